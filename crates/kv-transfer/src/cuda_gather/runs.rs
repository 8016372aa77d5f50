//! What a launch reads from a plan ([`BlockSource`]), and [`RunsGather`]:
//! the block-major rows of a `deliver` part launched straight from the
//! part's runs, without building a [`ConvertPlan`].
//!
//! For a fetch of up to [`INLINE_PACKED_BLOCKS`] blocks (small inline table,
//! packed ids or device table), building a plan only to copy its offset
//! vectors into the parameter image or staging buffer costs two allocations
//! and three passes (4.6 µs on the H200's host for 1024 blocks, 28.4 µs for
//! 4096). [`RunsGather`] makes one pass over the runs to check them (and
//! one to pack ids past 128 blocks), and the launch writes the table from
//! the runs directly: the same table, packed ids, geometry and bytes as
//! [`ConvertPlan::from_runs_tuned`] (checked by the tests below and the
//! kernel mirror).

use std::sync::Arc;

use crate::plan::CopyRun;

use super::{
    launch_geometry, packed::single_row_strides, ConvertError, ConvertPlan, GatherTuning,
    LaunchGeometry, PackedIds, PackedRef, PieceTable, INLINE_PACKED_BLOCKS, INLINE_SMALL_BLOCKS,
    PACKED_MAX_BLOCK_ID,
};

// The pass in `RunsGather::with_words` tests "an id past 16 bits" as
// `(s | d) >> 16 != 0`.
const _: () = assert!(PACKED_MAX_BLOCK_ID == 0xFFFF);

/// The blocks and pieces one launch of the converting gather reads.
pub trait BlockSource {
    /// Blocks moved (`n`).
    fn blocks(&self) -> usize;
    /// How each block is cut.
    fn pieces_arc(&self) -> &Arc<PieceTable>;
    /// Packed 16-bit ids, when the source has them.
    fn packed_ref(&self) -> Option<PackedRef<'_>>;
    /// `n` donor block addresses, then `n` target block addresses, for
    /// regions at `src_base` / `dst_base`, into `out[..2n]`.
    ///
    /// # Panics
    /// When `out` is shorter than `2n` (a caller bug).
    fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]);
    /// Launch geometry on a device with `sms` SMs.
    fn geometry_tuned(
        &self,
        src_base: u64,
        dst_base: u64,
        sms: u32,
        tuning: &GatherTuning,
    ) -> LaunchGeometry;
}

impl BlockSource for ConvertPlan {
    fn blocks(&self) -> usize {
        ConvertPlan::blocks(self)
    }
    fn pieces_arc(&self) -> &Arc<PieceTable> {
        ConvertPlan::pieces_arc(self)
    }
    fn packed_ref(&self) -> Option<PackedRef<'_>> {
        ConvertPlan::packed(self).map(PackedIds::view)
    }
    fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]) {
        ConvertPlan::write_block_table(self, src_base, dst_base, out);
    }
    fn geometry_tuned(&self, sb: u64, db: u64, sms: u32, tuning: &GatherTuning) -> LaunchGeometry {
        ConvertPlan::geometry_tuned(self, sb, db, sms, tuning)
    }
}

/// The block-major rows of a `TransferPlan` part (each run `blocks` rows of
/// `block_bytes`, contiguous on both sides), borrowed for one launch.
#[derive(Debug, Clone)]
pub struct RunsGather<'a> {
    runs: &'a [CopyRun],
    block_bytes: u64,
    n: usize,
    /// OR of the run offsets, the piece offsets and lengths, and the block
    /// length when a run has several rows: the same lowest set bit as the
    /// OR of every block offset.
    bits: u64,
    pieces: Arc<PieceTable>,
    /// Packed ids of 129..=8,128-block fetches whose ids pack (the launch
    /// sends them as a kernel parameter); one Vec per fetch.
    packed: Option<PackedIds>,
}

