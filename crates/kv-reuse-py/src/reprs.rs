//! `__repr__` text of the classes an operator prints (`print(client)`, a
//! log line, a debugger), in Python's conventions rather than the default
//! `<kv_reuse.X object at 0x...>`, which names nothing.
//!
//! - A value, whose fields are all it is (`Settings`, `FetchOutcome`, like
//!   `Layout` and `Advice`), reads `Name(field=value, ...)`.
//! - An object that owns something outside Python (a NATS connection, a
//!   bank's memory, a socket, threads) reads `<kv_reuse.Name field=value
//!   ...>`, the form of `<_io.TextIOWrapper name='x' mode='r'>`: the angle
//!   brackets say that the text does not rebuild it.
//!
//! Every value is written by Python's own `repr` (quotes and escapes as
//! Python writes them, `True`, `None`, `2.0`), not by Rust's `Debug`
//! (`Some(4)`, `true`). No secret reaches a repr: a `nats_url` is kept only
//! in its redacted form (`redact_url`: a password or token as `***`) and
//! the credential keywords (`password`, `token`, `creds`, `tls_key`) are
//! never kept by the objects at all.

use pyo3::prelude::*;
use pyo3::BoundObject;

/// The items of a list a repr shows before `...` (Python's `reprlib`
/// shows 6): a fetch of a long prompt has hundreds of rows, which would
/// bury the other fields of its one log line.
const MAX_LIST: usize = 8;

/// A repr being written, field by field.
pub(crate) struct Repr<'py> {
    py: Python<'py>,
    text: String,
    /// The object form (`<kv_reuse.Name a=1 b=2>`), else the value form.
    object: bool,
    fields: usize,
}

impl<'py> Repr<'py> {
    /// `Name(field=value, ...)`: a value.
    pub(crate) fn value(py: Python<'py>, class: &str) -> Self {
        Self {
            py,
            text: format!("{class}("),
            object: false,
            fields: 0,
        }
    }

    /// `<kv_reuse.Name field=value ...>`: an object owning a resource.
    pub(crate) fn object(py: Python<'py>, class: &str) -> Self {
        Self {
            py,
            text: format!("<kv_reuse.{class}"),
            object: true,
            fields: 0,
        }
    }

    /// `name=` and `v` as Python's `repr` writes it.
    pub(crate) fn field<T: IntoPyObject<'py>>(self, name: &str, v: T) -> PyResult<Self>
    where
        T::Error: Into<PyErr>,
    {
        let shown = v
            .into_pyobject(self.py)
            .map_err(Into::into)?
            .into_any()
            .into_bound()
            .repr()?
            .to_string();
        Ok(self.shown(name, &shown))
    }

    /// `name=` and `text`, which is a repr already (a nested object's, or
    /// an int shown in hex).
    pub(crate) fn shown(mut self, name: &str, text: &str) -> Self {
        let sep = match (self.object, self.fields) {
            (true, _) => " ",
            (false, 0) => "",
            (false, _) => ", ",
        };
        self.text.push_str(sep);
        self.text.push_str(name);
        self.text.push('=');
        self.text.push_str(text);
        self.fields += 1;
        self
    }

    /// `name=[a, b, ...]`: at most [`MAX_LIST`] items, then `...` as
    /// `reprlib` abbreviates a list.
    pub(crate) fn list(self, name: &str, items: &[u32]) -> Self {
        let mut shown: Vec<String> = items.iter().take(MAX_LIST).map(u32::to_string).collect();
        if items.len() > MAX_LIST {
            shown.push("...".into());
        }
        let text = format!("[{}]", shown.join(", "));
        self.shown(name, &text)
    }

    /// The repr, closed.
    pub(crate) fn finish(mut self) -> String {
        self.text.push(if self.object { '>' } else { ')' });
        self.text
    }
}
