//! The donor role: a host-shm or CUDA TP-N bank, stores of sealed blocks from numpy
//! arrays acknowledged per rank, events, the manifest, and the pin service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kv_bank::{
    sealed_blocks, BankConfig, BankError, BankManager, DeviceRows, LeaseConfig, MemoryKind,
    StoreStatus,
};
use kv_descriptor::{MemoryLocation, OwnerLease, Role, SequenceHash, Wire};
use kv_router_glue::{PinEndpoint, PinService, PinServiceConfig};

use crate::array::{on_cuda, ArrayView, Want};
use crate::errors::{
    bad_argument, bank, descriptor, index_below, uints, CudaUnavailable, PinServiceFailed,
};
use crate::layout::Layout;
use crate::reprs::Repr;

/// A decode worker's retained bank in host shared memory (kv_bank::BankManager).
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct DonorBank {
    pub(crate) inner: Arc<BankManager>,
    layout: Layout,
}

impl DonorBank {
    /// A Python view of a bank opened elsewhere (a `WorkerPublisher`'s
    /// donor agent owns it), stored into through the same calls.
    pub(crate) fn from_manager(inner: Arc<BankManager>, layout: Layout) -> Self {
        crate::exit_unlink::register(&inner);
        Self { inner, layout }
    }
}

