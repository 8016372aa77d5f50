//! The reuse settings as clap arguments, built from the registry, so a host
//! flattens them into its own parser (`#[command(flatten)]`) and
//! [`SettingsLoader::args`](super::SettingsLoader::args) parses the same way.
//!
//! Invariant: one clap argument per registered setting (id = key, long flag =
//! key with dashes, hidden alias = key with underscores, env `KV_REUSE_<KEY>`,
//! value parser = the registry's own text parser with its range check), plus
//! one hidden argument per removed key whose every use is refused with the
//! removal's explanation. No prefix inference: that is the host's
//! `Command::infer_long_args`, which it must leave off.

use std::sync::LazyLock;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

use super::{parse_text, spec, SettingKind, SettingOrigin, SettingSpec, SettingValue};
use super::{ENV_PREFIX, REMOVED_SETTINGS, SETTINGS};
use crate::SettingsError;

/// What a clap parser read for the reuse settings: the flags given and, for
/// flags the command line lacks, the `KV_REUSE_*` variables clap reads.
/// Values are already type- and range-checked. Hand it to
/// [`SettingsLoader::reuse_args`](super::SettingsLoader::reuse_args).
///
/// Booleans: a bare `--key` means true; `--key=false` or `--key false`
/// gives the value (so a bare boolean flag must not be followed by a
/// positional argument of the host: write `--key=true` there).
///
/// ```
/// use clap::Parser;
/// use kv_router_glue::{ReuseArgs, SettingsLoader};
///
/// #[derive(Parser, Debug)]
/// struct Cli {
///     /// The host's own flag.
///     #[arg(long)]
///     port: u16,
///     #[command(flatten)]
///     reuse: ReuseArgs,
/// }
///
/// let cli = Cli::try_parse_from([
///     "serve", "--port", "8000",
///     "--enable-decode-to-prefill-reuse",
///     "--minimum-transfer-prefix-blocks=8",
/// ]).unwrap();
/// assert_eq!(cli.port, 8000);
/// let loaded = SettingsLoader::new().reuse_args(&cli.reuse).build().unwrap();
/// assert!(loaded.settings.enable_decode_to_prefill_reuse);
/// assert_eq!(loaded.settings.minimum_transfer_prefix_blocks, 8);
///
/// // A removed key is refused with its explanation, an unknown one by clap.
/// let e = Cli::try_parse_from(["serve", "--port=1", "--transfer-source-force"]).unwrap_err();
/// assert!(e.to_string().contains("it was removed"), "{e}");
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReuseArgs {
    values: Vec<(&'static str, SettingValue, SettingOrigin)>,
}

/// `(long flag, env variable)` of every registered setting, in registry
/// order; clap keeps `&'static str`s, so they are made once.
static NAMES: LazyLock<Vec<(String, String)>> = LazyLock::new(|| {
    SETTINGS
        .iter()
        .map(|s| {
            (
                s.key.replace('_', "-"),
                format!("{ENV_PREFIX}{}", s.key.to_ascii_uppercase()),
            )
        })
        .collect()
});

/// Long flags of the removed keys, in [`REMOVED_SETTINGS`] order.
static REMOVED_FLAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
    REMOVED_SETTINGS
        .iter()
        .map(|(k, _)| k.replace('_', "-"))
        .collect()
});

/// Help heading of the reuse flags in a host's `--help`.
const HEADING: &str = "Decode-to-prefill KV reuse";

fn setting_arg(
    spec: &'static SettingSpec,
    (long, env): &'static (String, String),
    with_env: bool,
) -> Arg {
    let value_name = match (spec.kind, spec.unit) {
        (SettingKind::Bool, _) => "BOOL",
        (SettingKind::U32 { .. }, _) => "N",
        (_, "ms") => "MS",
        (_, "µs") => "US",
        _ => "VALUE",
    };
    let mut arg = Arg::new(spec.key)
        .long(long.as_str())
        .alias(spec.key)
        .value_name(value_name)
        .action(ArgAction::Set)
        .help_heading(HEADING)
        .help(spec.doc)
        .long_help(format!(
            "{} Unit {}, default {}, range {}.",
            spec.doc,
            spec.unit,
            spec.default,
            spec.kind.range_text()
        ))
        .value_parser(move |s: &str| parse_text(spec, s));
    arg = match spec.kind {
        SettingKind::Bool => arg.num_args(0..=1).default_missing_value("true"),
        _ => arg.num_args(1).allow_negative_numbers(true),
    };
    if with_env {
        arg = arg.env(env.as_str());
    }
    arg
}

