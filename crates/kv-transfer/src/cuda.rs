//! CUDA backend: copies between device regions mapped into this process
//! (a donor bank imported by CUDA IPC handle, or local device memory).
//!
//! Runs are copied with `cuMemcpyDtoDAsync` when there are few of them; many
//! scattered runs go through one launch of the converting gather kernel of
//! [`crate::cuda_gather`] (compiled once per device with NVRTC; under
//! `KV_GATHER_UPLOAD=pipelined2`, the default, a large part is cut into a few
//! launches, odd ones on a second stream, so the host packs the next while a stream runs one, see
//! [`GatherUpload`]), which also
//! lands blocks in another [`kv_descriptor::KvRegionLayout`]
//! ([`CudaCopyBackend::convert_blocks`]). The kernel runs on the destination
//! device; when the source lives on another device, peer access is enabled
//! first (IPC imports made with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` already
//! have it), and without peer access the backend falls back to device copies.
//!
//! Without libnvrtc the kernel is unavailable and every run is a device copy
//! (correct, slower for scattered blocks; a warning is logged).
//!
//! A part of more than 128 blocks whose ids fit 16 bits launches from the
//! ids its plan packed ([`crate::plan::PartPlan::packed_rows`]): before its
//! first launch the host does O(1) work (two compares of the rows' ends
//! against the regions, a slice of the ids into the parameter image), no
//! pass over the runs.
//!
//! Only the table (24 bytes per run) crosses the host: payload bytes never
//! do, so `host_payload_bytes` is 0. Every CUDA call of the crate lives here.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use kv_bank::{BankMemory, MemoryKind};
use parking_lot::Mutex;

use crate::cuda_gather::{
    ConvertPlan, ConvertShape, GatherTuning, GatherUpload, LayeredShape, PackedRows, Pipeline,
    PIPELINE_FIRST_ENV, PIPELINE_GROWTH_ENV, UPLOAD_ENV,
};
use crate::delivery::{CopyBackend, PartOutcome, RankIo, SourceRegion};
use crate::plan::PartPlan;
use crate::{DeliveryControl, TransferError};

mod device;
mod gather;
mod launch;
mod process_bound;
mod profile;
use device::Device;
use gather::launch_batches;
pub use launch::inline_compile_options;
use launch::{launch_convert, Kernels, Tables};
use process_bound::{cuda_unavailable, ProcessBound};
pub use profile::{time_raw_device_copy, LaunchPhases};

/// At most this many runs go out as individual device copies; more use the kernel.
const DIRECT_MAX_RUNS: usize = 4;
/// Blocks per kernel launch: a fetch of up to this many blocks is one launch
/// per rank; longer ones are cut, and cancellation and deadline are checked
/// between launches.
const BLOCKS_PER_LAUNCH: usize = 1 << 16;
/// Layout pairs whose [`ConvertShape`] the backend keeps (an executor lands
/// in a handful of target layouts; the oldest is dropped past this).
const CACHED_SHAPES: usize = 8;

/// Lets `ctx` access `peer`'s memory directly (NVLink / PCIe P2P). Returns
/// false when the devices cannot reach each other.
fn enable_peer_access(
    ctx: &Arc<CudaContext>,
    peer: &Arc<CudaContext>,
) -> Result<bool, TransferError> {
    ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
    // SAFETY: both are live primary contexts retained by `CudaContext`.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
    Ok(matches!(
        r,
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    ))
}

fn cuda_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TransferError {
    move |e| TransferError::Cuda {
        op,
        reason: format!("{e:?}"),
    }
}

/// True when `libcuda` can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only probes whether the shared library can be loaded.
    unsafe { sys::is_culib_present() }
}

/// Number of visible CUDA devices, 0 without a driver.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// A device's CUDA objects, used and dropped only by the process that set
/// them up ([`ProcessBound`]: a forked child forgets them).
type SharedDevice = Arc<ProcessBound<Mutex<Device>>>;