#[pymethods]
impl DonorBank {
    /// Opens a bank of `slots` KV blocks per TP rank: in host shm, or with
    /// `gpus` (one CUDA ordinal per TP rank) in device memory exported over
    /// CUDA IPC (the GPU path; `PendingStore.write` then copies CUDA
    /// tensors device to device, or host arrays to the device).
    ///
    /// `lease_s` is the owner lease (seconds, renewed in the background every
    /// fifth of it): once this process dies, `reclaim_stale()` anywhere on
    /// the host removes its segments after at most that long.
    ///
    /// `store_timeout_s` bounds how long an open store (`store()` until every
    /// rank's `ack`) may hold its reserved slots before it is rolled back
    /// (kv_bank's `BankConfig::store_timeout`, default 5 s); a `write` or
    /// `ack` of it after that raises `BankFailed` naming the store and
    /// `store_timeout_s` (the store is rolled back). A store rolled
    /// back by that timeout keeps its slots quarantined for one more
    /// `store_timeout_s` (a rank may still be copying into them): a `store`
    /// that needs them meanwhile raises `BankFailed` ("bank full") naming
    /// the quarantined slots and when they return. `abort()` (and leaving a
    /// `with` block) frees them at once.
    ///
    /// A host bank takes its `slots x tp_size x rank_block_bytes` bytes of
    /// `/dev/shm` here, at creation (the pages are reserved, so a full
    /// `/dev/shm` can never kill a later `write` with SIGBUS). Its names
    /// (segments and `.lease` files) are removed when it is dropped, or at
    /// interpreter exit by the wheel's `atexit` hook if it is still alive
    /// then (a daemon thread holding the script's globals keeps
    /// finalization from dropping it); the hook removes names only, so a
    /// thread still running keeps its mapping.
    ///
    /// Raises `BadArgument` naming `slots` (outside 1..=16777216, negative
    /// included), `lease_s`, `store_timeout_s` or `gpus` (also `gpus[i]`
    /// for a negative int or one past u32), `CudaUnavailable`
    /// when `gpus` is given where no CUDA device is, `BankFailed` when the
    /// segments or allocations cannot be created (naming `slots`, the bytes
    /// and the free space when `/dev/shm` cannot hold the bank; nothing is
    /// left behind).
    #[new]
    #[pyo3(signature = (layout, slots, host_id = "kv-reuse-py", gpus = None, lease_s = 15.0, store_timeout_s = 5.0))]
    fn new(
        layout: Layout,
        slots: &Bound<'_, PyAny>,
        host_id: &str,
        gpus: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = "crate::errors::seconds")] lease_s: f64,
        #[pyo3(from_py_with = "crate::errors::seconds")] store_timeout_s: f64,
    ) -> PyResult<Self> {
        let slots = slot_count(slots)?;
        check_host_id(host_id)?;
        let gpus: Option<Vec<u32>> = gpus.map(|g| uints("gpus", g)).transpose()?;
        // kv_bank accepts 1 ms ..= 1 day; below 50 ms a renewal every fifth
        // of it would be a busy thread.
        if !(lease_s.is_finite() && (0.05..=86_400.0).contains(&lease_s)) {
            return Err(bad_argument(
                "lease_s",
                format!("{lease_s} is not in [0.05, 86400] seconds"),
            ));
        }
        if !(store_timeout_s.is_finite() && (0.001..=3_600.0).contains(&store_timeout_s)) {
            return Err(bad_argument(
                "store_timeout_s",
                format!("{store_timeout_s} is not in [0.001, 3600] seconds"),
            ));
        }
        let bytes = slots
            .checked_mul(u64::from(layout.inner.tp_size()) * layout.inner.rank_block_bytes() as u64)
            .ok_or_else(|| bad_argument("slots", format!("{slots} slots overflow u64 bytes")))?;
        let mut cfg = BankConfig::new(layout.inner, OwnerLease::fresh(Role::Decode), bytes);
        let lease = Duration::from_secs_f64(lease_s);
        cfg.lease = LeaseConfig::background(lease, lease / 5);
        cfg.store_timeout = Duration::from_secs_f64(store_timeout_s);
        let inner = match gpus {
            None => BankManager::new_host_shm(cfg, host_id).map_err(bank)?,
            Some(g) => {
                if g.len() != layout.inner.tp_size() as usize {
                    return Err(bad_argument(
                        "gpus",
                        format!(
                            "{} ordinals, expected one per TP rank ({})",
                            g.len(),
                            layout.inner.tp_size()
                        ),
                    ));
                }
                BankManager::new_cuda(cfg, host_id, &g).map_err(|e| match e {
                    BankError::CudaUnavailable { .. } => {
                        CudaUnavailable::new_err(format!("gpus: {e}"))
                    }
                    other => bank(other),
                })?
            }
        };
        let inner = Arc::new(inner);
        // Its /dev/shm names go at interpreter exit even if finalization
        // never drops it (a daemon thread holding the script's globals).
        crate::exit_unlink::register(&inner);
        Ok(Self { inner, layout })
    }

    /// This donor's engine id (UUID string).
    #[getter]
    fn engine_id(&self) -> String {
        self.inner.owner().engine_id.to_string()
    }

    /// The bank manifest in its MessagePack wire form (what a target imports).
    fn manifest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inner.manifest().to_wire().map_err(descriptor)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Starts storing the sealed blocks of `tokens` (whole blocks only; a
    /// partial tail is not stored). Returns a `PendingStore` to fill per rank.
    ///
    /// Raises `BadArgument` naming `tokens` (fewer than one block) or
    /// `tokens[i]` (a negative id or one past u32); `BankFailed` from the
    /// bank (no free slots).
    fn store(&self, tokens: &Bound<'_, PyAny>) -> PyResult<PendingStore> {
        let tokens: Vec<u32> = uints("tokens", tokens)?;
        let tpb = self.layout.inner.tokens_per_block() as usize;
        let sealed = sealed_blocks(None, &tokens, tpb);
        if sealed.is_empty() {
            return Err(bad_argument(
                "tokens",
                format!("fewer than one block ({tpb} tokens)"),
            ));
        }
        let st = self.inner.store(None, &sealed).map_err(bank)?;
        Ok(PendingStore {
            started: Instant::now(),
            bank: self.inner.clone(),
            layout: self.layout,
            store_id: st.store_id,
            hashes: st.entries.iter().map(|(h, _)| h.0).collect(),
            already_retained: st.already_retained,
            excluded: st.excluded,
        })
    }

    /// Counters of this bank's life (kv_bank `BankStats`): `stores_ready`,
    /// `stores_rolled_back`, `blocks_stored`, `blocks_evicted`,
    /// `blocks_excluded`, `pins`, and the store payload by source in bytes:
    /// `store_bytes_from_host` (rows written from host arrays; on a CUDA
    /// bank each is a host-to-device copy, the store's host payload) and
    /// `store_bytes_from_device` (rows copied device to device from CUDA
    /// tensors, no host payload).
    #[getter]
    fn stats(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let s = self.inner.stats();
        [
            ("stores_ready", s.stores_ready),
            ("stores_rolled_back", s.stores_rolled_back),
            ("blocks_stored", s.blocks_stored),
            ("blocks_evicted", s.blocks_evicted),
            ("blocks_excluded", s.blocks_excluded),
            ("pins", s.pins),
            ("store_bytes_from_host", s.store_bytes_from_host),
            ("store_bytes_from_device", s.store_bytes_from_device),
        ]
        .into_iter()
        .collect()
    }

    /// The slot holding each of `hashes`, or None where the bank lacks it.
    ///
    /// Raises `BadArgument` naming `hashes[i]` for a negative int or one
    /// past u64.
    fn slots(&self, hashes: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u32>>> {
        Ok(uints::<u64>("hashes", hashes)?
            .iter()
            .map(|h| self.inner.lookup(&SequenceHash(*h)))
            .collect())
    }

    /// Drains the queued KV events (MessagePack `KvEvent` each).
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        self.inner
            .drain_events()
            .iter()
            .map(|e| {
                e.to_wire()
                    .map(|b| PyBytes::new(py, &b))
                    .map_err(descriptor)
            })
            .collect()
    }

    /// Source pins held now (kv_bank pins outstanding).
    #[getter]
    fn pins_outstanding(&self) -> u64 {
        self.inner.pins_outstanding()
    }

    /// Serves source pins on `endpoint` (`unix:/path`). Use as a context manager.
    ///
    /// Raises `BadArgument` naming `endpoint` when it does not parse (scheme,
    /// path length, a NUL byte) or its socket path is relative (the endpoint
    /// is handed to targets with other working directories),
    /// `PinServiceFailed` when binding it fails.
    fn serve_pins(&self, endpoint: &str) -> PyResult<PinServer> {
        served_pin_endpoint("endpoint", endpoint)?;
        let svc = PinService::bind(self.inner.clone(), endpoint, PinServiceConfig::default())
            .map_err(|e| PinServiceFailed::new_err(e.to_string()))?;
        Ok(PinServer {
            inner: take_once::Slot::new(svc),
        })
    }

    /// `<kv_reuse.DonorBank engine_id='...' slots=64 gpus=None closed=False
    /// layout=Layout(...)>`: `gpus` the CUDA ordinal of each rank's bank,
    /// None for a host-shm bank; `closed` once its publisher closed it.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let manifest = self.inner.manifest();
        let gpus: Option<Vec<u32>> = manifest
            .parts()
            .iter()
            .map(|p| match p.location() {
                MemoryLocation::Gpu(g) => Some(g.ordinal),
                MemoryLocation::Host { .. } => None,
            })
            .collect();
        Ok(Repr::object(py, "DonorBank")
            .field("engine_id", self.engine_id())?
            .field("slots", manifest.slot_count())?
            .field("gpus", gpus)?
            .field("closed", self.inner.is_closed())?
            .shown("layout", &self.layout.__repr__())
            .finish())
    }
}

