//! Phase timing and the launch-knob sweep of the GPU benchmark.
//!
//! Phases (every GPU scattered `cuda_ipc` row and every converting row):
//! host plan (what `deliver` builds per fetch before the launch: for a part
//! of more than 128 blocks with 16-bit ids the [`RowsGather`] of its plan's
//! packed rows, O(1); otherwise from the fetch's runs, a [`RunsGather`] up
//! to 8,128 blocks and a [`ConvertPlan`] past that; or the converting rows'
//! [`ConvertPlan`] from moves),
//! host tables (launch geometry and the block table written into pinned
//! memory), table upload and kernel alone (CUDA events), each a median of
//! `repeats` profiled launches after one warm-up; `kernel_ratio` is the raw
//! copy's time over the kernel's, the ratio the kernel would reach with no
//! host or upload cost.
//!
//! Knobs: `KV_GATHER_THREADS`, `KV_GATHER_CTAS_PER_SM`, `KV_GATHER_MAX_PIECE`
//! (bytes) override [`GatherTuning::default`] for the benchmark only.
//! `--sweep` runs the scattered 1024 x 64 KiB and 4096 x 16 KiB rows and the
//! 8B-shape HF conversion over [`GRID`] and reports each combination plus
//! the best per row (highest end-to-end ratio).

use std::time::{Duration, Instant};

use kv_bank::BankMemory;
use serde::{Deserialize, Serialize};

use crate::bench::{median, BenchRow};
use crate::cuda::CudaCopyBackend;
use crate::cuda_gather::{ContiguousPieces, ConvertPlan, GatherTuning, RowsGather, RunsGather};
use crate::plan::TransferPlan;
use crate::TransferError;

/// Medians of the phases of one row's launch, µs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Building the `ConvertPlan` on the host.
    pub host_plan_us: f64,
    /// Geometry and block table into pinned memory, host.
    pub host_tables_us: f64,
    /// Table upload, device (CUDA events).
    pub upload_us: f64,
    /// Kernel alone, device (CUDA events).
    pub kernel_us: f64,
    /// Raw copy time / kernel time.
    pub kernel_ratio: f64,
}

/// `(threads, ctas_per_sm, max_piece_bytes)` combinations of `--sweep` (18).
pub const GRID: [(u32, u32, u64); 18] = {
    let mut g = [(0, 0, 0); 18];
    let (t, c, p) = ([128, 256, 512], [4, 8, 16], [16 << 10, 64 << 10]);
    let mut i = 0;
    while i < 18 {
        g[i] = (t[i / 6], c[(i / 2) % 3], p[i % 2]);
        i += 1;
    }
    g
};

fn env_u64(name: &'static str, default: u64) -> Result<u64, TransferError> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| TransferError::input(name, format!("`{v}` is not an integer"))),
        Err(_) => Ok(default),
    }
}

/// The benchmark's tuning: [`GatherTuning::default`] (with its per-shape
/// small-piece geometry) when none of `KV_GATHER_THREADS`,
/// `KV_GATHER_CTAS_PER_SM`, `KV_GATHER_MAX_PIECE` is set; otherwise one
/// geometry for every shape ([`GatherTuning::new`]), unset knobs at their
/// defaults.
///
/// # Errors
/// [`TransferError::InvalidInput`] naming the variable (non-integer) or
/// `KV_GATHER_*` with the [`crate::cuda_gather::ConvertError::Tuning`] text
/// naming the knob (out of range).
pub fn env_tuning() -> Result<GatherTuning, TransferError> {
    let d = GatherTuning::default();
    const KNOBS: [&str; 3] = [
        "KV_GATHER_THREADS",
        "KV_GATHER_CTAS_PER_SM",
        "KV_GATHER_MAX_PIECE",
    ];
    if KNOBS.iter().all(|k| std::env::var_os(k).is_none()) {
        return Ok(d);
    }
    let t = env_u64("KV_GATHER_THREADS", u64::from(d.threads()))?;
    let c = env_u64("KV_GATHER_CTAS_PER_SM", u64::from(d.ctas_per_sm()))?;
    let p = env_u64("KV_GATHER_MAX_PIECE", d.max_piece_bytes())?;
    let narrow = |name, v: u64| {
        u32::try_from(v).map_err(|_| TransferError::input(name, format!("{v} is out of range")))
    };
    GatherTuning::new(
        narrow("KV_GATHER_THREADS", t)?,
        narrow("KV_GATHER_CTAS_PER_SM", c)?,
        p,
    )
    .map_err(|e| TransferError::input("KV_GATHER_*", e.to_string()))
}

