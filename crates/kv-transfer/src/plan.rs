//! Copy plans: from donor slots per rank to target blocks per rank.
//!
//! A plan is pure arithmetic over region geometry; it touches no memory.
//! Donor and target must have the same layout (equal [`KvLayout::fingerprint`],
//! which covers TP size): TP-N to TP-N only, no resharding. Logical slot ids
//! and target block ids are shared by every rank (one id names the same block
//! on every rank), so one list of moves serves all ranks; only the region
//! geometry (stride, count) may differ per rank.

use std::collections::HashSet;

use kv_descriptor::{KvLayout, SequenceHash, TensorOrder};

use crate::TransferError;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartPlan {
    /// TP rank (index in [`TransferPlan::parts`]).
    pub tp_rank: u32,
    /// Coalesced runs, sorted by source offset.
    pub runs: Vec<CopyRun>,
    /// Bytes this part must deliver: present blocks x `rank_block_bytes`.
    pub expected_bytes: u64,
    /// Donor region geometry of this rank.
    pub src: RegionGeometry,
    /// Target region geometry of this rank.
    pub dst: RegionGeometry,
}

/// A validated copy plan over a TP group. Only [`TransferPlan::new`] builds one.
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
/// assert_eq!(p.parts()[1].runs.len(), 2);
/// assert_eq!(p.parts()[1].expected_bytes, 3 * l.rank_block_bytes() as u64);
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
    ///   listed twice, or a donor slot listed twice.
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
        if moves.is_empty() {
            return Err(TransferError::input(
                "moves",
                "at least one block must be requested",
            ));
        }
        let src_limit = donor.iter().map(|g| g.blocks).min().unwrap_or(0);
        let dst_limit = target.iter().map(|g| g.blocks).min().unwrap_or(0);
        let (mut keys, mut dsts, mut srcs) = (HashSet::new(), HashSet::new(), HashSet::new());
        let mut present = Vec::with_capacity(moves.len());
        let mut missing = Vec::new();
        for (i, m) in moves.iter().enumerate() {
            if !keys.insert(m.key) {
                return Err(TransferError::input(
                    "moves.key",
                    format!("move {i}: key {:?} listed twice", m.key),
                ));
            }
            if m.dst_block >= dst_limit {
                return Err(TransferError::input(
                    "moves.dst_block",
                    format!(
                        "move {i}: block {} is not below the target's {dst_limit} blocks",
                        m.dst_block
                    ),
                ));
            }
            if !dsts.insert(m.dst_block) {
                return Err(TransferError::input(
                    "moves.dst_block",
                    format!("move {i}: block {} is written twice", m.dst_block),
                ));
            }
            match m.src_slot {
                None => missing.push(MissingKey {
                    index: i,
                    key: m.key,
                    dst_block: m.dst_block,
                }),
                Some(s) => {
                    if s >= src_limit {
                        return Err(TransferError::input(
                            "moves.src_slot",
                            format!(
                                "move {i}: slot {s} is not below the donor's {src_limit} slots"
                            ),
                        ));
                    }
                    if !srcs.insert(s) {
                        return Err(TransferError::input(
                            "moves.src_slot",
                            format!("move {i}: slot {s} listed twice"),
                        ));
                    }
                    present.push((s, m.dst_block));
                }
            }
        }
        // Sorting by donor slot lets consecutive slots meet; the target side
        // must also be consecutive for the pair to merge.
        present.sort_unstable();
        let parts = (0..tp)
            .map(|r| {
                let (src, dst) = (donor[r], target[r]);
                let dense = src.stride_bytes == bb && dst.stride_bytes == bb;
                let mut runs: Vec<CopyRun> = Vec::new();
                for &(s, d) in &present {
                    if let Some(last) = runs.last_mut() {
                        if dense
                            && last.src_block + last.blocks == s
                            && last.dst_block + last.blocks == d
                        {
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
                    tp_rank: r as u32,
                    runs,
                    expected_bytes: bb * present.len() as u64,
                    src,
                    dst,
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
        self.parts.iter().map(|p| p.expected_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_descriptor::DType;
    use proptest::prelude::*;

    fn layout(tp: u32) -> KvLayout {
        KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, tp).unwrap()
    }
    fn mv(k: u64, s: Option<u32>, d: u32) -> BlockMove {
        BlockMove {
            key: SequenceHash(k),
            src_slot: s,
            dst_block: d,
        }
    }

    #[test]
    fn coalesces_adjacent_pairs_only() {
        let l = layout(1);
        let bb = l.rank_block_bytes() as u64;
        let g = [RegionGeometry::dense(&l, 32)];
        // 5,6,7 -> 10,11,12 merge; 8 -> 20 breaks on the target side.
        let moves = [
            mv(1, Some(5), 10),
            mv(2, Some(6), 11),
            mv(3, Some(7), 12),
            mv(4, Some(8), 20),
        ];
        let p = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
        let runs = &p.parts()[0].runs;
        assert_eq!(runs.len(), 2);
        assert_eq!(
            runs[0],
            CopyRun {
                src_block: 5,
                dst_block: 10,
                blocks: 3,
                src_offset: 5 * bb,
                dst_offset: 10 * bb,
                len: 3 * bb
            }
        );
        assert_eq!(
            (runs[1].src_offset, runs[1].dst_offset, runs[1].len),
            (8 * bb, 20 * bb, bb)
        );
    }

    #[test]
    fn padded_stride_never_merges() {
        let l = layout(1);
        let bb = l.rank_block_bytes() as u64;
        let src = [RegionGeometry {
            stride_bytes: bb + 64,
            blocks: 8,
        }];
        let dst = [RegionGeometry::dense(&l, 8)];
        let p =
            TransferPlan::new(&l, &l, &[mv(1, Some(0), 0), mv(2, Some(1), 1)], &src, &dst).unwrap();
        assert_eq!(p.parts()[0].runs.len(), 2);
        assert_eq!(p.parts()[0].runs[1].src_offset, bb + 64);
    }

    #[test]
    fn rejects_geometry_mismatch_before_anything() {
        let a = layout(2);
        let b = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
        let g = [RegionGeometry::dense(&a, 4); 2];
        let e = TransferPlan::new(&a, &b, &[mv(1, Some(0), 0)], &g, &g).unwrap_err();
        assert!(matches!(e, TransferError::LayoutMismatch { .. }), "{e}");
        let e = TransferPlan::new(&a, &a, &[mv(1, Some(0), 0)], &g[..1], &g).unwrap_err();
        assert!(e.to_string().contains("`donor`"), "{e}");
    }

    #[test]
    fn rejects_bad_moves_naming_the_field() {
        let l = layout(1);
        let g = [RegionGeometry::dense(&l, 4)];
        let cases: [(&[BlockMove], &str); 5] = [
            (&[], "`moves`"),
            (&[mv(1, Some(4), 0)], "moves.src_slot"),
            (&[mv(1, Some(0), 4)], "moves.dst_block"),
            (&[mv(1, Some(0), 0), mv(2, Some(1), 0)], "written twice"),
            (&[mv(1, Some(0), 0), mv(1, Some(1), 1)], "moves.key"),
        ];
        for (moves, want) in cases {
            let e = TransferPlan::new(&l, &l, moves, &g, &g)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e} should mention {want}");
        }
    }

    proptest! {
        /// Runs cover exactly the present moves, never overlap on the target,
        /// and stay inside both regions.
        #[test]
        fn runs_cover_present_moves(
            pairs in proptest::collection::btree_map(0u32..64, 0u32..64, 1..40),
            drop_mask in any::<u64>(),
        ) {
            let l = layout(2);
            let bb = l.rank_block_bytes() as u64;
            let g = [RegionGeometry::dense(&l, 64); 2];
            let mut used_dst = HashSet::new();
            let moves: Vec<_> = pairs
                .iter()
                .filter(|(_, d)| used_dst.insert(**d))
                .enumerate()
                .map(|(i, (s, d))| mv(i as u64, (drop_mask >> (i % 64) & 1 == 0).then_some(*s), *d))
                .collect();
            let p = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
            let present: Vec<_> = moves.iter().filter(|m| m.src_slot.is_some()).collect();
            prop_assert_eq!(p.missing().len(), moves.len() - present.len());
            for part in p.parts() {
                let mut covered = Vec::new();
                for r in &part.runs {
                    prop_assert_eq!(r.len, u64::from(r.blocks) * bb);
                    prop_assert!(r.src_offset + r.len <= part.src.region_bytes());
                    prop_assert!(r.dst_offset + r.len <= part.dst.region_bytes());
                    for k in 0..r.blocks {
                        covered.push((r.src_block + k, r.dst_block + k));
                    }
                }
                covered.sort_unstable();
                let mut want: Vec<_> = present.iter().map(|m| (m.src_slot.unwrap(), m.dst_block)).collect();
                want.sort_unstable();
                prop_assert_eq!(covered, want);
                prop_assert_eq!(part.expected_bytes, present.len() as u64 * bb);
            }
        }
    }
}
