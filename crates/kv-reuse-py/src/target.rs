//! The target (prefill) role: check a hint against the prompt and execute it
//! with kv_router_glue's `FetchExecutor` into this target's host rows, pinning
//! through the donor's pin service (`RemoteDonor`) and reading its host shm.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kv_bank::{BankMemory, CompletedBlocks, DestinationPool};
use kv_descriptor::{BankManifest, EngineId, HintEnvelope, SequenceHash, Wire};
use kv_router_glue::{FetchExecutor, RemoteDonor, DEFAULT_PIN_TIMEOUT};
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend, LivenessProbe};

use crate::errors::{bad_argument, descriptor, fetch, BankFailed, FetchFellBack};
use crate::layout::Layout;

/// A prefill target with `rows` destination rows per TP rank in host memory.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct Target {
    engine: EngineId,
    layout: Layout,
    regions: Vec<Arc<HostBuffer>>,
    executor: FetchExecutor,
}

#[pymethods]
impl Target {
    /// Raises `BankFailed` when the host rows cannot be allocated.
    #[new]
    fn new(layout: Layout, rows: u32) -> PyResult<Self> {
        if rows == 0 {
            return Err(bad_argument("rows", "must be at least 1"));
        }
        let rbb = layout.inner.rank_block_bytes();
        let regions = (0..layout.inner.tp_size())
            .map(|_| HostBuffer::zeroed(rows as usize * rbb).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| BankFailed::new_err(e.to_string()))?;
        let dyn_regions: Vec<Arc<dyn BankMemory>> = regions
            .iter()
            .map(|r| r.clone() as Arc<dyn BankMemory>)
            .collect();
        let executor = FetchExecutor::new(
            layout.inner,
            DestinationPool::new(rows),
            dyn_regions,
            rows,
            Arc::new(HostCopyBackend),
        )
        .map_err(fetch)?;
        Ok(Self {
            engine: EngineId::fresh(),
            layout,
            regions,
            executor,
        })
    }

    /// This target's engine id (what the router routes to).
    #[getter]
    fn engine_id(&self) -> String {
        self.engine.to_string()
    }

    /// Destination rows free for a fetch.
    #[getter]
    fn free_rows(&self) -> u32 {
        self.executor.pool().free_blocks() as u32
    }

    /// Executes `hint` (MessagePack envelope from `Advice.hint`) for a prompt
    /// whose sealed blocks have `prompt_hashes`, from the donor whose
    /// manifest (wire form) is `manifest`. Releases the GIL while it runs.
    ///
    /// `donor_alive`, when given, is a callable returning False once the
    /// donor is gone (its process exited, its lease lapsed); it is called
    /// (with the GIL) before the first byte and after the last one, so bytes
    /// read from a donor that died meanwhile are never reported complete. A
    /// probe that raises counts as a dead donor. `pin_timeout_s` bounds each
    /// exchange with the donor's pin service (default 2 s).
    ///
    /// Raises `PromptMismatch` / `HintRefused` before anything is touched,
    /// `FetchFellBack` (stage, cause) after: recompute the prefix then.
    #[pyo3(signature = (hint, prompt_hashes, manifest, donor_alive = None, pin_timeout_s = None))]
    fn fetch(
        &self,
        py: Python<'_>,
        hint: &[u8],
        prompt_hashes: Vec<u64>,
        manifest: &[u8],
        donor_alive: Option<Py<PyAny>>,
        pin_timeout_s: Option<f64>,
    ) -> PyResult<FetchOutcome> {
        let envelope = HintEnvelope::from_wire(hint).map_err(descriptor)?;
        let manifest = BankManifest::from_wire(manifest).map_err(descriptor)?;
        let actions = envelope.fetch_gpu_actions().map_err(descriptor)?;
        let endpoint = actions
            .first()
            .map(|a| a.donor_control_endpoint.clone())
            .ok_or_else(|| bad_argument("hint", "no kv.fetch_gpu action"))?;
        let pin_timeout = match pin_timeout_s {
            None => DEFAULT_PIN_TIMEOUT,
            Some(s) if s.is_finite() && s > 0.0 && s <= 3600.0 => Duration::from_secs_f64(s),
            Some(s) => {
                return Err(bad_argument(
                    "pin_timeout_s",
                    format!("{s} is not in (0, 3600] seconds"),
                ))
            }
        };
        if let Some(probe) = &donor_alive {
            if !probe.bind(py).is_callable() {
                return Err(bad_argument("donor_alive", "is not callable"));
            }
        }
        let control = DeliveryControl {
            donor_alive: donor_alive.map(python_probe),
            ..DeliveryControl::default()
        };
        let prompt: Vec<SequenceHash> = prompt_hashes.into_iter().map(SequenceHash).collect();
        let out = py.allow_threads(|| {
            // A donor whose segments are gone (it exited) is a fallback like
            // a refused pin: the request recomputes.
            let donor = RemoteDonor::open_host_shm(manifest, &endpoint)
                .map_err(|e| {
                    FetchFellBack::new_err((format!("donor import: {e}"), "import", "donor_import"))
                })?
                .with_timeout(pin_timeout);
            self.executor
                .execute_for_prompt(&envelope, &prompt, &donor, &control)
                .map_err(fetch)
        })?;
        Ok(FetchOutcome {
            rows: out.target_blocks.to_vec(),
            fetch_from: out.fetch_from,
            fetched: out.fetched.iter().map(|h| h.0).collect(),
            bytes: out.report.counters.bytes,
            host_payload_bytes: out.report.counters.host_payload_bytes,
            transport: out.report.counters.transport.clone(),
            guard: Mutex::new(Some(out.target_blocks)),
        })
    }

