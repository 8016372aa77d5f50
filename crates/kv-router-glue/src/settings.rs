//! The eight reuse settings, their single registry, and their loaders.
//!
//! Every setting is declared once, in [`SETTINGS`]. The CLI parser, the
//! environment loader, the TOML loader, the JSON round trip, range checks and
//! the operator table in `docs/settings.md` ([`settings_markdown`]) are all
//! driven by that registry; a test fails if [`ReuseSettings`] grows a field
//! that the registry does not list.
//!
//! Precedence when layering with [`SettingsLoader`]: defaults < TOML file <
//! environment snapshot < CLI flags. Validation (ranges and cross-field rules)
//! runs once on the merged result, so a half-applied configuration is never
//! returned.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::SettingsError;

/// Prefix of every environment variable read by [`EnvSnapshot`]:
/// `KV_REUSE_<KEY IN UPPER CASE>`, e.g. `KV_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE`.
pub const ENV_PREFIX: &str = "KV_REUSE_";

/// Decode-to-prefill reuse settings, as used by the cost model and the advisor.
///
/// All off by default: [`ReuseSettings::default`] never fetches anything.
/// Units are in the field names (`_ms`, `_us`); every field is described in
/// [`SETTINGS`] and in `docs/settings.md`.
///
/// ```
/// use kv_router_glue::ReuseSettings;
/// let s = ReuseSettings::default();
/// assert!(!s.enable_decode_to_prefill_reuse);
/// let json = s.to_json().unwrap();
/// assert_eq!(ReuseSettings::from_json(&json).unwrap(), s);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReuseSettings {
    /// Master switch: route requests with a fetch hint when admitted.
    pub enable_decode_to_prefill_reuse: bool,
    /// Allow the GPU-direct path (CUDA IPC / NVLink / NIXL VRAM). Requires the master switch.
    pub enable_decode_to_prefill_gpu_reuse: bool,
    /// Smallest estimated TTFT saving, in ms, for which a fetch is admitted.
    pub minimum_estimated_ttft_saving_ms: f64,
    /// Smallest number of blocks worth fetching.
    pub minimum_transfer_prefix_blocks: u32,
    /// Estimated cost of moving one block over the host path (shared memory, NIXL DRAM), in µs.
    pub transfer_source_estimated_block_us: f64,
    /// Estimated cost of moving one block over the GPU path, in µs.
    pub transfer_source_gpu_estimated_block_us: f64,
    /// Time budget of one donor lookup, in ms.
    pub transfer_source_lookup_budget_ms: f64,
    /// Estimated prefill (recompute) cost of one token, in µs.
    pub transfer_source_prefill_token_us: f64,
}

impl Default for ReuseSettings {
    fn default() -> Self {
        let mut s = Self {
            enable_decode_to_prefill_reuse: false,
            enable_decode_to_prefill_gpu_reuse: false,
            minimum_estimated_ttft_saving_ms: 0.0,
            minimum_transfer_prefix_blocks: 0,
            transfer_source_estimated_block_us: 0.0,
            transfer_source_gpu_estimated_block_us: 0.0,
            transfer_source_lookup_budget_ms: 0.0,
            transfer_source_prefill_token_us: 0.0,
        };
        for spec in SETTINGS {
            (spec.set)(&mut s, spec.default);
        }
        s
    }
}

/// A setting's value, typed by its [`SettingKind`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SettingValue {
    /// A boolean switch.
    Bool(bool),
    /// A non-negative integer count.
    U32(u32),
    /// A finite real number in the setting's unit.
    F64(f64),
}

impl std::fmt::Display for SettingValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingValue::Bool(b) => write!(f, "{b}"),
            SettingValue::U32(v) => write!(f, "{v}"),
            SettingValue::F64(v) => write!(f, "{v}"),
        }
    }
}

