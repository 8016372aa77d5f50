//! [`ConvertShape`]: what a converting gather between two region layouts
//! costs the host once, so that each fetch only checks and places its blocks.
//!
//! Building the piece table walks every piece of a block through
//! [`KvRegionLayout::run_offset`] (8,192 pieces for an 8B block landing in an
//! HF cache); the H200 qualification measured 53.6 µs of host plan per HF
//! fetch. A shape does that walk, the split to the launch's piece size and
//! the OR of the piece offsets once; [`ConvertShape::plan`] is then O(moves).

use std::sync::Arc;

use kv_descriptor::KvRegionLayout;

use super::{
    Blocks, ConvertError, ConvertPlan, GatherTuning, PackedIds, PieceTable, MAX_WORK_ITEMS,
    MIN_SPLIT_PIECE_BYTES, MIN_WORK_ITEMS,
};

/// The donor / target layout pair of converting gathers, with its piece table
/// built and split once. Plans of one shape share the piece table (an
/// [`Arc`]), so the device copy of it is recognised by pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertShape {
    donor: KvRegionLayout,
    target: KvRegionLayout,
    tuning: GatherTuning,
    /// Pieces before splitting (work item count limit).
    base_pieces: u64,
    /// Pieces split to `tuning.max_piece_bytes()`: the table of every fetch
    /// with at least [`MIN_WORK_ITEMS`] work items.
    split: Arc<PieceTable>,
    /// OR of `split`'s piece length and offsets.
    split_bits: u64,
}

impl ConvertShape {
    /// The shape of gathers from `donor`'s order to `target`'s, pieces split
    /// to `tuning.max_piece_bytes()`.
    ///
    /// # Errors
    /// [`ConvertError::Layout`] when [`KvRegionLayout::check_compatible`]
    /// refuses the pair; [`ConvertError::TooLarge`] naming `region.strides`
    /// past [`super::MAX_PIECES`].
    pub fn new(
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        tuning: &GatherTuning,
    ) -> Result<Self, ConvertError> {
        let base = PieceTable::convert(donor, target)?;
        let base_pieces = base.len() as u64;
        // Split as for a fetch large enough that only the length cap splits.
        let split = base.split_for(MIN_WORK_ITEMS, tuning.max_piece_bytes());
        let split_bits = bits(&split);
        Ok(Self {
            donor: donor.clone(),
            target: target.clone(),
            tuning: *tuning,
            base_pieces,
            split: Arc::new(split),
            split_bits,
        })
    }

    /// Donor layout.
    pub fn donor(&self) -> &KvRegionLayout {
        &self.donor
    }
    /// Target layout.
    pub fn target(&self) -> &KvRegionLayout {
        &self.target
    }
    /// Tuning the pieces were split with.
    pub fn tuning(&self) -> &GatherTuning {
        &self.tuning
    }

    /// True when this shape is `donor` -> `target` split with `tuning`.
    pub fn is(&self, donor: &KvRegionLayout, target: &KvRegionLayout, t: &GatherTuning) -> bool {
        self.tuning.max_piece_bytes() == t.max_piece_bytes()
            && self.donor == *donor
            && self.target == *target
    }

