//! `KV_ROUTER_*` environment variables: one the router does not read is
//! refused at start (exit 2, naming it and the closest one it reads), as
//! an unknown `KV_REUSE_*` is (`unknown setting`). A typo was silently
//! ignored before (trial h44, 10: `KV_ROUTER_ADVISE_SUBJET=kv_reuse.prod.advise`
//! left the router on the default subject, splitting a namespace's advise
//! requests with no error).
//!
//! The names read are the flags' own `env` attributes, taken from clap's
//! command ([`known`]), and [`LOG_VAR`], the one variable read outside
//! clap: a flag added with an `env` is known without a list to update.

use std::ffi::OsString;

/// The prefix this check owns.
pub(crate) const PREFIX: &str = "KV_ROUTER_";

/// The log filter's variable, read by `main` itself (tracing-subscriber
/// syntax), not through a flag.
pub(crate) const LOG_VAR: &str = "KV_ROUTER_LOG";

/// Why the environment was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EnvNameError {
    /// A `KV_ROUTER_*` variable the router does not read.
    #[error(
        "`{name}` (environment variable) is not a variable kv-reuse-router reads \
         (did you mean `{closest}`?); it reads {}",
        known.join(", ")
    )]
    Unknown {
        /// The variable set (lossily decoded when not UTF-8).
        name: String,
        /// The known name closest to it (fewest single-character edits).
        closest: String,
        /// Every `KV_ROUTER_*` variable the router reads, sorted.
        known: Vec<String>,
    },
    /// A `KV_ROUTER_*` name made from a flag that has no variable
    /// (`KV_ROUTER_NAMESPACE` for `--namespace`): "did you mean" pointed at
    /// an unrelated variable (trial h47).
    #[error(
        "`{name}` (environment variable) is not read: `--{flag}` has no environment \
         variable; pass the flag"
    )]
    FlagOnly {
        /// The variable set.
        name: String,
        /// The flag's long name, without `--`.
        flag: String,
    },
}

/// The long names of `cmd`'s flags that have no `env` (the ones an
/// operator may guess a `KV_ROUTER_*` name for).
pub(crate) fn flags_without_env(cmd: &clap::Command) -> Vec<String> {
    cmd.get_arguments()
        .filter(|a| a.get_env().is_none())
        .filter_map(|a| a.get_long().map(str::to_owned))
        .collect()
}

