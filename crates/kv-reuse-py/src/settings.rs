//! Settings from a dict, argv and environment through kv_router_glue's
//! `SettingsLoader`: the same registry, precedence and refusals as the Rust
//! roles (unknown key, removed key, bad or out-of-range value, named).

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};

use kv_router_glue::{EnvSnapshot, LoadedSettings, SettingsLoader};

use crate::errors::{bad_argument, settings};

/// Validated reuse settings with the origin of each key.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct Settings {
    pub(crate) inner: LoadedSettings,
}

/// One dict value as a TOML literal; `key` names it in the refusal.
fn toml_value(key: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if v.is_instance_of::<PyBool>() {
        Ok(if v.extract::<bool>()? {
            "true"
        } else {
            "false"
        }
        .to_owned())
    } else if v.is_instance_of::<PyInt>() {
        Ok(v.extract::<i64>()?.to_string())
    } else if v.is_instance_of::<PyFloat>() {
        let f: f64 = v.extract()?;
        Ok(format!("{f:?}"))
    } else if v.is_instance_of::<PyString>() {
        let s: String = v.extract()?;
        Ok(format!("{:?}", s))
    } else {
        Err(bad_argument(
            &format!("values[{key:?}]"),
            "must be bool, int, float or str",
        ))
    }
}

#[pymethods]
impl Settings {
    /// Loads settings: `values` (a dict of registered keys, like a TOML
    /// file), then `env` (a dict of `KV_REUSE_*` variables; None = this
    /// process's environment, `{}` = none), then `argv` (CLI flags) on top.
    ///
    /// Raises `SettingsRefused` naming the key.
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
                text.push_str(&format!("{k} = {}\n", toml_value(&k, &v)?));
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
}