/// Blocks reserved in the bank, written per TP rank and acknowledged per rank.
///
/// The store's rows are exactly the blocks the bank lacked: `store(tokens)`
/// skips the sealed blocks already retained (ready, or pending in another
/// store) and stops at the exclusion lineage, and `sequence_hashes` lists
/// the rest, in prefix order. `write` takes one row per entry of
/// `sequence_hashes`, row `i` for `sequence_hashes[i]`.
#[pyclass(module = "kv_reuse")]
pub(crate) struct PendingStore {
    bank: Arc<BankManager>,
    layout: Layout,
    store_id: u64,
    /// Taken right after kv_bank's store began (its deadline is
    /// `store_timeout_s` from a moment earlier), to tell a store that timed
    /// out from one completed or aborted once kv_bank forgot it.
    started: Instant,
    /// The blocks this store writes (new to the bank), in prefix order.
    hashes: Vec<u64>,
    already_retained: usize,
    excluded: usize,
}

#[pymethods]
impl PendingStore {
    /// Sequence hashes of the blocks this store writes, in prefix order:
    /// the sealed blocks of the tokens the bank did not hold yet. Empty
    /// when it held them all (then `write` takes zero rows and `ack` is
    /// True at once). `write`'s row `i` is block `sequence_hashes[i]`.
    #[getter]
    fn sequence_hashes(&self) -> Vec<u64> {
        self.hashes.clone()
    }

    /// Sealed blocks of the tokens the bank already retained (ready, or
    /// pending in another store): not in `sequence_hashes`, not rewritten.
    #[getter]
    fn already_retained(&self) -> usize {
        self.already_retained
    }

    /// Sealed blocks refused by the exclusion lineage (the first tainted
    /// block and every later one): not in `sequence_hashes`, not stored.
    #[getter]
    fn excluded(&self) -> usize {
        self.excluded
    }