/// Copies between CUDA regions: device copies for a few runs, the NVRTC
/// gather kernel for many. One stream per destination device; parts on the
/// same device are serialized.
///
/// After `fork()` a child inherits the backend but may not use its CUDA
/// objects: there every copy is refused
/// ([`TransferError::CudaUnavailable`], naming both processes) and the
/// drop forgets the devices' streams, events and kernels instead of
/// destroying them (`cuda/process_bound.rs`).
pub struct CudaCopyBackend {
    devices: Mutex<HashMap<u32, SharedDevice>>,
    use_kernel: bool,
    tuning: GatherTuning,
    /// How block tables reach the kernel (`KV_GATHER_UPLOAD`).
    upload: GatherUpload,
    /// Chunk sizes of [`GatherUpload::Pipelined`].
    pipeline: Pipeline,
    /// Shapes of the converting parts seen, newest last: a fetch into a
    /// known layout pair builds no piece table.
    shapes: Mutex<Vec<Arc<ConvertShape>>>,
    /// Cached shapes cut into layer groups (by shape pointer and group
    /// count), for consumers released layer group by layer group.
    layered: Mutex<Vec<(u32, Arc<LayeredShape>)>>,
}

impl std::fmt::Debug for CudaCopyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyBackend")
            .field("devices", &self.devices.lock().keys().collect::<Vec<_>>())
            .field("use_kernel", &self.use_kernel)
            .field("tuning", &self.tuning)
            .field("upload", &self.upload)
            .field("pipeline", &self.pipeline)
            .finish()
    }
}

/// How a CUDA part is issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaMode {
    /// Device copies for up to 4 runs, the gather kernel beyond.
    Auto,
    /// One `cuMemcpyDtoDAsync` per run, never the kernel (the baseline).
    CopyPerRun,
}

/// The upload variant and pipeline chunking named by `KV_GATHER_UPLOAD`,
/// `KV_GATHER_PIPELINE_FIRST_KIB` and `KV_GATHER_PIPELINE_GROWTH` as `get`
/// reports them (unset: [`GatherUpload::default`], [`Pipeline::default`]).
///
/// # Errors
/// [`TransferError::InvalidInput`] naming the variable.
pub fn upload_from_env(
    get: impl Fn(&str) -> Option<String>,
) -> Result<(GatherUpload, Pipeline), TransferError> {
    let upload = match get(UPLOAD_ENV) {
        Some(v) => GatherUpload::parse(&v).map_err(|e| TransferError::input(UPLOAD_ENV, e))?,
        None => GatherUpload::default(),
    };
    let num = |name: &'static str, default: u64| -> Result<u64, TransferError> {
        get(name).map_or(Ok(default), |v| {
            v.trim()
                .parse()
                .map_err(|_| TransferError::input(name, format!("`{v}` is not an integer")))
        })
    };
    let d = Pipeline::default();
    let first_kib = num(PIPELINE_FIRST_ENV, d.first_bytes() >> 10)?;
    let growth = num(PIPELINE_GROWTH_ENV, d.growth())?;
    let pipeline = Pipeline::new(first_kib.saturating_mul(1024), growth).map_err(|e| {
        TransferError::input(
            if e.starts_with("growth") {
                PIPELINE_GROWTH_ENV
            } else {
                PIPELINE_FIRST_ENV
            },
            e,
        )
    })?;
    Ok((upload, pipeline))
}

