//! The layout oracle: a real bank's blocks fetched into engine-chosen blocks
//! of every target layout, every byte checked against the donor.
//!
//! For each target layout ([`TargetKind`]: vLLM `[2, num_blocks, ...]`, vLLM
//! `[num_blocks, 2, ...]`, HF `[2, batch, heads, tokens, head_dim]` at a
//! token offset that is not a block boundary, block-major at a non-zero base
//! inside a larger engine region) and for two cases, as [`crate::oracle`]:
//! 1. **positive**: 7 keys retained by a decode bank, pinned, fetched into
//!    the block ids an engine's allocator chose (scattered, out of order,
//!    reserved with `reserve_exact`) inside poisoned target memory; every
//!    element of every rank must equal the donor's element of the same
//!    `(layer, kv, token, head, d)` and the delivery must be complete;
//! 2. **missing keys**: 2 of the 7 keys absent on the donor; present blocks
//!    correct, every other target byte still poison, no completion.
//!
//! The check ([`check_landing`]) addresses both sides element by element
//! with [`KvRegionLayout::run_offset`] and the strides, independently of the
//! pieces the plan derives ([`crate::convert::Conversion::pieces`]), and
//! requires every target byte outside the present blocks' elements to be
//! untouched. Afterwards every pin must be released and the bank must close.
//!
//! Profiles: [`Profile::Cpu`] (host shm bank, host memcpy backend, a
//! private host buffer as the engine's tensors) and [`Profile::Gpu`] (CUDA
//! bank, the CUDA backend, device memory targets; host payload must be 0). A
//! backend that does not convert ([`crate::CopyBackend::converts`]) refuses
//! before a byte moves; such a case is reported in [`LayoutCase::refused`]
//! and must then have left every target byte poisoned and completed nothing.

use std::sync::Arc;
use std::time::Duration;

use kv_bank::{BankMemory, DestinationPool};
use kv_descriptor::{KvLayout, KvRegionLayout};
use serde::{Deserialize, Serialize};

use crate::cuda::{CudaCopyBackend, CudaMode};
pub use crate::oracle::Profile;
use crate::oracle::{case_keys, pin_moves, OracleDonor, KEYS};
use crate::plan::{BlockMove, TransferPlan};
use crate::{
    deliver, CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, RankIo, SourceRegion,
    TransferError,
};

/// A target layout the oracle lands blocks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetKind {
    /// vLLM per layer `[2, num_blocks, block_size, heads, head_dim]`, layers
    /// one padded tensor apart.
    VllmKvFirst,
    /// vLLM per layer `[num_blocks, 2, block_size, heads, head_dim]`.
    VllmBlockFirst,
    /// HF `[2, batch, heads, max_tokens, head_dim]` per layer, sequence 1 of
    /// 2, blocks from a token offset that is not a multiple of the block size.
    HfTokens,
    /// Block-major rows at a non-zero byte offset of the engine's region.
    BlockMajorAtOffset,
}

/// Every kind, in report order.
pub const TARGET_KINDS: [TargetKind; 4] = [
    TargetKind::VllmKvFirst,
    TargetKind::VllmBlockFirst,
    TargetKind::HfTokens,
    TargetKind::BlockMajorAtOffset,
];

/// Token where the HF target's block 0 starts (not a block boundary).
pub const HF_TOKEN_OFFSET: u64 = 24;

/// Engine-chosen target blocks of the fetch: scattered, not ascending.
pub const ENGINE_BLOCKS: [u32; KEYS] = [13, 2, 7, 8, 9, 30, 21];

const POISON: u8 = 0xA5;
const ABSENT: [usize; 2] = [1, 4];
const TARGET_BLOCKS: u32 = 32;