/// Type and allowed range of a setting (ranges inclusive).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SettingKind {
    /// `true` / `false`.
    Bool,
    /// Integer in `min..=max`.
    U32 {
        /// Smallest allowed value.
        min: u32,
        /// Largest allowed value.
        max: u32,
    },
    /// Finite real in `min..=max`.
    F64 {
        /// Smallest allowed value.
        min: f64,
        /// Largest allowed value.
        max: f64,
    },
}

impl SettingKind {
    fn range_text(&self) -> String {
        match self {
            SettingKind::Bool => "true / false (also 1 / 0, yes / no, on / off)".into(),
            SettingKind::U32 { min, max } => format!("{min} ..= {max}"),
            SettingKind::F64 { min, max } => format!("{min} ..= {max}"),
        }
    }
}

/// One registered setting: its key, type, range, unit, default and meaning.
pub struct SettingSpec {
    /// Canonical key (snake case). CLI flag `--<key with dashes>`, env `KV_REUSE_<KEY>`.
    pub key: &'static str,
    /// Type and range.
    pub kind: SettingKind,
    /// Unit for the docs table (`ms`, `µs`, `blocks`, `-`).
    pub unit: &'static str,
    /// Default value.
    pub default: SettingValue,
    /// One-line meaning, including where the default comes from.
    pub doc: &'static str,
    /// Reads the field.
    pub get: fn(&ReuseSettings) -> SettingValue,
    /// Writes the field (the value has already been type- and range-checked).
    pub set: fn(&mut ReuseSettings, SettingValue),
}

impl std::fmt::Debug for SettingSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettingSpec")
            .field("key", &self.key)
            .field("kind", &self.kind)
            .finish()
    }
}

macro_rules! setting {
    ($key:ident, $kind:expr, $unit:expr, $default:expr, $doc:expr, $variant:ident) => {
        SettingSpec {
            key: stringify!($key),
            kind: $kind,
            unit: $unit,
            default: SettingValue::$variant($default),
            doc: $doc,
            get: |s| SettingValue::$variant(s.$key),
            set: |s, v| {
                if let SettingValue::$variant(v) = v {
                    s.$key = v;
                }
            },
        }
    };
}

/// Block-count bound, equal to the largest fetch a hint may carry.
const MAX_BLOCKS: u32 = kv_descriptor::MAX_HINT_BLOCKS as u32;

/// The registry: every reuse setting, in documentation order.
pub static SETTINGS: &[SettingSpec] =
    &[
        setting!(
            enable_decode_to_prefill_reuse,
            SettingKind::Bool,
            "-",
            false,
            "Master switch. Off: no lookup, no hint, every prefill recomputes.",
            Bool
        ),
        setting!(
            enable_decode_to_prefill_gpu_reuse,
            SettingKind::Bool,
            "-",
            false,
            "Allow the GPU-direct path (CUDA IPC / NVLink / NIXL VRAM). Needs the master switch; \
         off: only host-memory donors are used.",
            Bool
        ),
        setting!(
            minimum_estimated_ttft_saving_ms,
            SettingKind::F64 {
                min: 0.0,
                max: 60_000.0
            },
            "ms",
            2.0,
            "Admit a fetch only when the estimated TTFT saving is at least this.",
            F64
        ),
        setting!(
            minimum_transfer_prefix_blocks,
            SettingKind::U32 {
                min: 1,
                max: MAX_BLOCKS
            },
            "blocks",
            4,
            "Admit a fetch only when it moves at least this many blocks.",
            U32
        ),
        setting!(
            transfer_source_estimated_block_us,
            SettingKind::F64 {
                min: 0.001,
                max: 1_000_000.0
            },
            "µs",
            400.0,
            "Estimated cost of one block over the host path (2 MiB block at ~5 GB/s host copy).",
            F64
        ),
        setting!(
        transfer_source_gpu_estimated_block_us,
        SettingKind::F64 { min: 0.001, max: 1_000_000.0 },
        "µs",
        25.0,
        "Estimated cost of one block over the GPU path (ANCHORS: 2 MiB at ~90 GB/s NIXL per-block \
         descriptors; the CUDA IPC gather path is faster).",
        F64
    ),
        setting!(
            transfer_source_lookup_budget_ms,
            SettingKind::F64 {
                min: 0.01,
                max: 1_000.0
            },
            "ms",
            1.0,
            "Time budget of one donor lookup; the lookup stops and reports no donor when spent.",
            F64
        ),
        setting!(
        transfer_source_prefill_token_us,
        SettingKind::F64 { min: 0.001, max: 100_000.0 },
        "µs",
        30.0,
        "Estimated recompute cost of one token (ANCHORS: 30-43 µs/token for an 8B model on H200; \
         the low end keeps the estimate conservative).",
        F64
    ),
    ];

