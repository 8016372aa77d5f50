//! Loading and launching the converting gather: the NVRTC modules of one
//! device, where each launch's block table goes ([`TablePlacement`]), and
//! the launch itself.
//!
//! Per fetch the host writes `2n` table entries (or copies `n` packed ids,
//! for a `deliver` part of more than 128 blocks a slice of the ids its plan
//! packed, `PackedRows`) and issues one launch; with an inline table (up to
//! [`crate::cuda_gather::INLINE_SMALL_BLOCKS`] blocks as u64 addresses,
//! 129..=[`crate::cuda_gather::INLINE_PACKED_BLOCKS`] as packed ids in the
//! smallest parameter tier that holds them) nothing else goes to the
//! device: the table is a kernel parameter, copied by the driver when the
//! launch is issued. Unpackable or larger fetches, and drivers older than
//! CUDA 12.1, use a device table filled by one `cuMemcpyHtoDAsync` of
//! exactly `2n` entries from a page-locked buffer.
//! Raw device pointers are passed as arguments, so no per-launch event
//! bookkeeping runs: every caller synchronizes the stream before returning.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};

use super::profile::{record, LaunchEvents};
use super::{cuda_err, Device};
use crate::cuda_gather::{
    BlockSource, GatherTuning, GatherUpload, PieceTable, TablePlacement, CONVERT_KERNEL_SRC,
    INLINE_KERNEL_DEFINE, INLINE_LARGE_ENTRIES, INLINE_PACKED_ENTRIES, INLINE_SMALL_ENTRIES,
};
use crate::TransferError;

/// CUDA driver API version that accepts kernel parameters past 4 KiB.
const LARGE_PARAMS_DRIVER: i32 = 12010;
/// Piece tables a device keeps (newest last): a pipelined part's chunks
/// split their pieces by chunk size (1024 x 64 KiB: 8, 32 and 16 KiB
/// pieces), an executor fetches in a few sizes and layout pairs, and a
/// fetch released by layer group launches one table per group (8 by
/// default in the serving harness), so a fetch uploads no piece table it
/// sent before.
const PIECE_TABLES: usize = 24;

/// Entry points of one table placement: by element width (bytes), then the
/// 16-byte eight-wide one ([`TablePlacement::wide_name`]).
struct EntryPoints {
    by_width: Vec<(u32, CudaFunction)>,
    wide: CudaFunction,
}

/// Entry points of the converting gather loaded on one device.
pub(super) struct Kernels {
    /// Table-pointer entry points, by element width.
    table: EntryPoints,
    /// Inline entry points by placement (small, large, every packed tier),
    /// when the inline module loaded.
    inline: Option<Vec<(TablePlacement, EntryPoints)>>,
    /// Why the inline module is absent (unsupported driver or device, or
    /// the NVRTC / load error); `None` when loaded.
    inline_absent: Option<String>,
}

impl Kernels {
    /// Compiles and loads the kernel on `ctx`. The inline module is tried
    /// only with a CUDA 12.1+ driver on compute capability 7.0+; when it
    /// does not compile or load, a warning is logged and every launch uses
    /// the device table (correct, a few µs slower per fetch).
    ///
    /// # Errors
    /// [`TransferError::Cuda`] naming `nvrtcCompileProgram`,
    /// `cuModuleLoadData` or `cuModuleGetFunction` for the table-pointer
    /// module.
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Self, TransferError> {
        let ptx =
            cudarc::nvrtc::compile_ptx(CONVERT_KERNEL_SRC).map_err(|e| TransferError::Cuda {
                op: "nvrtcCompileProgram",
                reason: e.to_string(),
            })?;
        let module = ctx.load_module(ptx).map_err(cuda_err("cuModuleLoadData"))?;
        let table = functions(&module, TablePlacement::Device)?;
        let (inline, inline_absent) = match inline_support(ctx)? {
            Ok(cc) => match load_inline(ctx, cc) {
                Ok(k) => (Some(k), None),
                Err(e) => {
                    tracing::warn!("inline gather tables unavailable, using a device table: {e}");
                    (None, Some(e.to_string()))
                }
            },
            Err(why) => (None, Some(why)),
        };
        Ok(Self {
            table,
            inline,
            inline_absent,
        })
    }