/// Builds rank `rank`'s target layout of `kind` for `geometry` with
/// `num_blocks` blocks; returns it with the region size it needs.
///
/// # Errors
/// [`TransferError::RegionLayout`] (field `target`) when the description is
/// refused, e.g. a geometry too large for 64-bit offsets.
pub fn target_layout(
    kind: TargetKind,
    geometry: KvLayout,
    rank: u32,
    num_blocks: u32,
) -> Result<KvRegionLayout, TransferError> {
    let bb = geometry.rank_block_bytes() as u64;
    let layers = u64::from(geometry.num_layers());
    let blocks = u64::from(num_blocks);
    // One layer's share of `num_blocks` blocks, plus a gap: separate tensors.
    let layer = blocks * bb / layers;
    let gap = 4096;
    let elem = geometry.dtype().size_bytes() as u64;
    let r = match kind {
        TargetKind::VllmKvFirst => KvRegionLayout::vllm_kv_first(
            geometry,
            rank,
            0,
            layer + gap,
            num_blocks,
            layers * (layer + gap),
        ),
        TargetKind::VllmBlockFirst => KvRegionLayout::vllm_block_first(
            geometry,
            rank,
            gap,
            layer + gap,
            num_blocks,
            gap + layers * (layer + gap),
        ),
        TargetKind::HfTokens => {
            let max_tokens = HF_TOKEN_OFFSET + blocks * u64::from(geometry.tokens_per_block()) + 3;
            let seq = u64::from(geometry.heads_per_rank())
                * max_tokens
                * u64::from(geometry.head_dim())
                * elem;
            let layer_bytes = 2 * 2 * seq;
            KvRegionLayout::hf_tokens(
                geometry,
                rank,
                0,
                layer_bytes,
                2,
                1,
                max_tokens,
                HF_TOKEN_OFFSET,
                num_blocks,
                layers * layer_bytes,
            )
        }
        TargetKind::BlockMajorAtOffset => {
            KvRegionLayout::block_major(geometry, rank, gap, num_blocks, gap + blocks * bb + gap)
        }
    };
    r.map_err(|source| TransferError::RegionLayout {
        field: "target",
        rank,
        source,
    })
}

/// Result of comparing a target region with the donor's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LandingCheck {
    /// Every element of every present block equals the donor's.
    pub bytes_ok: bool,
    /// Every other target byte (absent keys, blocks outside the fetch,
    /// padding) still holds the poison.
    pub untouched_ok: bool,
    /// Elements compared.
    pub elements: u64,
}

/// Compares `target` (the bytes of a region laid out as `tl`) with `donor`
/// (bytes of a region laid out as `dl`) for `moves`, element by element:
/// `(src_slot, dst_block)` present pairs must match at every
/// `(layer, kv, token, head, d)`; every target byte not written by a present
/// pair must equal `poison`.
///
/// # Panics
/// When a slice is shorter than its layout's `region_bytes` or a block id is
/// out of range (oracle input, not data).
pub fn check_landing(
    dl: &KvRegionLayout,
    donor: &[u8],
    tl: &KvRegionLayout,
    target: &[u8],
    moves: &[BlockMove],
    poison: u8,
) -> LandingCheck {
    let g = dl.geometry();
    let elem = g.dtype().size_bytes();
    let (ds, ts) = (dl.strides().dim, tl.strides().dim);
    let mut written = vec![false; target.len()];
    let (mut bytes_ok, mut elements) = (true, 0u64);
    for m in moves {
        let Some(slot) = m.src_slot else { continue };
        for layer in 0..g.num_layers() {
            for kv in 0..2 {
                for token in 0..g.tokens_per_block() {
                    for head in 0..g.heads_per_rank() {
                        let so = dl
                            .run_offset(layer, slot, kv, token, head)
                            .expect("donor index");
                        let to = tl
                            .run_offset(layer, m.dst_block, kv, token, head)
                            .expect("target index");
                        for d in 0..u64::from(g.head_dim()) {
                            let s = (so + d * ds * elem as u64) as usize;
                            let t = (to + d * ts * elem as u64) as usize;
                            bytes_ok &= donor[s..s + elem] == target[t..t + elem];
                            written[t..t + elem].iter_mut().for_each(|w| *w = true);
                            elements += 1;
                        }
                    }
                }
            }
        }
    }
    let untouched_ok = target.iter().zip(&written).all(|(&b, &w)| w || b == poison);
    LandingCheck {
        bytes_ok,
        untouched_ok,
        elements,
    }
}