fn removed_arg(key: &'static str, why: &'static str, long: &'static str) -> Arg {
    Arg::new(key)
        .long(long)
        .alias(key)
        .hide(true)
        .num_args(0..=1)
        .default_missing_value("")
        .value_parser(move |_: &str| -> Result<String, SettingsError> {
            Err(SettingsError::Removed {
                key: key.to_string(),
                reason: why,
            })
        })
}

fn add_arguments(mut cmd: Command, with_env: bool) -> Command {
    for (spec, names) in SETTINGS.iter().zip(NAMES.iter()) {
        cmd = cmd.arg(setting_arg(spec, names, with_env));
    }
    for ((key, why), long) in REMOVED_SETTINGS.iter().zip(REMOVED_FLAGS.iter()) {
        cmd = cmd.arg(removed_arg(key, why, long));
    }
    cmd
}

impl ReuseArgs {
    /// Every setting this parse set, with its origin (`Cli("--key")` or
    /// `Env("KV_REUSE_KEY")`), in registry order.
    pub fn values(
        &self,
    ) -> impl Iterator<Item = (&'static SettingSpec, &SettingValue, &SettingOrigin)> {
        self.values
            .iter()
            .map(|(k, v, o)| (spec(k).expect("keys come from the registry"), v, o))
    }

    /// Parses setting flags only (no binary name, no environment), mapping
    /// clap's errors to [`SettingsError`]. The origin of each value is its
    /// last flag as written.
    pub(crate) fn parse_flags(args: &[String]) -> Result<Self, SettingsError> {
        let cmd = add_arguments(
            Command::new("reuse-settings")
                .no_binary_name(true)
                .args_override_self(true)
                .disable_help_flag(true)
                .disable_version_flag(true),
            false,
        );
        let matches = cmd.try_get_matches_from(args).map_err(|e| from_clap(&e))?;
        let mut parsed = Self::from_arg_matches(&matches).map_err(|e| from_clap(&e))?;
        for (key, _, origin) in &mut parsed.values {
            if let Some(written) = args
                .iter()
                .rev()
                .find(|a| flag_key(a).as_deref() == Some(key))
            {
                *origin = SettingOrigin::Cli(written.clone());
            }
        }
        Ok(parsed)
    }
}

/// The registry key a `--flag[=value]` token names, if it is a flag.
fn flag_key(token: &str) -> Option<String> {
    let body = token.strip_prefix("--")?;
    let name = body.split_once('=').map_or(body, |(n, _)| n);
    Some(name.replace('-', "_"))
}

/// Maps a clap error of [`ReuseArgs::parse_flags`] to the typed error.
fn from_clap(e: &clap::Error) -> SettingsError {
    if let Some(ours) = std::error::Error::source(e).and_then(|s| s.downcast_ref::<SettingsError>())
    {
        return ours.clone();
    }
    let invalid = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    match e.kind() {
        ErrorKind::UnknownArgument if invalid.starts_with("--") => {
            let body = &invalid[2..];
            SettingsError::UnknownKey {
                key: body.split_once('=').map_or(body, |(n, _)| n).to_string(),
                origin: "cli".into(),
            }
        }
        ErrorKind::InvalidValue | ErrorKind::WrongNumberOfValues => {
            // The context names the argument as `--key-with-dashes <N>`.
            let flag = invalid.split_whitespace().next().unwrap_or_default();
            match flag_key(flag).as_deref().and_then(spec) {
                Some(spec) => SettingsError::MissingValue { key: spec.key },
                None => SettingsError::UnexpectedArgument { arg: e.to_string() },
            }
        }
        _ if !invalid.is_empty() => SettingsError::UnexpectedArgument { arg: invalid },
        _ => SettingsError::UnexpectedArgument {
            arg: e.render().to_string().trim().to_string(),
        },
    }
}

impl Args for ReuseArgs {
    fn augment_args(cmd: Command) -> Command {
        add_arguments(cmd, true)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        add_arguments(cmd, true)
    }
}

impl FromArgMatches for ReuseArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut values = Vec::new();
        for (spec, (long, env)) in SETTINGS.iter().zip(NAMES.iter()) {
            let origin = match m.value_source(spec.key) {
                Some(ValueSource::CommandLine) => SettingOrigin::Cli(format!("--{long}")),
                Some(ValueSource::EnvVariable) => SettingOrigin::Env(env.clone()),
                _ => continue,
            };
            let v = m
                .try_get_one::<SettingValue>(spec.key)
                .map_err(|e| clap::Error::raw(ErrorKind::ArgumentConflict, e))?;
            if let Some(v) = v {
                values.push((spec.key, *v, origin));
            }
        }
        Ok(Self { values })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        let newer = Self::from_arg_matches(m)?;
        self.values
            .retain(|(k, _, _)| !newer.values.iter().any(|(n, _, _)| n == k));
        self.values.extend(newer.values);
        Ok(())
    }
}