    /// True when the inline entry points are loaded.
    pub(super) fn inline_loaded(&self) -> bool {
        self.inline.is_some()
    }

    /// The entry point for `placement`, `width`-byte elements, and the
    /// eight-wide step when `wide` (16-byte elements only).
    fn function(&self, placement: TablePlacement, width: u32, wide: bool) -> Option<&CudaFunction> {
        let set = match (placement, &self.inline) {
            (TablePlacement::Device, _) => &self.table,
            (_, Some(sets)) => &sets.iter().find(|(p, _)| *p == placement)?.1,
            (_, None) => return None,
        };
        if wide {
            return (width == 16).then_some(&set.wide);
        }
        set.by_width
            .iter()
            .find(|(w, _)| *w == width)
            .map(|(_, f)| f)
    }
}

fn functions(
    module: &Arc<CudaModule>,
    placement: TablePlacement,
) -> Result<EntryPoints, TransferError> {
    let by_width = placement
        .names()
        .iter()
        .map(|&(w, name)| {
            module
                .load_function(name)
                .map(|f| (w, f))
                .map_err(cuda_err("cuModuleGetFunction"))
        })
        .collect::<Result<_, _>>()?;
    let wide = module
        .load_function(placement.wide_name())
        .map_err(cuda_err("cuModuleGetFunction"))?;
    Ok(EntryPoints { by_width, wide })
}

/// The device's compute capability `(major, minor)` when its driver is CUDA
/// 12.1+ and the capability 7.0+ (`__grid_constant__`, parameters past
/// 4 KiB); otherwise why not.
fn inline_support(ctx: &Arc<CudaContext>) -> Result<Result<(u32, u32), String>, TransferError> {
    let mut version = 0i32;
    // SAFETY: writes one int; the driver is loaded (a context exists).
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    let attr = |a| {
        ctx.attribute(a)
            .map(|v| v.max(0) as u32)
            .map_err(cuda_err("cuDeviceGetAttribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(
        if r != sys::CUresult::CUDA_SUCCESS || version < LARGE_PARAMS_DRIVER {
            Err(format!(
                "driver API version {version} is older than {LARGE_PARAMS_DRIVER}"
            ))
        } else if major < 7 {
            Err(format!("compute capability {major}.{minor} is below 7.0"))
        } else {
            Ok((major, minor))
        },
    )
}

/// Every placement the inline module has entry points for.
const INLINE_PLACEMENTS: [TablePlacement; 6] = [
    TablePlacement::InlineSmall,
    TablePlacement::InlineLarge,
    TablePlacement::InlinePacked1024,
    TablePlacement::InlinePacked2048,
    TablePlacement::InlinePacked4096,
    TablePlacement::InlinePacked,
];

fn load_inline(
    ctx: &Arc<CudaContext>,
    (major, minor): (u32, u32),
) -> Result<Vec<(TablePlacement, EntryPoints)>, TransferError> {
    let opts = inline_compile_options(major, minor);
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(CONVERT_KERNEL_SRC, opts).map_err(|e| {
        TransferError::Cuda {
            op: "nvrtcCompileProgram",
            reason: e.to_string(),
        }
    })?;
    let module = ctx.load_module(ptx).map_err(cuda_err("cuModuleLoadData"))?;
    INLINE_PLACEMENTS
        .iter()
        .map(|&p| Ok((p, functions(&module, p)?)))
        .collect()
}

/// NVRTC options of the inline module for a device of compute capability
/// `major.minor`: its entry points and that device's virtual architecture
/// (`compute_90` for an H100 / H200). The device's own architecture, not a
/// fixed oldest one: NVRTC 13 no longer accepts `compute_70` (CUDA 13 dropped
/// targets below 7.5), and every NVRTC that can target a device accepts its
/// architecture.
pub fn inline_compile_options(major: u32, minor: u32) -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        options: vec![
            INLINE_KERNEL_DEFINE.into(),
            format!("--gpu-architecture=compute_{major}{minor}"),
        ],
        ..Default::default()
    }
}

