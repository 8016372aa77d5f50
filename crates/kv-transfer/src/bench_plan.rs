//! Host plan-building rows of the CPU benchmark: what building the
//! converting gather's plan costs per fetch, per layout, measured without a
//! GPU (the GPU rows' `host_plan_us` phase is the same work on the H200's
//! host).
//!
//! Rows (median of `repeats` builds after one warm-up), printed after the
//! copy rows:
//! - `cpu/plan_build/runs/<n>x<size>`: `ConvertPlan::from_runs` of a
//!   scattered `TransferPlan`'s rows, what `deliver` builds per rank past
//!   8,128 blocks;
//! - `cpu/plan_build/runs_direct/<n>x<size>`: `RunsGather::with_words`,
//!   what `deliver` does up to 8,128 blocks for a part without packed rows
//!   (one branch-free pass that checks the runs and, past 128 blocks, packs
//!   the ids into the previous fetch's Vec; the launch writes the table from
//!   the runs; a larger fetch returns at once and builds the plan);
//! - `cpu/plan_build/packed_rows/<n>x<size>`: `PackedRows::gather` of the
//!   whole part with the piece table kept from the previous fetch, what
//!   `deliver` builds per fetch for a part whose plan packed its ids (more
//!   than 128 blocks, ids below 65,536: both scattered shapes; the 128-block
//!   row has none and repeats `runs_direct`'s work);
//! - `cpu/plan_build/8b_to_<target>/<n>x<size>`: `ConvertShape::plan` of the
//!   8B shape into block-major, vLLM kv-first and HF at token offset 48, the
//!   shape built once per target (as `CudaCopyBackend` caches it);
//! - `cpu/plan_build_cold/8b_to_<target>/..`: `ConvertPlan::new`, which
//!   builds the piece table again on every call;
//! - `cpu/transfer_plan/scattered/<n>x<size>`: `TransferPlan::new` of the
//!   scattered moves (checks, sort, runs), built before `deliver` is called;
//! - `cpu/deliver_host/scattered/<n>x<size>`: `deliver` of that plan through a
//!   backend that moves nothing and reports the part's expected bytes:
//!   `deliver`'s own host work per fetch (region bounds, control checks,
//!   report), the part of a GPU fetch's host time outside the backend;
//! - `cpu/destination_pool/reserve_complete/<n>x<size>`: the target's
//!   destination bookkeeping per fetch, `kv_bank::DestinationPool::reserve_exact`
//!   of `n` engine-chosen blocks (scattered ids of a pool of `n + 8`), then
//!   `complete` and the release of its `CompletedBlocks` (before the copies,
//!   after them, and once the engine read them).
//!
//! `p50_us` is the build time. `GBps` is the fetch's bytes over the build
//! time and `raw_GBps` the raw memcpy rate of the copy rows' same block size
//! (the 2 MiB row for the 8B shape) in the same run, so `ratio` = copy time
//! of the fetch / plan time: how many times faster planning is than moving
//! the bytes at memcpy speed on this host.

use std::time::{Duration, Instant};

use crate::bench::{gbps, median, moves_for, plan_of_moves, sizes, BenchRow};
use crate::bench_convert::{bad, case, Case};
use crate::bench_sweep::plan_of_runs;
use crate::cuda_gather::{ContiguousPieces, ConvertPlan, ConvertShape, GatherTuning, RunsGather};
use crate::delivery::{CopyBackend, PartOutcome, RankIo, SourceRegion};
use crate::plan::PartPlan;
use crate::{deliver, DeliveryControl, HostBuffer, TransferError};

/// A backend that moves nothing and reports each part's expected bytes, so
/// `deliver` completes: times `deliver`'s own host work.
struct NoCopy;

impl CopyBackend for NoCopy {
    fn name(&self) -> &'static str {
        "no_copy"
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        _io: &RankIo<'_>,
        _control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        Ok(PartOutcome {
            bytes: part.expected_bytes(),
            copies: 0,
            host_payload_bytes: 0,
            transport: "none".into(),
        })
    }
}

/// Median of `repeats` timed calls of `f` after one warm-up.
fn time<T>(
    repeats: usize,
    mut f: impl FnMut() -> Result<T, TransferError>,
) -> Result<Duration, TransferError> {
    let mut v = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let t0 = Instant::now();
        let out = f()?;
        let t = t0.elapsed();
        drop(out);
        if i > 0 {
            v.push(t);
        }
    }
    Ok(median(v))
}

fn plan_row(name: String, bytes: u64, blocks: u64, t: Duration, raw_gbps: f64) -> BenchRow {
    let g = gbps(bytes, t);
    BenchRow {
        name,
        bytes,
        blocks,
        gbps: g,
        raw_gbps,
        ratio: g / raw_gbps,
        p50_us: t.as_secs_f64() * 1e6,
        phases: None,
        gather_upload: None,
    }
}