/// Every `KV_ROUTER_*` variable the router reads: the `env` of each of
/// `cmd`'s arguments under [`PREFIX`] (the `KV_REUSE_*` ones are the
/// settings loader's), and [`LOG_VAR`]; sorted.
pub(crate) fn known(cmd: &clap::Command) -> Vec<String> {
    let mut names: Vec<String> = cmd
        .get_arguments()
        .filter_map(|a| a.get_env()?.to_str())
        .filter(|v| v.starts_with(PREFIX))
        .map(str::to_owned)
        .chain([LOG_VAR.to_owned()])
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Refuses the first of `names` (the environment's variable names, in
/// their order) that starts with [`PREFIX`] and is not in `known`.
///
/// # Errors
/// [`EnvNameError::FlagOnly`] when it is a flag of `flags_without_env`
/// spelled as a variable, else [`EnvNameError::Unknown`] naming it and the
/// closest known name.
pub(crate) fn check(
    names: impl IntoIterator<Item = OsString>,
    known: &[String],
    flags_without_env: &[String],
) -> Result<(), EnvNameError> {
    for name in names {
        let name = name.to_string_lossy();
        if !name.starts_with(PREFIX) || known.iter().any(|k| *k == name) {
            continue;
        }
        let as_flag = name[PREFIX.len()..].to_ascii_lowercase().replace('_', "-");
        if let Some(flag) = flags_without_env.iter().find(|f| **f == as_flag) {
            return Err(EnvNameError::FlagOnly {
                name: name.into_owned(),
                flag: flag.clone(),
            });
        }
        let closest = known
            .iter()
            .min_by_key(|k| edits(&name, k))
            .cloned()
            .unwrap_or_else(|| LOG_VAR.to_owned());
        return Err(EnvNameError::Unknown {
            name: name.into_owned(),
            closest,
            known: known.to_vec(),
        });
    }
    Ok(())
}

/// Levenshtein distance: insertions, deletions and substitutions of one
/// character each.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    // `row[j]`: the distance between the prefix of `a` seen so far and
    // `b[..j]`.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(above + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::super::Cli;
    use super::*;
    use clap::CommandFactory;

    fn os(names: &[&str]) -> Vec<OsString> {
        names.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_known_names_are_the_flags_env_and_the_log_filter() {
        assert_eq!(
            known(&Cli::command()),
            [
                "KV_ROUTER_ADVISE_SUBJECT",
                "KV_ROUTER_LOG",
                "KV_ROUTER_NATS_INBOX_PREFIX",
                "KV_ROUTER_NATS_PASSWORD",
                "KV_ROUTER_NATS_TOKEN",
                "KV_ROUTER_NATS_URL",
                "KV_ROUTER_NATS_USER",
            ]
        );
    }

    #[test]
    fn an_unknown_kv_router_name_is_refused_naming_the_closest_known_one() {
        let known = known(&Cli::command());
        let ok = os(&[
            "PATH",
            "KV_REUSE_X",
            "KV_ROUTER_LOG",
            "KV_ROUTERX",
            "kv_router_log",
        ]);
        assert_eq!(check(ok, &known, &[]), Ok(()));
        for (typo, closest) in [
            ("KV_ROUTER_ADVISE_SUBJET", "KV_ROUTER_ADVISE_SUBJECT"),
            ("KV_ROUTER_NATS_PASWORD", "KV_ROUTER_NATS_PASSWORD"),
            ("KV_ROUTER_LOGS", "KV_ROUTER_LOG"),
            ("KV_ROUTER_NATS_URLS", "KV_ROUTER_NATS_URL"),
            ("KV_ROUTER_", "KV_ROUTER_LOG"),
        ] {
            let e = check(os(&["HOME", typo, "KV_ROUTER_ZZZ"]), &known, &[]).unwrap_err();
            let EnvNameError::Unknown {
                name,
                closest: got,
                known: listed,
            } = &e
            else {
                panic!("{e:?}");
            };
            assert_eq!((name.as_str(), got.as_str()), (typo, closest));
            assert_eq!(listed, &known);
            let shown = e.to_string();
            assert!(
                shown.starts_with(&format!("`{typo}` (environment variable) is not"))
                    && shown.contains(&format!("did you mean `{closest}`?"))
                    && shown.contains("KV_ROUTER_NATS_INBOX_PREFIX"),
                "{shown}"
            );
        }
    }

    /// Trial h47: `KV_ROUTER_NAMESPACE` suggested `KV_ROUTER_NATS_URL`;
    /// `--namespace` has no variable, and the error says so.
    #[test]
    fn a_flag_spelled_as_a_variable_is_named_as_a_flag_without_one() {
        let cmd = Cli::command();
        let flags = flags_without_env(&cmd);
        assert!(flags.iter().any(|f| f == "namespace"), "{flags:?}");
        assert!(!flags.iter().any(|f| f == "nats-url"), "{flags:?}");
        for (name, flag) in [
            ("KV_ROUTER_NAMESPACE", "namespace"),
            ("KV_ROUTER_METRICS_ADDR", "metrics-addr"),
        ] {
            let e = check(os(&[name]), &known(&cmd), &flags).unwrap_err();
            assert_eq!(
                e,
                EnvNameError::FlagOnly {
                    name: name.into(),
                    flag: flag.into()
                }
            );
            assert!(e
                .to_string()
                .contains(&format!("`--{flag}` has no environment variable")));
        }
    }

    #[test]
    fn edits_count_insertions_deletions_and_substitutions() {
        assert_eq!(edits("", ""), 0);
        assert_eq!(edits("abc", "abc"), 0);
        assert_eq!(edits("SUBJET", "SUBJECT"), 1);
        assert_eq!(edits("kitten", "sitting"), 3);
        assert_eq!(edits("", "LOG"), 3);
        assert_eq!(edits("flaw", "lawn"), 2);
    }
}
