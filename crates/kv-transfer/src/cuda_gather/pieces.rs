//! [`PieceTable`]: how one block is cut into equal contiguous pieces, donor
//! and target offsets of each, built from the two region layouts (whole,
//! or one range of layers for a layer-group launch) and split for the
//! launch. Every offset comes from [`KvRegionLayout::run_offset`], so host
//! and GPU index the same bytes.

use kv_descriptor::KvRegionLayout;

use super::{ConvertError, MAX_PIECES, MIN_SPLIT_PIECE_BYTES, MIN_WORK_ITEMS};

/// Byte offsets of the pieces of one block: `src[k]` within a donor block,
/// `dst[k]` within a target block, each `piece_bytes` long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceTable {
    /// Length of every piece in bytes (> 0).
    pub piece_bytes: u64,
    /// Donor-block-relative offset of each piece, bytes.
    pub src: Vec<u64>,
    /// Target-block-relative offset of each piece, bytes.
    pub dst: Vec<u64>,
}

/// One dimension of a layer's tensor: extent and element strides on both sides.
#[derive(Debug, Clone, Copy)]
struct Dim {
    n: u64,
    src: u64,
    dst: u64,
}

impl PieceTable {
    /// A block that is `block_bytes` contiguous bytes on both sides (block-major
    /// rows of a [`crate::plan::TransferPlan`]), as one piece.
    pub fn contiguous(block_bytes: u64) -> Self {
        Self {
            piece_bytes: block_bytes,
            src: vec![0],
            dst: vec![0],
        }
    }

    /// Pieces of one block moved from `donor`'s order to `target`'s.
    ///
    /// Dimensions (head_dim, head, token, K/V, then layers) that are
    /// contiguous in both layouts are merged, innermost first; the rest are
    /// enumerated, and each piece's offsets come from
    /// [`KvRegionLayout::run_offset`] of block 0 (plus the head_dim index when
    /// head_dim itself is strided), so host and GPU index the same bytes.
    ///
    /// # Errors
    /// [`ConvertError::Layout`] when [`KvRegionLayout::check_compatible`]
    /// refuses the pair; [`ConvertError::TooLarge`] past [`MAX_PIECES`].
    pub fn convert(donor: &KvRegionLayout, target: &KvRegionLayout) -> Result<Self, ConvertError> {
        Self::convert_layers(donor, target, 0..donor.layer_offsets().len() as u32)
    }