    /// Writes rank `rank`'s part of every block of `sequence_hashes` from
    /// `blocks`, a C-contiguous tensor of shape
    /// `(len(sequence_hashes), layout.rank_block_elems)` and dtype
    /// `layout.typestr` (row `i` = block `sequence_hashes[i]`):
    ///
    /// - a host tensor (numpy through `__array_interface__`, a CPU torch
    ///   tensor through DLPack), read in place: into shm on a host bank, one
    ///   host-to-device copy per row on a CUDA bank (counted in
    ///   `DonorBank.stats["store_bytes_from_host"]`);
    /// - on a CUDA bank, a CUDA tensor on the rank's GPU (torch, CuPy;
    ///   DLPack preferred, else `__cuda_array_interface__`): copied device
    ///   to device on the legacy default stream after the producer's work
    ///   (DLPack `stream=1`), synchronized before `write` returns, so no
    ///   payload byte passes through the host
    ///   (`stats["store_bytes_from_device"]`).
    ///
    /// Releases the GIL while it copies; the engine must not write `blocks`
    /// until `write` returned. Only rows whose copy succeeded count as
    /// written for `ack`; a rank that acked can no longer write.
    ///
    /// Raises `BadArgument` naming `blocks` (dtype, a typestr that is none,
    /// shape, strides, an exporter whose protocol attribute or call raises,
    /// its exception the `__cause__`, a CUDA tensor on a host bank, a tensor on another GPU than the rank's, a
    /// CUDA array interface stream that is not a default one, a pointer
    /// that is not inside one device allocation) or `rank` (not below
    /// `tp_size`, negative); `BankFailed` from the bank (also when `rank`
    /// already acked: its part is sealed; and once the bank's
    /// `store_timeout_s` passed since `store()`: nothing is copied, the
    /// store is rolled back, and the message names the store and
    /// `store_timeout_s`, as `ack`'s does then).
    fn write(
        &self,
        py: Python<'_>,
        rank: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let rank = index_below("rank", rank, self.layout.inner.tp_size(), "tp_size")?;
        let rbb = self.layout.inner.rank_block_bytes();
        let dtype = self.layout.inner.dtype();
        let shape = [self.hashes.len(), rbb / dtype.size_bytes()];
        let memory = self.bank.rank(rank).map_err(bank)?.memory().kind();
        if let MemoryKind::Cuda { ordinal } = memory {
            if on_cuda(blocks, "blocks")? {
                let arr =
                    ArrayView::new(blocks, "blocks", dtype, &shape, Want::CudaSource(ordinal))?;
                let (ordinal, addr) = arr.device_ptr().expect("a CUDA view");
                if self.hashes.is_empty() {
                    return Ok(());
                }
                let rows = DeviceRows {
                    ordinal,
                    addr,
                    row_bytes: rbb,
                    rows: self.hashes.len(),
                };
                // `arr` keeps the tensor alive until the synchronized copy
                // returned.
                return py
                    .allow_threads(|| {
                        self.bank
                            .write_pending_from_device(self.store_id, rank, 0, rows)
                    })
                    .map_err(|e| match e {
                        BankError::InvalidArgument {
                            field: "source",
                            reason,
                        } => bad_argument("blocks", reason),
                        other => self.store_error(other, "write"),
                    });
            }
        }
        let arr = ArrayView::new(blocks, "blocks", dtype, &shape, Want::Host)?;
        let bytes = arr.bytes();
        // The copy (into shm, or host-to-device on a CUDA bank) is the long
        // part: other Python threads (the engine's) run meanwhile. `arr`
        // keeps the tensor referenced until the copy returned.
        py.allow_threads(|| {
            for (index, chunk) in bytes.chunks_exact(rbb).enumerate() {
                self.bank
                    .write_pending(self.store_id, rank, index, chunk)
                    .map_err(|e| self.store_error(e, "write"))?;
            }
            Ok(())
        })
    }

    /// Acknowledges rank `rank`'s writes; True once every rank acked (the
    /// blocks are in the inventory and a Stored event is queued). True at
    /// once for a store with no blocks to write (`sequence_hashes` empty).
    ///
    /// The bank checks the ack: it is refused while a block of `rank` was
    /// not written by a successful `write` (acking it would publish what the
    /// slot held before, another block's KV). A refused ack changes nothing:
    /// the store stays pending, nothing is published; write and ack again,
    /// or `abort` (the `with` block does), or the store timeout rolls it back.
    ///
    /// Raises `BadArgument` naming `rank` (not below `tp_size`, negative);
    /// `BankFailed` from the bank: the rank has unwritten blocks (the message
    /// names the rank and the first unwritten row), or the store timed out
    /// (naming the store and `store_timeout_s`) or was rolled back.
    fn ack(&self, rank: &Bound<'_, PyAny>) -> PyResult<bool> {
        let rank = index_below("rank", rank, self.layout.inner.tp_size(), "tp_size")?;
        if self.hashes.is_empty() {
            // kv_bank keeps no pending store for an empty one.
            return Ok(true);
        }
        Ok(self
            .bank
            .ack(self.store_id, rank)
            .map_err(|e| self.store_error(e, "ack"))?
            == StoreStatus::Ready)
    }

