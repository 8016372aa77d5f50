//! Converting-gather rows of the GPU benchmark (`bench::run`, GPU profile).
//!
//! The 8B-model shape (32 layers, 8 KV heads, head_dim 128, bf16, 16-token
//! blocks: 2 MiB a block on one rank), 512 blocks from scattered, shuffled
//! slots of a block-major donor of 1024 slots, landed through
//! [`CudaCopyBackend::convert_blocks`] in three target layouts: block-major,
//! vLLM per-layer `[2, num_blocks, block_size, heads, head_dim]` and HF
//! per-layer `[2, batch, heads, tokens, head_dim]` at a token offset of 48
//! (not a block boundary). Each is timed (median of `repeats` after one
//! warm-up, launch to synchronize) against a raw `cuMemcpyDtoDAsync` of the
//! same bytes measured in the same run; the first and last moved blocks are
//! checked element by element against the donor afterwards.

use std::time::{Duration, Instant};

use kv_bank::BankMemory;
use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};

use crate::bench::{gbps, median, BenchRow};
use crate::bench_sweep::{phases, Built};
use crate::cuda::CudaCopyBackend;
use crate::cuda_gather::{ConvertShape, GatherTuning};
use crate::{DeliveryControl, TransferError};

/// Token offset of the HF target: block `b` lands at tokens `48 + 16 b`.
const HF_TOKEN_OFFSET: u64 = 48;

pub(crate) fn bad(e: impl std::fmt::Display) -> TransferError {
    TransferError::input("bench.convert", e.to_string())
}

/// The target region layouts of the rows, by row label.
pub(crate) fn targets(
    g: &KvLayout,
    blocks: u32,
) -> Result<Vec<(&'static str, KvRegionLayout)>, TransferError> {
    let e = g.dtype().size_bytes() as u64;
    let (t, h, d) = (
        u64::from(g.tokens_per_block()),
        u64::from(g.heads_per_rank()),
        u64::from(g.head_dim()),
    );
    let layers = u64::from(g.num_layers());
    let nb = u64::from(blocks);
    let bm_bytes = nb * g.rank_block_bytes() as u64;
    let vllm_stride = 2 * nb * t * h * d * e;
    let max_tokens = HF_TOKEN_OFFSET + nb * t;
    let hf_stride = 2 * h * max_tokens * d * e;
    Ok(vec![
        (
            "block_major",
            KvRegionLayout::block_major(*g, 0, 0, blocks, bm_bytes).map_err(bad)?,
        ),
        (
            "vllm_kv_first",
            KvRegionLayout::vllm_kv_first(*g, 0, 0, vllm_stride, blocks, layers * vllm_stride)
                .map_err(bad)?,
        ),
        (
            "hf_tokens_at_48",
            KvRegionLayout::hf_tokens(
                *g,
                0,
                0,
                hf_stride,
                1,
                0,
                max_tokens,
                HF_TOKEN_OFFSET,
                blocks,
                layers * hf_stride,
            )
            .map_err(bad)?,
        ),
    ])
}