/// What `deliver` launches for a block-major part: the rows straight from
/// the runs ([`RunsGather`]) or a built plan.
pub(crate) enum Built<'a> {
    /// The plan's packed rows (more than 128 blocks, 16-bit ids), as the
    /// unchunked launch of `deliver` (`upload=params`).
    Rows(RowsGather<'a>),
    /// Up to 8,128 blocks.
    Runs(RunsGather<'a>),
    /// Larger fetches, and every converting row.
    Plan(ConvertPlan),
}

/// Profiles `build(words)` (the host plan) and the launch of what it built
/// `repeats` times after one warm-up; `raw` is the raw copy of the same
/// bytes. `words` is the packed-id Vec of the previous build (empty at
/// first), as `deliver` hands it from fetch to fetch.
pub(crate) fn phases<'a>(
    backend: &CudaCopyBackend,
    build: &dyn Fn(Vec<u32>) -> Result<Built<'a>, TransferError>,
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
    repeats: usize,
    raw: Duration,
) -> Result<Phases, TransferError> {
    let (mut hp, mut ht, mut up, mut k) = (vec![], vec![], vec![], vec![]);
    let mut words = Vec::new();
    for i in 0..=repeats {
        let t0 = Instant::now();
        let built = build(std::mem::take(&mut words))?;
        let host_plan = t0.elapsed();
        let p = match &built {
            Built::Rows(g) => backend.profile_rows(g, src, dst)?,
            Built::Runs(g) => backend.profile_runs(g, src, dst)?,
            Built::Plan(plan) => backend.profile_convert(plan, src, dst)?,
        };
        if let Built::Runs(g) = built {
            words = g.into_words();
        }
        if i > 0 {
            hp.push(host_plan);
            ht.push(Duration::from_secs_f64(p.host_tables_us / 1e6));
            up.push(Duration::from_secs_f64(p.upload_us / 1e6));
            k.push(Duration::from_secs_f64(p.kernel_us / 1e6));
        }
    }
    let us = |v| median(v).as_secs_f64() * 1e6;
    let kernel_us = us(k);
    Ok(Phases {
        host_plan_us: us(hp),
        host_tables_us: us(ht),
        upload_us: us(up),
        kernel_us,
        kernel_ratio: raw.as_secs_f64() * 1e6 / kernel_us,
    })
}

/// What `deliver` builds for rank 0 of `plan` (block-major rows): the
/// [`RowsGather`] of the plan's packed rows (its piece table from `pieces`,
/// kept across fetches as the backend keeps it) when the part has them,
/// else the direct [`RunsGather`] (packing into `words`, the last fetch's
/// Vec) when the fetch fits it, else [`plan_of_runs`].
pub(crate) fn launch_of_runs<'a>(
    plan: &'a TransferPlan,
    src_len: u64,
    dst_len: u64,
    tuning: &GatherTuning,
    (words, pieces): (Vec<u32>, &std::cell::RefCell<ContiguousPieces>),
) -> Result<Built<'a>, TransferError> {
    let part = &plan.parts()[0];
    if let Some(rows) = part.packed_rows() {
        let (n, bb) = (rows.blocks(), rows.block_bytes());
        let p = pieces.borrow_mut().get(bb, n, tuning.max_piece_bytes());
        return rows
            .gather(0, n, p)
            .map(Built::Rows)
            .map_err(|e| TransferError::input("runs", e.to_string()));
    }
    let blocks: u64 = part.runs().iter().map(|r| u64::from(r.blocks)).sum();
    let bb = part.expected_bytes() / blocks.max(1);
    match RunsGather::with_words(part.runs(), bb, tuning, words)
        .map_err(|e| TransferError::input("runs", e.to_string()))?
    {
        Some(g) => Ok(Built::Runs(g)),
        None => plan_of_runs(plan, src_len, dst_len, tuning).map(Built::Plan),
    }
}

