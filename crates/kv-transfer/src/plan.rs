//! Copy plans: from donor slots per rank to target blocks per rank.
//!
//! A plan is pure arithmetic over region geometry; it touches no memory.
//! Donor and target must have the same layout (equal [`KvLayout::fingerprint`],
//! which covers TP size): TP-N to TP-N only, no resharding. Logical slot ids
//! and target block ids are shared by every rank (one id names the same block
//! on every rank), so one list of moves serves all ranks; only the region
//! geometry (stride, count) may differ per rank.

use std::sync::Arc;

use kv_descriptor::{KvLayout, KvRegionLayout, SequenceHash, TensorOrder};

use crate::convert::{BlockPair, Conversion};
use crate::cuda_gather::{PackedRows, INLINE_SMALL_BLOCKS, PACKED_MAX_BLOCK_ID};
use crate::TransferError;

mod check;

use check::{check_moves, Sets};

/// Geometry of one rank's region: `blocks` rows of `stride_bytes` each,
/// starting at offset 0 of the region. A block's payload is the first
/// `rank_block_bytes` of its row; `stride_bytes >= rank_block_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionGeometry {
    /// Distance between the first bytes of consecutive rows, in bytes.
    pub stride_bytes: u64,
    /// Number of rows (slots on a donor, blocks on a target).
    pub blocks: u32,
}

impl RegionGeometry {
    /// Dense rows of exactly one rank block each (`stride = rank_block_bytes`).
    pub fn dense(layout: &KvLayout, blocks: u32) -> Self {
        Self {
            stride_bytes: layout.rank_block_bytes() as u64,
            blocks,
        }
    }

    /// Bytes spanned by the region: `stride_bytes x blocks`.
    pub fn region_bytes(&self) -> u64 {
        self.stride_bytes * u64::from(self.blocks)
    }
}

/// One block to move: `key` lives in donor slot `src_slot` (or is absent
/// there) and goes to target block `dst_block`. The same ids hold on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMove {
    /// Sequence hash of the block (for reporting).
    pub key: SequenceHash,
    /// Donor logical slot, `None` when the donor no longer holds the key.
    pub src_slot: Option<u32>,
    /// Target block id (row) that receives it.
    pub dst_block: u32,
}

/// A key the donor does not hold: its destination row is left untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MissingKey {
    /// Position of the move in the input list.
    pub index: usize,
    /// The missing sequence hash.
    pub key: SequenceHash,
    /// Target block that was not written.
    pub dst_block: u32,
}

/// A run of `blocks` consecutive rows copied as one region: donor rows
/// `src_block..src_block+blocks` to target rows `dst_block..dst_block+blocks`.
/// Byte offsets are relative to the regions' first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    /// First donor row.
    pub src_block: u32,
    /// First target row.
    pub dst_block: u32,
    /// Rows in the run (at least 1).
    pub blocks: u32,
    /// Byte offset of the first source byte in the donor region.
    pub src_offset: u64,
    /// Byte offset of the first destination byte in the target region.
    pub dst_offset: u64,
    /// Bytes in the run.
    pub len: u64,
}

/// One rank's share of a plan.
///
/// Built only by [`TransferPlan::new`] and [`TransferPlan::converting`] and
/// read through its accessors: a part also carries data derived from its
/// runs when the plan was built ([`PartPlan::region_ends`],
/// [`PartPlan::packed_rows`]), which backends launch from, so its runs are
/// not editable (an edited copy would launch the rows it was built with).
///
/// ```
/// use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
/// use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
/// let l = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// let bb = l.rank_block_bytes() as u64;
/// let m = BlockMove { key: SequenceHash(1), src_slot: Some(3), dst_block: 0 };
/// let g = [RegionGeometry::dense(&l, 16)];
/// let p = TransferPlan::new(&l, &l, &[m], &g, &g).unwrap();
/// let part = &p.parts()[0];
/// assert_eq!((part.tp_rank(), part.runs().len(), part.expected_bytes()), (0, 1, bb));
/// assert_eq!(part.region_ends(), (4 * bb, bb));
/// ```
///
/// A copy's runs cannot be edited:
///
/// ```compile_fail,E0616
/// use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
/// use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
/// let l = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// let m = BlockMove { key: SequenceHash(1), src_slot: Some(3), dst_block: 0 };
/// let g = [RegionGeometry::dense(&l, 16)];
/// let p = TransferPlan::new(&l, &l, &[m], &g, &g).unwrap();
/// let mut edited = p.parts()[0].clone();
/// edited.runs.clear();
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartPlan {
    /// TP rank (index in [`TransferPlan::parts`]).
    tp_rank: u32,
    /// Coalesced runs, sorted by source offset.
    runs: Vec<CopyRun>,
    /// Bytes this part must deliver: present blocks x `rank_block_bytes`.
    expected_bytes: u64,
    /// Donor region geometry of this rank.
    src: RegionGeometry,
    /// Target region geometry of this rank.
    dst: RegionGeometry,
    /// `Some` for a converting part (see [`PartPlan::conversion`]).
    conversion: Option<Conversion>,
    /// Bytes the donor / target region must have: the furthest run end
    /// (a conversion: its layouts' region bytes), found when the plan was
    /// built, so `deliver` checks the regions without a pass over the runs.
    ends: (u64, u64),
    /// The rows as packed ids (parts of more than 128 blocks whose ids fit
    /// 16 bits), so the gather launches without a pass over the runs.
    packed: Option<PackedRows>,
}

