//! What a launch reads from a plan ([`BlockSource`]), and [`RunsGather`]:
//! the block-major rows of a `deliver` part launched straight from the
//! part's runs, without building a [`ConvertPlan`].
//!
//! For a fetch of up to [`INLINE_LARGE_BLOCKS`] blocks (small inline table
//! or device table), building a plan only to copy its offset vectors into
//! the parameter image or staging buffer costs two allocations and three
//! passes (4.6 µs on the H200's host for 1024 blocks). [`RunsGather`] makes one
//! pass over the runs to check them, and the launch writes the table from
//! the runs directly: the same table, geometry and bytes as
//! [`ConvertPlan::from_runs_tuned`] (checked by the tests below and the
//! kernel mirror).

use std::sync::Arc;

use crate::plan::CopyRun;

use super::{
    launch_geometry, ConvertError, ConvertPlan, GatherTuning, LaunchGeometry, PackedIds,
    PieceTable, INLINE_LARGE_BLOCKS,
};

/// The blocks and pieces one launch of the converting gather reads.
pub trait BlockSource {
    /// Blocks moved (`n`).
    fn blocks(&self) -> usize;
    /// How each block is cut.
    fn pieces_arc(&self) -> &Arc<PieceTable>;
    /// Packed 16-bit ids, when the source has them.
    fn packed(&self) -> Option<&PackedIds>;
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
    fn packed(&self) -> Option<&PackedIds> {
        ConvertPlan::packed(self)
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
}

impl<'a> RunsGather<'a> {
    /// The rows of `runs`, pieces split as [`ConvertPlan::from_runs_tuned`]
    /// splits them; `None` when the fetch has more than
    /// [`INLINE_LARGE_BLOCKS`] blocks (then build the plan: it packs ids).
    ///
    /// # Errors
    /// [`ConvertError::Empty`], [`ConvertError::RunLength`] (for fetches
    /// this returns `None` for, the plan reports bad runs).
    pub fn new(
        runs: &'a [CopyRun],
        block_bytes: u64,
        tuning: &GatherTuning,
    ) -> Result<Option<Self>, ConvertError> {
        if runs.is_empty() || block_bytes == 0 {
            return Err(ConvertError::Empty);
        }
        // Every run has at least one row: more runs than the table holds
        // decide without a pass (the plan's own pass checks them).
        if runs.len() > INLINE_LARGE_BLOCKS {
            return Ok(None);
        }
        let (mut n, mut bits) = (0usize, 0u64);
        for (index, r) in runs.iter().enumerate() {
            if r.len != u64::from(r.blocks) * block_bytes {
                return Err(ConvertError::RunLength {
                    index,
                    len: r.len,
                    block_bytes,
                });
            }
            n += r.blocks as usize;
            bits |= r.src_offset | r.dst_offset;
            if r.blocks > 1 {
                bits |= block_bytes;
            }
        }
        if n > INLINE_LARGE_BLOCKS {
            return Ok(None);
        }
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
        }))
    }

    /// Payload bytes moved.
    pub fn bytes(&self) -> u64 {
        self.n as u64 * self.block_bytes
    }
}

impl BlockSource for RunsGather<'_> {
    fn blocks(&self) -> usize {
        self.n
    }
    fn pieces_arc(&self) -> &Arc<PieceTable> {
        &self.pieces
    }
    fn packed(&self) -> Option<&PackedIds> {
        None
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
        let big: Vec<CopyRun> = (0..2033).map(|i| run(i, 64)).collect();
        assert!(RunsGather::new(&big, 64, &t).unwrap().is_none());
        assert!(RunsGather::new(&big[..2032], 64, &t).unwrap().is_some());
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
