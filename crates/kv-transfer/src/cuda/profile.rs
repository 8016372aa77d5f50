//! Phase timing of the converting gather for the benchmark: CUDA events
//! around the table upload and the kernel of one launch. Kept apart from the
//! fetch path, which records no event. Also the benchmark's raw-copy
//! baseline ([`time_raw_device_copy`]).

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use kv_bank::BankMemory;

use super::{cuda_err, enable_peer_access, CudaCopyBackend};
use crate::cuda_gather::{BlockSource, ConvertPlan, RowsGather, RunsGather, TablePlacement};
use crate::TransferError;

/// Timing points of one profiled launch ([`CudaCopyBackend::profile_convert`]).
#[derive(Default)]
pub(super) struct LaunchEvents {
    pub(super) host: std::time::Duration,
    pub(super) start: Option<CudaEvent>,
    pub(super) uploaded: Option<CudaEvent>,
    pub(super) done: Option<CudaEvent>,
    pub(super) placement: TablePlacement,
}

/// An event with timing enabled, recorded on `stream` now.
pub(super) fn record(stream: &CudaStream) -> Result<CudaEvent, TransferError> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(cuda_err("cuEventRecord"))
}

/// Phases of one converting-gather launch, measured by
/// [`CudaCopyBackend::profile_convert`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaunchPhases {
    /// Host time from entering the launch to the block table written into
    /// the page-locked buffer (geometry, table fill), µs.
    pub host_tables_us: f64,
    /// Device time of the block (and, on a layout change, piece) table
    /// upload, between CUDA events, µs.
    pub upload_us: f64,
    /// Device time of the kernel alone, between CUDA events, µs.
    pub kernel_us: f64,
    /// Where the launch's block table was (inline parameter or device).
    pub table: TablePlacement,
}

impl CudaCopyBackend {
    /// Runs `plan` once like [`CudaCopyBackend::convert_blocks`] (no
    /// cancellation) with CUDA events around the table upload and the
    /// kernel, and synchronizes. Benchmark instrumentation: events cost a
    /// few µs, so the product path records none.
    ///
    /// # Errors
    /// As [`CudaCopyBackend::convert_blocks`]; [`TransferError::Cuda`]
    /// naming `cuEventElapsedTime`.
    pub fn profile_convert(
        &self,
        plan: &ConvertPlan,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
    ) -> Result<LaunchPhases, TransferError> {
        let need = (plan.src_region_bytes(), plan.dst_region_bytes());
        self.profile_source(plan, need, src, dst)
    }

    /// [`CudaCopyBackend::profile_convert`] of a [`RunsGather`], the launch
    /// `deliver` issues for block-major rows of up to 8,128 blocks.
    ///
    /// # Errors
    /// [`TransferError::InvalidInput`] naming `src.len` / `dst.len` when a
    /// run ends past its region; otherwise as
    /// [`CudaCopyBackend::profile_convert`].
    pub fn profile_runs(
        &self,
        gather: &RunsGather<'_>,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
    ) -> Result<LaunchPhases, TransferError> {
        self.profile_source(gather, gather.region_bytes(), src, dst)
    }

    /// [`CudaCopyBackend::profile_convert`] of a [`RowsGather`], the launch
    /// `deliver` issues from a part's packed rows (the unchunked one).
    ///
    /// # Errors
    /// As [`CudaCopyBackend::profile_runs`].
    pub fn profile_rows(
        &self,
        gather: &RowsGather<'_>,
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
    ) -> Result<LaunchPhases, TransferError> {
        self.profile_source(gather, gather.region_bytes(), src, dst)
    }

    fn profile_source(
        &self,
        plan: &dyn BlockSource,
        (src_need, dst_need): (u64, u64),
        src: &dyn BankMemory,
        dst: &dyn BankMemory,
    ) -> Result<LaunchPhases, TransferError> {
        for (field, have, need) in [
            ("src.len", src.len() as u64, src_need),
            ("dst.len", dst.len() as u64, dst_need),
        ] {
            if have < need {
                return Err(TransferError::input(
                    field,
                    format!("region has {have} bytes, its layout addresses {need}"),
                ));
            }
        }
        let (dev, _, _) = self.open_pair(0, src, dst)?;
        let mut dev = dev.lock();
        dev.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let mut ev = LaunchEvents::default();
        let bases = (src.base_addr(), dst.base_addr());
        let launched = super::launch_convert(
            &mut dev,
            plan,
            bases,
            &self.tuning,
            self.upload,
            false,
            Some(&mut ev),
        );
        let synced = dev.sync();
        launched?;
        synced?;
        let (Some(a), Some(b), Some(c)) = (&ev.start, &ev.uploaded, &ev.done) else {
            return Err(TransferError::Cuda {
                op: "cuEventRecord",
                reason: "a profiling event was not recorded".into(),
            });
        };
        let ms = |x: &CudaEvent, y| {
            x.elapsed_ms(y)
                .map(|m| f64::from(m) * 1e3)
                .map_err(cuda_err("cuEventElapsedTime"))
        };
        Ok(LaunchPhases {
            host_tables_us: ev.host.as_secs_f64() * 1e6,
            upload_us: ms(a, b)?,
            kernel_us: ms(b, c)?,
            table: ev.placement,
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
/// [`TransferError::CudaUnavailable`] in a child forked after CUDA was
/// initialized (kv-bank's record of `cuInit`), before any CUDA call;
/// [`TransferError::Cuda`] naming the failing call.
pub fn time_raw_device_copy(
    src_ordinal: u32,
    ordinal: u32,
    dst: u64,
    src: u64,
    bytes: usize,
    repeats: usize,
) -> Result<Vec<std::time::Duration>, TransferError> {
    kv_bank::cuda_driver_here().map_err(super::cuda_unavailable)?;
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