impl PartPlan {
    /// TP rank of this part: its index in [`TransferPlan::parts`].
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }

    /// The coalesced runs, sorted by source offset (byte offsets and
    /// lengths in bytes, relative to each region's first byte). Empty for a
    /// converting part ([`PartPlan::conversion`]).
    pub fn runs(&self) -> &[CopyRun] {
        &self.runs
    }

    /// Bytes this part must deliver: present blocks x `rank_block_bytes`
    /// (a converting part too).
    pub fn expected_bytes(&self) -> u64 {
        self.expected_bytes
    }

    /// Donor region geometry of this rank (stride in bytes, rows); zero
    /// rows for a converting part, which does not use it.
    pub fn src(&self) -> RegionGeometry {
        self.src
    }

    /// Target region geometry of this rank (stride in bytes, rows); zero
    /// rows for a converting part, which does not use it.
    pub fn dst(&self) -> RegionGeometry {
        self.dst
    }

    /// `Some` for a converting part ([`TransferPlan::converting`] between
    /// two memory orders): then [`PartPlan::runs`] is empty,
    /// [`PartPlan::src`] / [`PartPlan::dst`] are unused (zero rows), and
    /// the bytes to move are [`Conversion::pieces`]. Only a backend whose
    /// [`crate::CopyBackend::converts`] is true executes it;
    /// [`crate::deliver`] refuses it for any other before a byte moves.
    pub fn conversion(&self) -> Option<&Conversion> {
        self.conversion.as_ref()
    }

    /// `(donor, target)` bytes the regions must have: the end of the
    /// furthest run on each side, or for a converting part its layouts'
    /// region bytes. O(1): found when the plan was built.
    pub fn region_ends(&self) -> (u64, u64) {
        self.ends
    }

    /// The rows of a block-major part as packed 16-bit ids (block `i` of the
    /// runs, in order, is `words()[i]`), present when the part has more than
    /// [`INLINE_SMALL_BLOCKS`] blocks and every id is at most
    /// [`PACKED_MAX_BLOCK_ID`]; the CUDA backend launches from them.
    pub fn packed_rows(&self) -> Option<&PackedRows> {
        self.packed.as_ref()
    }
}

/// A validated copy plan over a TP group. Only [`TransferPlan::new`] and
/// [`TransferPlan::converting`] build one.
///
/// ```
/// use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
/// use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
/// let l = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
/// let m = |k, s, d| BlockMove { key: SequenceHash(k), src_slot: s, dst_block: d };
/// // slots 3,4 go to blocks 0,1 (one run), slot 9 to block 5, key 7 is gone.
/// let moves = [m(1, Some(3), 0), m(2, Some(4), 1), m(3, Some(9), 5), m(7, None, 6)];
/// let g = [RegionGeometry::dense(&l, 16); 2];
/// let p = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
/// assert_eq!(p.parts().len(), 2);
/// assert_eq!(p.parts()[1].runs().len(), 2);
/// assert_eq!(p.parts()[1].expected_bytes(), 3 * l.rank_block_bytes() as u64);
/// assert_eq!(p.missing()[0].dst_block, 6);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    parts: Vec<PartPlan>,
    missing: Vec<MissingKey>,
    rank_block_bytes: u64,
    present_blocks: usize,
}