/// One target layout's two cases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutCase {
    /// Target layout.
    pub kind: TargetKind,
    /// Positive case: every byte right, nothing else touched, complete.
    pub positive_ok: bool,
    /// Missing-key case: present bytes right, absent and other bytes poison.
    pub missing_ok: bool,
    /// The missing-key case reported completion (must be false).
    pub false_completion: bool,
    /// Payload bytes of the positive case, all ranks.
    pub bytes: u64,
    /// Copy operations of the positive case (memcpy calls, launches).
    pub copies: u64,
    /// Host payload bytes over both cases (must be 0 on GPU).
    pub host_payload_bytes: u64,
    /// The backend refused the conversion before a byte moved
    /// ([`TransferError::UnsupportedLayout`]); then both cases must have left
    /// the target poisoned and completed nothing.
    pub refused: Option<String>,
}

impl LayoutCase {
    /// Verdict of this layout.
    pub fn passed(&self, profile: Profile) -> bool {
        let gpu_ok = profile == Profile::Cpu || self.host_payload_bytes == 0;
        self.missing_ok
            && !self.false_completion
            && gpu_ok
            && (self.positive_ok || self.refused.is_some())
    }
}

/// Outcome of the layout oracle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutOracleReport {
    /// Profile run.
    pub profile: Profile,
    /// TP size of the bank.
    pub tp_size: u32,
    /// Backend name.
    pub backend: String,
    /// One entry per [`TARGET_KINDS`] kind.
    pub cases: Vec<LayoutCase>,
    /// No pin outstanding afterwards.
    pub pins_released: bool,
    /// The donor bank closed.
    pub banks_closed: bool,
}

impl LayoutOracleReport {
    /// Verdict: every layout passed, pins released, bank closed.
    pub fn passed(&self) -> bool {
        self.pins_released
            && self.banks_closed
            && self.cases.len() == TARGET_KINDS.len()
            && self.cases.iter().all(|c| c.passed(self.profile))
    }
}

