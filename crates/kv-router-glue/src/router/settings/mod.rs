//! The eight reuse settings, their single registry, and their loaders.
//!
//! Every setting is declared once, in [`SETTINGS`]. The clap arguments a host
//! flattens into its own parser ([`ReuseArgs`]), the environment loader, the
//! TOML and JSON decoders (serde, one value at a time so errors name the key),
//! range checks and the operator table in `docs/settings.md`
//! ([`settings_markdown`]) are all driven by that registry; a test fails if
//! [`ReuseSettings`] grows a field that the registry does not list.
//!
//! One matching rule everywhere: a flag is a setting's exact key, written with
//! dashes or underscores; prefixes are never expanded (a host's own flags share
//! the command line, so a prefix could silently steal one of them).
//!
//! Precedence when layering with [`SettingsLoader`]: defaults < TOML file <
//! environment snapshot < CLI flags. Validation (ranges and cross-field rules)
//! runs once on the merged result, so a half-applied configuration is never
//! returned.
//!
//! Modules: `cli` (clap), `loader` (layers and origins), `docs` (the table).

mod cli;
mod docs;
mod loader;

pub use cli::ReuseArgs;
pub use docs::settings_markdown;
pub use loader::{EnvSnapshot, LoadedSettings, SettingOrigin, SettingsLoader};

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
    pub(crate) fn range_text(&self) -> String {
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
pub static SETTINGS: &[SettingSpec] = &[
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
        SettingKind::F64 {
            min: 0.001,
            max: 1_000_000.0
        },
        "µs",
        25.0,
        "Estimated cost of one block over the GPU path (a 2 MiB block at ~90 GB/s, NIXL with \
         per-block descriptors; the CUDA IPC gather path measured here is faster).",
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
        SettingKind::F64 {
            min: 0.001,
            max: 100_000.0
        },
        "µs",
        30.0,
        "Estimated recompute cost of one token (29-41 µs/token measured for the Llama-3.1-8B \
         shape on an H200, docs/qualification/prefill_cost_h200.json; the low end keeps the \
         estimate conservative).",
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

pub(crate) fn check_removed(key: &str) -> Result<(), SettingsError> {
    if let Some((k, why)) = REMOVED_SETTINGS.iter().find(|(k, _)| *k == key) {
        return Err(SettingsError::Removed {
            key: (*k).to_string(),
            reason: why,
        });
    }
    Ok(())
}

pub(crate) fn known(key: &str, origin: &str) -> Result<&'static SettingSpec, SettingsError> {
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
pub(crate) fn parse_text(spec: &SettingSpec, raw: &str) -> Result<SettingValue, SettingsError> {
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

/// Decodes one value of `spec` from any serde format (TOML, JSON), by the
/// setting's kind, then range-checks it. Integers are accepted for
/// real-valued settings (serde's `f64` does that); nothing else is coerced.
/// `shown` is the value as written, for the error.
fn decode_value<'de, D>(
    spec: &SettingSpec,
    value: D,
    shown: &str,
) -> Result<SettingValue, SettingsError>
where
    D: serde::Deserializer<'de>,
{
    // A file's boolean is the format's own `true` / `false`: the text
    // spellings `range_text` lists (1 / 0, yes / no, on / off) are for
    // flags and environment variables, and naming them here sent an
    // operator who wrote "yes" in TOML in a circle (helper-20 finding 18).
    let expected = match spec.kind {
        SettingKind::Bool => "true or false, unquoted (1 / 0, yes / no, on / off are for flags and environment variables only)".to_string(),
        _ => spec.kind.range_text(),
    };
    let bad = |_| SettingsError::InvalidValue {
        key: spec.key,
        value: shown.to_string(),
        expected: expected.clone(),
    };
    let v = match spec.kind {
        SettingKind::Bool => SettingValue::Bool(bool::deserialize(value).map_err(bad)?),
        SettingKind::U32 { .. } => {
            // Decoded as i64 first so that a negative or too large count is
            // reported as out of range, not as a type error.
            let i = i64::deserialize(value).map_err(bad)?;
            SettingValue::U32(u32::try_from(i).map_err(|_| SettingsError::OutOfRange {
                key: spec.key,
                value: i.to_string(),
                range: spec.kind.range_text(),
            })?)
        }
        SettingKind::F64 { .. } => SettingValue::F64(f64::deserialize(value).map_err(bad)?),
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
            let value = decode_value(spec, v, &v.to_string())?;
            (spec.set)(&mut s, value);
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
