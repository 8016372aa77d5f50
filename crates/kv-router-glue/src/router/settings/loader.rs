//! Layered loading (defaults < TOML < environment < CLI) and the origin of
//! every value.

use std::collections::BTreeMap;
use std::path::Path;

use super::{decode_value, known, parse_text, spec, ReuseArgs, ReuseSettings, SettingSpec};
use super::{SettingValue, ENV_PREFIX, SETTINGS};
use crate::SettingsError;

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettingOrigin {
    /// Built-in default.
    Default,
    /// A TOML file (path).
    File(String),
    /// An environment variable (name).
    Env(String),
    /// A CLI flag (as written).
    Cli(String),
}

impl std::fmt::Display for SettingOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingOrigin::Default => write!(f, "default"),
            SettingOrigin::File(p) => write!(f, "file {p}"),
            SettingOrigin::Env(v) => write!(f, "env {v}"),
            SettingOrigin::Cli(a) => write!(f, "cli {a}"),
        }
    }
}

/// The `KV_REUSE_*` variables captured once.
///
/// A loader reads only the snapshot, so a process that changes its
/// environment later (or a test running beside others) cannot change the
/// settings already in force or loaded from this snapshot.
///
/// ```
/// use kv_router_glue::{EnvSnapshot, SettingsLoader};
/// let env = EnvSnapshot::from_pairs([("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS", "8")]);
/// let loaded = SettingsLoader::new().env(&env).unwrap().build().unwrap();
/// assert_eq!(loaded.settings.minimum_transfer_prefix_blocks, 8);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvSnapshot {
    vars: BTreeMap<String, String>,
}

impl EnvSnapshot {
    /// Copies every process environment variable starting with [`ENV_PREFIX`]
    /// (non-UTF-8 values are kept lossily so that they fail validation by name).
    pub fn capture() -> Self {
        Self::from_pairs(
            std::env::vars_os()
                .filter_map(|(k, v)| {
                    Some((k.into_string().ok()?, v.to_string_lossy().into_owned()))
                })
                .filter(|(k, _)| k.starts_with(ENV_PREFIX)),
        )
    }

    /// A snapshot from explicit pairs; pairs without the prefix are dropped.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .filter(|(k, _)| k.starts_with(ENV_PREFIX))
                .collect(),
        }
    }

    /// Captured variables, sorted by name.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> {
        self.vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Settings after loading, with the origin of each key.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSettings {
    /// Validated settings.
    pub settings: ReuseSettings,
    /// Origin of every registered key.
    pub origins: BTreeMap<&'static str, SettingOrigin>,
}

impl LoadedSettings {
    /// The settings in force in registry order: `(key, value, unit,
    /// origin)`, the unit as registered (`-` for none).
    ///
    /// ```
    /// use kv_router_glue::{SettingOrigin, SettingsLoader};
    /// let loaded = SettingsLoader::new()
    ///     .toml_str("minimum_transfer_prefix_blocks = 6", "a.toml").unwrap()
    ///     .build().unwrap();
    /// let row = loaded.in_force().into_iter()
    ///     .find(|r| r.0 == "minimum_transfer_prefix_blocks").unwrap();
    /// assert_eq!((row.1.to_string().as_str(), row.2), ("6", "blocks"));
    /// assert_eq!(row.3, SettingOrigin::File("a.toml".into()));
    /// ```
    pub fn in_force(&self) -> Vec<(&'static str, SettingValue, &'static str, SettingOrigin)> {
        self.settings
            .entries()
            .into_iter()
            .map(|(key, value)| {
                let origin = self
                    .origins
                    .get(key)
                    .cloned()
                    .unwrap_or(SettingOrigin::Default);
                let unit = spec(key).map_or("-", |s| s.unit);
                (key, value, unit, origin)
            })
            .collect()
    }

    /// A table of the settings in force with their origins, one line per key.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for (key, value, unit, origin) in self.in_force() {
            // `SettingValue`'s Display ignores width: pad its text.
            let value = value.to_string();
            out.push_str(&format!("{key:<40} = {value:<10} {unit:<6} ({origin})\n"));
        }
        out
    }
}

/// Layered loader: defaults < TOML file < environment snapshot < CLI flags.
///
/// Each layer is parsed and range-checked when it is added (errors name the
/// key and the layer); cross-field rules run in [`SettingsLoader::build`].
///
/// ```
/// use kv_router_glue::{EnvSnapshot, SettingsLoader};
/// let loaded = SettingsLoader::new()
///     .toml_str("minimum_transfer_prefix_blocks = 6", "inline").unwrap()
///     .env(&EnvSnapshot::from_pairs([("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS", "7")])).unwrap()
///     .args(["--enable-decode-to-prefill-reuse", "--minimum-transfer-prefix-blocks=9"]).unwrap()
///     .build().unwrap();
/// assert!(loaded.settings.enable_decode_to_prefill_reuse);
/// assert_eq!(loaded.settings.minimum_transfer_prefix_blocks, 9);
/// ```
#[derive(Debug, Clone)]
pub struct SettingsLoader {
    settings: ReuseSettings,
    origins: BTreeMap<&'static str, SettingOrigin>,
}

impl Default for SettingsLoader {
    fn default() -> Self {
        Self::new()
    }
}