/// Block tables of one device.
pub(super) struct Tables {
    /// Host image of the inline parameter; launches pass its first
    /// [`INLINE_SMALL_ENTRIES`] or all entries.
    inline: Box<[u64; INLINE_LARGE_ENTRIES]>,
    /// Host image of the packed inline parameter.
    packed: Box<[u32; INLINE_PACKED_ENTRIES]>,
    /// Device table, its raw address, the page-locked staging buffer and its
    /// raw pointer (same capacity; grown, never shrunk).
    device: Option<(CudaSlice<u64>, u64, PinnedHostSlice<u64>, *mut u64)>,
    /// A launch read the staging buffer and the stream was not synchronized
    /// since (only within one multi-launch part).
    staged_in_flight: bool,
    /// Piece tables on the device (at most [`PIECE_TABLES`], newest last),
    /// each with its raw address and the host table it holds: a launch
    /// whose pieces are one of them uploads nothing.
    pieces: Vec<(CudaSlice<u64>, u64, Arc<PieceTable>)>,
}

// SAFETY: the raw staging pointer points into the `PinnedHostSlice` stored
// beside it and is only used while the owning `Device` is locked.
unsafe impl Send for Tables {}

impl Tables {
    pub(super) fn new() -> Self {
        Self {
            inline: Box::new([0; INLINE_LARGE_ENTRIES]),
            packed: Box::new([0; INLINE_PACKED_ENTRIES]),
            device: None,
            staged_in_flight: false,
            pieces: Vec::new(),
        }
    }

    /// The stream was synchronized: nothing reads the staging buffer.
    pub(super) fn quiesced(&mut self) {
        self.staged_in_flight = false;
    }

