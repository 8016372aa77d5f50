//! CUDA backend: copies between device regions mapped into this process
//! (a donor bank imported by CUDA IPC handle, or local device memory).
//!
//! Runs are copied with `cuMemcpyDtoDAsync` when there are few of them; many
//! scattered runs go through one gather kernel launch (compiled once per
//! device with NVRTC) that reads a table of `(src, dst, len)` triples and
//! copies 16 bytes per thread per step. The kernel runs on the destination
//! device; when the source lives on another device, peer access is enabled
//! first (IPC imports made with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` already
//! have it), and without peer access the backend falls back to device copies.
//!
//! Without libnvrtc the kernel is unavailable and every run is a device copy
//! (correct, slower for scattered blocks; a warning is logged).
//!
//! Only the table (24 bytes per run) crosses the host: payload bytes never
//! do, so `host_payload_bytes` is 0. Every CUDA call of the crate lives here.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use kv_bank::MemoryKind;
use parking_lot::Mutex;

use crate::delivery::{CopyBackend, PartOutcome, RankIo, SourceRegion};
use crate::plan::{CopyRun, PartPlan};
use crate::{DeliveryControl, TransferError};

/// CUDA C source of the gather kernel. One thread block per (run, chunk):
/// `blockIdx.x` picks the run, `blockIdx.y` strides over its `CHUNK`-byte
/// chunks. 16-byte vector loads/stores when source, destination and length
/// are 16-byte aligned (always true for KV rows), bytes otherwise.
pub const GATHER_KERNEL_SRC: &str = r#"
extern "C" __global__ void kv_gather(const unsigned long long* __restrict__ table,
                                     unsigned int n, unsigned long long chunk) {
    unsigned int r = blockIdx.x;
    if (r >= n) return;
    unsigned long long s = table[r], d = table[n + r], l = table[2ull * n + r];
    for (unsigned long long off = (unsigned long long)blockIdx.y * chunk; off < l;
         off += (unsigned long long)gridDim.y * chunk) {
        unsigned long long end = off + chunk < l ? off + chunk : l;
        if (((s | d | off | end) & 15ull) == 0) {
            const uint4* sp = (const uint4*)(s + off);
            uint4* dp = (uint4*)(d + off);
            unsigned long long nv = (end - off) >> 4;
            for (unsigned long long i = threadIdx.x; i < nv; i += blockDim.x) dp[i] = sp[i];
        } else {
            const unsigned char* sp = (const unsigned char*)(s + off);
            unsigned char* dp = (unsigned char*)(d + off);
            for (unsigned long long i = threadIdx.x; i < end - off; i += blockDim.x) dp[i] = sp[i];
        }
    }
}
"#;

/// Bytes one thread block copies per step of the gather kernel.
const CHUNK: u64 = 64 << 10;
/// Threads per block of the gather kernel.
const THREADS: u32 = 512;
/// Largest grid y dimension CUDA allows.
const MAX_GRID_Y: u64 = 65_535;
/// At most this many runs go out as individual device copies; more use the kernel.
const DIRECT_MAX_RUNS: usize = 4;
/// Runs per kernel launch; cancellation and deadline are checked between launches.
const RUNS_PER_LAUNCH: usize = 8192;

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

struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather: Option<CudaFunction>,
    table: Option<CudaSlice<u64>>,
    peers: HashMap<u32, bool>,
}

/// Copies between CUDA regions: device copies for a few runs, the NVRTC
/// gather kernel for many. One stream per destination device; parts on the
/// same device are serialized.
pub struct CudaCopyBackend {
    devices: Mutex<HashMap<u32, Arc<Mutex<Device>>>>,
    use_kernel: bool,
}

impl std::fmt::Debug for CudaCopyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyBackend")
            .field("devices", &self.devices.lock().keys().collect::<Vec<_>>())
            .field("use_kernel", &self.use_kernel)
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

