//! The checks clap runs on single flag values (`value_parser`), so that a
//! refusal names the flag: NATS URLs, subject tokens, bucket names and the
//! inbox prefix.

use kv_router_glue::announce_subject;

/// `--nats-inbox-prefix`'s check (clap names the flag in the error).
pub(super) fn inbox_prefix(v: &str) -> Result<String, String> {
    match kv_router_glue::inbox_prefix_problem(v) {
        None => Ok(v.to_owned()),
        Some(why) => Err(why.to_owned()),
    }
}

/// `--nats-url`'s check, by async-nats' own parser of the value it is
/// given, so a malformed URL is a flag error (exit 2 naming the flag)
/// before any connection rather than a failed connection (exit 1).
/// `--nats-url`'s parser: [`nats_url`], with the refused value shown with
/// its password replaced by `***` (clap's own "invalid value" message
/// repeats the value as given, password included; helper-20 finding 26).
#[derive(Clone, Copy, Debug)]
pub(super) struct NatsUrlParser;

impl clap::builder::TypedValueParser for NatsUrlParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        use clap::error::ErrorKind;
        let flag = arg.map_or_else(|| "--nats-url".to_string(), |a| a.to_string());
        let Some(v) = value.to_str() else {
            return Err(clap::Error::raw(
                ErrorKind::InvalidUtf8,
                format!("invalid UTF-8 in the value of '{flag}'\n"),
            )
            .with_cmd(cmd));
        };
        nats_url(v).map_err(|reason| {
            clap::Error::raw(
                ErrorKind::ValueValidation,
                format!(
                    "invalid value '{}' for '{flag}': {reason}\n",
                    kv_router_glue::redact_url(v)
                ),
            )
            .with_cmd(cmd)
        })
    }
}

pub(super) fn nats_url(v: &str) -> Result<String, String> {
    kv_router_glue::nats_server_addrs(v).map(|_| v.to_owned())
}

/// `--namespace`'s check, by the rule of the subjects built from it
/// (`kv.<ns>.workers.announce`, `kv.<ns>.inventory.<engine>`), so a bad
/// token is a flag error before any connection.
pub(super) fn namespace_token(v: &str) -> Result<String, String> {
    announce_subject(v).map(|_| v.to_owned()).map_err(|_| {
        "must be one NATS subject token: non-empty, without `.`, `*`, `>` or whitespace".to_owned()
    })
}

/// `--directory-bucket`'s check (NATS key-value bucket names).
pub(super) fn bucket_name(v: &str) -> Result<String, String> {
    match kv_router_glue::bucket_name_problem(v) {
        None => Ok(v.to_owned()),
        Some(why) => Err(why.to_owned()),
    }
}
