//! The target (prefill) role: check a hint against the prompt and execute it
//! with kv_router_glue's `FetchExecutor` into this target's host rows, pinning
//! through the donor's pin service (`RemoteDonor`) and reading its host shm.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::{PyTraverseError, PyVisit};

use kv_bank::{BankError, BankMemory, DestinationPool};
use kv_descriptor::{BankManifest, EngineId, HintEnvelope, SequenceHash, Wire};
use kv_router_glue::{
    check_prompt_prefix, validate_hint, EngineRegion, FetchError, FetchExecutor, RemoteDonor,
    DEFAULT_PIN_TIMEOUT,
};
use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
use kv_transfer::{CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend};

use crate::array::{ArrayView, ExternalMemory, Want};
use crate::donor_imports::DonorImports;
use crate::engine_layout::EngineOrder;
use crate::errors::{
    bad_argument, descriptor, fetch, index_below, uint, uints, BankFailed, CudaUnavailable,
    FetchFellBack, HintRefused,
};
use crate::fetch_job::{run_job, FetchJob, FetchJobs};
use crate::fetch_outcome::{micros, FetchOutcome};
use crate::layout::Layout;
use crate::stream_gate::StreamGate;

/// A prefill target with `rows` destination rows (KV blocks) per TP rank:
/// its own host buffers, or the engine's KV tensors (`kv_caches`).
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct Target {
    engine: EngineId,
    /// CUDA ordinal of each rank's destination (the GPU path), or None.
    gpus: Option<Vec<u32>>,
    /// How the destination tensors are laid out.
    order: EngineOrder,
    layout: Layout,
    /// Destination rows (KV blocks) per TP rank.
    rows: u32,
    regions: Vec<Arc<dyn BankMemory>>,
    /// The regions that are the engine's tensors (`kv_caches`), typed: the
    /// Python objects they hold are shown to the garbage collector
    /// (`__traverse__`). Every clone of these `Arc`s lives in this target
    /// (`regions`, `executor`), so the references they hold are this
    /// target's alone.
    external: Vec<Arc<ExternalMemory>>,
    executor: FetchExecutor,
    /// CUDA IPC donors kept imported between fetches (donor_imports.rs).
    imports: DonorImports,
    /// The thread `fetch_async` runs fetches on.
    jobs: FetchJobs,
}

/// A fetch whose arguments `Target::prepare` checked, ready to run without
/// the GIL (on the calling thread, or the target's fetch thread).
struct PreparedFetch {
    envelope: HintEnvelope,
    prompt: Vec<SequenceHash>,
    /// The manifest's wire bytes: the key of kept CUDA IPC imports.
    manifest_bytes: Vec<u8>,
    manifest: BankManifest,
    dst_blocks: Option<Vec<u32>>,
    endpoint: String,
    pin_timeout: Duration,
    control: DeliveryControl,
    /// The `donor_alive` probe's callable and what it raised (the
    /// fallback's `__cause__`), taken back by the caller once the fetch
    /// ended: a clone of this `Arc` is taken before the fetch runs.
    probe: Option<Arc<Probe>>,
    /// Ends the fetch's `StreamGate` when the fetch is done (dropped).
    _gate_end: Option<crate::stream_gate::GateEnd>,
}