/// Runs the layout oracle on `profile` with its native backend.
///
/// # Errors
/// Setup failures (no GPU on [`Profile::Gpu`], bank or memory errors) and
/// delivery errors other than a backend's [`TransferError::UnsupportedLayout`].
/// Check failures are `false` fields and `passed() == false`.
pub fn run(profile: Profile) -> Result<LayoutOracleReport, TransferError> {
    let OracleDonor {
        tp,
        layout,
        block_bytes: bb,
        slots,
        bank: donor,
        wanted,
        absent,
    } = OracleDonor::new(profile, "layout-oracle-host", &[(1_000, 3)])?;
    let engine: Box<dyn CopyBackend> = match profile {
        Profile::Cpu => Box::new(HostCopyBackend),
        Profile::Gpu => Box::new(CudaCopyBackend::new(CudaMode::Auto)?),
    };
    let donor_layouts: Vec<KvRegionLayout> = (0..tp)
        .map(|r| {
            KvRegionLayout::block_major(layout, r, 0, slots, u64::from(slots) * bb as u64).map_err(
                |source| TransferError::RegionLayout {
                    field: "donor",
                    rank: r,
                    source,
                },
            )
        })
        .collect::<Result<_, _>>()?;
    let mut donor_bytes = Vec::new();
    for r in 0..tp {
        let m = donor.rank(r)?.memory().clone();
        donor_bytes.push(m.read_vec(0, m.len())?);
    }

    let mut cases = Vec::new();
    for kind in TARGET_KINDS {
        let tls: Vec<KvRegionLayout> = (0..tp)
            .map(|r| target_layout(kind, layout, r, TARGET_BLOCKS))
            .collect::<Result<_, _>>()?;
        let targets: Vec<Arc<dyn BankMemory>> = tls
            .iter()
            .enumerate()
            .map(|(r, l)| -> Result<Arc<dyn BankMemory>, TransferError> {
                let len = l.region_bytes() as usize;
                Ok(match profile {
                    Profile::Cpu => Arc::new(HostBuffer::zeroed(len)?),
                    Profile::Gpu => Arc::new(kv_bank::CudaDeviceMemory::new(r as u32, len)?),
                })
            })
            .collect::<Result<_, _>>()?;
        let pool = DestinationPool::new(TARGET_BLOCKS);
        let mut case = LayoutCase {
            kind,
            positive_ok: false,
            missing_ok: false,
            false_completion: false,
            bytes: 0,
            copies: 0,
            host_payload_bytes: 0,
            refused: None,
        };
        for missing in [false, true] {
            let keys = case_keys(&wanted, &absent, &ABSENT, missing);
            for t in &targets {
                t.write_bytes(0, &vec![POISON; t.len()])?;
            }
            let reservation = pool.reserve_exact(&ENGINE_BLOCKS)?;
            let (pin, moves) = pin_moves(&donor, &keys, reservation.blocks())?;
            let plan = TransferPlan::converting(&donor_layouts, &tls, &moves)?;
            let mut mems = Vec::new();
            for r in 0..tp {
                mems.push(pin.rank(r)?.memory().clone());
            }
            let io: Vec<RankIo> = (0..tp as usize)
                .map(|r| RankIo {
                    src: SourceRegion::Mapped(mems[r].as_ref()),
                    dst: targets[r].as_ref(),
                })
                .collect();
            let result = deliver(
                &plan,
                engine.as_ref(),
                &io,
                &DeliveryControl::with_timeout(Duration::from_secs(30)),
            );
            drop(io);
            drop(pin);
            let report = match result {
                Ok(r) => {
                    reservation.complete();
                    Some(r)
                }
                Err(e @ TransferError::UnsupportedLayout { .. }) => {
                    reservation.cancel().quiesced();
                    case.refused = Some(e.to_string());
                    None
                }
                Err(e) => {
                    reservation.cancel().quiesced();
                    return Err(e);
                }
            };
            let mut ok = true;
            for r in 0..tp as usize {
                let got = targets[r].read_vec(0, targets[r].len())?;
                // A refused delivery must not have written anything.
                let check_moves: &[BlockMove] = if report.is_some() { &moves } else { &[] };
                let c = check_landing(
                    &donor_layouts[r],
                    &donor_bytes[r],
                    &tls[r],
                    &got,
                    check_moves,
                    POISON,
                );
                ok &= c.bytes_ok && c.untouched_ok;
            }
            if let Some(rep) = &report {
                case.host_payload_bytes += rep.counters.host_payload_bytes;
            }
            if missing {
                case.missing_ok = ok;
                case.false_completion = report.as_ref().is_some_and(|r| r.is_complete());
            } else {
                let complete = report.as_ref().is_some_and(|r| {
                    r.is_complete() && r.counters.bytes == (KEYS * bb) as u64 * u64::from(tp)
                });
                case.positive_ok = ok && complete;
                if let Some(rep) = &report {
                    case.bytes = rep.counters.bytes;
                    case.copies = rep.counters.copies;
                }
            }
        }
        cases.push(case);
    }
    let pins_released = donor.pins_outstanding() == 0;
    let backend = engine.name().to_string();
    drop(engine);
    let banks_closed = donor.close(Duration::from_secs(5)).is_ok() && donor.is_closed();
    Ok(LayoutOracleReport {
        profile,
        tp_size: tp,
        backend,
        cases,
        pins_released,
        banks_closed,
    })
}

#[cfg(test)]
#[path = "layout_oracle_tests.rs"]
mod tests;
