//! Ratio benchmark behind `cargo xtask bench transfer`.
//!
//! Every row times one backend moving `blocks` blocks of one size and puts it
//! next to a raw copy of the same total bytes measured in the same run
//! (`memcpy` on the CPU profile, one `cuMemcpyDtoDAsync` on the GPU profile):
//! `ratio = GBps / raw_GBps`. Times are medians of `repeats` deliveries after
//! one warm-up; bytes count bytes copied (not read + written). Each case's
//! first and last destination rows are checked against the source after the
//! runs, so a row is never reported for a copy that did not happen.
//!
//! Cases: contiguous (one run) and scattered (every block its own run, donor
//! slots in a shuffled order) at 1024 x 64 KiB, 4096 x 16 KiB and 128 x 2 MiB; NIXL issued
//! with prepared lists and naively with one descriptor per block; on GPU also
//! the device-copy-per-run baseline, a peer (GPU0 -> GPU1) case when two GPUs
//! are visible, a 7 x 32 KiB fetch whose end-to-end p50 latency is given
//! in `p50_us`, and (module `bench_convert`) the converting gather on the
//! 8B-model shape: 512 scattered 2 MiB blocks from a block-major donor to a
//! block-major, a vLLM per-layer (kv-first) and an HF per-layer target at a
//! token offset, each against a raw copy of the same 1 GiB. On CPU, after the
//! copy rows, module `bench_plan`'s host plan-building rows (per layout, no
//! GPU needed).

use std::time::{Duration, Instant};

use kv_bank::BankMemory;
use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
use serde::{Deserialize, Serialize};

use crate::cuda::{CudaCopyBackend, CudaMode};
use crate::nixl::{NixlAgent, NixlBackend, NixlMode};
use crate::oracle::Profile;
use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
use crate::{
    deliver, CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, NixlRemoteRegion, RankIo,
    SourceRegion, TransferError,
};

/// Benchmark settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchOpts {
    /// CPU (host memory) or GPU (device memory) cases.
    pub profile: Profile,
    /// Timed deliveries per row (median reported); at least 1.
    pub repeats: usize,
    /// Shrink every case to at most 64 blocks (for smoke tests).
    pub quick: bool,
    /// Include NIXL rows when the runtime loads (skipped rows are not errors).
    pub nixl: bool,
    /// GPU profile: run only the launch-knob sweep (`bench_sweep`) instead
    /// of the rows.
    #[serde(default)]
    pub sweep: bool,
}

impl Default for BenchOpts {
    fn default() -> Self {
        Self {
            profile: Profile::Cpu,
            repeats: 10,
            quick: false,
            nixl: true,
            sweep: false,
        }
    }
}

/// One benchmark row (JSON keys: `name, bytes, blocks, GBps, raw_GBps, ratio`,
/// plus `p50_us` when the row is a latency case).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    /// `backend/pattern/blocksxsize`, e.g. `host_memcpy/scattered/1024x64KiB`.
    pub name: String,
    /// Bytes per delivery.
    pub bytes: u64,
    /// Blocks per delivery.
    pub blocks: u64,
    /// Throughput of the backend, 10^9 bytes per second (median time).
    #[serde(rename = "GBps")]
    pub gbps: f64,
    /// Throughput of the raw copy of the same bytes, same run.
    #[serde(rename = "raw_GBps")]
    pub raw_gbps: f64,
    /// `GBps / raw_GBps`.
    pub ratio: f64,
    /// Median end-to-end delivery time in µs (every row; the headline for latency cases).
    pub p50_us: f64,
    /// GPU gather / convert rows: host plan, host tables, upload and
    /// kernel-only medians (JSON key `phases`, absent elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<crate::bench_sweep::Phases>,
    /// GPU rows of the gather backend (`cuda_ipc`, `cuda_convert`, sweep):
    /// how block tables reached the kernel, as
    /// [`CudaCopyBackend::upload_label`] says (`upload=params`,
    /// `upload=pipelined first=16384KiB growth=4`, `upload=copy`; set with
    /// `KV_GATHER_UPLOAD`). JSON key `gather_upload`, absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_upload: Option<String>,
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

pub(crate) fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Layout whose rank block is `block_bytes` (a multiple of 16 KiB): 16 tokens,
/// 4 heads of 64 bf16, `block_bytes / 16 KiB` layers, TP1.
pub(crate) fn layout_for(block_bytes: usize) -> Result<KvLayout, TransferError> {
    KvLayout::new(
        (block_bytes / 16_384) as u32,
        4,
        64,
        DType::Bf16,
        16,
        TensorOrder::BlockMajor,
        1,
    )
    .map_err(|e| TransferError::input("layout", e.to_string()))
}