    /// Rolls the store back on every rank if it is still pending (not
    /// every rank acked): its blocks never become visible, no event is sent,
    /// and its slots return to the bank at once (a `write` still copying
    /// on another thread keeps its rows until it returns). Returns True when
    /// it rolled back, False when the store had already completed, timed
    /// out or been rolled back. Idempotent. A `PendingStore` dropped before
    /// every rank acked is aborted the same way.
    fn abort(&self, py: Python<'_>) -> bool {
        if self.hashes.is_empty() {
            return false;
        }
        // Every write of a Python store goes through `write`, i.e. kv_bank's
        // `write_pending*`, whose running copies the bank tracks: nothing
        // can land in the slots later, so kv_bank's `abort` frees them now
        // (its `fail` would quarantine them for a store timeout, for ranks
        // that write by address). It refuses a store that is no longer
        // pending (UnknownStore): a completed store is never taken back.
        py.allow_threads(|| self.bank.abort(self.store_id).is_ok())
    }

    /// A context manager: leaving the `with` block without every rank's
    /// ack (an exception, a skipped ack) rolls the store back (`abort`), so
    /// nothing is half-published.
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.abort(py);
        false
    }

    /// `<kv_reuse.PendingStore store_id=3 blocks=6 already_retained=0
    /// excluded=0>`: `blocks` counts `sequence_hashes` (the hashes
    /// themselves are 20-digit ints that would fill the line).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(Repr::object(py, "PendingStore")
            .field("store_id", self.store_id)?
            .field("blocks", self.hashes.len())?
            .field("already_retained", self.already_retained)?
            .field("excluded", self.excluded)?
            .finish())
    }
}

impl Drop for PendingStore {
    /// A store nobody can finish any more (this object was its only handle)
    /// gives its slots back now rather than at the store timeout, followed
    /// by a quarantine. Only in the bank's process: a forked child's copy
    /// of the bank is not its to change (and its lock may have been copied
    /// held).
    fn drop(&mut self) {
        if !self.hashes.is_empty() && self.bank.creator().is_current() {
            let _ = self.bank.abort(self.store_id);
        }
    }
}

mod take_once {
    //! A take-once cell for a service that shuts down by value.
    use std::sync::Mutex;
    pub(crate) struct Slot<T>(Mutex<Option<T>>);
    impl<T> Slot<T> {
        pub(crate) fn new(v: T) -> Self {
            Self(Mutex::new(Some(v)))
        }
        pub(crate) fn take(&self) -> Option<T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
        }
        pub(crate) fn with<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(f)
        }
    }
}

/// A running pin service (kv_router_glue::PinService); a context manager
/// that shuts it down (draining for up to 1 s) on exit.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct PinServer {
    inner: take_once::Slot<PinService>,
}

#[pymethods]
impl PinServer {
    /// The endpoint served (`unix:/path`), None after close.
    #[getter]
    fn endpoint(&self) -> Option<String> {
        self.inner.with(|s| s.endpoint().to_owned())
    }
    /// Pins granted and not yet released.
    #[getter]
    fn active_pins(&self) -> usize {
        self.inner.with(|s| s.active_pins()).unwrap_or(0)
    }
    /// Stops serving; held pins end. Idempotent. Releases the GIL.
    fn close(&self, py: Python<'_>) {
        if let Some(s) = self.inner.take() {
            py.allow_threads(|| {
                s.shutdown(Duration::from_secs(1));
            });
        }
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }
    /// `<kv_reuse.PinServer endpoint='unix:/run/d0.sock' active_pins=0>`
    /// (`endpoint=None` once closed).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(Repr::object(py, "PinServer")
            .field("endpoint", self.endpoint())?
            .field("active_pins", self.active_pins())?
            .finish())
    }
}

