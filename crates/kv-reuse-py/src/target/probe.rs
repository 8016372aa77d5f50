//! The `donor_alive` argument as the delivery's liveness probe: a Python
//! callable run with the GIL for each check, failing closed, its first
//! exception kept for the fallback's `__cause__`.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyBaseException, PyTypeError};
use pyo3::prelude::*;

use kv_transfer::LivenessProbe;

/// The Python side of one fetch's `donor_alive` probe: the callable and
/// the first exception it raised. Both are taken back when the fetch ends
/// ([`Probe::take`]) by whoever holds the GIL next or hands them on (the
/// `FetchJob`, which shows them to the garbage collector), instead of
/// being dropped with the delivery's probe closure on the fetch thread:
/// there pyo3 only queues the decref until some later call into the
/// wheel, which at interpreter exit never comes, and a queued reference to
/// a function of the engine's script (or to an exception whose traceback
/// holds its frame) keeps the script's globals, and a donor in them, alive
/// past exit.
#[derive(Default)]
pub(super) struct Probe {
    callable: Mutex<Option<Py<PyAny>>>,
    raised: Mutex<Option<Py<PyBaseException>>>,
}

/// What a fetch's probe leaves behind: the exception it raised first (the
/// fallback's `__cause__`), if any, and the callable itself.
pub(super) struct ProbeLeft {
    pub(super) raised: Option<Py<PyBaseException>>,
    pub(super) callable: Option<Py<PyAny>>,
}

impl Probe {
    /// Empties the probe (later calls of its closure answer "gone"), so
    /// that dropping the closure drops no Python object. Needs no GIL:
    /// the references move, none is released.
    pub(super) fn take(&self) -> ProbeLeft {
        ProbeLeft {
            raised: self.raised.lock().unwrap_or_else(|p| p.into_inner()).take(),
            callable: self
                .callable
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        }
    }
}

/// A Python callable as the delivery's liveness probe. The delivery runs
/// without the GIL, so the probe takes it for each call; an exception or a
/// non-bool result counts as "donor gone" (fail closed: recompute). The
/// exception is kept in the returned [`Probe`]: a buggy probe must not pass
/// for a dead donor without a trace (`Target::fetch` and the `FetchJob`
/// chain it as the fallback's `__cause__`).
pub(super) fn python_probe(callable: Py<PyAny>) -> (LivenessProbe, Arc<Probe>) {
    let probe = Arc::new(Probe {
        callable: Mutex::new(Some(callable)),
        raised: Mutex::default(),
    });
    let slot = probe.clone();
    let live = Arc::new(move || {
        Python::with_gil(|py| {
            // A new reference for the call: the lock is not held while
            // Python code runs (which may reach this fetch's job).
            let callable = slot
                .callable
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|c| c.clone_ref(py));
            // Taken back: the fetch is over, nothing to vouch for.
            let Some(callable) = callable else {
                return false;
            };
            match callable.call0(py).and_then(|v| {
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
                    // As an exception object (its traceback attached), so
                    // that the job holding it can show it to the collector.
                    let e = e.into_value(py);
                    let mut raised = slot.raised.lock().unwrap_or_else(|p| p.into_inner());
                    if raised.is_none() {
                        *raised = Some(e);
                    } else {
                        // Not the first: dropped with the GIL, after the lock.
                        drop(raised);
                        drop(e);
                    }
                    false
                }
            }
        })
    });
    (live, probe)
}

/// `e` with `cause` (what the probe raised, if it did) as its `__cause__`,
/// so the fallback's traceback shows the probe's own error.
pub(crate) fn with_cause(py: Python<'_>, e: PyErr, cause: Option<Py<PyBaseException>>) -> PyErr {
    if let Some(cause) = cause {
        e.set_cause(py, Some(PyErr::from_value(cause.into_bound(py).into_any())));
    }
    e
}