impl TransferPlan {
    /// Plans `moves` for every rank of the group.
    ///
    /// `donor[r]` / `target[r]` describe rank `r`'s donor and target regions.
    /// Adjacent moves (consecutive donor slots to consecutive target blocks,
    /// both regions dense) coalesce into one run.
    ///
    /// # Errors
    /// Nothing is planned (and so nothing can move) when:
    /// - [`TransferError::LayoutMismatch`]: donor and target fingerprints differ;
    /// - `layout.tensor_order`: not block-major (a per-layer block is not one row);
    /// - `donor` / `target`: not exactly `tp_size` entries, or a stride smaller
    ///   than `rank_block_bytes`;
    /// - `moves`: empty, a slot or block out of range, a key or target block
    ///   listed twice, or a donor slot listed twice. The first refused move
    ///   decides, its checks in the order key, `moves.dst_block` (range,
    ///   then twice), `moves.src_slot` (range, then twice).
    ///
    /// # Cost
    /// Linear in `moves` (no sort, no SipHash): 13-20 / 54-89 us for 1,024
    /// / 4,096 scattered moves on one rank of the shared 2-core CPU build
    /// machine (`cpu/transfer_plan/scattered/*`,
    /// `crates/kv-transfer/MEASURED.md`; 150-240 / 620-1,050 us before).
    /// Scratch memory: a bit per donor slot and per target block of the
    /// smallest regions where those are at most ~256 rows per move (plus
    /// 65,536), 4 bytes per donor slot where at most 16 per move (plus
    /// 4,096), and up to 32 bytes per move for the keys; past those
    /// bounds the ids are hashed like the keys and the rows sorted.
    pub fn new(
        donor_layout: &KvLayout,
        target_layout: &KvLayout,
        moves: &[BlockMove],
        donor: &[RegionGeometry],
        target: &[RegionGeometry],
    ) -> Result<Self, TransferError> {
        if donor_layout.fingerprint() != target_layout.fingerprint() {
            return Err(TransferError::LayoutMismatch {
                donor: donor_layout.fingerprint(),
                target: target_layout.fingerprint(),
            });
        }
        if donor_layout.tensor_order() != TensorOrder::BlockMajor {
            return Err(TransferError::input(
                "layout.tensor_order",
                "only block-major banks are planned (one block = one contiguous row per rank)",
            ));
        }
        let tp = donor_layout.tp_size() as usize;
        for (field, g) in [("donor", donor), ("target", target)] {
            if g.len() != tp {
                return Err(TransferError::input(
                    field,
                    format!("tp_size is {tp} but {} rank regions were given", g.len()),
                ));
            }
        }
        let bb = donor_layout.rank_block_bytes() as u64;
        for (field, g) in [
            ("donor.stride_bytes", donor),
            ("target.stride_bytes", target),
        ] {
            if let Some((r, bad)) = g.iter().enumerate().find(|(_, g)| g.stride_bytes < bb) {
                return Err(TransferError::input(
                    field,
                    format!(
                        "rank {r} stride {} is below rank_block_bytes {bb}",
                        bad.stride_bytes
                    ),
                ));
            }
        }
        let src_limit = donor.iter().map(|g| g.blocks).min().unwrap_or(0);
        let dst_limit = target.iter().map(|g| g.blocks).min().unwrap_or(0);
        // Sorted by donor slot, so consecutive slots meet; the target side
        // must also be consecutive for the pair to merge.
        let (present, missing) = check_moves(moves, src_limit, dst_limit, Sets::AUTO)?;
        let words = packed_words(&present, src_limit, dst_limit);
        let parts = (0..tp)
            .map(|r| row_part(r as u32, &present, bb, donor[r], target[r], words.as_ref()))
            .collect();
        Ok(Self {
            parts,
            missing,
            rank_block_bytes: bb,
            present_blocks: present.len(),
        })
    }