/// `host_id` as a bank's location, or `BadArgument` naming `host_id` with
/// [`kv_descriptor::host_id_refusal`]'s reason (kv-descriptor refuses the
/// same as `location.host_id` / `gpu.host_id`, names a Python caller never
/// sees).
pub(crate) fn check_host_id(host_id: &str) -> PyResult<()> {
    match kv_descriptor::host_id_refusal(host_id) {
        Some(why) => Err(bad_argument("host_id", why)),
        None => Ok(()),
    }
}

/// A bank's slot count: an int in `1..=kv_descriptor::MAX_SLOTS`, or
/// `BadArgument` naming `slots` and that range, also for a negative int or
/// one past u64 (kv_bank would refuse a larger one as an invalid
/// `budget_bytes`, a name a Python caller never gave).
pub(crate) fn slot_count(slots: &Bound<'_, PyAny>) -> PyResult<u64> {
    crate::errors::uint_in("slots", slots, 1..=u64::from(kv_descriptor::MAX_SLOTS))
}

/// `endpoint` parsed as a pin endpoint (`unix:<absolute path>`, a plain
/// absolute path, or `tcp:<host>:<port>`), or `BadArgument` naming
/// `argument` with [`PinEndpoint::parse`]'s reason: scheme, path length, a
/// NUL byte, a relative socket path (the endpoint travels to targets in other
/// processes, which would resolve it against their own working
/// directories), port.
pub(crate) fn pin_endpoint(argument: &str, endpoint: &str) -> PyResult<PinEndpoint> {
    PinEndpoint::parse(endpoint).map_err(|e| bad_argument(argument, e))
}

/// [`pin_endpoint`] for an endpoint this process serves pins on: a `tcp:`
/// one is refused too. kv-router-glue's TCP pins need a pre-shared key,
/// which this API does not take: refused here naming the argument, not
/// later by the pin service naming its Rust setting (`auth_key`). (A
/// router may still be told of a Rust donor's TCP endpoint.)
pub(crate) fn served_pin_endpoint(argument: &str, endpoint: &str) -> PyResult<PinEndpoint> {
    let parsed = pin_endpoint(argument, endpoint)?;
    if endpoint.starts_with("tcp:") {
        return Err(bad_argument(
            argument,
            format!(
                "{endpoint:?}: TCP pin endpoints are not served from Python (they need a \
                 pre-shared key this API does not take); use `unix:<absolute path>`"
            ),
        ));
    }
    Ok(parsed)
}

impl PendingStore {
    /// A refusal of `write` / `ack` (`call`) as `BankFailed`, in the words
    /// of the Python API: kv_bank's own text names its Rust calls
    /// (`write_pending` / `write_pending_from_device`, `fail`), arguments
    /// (`index`, `store_id`) and settings (its store timeout in ms), which a
    /// Python caller never sees; the rest is kv_bank's text.
    fn store_error(&self, e: BankError, call: &str) -> PyErr {
        let timeout_s = self.bank.config().store_timeout.as_secs_f64();
        let msg = match e {
            BankError::Unwritten {
                store_id,
                rank,
                missing,
                first,
            } => format!(
                "store {store_id}: `rank` {rank} acked with {missing} unwritten rows (first: row \
                 {first} of `blocks`); `write({rank}, blocks)` before acking, or `abort()` the store"
            ),
            BankError::RankAcked { store_id, rank, .. } => format!(
                "store {store_id}: `rank` {rank} already acked, its rows are sealed (`write` refused)"
            ),
            // The setting the caller gave (`store_timeout_s`), not only the
            // time that passed: a late write or ack names what it missed.
            BankError::StoreTimedOut {
                store_id,
                waited_ms,
                missing,
                ..
            } => format!(
                "store {store_id} timed out: store_timeout_s={timeout_s} passed before every rank \
                 acked (ranks {missing:?} had not; {waited_ms} ms since `store`); it was rolled \
                 back, `{call}` refused"
            ),
            // kv_bank forgets a store its expiry sweep (any `store()`)
            // rolled back: past the deadline, that is what happened to it.
            BankError::UnknownStore(store_id)
                if self.started.elapsed().as_secs_f64() >= timeout_s =>
            {
                format!(
                    "store {store_id} timed out: store_timeout_s={timeout_s} passed before every \
                     rank acked; it was rolled back, `{call}` refused"
                )
            }
            BankError::UnknownStore(store_id) => format!(
                "store {store_id} is no longer pending (it completed, was aborted or timed out)"
            ),
            other => return bank(other),
        };
        crate::errors::BankFailed::new_err(msg)
    }
}