/// Checks moved blocks `which` of `moves` element by element (one device read
/// per `head_dim` row on each side).
fn verify(
    donor: &KvRegionLayout,
    target: &KvRegionLayout,
    moves: &[(u32, u32)],
    which: [usize; 2],
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
    name: &str,
) -> Result<(), TransferError> {
    let g = donor.geometry();
    let row = g.head_dim() as usize * g.dtype().size_bytes();
    let (mut a, mut b) = (vec![0u8; row], vec![0u8; row]);
    for &(sb, db) in which.iter().map(|&i| &moves[i]) {
        for l in 0..g.num_layers() {
            for kv in 0..2 {
                for t in 0..g.tokens_per_block() {
                    for h in 0..g.heads_per_rank() {
                        let so = donor.run_offset(l, sb, kv, t, h).expect("in range");
                        let to = target.run_offset(l, db, kv, t, h).expect("in range");
                        src.read_bytes(so as usize, &mut a)?;
                        dst.read_bytes(to as usize, &mut b)?;
                        if a != b {
                            return Err(TransferError::input(
                                "bench",
                                format!("{name}: layer {l} kv {kv} token {t} head {h} of block {db} differs from the donor"),
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The 8B-shape case of the converting rows (and of the CPU plan rows).
pub(crate) struct Case {
    /// Blocks moved.
    pub(crate) blocks: u32,
    /// Rank block bytes.
    pub(crate) block_bytes: u64,
    /// Block-major donor of `2 x blocks` slots.
    pub(crate) donor: KvRegionLayout,
    /// Target layouts by row label.
    pub(crate) targets: Vec<(&'static str, KvRegionLayout)>,
    /// `(donor slot, target block)`: every other slot, shuffled.
    pub(crate) moves: Vec<(u32, u32)>,
    /// Block size label (`2MiB`; `256KiB` for the quick 4-layer shape).
    pub(crate) size: String,
}

/// The 8B shape (4 layers and 32 blocks when `quick`).
///
/// # Errors
/// [`TransferError::InvalidInput`] naming `bench.convert` (a layout refused).
pub(crate) fn case(quick: bool) -> Result<Case, TransferError> {
    let layers = if quick { 4 } else { 32 };
    let blocks: u32 = if quick { 32 } else { 512 };
    let g =
        KvLayout::new(layers, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).map_err(bad)?;
    let bb = g.rank_block_bytes() as u64;
    let slots = 2 * blocks;
    let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).map_err(bad)?;
    // Donor slots: every other slot, shuffled, as the scattered rows.
    let moves: Vec<(u32, u32)> = crate::bench::shuffled(blocks, 11)
        .into_iter()
        .enumerate()
        .map(|(i, s)| (2 * s + 1, i as u32))
        .collect();
    let size = if bb % (1 << 20) == 0 {
        format!("{}MiB", bb >> 20)
    } else {
        format!("{}KiB", bb >> 10)
    };
    Ok(Case {
        blocks,
        block_bytes: bb,
        targets: targets(&g, blocks)?,
        donor,
        moves,
        size,
    })
}

/// The converting rows; see the module docs. `quick` keeps 4 layers and 32
/// blocks; plans are split with `tuning`; `only` keeps one target label.
/// Every row carries its phases (host plan = `ConvertShape::plan` of a shape
/// built once per target, as `CudaCopyBackend` caches it).
pub(crate) fn rows(
    backend: &CudaCopyBackend,
    quick: bool,
    repeats: usize,
    tuning: &GatherTuning,
    only: Option<&str>,
) -> Result<Vec<BenchRow>, TransferError> {
    let Case {
        blocks,
        block_bytes: bb,
        donor,
        mut targets,
        moves,
        size,
    } = case(quick)?;
    targets.retain(|(l, _)| only.is_none_or(|o| o == *l));
    let dst_bytes = targets
        .iter()
        .map(|(_, t)| t.region_bytes())
        .max()
        .unwrap_or(0);
    let src = kv_bank::CudaDeviceMemory::new(0, donor.region_bytes() as usize)?;
    let dst = kv_bank::CudaDeviceMemory::new(0, dst_bytes as usize)?;
    crate::bench::fill(&src, 9)?;
    let bytes = u64::from(blocks) * bb;
    let control = DeliveryControl::new();
    let mut out = Vec::new();
    let mut timed = Vec::new();
    for (label, target) in &targets {
        let plan = ConvertShape::new(&donor, target, tuning)
            .and_then(|s| s.plan(&moves))
            .map_err(bad)?;
        let mut times = Vec::with_capacity(repeats);
        for i in 0..=repeats {
            let t0 = Instant::now();
            let o = backend.convert_blocks(&plan, &src, &dst, &control)?;
            let t = t0.elapsed();
            if o.bytes != bytes || o.host_payload_bytes != 0 {
                return Err(TransferError::input(
                    "bench",
                    format!(
                        "{label}: moved {} bytes ({} through the host), expected {bytes}",
                        o.bytes, o.host_payload_bytes
                    ),
                ));
            }
            if i > 0 {
                times.push(t);
            }
        }
        let name = format!("gpu/cuda_convert/8b_scattered_to_{label}/{blocks}x{size}");
        verify(
            &donor,
            target,
            &moves,
            [0, moves.len() - 1],
            &src,
            &dst,
            &name,
        )?;
        timed.push((name, median(times), target));
    }
    // Raw copy of the same bytes, after the cases, so a cold first
    // measurement cannot flatter the ratio.
    let raw = median(crate::cuda::time_raw_device_copy(
        0,
        0,
        dst.base_addr(),
        src.base_addr(),
        bytes as usize,
        repeats,
    )?);
    for (name, t, target) in timed {
        // The shape is built once per target (as the backend caches it):
        // the host plan phase is what each fetch pays.
        let shape = ConvertShape::new(&donor, target, tuning).map_err(bad)?;
        let build = |_| shape.plan(&moves).map(Built::Plan).map_err(bad);
        let mut r = row_of(name, bytes, blocks, t, raw);
        r.phases = Some(phases(backend, &build, &src, &dst, repeats, raw)?);
        out.push(r);
    }
    Ok(out)
}

fn row_of(name: String, bytes: u64, blocks: u32, t: Duration, raw: Duration) -> BenchRow {
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
