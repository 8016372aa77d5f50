//! The `donor_alive` argument as the delivery's liveness probe: a Python
//! callable run with the GIL for each check, failing closed, its first
//! exception kept for the fallback's `__cause__`.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use kv_transfer::LivenessProbe;

/// The first exception a `donor_alive` probe raised during one fetch,
/// chained as the `__cause__` of the error that fetch raises.
pub(super) type ProbeError = Arc<Mutex<Option<PyErr>>>;

/// A Python callable as the delivery's liveness probe. The delivery runs
/// without the GIL, so the probe takes it for each call; an exception or a
/// non-bool result counts as "donor gone" (fail closed: recompute). The
/// exception is kept in the returned slot: a buggy probe must not pass for
/// a dead donor without a trace ([`with_probe_cause`]).
pub(super) fn python_probe(probe: Py<PyAny>) -> (LivenessProbe, ProbeError) {
    let raised: ProbeError = Arc::default();
    let slot = raised.clone();
    let live = Arc::new(move || {
        Python::with_gil(|py| {
            match probe.call0(py).and_then(|v| {
                v.extract::<bool>(py).map_err(|_| {
                    let shown = v
                        .bind(py)
                        .repr()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "a value".into());
                    PyTypeError::new_err(format!("donor_alive returned {shown}, not a bool"))
                })
            }) {
                Ok(alive) => alive,
                Err(e) => {
                    slot.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                    false
                }
            }
        })
    });
    (live, raised)
}

/// `e` with the probe's exception (if it raised) as its `__cause__`, so the
/// fallback's traceback shows the probe's own error. Takes the GIL only
/// when there is one (the probe took it anyway).
pub(super) fn with_probe_cause(e: PyErr, raised: Option<&ProbeError>) -> PyErr {
    let cause = raised.and_then(|r| r.lock().unwrap_or_else(|p| p.into_inner()).take());
    if let Some(cause) = cause {
        Python::with_gil(|py| e.set_cause(py, Some(cause)));
    }
    e
}