impl CudaCopyBackend {
    /// A backend; devices are initialised on first use.
    ///
    /// # Errors
    /// [`TransferError::Cuda`] naming `libcuda` when no driver is present.
    pub fn new(mode: CudaMode) -> Result<Self, TransferError> {
        if !driver_present() {
            return Err(TransferError::Cuda {
                op: "libcuda",
                reason: "CUDA driver library not found".into(),
            });
        }
        Ok(Self {
            devices: Mutex::new(HashMap::new()),
            use_kernel: mode == CudaMode::Auto,
        })
    }

    fn device(&self, ordinal: u32) -> Result<Arc<Mutex<Device>>, TransferError> {
        let mut devs = self.devices.lock();
        if let Some(d) = devs.get(&ordinal) {
            return Ok(d.clone());
        }
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
        let gather = if self.use_kernel && nvrtc {
            let ptx =
                cudarc::nvrtc::compile_ptx(GATHER_KERNEL_SRC).map_err(|e| TransferError::Cuda {
                    op: "nvrtcCompileProgram",
                    reason: e.to_string(),
                })?;
            let module = ctx.load_module(ptx).map_err(cuda_err("cuModuleLoadData"))?;
            Some(
                module
                    .load_function("kv_gather")
                    .map_err(cuda_err("cuModuleGetFunction"))?,
            )
        } else {
            None
        };
        let d = Arc::new(Mutex::new(Device {
            ctx,
            stream,
            gather,
            table: None,
            peers: HashMap::new(),
        }));
        devs.insert(ordinal, d.clone());
        Ok(d)
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

    fn copy_runs(dev: &Device, sb: u64, db: u64, runs: &[CopyRun]) -> Result<u64, TransferError> {
        for r in runs {
            // SAFETY: `deliver` checked both ranges against their regions,
            // which stay mapped while the part runs; the target rows are
            // reserved and the donor rows pinned, so nothing else touches them.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    db + r.dst_offset,
                    sb + r.src_offset,
                    r.len as usize,
                    dev.stream.cu_stream(),
                )
            }
            .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
        }
        Ok(runs.len() as u64)
    }

    fn gather(dev: &mut Device, sb: u64, db: u64, runs: &[CopyRun]) -> Result<u64, TransferError> {
        let n = runs.len();
        let mut table = Vec::with_capacity(3 * n);
        table.extend(runs.iter().map(|r| sb + r.src_offset));
        table.extend(runs.iter().map(|r| db + r.dst_offset));
        table.extend(runs.iter().map(|r| r.len));
        let max_len = runs.iter().map(|r| r.len).max().unwrap_or(0);
        if dev.table.as_ref().is_none_or(|t| t.len() < table.len()) {
            dev.table = Some(
                dev.stream
                    .alloc_zeros::<u64>(table.len().max(3 * 1024))
                    .map_err(cuda_err("cuMemAlloc"))?,
            );
        }
        let Device {
            stream,
            gather,
            table: dt,
            ..
        } = dev;
        let dt = dt.as_mut().expect("table allocated above");
        stream
            .memcpy_htod(&table, dt)
            .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        let func = gather.as_ref().expect("kernel loaded when use_kernel");
        let cfg = LaunchConfig {
            grid_dim: (
                n as u32,
                max_len.div_ceil(CHUNK).clamp(1, MAX_GRID_Y) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n32, chunk) = (n as u32, CHUNK);
        let mut launch = stream.launch_builder(func);
        launch.arg(&*dt).arg(&n32).arg(&chunk);
        // SAFETY: the kernel signature is (const u64*, u32, u64) as pushed;
        // the table holds `n` in-range (src, dst, len) triples checked by
        // `deliver`, so every access stays inside the two regions.
        unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(1)
    }
}

