//! `--advise-subject`: the NATS subject the router answers advise requests
//! on, and the warning when a router of a non-default namespace keeps the
//! shared default (trial h42, 10: the subject was fixed, so routers of
//! different namespaces on one NATS server joined one queue group and
//! answered each other's requests, about half of them refused as `unknown
//! target engine`).

use kv_router_glue::service::{check_advise_subject, AdviseClientError, ADVISE_SUBJECT};

// A plain comment, not a doc comment: clap takes a flattened struct's doc
// comment for the command's `about`.
#[derive(clap::Args, Debug)]
pub(crate) struct AdviseArgs {
    /// NATS subject of the advise requests this router answers (queue
    /// group `kv_reuse_router`, shared by the routers on one subject); its
    /// callers must use the same (`RouterClient(subject=...)`). Routers of
    /// different `--namespace`s on one NATS server need one each, or each
    /// answers about half of the other's requests (`unknown target
    /// engine`). A NATS subject of at most 256 bytes, without wildcards
    /// (`*`, `>`), whitespace or empty tokens.
    #[arg(
        long,
        env = "KV_ROUTER_ADVISE_SUBJECT",
        value_name = "SUBJECT",
        default_value = ADVISE_SUBJECT,
        value_parser = advise_subject
    )]
    pub(crate) advise_subject: String,
}

/// `--advise-subject`'s check ([`check_advise_subject`], the rule the
/// callers' `RouterClient` applies), so a bad subject is a flag error
/// (exit 2 naming the flag) before any connection.
fn advise_subject(v: &str) -> Result<String, String> {
    match check_advise_subject(v) {
        Ok(()) => Ok(v.to_owned()),
        Err(AdviseClientError::Subject { reason, .. }) => Err(reason.to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Whether a router of `namespace` answering on `subject` shares the
/// default subject with the routers of every other namespace.
fn shares_the_default(namespace: &str, subject: &str) -> bool {
    namespace != "default" && subject == ADVISE_SUBJECT
}

/// Logs one warning at start when [`shares_the_default`].
pub(crate) fn warn_if_shared(namespace: &str, subject: &str) {
    if shares_the_default(namespace, subject) {
        // Display (`%`): both are checked tokens, without spaces or quotes.
        tracing::warn!(
            namespace = %namespace,
            subject = %subject,
            "the routers of every namespace on this NATS server answer `{ADVISE_SUBJECT}`: \
             a router of another namespace may take this namespace's advise requests \
             (refused as `unknown target engine`); give each namespace its own \
             `--advise-subject`, and its clients the same `subject=`"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::Cli;
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kv-reuse-router").chain(args.iter().copied()))
    }

    #[test]
    fn the_advise_subject_is_the_default_or_the_flag_and_a_bad_one_is_refused_naming_it() {
        if std::env::var_os("KV_ROUTER_ADVISE_SUBJECT").is_none() {
            assert_eq!(parse(&[]).unwrap().advise.advise_subject, ADVISE_SUBJECT);
        }
        for ok in ["kv_reuse.prod.advise", "advise", "kv-reuse.ns_1.advise"] {
            let cli = parse(&["--advise-subject", ok]).unwrap();
            assert_eq!(cli.advise.advise_subject, ok);
        }
        for (bad, why) in [
            ("kv_reuse.>", "wildcard"),
            ("kv_reuse.*.advise", "wildcard"),
            ("kv_reuse..advise", "empty token"),
            (".advise", "empty token"),
            ("", "empty"),
            ("kv reuse", "whitespace"),
        ] {
            let e = parse(&["--advise-subject", bad]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{e}");
            assert_eq!(e.exit_code(), 2);
            let text = e.to_string();
            assert!(text.contains("--advise-subject"), "{bad:?}: {text}");
            assert!(text.contains(why), "{bad:?}: {text}");
        }
    }

    #[test]
    fn only_a_non_default_namespace_on_the_default_subject_is_warned_about() {
        assert!(shares_the_default("prod", ADVISE_SUBJECT));
        assert!(!shares_the_default("default", ADVISE_SUBJECT));
        assert!(!shares_the_default("prod", "kv_reuse.prod.advise"));
        assert!(!shares_the_default("default", "kv_reuse.default.advise"));
    }
}