/// Keys that existed once and are refused with an explanation, never ignored.
pub static REMOVED_SETTINGS: &[(&str, &str)] = &[
    (
        "decode_to_prefill_reuse_mode",
        "reuse modes were removed; use enable_decode_to_prefill_reuse and let the cost model admit",
    ),
    (
        "transfer_source_force",
        "forced reuse bypassed admission and could make TTFT worse; it was removed",
    ),
    (
        "transfer_source_cpu_estimated_block_us",
        "renamed to transfer_source_estimated_block_us",
    ),
];

/// Looks up a registered setting by canonical key.
pub fn spec(key: &str) -> Option<&'static SettingSpec> {
    SETTINGS.iter().find(|s| s.key == key)
}

fn check_removed(key: &str) -> Result<(), SettingsError> {
    if let Some((k, why)) = REMOVED_SETTINGS.iter().find(|(k, _)| *k == key) {
        return Err(SettingsError::Removed {
            key: (*k).to_string(),
            reason: why,
        });
    }
    Ok(())
}

fn known(key: &str, origin: &str) -> Result<&'static SettingSpec, SettingsError> {
    check_removed(key)?;
    spec(key).ok_or_else(|| SettingsError::UnknownKey {
        key: key.to_string(),
        origin: origin.to_string(),
    })
}

fn check_range(spec: &SettingSpec, v: SettingValue) -> Result<SettingValue, SettingsError> {
    let ok = match (spec.kind, v) {
        (SettingKind::Bool, SettingValue::Bool(_)) => true,
        (SettingKind::U32 { min, max }, SettingValue::U32(x)) => (min..=max).contains(&x),
        (SettingKind::F64 { min, max }, SettingValue::F64(x)) => {
            x.is_finite() && x >= min && x <= max
        }
        _ => {
            return Err(SettingsError::InvalidValue {
                key: spec.key,
                value: v.to_string(),
                expected: spec.kind.range_text(),
            })
        }
    };
    if ok {
        Ok(v)
    } else {
        Err(SettingsError::OutOfRange {
            key: spec.key,
            value: v.to_string(),
            range: spec.kind.range_text(),
        })
    }
}

/// Parses a textual value (CLI, environment) for `spec`, with range check.
fn parse_text(spec: &SettingSpec, raw: &str) -> Result<SettingValue, SettingsError> {
    let bad = || SettingsError::InvalidValue {
        key: spec.key,
        value: raw.to_string(),
        expected: spec.kind.range_text(),
    };
    let t = raw.trim();
    let v = match spec.kind {
        SettingKind::Bool => match t.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => SettingValue::Bool(true),
            "false" | "0" | "no" | "off" => SettingValue::Bool(false),
            _ => return Err(bad()),
        },
        SettingKind::U32 { .. } => SettingValue::U32(t.parse().map_err(|_| bad())?),
        SettingKind::F64 { .. } => SettingValue::F64(t.parse().map_err(|_| bad())?),
    };
    check_range(spec, v)
}

