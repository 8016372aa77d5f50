//! [`PackedRows`]: the rows of a block-major `deliver` part as packed 16-bit
//! ids, built once with its [`crate::plan::TransferPlan`], and
//! [`RowsGather`]: one launch of a range of them.
//!
//! A scattered part's host work per fetch used to be one pass over its runs
//! in `deliver` (the region bounds) and one in [`super::RunsGather`] (check
//! every run, pack its ids): 2.8 / 10.8 µs for 1024 / 4096 runs on this
//! project's build VM, 4.5 / 12.9 µs on the H200's host, in front of a
//! 42-47 µs kernel whose whole budget to the 0.90 / 0.80 goals is ~5 µs.
//! The plan already walks every block once when it builds its runs; packing
//! the ids there (shared by every rank: the ids are the same on each) costs
//! a few hundred nanoseconds more of a plan that takes over 100 µs, and
//! leaves `deliver` O(1) host work before the launch: the region bounds
//! are two compares of ends found here, and each launch takes a slice of
//! the words, copied into its parameter image (`launch.rs`).
//!
//! Soundness does not rest on the runs: [`PackedRows::of_ids`] derives the
//! ends from the words and strides themselves (every address a launch forms
//! is `base + id x stride + offset < base + end`), and the CUDA backend
//! compares those ends with both regions before it launches.
//!
//! Nothing here calls CUDA.

use std::sync::Arc;

use super::packed::PackedRef;
use super::{
    launch_geometry, BlockSource, ConvertError, GatherTuning, LaunchGeometry, PackedIds,
    PieceTable, MAX_WORK_ITEMS, MIN_SPLIT_PIECE_BYTES, MIN_WORK_ITEMS,
};

/// The rows of one rank's block-major part, one packed id a block: block `i`
/// is donor bytes `src_stride x (words[i] >> 16) ..+ block_bytes` and target
/// bytes `dst_stride x (words[i] & 0xFFFF) ..+ block_bytes` (from each
/// region's first byte). Built by the plan for parts of more than
/// [`super::INLINE_SMALL_BLOCKS`] blocks whose ids fit 16 bits.
#[derive(Clone, PartialEq, Eq)]
pub struct PackedRows {
    /// `donor id << 16 | target id`, one per block (the plan's order; every
    /// rank of a plan shares them).
    words: Arc<[u32]>,
    src_stride: u64,
    dst_stride: u64,
    block_bytes: u64,
    /// OR of every block's donor and target offset: its lowest set bit
    /// bounds the element width of every chunk.
    bits: u64,
    /// Bytes the donor / target region must have: the furthest block end.
    src_end: u64,
    dst_end: u64,
}

impl std::fmt::Debug for PackedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedRows")
            .field("blocks", &self.words.len())
            .field("src_stride", &self.src_stride)
            .field("dst_stride", &self.dst_stride)
            .field("block_bytes", &self.block_bytes)
            .field("src_end", &self.src_end)
            .field("dst_end", &self.dst_end)
            .finish()
    }
}

impl PackedRows {
    /// Rows of `block_bytes` at `words` over the given strides; one pass
    /// over the words for the ends and the offset bits. `None` when there
    /// is no block, a stride is below `block_bytes` (rows would overlap)
    /// or an end overflows.
    pub fn of_ids(
        words: Arc<[u32]>,
        src_stride: u64,
        dst_stride: u64,
        block_bytes: u64,
    ) -> Option<Self> {
        if words.is_empty() || block_bytes == 0 || src_stride.min(dst_stride) < block_bytes {
            return None;
        }
        // Branch-free: ids are at most 16 bits, so the products fit easily
        // for any stride below 2^47 (checked on the ends below).
        let (mut max_s, mut max_d, mut bits) = (0u64, 0u64, 0u64);
        for &w in words.iter() {
            let (s, d) = (u64::from(w >> 16), u64::from(w & 0xFFFF));
            max_s = max_s.max(s);
            max_d = max_d.max(d);
            bits |= s.wrapping_mul(src_stride) | d.wrapping_mul(dst_stride);
        }
        let end = |id: u64, stride: u64| id.checked_mul(stride)?.checked_add(block_bytes);
        Some(Self {
            src_end: end(max_s, src_stride)?,
            dst_end: end(max_d, dst_stride)?,
            words,
            src_stride,
            dst_stride,
            block_bytes,
            bits,
        })
    }