/// A deterministic shuffle (64-bit LCG) so runs are reproducible.
pub(crate) fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v
}

/// The benchmark's moves: `blocks` target blocks in order from donor slots
/// `0..blocks` (contiguous) or every other slot of twice as many, shuffled
/// (scattered).
pub(crate) fn moves_for(blocks: u32, scattered: bool) -> Vec<BlockMove> {
    // Donor has twice the slots; scattered picks every other slot, shuffled.
    let src_slots: Vec<u32> = if scattered {
        shuffled(blocks, 7).into_iter().map(|s| 2 * s + 1).collect()
    } else {
        (0..blocks).collect()
    };
    src_slots
        .iter()
        .enumerate()
        .map(|(i, &s)| BlockMove {
            key: SequenceHash(i as u64),
            src_slot: Some(s),
            dst_block: i as u32,
        })
        .collect()
}

/// [`TransferPlan::new`] of [`moves_for`] over dense regions (donor twice
/// the target's blocks).
pub(crate) fn plan_of_moves(
    layout: &KvLayout,
    blocks: u32,
    moves: &[BlockMove],
) -> Result<TransferPlan, TransferError> {
    TransferPlan::new(
        layout,
        layout,
        moves,
        &[RegionGeometry::dense(layout, 2 * blocks)],
        &[RegionGeometry::dense(layout, blocks)],
    )
}

pub(crate) fn plan_for(
    layout: &KvLayout,
    blocks: u32,
    scattered: bool,
) -> Result<TransferPlan, TransferError> {
    plan_of_moves(layout, blocks, &moves_for(blocks, scattered))
}

pub(crate) fn fill(mem: &dyn BankMemory, seed: u8) -> Result<(), TransferError> {
    let chunk: Vec<u8> = (0..(1usize << 20))
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect();
    let mut off = 0;
    while off < mem.len() {
        let n = chunk.len().min(mem.len() - off);
        mem.write_bytes(off, &chunk[..n])?;
        off += n;
    }
    Ok(())
}

/// Checks the first and last planned rows against the donor bytes.
pub(crate) fn verify(
    plan: &TransferPlan,
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
    name: &str,
) -> Result<(), TransferError> {
    let runs = plan.parts()[0].runs();
    let bb = plan.rank_block_bytes() as usize;
    for r in [runs.first(), runs.last()].into_iter().flatten() {
        let (mut a, mut b) = (vec![0u8; bb], vec![0u8; bb]);
        src.read_bytes(r.src_offset as usize, &mut a)?;
        dst.read_bytes(r.dst_offset as usize, &mut b)?;
        if a != b {
            return Err(TransferError::input(
                "bench",
                format!("{name}: destination row differs from its source"),
            ));
        }
    }
    Ok(())
}