/// The plan rows; `copy_rows` are the CPU copy rows of the same run (their
/// raw rates are the rows' baselines). See the module docs.
///
/// # Errors
/// A layout or plan the benchmark builds is refused
/// ([`TransferError::InvalidInput`] naming `bench.convert` or `runs`).
pub(crate) fn rows(
    quick: bool,
    repeats: usize,
    copy_rows: &[BenchRow],
) -> Result<Vec<BenchRow>, TransferError> {
    let raw_for = |label: &str| {
        copy_rows
            .iter()
            .find(|r| r.name.ends_with(label))
            .map_or(f64::NAN, |r| r.raw_gbps)
    };
    let tuning = GatherTuning::default();
    let mut out = Vec::new();
    for s in sizes(quick) {
        let layout = crate::bench::layout_for(s.block_bytes)?;
        let moves = moves_for(s.blocks, true);
        let plan = plan_of_moves(&layout, s.blocks, &moves)?;
        let transfer_plan = time(repeats, || plan_of_moves(&layout, s.blocks, &moves))?;
        // Regions of the plan's sizes (never touched: `NoCopy` moves nothing).
        let total = s.blocks as usize * s.block_bytes;
        let (src, dst) = (HostBuffer::zeroed(2 * total)?, HostBuffer::zeroed(total)?);
        let io = [RankIo {
            src: SourceRegion::Mapped(&src),
            dst: &dst,
        }];
        let control = DeliveryControl::new();
        let deliver_host = time(repeats, || {
            let r = deliver(&plan, &NoCopy, &io, &control)?;
            if r.is_complete() {
                Ok(r)
            } else {
                Err(TransferError::input(
                    "bench",
                    "a no-copy delivery was not complete",
                ))
            }
        })?;
        let len = 2 * s.blocks as u64 * s.block_bytes as u64;
        let t = time(repeats, || plan_of_runs(&plan, len, len, &tuning))?;
        let part = &plan.parts()[0];
        let bb = s.block_bytes as u64;
        // As `deliver` does: each fetch packs into the previous one's Vec.
        let mut words = Vec::new();
        let direct = time(repeats, || {
            let g = RunsGather::with_words(part.runs(), bb, &tuning, std::mem::take(&mut words))
                .map_err(|e| TransferError::input("runs", e.to_string()))?;
            Ok(g.map(|g| {
                let bytes = g.bytes();
                words = g.into_words();
                bytes
            }))
        })?;
        // As the CUDA backend does per fetch: the part's packed rows (built
        // with the plan) as one launch, its piece table kept by the device.
        let mut pieces = ContiguousPieces::default();
        let rows = time(repeats, || match part.packed_rows() {
            Some(rows) => {
                let p = pieces.get(bb, rows.blocks(), tuning.max_piece_bytes());
                let g = rows
                    .gather(0, rows.blocks(), p)
                    .map_err(|e| TransferError::input("runs", e.to_string()))?;
                Ok(g.bytes())
            }
            None => RunsGather::with_words(part.runs(), bb, &tuning, std::mem::take(&mut words))
                .map_err(|e| TransferError::input("runs", e.to_string()))
                .map(|g| g.map_or(0, |g| g.bytes())),
        })?;
        // The target's destination bookkeeping per fetch: the engine-chosen
        // blocks reserved (scattered, as an allocator hands them out),
        // completed, then released when the engine's cache is done with them.
        let pool = kv_bank::DestinationPool::new(s.blocks + 8);
        let ids: Vec<u32> = (0..s.blocks).rev().collect();
        let destination = time(repeats, || {
            let r = pool
                .reserve_exact(&ids)
                .map_err(|e| TransferError::input("bench", e.to_string()))?;
            Ok(r.complete())
        })?;
        let size = format!("{}x{}", s.blocks, s.label);
        for (kind, t) in [
            ("plan_build/runs", t),
            ("plan_build/runs_direct", direct),
            ("plan_build/packed_rows", rows),
            ("transfer_plan/scattered", transfer_plan),
            ("deliver_host/scattered", deliver_host),
            ("destination_pool/reserve_complete", destination),
        ] {
            out.push(plan_row(
                format!("cpu/{kind}/{size}"),
                plan.expected_bytes(),
                u64::from(s.blocks),
                t,
                raw_for(&format!("x{}", s.label)),
            ));
        }
    }
    let Case {
        blocks,
        block_bytes,
        donor,
        targets,
        moves,
        size,
    } = case(quick)?;
    let bytes = u64::from(blocks) * block_bytes;
    let raw = raw_for("x2MiB");
    for (label, target) in &targets {
        let shape = ConvertShape::new(&donor, target, &tuning).map_err(bad)?;
        let hot = time(repeats, || shape.plan(&moves).map_err(bad))?;
        let cold = time(repeats, || {
            ConvertPlan::new(&donor, target, &moves).map_err(bad)
        })?;
        for (kind, t) in [("plan_build", hot), ("plan_build_cold", cold)] {
            out.push(plan_row(
                format!("cpu/{kind}/8b_to_{label}/{blocks}x{size}"),
                bytes,
                u64::from(blocks),
                t,
                raw,
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// Prints the full-size plan rows (`cargo test -p kv-transfer --features
    /// qualify --lib plan_rows_print -- --ignored --nocapture`; build
    /// kv-transfer optimized for real numbers, e.g. `--config
    /// 'profile.dev.package.kv-transfer.opt-level=3'`). Ignored: a timing
    /// print, not a check.
    #[test]
    #[ignore]
    fn plan_rows_print() {
        let rows = super::rows(false, 200, &[]).unwrap();
        for r in &rows {
            println!("{:<50} p50 {:>9.2} us", r.name, r.p50_us);
        }
        assert!(rows.iter().all(|r| r.p50_us > 0.0));
    }
}