    /// Blocks (rows) of the part.
    pub fn blocks(&self) -> usize {
        self.words.len()
    }
    /// The packed ids, one per block.
    pub fn words(&self) -> &[u32] {
        &self.words
    }
    /// `(donor, target)` block strides, bytes.
    pub fn strides(&self) -> (u64, u64) {
        (self.src_stride, self.dst_stride)
    }
    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }
    /// `(donor, target)` bytes a region must have for every block to lie
    /// inside it.
    pub fn region_bytes(&self) -> (u64, u64) {
        (self.src_end, self.dst_end)
    }

    /// The launch of blocks `start..start + len` with `pieces` (from
    /// [`ContiguousPieces::get`] for this block length and `len` blocks).
    ///
    /// # Errors
    /// [`ConvertError::Empty`] for an empty or out-of-range slice;
    /// [`ConvertError::TooLarge`] naming `moves` past [`MAX_WORK_ITEMS`]
    /// work items.
    pub fn gather(
        &self,
        start: usize,
        len: usize,
        (pieces, piece_bits): (Arc<PieceTable>, u64),
    ) -> Result<RowsGather<'_>, ConvertError> {
        let words = start
            .checked_add(len)
            .and_then(|end| self.words.get(start..end))
            .filter(|w| !w.is_empty())
            .ok_or(ConvertError::Empty)?;
        let items = len as u64 * pieces.len() as u64;
        if items > MAX_WORK_ITEMS {
            return Err(ConvertError::TooLarge {
                field: "moves",
                got: items,
                limit: MAX_WORK_ITEMS,
            });
        }
        Ok(RowsGather {
            rows: self,
            words,
            pieces,
            bits: self.bits | piece_bits,
        })
    }
}

/// One launch of a range of [`PackedRows`]: what a `deliver` part of more
/// than 128 blocks launches, each chunk a slice of the plan's words.
#[derive(Debug, Clone)]
pub struct RowsGather<'a> {
    rows: &'a PackedRows,
    words: &'a [u32],
    pieces: Arc<PieceTable>,
    /// The rows' offset bits OR the piece length and offsets.
    bits: u64,
}

impl RowsGather<'_> {
    /// Payload bytes moved.
    pub fn bytes(&self) -> u64 {
        self.words.len() as u64 * self.rows.block_bytes
    }
    /// `(donor, target)` bytes a region must have (those of the whole part).
    pub fn region_bytes(&self) -> (u64, u64) {
        self.rows.region_bytes()
    }
}

impl BlockSource for RowsGather<'_> {
    fn blocks(&self) -> usize {
        self.words.len()
    }
    fn pieces_arc(&self) -> &Arc<PieceTable> {
        &self.pieces
    }
    fn packed_ref(&self) -> Option<PackedRef<'_>> {
        Some(PackedRef {
            src_stride: self.rows.src_stride,
            dst_stride: self.rows.dst_stride,
            words: self.words,
        })
    }
    fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]) {
        let p = self.packed_ref().expect("rows are packed");
        p.write_block_table(src_base, dst_base, out);
    }
    fn geometry_tuned(&self, sb: u64, db: u64, sms: u32, tuning: &GatherTuning) -> LaunchGeometry {
        launch_geometry(
            &self.pieces,
            self.words.len(),
            self.bits | sb | db,
            sms,
            tuning,
        )
    }
}

/// Piece length of `block_bytes` contiguous bytes cut as
/// `PieceTable::split_for` cuts [`PieceTable::contiguous`] for a fetch of
/// `blocks` blocks (no table built).
pub fn contiguous_piece_bytes(block_bytes: u64, blocks: u64, max_piece_bytes: u64) -> u64 {
    let (mut b, mut count) = (block_bytes, 1u64);
    loop {
        let small_fetch =
            blocks.saturating_mul(count) < MIN_WORK_ITEMS && b >= 2 * MIN_SPLIT_PIECE_BYTES;
        let align = 1u64 << b.trailing_zeros().min(4);
        let halvable = b % 2 == 0 && (b / 2) % align == 0;
        if !(halvable && (b > max_piece_bytes || small_fetch)) {
            return b;
        }
        b /= 2;
        count *= 2;
    }
}