impl<'a> RunsGather<'a> {
    /// The rows of `runs`, pieces split as [`ConvertPlan::from_runs_tuned`]
    /// splits them, with the packed ids [`ConvertPlan::from_runs_tuned`]
    /// would pack; `None` when the fetch has more than
    /// [`INLINE_PACKED_BLOCKS`] blocks (then build the plan: the launch is
    /// split in batches of plans).
    ///
    /// # Errors
    /// [`ConvertError::Empty`], [`ConvertError::RunLength`] (for fetches
    /// this returns `None` for, the plan reports bad runs).
    pub fn new(
        runs: &'a [CopyRun],
        block_bytes: u64,
        tuning: &GatherTuning,
    ) -> Result<Option<Self>, ConvertError> {
        Self::with_words(runs, block_bytes, tuning, Vec::new())
    }

    /// [`RunsGather::new`] packing the ids into `words` (cleared first): a
    /// caller that launches fetch after fetch passes the Vec of the last
    /// one ([`RunsGather::into_words`]), so a scattered fetch allocates no
    /// id table and writes into memory it already touched. On `Err` or
    /// `None` the Vec is dropped.
    ///
    /// # Errors
    /// As [`RunsGather::new`].
    pub fn with_words(
        runs: &'a [CopyRun],
        block_bytes: u64,
        tuning: &GatherTuning,
        mut words: Vec<u32>,
    ) -> Result<Option<Self>, ConvertError> {
        if runs.is_empty() || block_bytes == 0 {
            return Err(ConvertError::Empty);
        }
        // Every run has at least one row: more runs than the table holds
        // decide without a pass (the plan's own pass checks them).
        if runs.len() > INLINE_PACKED_BLOCKS {
            return Ok(None);
        }
        // Past 128 runs the ids are packed in this same pass, with the
        // single-row strides (a part of single-row runs, the scattered
        // case): the runs are read once, not twice (4096 runs are 160 KiB).
        let pack = runs.len() > INLINE_SMALL_BLOCKS;
        let (ss, ds) = if pack {
            single_row_strides(runs, block_bytes)
        } else {
            (0, 0)
        };
        // One pass with no branch or early return per run: every check
        // folds into a flag held in a register (locals of a plain loop, not
        // state captured by a closure), and a bad length is located
        // afterwards (the refusal names the same first bad run). The ids
        // are written into an exactly sized slice, not pushed with a
        // capacity test each (4096 runs: see `cpu/plan_build/runs_direct`).
        // The flags are ORs of XORs (nonzero when a run fails), not a
        // compare and set per check.
        let (mut n, mut bits, mut multi) = (0u64, 0u64, false);
        let (mut bad_len, mut unpacked) = (0u64, 0u64);
        words.clear();
        if pack {
            words.resize(runs.len(), 0);
            for (w, r) in words.iter_mut().zip(runs) {
                let rows = u64::from(r.blocks);
                bad_len |= r.len ^ (rows * block_bytes);
                n += rows;
                bits |= r.src_offset | r.dst_offset;
                multi |= r.blocks > 1;
                let (s, d) = (u64::from(r.src_block), u64::from(r.dst_block));
                // Off its stride on either side, an id past 16 bits, or a
                // run of other than one row.
                unpacked |= ((s * ss) ^ r.src_offset)
                    | ((d * ds) ^ r.dst_offset)
                    | ((s | d) >> 16)
                    | (rows ^ 1);
                *w = r.src_block << 16 | (r.dst_block & 0xFFFF);
            }
        } else {
            for r in runs {
                let rows = u64::from(r.blocks);
                bad_len |= r.len ^ (rows * block_bytes);
                n += rows;
                bits |= r.src_offset | r.dst_offset;
                multi |= r.blocks > 1;
            }
        }
        let (bad_len, unpacked) = (bad_len != 0, unpacked != 0);
        if bad_len {
            let index = runs
                .iter()
                .position(|r| r.len != u64::from(r.blocks) * block_bytes)
                .expect("a run failed the length check");
            return Err(ConvertError::RunLength {
                index,
                len: runs[index].len,
                block_bytes,
            });
        }
        if n > INLINE_PACKED_BLOCKS as u64 {
            return Ok(None);
        }
        let n = n as usize;
        if multi {
            // A run of several rows: block offsets step by the block length.
            bits |= block_bytes;
        }
        // Runs of several rows (or a refusal, decided again) go to
        // `of_runs`, the authority; single-row parts keep the words above.
        let packed = if pack && !unpacked {
            Some(PackedIds {
                src_stride: ss,
                dst_stride: ds,
                words,
            })
        } else {
            PackedIds::of_runs(runs, block_bytes, n, multi)
        };
        let pieces =
            PieceTable::contiguous(block_bytes).split_for(n as u64, tuning.max_piece_bytes());
        let bits = pieces
            .src
            .iter()
            .chain(&pieces.dst)
            .fold(bits | pieces.piece_bytes, |a, b| a | b);
        Ok(Some(Self {
            runs,
            block_bytes,
            n,
            bits,
            pieces: Arc::new(pieces),
            packed,
        }))
    }