/// The `ConvertPlan` of rank 0 of `plan` (block-major rows, one piece per
/// block before splitting), what `deliver` builds past 8,128 blocks.
pub(crate) fn plan_of_runs(
    plan: &TransferPlan,
    src_len: u64,
    dst_len: u64,
    tuning: &GatherTuning,
) -> Result<ConvertPlan, TransferError> {
    let part = &plan.parts()[0];
    let blocks: u64 = part.runs().iter().map(|r| u64::from(r.blocks)).sum();
    let bb = part.expected_bytes() / blocks.max(1);
    ConvertPlan::from_runs_tuned(part.runs(), bb, src_len, dst_len, tuning)
        .map_err(|e| TransferError::input("runs", e.to_string()))
}

/// `--sweep`: the scattered 1024 x 64 KiB and 4096 x 16 KiB rows
/// (end-to-end `deliver`, with phases) and the 8B-shape HF conversion for
/// every tuning of [`GRID`], then the best per case. `quick` shrinks the
/// cases as the main benchmark does.
///
/// # Errors
/// As [`crate::bench::run`] on the GPU profile.
pub(crate) fn sweep(quick: bool, repeats: usize) -> Result<Vec<BenchRow>, TransferError> {
    use crate::bench::{fill, layout_for, plan_for, row, sizes, time_delivery, verify};
    use crate::cuda::CudaMode;
    use crate::{RankIo, SourceRegion};
    let mut rows = Vec::new();
    let cases: Vec<_> = sizes(quick).into_iter().take(2).collect();
    let mut mems = Vec::new();
    for s in &cases {
        let layout = layout_for(s.block_bytes)?;
        let total = s.blocks as usize * s.block_bytes;
        let src = kv_bank::CudaDeviceMemory::new(0, 2 * total)?;
        let dst = kv_bank::CudaDeviceMemory::new(0, total)?;
        fill(&src, 3)?;
        let raw = median(crate::cuda::time_raw_device_copy(
            0,
            0,
            dst.base_addr(),
            src.base_addr(),
            total,
            repeats,
        )?);
        let plan = plan_for(&layout, s.blocks, true)?;
        mems.push((src, dst, raw, plan, s.blocks, s.label));
    }
    let mut label_of = None;
    for &(t, c, p) in &GRID {
        let tuning =
            GatherTuning::new(t, c, p).map_err(|e| TransferError::input("sweep", e.to_string()))?;
        let backend = CudaCopyBackend::new(CudaMode::Auto)?.with_tuning(tuning);
        label_of.get_or_insert_with(|| backend.upload_label());
        for (src, dst, raw, plan, blocks, size) in &mems {
            let io = [RankIo {
                src: SourceRegion::Mapped(src),
                dst,
            }];
            let time = time_delivery(plan, &backend, &io, repeats)?;
            let name = format!("sweep/scattered/{blocks}x{size}/{}", label(&tuning));
            verify(plan, src, dst, &name)?;
            let (sl, dl) = (src.len() as u64, dst.len() as u64);
            let pieces = Default::default();
            let build = |w| launch_of_runs(plan, sl, dl, &tuning, (w, &pieces));
            let mut r = row(name, plan, *blocks, time, *raw);
            r.phases = Some(phases(&backend, &build, src, dst, repeats, *raw)?);
            rows.push(r);
        }
        for mut r in
            crate::bench_convert::rows(&backend, quick, repeats, &tuning, Some("hf_tokens_at_48"))?
        {
            let case = r.name.replace("gpu/cuda_convert/", "");
            r.name = format!("sweep/{case}/{}", label(&tuning));
            rows.push(r);
        }
    }
    best_rows(&mut rows);
    if let Some(b) = &label_of {
        crate::bench::label_gather_rows(&mut rows, b);
    }
    Ok(rows)
}

