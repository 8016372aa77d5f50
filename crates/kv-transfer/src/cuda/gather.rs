//! How a block-major part's rows reach the device once `copy_part` has
//! checked them: one device copy per run (no kernel, or a part of at most
//! `DIRECT_MAX_RUNS` runs), or the converting gather launched from the runs
//! or from the plan's packed rows, whole or in pipelined chunks (odd ones
//! on the device's second stream under `pipelined2`). Every function here
//! leaves the synchronization to its caller (`Device::settle`), which
//! waits whatever happened.

use super::launch::launch_convert;
use super::{cuda_err, CudaCopyBackend, Device};
use crate::cuda_gather::{
    ConvertPlan, GatherTuning, GatherUpload, PackedRows, Pipeline, RunsGather,
};
use crate::plan::CopyRun;
use crate::TransferError;

impl CudaCopyBackend {
    /// One device copy per run; returns `(copies, bytes)`.
    pub(super) fn copy_runs(
        dev: &Device,
        sb: u64,
        db: u64,
        runs: &[CopyRun],
    ) -> Result<(u64, u64), TransferError> {
        let mut bytes = 0;
        for r in runs {
            bytes += r.len;
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
        Ok((runs.len() as u64, bytes))
    }

    /// The converting gather for `runs`: one launch, or under
    /// [`GatherUpload::Pipelined`] one per [`Pipeline::chunks`] slice, each
    /// issued before the next slice is packed (the stream runs slice `k`
    /// while the host packs `k + 1`; the caller synchronizes once after the
    /// last). Returns `(launches, bytes)` as [`CudaCopyBackend::gather_one`].
    /// On an error, the slices already launched may still run: the caller
    /// synchronizes before it returns, whatever happened.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather(
        dev: &mut Device,
        sb: u64,
        db: u64,
        runs: &[CopyRun],
        block_bytes: u64,
        regions: (u64, u64),
        tuning: &GatherTuning,
        (upload, pipeline): (GatherUpload, &Pipeline),
    ) -> Result<(u64, u64), TransferError> {
        let one = (upload, false);
        if !upload.pipelines() {
            return Self::gather_one(dev, sb, db, runs, block_bytes, regions, tuning, one);
        }
        let two = upload == GatherUpload::Pipelined2;
        if two && dev.aux.is_none() {
            // Before the first chunk: a piece table uploaded for it is then
            // waited for before the second stream can read it
            // (`Tables::pieces` with two streams).
            let s = dev.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
            dev.aux = Some(s);
        }
        let (mut launches, mut bytes) = (0, 0);
        for (k, chunk) in pipeline.chunks(runs).enumerate() {
            let on_aux = two && k % 2 == 1;
            if on_aux {
                // Set before the launch: `Device::sync` then waits for
                // `aux` whatever the launch returns.
                dev.aux_in_flight = true;
            }
            let (l, b) = Self::gather_one(
                dev,
                sb,
                db,
                chunk,
                block_bytes,
                regions,
                tuning,
                (upload, on_aux),
            )?;
            launches += l;
            bytes += b;
        }
        Ok((launches, bytes))
    }

    /// One launch of the converting gather for `runs` (on the device's
    /// second stream when `on_aux`); returns `(launches, bytes)`, the bytes
    /// being the rows the launch covers (every run checked to be `blocks x
    /// block_bytes` long), so the part's outcome needs no second pass over
    /// its runs.
    #[allow(clippy::too_many_arguments)]
    fn gather_one(
        dev: &mut Device,
        sb: u64,
        db: u64,
        runs: &[CopyRun],
        block_bytes: u64,
        regions: (u64, u64),
        tuning: &GatherTuning,
        (upload, on_aux): (GatherUpload, bool),
    ) -> Result<(u64, u64), TransferError> {
        let bad = |e: crate::cuda_gather::ConvertError| TransferError::input("runs", e.to_string());
        // Up to 8,128 blocks the launch writes the inline table (or packed
        // ids) from the runs themselves, into the id Vec of the last fetch;
        // larger batches build the plan.
        let words = std::mem::take(&mut dev.words);
        if let Some(direct) =
            RunsGather::with_words(runs, block_bytes, tuning, words).map_err(bad)?
        {
            let launched = launch_convert(dev, &direct, (sb, db), tuning, upload, on_aux, None);
            let bytes = direct.bytes();
            dev.words = direct.into_words();
            return Ok((launched?, bytes));
        }
        let plan = ConvertPlan::from_runs_tuned(runs, block_bytes, regions.0, regions.1, tuning)
            .map_err(bad)?;
        Ok((
            launch_convert(dev, &plan, (sb, db), tuning, upload, on_aux, None)?,
            plan.bytes(),
        ))
    }

    /// The converting gather for a part's [`PackedRows`] (its plan packed
    /// the ids): one launch, or under [`GatherUpload::Pipelined`] one per
    /// [`Pipeline::block_chunks`] range (odd ones on the second stream under
    /// `Pipelined2`), each a slice of the plan's words; no pass over the
    /// runs, no allocation once the device has seen the block size. The
    /// caller checked `rows.region_bytes()` against both regions and
    /// synchronizes after the last launch, whatever happened. Returns
    /// `(launches, bytes)` as [`CudaCopyBackend::gather_one`].
    pub(super) fn gather_rows(
        dev: &mut Device,
        (sb, db): (u64, u64),
        rows: &PackedRows,
        tuning: &GatherTuning,
        (upload, pipeline): (GatherUpload, &Pipeline),
    ) -> Result<(u64, u64), TransferError> {
        let bad = |e: crate::cuda_gather::ConvertError| TransferError::input("runs", e.to_string());
        let (n, bb) = (rows.blocks(), rows.block_bytes());
        let two = upload == GatherUpload::Pipelined2;
        if two && dev.aux.is_none() {
            // Before the first chunk, as in `gather`.
            let s = dev.ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
            dev.aux = Some(s);
        }
        let mut chunks = pipeline.block_chunks(n, bb);
        let whole = [(0, n)];
        let mut one = whole.iter().copied();
        let ranges: &mut dyn Iterator<Item = (usize, usize)> = if upload.pipelines() {
            &mut chunks
        } else {
            &mut one
        };
        let (mut launches, mut bytes) = (0, 0);
        for (k, (start, len)) in ranges.enumerate() {
            let on_aux = two && k % 2 == 1;
            let pieces = dev.row_pieces.get(bb, len, tuning.max_piece_bytes());
            let g = rows.gather(start, len, pieces).map_err(bad)?;
            if on_aux {
                // Set before the launch: `Device::sync` then waits for
                // `aux` whatever the launch returns.
                dev.aux_in_flight = true;
            }
            launches += launch_convert(dev, &g, (sb, db), tuning, upload, on_aux, None)?;
            bytes += g.bytes();
        }
        Ok((launches, bytes))
    }
}

/// Consecutive slices of `runs` of at most `max_blocks` blocks each (a run
/// longer than that is a slice of its own): one kernel launch per slice.
pub(super) fn launch_batches(runs: &[CopyRun], max_blocks: usize) -> Vec<&[CopyRun]> {
    let mut out = Vec::new();
    let (mut start, mut blocks) = (0, 0usize);
    for (i, r) in runs.iter().enumerate() {
        if i > start && blocks + r.blocks as usize > max_blocks {
            out.push(&runs[start..i]);
            (start, blocks) = (i, 0);
        }
        blocks += r.blocks as usize;
    }
    if start < runs.len() {
        out.push(&runs[start..]);
    }
    out
}