/// Converts a TOML value for `spec`, with range check. Integers are accepted
/// for real-valued settings; nothing else is coerced.
fn parse_toml(spec: &SettingSpec, value: &toml::Value) -> Result<SettingValue, SettingsError> {
    let v = match (spec.kind, value) {
        (SettingKind::Bool, toml::Value::Boolean(b)) => SettingValue::Bool(*b),
        (SettingKind::U32 { .. }, toml::Value::Integer(i)) => match u32::try_from(*i) {
            Ok(x) => SettingValue::U32(x),
            Err(_) => {
                return Err(SettingsError::OutOfRange {
                    key: spec.key,
                    value: i.to_string(),
                    range: spec.kind.range_text(),
                })
            }
        },
        (SettingKind::F64 { .. }, toml::Value::Float(x)) => SettingValue::F64(*x),
        (SettingKind::F64 { .. }, toml::Value::Integer(i)) => SettingValue::F64(*i as f64),
        _ => {
            return Err(SettingsError::InvalidValue {
                key: spec.key,
                value: value.to_string(),
                expected: spec.kind.range_text(),
            })
        }
    };
    check_range(spec, v)
}

impl ReuseSettings {
    /// Checks every range and the cross-field rules.
    ///
    /// # Errors
    /// [`SettingsError::OutOfRange`] naming the first key out of range (NaN and
    /// infinities included); [`SettingsError::Inconsistent`] when the GPU path
    /// is enabled without the master switch.
    pub fn validate(&self) -> Result<(), SettingsError> {
        for spec in SETTINGS {
            check_range(spec, (spec.get)(self))?;
        }
        if self.enable_decode_to_prefill_gpu_reuse && !self.enable_decode_to_prefill_reuse {
            return Err(SettingsError::Inconsistent {
                key: "enable_decode_to_prefill_gpu_reuse",
                reason: "is true but enable_decode_to_prefill_reuse is false".into(),
            });
        }
        Ok(())
    }

    /// Encodes as a JSON object with one member per registered key.
    ///
    /// # Errors
    /// [`SettingsError::Json`] (not expected: every field is a plain number or bool).
    pub fn to_json(&self) -> Result<String, SettingsError> {
        serde_json::to_string_pretty(self).map_err(|e| SettingsError::Json {
            reason: e.to_string(),
        })
    }