impl SettingsLoader {
    /// Starts from the defaults.
    pub fn new() -> Self {
        Self {
            settings: ReuseSettings::default(),
            origins: SETTINGS
                .iter()
                .map(|s| (s.key, SettingOrigin::Default))
                .collect(),
        }
    }

    fn put(&mut self, spec: &'static SettingSpec, v: SettingValue, origin: SettingOrigin) {
        (spec.set)(&mut self.settings, v);
        self.origins.insert(spec.key, origin);
    }

    /// Applies a TOML file of flat `key = value` pairs.
    ///
    /// # Errors
    /// [`SettingsError::Io`] if unreadable; otherwise as [`SettingsLoader::toml_str`].
    pub fn toml_file(self, path: impl AsRef<Path>) -> Result<Self, SettingsError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| SettingsError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        self.toml_str(&text, &path.display().to_string())
    }

    /// Applies TOML text; `name` is used in errors and origins.
    ///
    /// # Errors
    /// [`SettingsError::Toml`] for a syntax error,
    /// [`SettingsError::UnknownKey`] (naming `name`); [`SettingsError::InFile`]
    /// naming `name` around [`SettingsError::Removed`],
    /// [`SettingsError::InvalidValue`] (a nested table, a value of the
    /// wrong type) or [`SettingsError::OutOfRange`].
    pub fn toml_str(mut self, text: &str, name: &str) -> Result<Self, SettingsError> {
        let table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| SettingsError::Toml {
                    file: name.to_string(),
                    reason: match e.span() {
                        Some(span) => {
                            let (line, column) = line_column(text, span.start);
                            format!("line {line}, column {column}: {}", e.message())
                        }
                        None => e.message().to_string(),
                    },
                })?;
        let in_file = |e: SettingsError| match e {
            // These name the file already.
            SettingsError::UnknownKey { .. } | SettingsError::Toml { .. } => e,
            e => SettingsError::InFile {
                file: name.to_string(),
                error: Box::new(e),
            },
        };
        for (key, value) in table {
            let spec = known(&key, name).map_err(in_file)?;
            let shown = value.to_string();
            let v = decode_value(spec, value, &shown).map_err(in_file)?;
            self.put(spec, v, SettingOrigin::File(name.to_string()));
        }
        Ok(self)
    }

    /// Applies the captured `KV_REUSE_*` variables.
    ///
    /// # Errors
    /// [`SettingsError::UnknownKey`] for a prefixed variable naming no setting
    /// (a typo is never silently ignored), [`SettingsError::Removed`],
    /// [`SettingsError::InvalidValue`], [`SettingsError::OutOfRange`].
    pub fn env(mut self, env: &EnvSnapshot) -> Result<Self, SettingsError> {
        for (name, raw) in env.vars() {
            let key = name[ENV_PREFIX.len()..].to_ascii_lowercase();
            let spec = known(&key, name)?;
            let v = parse_text(spec, raw)?;
            self.put(spec, v, SettingOrigin::Env(name.to_string()));
        }
        Ok(self)
    }

    /// Applies setting flags, and nothing else: `--key value`, `--key=value`,
    /// or a bare `--key` for a boolean (true). Keys are exact, with dashes or
    /// underscores; a later flag overrides an earlier one. Parsed by clap with
    /// the arguments of [`ReuseArgs`] (environment variables are not read
    /// here: that is [`SettingsLoader::env`]'s layer, so precedence holds).
    ///
    /// A host with its own clap parser flattens [`ReuseArgs`] instead and
    /// passes the result to [`SettingsLoader::reuse_args`].
    ///
    /// # Errors
    /// [`SettingsError::UnknownKey`] for a flag that is not a key (a prefix
    /// included), [`SettingsError::Removed`], [`SettingsError::MissingValue`],
    /// [`SettingsError::UnexpectedArgument`] for a token that is not a flag,
    /// [`SettingsError::InvalidValue`], [`SettingsError::OutOfRange`].
    pub fn args<I, S>(self, args: I) -> Result<Self, SettingsError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_string()).collect();
        let parsed = ReuseArgs::parse_flags(&args)?;
        Ok(self.reuse_args(&parsed))
    }

    /// Applies what a clap parser read into [`ReuseArgs`] (flags, and the
    /// `KV_REUSE_*` variables clap reads for flags the command line lacks).
    /// Values were type- and range-checked while parsing.
    pub fn reuse_args(mut self, args: &ReuseArgs) -> Self {
        for (spec, v, origin) in args.values() {
            self.put(spec, *v, origin.clone());
        }
        self
    }

    /// The merged settings without cross-field validation (tests of single layers).
    #[cfg(test)]
    pub(crate) fn settings_unchecked(self) -> ReuseSettings {
        self.settings
    }

    /// Validates the merged settings.
    ///
    /// # Errors
    /// As [`ReuseSettings::validate`].
    pub fn build(self) -> Result<LoadedSettings, SettingsError> {
        self.settings.validate()?;
        Ok(LoadedSettings {
            settings: self.settings,
            origins: self.origins,
        })
    }
}

/// 1-based line and column (in characters) of byte `offset` of `text`, as
/// editors show them, so a TOML error points at the place to fix.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    // The parser's spans start on a character; `get` keeps a bad one from panicking.
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}