impl CudaCopyBackend {
    /// A backend; devices are initialised on first use. The block-table
    /// variant and pipeline chunking come from `KV_GATHER_UPLOAD`
    /// (`params`, `pipelined`, `pipelined2` (default) or `copy`, see
    /// [`GatherUpload`]),
    /// `KV_GATHER_PIPELINE_FIRST_KIB` and `KV_GATHER_PIPELINE_GROWTH`
    /// ([`Pipeline`]); [`CudaCopyBackend::with_upload`] sets them in code.
    ///
    /// # Errors
    /// [`TransferError::Cuda`] naming `libcuda` when no driver is present;
    /// [`TransferError::InvalidInput`] naming one of those variables when
    /// its value is not accepted.
    pub fn new(mode: CudaMode) -> Result<Self, TransferError> {
        if !driver_present() {
            return Err(TransferError::Cuda {
                op: "libcuda",
                reason: "CUDA driver library not found".into(),
            });
        }
        let (upload, pipeline) = upload_from_env(|k| std::env::var(k).ok())?;
        Ok(Self {
            devices: Mutex::new(HashMap::new()),
            use_kernel: mode == CudaMode::Auto,
            tuning: GatherTuning::default(),
            upload,
            pipeline,
            shapes: Mutex::new(Vec::new()),
            layered: Mutex::new(Vec::new()),
        })
    }

    /// The same backend sending block tables the `upload` way, cutting
    /// pipelined parts as `pipeline` says.
    pub fn with_upload(mut self, upload: GatherUpload, pipeline: Pipeline) -> Self {
        self.upload = upload;
        self.pipeline = pipeline;
        self
    }

    /// How block tables reach the kernel.
    pub fn upload(&self) -> GatherUpload {
        self.upload
    }

    /// Chunk sizes of [`GatherUpload::Pipelined`].
    pub fn pipeline(&self) -> Pipeline {
        self.pipeline
    }