#[pymethods]
impl Target {
    /// `kv_caches`, when given, is the engine's own KV cache: one
    /// C-contiguous, writable host tensor per TP rank (numpy or a CPU torch
    /// tensor via DLPack) of shape `(rows, layout.rank_block_elems)` and
    /// dtype `layout.typestr`, block-major (row = the engine's block id).
    /// A fetch then writes straight into it at the rows it returns; the
    /// engine must not touch those rows until the fetch returned. Without
    /// it the target allocates its own zeroed host rows.
    ///
    /// With `gpus` (one CUDA ordinal per TP rank: the GPU path) the
    /// `kv_caches` are CUDA tensors on those devices, read through
    /// `__cuda_array_interface__` or DLPack (torch, CuPy); fetches import
    /// the donor's CUDA IPC banks and copy device to device, so no payload
    /// crosses the host (`FetchOutcome.host_payload_bytes == 0`).
    /// Synchronize the engine's stream before `fetch` and read the rows
    /// after it returns (the copy is complete then).
    ///
    /// `kv_layout` names the tensors' order (engine_layout.rs): `block_major`
    /// `[rows, rank_block_elems]` (the default), `vllm_kv_first`
    /// `[L, 2, rows, T, H, D]` or `vllm_block_first` `[L, rows, 2, T, H, D]`
    /// (H = this rank's KV heads; vLLM's per-layer tensors stacked in one
    /// buffer); the copy converts from the donor's block-major slots.
    ///
    /// Raises `BadArgument` naming `rows`, `gpus`, `kv_layout` or `kv_caches[r]` (count,
    /// dtype, shape, strides, read-only, a tensor on another device, a CUDA
    /// tensor on the host path or a CPU tensor on the GPU path, memory that
    /// overlaps an earlier `kv_caches` tensor's: the same tensor twice), or
    /// `rows` / `gpus[i]` for a negative int or one past u32;
    /// `CudaUnavailable` on the GPU path without a CUDA driver; `BankFailed`
    /// when the host rows cannot be allocated (naming `rows` and the bytes
    /// they would take).
    #[new]
    #[pyo3(signature = (layout, rows, kv_caches = None, gpus = None, kv_layout = "block_major"))]
    fn new(
        layout: Layout,
        rows: &Bound<'_, PyAny>,
        kv_caches: Option<Vec<Bound<'_, PyAny>>>,
        gpus: Option<&Bound<'_, PyAny>>,
        kv_layout: &str,
    ) -> PyResult<Self> {
        let rows: u32 = crate::errors::uint_in("rows", rows, 1..=u64::from(u32::MAX))?;
        let gpus: Option<Vec<u32>> = gpus.map(|g| uints("gpus", g)).transpose()?;
        let order = EngineOrder::parse(kv_layout)?;
        if order != EngineOrder::BlockMajor && kv_caches.is_none() {
            return Err(bad_argument(
                "kv_caches",
                format!("required with kv_layout={kv_layout:?} (the engine's tensors)"),
            ));
        }
        let rbb = layout.inner.rank_block_bytes();
        let tp = layout.inner.tp_size() as usize;
        if let Some(g) = &gpus {
            if g.len() != tp {
                return Err(bad_argument(
                    "gpus",
                    format!("{} ordinals, expected one per TP rank ({tp})", g.len()),
                ));
            }
            if kv_caches.is_none() {
                return Err(bad_argument(
                    "kv_caches",
                    "required with `gpus` (the engine's CUDA tensors)",
                ));
            }
        }
        let mut hf_layouts = Vec::new();
        // Bytes each destination tensor claimed: two ranks (or layers) must
        // not be given the same memory.
        let mut claimed = Claimed::default();
        let mut external = Vec::new();
        let regions: Vec<Arc<dyn BankMemory>> = match kv_caches {
            None => (0..tp)
                .map(|_| {
                    HostBuffer::zeroed(rows as usize * rbb)
                        .map(|b| Arc::new(b) as Arc<dyn BankMemory>)
                })
                .collect::<Result<Vec<_>, _>>()
                // `rows` is what asked for the memory: name it and what it
                // would take, not only the allocator's byte count.
                .map_err(|e| {
                    BankFailed::new_err(format!(
                        "rows: {rows} rows of {rbb} bytes on each of {tp} TP ranks need {} bytes \
                         of host memory ({} bytes a rank), which could not be allocated ({e}); \
                         lower `rows` or pass the engine's `kv_caches`",
                        (rows as u128) * (rbb as u128) * (tp as u128),
                        rows as usize * rbb,
                    ))
                })?,
            Some(caches) if order == EngineOrder::Hf => {
                if caches.len() != tp {
                    return Err(bad_argument(
                        "kv_caches",
                        format!("{} lists, expected one per TP rank ({tp})", caches.len()),
                    ));
                }
                let mut out = Vec::with_capacity(tp);
                for (r, list) in caches.iter().enumerate() {
                    let tensors = hf_tensors(list, r, layout.inner.num_layers() as usize)?;
                    let want = gpus.as_ref().map_or(Want::Host, |g| Want::Cuda(g[r]));
                    let views = tensors
                        .iter()
                        .enumerate()
                        .map(|(i, t)| {
                            let arg = format!("kv_caches[{r}][{i}]");
                            let v = ArrayView::new_strided(t, &arg, layout.inner.dtype(), want)
                                .and_then(|v| v.writable(&arg))?;
                            // The dense last axis of its first token: bytes of
                            // this tensor alone (the spans of strided views
                            // of one buffer interleave without sharing bytes).
                            let row = layout.inner.head_dim() as usize
                                * layout.inner.dtype().size_bytes();
                            claimed.claim(&arg, v.memory_kind(), v.addr(), row)?;
                            Ok(v)
                        })
                        .collect::<PyResult<Vec<_>>>()?;
                    let (region, base, len) =
                        crate::engine_layout::hf_region(layout.inner, r as u32, rows, &views)?;
                    let kind = views[0].memory_kind();
                    hf_layouts.push(region);
                    let memory = Arc::new(ExternalMemory::spanning(views, base, len, kind));
                    external.push(memory.clone());
                    out.push(memory as Arc<dyn BankMemory>);
                }
                out
            }
            Some(caches) => {
                if caches.len() != tp {
                    return Err(bad_argument(
                        "kv_caches",
                        format!("{} tensors, expected one per TP rank ({tp})", caches.len()),
                    ));
                }
                let shape = order.shape(&layout.inner, rows);
                caches
                    .iter()
                    .enumerate()
                    .map(|(r, t)| {
                        let arg = format!("kv_caches[{r}]");
                        let want = gpus.as_ref().map_or(Want::Host, |g| Want::Cuda(g[r]));
                        let v = ArrayView::new(t, &arg, layout.inner.dtype(), &shape, want)
                            .and_then(|v| v.writable(&arg))?;
                        // C-contiguous: the span is exactly its bytes.
                        claimed.claim(&arg, v.memory_kind(), v.addr(), v.span_bytes())?;
                        let memory = Arc::new(v.into_memory());
                        external.push(memory.clone());
                        Ok(memory as Arc<dyn BankMemory>)
                    })
                    .collect::<PyResult<Vec<_>>>()?
            }
        };
        let backend: Arc<dyn CopyBackend> = match &gpus {
            None => Arc::new(HostCopyBackend),
            Some(_) => Arc::new(
                CudaCopyBackend::new(CudaMode::Auto)
                    .map_err(|e| CudaUnavailable::new_err(format!("gpus: {e}")))?,
            ),
        };
        let executor = if order == EngineOrder::BlockMajor {
            FetchExecutor::new(
                layout.inner,
                DestinationPool::new(rows),
                regions.clone(),
                rows,
                backend,
            )
            .map_err(fetch)?
        } else {
            let engine_regions = regions
                .iter()
                .enumerate()
                .map(|(r, memory)| {
                    match hf_layouts.get(r) {
                        Some(l) => Ok(l.clone()),
                        None => order.region(layout.inner, r as u32, rows),
                    }
                    .map(|l| EngineRegion {
                        memory: memory.clone(),
                        layout: l,
                    })
                    .map_err(|e| bad_argument("kv_layout", format!("rank {r}: {e}")))
                })
                .collect::<PyResult<Vec<_>>>()?;
            FetchExecutor::with_engine_regions(
                layout.inner,
                DestinationPool::new(rows),
                engine_regions,
                backend,
            )
            .map_err(|e| match e {
                // A backend that cannot convert, or a tensor too small for its layout.
                FetchError::LayoutMismatch { field, detail } => {
                    bad_argument("kv_layout", format!("{field}: {detail}"))
                }
                other => fetch(other),
            })?
        };
        Ok(Self {
            engine: EngineId::fresh(),
            gpus,
            order,
            layout,
            rows,
            regions,
            external,
            executor,
            imports: DonorImports::default(),
            jobs: FetchJobs::default(),
        })
    }