impl CopyBackend for CudaCopyBackend {
    fn name(&self) -> &'static str {
        "cuda_ipc"
    }

    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let unsupported = || TransferError::UnsupportedMemory {
            backend: "cuda_ipc",
            rank: part.tp_rank,
            src: io.src.kind().to_string(),
            dst: io.dst.kind().to_string(),
        };
        let (SourceRegion::Mapped(src), MemoryKind::Cuda { ordinal: dst_dev }) =
            (io.src, io.dst.kind())
        else {
            return Err(unsupported());
        };
        let MemoryKind::Cuda { ordinal: src_dev } = src.kind() else {
            return Err(unsupported());
        };
        if src.device_local_mapping() && src_dev != dst_dev {
            // Checked before any launch: reading it from `dst_dev` faults
            // (CUDA_ERROR_ILLEGAL_ADDRESS poisons the context for every later
            // copy) or, for a plain copy, crawls through a slow path.
            return Err(TransferError::UnsupportedMemory {
                backend: "cuda_ipc",
                rank: part.tp_rank,
                src: format!(
                    "cuda:{src_dev} (an import mapped for device {src_dev} only; \
                     open it on the destination device {dst_dev})"
                ),
                dst: io.dst.kind().to_string(),
            });
        }
        let dev = self.device(dst_dev)?;
        let mut dev = dev.lock();
        if !Self::peer_ok(&mut dev, src_dev)? {
            return Err(TransferError::Cuda {
                op: "cuCtxEnablePeerAccess",
                reason: format!(
                    "device {dst_dev} cannot access device {src_dev} directly; \
                     a copy would be staged through host memory"
                ),
            });
        }
        let kernel_ok = dev.gather.is_some() && part.runs.len() > DIRECT_MAX_RUNS;
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let (sb, db) = (src.base_addr(), io.dst.base_addr());
        let mut copies = 0;
        let mut failed = None;
        for batch in part.runs.chunks(RUNS_PER_LAUNCH) {
            if let Err(e) = control.check() {
                failed = Some(e);
                break;
            }
            let r = if kernel_ok {
                Self::gather(&mut dev, sb, db, batch)
            } else {
                Self::copy_runs(&dev, sb, db, batch)
            };
            match r {
                Ok(c) => copies += c,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // Quiesce before returning, whatever happened: the caller releases the
        // destination reservation and donor pins as soon as we return.
        let synced = dev
            .stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"));
        if let Some(e) = failed {
            return Err(e);
        }
        synced?;
        Ok(PartOutcome {
            bytes: part.runs.iter().map(|r| r.len).sum(),
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

/// Times `repeats` plain `cuMemcpyDtoDAsync` calls of `bytes` from `src` (on
/// device `src_ordinal`) to `dst` (on device `ordinal`), each followed by a
/// stream synchronize: the raw-copy baseline of the benchmark. Peer access is
/// enabled first when the devices differ, so the baseline is a direct peer
/// copy, not one staged through the host. One untimed warm-up copy runs first.
///
/// # Errors
/// [`TransferError::Cuda`] naming the failing call.
pub fn time_raw_device_copy(
    src_ordinal: u32,
    ordinal: u32,
    dst: u64,
    src: u64,
    bytes: usize,
    repeats: usize,
) -> Result<Vec<std::time::Duration>, TransferError> {
    let ctx = CudaContext::new(ordinal as usize).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
    if src_ordinal != ordinal {
        let peer =
            CudaContext::new(src_ordinal as usize).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        if !enable_peer_access(&ctx, &peer)? {
            return Err(TransferError::Cuda {
                op: "cuCtxEnablePeerAccess",
                reason: format!("device {ordinal} cannot access device {src_ordinal} directly"),
            });
        }
    }
    let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
    let mut out = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let t0 = std::time::Instant::now();
        // SAFETY: the caller passes two live device ranges of `bytes` bytes
        // that nothing else uses during the benchmark.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
            .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        if i > 0 {
            out.push(t0.elapsed());
        }
    }
    Ok(out)
}