    /// Decodes a JSON object and validates it. Missing keys take their default;
    /// unknown and removed keys are errors naming the key.
    ///
    /// # Errors
    /// [`SettingsError::Removed`], [`SettingsError::UnknownKey`],
    /// [`SettingsError::InvalidValue`], [`SettingsError::OutOfRange`],
    /// [`SettingsError::Json`] for malformed JSON.
    pub fn from_json(text: &str) -> Result<Self, SettingsError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| SettingsError::Json {
                reason: e.to_string(),
            })?;
        let serde_json::Value::Object(map) = value else {
            return Err(SettingsError::Json {
                reason: "top level must be an object".into(),
            });
        };
        let mut s = Self::default();
        for (key, v) in &map {
            let spec = known(key, "json")?;
            let bad = || SettingsError::InvalidValue {
                key: spec.key,
                value: v.to_string(),
                expected: spec.kind.range_text(),
            };
            let value = match (spec.kind, v) {
                (SettingKind::Bool, serde_json::Value::Bool(b)) => SettingValue::Bool(*b),
                (SettingKind::U32 { .. }, serde_json::Value::Number(n)) => {
                    let i = n.as_u64().ok_or_else(bad)?;
                    SettingValue::U32(u32::try_from(i).map_err(|_| SettingsError::OutOfRange {
                        key: spec.key,
                        value: i.to_string(),
                        range: spec.kind.range_text(),
                    })?)
                }
                (SettingKind::F64 { .. }, serde_json::Value::Number(n)) => {
                    SettingValue::F64(n.as_f64().ok_or_else(bad)?)
                }
                _ => return Err(bad()),
            };
            (spec.set)(&mut s, check_range(spec, value)?);
        }
        s.validate()?;
        Ok(s)
    }

    /// The settings in force as `(key, value)` pairs in registry order, for logs
    /// and `qualify` output.
    pub fn entries(&self) -> Vec<(&'static str, SettingValue)> {
        SETTINGS.iter().map(|s| (s.key, (s.get)(self))).collect()
    }
}

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
    /// A table of the settings in force with their origins, one line per key.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for (key, value) in self.settings.entries() {
            let origin = self
                .origins
                .get(key)
                .cloned()
                .unwrap_or(SettingOrigin::Default);
            let unit = spec(key).map(|s| s.unit).unwrap_or("-");
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
///     .args(["--enable-decode-to-prefill-reuse", "--minimum-transfer=9"]).unwrap()
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
    /// [`SettingsError::Toml`] for a syntax error or a nested table,
    /// [`SettingsError::UnknownKey`], [`SettingsError::Removed`],
    /// [`SettingsError::InvalidValue`], [`SettingsError::OutOfRange`].
    pub fn toml_str(mut self, text: &str, name: &str) -> Result<Self, SettingsError> {
        let table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| SettingsError::Toml {
                    file: name.to_string(),
                    reason: e.message().to_string(),
                })?;
        for (key, value) in &table {
            let spec = known(key, name)?;
            let v = parse_toml(spec, value)?;
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

    /// Applies CLI flags: `--key value`, `--key=value`, or a bare `--key` for a
    /// boolean (true). Dashes and underscores are interchangeable; a unique
    /// prefix of a key is accepted, an exact key always wins.
    ///
    /// # Errors
    /// [`SettingsError::AmbiguousFlag`] listing the candidates,
    /// [`SettingsError::UnknownKey`], [`SettingsError::Removed`],
    /// [`SettingsError::MissingValue`], [`SettingsError::UnexpectedArgument`]
    /// for a token that is not a flag, value errors as for the other layers.
    pub fn args<I, S>(mut self, args: I) -> Result<Self, SettingsError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_string()).collect();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            let Some(body) = arg.strip_prefix("--") else {
                return Err(SettingsError::UnexpectedArgument { arg: arg.clone() });
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let spec = resolve_flag(name)?;
            let raw = match inline {
                Some(v) => v,
                None => match separate_value(spec, args.get(i + 1)) {
                    Some(next) => {
                        i += 1;
                        next.clone()
                    }
                    None if spec.kind == SettingKind::Bool => "true".into(),
                    None => return Err(SettingsError::MissingValue { key: spec.key }),
                },
            };
            let v = parse_text(spec, &raw)?;
            self.put(spec, v, SettingOrigin::Cli(arg.clone()));
            i += 1;
        }
        Ok(self)
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

/// Splits a process's command line into the reuse setting flags, for
/// [`SettingsLoader::args`], and everything else, for the host's own parser;
/// order is kept on both sides.
///
/// A flag is ours when its name (dashes or underscores) is exactly a setting
/// key or a removed key (so the loader can explain the removal); prefixes are
/// not matched here, since a host flag could be one. Its value goes with it:
/// `--key=value`, `--key value`, or a bare boolean `--key` (followed by a
/// value only when the next token parses as a boolean), as `args` reads them.
///
/// ```
/// use kv_router_glue::{split_setting_args, SettingsLoader};
/// let argv = ["--port", "8000", "--enable-decode-to-prefill-reuse", "model.gguf",
///             "--minimum_transfer_prefix_blocks", "8"];
/// let (ours, host) = split_setting_args(argv);
/// assert_eq!(ours, ["--enable-decode-to-prefill-reuse", "--minimum_transfer_prefix_blocks", "8"]);
/// assert_eq!(host, ["--port", "8000", "model.gguf"]);
/// let s = SettingsLoader::new().args(&ours).unwrap().build().unwrap();
/// assert!(s.settings.enable_decode_to_prefill_reuse);
/// assert_eq!(s.settings.minimum_transfer_prefix_blocks, 8);
/// ```
pub fn split_setting_args<I, S>(args: I) -> (Vec<String>, Vec<String>)
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let args: Vec<String> = args.into_iter().map(|a| a.as_ref().to_string()).collect();
    let (mut ours, mut host) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let flag = arg
            .strip_prefix("--")
            .map(|body| match body.split_once('=') {
                Some((n, _)) => (n.replace('-', "_"), true),
                None => (body.replace('-', "_"), false),
            });
        let Some((key, inline)) = flag else {
            host.push(arg.clone());
            i += 1;
            continue;
        };
        let removed = REMOVED_SETTINGS.iter().any(|(k, _)| *k == key);
        let Some(spec) = spec(&key).filter(|_| !removed) else {
            if removed {
                ours.push(arg.clone());
            } else {
                host.push(arg.clone());
            }
            i += 1;
            continue;
        };
        ours.push(arg.clone());
        i += 1;
        if let Some(next) = separate_value(spec, args.get(i)).filter(|_| !inline) {
            ours.push(next.clone());
            i += 1;
        }
    }
    (ours, host)
}