    /// The bytes of destination row `row` of rank `rank` (a copy; use
    /// `numpy.frombuffer(..., dtype)` to view them).
    fn read_row<'py>(&self, py: Python<'py>, rank: u32, row: u32) -> PyResult<Bound<'py, PyBytes>> {
        let region = self.regions.get(rank as usize).ok_or_else(|| {
            bad_argument("rank", format!("{rank} >= tp_size {}", self.regions.len()))
        })?;
        let rbb = self.layout.inner.rank_block_bytes();
        let mut buf = vec![0u8; rbb];
        region
            .read_bytes(row as usize * rbb, &mut buf)
            .map_err(|e| bad_argument("row", e))?;
        Ok(PyBytes::new(py, &buf))
    }
}

/// A Python callable as the delivery's liveness probe. The delivery runs
/// without the GIL, so the probe takes it for each call; an exception or a
/// non-bool result counts as "donor gone" (fail closed: recompute).
fn python_probe(probe: Py<PyAny>) -> LivenessProbe {
    Arc::new(move || {
        Python::with_gil(|py| {
            probe
                .call0(py)
                .and_then(|v| v.extract::<bool>(py))
                .unwrap_or(false)
        })
    })
}

/// A completed fetch. Its rows stay out of the pool until `release()` (or
/// the end of a `with` block): keep it while the request reads them.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct FetchOutcome {
    /// Destination rows, one per fetched block, in prefix order.
    #[pyo3(get)]
    rows: Vec<u32>,
    /// Index of the first fetched block in the prompt.
    #[pyo3(get)]
    fetch_from: u32,
    /// Sequence hashes of the fetched blocks.
    #[pyo3(get)]
    fetched: Vec<u64>,
    /// Bytes moved (all ranks).
    #[pyo3(get)]
    bytes: u64,
    /// Bytes that crossed host memory (all of them on the host-shm path).
    #[pyo3(get)]
    host_payload_bytes: u64,
    /// The transport (`host-memcpy`, ...).
    #[pyo3(get)]
    transport: String,
    guard: Mutex<Option<CompletedBlocks>>,
}

#[pymethods]
impl FetchOutcome {
    /// Returns the rows to the target's pool. Idempotent.
    fn release(&self) {
        drop(self.guard.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
    /// True after `release()`.
    #[getter]
    fn released(&self) -> bool {
        self.guard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release();
        false
    }
}
