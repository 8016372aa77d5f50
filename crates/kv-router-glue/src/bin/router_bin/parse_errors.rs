//! What the router says when clap refuses its command line, where clap's
//! own message falls short: a flag's value taken from its environment
//! variable (clap names only the flag), and a secret starting with `-`
//! given as a separate argument (clap takes it for flags and prints its
//! first characters).

use std::ffi::OsString;

use clap::CommandFactory;

use super::Cli;

/// The flags whose value may be a secret, with their variables: a value
/// of theirs is never printed.
const SECRET_FLAGS: [(&str, &str); 3] = [
    ("--nats-url", "KV_ROUTER_NATS_URL"),
    ("--nats-password", "KV_ROUTER_NATS_PASSWORD"),
    ("--nats-token", "KV_ROUTER_NATS_TOKEN"),
];

/// The message to print instead of clap's for `err`, refused on `args`;
/// `None` to let clap print its own.
pub(super) fn explain(err: &clap::Error, args: &[OsString]) -> Option<String> {
    if let Some((flag, var)) = hyphen_secret(args) {
        return Some(format!(
            "kv-reuse-router: error: the argument after '{flag}' starts with `-`, so it is taken \
             for a flag (not shown: it may be a secret); write a value starting with `-` as \
             '{flag}=VALUE', or give it through {var}\n"
        ));
    }
    let var = env_source(err, args)?;
    // clap's text ("error: invalid value 'x' for '--flag'") names the
    // flag; say the variable it was read from.
    Some(format!(
        "kv-reuse-router: `{var}` (environment variable): {err}"
    ))
}

/// A secret flag followed by an argument starting with `-` (trial h42,
/// 2: `--nats-token -XsecTOK123` was refused as `unexpected argument '-X'
/// found`, showing the token's first characters and not how to pass it).
/// Such a command line never parses (the command allows only negative
/// numbers as values), so the refusal is about it. A number is left out:
/// clap takes it as the value.
fn hyphen_secret(args: &[OsString]) -> Option<(&'static str, &'static str)> {
    args.windows(2).find_map(|pair| {
        let (flag, var) = SECRET_FLAGS.iter().find(|(f, _)| pair[0] == *f)?;
        let next = pair[1].to_string_lossy();
        // Digits with at most one `.`, as clap's negative-number check:
        // Rust's float parser also takes `-inf`, `-nan` and `-.5`, which
        // clap refuses, printing their first characters (trial h47).
        let body = next.strip_prefix('-').unwrap_or("");
        let number = body.bytes().any(|b| b.is_ascii_digit())
            && body.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            && body.bytes().filter(|&b| b == b'.').count() <= 1
            && !body.starts_with('.');
        (next.starts_with('-') && !number).then_some((*flag, *var))
    })
}

/// The environment variable `err` (clap's refusal of a flag's value) came
/// from, when it came from one: an `env`-backed flag that the message names,
/// absent from the command line, whose variable is set. clap's own message
/// names only the flag (trial h33, nit 6). Found from the message, because
/// the value parsers' own errors (`--nats-url`'s) carry no context.
fn env_source(err: &clap::Error, args: &[OsString]) -> Option<String> {
    let shown = err.to_string();
    let cmd = Cli::command();
    let var = cmd.get_arguments().find_map(|arg| {
        let long = arg.get_long()?;
        let var = arg.get_env()?.to_str()?;
        let flag = format!("--{long}");
        // `'--nats-url'` or `'--nats-url <NATS_URL>'`: not a longer flag.
        let named = shown.contains(&format!("'{flag}'")) || shown.contains(&format!("'{flag} "));
        let on_command_line = args.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == flag || a.starts_with(&format!("{flag}=")))
        });
        (named && !on_command_line && std::env::var_os(var).is_some()).then(|| var.to_string())
    });
    var
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(list: &[&str]) -> Vec<OsString> {
        std::iter::once("kv-reuse-router")
            .chain(list.iter().copied())
            .map(OsString::from)
            .collect()
    }

    #[test]
    fn a_secret_starting_with_a_hyphen_is_explained_without_its_text() {
        for (list, flag, var) in [
            (
                &["--nats-token", "-XsecTOK123"][..],
                "--nats-token",
                "KV_ROUTER_NATS_TOKEN",
            ),
            (
                &["--nats-user", "r", "--nats-password", "-pSECRET"][..],
                "--nats-password",
                "KV_ROUTER_NATS_PASSWORD",
            ),
            (
                &["--nats-url", "-tok@127.0.0.1:1"][..],
                "--nats-url",
                "KV_ROUTER_NATS_URL",
            ),
            (
                &["--nats-token", "--metrics-addr", "x"][..],
                "--nats-token",
                "KV_ROUTER_NATS_TOKEN",
            ),
            // Numbers to Rust's float parser, not to clap (trial h47).
            (
                &["--nats-token", "-inf"][..],
                "--nats-token",
                "KV_ROUTER_NATS_TOKEN",
            ),
            (
                &["--nats-token", "-nan"][..],
                "--nats-token",
                "KV_ROUTER_NATS_TOKEN",
            ),
            (
                &["--nats-token", "-.5"][..],
                "--nats-token",
                "KV_ROUTER_NATS_TOKEN",
            ),
        ] {
            let a = args(list);
            let e = Cli::try_parse_from(&a).expect_err("clap refuses it");
            let text = explain(&e, &a).expect("explained");
            assert_eq!(
                text,
                format!(
                    "kv-reuse-router: error: the argument after '{flag}' starts with `-`, so it \
                     is taken for a flag (not shown: it may be a secret); write a value starting \
                     with `-` as '{flag}=VALUE', or give it through {var}\n"
                )
            );
            assert!(!text.contains("SEC") && !text.contains("-X") && !text.contains("tok@"));
        }
        // Written with `=`, the value is taken as it is.
        let cli = Cli::try_parse_from(args(&["--nats-token=-XsecTOK123"])).unwrap();
        assert_eq!(cli.nats_token.as_deref(), Some("-XsecTOK123"));
        // A negative number is a value for clap: nothing to explain.
        assert_eq!(hyphen_secret(&args(&["--nats-token", "-5"])), None);
        assert_eq!(hyphen_secret(&args(&["--nats-token", "-2.5"])), None);
        assert_eq!(hyphen_secret(&args(&["--max-probes", "-5"])), None);
    }
}