    /// Device address of the block table holding `plan`'s `2n` entries for
    /// regions at `sb` / `db`, uploaded on `stream` (exactly `2n` entries).
    /// `all` are the device's streams (the launch stream among them).
    fn upload_blocks(
        &mut self,
        stream: &Arc<CudaStream>,
        all: &[&Arc<CudaStream>],
        plan: &dyn BlockSource,
        (sb, db): (u64, u64),
    ) -> Result<u64, TransferError> {
        let n2 = 2 * plan.blocks();
        if self.staged_in_flight {
            // An earlier launch of this part, on either stream, may still
            // read the staging buffer or the device table; rare (parts over
            // 65,536 blocks, or pipelined chunks whose ids do not pack).
            for s in all {
                s.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
            }
            self.staged_in_flight = false;
        }
        if self.device.as_ref().is_none_or(|d| d.0.len() < n2) {
            let cap = n2.next_power_of_two().max(INLINE_LARGE_ENTRIES);
            let table = stream
                .alloc_zeros::<u64>(cap)
                .map_err(cuda_err("cuMemAlloc"))?;
            let ptr = table.device_ptr(stream).0;
            // SAFETY: the pinned buffer is written (below) before any copy
            // reads it; u64 has no invalid bit patterns.
            let mut pinned = unsafe { stream.context().alloc_pinned::<u64>(cap) }
                .map_err(cuda_err("cuMemHostAlloc"))?;
            let host = pinned
                .as_mut_ptr()
                .map_err(cuda_err("cuEventSynchronize"))?;
            self.device = Some((table, ptr, pinned, host));
        }
        let (_, ptr, pinned, host) = self.device.as_mut().expect("allocated above");
        // SAFETY: `host` points at `pinned.len() >= n2` u64 owned by
        // `pinned`; no copy reads it now (`staged_in_flight` is false).
        let staging = unsafe { std::slice::from_raw_parts_mut(*host, pinned.len()) };
        plan.write_block_table(sb, db, &mut staging[..n2]);
        // SAFETY: `ptr` is a live allocation of at least `n2` u64; the
        // staging slice stays untouched until the stream is synchronized
        // (`staged_in_flight`).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(*ptr, &staging[..n2], stream.cu_stream())
        }
        .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        self.staged_in_flight = true;
        Ok(*ptr)
    }

    /// Device address of `plan`'s piece table, uploaded only when none of
    /// the kept tables equals it (pointer-equal tables of a cached shape
    /// skip the comparison). Past [`PIECE_TABLES`] the oldest is dropped:
    /// its memory is freed in stream order (`cuMemFreeAsync` on `stream`,
    /// the main stream every table is uploaded on), after every launch
    /// already issued there that reads it. When the device has a second
    /// stream (`all` longer than one), a miss first waits for every stream
    /// (no launch on the other stream reads a table about to be dropped)
    /// and then for the upload (the other stream may read the new table
    /// next): only on a miss.
    fn pieces(
        &mut self,
        stream: &Arc<CudaStream>,
        all: &[&Arc<CudaStream>],
        plan: &dyn BlockSource,
    ) -> Result<u64, TransferError> {
        let want = plan.pieces_arc();
        if let Some((_, ptr, _)) = self
            .pieces
            .iter()
            .rev()
            .find(|(_, _, host)| Arc::ptr_eq(host, want) || **host == **want)
        {
            return Ok(*ptr);
        }
        let two = all.len() > 1;
        if two {
            for s in all {
                s.synchronize().map_err(cuda_err("cuStreamSynchronize"))?;
            }
        }
        let table: Vec<u64> = want.src.iter().chain(&want.dst).copied().collect();
        let mut t = stream
            .alloc_zeros::<u64>(table.len())
            .map_err(cuda_err("cuMemAlloc"))?;
        stream
            .memcpy_htod(&table, &mut t)
            .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        let ptr = t.device_ptr(stream).0;
        if self.pieces.len() == PIECE_TABLES {
            self.pieces.remove(0);
        }
        self.pieces.push((t, ptr, want.clone()));
        if two {
            stream
                .synchronize()
                .map_err(cuda_err("cuStreamSynchronize"))?;
        }
        Ok(ptr)
    }
}