/// Most tables [`ContiguousPieces`] keeps (a device sees a few block sizes,
/// each at one or two piece lengths).
const KEPT_PIECE_TABLES: usize = 8;

/// Piece tables of contiguous blocks (block-major rows), kept by block and
/// piece length so a fetch builds none and the launch finds the device copy
/// by pointer: the table of `block_bytes` cut into `piece_bytes` pieces is
/// offsets `0, piece, 2 x piece, ..` on both sides.
#[derive(Debug, Default)]
pub struct ContiguousPieces {
    kept: Vec<(u64, Arc<PieceTable>, u64)>,
}

impl ContiguousPieces {
    /// The table [`PieceTable::contiguous`]`(block_bytes).split_for(blocks,
    /// max_piece_bytes)` builds, and the OR of its piece length and offsets.
    pub fn get(
        &mut self,
        block_bytes: u64,
        blocks: usize,
        max_piece_bytes: u64,
    ) -> (Arc<PieceTable>, u64) {
        let piece = contiguous_piece_bytes(block_bytes, blocks as u64, max_piece_bytes);
        if let Some((_, t, bits)) = self
            .kept
            .iter()
            .find(|(bb, t, _)| *bb == block_bytes && t.piece_bytes == piece)
        {
            return (t.clone(), *bits);
        }
        let offsets: Vec<u64> = (0..block_bytes / piece.max(1)).map(|i| i * piece).collect();
        let bits = offsets.iter().fold(piece, |a, o| a | o);
        let t = Arc::new(PieceTable {
            piece_bytes: piece,
            src: offsets.clone(),
            dst: offsets,
        });
        if self.kept.len() == KEPT_PIECE_TABLES {
            self.kept.remove(0);
        }
        self.kept.push((block_bytes, t.clone(), bits));
        (t, bits)
    }
}