    /// The plan moving donor block `moves[i].0` to target block `moves[i].1`:
    /// the same plan as [`ConvertPlan::new_tuned`] of this shape's layouts
    /// and tuning, without rebuilding the piece table.
    ///
    /// # Errors
    /// [`ConvertError::Empty`], [`ConvertError::BlockOutOfRange`] naming
    /// `moves.src_block` / `moves.dst_block` (the first bad move),
    /// [`ConvertError::DuplicateTarget`] (the first repeated target),
    /// [`ConvertError::TooLarge`] naming `moves`.
    pub fn plan(&self, moves: &[(u32, u32)]) -> Result<ConvertPlan, ConvertError> {
        if moves.is_empty() {
            return Err(ConvertError::Empty);
        }
        check_moves(&self.donor, &self.target, moves)?;
        let n = moves.len() as u64;
        let items = n * self.base_pieces;
        if items > MAX_WORK_ITEMS {
            return Err(ConvertError::TooLarge {
                field: "moves",
                got: items,
                limit: MAX_WORK_ITEMS,
            });
        }
        let elem = self.donor.dtype().size_bytes() as u64;
        let (sb, db) = (
            self.donor.strides().block * elem,
            self.target.strides().block * elem,
        );
        let (blocks, block_bits) = match PackedIds::of_moves(moves, sb, db) {
            Some(p) => (Blocks::Packed(p), sb | db),
            None => {
                let mut or = 0u64;
                let (mut src, mut dst) = (Vec::with_capacity(moves.len()), Vec::new());
                dst.reserve_exact(moves.len());
                for &(s, d) in moves {
                    let (so, dso) = (u64::from(s) * sb, u64::from(d) * db);
                    or |= so | dso;
                    src.push(so);
                    dst.push(dso);
                }
                (Blocks::Offsets { src, dst }, or)
            }
        };
        // A small fetch is split further so it still spreads over SMs; the
        // same halvings `split_for` of the unsplit table would make.
        let small = n * (self.split.len() as u64) < MIN_WORK_ITEMS
            && self.split.piece_bytes >= 2 * MIN_SPLIT_PIECE_BYTES;
        let (pieces, piece_bits) = if small {
            let t = self.split.split_for(n, self.tuning.max_piece_bytes());
            let b = bits(&t);
            (Arc::new(t), b)
        } else {
            (self.split.clone(), self.split_bits)
        };
        Ok(ConvertPlan {
            pieces,
            blocks,
            src_region_bytes: self.donor.region_bytes(),
            dst_region_bytes: self.target.region_bytes(),
            offset_bits: block_bits | piece_bits,
        })
    }
}

/// OR of a piece table's piece length and every offset.
fn bits(t: &PieceTable) -> u64 {
    t.src.iter().chain(&t.dst).fold(t.piece_bytes, |a, b| a | b)
}