/// One launch of the converting gather for `plan` between the regions at
/// `sb` / `db` on `dev` (on its second stream when `on_aux`, which must
/// exist); returns the launches issued (1). Under [`GatherUpload::Copy`]
/// the block table is always the device table. The caller synchronizes the
/// streams ([`Device::sync`], which calls [`Tables::quiesced`]) before it
/// returns.
pub(super) fn launch_convert(
    dev: &mut Device,
    plan: &dyn BlockSource,
    (sb, db): (u64, u64),
    tuning: &GatherTuning,
    upload: GatherUpload,
    on_aux: bool,
    mut events: Option<&mut LaunchEvents>,
) -> Result<u64, TransferError> {
    let host_t0 = std::time::Instant::now();
    let geo = plan.geometry_tuned(sb, db, dev.sms, tuning);
    let Device {
        stream: main,
        aux,
        kernels,
        tables,
        ..
    } = dev;
    let main: &Arc<CudaStream> = main;
    let aux: Option<&Arc<CudaStream>> = aux.as_ref();
    let both = [main, aux.unwrap_or(main)];
    let streams = &both[..if aux.is_some() { 2 } else { 1 }];
    let stream = match (on_aux, aux) {
        (false, _) => main,
        (true, Some(a)) => a,
        (true, None) => {
            return Err(TransferError::Cuda {
                op: "cuLaunchKernel",
                reason: "a launch on the second stream before it was created".into(),
            })
        }
    };
    let kernels = kernels.as_ref().ok_or_else(|| TransferError::Cuda {
        op: "nvrtcCompileProgram",
        reason: "libnvrtc not found: the converting gather kernel is unavailable".into(),
    })?;
    let packed = plan.packed_ref();
    let placement = TablePlacement::for_blocks(
        plan.blocks(),
        kernels.inline_loaded() && upload.inline_allowed(),
        packed.is_some(),
    );
    let func = kernels
        .function(placement, geo.width, geo.wide)
        .ok_or_else(|| TransferError::Cuda {
            op: "cuModuleGetFunction",
            reason: format!(
                "no {placement:?} entry point for width {} (wide: {})",
                geo.width, geo.wide
            ),
        })?;
    // Packed ids exactly as many as their tier holds (a 1,024- or 4,096-block
    // part launched whole from its plan's rows) go out from where they are:
    // the driver reads the tier's size from the pointer, all of them ids.
    let exact = packed
        .filter(|ids| placement.packed_capacity() == Some(ids.words.len()))
        .map(|ids| ids.words);
    match (placement, packed) {
        (TablePlacement::Device, _) => {}
        (p, Some(ids)) if p.packed_capacity().is_some() => {
            if exact.is_none() {
                tables.packed[..ids.words.len()].copy_from_slice(ids.words);
            }
        }
        _ => plan.write_block_table(sb, db, &mut tables.inline[..2 * plan.blocks()]),
    }
    let strides = packed.map_or((0, 0), |p| (p.src_stride, p.dst_stride));
    if let Some(ev) = events.as_deref_mut() {
        ev.placement = placement;
        ev.host = host_t0.elapsed();
        ev.start = Some(record(stream)?);
    }
    let block_ptr = if placement == TablePlacement::Device {
        tables.upload_blocks(stream, streams, plan, (sb, db))?
    } else {
        0
    };
    let piece_ptr = tables.pieces(main, streams, plan)?;
    if let Some(ev) = events.as_deref_mut() {
        ev.uploaded = Some(record(stream)?);
    }
    let cfg = LaunchConfig {
        grid_dim: (geo.grid_x, 1, 1),
        block_dim: (geo.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let small: &[u64; INLINE_SMALL_ENTRIES] = tables.inline[..INLINE_SMALL_ENTRIES]
        .try_into()
        .expect("the inline image holds the small table");
    // The packed tiers: prefixes of the one host image (or the exact ids),
    // each exactly its kernel struct's size (the driver copies that many
    // parameter bytes).
    let words: &[u32] = exact.unwrap_or(&tables.packed[..]);
    fn tier<const N: usize>(words: &[u32]) -> &[u32; N] {
        words[..N].try_into().expect("tier fits")
    }
    let mut launch = stream.launch_builder(func);
    match placement {
        TablePlacement::InlineSmall => launch.arg(small),
        TablePlacement::InlineLarge => launch.arg(&*tables.inline),
        TablePlacement::InlinePacked => launch.arg(tier::<INLINE_PACKED_ENTRIES>(words)),
        TablePlacement::InlinePacked1024 => launch.arg(tier::<1024>(words)),
        TablePlacement::InlinePacked2048 => launch.arg(tier::<2048>(words)),
        TablePlacement::InlinePacked4096 => launch.arg(tier::<4096>(words)),
        TablePlacement::Device => launch.arg(&block_ptr),
    };
    if placement.packed_capacity().is_some() {
        launch.arg(&sb).arg(&db).arg(&strides.0).arg(&strides.1);
    }
    launch
        .arg(&piece_ptr)
        .arg(&geo.n)
        .arg(&geo.num_pieces)
        .arg(&geo.piece_shift)
        .arg(&geo.piece_elems)
        .arg(&geo.group_shift);
    // SAFETY: the signature is (table, [u64 x 4 for packed,] const u64*,
    // u32 x 5) as pushed: the table is the entry point's inline struct (same
    // entry count, filled for `2n` entries, or `n` packed ids whose bases and
    // strides follow, in the tier struct of exactly the pushed array's size
    // with `n <= packed_capacity()`: the image, or the source's own ids when
    // `n` is the capacity, borrowed for this call; copied by the driver at
    // the launch) or a device pointer to `2n` uploaded entries. Every block base + piece offset + piece
    // length lies inside its region: `ConvertPlan` / `RunsGather` built the
    // offsets from validated `KvRegionLayout`s (or in-range plan runs that
    // `deliver` checked against both regions), and a `RowsGather` is a slice
    // of `PackedRows` whose ends were derived from those same ids and
    // strides (`PackedRows::of_ids`: every `id x stride + block_bytes` is at
    // most its end, and its pieces tile exactly `block_bytes`); the callers
    // checked both regions are at least the plan's region bytes (or those
    // ends) long; the width divides every address (`geometry_tuned`: the OR
    // of every offset, the piece length and both bases).
    unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel"))?;
    if let Some(ev) = events {
        ev.done = Some(record(stream)?);
    }
    Ok(1)
}

impl super::CudaCopyBackend {
    /// True when device `ordinal` launches the gather with inline block
    /// tables (the inline module compiled and loaded); false when every
    /// launch uploads a device table (driver older than CUDA 12.1, compute
    /// capability below 7.0, or the module failed: a warning was logged).
    ///
    /// # Errors
    /// As the device's first use: [`TransferError::Cuda`] naming the call.
    pub fn inline_tables(&self, ordinal: u32) -> Result<bool, TransferError> {
        let dev = self.device(ordinal)?;
        let dev = dev.lock();
        Ok(dev.kernels.as_ref().is_some_and(Kernels::inline_loaded))
    }

    /// True when the driver and device of `ordinal` support inline tables.
    ///
    /// # Errors
    /// [`TransferError::Cuda`] naming the failing call.
    pub fn inline_tables_supported(&self, ordinal: u32) -> Result<bool, TransferError> {
        let dev = self.device(ordinal)?;
        let ctx = dev.lock().ctx.clone();
        Ok(inline_support(&ctx)?.is_ok())
    }

    /// One line saying how device `ordinal` places gather block tables:
    /// `inline kernel parameters`, `device table upload (<why>)` or
    /// `device table upload (KV_GATHER_UPLOAD=copy)`, then the upload
    /// variant (`upload=pipelined first=16384KiB growth=4`), for the
    /// benchmark log.
    ///
    /// # Errors
    /// As the device's first use.
    pub fn table_path(&self, ordinal: u32) -> Result<String, TransferError> {
        let dev = self.device(ordinal)?;
        let dev = dev.lock();
        let tables = match &dev.kernels {
            None => "no gather kernel (libnvrtc absent or CudaMode::CopyPerRun)".into(),
            Some(_) if !self.upload.inline_allowed() => {
                format!(
                    "device table upload ({}=copy)",
                    crate::cuda_gather::UPLOAD_ENV
                )
            }
            Some(k) => match &k.inline_absent {
                None => "inline kernel parameters (small u64 / packed ids 4-32 KiB)".into(),
                Some(why) => format!("device table upload ({why})"),
            },
        };
        Ok(format!("{tables}; {}", self.upload_label()))
    }

    /// `upload=<variant>`, with `first=<KiB>KiB growth=<n>` when pipelined:
    /// the variant the benchmark rows were measured with.
    pub fn upload_label(&self) -> String {
        match self.upload {
            GatherUpload::Pipelined => format!(
                "upload=pipelined first={}KiB growth={}",
                self.pipeline.first_bytes() >> 10,
                self.pipeline.growth()
            ),
            u => format!("upload={}", u.label()),
        }
    }
}

#[cfg(all(test, feature = "qualify"))]
mod tests {
    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};

    use crate::cuda::{device_count, driver_present, CudaCopyBackend, CudaMode};
    use crate::cuda_gather::{reference_convert, ConvertPlan, TablePlacement};
    use crate::DeliveryControl;

    /// Fetches sized for every table placement (small, each packed tier at
    /// both of its ends, and device past 8,128 blocks) into a vLLM kv-first target on GPU 0; every
    /// target byte against the host reference. Skips without a GPU.
    #[test]
    fn every_table_placement_lands_every_byte_on_the_gpu() {
        if !driver_present() || device_count() == 0 {
            println!("SKIP table placements on the GPU: no CUDA device visible");
            return;
        }
        let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
        let inline = backend.inline_tables(0).unwrap();
        println!("inline tables loaded: {inline}");
        // A CUDA 12.1+ driver on Volta or later must not fall back silently.
        assert_eq!(inline, backend.inline_tables_supported(0).unwrap());
        let g = KvLayout::new(2, 1, 16, DType::Bf16, 2, TensorOrder::BlockMajor, 1).unwrap();
        let bb = g.rank_block_bytes() as u64;
        for n in [
            7u32, 128, 129, 1024, 1025, 2032, 2049, 4096, 4097, 8128, 9000,
        ] {
            let slots = 2 * n + 1;
            let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).unwrap();
            let stride = 2 * u64::from(n) * 2 * 16 * 2;
            let target = KvRegionLayout::vllm_kv_first(g, 0, 0, stride, n, 2 * stride).unwrap();
            let moves: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - i) - 1, i)).collect();
            lands_every_byte(&backend, inline, &donor, &target, &moves);
        }
        // Block-major to block-major with pieces of 16 KiB, so every
        // placement's eight-wide `_w` entry point runs: 128 KiB blocks for
        // the small table and the first packed tier (a fetch under 1,024
        // work items is cut to 16 KiB pieces), 16 KiB blocks past that.
        let big = KvLayout::new(2, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
        let small = KvLayout::new(2, 1, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
        for (g, n) in [
            (big, 128u32),
            (big, 129),
            (small, 1025),
            (small, 2049),
            (small, 4097),
            (small, 9000),
        ] {
            let bb = g.rank_block_bytes() as u64;
            let slots = 2 * n + 1;
            let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).unwrap();
            let target = KvRegionLayout::block_major(g, 0, 0, n, u64::from(n) * bb).unwrap();
            let moves: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - i) - 1, i)).collect();
            let geo = ConvertPlan::new(&donor, &target, &moves)
                .unwrap()
                .geometry(0, 0, 132);
            assert!(geo.wide, "{n} blocks of {bb} bytes launch four-wide");
            lands_every_byte(&backend, inline, &donor, &target, &moves);
        }
    }

    /// Converts `moves` from `donor` to `target` on GPU 0 and checks every
    /// target byte against the host reference.
    fn lands_every_byte(
        backend: &CudaCopyBackend,
        inline: bool,
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        moves: &[(u32, u32)],
    ) {
        let n = moves.len() as u32;
        let bb = donor.geometry().rank_block_bytes() as u64;
        {
            let plan = ConvertPlan::new(donor, target, moves).unwrap();
            let placement = TablePlacement::for_blocks(n as usize, inline, plan.packed().is_some());
            let src = kv_bank::CudaDeviceMemory::new(0, donor.region_bytes() as usize).unwrap();
            let dst = kv_bank::CudaDeviceMemory::new(0, target.region_bytes() as usize).unwrap();
            let host: Vec<u8> = (0..src.len())
                .map(|i| (i * 7 + i / 251) as u8 | 1)
                .collect();
            src.write_bytes(0, &host).unwrap();
            dst.write_bytes(0, &vec![0; dst.len()]).unwrap();
            let o = backend
                .convert_blocks(&plan, &src, &dst, &DeliveryControl::new())
                .unwrap();
            assert_eq!(o.bytes, u64::from(n) * bb, "{n} blocks, {placement:?}");
            let mut want = vec![0u8; dst.len()];
            reference_convert(donor, target, moves, &host, &mut want).unwrap();
            let mut got = vec![0u8; dst.len()];
            dst.read_bytes(0, &mut got).unwrap();
            assert!(got == want, "{n} blocks, {placement:?}: target differs");
            println!("{n} blocks via {placement:?}: every byte matches");
        }
    }
}