    /// Plans `moves` from donor regions to target regions described by
    /// [`KvRegionLayout`]s (one per TP rank, rank `r` at index `r`): the
    /// target blocks are engine-chosen ids inside the engine's own tensors,
    /// in any memory order of the same geometry.
    ///
    /// A rank whose donor and target are both block-major from byte 0 of
    /// their regions gets block runs (as [`TransferPlan::new`], every
    /// backend); any other rank gets a [`Conversion`] (empty `runs`), whose
    /// pieces a converting backend copies in one pass, each element from its
    /// donor address to its target address.
    ///
    /// ```
    /// use kv_descriptor::{DType, KvLayout, KvRegionLayout, SequenceHash, TensorOrder};
    /// use kv_transfer::plan::{BlockMove, TransferPlan};
    /// let g = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
    /// let bb = g.rank_block_bytes() as u64;
    /// let donor: Vec<_> = (0..2)
    ///     .map(|r| KvRegionLayout::block_major(g, r, 0, 16, 16 * bb).unwrap())
    ///     .collect();
    /// // vLLM `[num_blocks, 2, block_size, heads, head_dim]`, 32 blocks, one tensor a layer.
    /// let layer = 32 * bb / 2;
    /// let target: Vec<_> = (0..2)
    ///     .map(|r| KvRegionLayout::vllm_block_first(g, r, 0, layer, 32, 2 * layer).unwrap())
    ///     .collect();
    /// let m = |k, s, d| BlockMove { key: SequenceHash(k), src_slot: s, dst_block: d };
    /// // The engine's allocator chose blocks 17 and 4; key 3 is gone on the donor.
    /// let p = TransferPlan::converting(&donor, &target, &[m(1, Some(2), 17), m(2, Some(3), 4), m(3, None, 9)])
    ///     .unwrap();
    /// let conv = p.parts()[1].conversion().unwrap();
    /// assert_eq!(conv.pairs().len(), 2);
    /// assert_eq!(p.parts()[1].expected_bytes(), 2 * bb);
    /// assert_eq!(p.missing()[0].dst_block, 9);
    /// // A TP-rank mix-up is refused before a byte moves, naming the field.
    /// let e = TransferPlan::converting(&donor, &[target[1].clone(), target[0].clone()], &[m(1, Some(2), 17)])
    ///     .unwrap_err();
    /// assert!(e.to_string().contains("target.tp_rank"), "{e}");
    /// ```
    ///
    /// # Errors
    /// Nothing is planned (and so nothing can move) when:
    /// - `donor` / `target` ([`TransferError::InvalidInput`]): not exactly
    ///   `tp_size` entries (of the donor's geometry);
    /// - [`TransferError::RegionLayout`]: `donor.tp_rank` / `target.tp_rank`
    ///   (entry `r` is not rank `r`'s region), or
    ///   [`KvRegionLayout::check_compatible`] refused the pair (the
    ///   [`kv_descriptor::RegionLayoutError::Incompatible`] names the field:
    ///   layers, heads, head_dim, dtype, tokens per block, TP size, TP rank);
    /// - `moves` as for [`TransferPlan::new`], against the smallest
    ///   `num_blocks` of the donor and of the target layouts.
    pub fn converting(
        donor: &[KvRegionLayout],
        target: &[KvRegionLayout],
        moves: &[BlockMove],
    ) -> Result<Self, TransferError> {
        let first = donor.first().ok_or_else(|| {
            TransferError::input(
                "donor",
                "no rank regions were given (tp_size is at least 1)",
            )
        })?;
        let tp = first.geometry().tp_size() as usize;
        for (field, l) in [("donor", donor), ("target", target)] {
            if l.len() != tp {
                return Err(TransferError::input(
                    field,
                    format!("tp_size is {tp} but {} rank regions were given", l.len()),
                ));
            }
        }
        for (r, (d, t)) in donor.iter().zip(target).enumerate() {
            let r = r as u32;
            for (field, l) in [("donor.tp_rank", d), ("target.tp_rank", t)] {
                if l.tp_rank() != r {
                    return Err(TransferError::RegionLayout {
                        field,
                        rank: r,
                        source: kv_descriptor::RegionLayoutError::Incompatible {
                            field: "region.tp_rank",
                            donor: r.to_string(),
                            target: l.tp_rank().to_string(),
                        },
                    });
                }
            }
            // One geometry per group; each target is then checked against
            // its own rank's donor.
            if d.geometry() != first.geometry() {
                return Err(TransferError::input(
                    "donor.geometry",
                    format!(
                        "rank {r} region is {:?}, rank 0's is {:?}",
                        d.geometry(),
                        first.geometry()
                    ),
                ));
            }
            d.check_compatible(t)
                .map_err(|source| TransferError::RegionLayout {
                    field: "target",
                    rank: r,
                    source,
                })?;
        }
        let src_limit = donor.iter().map(|l| l.num_blocks()).min().unwrap_or(0);
        let dst_limit = target.iter().map(|l| l.num_blocks()).min().unwrap_or(0);
        let (present, missing) = check_moves(moves, src_limit, dst_limit, Sets::AUTO)?;
        let bb = first.geometry().rank_block_bytes() as u64;
        let words = packed_words(&present, src_limit, dst_limit);
        let parts = donor
            .iter()
            .zip(target)
            .enumerate()
            .map(|(r, (d, t))| match (block_rows(d), block_rows(t)) {
                (Some(src), Some(dst)) => {
                    row_part(r as u32, &present, bb, src, dst, words.as_ref())
                }
                _ => {
                    let pairs = present
                        .iter()
                        .map(|&(src_block, dst_block)| BlockPair {
                            src_block,
                            dst_block,
                        })
                        .collect();
                    let none = RegionGeometry {
                        stride_bytes: bb,
                        blocks: 0,
                    };
                    PartPlan {
                        tp_rank: r as u32,
                        runs: Vec::new(),
                        expected_bytes: bb * present.len() as u64,
                        src: none,
                        dst: none,
                        ends: (d.region_bytes(), t.region_bytes()),
                        conversion: Some(Conversion::new(d.clone(), t.clone(), pairs)),
                        packed: None,
                    }
                }
            })
            .collect();
        Ok(Self {
            parts,
            missing,
            rank_block_bytes: bb,
            present_blocks: present.len(),
        })
    }