    /// Shows the garbage collector the engine's tensors (exporters and
    /// DLPack capsules) this target holds, so that a reference cycle
    /// through it is collected: a `kv_caches` exporter whose class is
    /// defined in the engine's script reaches the script's globals, which
    /// hold the target; unseen, that cycle (and a donor bank in the same
    /// globals, with its /dev/shm segments and leases) outlived interpreter
    /// exit. Visits every Python object the target holds; it holds no
    /// other (`donor_alive` lives with a fetch, not the target).
    ///
    /// There is deliberately no `__clear__`: the exporters are the memory a
    /// fetch writes through raw pointers, so the target lets go of them
    /// only in its own drop, when no fetch can run (each fetch holds the
    /// target: `fetch` through its caller's reference, a `fetch_async` job
    /// through the `Py<Target>` its fetch thread owns until the fetch
    /// ends). Those references are invisible to the collector, so a target
    /// with a fetch in flight is never part of garbage at all. (Once the
    /// fetch ended, the fetch thread hands that reference to the
    /// `FetchJob`, which shows it and may drop it in its `__clear__`:
    /// nothing writes into the target for that job any more.) A cycle
    /// through a target is broken
    /// by clearing its other members (the exporter's `__dict__`, the
    /// script's globals), after which the target's refcount reaches zero
    /// and its drop releases the exporters. Such a clear may free an
    /// exporter's memory before the target's drop (an `__array_interface__`
    /// object whose `__dict__` held the array): harmless, since nothing
    /// reaches the garbage target to start a fetch and its drop reads or
    /// writes none of that memory.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for memory in &self.external {
            memory.traverse(&visit)?;
        }
        Ok(())
    }

    /// Donors whose CUDA IPC banks this target keeps imported between
    /// fetches (at most 8; each holds one mapping per TP rank). A donor's
    /// entry goes when its lease is no longer live (checked at every
    /// fetch from it, and for all at most once a second), when a fetch
    /// from it fell back, or by `forget_donors()`.
    #[getter]
    fn imported_donors(&self) -> usize {
        self.imports.len()
    }

    /// Drops every kept donor import (its mappings close unless a fetch
    /// in flight still holds them); returns how many were kept. Call it
    /// when the target stops fetching for a while, so no dead donor's
    /// device memory stays mapped here.
    fn forget_donors(&self, py: Python<'_>) -> usize {
        py.allow_threads(|| self.imports.clear())
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

    /// `<kv_reuse.Target engine_id='...' rows=8 free_rows=8
    /// kv_layout='block_major' gpus=None layout=Layout(...)>`.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(crate::reprs::Repr::object(py, "Target")
            .field("engine_id", self.engine_id())?
            .field("rows", self.rows)?
            .field("free_rows", self.free_rows())?
            .field("kv_layout", self.order.name())?
            .field("gpus", self.gpus.clone())?
            .shown("layout", &self.layout.__repr__())
            .finish())
    }

    /// Executes `hint` (MessagePack envelope from `Advice.hint`) for a prompt
    /// whose sealed blocks have `prompt_hashes`, from the donor whose
    /// manifest (wire form) is `manifest`. Releases the GIL while it runs.
    ///
    /// `donor_alive`, when given, is a callable returning False once the
    /// donor is gone (its process exited, its lease lapsed); it is called
    /// (with the GIL) before the first byte and after the last one of each
    /// TP rank's transfer (`2 * tp_size` calls a fetch), so bytes read from
    /// a donor that died meanwhile are never reported complete. A
    /// probe that raises (or returns a non-bool) counts as a dead donor; its
    /// exception is the `__cause__` of the `FetchFellBack`. `pin_timeout_s` bounds each
    /// exchange with the donor's pin service (default 2 s).
    ///
    /// `dst_blocks`, when given, are the engine's block ids (rows of
    /// `kv_caches`) for the fetched blocks, in prefix order, chosen by the
    /// engine's allocator; by default the target's pool picks free rows.
    /// Either way `FetchOutcome.rows` says where the blocks landed.
    ///
    /// `manifest` is the donor's `DonorDirectory.manifest` (or
    /// `DonorBank.manifest()` in process); None, which the directory
    /// answers once the donor's record is gone, is `HintRefused`.
    ///
    /// Raises `PromptMismatch` / `HintRefused` before anything is touched
    /// (the hint is checked against `prompt_hashes`, then against
    /// `manifest` and this target's layout: donor engine, bank generation,
    /// layout, TP size, slots; all before `dst_blocks` is checked and the
    /// donor's segments are imported, so a hint for another prompt is a
    /// mismatch even when its donor is gone, and a hint for another donor
    /// or a closed generation is `HintRefused` naming that, whatever
    /// `dst_blocks` holds), `FetchFellBack` (stage, cause) after:
    /// recompute the prefix then. `BadArgument` names `prompt_hashes[i]`,
    /// `dst_blocks[i]` or `dst_token_offset` for a negative int or one past
    /// u64 (hashes, offset) / u32 (block ids), `dst_blocks` when it does not
    /// hold one id per fetched block, and `dst_blocks[i]` for an id not
    /// below `rows` or given twice (checked before anything is touched).
    ///
    /// On `kv_layout="hf"` block `b` is tokens `b*T .. (b+1)*T` of every
    /// cache tensor; `dst_token_offset=N` (a multiple of T) lands the
    /// fetched blocks at tokens `N, N+T, ...` (blocks `N/T ..`); without it
    /// and without `dst_blocks` they land where they sit in the prompt
    /// (tokens `fetch_from*T ..`). `BadArgument` names `dst_token_offset`
    /// when it is not a multiple of T, is given with `dst_blocks` or on
    /// another layout, or the blocks would end past `rows * T` tokens.
    ///
    /// `gate` (a `StreamGate`, CUDA targets only): the gate's stream is made
    /// to wait for this fetch's copies as soon as they are issued and the
    /// gate opens, so an engine thread blocked in `gate.wait()` can enqueue
    /// its forward while this call (run from another thread) still
    /// completes; work enqueued so must be discarded if this call raises.
    /// `BadArgument` names `gate` when its device is none of the target's
    /// GPUs, on a host target, or when it served a fetch already.
    #[pyo3(signature = (hint, prompt_hashes, manifest, donor_alive = None, pin_timeout_s = None, dst_blocks = None, dst_token_offset = None, gate = None))]
    // One Rust argument per Python keyword argument (each optional).
    #[allow(clippy::too_many_arguments)]
    fn fetch(
        &self,
        py: Python<'_>,
        hint: &[u8],
        prompt_hashes: &Bound<'_, PyAny>,
        manifest: Option<&[u8]>,
        donor_alive: Option<Py<PyAny>>,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] pin_timeout_s: Option<f64>,
        dst_blocks: Option<&Bound<'_, PyAny>>,
        dst_token_offset: Option<&Bound<'_, PyAny>>,
        gate: Option<PyRef<'_, StreamGate>>,
    ) -> PyResult<FetchOutcome> {
        let prepared = self.prepare(
            py,
            hint,
            prompt_hashes,
            manifest,
            donor_alive,
            pin_timeout_s,
            dst_blocks,
            dst_token_offset,
            gate,
        )?;
        let probe = prepared.probe.clone();
        let out = py.allow_threads(|| self.run(prepared));
        // With the GIL: the callable is released here, not queued by pyo3.
        let left = probe.map(|p| p.take());
        out.map_err(|e| with_cause(py, e, left.and_then(|l| l.raised)))
    }

    /// `fetch` on the target's fetch thread: the same arguments, checked
    /// here (so `PromptMismatch`, `HintRefused` and `BadArgument` raise from
    /// this call, before anything runs), then the fetch runs on a thread of
    /// the wheel's own that never takes the GIL (unless `donor_alive` is
    /// given: the probe takes it). Returns a `FetchJob` at once; its
    /// `result()` returns the `FetchOutcome` or raises what `fetch` would
    /// (`FetchFellBack`, ...).
    ///
    /// Why: with `gate`, the engine thread enqueues its forward while the
    /// fetch completes. A Python thread running `fetch` needs the GIL to
    /// start and to finish, which it takes from the engine thread in the
    /// middle of the forward's launches; the wheel's thread does not. Fetches
    /// of one target run one after another on that thread, in call order.
    #[pyo3(signature = (hint, prompt_hashes, manifest, donor_alive = None, pin_timeout_s = None, dst_blocks = None, dst_token_offset = None, gate = None))]
    // One Rust argument per Python keyword argument (each optional).
    #[allow(clippy::too_many_arguments)]
    fn fetch_async(
        slf: &Bound<'_, Self>,
        hint: &[u8],
        prompt_hashes: &Bound<'_, PyAny>,
        manifest: Option<&[u8]>,
        donor_alive: Option<Py<PyAny>>,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] pin_timeout_s: Option<f64>,
        dst_blocks: Option<&Bound<'_, PyAny>>,
        dst_token_offset: Option<&Bound<'_, PyAny>>,
        gate: Option<PyRef<'_, StreamGate>>,
    ) -> PyResult<FetchJob> {
        let this = slf.get();
        let prepared = this.prepare(
            slf.py(),
            hint,
            prompt_hashes,
            manifest,
            donor_alive,
            pin_timeout_s,
            dst_blocks,
            dst_token_offset,
            gate,
        )?;
        let target: Py<Target> = slf.clone().unbind();
        let cancel = prepared.control.cancel.clone();
        let probe = prepared.probe.clone();
        let (job, done) = FetchJob::new(cancel);
        this.jobs.submit(Box::new(move || {
            let out = run_job(done.state(), || target.get().run(prepared));
            // The fetch ended (or never started): its Python references
            // (the target, the probe's callable and exception) go to the
            // job, which releases them with the GIL and shows them to the
            // collector meanwhile. Dropped here, without the GIL, pyo3 would
            // queue their decrefs until the next call into the wheel.
            let left = probe.map(|p| p.take());
            let (raised, callable) = left.map_or((None, None), |l| (l.raised, l.callable));
            let held = std::iter::once(target.into_any()).chain(callable).collect();
            done.finish(out, raised, held);
        }))?;
        Ok(job)
    }

    /// The bytes of destination row `row` of rank `rank` (a copy; use
    /// `numpy.frombuffer(..., dtype)` to view them).
    ///
    /// Raises `BadArgument` naming `rank` (not below `tp_size`, negative)
    /// or `row` (not below the target's `rows`, with both numbers;
    /// negative; on another layout than block-major or rows in CUDA memory).
    fn read_row<'py>(
        &self,
        py: Python<'py>,
        rank: &Bound<'_, PyAny>,
        row: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let tp_size = self.regions.len() as u32;
        let rank = index_below("rank", rank, tp_size, "tp_size")?;
        let region = &self.regions[rank as usize];
        if self.order != EngineOrder::BlockMajor {
            return Err(bad_argument(
                "row",
                "read_row reads block-major rows; read the engine's kv_caches instead",
            ));
        }
        let row = index_below("row", row, self.rows, "rows")?;
        let rbb = self.layout.inner.rank_block_bytes();
        let mut buf = vec![0u8; rbb];
        region
            .read_bytes(row as usize * rbb, &mut buf)
            .map_err(|e| match e {
                // kv_bank names its own call (`read_bytes`); say what the
                // Python caller can do instead.
                BankError::Unsupported { kind, .. } => bad_argument(
                    "row",
                    format!(
                        "read_row reads host rows, rank {rank}'s are in {kind} memory; \
                         read the engine's kv_caches instead"
                    ),
                ),
                other => bad_argument("row", other),
            })?;
        Ok(PyBytes::new(py, &buf))
    }
}