    /// The packed ids, when the part's ids pack (129..=8,128 blocks).
    pub fn packed(&self) -> Option<&PackedIds> {
        self.packed.as_ref()
    }

    /// The packed-id Vec, to pass to the next fetch's
    /// [`RunsGather::with_words`] (empty when the ids did not pack).
    pub fn into_words(self) -> Vec<u32> {
        self.packed.map(|p| p.words).unwrap_or_default()
    }

    /// Payload bytes moved.
    pub fn bytes(&self) -> u64 {
        self.n as u64 * self.block_bytes
    }

    /// `(donor, target)` bytes a region must have for every run to lie
    /// inside it: the largest run end on each side (one pass; the launch
    /// path relies on `deliver`'s own range checks instead).
    pub fn region_bytes(&self) -> (u64, u64) {
        self.runs.iter().fold((0, 0), |(s, d), r| {
            (s.max(r.src_offset + r.len), d.max(r.dst_offset + r.len))
        })
    }
}

impl BlockSource for RunsGather<'_> {
    fn blocks(&self) -> usize {
        self.n
    }
    fn pieces_arc(&self) -> &Arc<PieceTable> {
        &self.pieces
    }
    fn packed_ref(&self) -> Option<PackedRef<'_>> {
        self.packed.as_ref().map(PackedIds::view)
    }
    fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]) {
        let n = self.n;
        let (s, d) = out[..2 * n].split_at_mut(n);
        let mut i = 0;
        for r in self.runs {
            for k in 0..u64::from(r.blocks) {
                s[i] = src_base + r.src_offset + k * self.block_bytes;
                d[i] = dst_base + r.dst_offset + k * self.block_bytes;
                i += 1;
            }
        }
    }
    fn geometry_tuned(&self, sb: u64, db: u64, sms: u32, tuning: &GatherTuning) -> LaunchGeometry {
        launch_geometry(&self.pieces, self.n, self.bits | sb | db, sms, tuning)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Same table, geometry and pieces as the plan `from_runs` builds,
        /// for coalesced and single-row runs at any alignment.
        #[test]
        fn runs_gather_launches_what_from_runs_plans(
            runs in proptest::collection::vec((0u32..4, 1u32..5, 0u64..64), 1..40),
            bb_pow in 4u32..18, mis in 0u64..17, sms in 1u32..200,
            tuned in any::<bool>(),
        ) {
            let bb = 1u64 << bb_pow;
            let tuning = if tuned {
                GatherTuning::new(128, 4, 16 << 10).unwrap()
            } else {
                GatherTuning::default()
            };
            let (mut s, mut d) = (0u64, 0u64);
            let runs: Vec<CopyRun> = runs
                .into_iter()
                .map(|(gap, blocks, off)| {
                    let r = CopyRun {
                        src_block: 0,
                        dst_block: 0,
                        blocks,
                        src_offset: s + u64::from(gap) * bb + off * 16,
                        dst_offset: d + off,
                        len: u64::from(blocks) * bb,
                    };
                    s = r.src_offset + r.len;
                    d = r.dst_offset + r.len;
                    r
                })
                .collect();
            let plan = ConvertPlan::from_runs_tuned(&runs, bb, s, d, &tuning).unwrap();
            let direct = RunsGather::new(&runs, bb, &tuning).unwrap().unwrap();
            prop_assert_eq!(direct.blocks(), plan.blocks());
            prop_assert_eq!(direct.bytes(), plan.bytes());
            prop_assert_eq!(&**direct.pieces_arc(), plan.pieces());
            let (sb, db) = (4096 + mis, 1 << 30);
            let mut t = vec![0; 2 * plan.blocks()];
            direct.write_block_table(sb, db, &mut t);
            prop_assert_eq!(t, plan.block_table(sb, db));
            prop_assert_eq!(
                direct.geometry_tuned(sb, db, sms, &tuning),
                plan.geometry_tuned(sb, db, sms, &tuning)
            );
        }
    }

    /// Scattered fetches of 129..=8,128 blocks (the benchmark's 1024 x
    /// 64 KiB and 4096 x 16 KiB shapes): the direct gather packs the same
    /// ids as the plan, so the launch sends them as a parameter instead of
    /// uploading a device table, with the same table and geometry.
    #[test]
    fn runs_gather_packs_the_ids_the_plan_packs() {
        let t = GatherTuning::default();
        for (n, bb) in [(129u32, 4096u64), (1024, 64 << 10), (4096, 16 << 10)] {
            // Every other donor slot, reversed: no run has two rows.
            let runs: Vec<CopyRun> = (0..n)
                .map(|i| {
                    let s = 2 * (n - 1 - i) + 1;
                    CopyRun {
                        src_block: s,
                        dst_block: i,
                        blocks: 1,
                        src_offset: u64::from(s) * bb,
                        dst_offset: u64::from(i) * bb,
                        len: bb,
                    }
                })
                .collect();
            let len = 2 * u64::from(n) * bb;
            let plan = ConvertPlan::from_runs_tuned(&runs, bb, len, len, &t).unwrap();
            let direct = RunsGather::new(&runs, bb, &t).unwrap().unwrap();
            let packed = direct.packed().expect("scattered ids pack");
            assert_eq!(Some(packed), plan.packed(), "{n} blocks");
            assert_eq!((packed.src_stride, packed.dst_stride), (bb, bb));
            assert_eq!(packed.words[0], (2 * n - 1) << 16);
            assert_eq!(direct.region_bytes(), (len, u64::from(n) * bb));
            let (sb, db) = (1 << 20, 1 << 30);
            let mut table = vec![0; 2 * n as usize];
            direct.write_block_table(sb, db, &mut table);
            assert_eq!(table, plan.block_table(sb, db));
            assert_eq!(
                direct.geometry_tuned(sb, db, 132, &t),
                plan.geometry_tuned(sb, db, 132, &t)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Parts of 100..=400 runs (single and multi-row, dense or padded
        /// donor strides, ids near the 16-bit limit, one offset off its
        /// stride): `RunsGather::new` packs exactly what `from_runs` packs.
        #[test]
        fn runs_gather_packs_like_from_runs_for_any_part(
            runs in proptest::collection::vec((0u32..3, 1u32..4), 100..400),
            multi in any::<bool>(), pad in 0u64..3,
            start in prop_oneof![Just(0u32), Just(64_000)],
            bump in proptest::option::of(0usize..100),
        ) {
            let bb = 4096u64;
            let ss = bb + pad * 1024;
            let (mut s, mut d) = (start, 0u32);
            let mut v: Vec<CopyRun> = runs
                .into_iter()
                .map(|(gap, rows)| {
                    let rows = if multi { rows } else { 1 };
                    s += gap;
                    let r = CopyRun {
                        src_block: s,
                        dst_block: d,
                        blocks: rows,
                        src_offset: u64::from(s) * ss,
                        dst_offset: u64::from(d) * bb,
                        len: u64::from(rows) * bb,
                    };
                    s += rows;
                    d += rows;
                    r
                })
                .collect();
            if let Some(i) = bump {
                v[i].src_offset += 16;
            }
            let end = |f: fn(&CopyRun) -> u64| v.iter().map(f).max().unwrap();
            let (sl, dl) = (end(|r| r.src_offset + r.len), end(|r| r.dst_offset + r.len));
            let t = GatherTuning::default();
            let plan = ConvertPlan::from_runs_tuned(&v, bb, sl, dl, &t).unwrap();
            let direct = RunsGather::new(&v, bb, &t).unwrap().unwrap();
            prop_assert_eq!(direct.packed(), plan.packed());
            // Packed ids name the same bytes as the run offsets.
            if let Some(p) = direct.packed() {
                let (sb, db) = (1u64 << 30, 1u64 << 40);
                let mut table = vec![0; 2 * direct.blocks()];
                direct.write_block_table(sb, db, &mut table);
                let n = direct.blocks();
                for (i, w) in p.words.iter().enumerate() {
                    prop_assert_eq!(sb + u64::from(w >> 16) * p.src_stride, table[i]);
                    prop_assert_eq!(db + u64::from(w & 0xFFFF) * p.dst_stride, table[n + i]);
                }
            }
        }
    }

    /// The single pass folds its checks into flags: a part with several
    /// bad runs is still refused naming the first, ids past 16 bits or a
    /// run off its stride still fall back exactly as `from_runs` decides,
    /// and a reused Vec is filled in place (no new allocation).
    #[test]
    fn one_pass_keeps_every_check_and_reuses_the_id_vec() {
        let bb = 16u64 << 10;
        let t = GatherTuning::default();
        let runs: Vec<CopyRun> = (0..300u32)
            .map(|i| CopyRun {
                src_block: 2 * i + 1,
                dst_block: i,
                blocks: 1,
                src_offset: u64::from(2 * i + 1) * bb,
                dst_offset: u64::from(i) * bb,
                len: bb,
            })
            .collect();
        let mut bad = runs.clone();
        bad[200].len = bb + 16;
        bad[5].len = bb - 16;
        assert_eq!(
            RunsGather::new(&bad, bb, &t).unwrap_err(),
            ConvertError::RunLength {
                index: 5,
                len: bb - 16,
                block_bytes: bb
            }
        );
        let len = 2 * 300 * bb + bb;
        for (edit, packs) in [
            (None, true),
            (Some((7usize, 65_536u32, None)), false),
            (Some((9, 40, Some(16u64))), false),
        ] {
            let mut v = runs.clone();
            if let Some((i, id, off)) = edit {
                v[i].src_block = id;
                v[i].src_offset = u64::from(id) * bb + off.unwrap_or(0);
            }
            let end = v.iter().map(|r| r.src_offset + r.len).max().unwrap();
            let plan = ConvertPlan::from_runs_tuned(&v, bb, end.max(len), len, &t).unwrap();
            let direct = RunsGather::new(&v, bb, &t).unwrap().unwrap();
            assert_eq!(direct.packed().is_some(), packs, "{edit:?}");
            assert_eq!(direct.packed(), plan.packed(), "{edit:?}");
        }
        let scratch: Vec<u32> = Vec::with_capacity(4096);
        let ptr = scratch.as_ptr();
        let g = RunsGather::with_words(&runs, bb, &t, scratch)
            .unwrap()
            .unwrap();
        assert_eq!(g.packed().unwrap().words[3], 7 << 16 | 3);
        let words = g.into_words();
        assert_eq!((words.as_ptr(), words.len()), (ptr, 300));
        // The next fetch clears and refills it.
        let g = RunsGather::with_words(&runs[..200], bb, &t, words)
            .unwrap()
            .unwrap();
        assert_eq!(g.packed().unwrap().words.len(), 200);
        let words = g.into_words();
        assert_eq!(words.as_ptr(), ptr);
    }

    #[test]
    fn large_fetches_and_bad_runs_are_left_to_the_plan() {
        let run = |i: u32, len| CopyRun {
            src_block: i,
            dst_block: i,
            blocks: 1,
            src_offset: u64::from(i) * 64,
            dst_offset: u64::from(i) * 64,
            len,
        };
        let t = GatherTuning::default();
        let big: Vec<CopyRun> = (0..8129).map(|i| run(i, 64)).collect();
        assert!(RunsGather::new(&big, 64, &t).unwrap().is_none());
        assert!(RunsGather::new(&big[..8128], 64, &t).unwrap().is_some());
        assert_eq!(
            RunsGather::new(&[run(0, 64), run(1, 63)], 64, &t).unwrap_err(),
            ConvertError::RunLength {
                index: 1,
                len: 63,
                block_bytes: 64
            }
        );
        assert_eq!(
            RunsGather::new(&[], 64, &t).unwrap_err(),
            ConvertError::Empty
        );
    }
}