/// Checks every planned row of rank 0 against the donor bytes (one read of
/// each region, after the timed runs): the GPU gather rows' byte oracle,
/// so every upload variant's row stands on a fully checked copy.
pub(crate) fn verify_all(
    plan: &TransferPlan,
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
    name: &str,
) -> Result<(), TransferError> {
    let (mut a, mut b) = (vec![0u8; src.len()], vec![0u8; dst.len()]);
    src.read_bytes(0, &mut a)?;
    dst.read_bytes(0, &mut b)?;
    for (i, r) in plan.parts()[0].runs().iter().enumerate() {
        let (s, d, n) = (r.src_offset as usize, r.dst_offset as usize, r.len as usize);
        if a[s..s + n] != b[d..d + n] {
            return Err(TransferError::input(
                "bench",
                format!(
                    "{name}: run {i} (target block {}) differs from its source",
                    r.dst_block
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn time_delivery(
    plan: &TransferPlan,
    backend: &dyn CopyBackend,
    io: &[RankIo<'_>],
    repeats: usize,
) -> Result<Duration, TransferError> {
    let mut times = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let t0 = Instant::now();
        let rep = deliver(plan, backend, io, &DeliveryControl::new())?;
        let t = t0.elapsed();
        if !rep.is_complete() {
            return Err(TransferError::input(
                "bench",
                "a benchmark delivery was not complete",
            ));
        }
        if i > 0 {
            times.push(t);
        }
    }
    Ok(median(times))
}

fn time_memcpy(dst: &HostBuffer, src: &HostBuffer, bytes: usize, repeats: usize) -> Duration {
    let mut times = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let t0 = Instant::now();
        // SAFETY: both buffers are live, distinct and at least `bytes` long;
        // the benchmark is their only user.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.base_addr() as *const u8,
                dst.base_addr() as *mut u8,
                bytes,
            )
        };
        std::hint::black_box(dst.base_addr());
        if i > 0 {
            times.push(t0.elapsed());
        }
    }
    median(times)
}

pub(crate) struct Size {
    pub(crate) blocks: u32,
    pub(crate) block_bytes: usize,
    pub(crate) label: &'static str,
}

pub(crate) fn sizes(quick: bool) -> Vec<Size> {
    let cap = |n: u32| if quick { n.min(64) } else { n };
    vec![
        Size {
            blocks: cap(1024),
            block_bytes: 64 << 10,
            label: "64KiB",
        },
        Size {
            blocks: cap(4096),
            block_bytes: 16 << 10,
            label: "16KiB",
        },
        Size {
            blocks: cap(128),
            block_bytes: 2 << 20,
            label: "2MiB",
        },
    ]
}

pub(crate) fn row(
    name: String,
    plan: &TransferPlan,
    blocks: u32,
    t: Duration,
    raw: Duration,
) -> BenchRow {
    let bytes = plan.expected_bytes();
    let (g, rg) = (gbps(bytes, t), gbps(bytes, raw));
    BenchRow {
        name,
        bytes,
        blocks: u64::from(blocks),
        gbps: g,
        raw_gbps: rg,
        ratio: g / rg,
        p50_us: t.as_secs_f64() * 1e6,
        phases: None,
        gather_upload: None,
    }
}

/// Runs the benchmark of `opts.profile`; see the module docs.
///
/// # Errors
/// Memory allocation, a failed or incomplete delivery, or a destination row
/// that does not match its source. NIXL rows are skipped (not an error) when
/// the runtime is not loadable; GPU profile without a GPU is an error.
pub fn run(opts: &BenchOpts) -> Result<Vec<BenchRow>, TransferError> {
    let repeats = opts.repeats.max(1);
    match opts.profile {
        Profile::Cpu => run_cpu(opts, repeats),
        Profile::Gpu if opts.sweep => crate::bench_sweep::sweep(opts.quick, repeats),
        Profile::Gpu => run_gpu(opts, repeats),
    }
}

fn nixl_pair(tag: &str) -> Result<Option<(NixlAgent, std::sync::Arc<NixlAgent>)>, TransferError> {
    static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    if let Err(e) = crate::nixl::runtime_status() {
        tracing::warn!("NIXL rows skipped: {e}");
        return Ok(None);
    }
    let n = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tag = format!("{tag}-{}-{n}", std::process::id());
    let d = NixlAgent::new(&format!("kvx-bench-donor-{tag}"))?;
    let t = NixlAgent::new(&format!("kvx-bench-target-{tag}"))?;
    Ok(Some((d, std::sync::Arc::new(t))))
}

/// True for the GPU path's fail-closed refusals of an unverified or
/// host-staged NIXL transport (possibly wrapped in a part failure).
fn refused_unverified(e: &TransferError) -> bool {
    matches!(
        e.part_cause(),
        TransferError::TransportUnverified { .. } | TransferError::HostStaged { .. }
    )
}

/// NIXL rows for one size: prepared lists and the one-descriptor-per-block baseline.
#[allow(clippy::too_many_arguments)]
fn nixl_rows(
    rows: &mut Vec<BenchRow>,
    profile: &str,
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
    layout: &KvLayout,
    s: &Size,
    raw: Duration,
    repeats: usize,
) -> Result<(), TransferError> {
    let Some((donor, target)) = nixl_pair(profile)? else {
        return Ok(());
    };
    donor.register(src)?;
    target.register(dst)?;
    let name = target.load_remote(&donor.metadata()?)?;
    let remote = NixlRemoteRegion {
        agent_name: name,
        base_addr: src.base_addr(),
        len: src.len() as u64,
        kind: src.kind(),
    };
    let io = [RankIo {
        src: SourceRegion::Nixl(&remote),
        dst,
    }];
    for (pattern, scattered) in [("contiguous", false), ("scattered", true)] {
        let plan = plan_for(layout, s.blocks, scattered)?;
        for (mode, label) in [
            (NixlMode::Prepared, "nixl_prepared"),
            (NixlMode::PerBlock, "nixl_per_block"),
        ] {
            let backend = NixlBackend::new(target.clone(), mode);
            let t = match time_delivery(&plan, &backend, &io, repeats) {
                Ok(t) => t,
                // The GPU path refuses a NIXL VRAM read it cannot verify
                // device-direct (issue 15.7): one process with two agents gets
                // no GPU lane from UCX, and this bench keeps no UCX protocol
                // log. That is the product failing closed, not a bench
                // failure: the row is skipped with the reason, and
                // `kvq bench nixl-two-process` measures NIXL VRAM.
                Err(e) if refused_unverified(&e) => {
                    println!(
                        "SKIP {profile}/{label}/{pattern}/{}x{}: {e}",
                        s.blocks, s.label
                    );
                    continue;
                }
                Err(e) => return Err(e),
            };
            let rname = format!("{profile}/{label}/{pattern}/{}x{}", s.blocks, s.label);
            verify(&plan, src, dst, &rname)?;
            rows.push(row(rname, &plan, s.blocks, t, raw));
        }
    }
    Ok(())
}

fn run_cpu(opts: &BenchOpts, repeats: usize) -> Result<Vec<BenchRow>, TransferError> {
    let mut rows = Vec::new();
    for s in sizes(opts.quick) {
        let layout = layout_for(s.block_bytes)?;
        let total = s.blocks as usize * s.block_bytes;
        let src = HostBuffer::zeroed(2 * total)?;
        let dst = HostBuffer::zeroed(total)?;
        fill(&src, 1)?;
        // The raw memcpy is timed before and after the cases; the faster of
        // the two is the baseline, so a cold first measurement cannot flatter
        // the ratio.
        let raw_before = time_memcpy(&dst, &src, total, repeats);
        let io = [RankIo {
            src: SourceRegion::Mapped(&src),
            dst: &dst,
        }];
        let mut timed = Vec::new();
        for (pattern, scattered) in [("contiguous", false), ("scattered", true)] {
            let plan = plan_for(&layout, s.blocks, scattered)?;
            let t = time_delivery(&plan, &HostCopyBackend, &io, repeats)?;
            let name = format!("cpu/host_memcpy/{pattern}/{}x{}", s.blocks, s.label);
            verify(&plan, &src, &dst, &name)?;
            timed.push((name, plan, t));
        }
        let raw = raw_before.min(time_memcpy(&dst, &src, total, repeats));
        for (name, plan, t) in timed {
            rows.push(row(name, &plan, s.blocks, t, raw));
        }
        if opts.nixl {
            nixl_rows(&mut rows, "cpu", &src, &dst, &layout, &s, raw, repeats)?;
        }
    }
    let plans = crate::bench_plan::rows(opts.quick, repeats, &rows)?;
    rows.extend(plans);
    Ok(rows)
}

fn run_gpu(opts: &BenchOpts, repeats: usize) -> Result<Vec<BenchRow>, TransferError> {
    let devices = crate::cuda::device_count();
    if devices == 0 {
        return Err(TransferError::Cuda {
            op: "cuDeviceGetCount",
            reason: "no CUDA device visible".into(),
        });
    }
    let tuning = crate::bench_sweep::env_tuning()?;
    let auto = CudaCopyBackend::new(CudaMode::Auto)?.with_tuning(tuning);
    // Which block-table path the gather rows measure (a silent fallback to
    // the device upload changes every fixed cost), first in the log.
    println!("gather block tables on GPU 0: {}", auto.table_path(0)?);
    let per_run = CudaCopyBackend::new(CudaMode::CopyPerRun)?;
    let mut rows = Vec::new();
    let mut pairs = vec![(0u32, 0u32, "gpu")];
    if devices >= 2 {
        pairs.push((0, 1, "gpu_peer"));
    }
    for s in sizes(opts.quick) {
        let layout = layout_for(s.block_bytes)?;
        let total = s.blocks as usize * s.block_bytes;
        for &(sd, dd, prefix) in &pairs {
            let src = kv_bank::CudaDeviceMemory::new(sd, 2 * total)?;
            let dst = kv_bank::CudaDeviceMemory::new(dd, total)?;
            fill(&src, 3)?;
            let raw = median(crate::cuda::time_raw_device_copy(
                sd,
                dd,
                dst.base_addr(),
                src.base_addr(),
                total,
                repeats,
            )?);
            let io = [RankIo {
                src: SourceRegion::Mapped(&src),
                dst: &dst,
            }];
            for (pattern, scattered) in [("contiguous", false), ("scattered", true)] {
                let plan = plan_for(&layout, s.blocks, scattered)?;
                for (backend, label) in [(&auto, "cuda_ipc"), (&per_run, "cuda_copy_per_run")] {
                    if !scattered && label == "cuda_copy_per_run" {
                        continue; // one run: identical to the row above
                    }
                    // Zero the target first so the check below sees only
                    // what these deliveries wrote.
                    if label == "cuda_ipc" {
                        dst.write_bytes(0, &vec![0u8; dst.len()])?;
                    }
                    let t = time_delivery(&plan, backend, &io, repeats)?;
                    let name = format!("{prefix}/{label}/{pattern}/{}x{}", s.blocks, s.label);
                    if label == "cuda_ipc" {
                        verify_all(&plan, &src, &dst, &name)?;
                    } else {
                        verify(&plan, &src, &dst, &name)?;
                    }
                    let mut r = row(name, &plan, s.blocks, t, raw);
                    if scattered && label == "cuda_ipc" {
                        let (sl, dl) = (src.len() as u64, dst.len() as u64);
                        let pieces = Default::default();
                        let build = |w| {
                            crate::bench_sweep::launch_of_runs(&plan, sl, dl, &tuning, (w, &pieces))
                        };
                        r.phases = Some(crate::bench_sweep::phases(
                            &auto, &build, &src, &dst, repeats, raw,
                        )?);
                    }
                    rows.push(r);
                }
            }
            if opts.nixl {
                nixl_rows(&mut rows, prefix, &src, &dst, &layout, &s, raw, repeats)?;
            }
        }
    }
    // A 7-block fetch of 32 KiB blocks, scattered: end-to-end latency.
    let layout = layout_for(32 << 10)?;
    let src = kv_bank::CudaDeviceMemory::new(0, 64 * (32 << 10))?;
    let dst = kv_bank::CudaDeviceMemory::new(0, 32 * (32 << 10))?;
    fill(&src, 5)?;
    let moves: Vec<BlockMove> = [41u32, 3, 17, 29, 8, 60, 22]
        .iter()
        .enumerate()
        .map(|(i, &s)| BlockMove {
            key: SequenceHash(i as u64),
            src_slot: Some(s),
            dst_block: 2 * i as u32,
        })
        .collect();
    let plan = TransferPlan::new(
        &layout,
        &layout,
        &moves,
        &[RegionGeometry::dense(&layout, 64)],
        &[RegionGeometry::dense(&layout, 32)],
    )?;
    let raw = median(crate::cuda::time_raw_device_copy(
        0,
        0,
        dst.base_addr(),
        src.base_addr(),
        7 * (32 << 10),
        repeats.max(100),
    )?);
    let io = [RankIo {
        src: SourceRegion::Mapped(&src),
        dst: &dst,
    }];
    let t = time_delivery(&plan, &auto, &io, repeats.max(100))?;
    verify(&plan, &src, &dst, "fetch7")?;
    rows.push(row(
        "gpu/cuda_ipc/fetch7_latency/7x32KiB".into(),
        &plan,
        7,
        t,
        raw,
    ));
    rows.extend(crate::bench_convert::rows(
        &auto, opts.quick, repeats, &tuning, None,
    )?);
    label_gather_rows(&mut rows, &auto.upload_label());
    Ok(rows)
}

/// Sets `gather_upload` on the rows the gather backend ran (`cuda_ipc`,
/// `cuda_convert`, `sweep`), not on the per-run copy or NIXL rows.
pub(crate) fn label_gather_rows(rows: &mut [BenchRow], label: &str) {
    for r in rows {
        if ["/cuda_ipc/", "/cuda_convert/"]
            .iter()
            .any(|k| r.name.contains(k))
            || r.name.starts_with("sweep")
        {
            r.gather_upload = Some(label.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn gather_rows_carry_the_upload_variant() {
        let mut rows: Vec<BenchRow> = [
            "gpu/cuda_ipc/scattered/1024x64KiB",
            "gpu/cuda_copy_per_run/scattered/1024x64KiB",
            "gpu/nixl_prepared/scattered/1024x64KiB",
            "gpu/cuda_convert/8b_scattered_to_hf_tokens_at_48/512x2MiB",
            "sweep/scattered/1024x64KiB/t256_c8_p64KiB",
        ]
        .into_iter()
        .map(|n| BenchRow {
            name: n.into(),
            bytes: 1,
            blocks: 1,
            gbps: 1.0,
            raw_gbps: 1.0,
            ratio: 1.0,
            p50_us: 1.0,
            phases: None,
            gather_upload: None,
        })
        .collect();
        label_gather_rows(&mut rows, "upload=params");
        let got: Vec<bool> = rows.iter().map(|r| r.gather_upload.is_some()).collect();
        assert_eq!(got, [true, false, false, true, true]);
        let json = serde_json::to_value(&rows[0]).unwrap();
        assert_eq!(json["gather_upload"], "upload=params");
        assert!(serde_json::to_value(&rows[1])
            .unwrap()
            .get("gather_upload")
            .is_none());
    }

    #[test]
    fn only_fail_closed_transport_refusals_skip_a_nixl_row() {
        let refused = TransferError::PartFailed {
            rank: 0,
            source: Box::new(TransferError::TransportUnverified {
                rank: 0,
                transport: "unknown".into(),
                reason: "UCX did not report the transport".into(),
            }),
        };
        assert!(super::refused_unverified(&refused));
        assert!(super::refused_unverified(&TransferError::HostStaged {
            rank: 0,
            bytes: 1
        }));
        assert!(!super::refused_unverified(&TransferError::Cancelled));
        assert!(!super::refused_unverified(&TransferError::PartFailed {
            rank: 0,
            source: Box::new(TransferError::Cancelled),
        }));
    }
    use super::*;

    #[test]
    fn quick_cpu_bench_rows_are_consistent() {
        let rows = run(&BenchOpts {
            profile: Profile::Cpu,
            repeats: 2,
            quick: true,
            nixl: false,
            sweep: false,
        })
        .unwrap();
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "cpu/host_memcpy/contiguous/64x64KiB",
                "cpu/host_memcpy/scattered/64x64KiB",
                "cpu/host_memcpy/contiguous/64x16KiB",
                "cpu/host_memcpy/scattered/64x16KiB",
                "cpu/host_memcpy/contiguous/64x2MiB",
                "cpu/host_memcpy/scattered/64x2MiB",
                "cpu/plan_build/runs/64x64KiB",
                "cpu/plan_build/runs_direct/64x64KiB",
                "cpu/plan_build/packed_rows/64x64KiB",
                "cpu/transfer_plan/scattered/64x64KiB",
                "cpu/deliver_host/scattered/64x64KiB",
                "cpu/destination_pool/reserve_complete/64x64KiB",
                "cpu/plan_build/runs/64x16KiB",
                "cpu/plan_build/runs_direct/64x16KiB",
                "cpu/plan_build/packed_rows/64x16KiB",
                "cpu/transfer_plan/scattered/64x16KiB",
                "cpu/deliver_host/scattered/64x16KiB",
                "cpu/destination_pool/reserve_complete/64x16KiB",
                "cpu/plan_build/runs/64x2MiB",
                "cpu/plan_build/runs_direct/64x2MiB",
                "cpu/plan_build/packed_rows/64x2MiB",
                "cpu/transfer_plan/scattered/64x2MiB",
                "cpu/deliver_host/scattered/64x2MiB",
                "cpu/destination_pool/reserve_complete/64x2MiB",
                "cpu/plan_build/8b_to_block_major/32x256KiB",
                "cpu/plan_build_cold/8b_to_block_major/32x256KiB",
                "cpu/plan_build/8b_to_vllm_kv_first/32x256KiB",
                "cpu/plan_build_cold/8b_to_vllm_kv_first/32x256KiB",
                "cpu/plan_build/8b_to_hf_tokens_at_48/32x256KiB",
                "cpu/plan_build_cold/8b_to_hf_tokens_at_48/32x256KiB",
            ]
        );
        for r in &rows {
            assert_eq!(
                r.bytes,
                r.blocks
                    * match &r.name[r.name.rfind('x').unwrap() + 1..] {
                        "64KiB" => 64 << 10,
                        "16KiB" => 16 << 10,
                        "256KiB" => 256 << 10,
                        _ => 2 << 20,
                    }
            );
            assert!(r.gbps > 0.0 && r.raw_gbps > 0.0);
            assert!((r.ratio - r.gbps / r.raw_gbps).abs() < 1e-9);
        }
        let json = serde_json::to_value(&rows[0]).unwrap();
        for k in ["name", "bytes", "blocks", "GBps", "raw_GBps", "ratio"] {
            assert!(json.get(k).is_some(), "missing JSON key {k}");
        }
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v = shuffled(1000, 7);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
    }
}