/// The token after a `--key` written without `=value` when it is that
/// flag's value: always for a number, for a boolean only when it parses as
/// one (a bare boolean flag means true). Shared by [`SettingsLoader::args`]
/// and [`split_setting_args`], so both read a command line alike.
fn separate_value<'a>(spec: &SettingSpec, next: Option<&'a String>) -> Option<&'a String> {
    next.filter(|n| spec.kind != SettingKind::Bool || parse_text(spec, n).is_ok())
}

/// Resolves a flag name (without `--`) to a setting: exact key first, then a
/// unique prefix. Removed keys are refused by exact name only.
fn resolve_flag(name: &str) -> Result<&'static SettingSpec, SettingsError> {
    let key = name.replace('-', "_");
    if key.is_empty() {
        return Err(SettingsError::UnknownKey {
            key: name.to_string(),
            origin: "cli".into(),
        });
    }
    check_removed(&key)?;
    if let Some(s) = spec(&key) {
        return Ok(s);
    }
    let matches: Vec<&'static SettingSpec> = SETTINGS
        .iter()
        .filter(|s| s.key.starts_with(&key))
        .collect();
    match matches.as_slice() {
        [one] => Ok(one),
        [] => Err(SettingsError::UnknownKey {
            key: name.to_string(),
            origin: "cli".into(),
        }),
        many => Err(SettingsError::AmbiguousFlag {
            flag: format!("--{name}"),
            candidates: many.iter().map(|s| s.key).collect::<Vec<_>>().join(", "),
        }),
    }
}

/// The operator table of every setting (Markdown), generated from [`SETTINGS`].
/// `docs/settings.md` is this text; a test keeps them equal.
pub fn settings_markdown() -> String {
    let mut out = String::from(
        "# Reuse settings\n\n\
         <!-- Generated from kv_router_glue::SETTINGS by `settings_markdown()`; \
         the test `docs_match_registry` fails when this file is stale. -->\n\n\
         Precedence: defaults < TOML file < environment (`KV_REUSE_<KEY>`, captured once at start) \
         < CLI flags (`--key value`, `--key=value`, dashes or underscores, unique prefixes). \
         Unknown, ambiguous, removed and out-of-range keys are refused with the key named. \
         Everything is off by default.\n\n\
         | key | env | unit | default | range | meaning |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for s in SETTINGS {
        out.push_str(&format!(
            "| `{}` | `{}{}` | {} | `{}` | {} | {} |\n",
            s.key,
            ENV_PREFIX,
            s.key.to_ascii_uppercase(),
            s.unit,
            s.default,
            s.kind.range_text(),
            s.doc
        ));
    }
    out.push_str(
        "\n## Removed keys (refused with this explanation)\n\n| key | why |\n| --- | --- |\n",
    );
    for (k, why) in REMOVED_SETTINGS {
        out.push_str(&format!("| `{k}` | {why} |\n"));
    }
    out
}