impl Target {
    /// `fetch`'s checks, with the GIL: the arguments decoded, the hint
    /// checked against the prompt, the gate armed. Every way out ends the
    /// gate (its end guard travels in the result and ends it when the fetch
    /// is done).
    // One Rust argument per Python keyword argument (each optional).
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        hint: &[u8],
        prompt_hashes: &Bound<'_, PyAny>,
        manifest: Option<&[u8]>,
        donor_alive: Option<Py<PyAny>>,
        pin_timeout_s: Option<f64>,
        dst_blocks: Option<&Bound<'_, PyAny>>,
        dst_token_offset: Option<&Bound<'_, PyAny>>,
        gate: Option<PyRef<'_, StreamGate>>,
    ) -> PyResult<PreparedFetch> {
        // First: every way out of this call, an argument error included,
        // ends the gate, so a thread waiting on it never hangs.
        let gate_end = gate.as_ref().map(|g| g.end_guard());
        let prompt: Vec<SequenceHash> = uints::<u64>("prompt_hashes", prompt_hashes)?
            .into_iter()
            .map(SequenceHash)
            .collect();
        let dst_blocks: Option<Vec<u32>> =
            dst_blocks.map(|d| uints("dst_blocks", d)).transpose()?;
        let dst_token_offset: Option<u64> = dst_token_offset
            .map(|o| uint("dst_token_offset", o))
            .transpose()?;
        let envelope = HintEnvelope::from_wire(hint).map_err(descriptor)?;
        let manifest = manifest
            .map(|m| BankManifest::from_wire(m).map(|d| (m.to_vec(), d)))
            .transpose()
            .map_err(descriptor)?;
        let actions = envelope.fetch_gpu_actions().map_err(descriptor)?;
        // The hint is checked against the prompt before the donor is
        // imported or asked anything: a hint for another prompt is
        // `PromptMismatch` even when its donor is gone.
        for action in &actions {
            check_prompt_prefix(action, &prompt).map_err(fetch)?;
        }
        // `DonorDirectory.manifest` answers None once the donor's record is
        // gone: a donor that stopped is a refused hint (a `KvReuseError`
        // the engine falls back on), not a `TypeError`.
        let Some((manifest_bytes, manifest)) = manifest else {
            let donor = actions.first().map_or_else(
                || "the hint's donor".to_string(),
                |a| format!("donor {}", a.donor_engine_id),
            );
            return Err(HintRefused::new_err(format!(
                "manifest: None: {donor} has no directory record (it stopped, or its lease \
                 lapsed): recompute the prefix"
            )));
        };
        // Then the hint against the donor's manifest and this target's
        // layout (donor engine, bank generation, layout, TP size, slots),
        // the executor's own first check, run here so that a hint for
        // another donor or a closed generation is `HintRefused` naming that
        // cause before the `dst_blocks` checks below: its block count means
        // nothing, and an allocator's "wrong count" would hide the real cause.
        for action in &actions {
            validate_hint(action, &manifest, &self.layout.inner).map_err(fetch)?;
        }
        // The executor's own check (count, then each id below the pool's
        // `rows`, none repeated), run here so that an allocator bug raises
        // `BadArgument` from this call, before the donor is imported or
        // asked (and from `fetch_async` itself, not its job).
        if let (Some(d), Some(a)) = (&dst_blocks, actions.first()) {
            self.executor.check_dst_blocks(a, d).map_err(fetch)?;
        }
        let dst_blocks = self.hf_dst_blocks(&actions, dst_blocks, dst_token_offset)?;
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
        let consumer = match (&gate, &self.gpus) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(bad_argument(
                    "gate",
                    "a host target delivers to no CUDA stream",
                ))
            }
            (Some(g), Some(gpus)) => {
                let a = &actions[0];
                let from = a.fetch_from;
                let blocks = (a.sequence_hashes.len() as u32).saturating_sub(from);
                Some(g.arm(gpus, from, blocks)?)
            }
        };
        let (live, probe) = donor_alive.map(python_probe).unzip();
        let control = DeliveryControl {
            donor_alive: live,
            consumer,
            ..DeliveryControl::default()
        };
        Ok(PreparedFetch {
            envelope,
            prompt,
            manifest_bytes,
            manifest,
            dst_blocks,
            endpoint,
            pin_timeout,
            control,
            probe,
            _gate_end: gate_end,
        })
    }

    /// Runs a prepared fetch; needs no GIL (a `donor_alive` probe takes it).
    /// Its error holds no Python object (made without the GIL); the probe's
    /// exception, if it raised, is chained by the caller, which takes it
    /// back from the `Probe` (a clone of `p.probe` taken before this call).
    fn run(&self, p: PreparedFetch) -> PyResult<FetchOutcome> {
        let PreparedFetch {
            envelope,
            prompt,
            manifest_bytes,
            manifest,
            dst_blocks,
            endpoint,
            pin_timeout,
            control,
            probe: _,
            _gate_end,
        } = p;
        let out = (|| {
            let started = std::time::Instant::now();
            // A donor whose segments are gone (it exited) is a fallback like
            // a refused pin: the request recomputes.
            let import_failed = |e: kv_router_glue::RemoteDonorError| {
                FetchFellBack::new_err((format!("donor import: {e}"), "import", "donor_import"))
            };
            let donor = match &self.gpus {
                None => Arc::new(
                    RemoteDonor::open_host_shm(manifest, &endpoint)
                        .map_err(import_failed)?
                        .with_timeout(pin_timeout),
                ),
                // Each rank's bank is imported on the GPU that reads it,
                // once per donor bank: kept for later fetches while its
                // lease is live.
                Some(g) => self
                    .imports
                    .get_or_open(&manifest_bytes, &endpoint, pin_timeout, || {
                        RemoteDonor::open_cuda_ipc(manifest, g, &endpoint)
                            .map(|d| d.with_timeout(pin_timeout))
                    })
                    .map_err(import_failed)?,
            };
            let import_us = micros(started.elapsed());
            let result = match &dst_blocks {
                None => self
                    .executor
                    .execute_for_prompt(&envelope, &prompt, &*donor, &control),
                Some(d) => self
                    .executor
                    .execute_for_prompt_at(&envelope, &prompt, d, &*donor, &control),
            };
            if result.is_err() {
                // It may be gone: the next fetch from it imports afresh.
                self.imports.forget(&donor);
            }
            result
                .map(|out| (out, import_us, micros(started.elapsed())))
                .map_err(fetch)
        })()?;
        let (out, import_us, total_us) = out;
        Ok(FetchOutcome::new(out, import_us, total_us))
    }

    /// The destination blocks of an HF-layout fetch (see `fetch`), or
    /// `dst_blocks` unchanged on the other layouts.
    fn hf_dst_blocks(
        &self,
        actions: &[kv_descriptor::FetchGpuHint],
        dst_blocks: Option<Vec<u32>>,
        dst_token_offset: Option<u64>,
    ) -> PyResult<Option<Vec<u32>>> {
        let arg = "dst_token_offset";
        if self.order != EngineOrder::Hf {
            return match dst_token_offset {
                Some(_) => Err(bad_argument(arg, "only with kv_layout=\"hf\"")),
                None => Ok(dst_blocks),
            };
        }
        if dst_blocks.is_some() {
            return match dst_token_offset {
                Some(_) => Err(bad_argument(
                    arg,
                    "give dst_blocks or dst_token_offset, not both",
                )),
                None => Ok(dst_blocks),
            };
        }
        // More than one action is refused by the executor, naming it.
        let Some(a) = actions.first() else {
            return Ok(None);
        };
        let t = u64::from(self.layout.inner.tokens_per_block());
        let n = a
            .sequence_hashes
            .len()
            .saturating_sub(a.fetch_from as usize) as u64;
        let start = dst_token_offset.unwrap_or(u64::from(a.fetch_from) * t);
        if start % t != 0 {
            return Err(bad_argument(
                arg,
                format!("{start} is not a multiple of tokens_per_block {t}"),
            ));
        }
        let first = start / t;
        let capacity = u64::from(self.rows) * t;
        let end = start.saturating_add(n * t);
        if end > capacity {
            return Err(bad_argument(
                arg,
                format!("{n} blocks from token {start} end at {end}, past the cache's {capacity} tokens"),
            ));
        }
        Ok(Some((first..first + n).map(|b| b as u32).collect()))
    }
}

mod kv_caches;
use kv_caches::{hf_tensors, Claimed};
mod probe;
pub(crate) use probe::with_cause;
use probe::{python_probe, Probe};