impl PackedIds {
    /// The ids as a borrowed view.
    pub fn view(&self) -> PackedRef<'_> {
        PackedRef {
            src_stride: self.src_stride,
            dst_stride: self.dst_stride,
            words: &self.words,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_gather::{ConvertPlan, MAX_PIECE_BYTES};
    use crate::plan::CopyRun;
    use proptest::prelude::*;

    proptest! {
        /// The arithmetic split and the cached table are exactly the table
        /// `split_for` builds, for any block length, fetch size and cap.
        #[test]
        fn cached_pieces_are_the_split_table(
            bb in prop_oneof![1u64..200_000, (4u32..22).prop_map(|p| 1u64 << p),
                              (1u64..64).prop_map(|k| (k * 16) << 10)],
            blocks in 1usize..3000, max_pow in 10u32..22,
        ) {
            let max = 1u64 << max_pow;
            let want = PieceTable::contiguous(bb).split_for(blocks as u64, max);
            prop_assert_eq!(contiguous_piece_bytes(bb, blocks as u64, max), want.piece_bytes);
            let mut cache = ContiguousPieces::default();
            let (t, bits) = cache.get(bb, blocks, max);
            prop_assert_eq!(&*t, &want);
            let want_bits = want.src.iter().chain(&want.dst).fold(want.piece_bytes, |a, o| a | o);
            prop_assert_eq!(bits, want_bits);
            // Found again by pointer.
            let (again, _) = cache.get(bb, blocks, max);
            prop_assert!(Arc::ptr_eq(&t, &again));
        }
    }

    #[test]
    fn the_cache_keeps_eight_tables_newest_last() {
        let mut c = ContiguousPieces::default();
        let first = c.get(64 << 10, 1024, MAX_PIECE_BYTES).0;
        for k in 1..=8u64 {
            c.get(k * (128 << 10), 1024, MAX_PIECE_BYTES);
        }
        assert_eq!(c.kept.len(), 8);
        let again = c.get(64 << 10, 1024, MAX_PIECE_BYTES).0;
        assert!(!Arc::ptr_eq(&first, &again), "the oldest was dropped");
        assert_eq!(first, again);
        // 1024 x 64 KiB: one 64 KiB piece; 128 blocks of it: 8 KiB pieces
        // (fewer than 1024 work items are cut further).
        assert_eq!(again.piece_bytes, 64 << 10);
        assert_eq!(c.get(64 << 10, 128, MAX_PIECE_BYTES).0.len(), 8);
    }

    fn words(pairs: &[(u32, u32)]) -> Arc<[u32]> {
        pairs.iter().map(|&(s, d)| s << 16 | d).collect()
    }

    #[test]
    fn ends_and_bits_come_from_the_ids_themselves() {
        let w = words(&[(7, 0), (3, 9), (65_535, 2)]);
        let r = PackedRows::of_ids(w.clone(), 48, 32, 32).unwrap();
        assert_eq!(r.region_bytes(), (65_535 * 48 + 32, 9 * 32 + 32));
        assert_eq!(
            r.bits,
            (7 * 48) | (3 * 48) | (65_535 * 48) | (9 * 32) | (2 * 32)
        );
        assert_eq!(
            (r.blocks(), r.strides(), r.block_bytes()),
            (3, (48, 32), 32)
        );
        // Overlapping rows, no rows, an end past u64.
        assert!(PackedRows::of_ids(w.clone(), 16, 32, 32).is_none());
        assert!(PackedRows::of_ids(words(&[]), 32, 32, 32).is_none());
        assert!(PackedRows::of_ids(w, u64::MAX / 1000, 32, 32).is_none());
        let dbg = format!(
            "{:?}",
            PackedRows::of_ids(words(&[(1, 1)]), 64, 64, 64).unwrap()
        );
        assert!(dbg.contains("blocks: 1") && !dbg.contains("words"), "{dbg}");
    }

    /// Any slice of the rows launches what `ConvertPlan::from_runs` plans
    /// for the same rows as single-block runs: same table, packed ids,
    /// pieces, bytes and geometry. (The element width comes from the OR of
    /// the whole part's offsets, a superset of the slice's: never wider
    /// than the slice's own, equal here.)
    #[test]
    fn a_slice_launches_what_the_plan_of_its_runs_plans() {
        let (bb, ss, ds) = (16u64 << 10, 20u64 << 10, 16u64 << 10);
        let n = 3000u32;
        let pairs: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - 1 - i) + 1, i)).collect();
        let rows = PackedRows::of_ids(words(&pairs), ss, ds, bb).unwrap();
        let t = GatherTuning::default();
        let mut cache = ContiguousPieces::default();
        for (start, len) in [
            (0usize, 3000usize),
            (0, 128),
            (128, 512),
            (2500, 500),
            (7, 1),
        ] {
            let g = rows
                .gather(start, len, cache.get(bb, len, t.max_piece_bytes()))
                .unwrap();
            let runs: Vec<CopyRun> = pairs[start..start + len]
                .iter()
                .map(|&(s, d)| CopyRun {
                    src_block: s,
                    dst_block: d,
                    blocks: 1,
                    src_offset: u64::from(s) * ss,
                    dst_offset: u64::from(d) * ds,
                    len: bb,
                })
                .collect();
            let (sl, dl) = rows.region_bytes();
            let plan = ConvertPlan::from_runs_tuned(&runs, bb, sl, dl, &t).unwrap();
            assert_eq!(g.blocks(), len);
            assert_eq!(g.bytes(), plan.bytes());
            assert_eq!(&**g.pieces_arc(), plan.pieces(), "{start}+{len}");
            let (sb, db) = (1u64 << 20, 1u64 << 40);
            let mut table = vec![0; 2 * len];
            g.write_block_table(sb, db, &mut table);
            assert_eq!(table, plan.block_table(sb, db), "{start}+{len}");
            if let Some(p) = plan.packed() {
                assert_eq!(g.packed_ref(), Some(p.view()));
            }
            let geo = g.geometry_tuned(sb, db, 132, &t);
            assert_eq!(geo, plan.geometry_tuned(sb, db, 132, &t), "{start}+{len}");
            assert_eq!(geo.width, 16);
        }
        assert_eq!(
            rows.gather(2999, 2, cache.get(bb, 2, MAX_PIECE_BYTES))
                .unwrap_err(),
            ConvertError::Empty
        );
        assert_eq!(
            rows.gather(5, 0, cache.get(bb, 1, MAX_PIECE_BYTES))
                .unwrap_err(),
            ConvertError::Empty
        );
    }
}