    /// [`PieceTable::convert`] restricted to model layers `layers` (end
    /// exclusive, within the geometry): the pieces of those layers only,
    /// in the same order, so the tables of consecutive ranges concatenated
    /// are the whole table's pieces (up to layer merging). A launch per
    /// range delivers a block layer group by layer group
    /// ([`crate::ConsumerStream::with_layer_groups`]).
    ///
    /// # Errors
    /// As [`PieceTable::convert`]; [`ConvertError::TooLarge`] naming
    /// `layers` for an empty range or one past the geometry's layers.
    pub(crate) fn convert_layers(
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        layer_range: std::ops::Range<u32>,
    ) -> Result<Self, ConvertError> {
        donor.check_compatible(target)?;
        let all = donor.layer_offsets().len() as u32;
        if layer_range.is_empty() || layer_range.end > all {
            return Err(ConvertError::TooLarge {
                field: "layers",
                got: u64::from(layer_range.end),
                limit: u64::from(all),
            });
        }
        let g = donor.geometry();
        let elem = g.dtype().size_bytes() as u64;
        let (s, t) = (donor.strides(), target.strides());
        // Innermost first: head_dim, head, token, K/V.
        let mut dims = [
            Dim {
                n: u64::from(g.head_dim()),
                src: s.dim,
                dst: t.dim,
            },
            Dim {
                n: u64::from(g.heads_per_rank()),
                src: s.head,
                dst: t.head,
            },
            Dim {
                n: u64::from(g.tokens_per_block()),
                src: s.token,
                dst: t.token,
            },
            Dim {
                n: 2,
                src: s.kv,
                dst: t.kv,
            },
        ];
        // `merged[k]`: dimension k lies inside the contiguous piece.
        let mut merged = [false; 4];
        let mut run = 1u64; // elements
        loop {
            let hit = (0..4).find(|&k| {
                !merged[k] && (dims[k].n == 1 || (dims[k].src == run && dims[k].dst == run))
            });
            let Some(k) = hit else { break };
            merged[k] = true;
            run *= dims[k].n;
        }
        let (first, layers) = (
            layer_range.start as usize,
            (layer_range.end - layer_range.start) as usize,
        );
        // Whole layers merge too when both sides place them back to back
        // (block-major -> block-major: the block is one piece).
        let layer_merge = merged.iter().all(|&m| m)
            && [donor.layer_offsets(), target.layer_offsets()]
                .iter()
                .all(|o| (0..layers).all(|l| o[first + l] == o[first] + l as u64 * run * elem));
        let piece_bytes = run * elem * if layer_merge { layers as u64 } else { 1 };
        for (k, m) in merged.iter().enumerate() {
            if *m {
                dims[k].n = 1;
            }
        }
        let per_layer: u64 = dims.iter().map(|d| d.n).product();
        let count = per_layer * if layer_merge { 1 } else { layers as u64 };
        if count > MAX_PIECES as u64 {
            return Err(ConvertError::TooLarge {
                field: "region.strides",
                got: count,
                limit: MAX_PIECES as u64,
            });
        }
        let mut table = Self {
            piece_bytes,
            src: Vec::with_capacity(count as usize),
            dst: Vec::with_capacity(count as usize),
        };
        let offset = |r: &KvRegionLayout, l: u32, kv: u64, tok: u64, h: u64, d: u64, sd: u64| {
            r.run_offset(l, 0, kv as u32, tok as u32, h as u32)
                .expect("indices below the geometry's extents")
                + d * sd * elem
        };
        let last = if layer_merge {
            layer_range.start + 1
        } else {
            layer_range.end
        };
        for l in layer_range.start..last {
            for kv in 0..dims[3].n {
                for tok in 0..dims[2].n {
                    for h in 0..dims[1].n {
                        for d in 0..dims[0].n {
                            table.src.push(offset(donor, l, kv, tok, h, d, s.dim));
                            table.dst.push(offset(target, l, kv, tok, h, d, t.dim));
                        }
                    }
                }
            }
        }
        Ok(table)
    }

    /// Pieces in the table.
    pub fn len(&self) -> usize {
        self.src.len()
    }

    /// True when the table has no piece (never for a built table).
    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }

    /// The same bytes cut into `2^k` times more pieces, halving while a piece
    /// is longer than [`MAX_PIECE_BYTES`], or while the fetch of `blocks`
    /// blocks has fewer than 1024 work items and pieces are at least 8 KiB;
    /// a half must keep the piece's alignment (a multiple of 16 stays one).
    pub(super) fn split_for(&self, blocks: u64, max_piece_bytes: u64) -> Self {
        let mut t = self.clone();
        loop {
            let b = t.piece_bytes;
            let small_fetch =
                blocks * (t.len() as u64) < MIN_WORK_ITEMS && b >= 2 * MIN_SPLIT_PIECE_BYTES;
            let align = 1u64 << b.trailing_zeros().min(4);
            let halvable = b % 2 == 0 && (b / 2) % align == 0;
            if !(halvable && (b > max_piece_bytes || small_fetch)) {
                return t;
            }
            let h = b / 2;
            let (src, dst) = t
                .src
                .iter()
                .zip(&t.dst)
                .flat_map(|(&s, &d)| [(s, d), (s + h, d + h)])
                .unzip();
            t = Self {
                piece_bytes: h,
                src,
                dst,
            };
        }
    }
}
