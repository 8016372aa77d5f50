//! Settings from a dict, argv and environment through kv_router_glue's
//! `SettingsLoader`: the same registry, precedence and refusals as the Rust
//! roles (unknown key, removed key, bad or out-of-range value, named).

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};

use kv_router_glue::{EnvSnapshot, LoadedSettings, SettingOrigin, SettingValue, SettingsLoader};

use crate::errors::{bad_argument, settings};
use crate::reprs::Repr;

/// Validated reuse settings with the origin of each key.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct Settings {
    pub(crate) inner: LoadedSettings,
}

/// `s` as a TOML basic string (`"..."`): quote, backslash and every
/// control character escaped, so that a dict key or value is one TOML
/// token whatever it holds (a key `a.b` stays one key, a newline cannot
/// start another setting). Rust's `{:?}` is not TOML (`\u{7f}`, `\0`).
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// One dict value as a TOML literal; `argument` (`values["key"]`) names it
/// in the refusal.
fn toml_value(argument: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if v.is_instance_of::<PyBool>() {
        Ok(if v.extract::<bool>()? {
            "true"
        } else {
            "false"
        }
        .to_owned())
    } else if v.is_instance_of::<PyInt>() {
        // TOML integers are 64-bit; the registry then range-checks them.
        v.extract::<i64>()
            .map(|i| i.to_string())
            .map_err(|_| bad_argument(argument, "is past the 64-bit integers of TOML"))
    } else if v.is_instance_of::<PyFloat>() {
        let f: f64 = v.extract()?;
        // TOML spells them `nan` / `inf` (Rust's `NaN` is no TOML): the
        // registry refuses them as out of range, naming the key.
        Ok(if f.is_nan() {
            "nan".to_owned()
        } else if f.is_infinite() {
            if f > 0.0 { "inf" } else { "-inf" }.to_owned()
        } else {
            format!("{f:?}")
        })
    } else if v.is_instance_of::<PyString>() {
        let s: String = v
            .extract()
            .map_err(|_| bad_argument(argument, "is not valid UTF-8 text"))?;
        Ok(toml_string(&s))
    } else {
        Err(bad_argument(argument, "must be bool, int, float or str"))
    }
}

#[pymethods]
impl Settings {
    /// Loads settings: `values` (a dict of registered keys, like a TOML
    /// file), then `env` (a dict of `KV_REUSE_*` variables; None = this
    /// process's environment, `{}` = none), then `argv` (CLI flags) on top.
    ///
    /// Raises `SettingsRefused` naming the key (unknown, removed, a bad or
    /// out-of-range value: NaN and infinities included); `BadArgument`
    /// naming `values` (a key that is not str) or `values["key"]` (a value
    /// that is not bool, int, float or str, an int past 64 bits).
    /// Keys and values are taken literally: a key `a.b` is one (unknown)
    /// key, never a TOML table.
    #[new]
    #[pyo3(signature = (values = None, argv = None, env = None))]
    fn new(
        values: Option<&Bound<'_, PyDict>>,
        argv: Option<Vec<String>>,
        env: Option<HashMap<String, String>>,
    ) -> PyResult<Self> {
        let mut loader = SettingsLoader::new();
        if let Some(values) = values {
            let mut text = String::new();
            for (k, v) in values.iter() {
                let k: String = k
                    .extract()
                    .map_err(|_| bad_argument("values", "keys must be str"))?;
                let argument = format!("values[{}]", toml_string(&k));
                text.push_str(&format!(
                    "{} = {}\n",
                    toml_string(&k),
                    toml_value(&argument, &v)?
                ));
            }
            loader = loader.toml_str(&text, "values").map_err(settings)?;
        }
        let snapshot = match env {
            Some(pairs) => EnvSnapshot::from_pairs(pairs),
            None => EnvSnapshot::capture(),
        };
        loader = loader.env(&snapshot).map_err(settings)?;
        if let Some(argv) = argv {
            loader = loader.args(argv).map_err(settings)?;
        }
        Ok(Self {
            inner: loader.build().map_err(settings)?,
        })
    }

    /// The settings as JSON (kv_router_glue's round-trip form).
    fn to_json(&self) -> PyResult<String> {
        self.inner.settings.to_json().map_err(settings)
    }

    /// `{key: (value, origin)}` for every registered key.
    fn entries(&self) -> HashMap<String, (String, String)> {
        self.inner
            .settings
            .entries()
            .into_iter()
            .map(|(k, v)| {
                let origin = self
                    .inner
                    .origins
                    .get(k)
                    .map(|o| format!("{o:?}"))
                    .unwrap_or_default();
                (k.to_owned(), (format!("{v}"), origin))
            })
            .collect()
    }

    /// The settings-in-force table (one line per key with its origin).
    fn describe(&self) -> String {
        self.inner.describe()
    }

    /// `Settings(values={'key': value, ...}, env={})`: the keys set by the
    /// dict, `env` or `argv` (not by default), in the registry's order, as
    /// the `values` that make the same settings, and `env={}`, so that
    /// `eval(repr(s))` makes them whatever `KV_REUSE_*` variables the
    /// evaluating process has (without it, `Settings()` reads the process
    /// environment: a variable there would add a key, a mistyped one raise
    /// `SettingsRefused`). Every key's value and origin: `describe()`.
    /// Settings hold no secret (bools and numbers only).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let set = PyDict::new(py);
        for (key, value, _, origin) in self.inner.in_force() {
            if matches!(origin, SettingOrigin::Default) {
                continue;
            }
            match value {
                SettingValue::Bool(b) => set.set_item(key, b)?,
                SettingValue::U32(n) => set.set_item(key, n)?,
                SettingValue::F64(f) => set.set_item(key, f)?,
            }
        }
        Ok(Repr::value(py, "Settings")
            .field("values", set)?
            .field("env", PyDict::new(py))?
            .finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_router_glue::SettingsError;

    /// Every awkward key reaches the loader as exactly that one key (the
    /// TOML parser reads `toml_string`'s escapes back), and a value as one
    /// string of its key: nothing is split, dropped or injected.
    #[test]
    fn toml_strings_read_back_as_one_literal_key_or_value() {
        let keys = [
            "a.b",
            "x = 1\ny",
            "q\"uote\\back",
            "nul\0del\u{7f}c1\u{85}tab\tcr\r",
            "ünï✓",
            "",
        ];
        for key in keys {
            let text = format!("{} = 1\n", toml_string(key));
            match SettingsLoader::new().toml_str(&text, "values") {
                Err(SettingsError::UnknownKey { key: got, .. }) => assert_eq!(got, key),
                other => panic!("{key:?}: {:?}", other.map(|_| ())),
            }
        }
        let value = "6\"\nenable_decode_to_prefill_reuse = true\n\"\0\u{7f}";
        let text = format!("minimum_transfer_prefix_blocks = {}\n", toml_string(value));
        match SettingsLoader::new()
            .toml_str(&text, "values")
            .as_ref()
            .map_err(SettingsError::root)
        {
            Err(SettingsError::InvalidValue {
                key, value: shown, ..
            }) => {
                assert_eq!(*key, "minimum_transfer_prefix_blocks");
                assert!(shown.contains("enable_decode_to_prefill_reuse"), "{shown}");
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
}