    /// The same backend launching the gather with `tuning` (CTA size, grid
    /// cap, piece split of the `deliver` path); the benchmark's sweep uses it.
    /// Plans given to [`CudaCopyBackend::convert_blocks`] keep the piece
    /// split they were built with ([`ConvertPlan::new_tuned`]).
    pub fn with_tuning(mut self, tuning: GatherTuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// The cached [`ConvertShape`] of `donor` -> `target` under this
    /// backend's tuning, built on first use.
    ///
    /// # Errors
    /// As [`ConvertShape::new`].
    pub fn shape(
        &self,
        donor: &kv_descriptor::KvRegionLayout,
        target: &kv_descriptor::KvRegionLayout,
    ) -> Result<Arc<ConvertShape>, crate::cuda_gather::ConvertError> {
        let mut shapes = self.shapes.lock();
        if let Some(s) = shapes.iter().find(|s| s.is(donor, target, &self.tuning)) {
            return Ok(s.clone());
        }
        let s = Arc::new(ConvertShape::new(donor, target, &self.tuning)?);
        if shapes.len() == CACHED_SHAPES {
            shapes.remove(0);
        }
        shapes.push(s.clone());
        Ok(s)
    }

    /// `shape` cut into `groups` layer groups, cached while `shape` is
    /// (same pointer, same count).
    fn layered(
        &self,
        shape: Arc<ConvertShape>,
        groups: u32,
    ) -> Result<Arc<LayeredShape>, crate::cuda_gather::ConvertError> {
        let mut cache = self.layered.lock();
        if let Some((_, l)) = cache
            .iter()
            .find(|(g, l)| *g == groups && Arc::ptr_eq(l.whole(), &shape))
        {
            return Ok(l.clone());
        }
        let l = Arc::new(LayeredShape::new(shape, groups)?);
        if cache.len() == CACHED_SHAPES {
            cache.remove(0);
        }
        cache.push((groups, l.clone()));
        Ok(l)
    }

    /// Device `ordinal`'s objects, set up on first use.
    ///
    /// # Errors
    /// [`TransferError::CudaUnavailable`] in a child forked after the
    /// device was set up, or after CUDA was initialized (kv-bank's record
    /// of `cuInit`, which a first set-up makes here), before any CUDA call;
    /// [`TransferError::Cuda`] for a failing call.
    fn device(&self, ordinal: u32) -> Result<SharedDevice, TransferError> {
        let mut devs = self.devices.lock();
        if let Some(d) = devs.get(&ordinal) {
            d.usable()?;
            return Ok(d.clone());
        }
        // Through kv-bank's driver initialization, so that its record of
        // the process that ran `cuInit` covers these objects too.
        kv_bank::cuda_driver_here().map_err(cuda_unavailable)?;
        let ctx =
            CudaContext::new(ordinal as usize).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        // SAFETY: only probes whether libnvrtc can be loaded (cudarc panics
        // on first use otherwise).
        let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if self.use_kernel && !nvrtc {
            tracing::warn!(
                "libnvrtc not found: scattered blocks go out as one device copy per run"
            );
        }
        let kernels = if self.use_kernel && nvrtc {
            Some(Kernels::load(&ctx)?)
        } else {
            None
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("cuDeviceGetAttribute"))?
            .max(1) as u32;
        let device = Mutex::new(Device {
            ctx,
            stream,
            kernels,
            sms,
            tables: Tables::new(),
            aux: None,
            aux_in_flight: false,
            row_pieces: Default::default(),
            words: Vec::new(),
            peers: HashMap::new(),
            enqueued: None,
            blocking: None,
            released: false,
        });
        let d = Arc::new(ProcessBound::new(
            device,
            format!("this copy backend's CUDA stream and kernels of device {ordinal} were set up"),
        ));
        devs.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The destination device of a `src` -> `dst` copy, locked for no one
    /// yet, with peer access to the source enabled: `(device, src ordinal,
    /// dst ordinal)`.
    ///
    /// # Errors
    /// [`TransferError::UnsupportedMemory`] when either side is not CUDA
    /// memory or `src` is an import mapped for another device only;
    /// [`TransferError::Cuda`] when the devices cannot reach each other.
    fn open_pair(
        &self,
        rank: u32,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
    ) -> Result<(SharedDevice, u32, u32), TransferError> {
        let unsupported = || TransferError::UnsupportedMemory {
            backend: "cuda_ipc",
            rank,
            src: src.kind().to_string(),
            dst: dst.kind().to_string(),
        };
        let (MemoryKind::Cuda { ordinal: src_dev }, MemoryKind::Cuda { ordinal: dst_dev }) =
            (src.kind(), dst.kind())
        else {
            return Err(unsupported());
        };
        if src.device_local_mapping() && src_dev != dst_dev {
            // Checked before any launch: reading it from `dst_dev` faults
            // (CUDA_ERROR_ILLEGAL_ADDRESS poisons the context for every later
            // copy) or, for a plain copy, crawls through a slow path.
            return Err(TransferError::UnsupportedMemory {
                backend: "cuda_ipc",
                rank,
                src: format!(
                    "cuda:{src_dev} (an import mapped for device {src_dev} only; \
                     open it on the destination device {dst_dev})"
                ),
                dst: dst.kind().to_string(),
            });
        }
        let dev = self.device(dst_dev)?;
        if !Self::peer_ok(&mut dev.lock(), src_dev)? {
            return Err(TransferError::Cuda {
                op: "cuCtxEnablePeerAccess",
                reason: format!(
                    "device {dst_dev} cannot access device {src_dev} directly; \
                     a copy would be staged through host memory"
                ),
            });
        }
        Ok((dev, src_dev, dst_dev))
    }

    /// Moves the blocks of `plan` from `src` to `dst` with one launch of the
    /// converting gather on `dst`'s device, writing them in the target
    /// [`kv_descriptor::KvRegionLayout`] the plan was built for (vLLM
    /// per-layer, HF at a token offset, block-major), and returns once the
    /// bytes have landed: the stream is synchronized whatever happened, so
    /// nothing is in flight on return.
    ///
    /// `src` / `dst` are the regions the plan's donor / target layouts
    /// describe (layout byte 0 = the region's first byte). The caller holds
    /// the donor blocks pinned and the target blocks reserved until it
    /// returns. Same GPU or peer (peer access is enabled first). Payload never
    /// touches the host: `host_payload_bytes` is 0; `copies` counts launches.
    ///
    /// # Errors
    /// [`TransferError::UnsupportedMemory`] (not CUDA memory, an import mapped
    /// for another device); [`TransferError::InvalidInput`] naming `src.len` /
    /// `dst.len` when a region is shorter than its layout;
    /// [`TransferError::Cancelled`] / [`TransferError::DeadlineExceeded`]
    /// before the launch; [`TransferError::Cuda`] without libnvrtc, without
    /// peer access, or for a failing call.
    pub fn convert_blocks(
        &self,
        plan: &ConvertPlan,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        self.convert_rank(0, plan, src, dst, control)
    }

    /// [`CudaCopyBackend::convert_blocks`] for TP rank `rank` (named in errors).
    fn convert_rank(
        &self,
        rank: u32,
        plan: &ConvertPlan,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        self.convert_groups(rank, &[(None, plan)], src, dst, control)
    }

    /// Launches `groups` in order (every plan over the same blocks and
    /// regions), checking cancellation and the deadline before each. A
    /// group with a layer range is released on its own right after its
    /// launch ([`Device::release_layers`]) and the part ends with
    /// [`Device::settle_layered`]; a single group without one is released
    /// whole at the end ([`Device::settle`]). A consumer waits only for a
    /// launch that was issued whole.
    fn convert_groups(
        &self,
        rank: u32,
        groups: &[(Option<std::ops::Range<u32>>, &ConvertPlan)],
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let Some((_, first)) = groups.first() else {
            return Err(TransferError::input("conversion", "no layer group"));
        };
        for (field, have, need) in [
            ("src.len", src.len() as u64, first.src_region_bytes()),
            ("dst.len", dst.len() as u64, first.dst_region_bytes()),
        ] {
            if have < need {
                return Err(TransferError::input(
                    field,
                    format!("region has {have} bytes, its layout addresses {need}"),
                ));
            }
        }
        let (dev, src_dev, dst_dev) = self.open_pair(rank, src, dst)?;
        let mut dev = dev.lock();
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        control.check()?;
        let layered = groups.iter().any(|(layers, _)| layers.is_some());
        let (mut copies, mut bytes, mut failed) = (0, 0, None);
        for (i, (layers, plan)) in groups.iter().enumerate() {
            let r = (if i > 0 { control.check() } else { Ok(()) })
                .and_then(|()| {
                    launch_convert(
                        &mut dev,
                        *plan,
                        (src.base_addr(), dst.base_addr()),
                        &self.tuning,
                        self.upload,
                        false,
                        None,
                    )
                })
                .and_then(|n| match layers {
                    Some(l) => dev.release_layers(control, rank, l.clone()).map(|()| n),
                    None => Ok(n),
                });
            match r {
                Ok(n) => {
                    copies += n;
                    bytes += plan.bytes();
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if layered {
            dev.settle_layered(control, rank, failed)?;
        } else {
            dev.settle(control, rank, failed)?;
        }
        Ok(PartOutcome {
            bytes,
            copies,
            host_payload_bytes: 0,
            transport: if src_dev == dst_dev {
                "cuda_same_device_convert_kernel".into()
            } else {
                "cuda_peer_convert_kernel".into()
            },
        })
    }

    /// Makes `src` device memory directly readable from `dev` (kernels and
    /// copies); false if the hardware cannot, in which case the driver would
    /// stage a copy through host memory. Locks no other device, so parts on
    /// two devices reading each other cannot deadlock.
    fn peer_ok(dev: &mut Device, src: u32) -> Result<bool, TransferError> {
        if dev.ctx.ordinal() as u32 == src {
            return Ok(true);
        }
        if let Some(&ok) = dev.peers.get(&src) {
            return Ok(ok);
        }
        let peer = CudaContext::new(src as usize).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let ok = enable_peer_access(&dev.ctx, &peer)?;
        dev.peers.insert(src, ok);
        Ok(ok)
    }
}

impl CopyBackend for CudaCopyBackend {
    fn name(&self) -> &'static str {
        "cuda_ipc"
    }

    /// Converting parts run as one launch of the converting gather per rank
    /// (one device copy per piece without NVRTC or in [`CudaMode::CopyPerRun`]).
    fn converts(&self) -> bool {
        true
    }

    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let SourceRegion::Mapped(src) = io.src else {
            return Err(TransferError::UnsupportedMemory {
                backend: "cuda_ipc",
                rank: part.tp_rank(),
                src: io.src.kind().to_string(),
                dst: io.dst.kind().to_string(),
            });
        };
        if let Some(c) = part.conversion() {
            return self.copy_conversion(part.tp_rank(), c, src, io.dst, control);
        }
        let (dev, src_dev, dst_dev) = self.open_pair(part.tp_rank(), src, io.dst)?;
        let mut dev = dev.lock();
        let kernel_ok = dev.kernels.is_some() && part.runs().len() > DIRECT_MAX_RUNS;
        if let Some(rows) = part.packed_rows().filter(|_| kernel_ok) {
            return self.copy_rows(
                &mut dev,
                part.tp_rank(),
                rows,
                (src, io.dst),
                control,
                src_dev == dst_dev,
            );
        }
        // The rank block from the first run, not a pass over every run
        // (4096 runs are 160 KiB): the gather refuses a run that is not
        // `blocks` rows of it, and `deliver` a part whose bytes are not
        // the expected bytes, so a wrong value cannot complete a fetch.
        let block_bytes = part
            .runs()
            .first()
            .map_or(0, |r| r.len / u64::from(r.blocks.max(1)));
        let planned_blocks = part.expected_bytes() / block_bytes.max(1);
        let regions = (src.len() as u64, io.dst.len() as u64);
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let (sb, db) = (src.base_addr(), io.dst.base_addr());
        let (mut copies, mut bytes) = (0, 0);
        let mut failed = None;
        // A fetch within one launch needs no second pass over its runs.
        let batches = if planned_blocks <= BLOCKS_PER_LAUNCH as u64 {
            vec![part.runs()]
        } else {
            launch_batches(part.runs(), BLOCKS_PER_LAUNCH)
        };
        for batch in batches {
            if let Err(e) = control.check() {
                failed = Some(e);
                break;
            }
            let r = if kernel_ok {
                Self::gather(
                    &mut dev,
                    sb,
                    db,
                    batch,
                    block_bytes,
                    regions,
                    &self.tuning,
                    (self.upload, &self.pipeline),
                )
            } else {
                Self::copy_runs(&dev, sb, db, batch)
            };
            match r {
                Ok((c, b)) => {
                    copies += c;
                    bytes += b;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        dev.settle(control, part.tp_rank(), failed)?;
        Ok(PartOutcome {
            bytes,
            copies,
            host_payload_bytes: 0,
            transport: match (src_dev == dst_dev, kernel_ok) {
                (true, true) => "cuda_same_device_gather_kernel".into(),
                (true, false) => "cuda_same_device_copy".into(),
                (false, true) => "cuda_peer_gather_kernel".into(),
                (false, false) => "cuda_peer_copy".into(),
            },
        })
    }
}

impl CudaCopyBackend {
    /// A block-major part launched from its plan's [`PackedRows`]: O(1) host
    /// work before the first launch (two compares of the rows' own ends
    /// against the regions, a slice of the plan's ids into the parameter
    /// image). Quiesced before returning, whatever happened.
    fn copy_rows(
        &self,
        dev: &mut Device,
        rank: u32,
        rows: &PackedRows,
        (src, dst): (&dyn BankMemory, &dyn BankMemory),
        control: &DeliveryControl,
        same_device: bool,
    ) -> Result<PartOutcome, TransferError> {
        // The ends `deliver` checked were found from the runs; these come
        // from the ids and strides the kernel reads, so the launch is in
        // bounds whoever called.
        let (src_end, dst_end) = rows.region_bytes();
        for (field, end, len) in [
            ("io.src", src_end, src.len() as u64),
            ("io.dst", dst_end, dst.len() as u64),
        ] {
            if end > len {
                return Err(TransferError::input(
                    field,
                    format!("rank {rank} addresses up to byte {end} of a {len}-byte region"),
                ));
            }
        }
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let mut failed = control.check().err();
        let mut done = (0, 0);
        if failed.is_none() {
            match Self::gather_rows(
                dev,
                (src.base_addr(), dst.base_addr()),
                rows,
                &self.tuning,
                (self.upload, &self.pipeline),
            ) {
                Ok(d) => done = d,
                Err(e) => failed = Some(e),
            }
        }
        dev.settle(control, rank, failed)?;
        let (copies, bytes) = done;
        Ok(PartOutcome {
            bytes,
            copies,
            host_payload_bytes: 0,
            transport: if same_device {
                "cuda_same_device_gather_kernel".into()
            } else {
                "cuda_peer_gather_kernel".into()
            },
        })
    }

    /// A converting part ([`crate::convert::Conversion`] of a converting
    /// `TransferPlan`): one launch of the converting gather when the kernel is
    /// loaded, else one device copy per piece (correct, slow; cancellation and
    /// deadline checked every 4096 pieces). Quiesced before returning.
    fn copy_conversion(
        &self,
        rank: u32,
        c: &crate::convert::Conversion,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let pairs: Vec<(u32, u32)> = c
            .pairs()
            .iter()
            .map(|p| (p.src_block, p.dst_block))
            .collect();
        let (dev, src_dev, dst_dev) = self.open_pair(rank, src, dst)?;
        if dev.lock().kernels.is_some() {
            drop(dev);
            // A consumer on the destination device that asked for layer
            // groups gets one launch per group, each released on its own.
            let groups = control
                .consumer
                .as_ref()
                .filter(|s| s.ordinal() == dst_dev)
                .and_then(|s| s.layer_groups())
                .filter(|&g| g > 1 && c.src().layer_offsets().len() > 1);
            let input = |e: crate::cuda_gather::ConvertError| {
                TransferError::input("conversion", e.to_string())
            };
            let shape = self.shape(c.src(), c.dst()).map_err(input)?;
            if let Some(g) = groups {
                let plans = self
                    .layered(shape, g)
                    .and_then(|l| l.plans(&pairs))
                    .map_err(input)?;
                let groups: Vec<_> = plans.iter().map(|(r, p)| (Some(r.clone()), p)).collect();
                return self.convert_groups(rank, &groups, src, dst, control);
            }
            let plan = shape.plan(&pairs).map_err(input)?;
            return self.convert_rank(rank, &plan, src, dst, control);
        }
        let mut dev = dev.lock();
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let (sb, db) = (src.base_addr(), dst.base_addr());
        let (mut copies, mut failed) = (0u64, None);
        for p in c.pieces() {
            if copies % 4096 == 0 {
                if let Err(e) = control.check() {
                    failed = Some(e);
                    break;
                }
            }
            // SAFETY: `deliver` checked both regions are at least the
            // layouts' region bytes, and every piece of a `Conversion` lies
            // inside them; donor blocks are pinned, target blocks reserved.
            let r = unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    db + p.dst_offset,
                    sb + p.src_offset,
                    p.len as usize,
                    dev.stream.cu_stream(),
                )
            };
            if let Err(e) = r {
                failed = Some(cuda_err("cuMemcpyDtoDAsync")(e));
                break;
            }
            copies += 1;
        }
        dev.settle(control, rank, failed)?;
        Ok(PartOutcome {
            bytes: c.bytes(),
            copies,
            host_payload_bytes: 0,
            transport: if src_dev == dst_dev {
                "cuda_same_device_copy".into()
            } else {
                "cuda_peer_copy".into()
            },
        })
    }
}

#[cfg(test)]
mod tests;