    /// One part per rank, in rank order.
    pub fn parts(&self) -> &[PartPlan] {
        &self.parts
    }
    /// Keys the donor does not hold, in input order.
    pub fn missing(&self) -> &[MissingKey] {
        &self.missing
    }
    /// Bytes of one block on one rank.
    pub fn rank_block_bytes(&self) -> u64 {
        self.rank_block_bytes
    }
    /// Blocks that will be copied (present keys), per rank.
    pub fn present_blocks(&self) -> usize {
        self.present_blocks
    }
    /// Bytes the whole delivery must move: sum of the parts' expected bytes.
    pub fn expected_bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.expected_bytes()).sum()
    }
}

/// `donor slot << 16 | target block` of every present move (in `present`'s
/// order, shared by every rank's [`PackedRows`]) when there are more than
/// [`INLINE_SMALL_BLOCKS`] and every id fits 16 bits (decided from the
/// limits every id was checked against, or else one pass).
fn packed_words(present: &[SlotToBlock], src_limit: u32, dst_limit: u32) -> Option<Arc<[u32]>> {
    if present.len() <= INLINE_SMALL_BLOCKS {
        return None;
    }
    // The limit is 16 set bits: the OR of every id stays below it exactly
    // when each id does.
    let limit = PACKED_MAX_BLOCK_ID;
    let fits = src_limit.max(dst_limit) <= limit + 1
        || present.iter().fold(0, |m, &(s, d)| m | s | d) <= limit;
    fits.then(|| present.iter().map(|&(s, d)| s << 16 | d).collect())
}

/// One rank's part over block rows: `present` (sorted by slot, each slot
/// once) coalesced into runs where both regions are dense and both ids are
/// consecutive; with `words` (see [`packed_words`]), the rows as
/// [`PackedRows`] too.
fn row_part(
    tp_rank: u32,
    present: &[(u32, u32)],
    bb: u64,
    src: RegionGeometry,
    dst: RegionGeometry,
    words: Option<&Arc<[u32]>>,
) -> PartPlan {
    let dense = src.stride_bytes == bb && dst.stride_bytes == bb;
    let mut runs: Vec<CopyRun> = Vec::new();
    // Every row ends at `id x stride + bb` (a merged run's rows too: dense,
    // so its end is its last row's), so the furthest run end on each side
    // is the largest id's: the last slot (sorted), the largest block.
    let mut max_d = 0;
    for &(s, d) in present {
        max_d = max_d.max(d);
        if let Some(last) = runs.last_mut() {
            if dense && last.src_block + last.blocks == s && last.dst_block + last.blocks == d {
                last.blocks += 1;
                last.len += bb;
                continue;
            }
        }
        runs.push(CopyRun {
            src_block: s,
            dst_block: d,
            blocks: 1,
            src_offset: u64::from(s) * src.stride_bytes,
            dst_offset: u64::from(d) * dst.stride_bytes,
            len: bb,
        });
    }
    PartPlan {
        tp_rank,
        runs,
        expected_bytes: bb * present.len() as u64,
        src,
        dst,
        conversion: None,
        ends: match present.last() {
            Some(&(s, _)) => (
                u64::from(s) * src.stride_bytes + bb,
                u64::from(max_d) * dst.stride_bytes + bb,
            ),
            None => (0, 0),
        },
        packed: words
            .and_then(|w| PackedRows::of_ids(w.clone(), src.stride_bytes, dst.stride_bytes, bb)),
    }
}

/// The rows of `l` when it is a bank's slot rows ([`crate::convert::is_bank_rows`]):
/// then every backend's row path applies.
fn block_rows(l: &KvRegionLayout) -> Option<RegionGeometry> {
    crate::convert::is_bank_rows(l).then(|| RegionGeometry::dense(l.geometry(), l.num_blocks()))
}

/// A present move: `(donor slot, target block)`.
type SlotToBlock = (u32, u32);

#[cfg(test)]
mod tests;
