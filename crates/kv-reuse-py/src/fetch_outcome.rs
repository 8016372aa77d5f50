//! What a completed fetch hands back to Python ([`FetchOutcome`]): the rows
//! it filled, what moved and how long each stage took, and the rows' guard,
//! which returns them to the target's pool on `release()` (or at the end of
//! a `with` block).

use std::sync::Mutex;

use pyo3::prelude::*;

use kv_bank::CompletedBlocks;

use crate::reprs::Repr;

/// A completed fetch. Its rows stay out of the pool until `release()` (or
/// the end of a `with` block): keep it while the request reads them.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct FetchOutcome {
    /// Destination rows, one per fetched block, in prefix order.
    #[pyo3(get)]
    pub(crate) rows: Vec<u32>,
    /// Index of the first fetched block in the prompt.
    #[pyo3(get)]
    pub(crate) fetch_from: u32,
    /// Sequence hashes of the fetched blocks.
    #[pyo3(get)]
    pub(crate) fetched: Vec<u64>,
    /// Bytes moved (all ranks).
    #[pyo3(get)]
    pub(crate) bytes: u64,
    /// Bytes that crossed host memory (all of them on the host-shm path).
    #[pyo3(get)]
    pub(crate) host_payload_bytes: u64,
    /// The transport (`memcpy` for host memory, ...).
    #[pyo3(get)]
    pub(crate) transport: String,
    /// Microseconds spent importing the donor's segments before the
    /// executor ran: host shm maps, or CUDA IPC mappings (kept by this
    /// target after its first fetch from that donor: a lease check then).
    #[pyo3(get)]
    pub(crate) import_us: u64,
    /// Microseconds of the delivery itself, first check to last
    /// (`DeliveryReport::elapsed_us`: the copies and their completion).
    #[pyo3(get)]
    pub(crate) transfer_us: u64,
    /// Microseconds of the whole fetch without the GIL: import, reserve,
    /// plan, pin round trip, delivery, unpin, checksum verify, commit.
    /// `total_us - import_us - transfer_us` is the pin/verify/commit share.
    #[pyo3(get)]
    pub(crate) total_us: u64,
    pub(crate) stages: kv_router_glue::FetchStages,
    pub(crate) guard: Mutex<Option<CompletedBlocks>>,
}

impl FetchOutcome {
    /// The Python form of the executor's outcome `out`, with the import
    /// and whole-fetch times the target measured around it.
    pub(crate) fn new(out: kv_router_glue::FetchOutcome, import_us: u64, total_us: u64) -> Self {
        Self {
            rows: out.target_blocks.to_vec(),
            fetch_from: out.fetch_from,
            fetched: out.fetched.iter().map(|h| h.0).collect(),
            bytes: out.report.counters.bytes,
            host_payload_bytes: out.report.counters.host_payload_bytes,
            transport: out.report.counters.transport.clone(),
            import_us,
            transfer_us: out.report.elapsed_us,
            total_us,
            stages: out.stages,
            guard: Mutex::new(Some(out.target_blocks)),
        }
    }
}

#[pymethods]
impl FetchOutcome {
    /// The executor's stages in µs, in the order they ran: `reserve` (hint
    /// checks, destination rows), `plan` (the copy plan), `pin` (the donor's
    /// pin grant, a round trip), `transfer` (copies issued and completed,
    /// donor probed), `verify_commit` (pin release, checksums, commit).
    #[getter]
    fn stages_us(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let s = &self.stages;
        std::collections::BTreeMap::from([
            ("reserve", s.reserve_us),
            ("plan", s.plan_us),
            ("pin", s.pin_us),
            ("transfer", s.transfer_us),
            ("verify_commit", s.verify_commit_us),
        ])
    }
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
    /// `FetchOutcome(fetch_from=2, rows=[5, 6, 7, 8], bytes=..,
    /// host_payload_bytes=.., transport='memcpy', total_us=..,
    /// released=False)`: a long fetch's `rows` cut after 8 (`...`), and
    /// `fetched` left out (one 20-digit hash per row; `rows` says as much).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(Repr::value(py, "FetchOutcome")
            .field("fetch_from", self.fetch_from)?
            .list("rows", &self.rows)
            .field("bytes", self.bytes)?
            .field("host_payload_bytes", self.host_payload_bytes)?
            .field("transport", self.transport.as_str())?
            .field("total_us", self.total_us)?
            .field("released", self.released())?
            .finish())
    }
}

/// `d` in whole microseconds (saturating at u64::MAX, ~584,000 years): the
/// unit of [`FetchOutcome`]'s stage times.
pub(crate) fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