/// Label of a tuning in sweep row names, e.g. `t256_c8_p64KiB`.
pub fn label(t: &GatherTuning) -> String {
    format!(
        "t{}_c{}_p{}KiB",
        t.threads(),
        t.ctas_per_sm(),
        t.max_piece_bytes() >> 10
    )
}

/// Appends, for every row prefix `sweep/<case>/`, a `sweep_best/<case>/<label>`
/// copy of its highest-ratio combination.
pub(crate) fn best_rows(rows: &mut Vec<BenchRow>) {
    let mut best: Vec<BenchRow> = Vec::new();
    for r in rows.iter() {
        let Some((case, _)) = r
            .name
            .strip_prefix("sweep/")
            .and_then(|n| n.rsplit_once('/'))
        else {
            continue;
        };
        let name = format!("sweep_best/{case}/");
        match best.iter_mut().find(|b| b.name.starts_with(&name)) {
            Some(b) if b.ratio >= r.ratio => {}
            Some(b) => *b = rename(r, &name),
            None => best.push(rename(r, &name)),
        }
    }
    rows.extend(best);
}

fn rename(r: &BenchRow, prefix: &str) -> BenchRow {
    let tail = r.name.rsplit_once('/').map_or("", |(_, t)| t);
    BenchRow {
        name: format!("{prefix}{tail}"),
        ..r.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, ratio: f64) -> BenchRow {
        BenchRow {
            name: name.into(),
            bytes: 1,
            blocks: 1,
            gbps: ratio,
            raw_gbps: 1.0,
            ratio,
            p50_us: 1.0,
            phases: None,
            gather_upload: None,
        }
    }

    #[test]
    fn grid_is_18_distinct_valid_tunings() {
        let mut seen = std::collections::HashSet::new();
        for (t, c, p) in GRID {
            GatherTuning::new(t, c, p).unwrap();
            assert!(seen.insert((t, c, p)));
        }
        assert_eq!(seen.len(), 18);
    }

    #[test]
    fn best_row_per_case_is_the_highest_ratio() {
        let mut rows = vec![
            row("gpu/cuda_ipc/scattered/1024x64KiB", 0.9),
            row("sweep/scattered/1024x64KiB/t128_c4_p16KiB", 0.7),
            row("sweep/scattered/1024x64KiB/t256_c8_p64KiB", 0.8),
            row("sweep/scattered/4096x16KiB/t128_c4_p16KiB", 0.5),
            row("sweep/scattered/4096x16KiB/t512_c16_p64KiB", 0.4),
        ];
        best_rows(&mut rows);
        let best: Vec<_> = rows[5..]
            .iter()
            .map(|r| (r.name.as_str(), r.ratio))
            .collect();
        assert_eq!(
            best,
            [
                ("sweep_best/scattered/1024x64KiB/t256_c8_p64KiB", 0.8),
                ("sweep_best/scattered/4096x16KiB/t128_c4_p16KiB", 0.5),
            ]
        );
    }

    #[test]
    fn env_knobs_override_and_refuse_by_name() {
        // One test owns these variables (tests in this binary run in threads).
        std::env::set_var("KV_GATHER_THREADS", "512");
        std::env::set_var("KV_GATHER_CTAS_PER_SM", "4");
        std::env::set_var("KV_GATHER_MAX_PIECE", "16384");
        assert_eq!(
            env_tuning().unwrap(),
            GatherTuning::new(512, 4, 16384).unwrap()
        );
        std::env::set_var("KV_GATHER_THREADS", "x");
        let e = env_tuning().unwrap_err().to_string();
        assert!(e.contains("KV_GATHER_THREADS"), "{e}");
        std::env::set_var("KV_GATHER_THREADS", "100");
        let e = env_tuning().unwrap_err().to_string();
        assert!(e.contains("tuning.threads"), "{e}");
        for v in [
            "KV_GATHER_THREADS",
            "KV_GATHER_CTAS_PER_SM",
            "KV_GATHER_MAX_PIECE",
        ] {
            std::env::remove_var(v);
        }
        assert_eq!(env_tuning().unwrap(), GatherTuning::default());
    }
}