/// The first refused move, in move order: a block id out of range (donor
/// before target) or a target written a second time, as
/// [`ConvertPlan::new`] reports them. Duplicates are found by sorting
/// `(target, index)` keys, O(n log n) with no hashing.
fn check_moves(
    donor: &KvRegionLayout,
    target: &KvRegionLayout,
    moves: &[(u32, u32)],
) -> Result<(), ConvertError> {
    let (sl, dl) = (donor.num_blocks(), target.num_blocks());
    let range = moves
        .iter()
        .position(|&(s, d)| s >= sl || d >= dl)
        .map(|index| {
            let (s, d) = moves[index];
            let (field, block, limit) = if s >= sl {
                ("moves.src_block", s, sl)
            } else {
                ("moves.dst_block", d, dl)
            };
            ConvertError::BlockOutOfRange {
                field,
                index,
                block,
                limit,
            }
        });
    let mut keys: Vec<u64> = moves
        .iter()
        .enumerate()
        .map(|(i, &(_, d))| u64::from(d) << 32 | i as u64)
        .collect();
    keys.sort_unstable();
    // Within a run of equal targets the second key is the second write.
    let dup = keys
        .windows(2)
        .filter(|w| w[0] >> 32 == w[1] >> 32)
        .map(|w| w[1] as u32 as usize)
        .min();
    match (range, dup) {
        (Some(ConvertError::BlockOutOfRange { index, .. }), Some(j)) if j < index => {
            Err(ConvertError::DuplicateTarget {
                index: j,
                block: moves[j].1,
            })
        }
        (Some(e), _) => Err(e),
        (None, Some(j)) => Err(ConvertError::DuplicateTarget {
            index: j,
            block: moves[j].1,
        }),
        (None, None) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_descriptor::{DType, KvLayout, TensorOrder};

    fn layouts() -> (KvRegionLayout, KvRegionLayout) {
        let g = KvLayout::new(4, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
        let bb = g.rank_block_bytes() as u64;
        let donor = KvRegionLayout::block_major(g, 0, 0, 64, 64 * bb).unwrap();
        let max_tokens = 48 + 32 * 16;
        let layer = 2 * 8 * max_tokens * 128 * 2;
        let hf =
            KvRegionLayout::hf_tokens(g, 0, 0, layer, 1, 0, max_tokens, 48, 32, 4 * layer).unwrap();
        (donor, hf)
    }

    /// The plan `checked` builds from the unsplit table (the generic path
    /// `from_runs` also takes), with block offsets computed here.
    fn reference_plan(
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        moves: &[(u32, u32)],
        tuning: &GatherTuning,
    ) -> ConvertPlan {
        let e = donor.dtype().size_bytes() as u64;
        let (sb, db) = (donor.strides().block * e, target.strides().block * e);
        ConvertPlan::checked(
            PieceTable::convert(donor, target).unwrap(),
            Blocks::Offsets {
                src: moves.iter().map(|m| u64::from(m.0) * sb).collect(),
                dst: moves.iter().map(|m| u64::from(m.1) * db).collect(),
            },
            donor.region_bytes(),
            target.region_bytes(),
            tuning,
        )
        .unwrap()
    }

    #[test]
    fn shape_plans_equal_plans_split_from_scratch_and_share_the_piece_table() {
        let (donor, hf) = layouts();
        for tuning in [
            GatherTuning::default(),
            GatherTuning::new(128, 4, 16 << 10).unwrap(),
            GatherTuning::new(256, 8, 1 << 10).unwrap(),
        ] {
            for target in [&donor, &hf] {
                let shape = ConvertShape::new(&donor, target, &tuning).unwrap();
                // 1 and 7 blocks: small fetches, split further than the cap.
                for moves in [
                    vec![(3, 0)],
                    (0..7).map(|i| (2 * i + 1, i)).collect::<Vec<_>>(),
                    (0..32).map(|i| (63 - 2 * i, 31 - i)).collect(),
                ] {
                    let want = reference_plan(&donor, target, &moves, &tuning);
                    assert_eq!(shape.plan(&moves).unwrap(), want, "{} moves", moves.len());
                    let new = ConvertPlan::new_tuned(&donor, target, &moves, &tuning).unwrap();
                    assert_eq!(new, want);
                }
                // HF pieces (256 B) are never split further: every fetch of
                // the shape shares its table (a small block-major fetch may
                // be split further and get its own).
                let a = shape.plan(&(0..32).map(|i| (i, i)).collect::<Vec<_>>());
                let b = shape.plan(&(0..32).map(|i| (i + 1, i)).collect::<Vec<_>>());
                let shared = Arc::ptr_eq(a.unwrap().pieces_arc(), b.unwrap().pieces_arc());
                assert!(shared || !std::ptr::eq(target, &hf));
            }
        }
    }

    #[test]
    fn refusals_name_the_first_bad_move() {
        let (donor, hf) = layouts();
        let shape = ConvertShape::new(&donor, &hf, &GatherTuning::default()).unwrap();
        let range = |field, index, block, limit| ConvertError::BlockOutOfRange {
            field,
            index,
            block,
            limit,
        };
        let dup = |index, block| ConvertError::DuplicateTarget { index, block };
        for (moves, want) in [
            (vec![], ConvertError::Empty),
            (vec![(64, 0)], range("moves.src_block", 0, 64, 64)),
            (vec![(0, 32)], range("moves.dst_block", 0, 32, 32)),
            (vec![(64, 40)], range("moves.src_block", 0, 64, 64)),
            (vec![(0, 1), (2, 1)], dup(1, 1)),
            (vec![(0, 1), (2, 1), (64, 0)], dup(1, 1)),
            (
                vec![(0, 1), (64, 0), (2, 1)],
                range("moves.src_block", 1, 64, 64),
            ),
            (vec![(5, 3), (6, 4), (7, 3), (8, 4)], dup(2, 3)),
            (vec![(5, 4), (6, 3), (7, 3), (8, 4)], dup(2, 3)),
            (vec![(0, 40), (1, 40)], range("moves.dst_block", 0, 40, 32)),
        ] {
            assert_eq!(shape.plan(&moves).unwrap_err(), want, "{moves:?}");
            let fresh = ConvertPlan::new(&donor, &hf, &moves).unwrap_err();
            assert_eq!(fresh, want, "{moves:?}");
        }
    }
}

/// A [`ConvertShape`] cut into layer groups ([`crate::layer_group_ranges`]):
/// one piece table per group, built once, so a fetch released layer group
/// by layer group ([`crate::ConsumerStream::with_layer_groups`]) launches
/// one plan per group without walking the layouts again.
///
/// Invariant: the groups' tables together hold exactly the bytes of the
/// whole shape's table (every layer in one group, groups in layer order).
#[derive(Debug)]
pub struct LayeredShape {
    whole: Arc<ConvertShape>,
    groups: Vec<(std::ops::Range<u32>, Arc<PieceTable>, u64)>,
}

impl LayeredShape {
    /// `whole` cut into `layer_group_ranges(layers, groups)`.
    ///
    /// # Errors
    /// As [`ConvertShape::new`] (never for a shape `new` accepted).
    pub fn new(whole: Arc<ConvertShape>, groups: u32) -> Result<Self, ConvertError> {
        let layers = whole.donor.layer_offsets().len() as u32;
        let groups = crate::control::layer_group_ranges(layers, groups)
            .into_iter()
            .map(|r| {
                let t = PieceTable::convert_layers(&whole.donor, &whole.target, r.clone())?
                    .split_for(MIN_WORK_ITEMS, whole.tuning.max_piece_bytes());
                let b = bits(&t);
                Ok((r, Arc::new(t), b))
            })
            .collect::<Result<Vec<_>, ConvertError>>()?;
        Ok(Self { whole, groups })
    }

    /// The whole shape this one cuts.
    pub fn whole(&self) -> &Arc<ConvertShape> {
        &self.whole
    }

    /// Layer groups (end exclusive), in layer order.
    pub fn ranges(&self) -> impl Iterator<Item = std::ops::Range<u32>> + '_ {
        self.groups.iter().map(|g| g.0.clone())
    }

    /// One plan per layer group for `moves`, in layer order: the blocks of
    /// [`ConvertShape::plan`]`(moves)` (checked once), each with its group's
    /// pieces (split further for a small fetch, as `plan` splits).
    ///
    /// # Errors
    /// As [`ConvertShape::plan`].
    pub fn plans(
        &self,
        moves: &[(u32, u32)],
    ) -> Result<Vec<(std::ops::Range<u32>, ConvertPlan)>, ConvertError> {
        let whole = self.whole.plan(moves)?;
        let n = moves.len() as u64;
        let block_bits = whole.blocks.bits();
        Ok(self
            .groups
            .iter()
            .map(|(r, t, b)| {
                let small = n * (t.len() as u64) < MIN_WORK_ITEMS
                    && t.piece_bytes >= 2 * MIN_SPLIT_PIECE_BYTES;
                let (pieces, piece_bits) = if small {
                    let t = t.split_for(n, self.whole.tuning.max_piece_bytes());
                    let b = bits(&t);
                    (Arc::new(t), b)
                } else {
                    (t.clone(), *b)
                };
                let plan = ConvertPlan {
                    pieces,
                    blocks: whole.blocks.clone(),
                    src_region_bytes: whole.src_region_bytes,
                    dst_region_bytes: whole.dst_region_bytes,
                    offset_bits: block_bits | piece_bits,
                };
                (r.clone(), plan)
            })
            .collect())
    }
}
