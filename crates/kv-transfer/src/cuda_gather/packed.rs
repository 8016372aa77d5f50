//! Packed block ids: the compact block table of the `kv_convert_p*` entry
//! points ([`super::TablePlacement::InlinePacked`]), one u32 per block.
//!
//! A fetch of 129..=8,128 blocks does not fit the small u64 inline table,
//! and a u64 table of 16 bytes a block in a large parameter slows the
//! kernel, but block ids of one region below 65,536 with one stride per
//! side fit 4 bytes a block: `donor id << 16 | target id`, the kernel
//! forming `base + id x stride`, sent in the smallest of the 4 / 8 / 16 /
//! 32 KiB parameter tiers that holds them. Built only for fetch sizes where
//! it is used, so fetches of up to 128 blocks pay nothing.

use crate::plan::CopyRun;

use super::{INLINE_PACKED_BLOCKS, INLINE_SMALL_BLOCKS, PACKED_MAX_BLOCK_ID};

/// Packed ids of one plan: block `i` starts at `src_stride x (words[i] >>
/// 16)` in the donor region and `dst_stride x (words[i] & 0xFFFF)` in the
/// target region (bytes from the region's first byte).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedIds {
    /// Donor block stride, bytes.
    pub src_stride: u64,
    /// Target block stride, bytes.
    pub dst_stride: u64,
    /// `donor id << 16 | target id`, one per block.
    pub words: Vec<u32>,
}

/// Packed ids as a launch reads them (borrowed from a plan's [`PackedIds`],
/// a [`super::RunsGather`]'s, or a slice of a `deliver` part's
/// [`super::PackedRows`]): block `i` at `src_stride x (words[i] >> 16)` and
/// `dst_stride x (words[i] & 0xFFFF)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedRef<'a> {
    /// Donor block stride, bytes.
    pub src_stride: u64,
    /// Target block stride, bytes.
    pub dst_stride: u64,
    /// `donor id << 16 | target id`, one per block.
    pub words: &'a [u32],
}

impl PackedRef<'_> {
    /// The device table of these ids (no inline module, or past the packed
    /// tiers): `n` donor block addresses, then `n` target block addresses,
    /// for regions at `src_base` / `dst_base`, into `out[..2n]`; the
    /// addresses the packed entry points would form.
    ///
    /// # Panics
    /// When `out` is shorter than `2n` (a caller bug).
    pub fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]) {
        let n = self.words.len();
        let (s, d) = out[..2 * n].split_at_mut(n);
        for ((os, od), w) in s.iter_mut().zip(d.iter_mut()).zip(self.words) {
            *os = src_base + u64::from(w >> 16) * self.src_stride;
            *od = dst_base + u64::from(w & 0xFFFF) * self.dst_stride;
        }
    }
}

/// `(donor, target)` block strides of a part of single-row runs: the first
/// row past id 0 on each side gives it (`block_bytes` when there is none);
/// every row must then be checked against it.
pub(super) fn single_row_strides(runs: &[CopyRun], block_bytes: u64) -> (u64, u64) {
    let pick = |id: fn(&CopyRun) -> (u32, u64)| {
        runs.iter()
            .map(id)
            .find(|&(b, _)| b > 0)
            .map_or(block_bytes, |(b, off)| off / u64::from(b))
    };
    (
        pick(|r| (r.src_block, r.src_offset)),
        pick(|r| (r.dst_block, r.dst_offset)),
    )
}

/// True when a fetch of `n` blocks would use the packed table.
fn wanted(n: usize) -> bool {
    n > INLINE_SMALL_BLOCKS && n <= INLINE_PACKED_BLOCKS
}

impl PackedIds {
    /// Packed ids of `moves` (`(donor id, target id)`, already range
    /// checked) over regions of the given block strides; `None` when the
    /// fetch size does not use the packed table or an id exceeds 16 bits.
    pub(super) fn of_moves(moves: &[(u32, u32)], src_stride: u64, dst_stride: u64) -> Option<Self> {
        if !wanted(moves.len()) || moves.iter().any(|&(s, d)| s.max(d) > PACKED_MAX_BLOCK_ID) {
            return None;
        }
        Some(Self {
            src_stride,
            dst_stride,
            words: moves.iter().map(|&(s, d)| s << 16 | d).collect(),
        })
    }

    /// Packed ids of a `TransferPlan` part's rows: each run starts at
    /// `id x stride` on both sides (one stride per side; runs of several
    /// rows only over `block_bytes` strides); `None` otherwise, when the
    /// fetch size does not use the packed table, or an id exceeds 16 bits.
    /// `n` is the rows in all runs, `multi` whether a run has several.
    pub(super) fn of_runs(
        runs: &[CopyRun],
        block_bytes: u64,
        n: usize,
        multi: bool,
    ) -> Option<Self> {
        if !wanted(n) {
            return None;
        }
        // Rows of several blocks only exist over dense (`block_bytes`)
        // strides; otherwise the first row past id 0 gives the stride, and
        // every row is checked against it in the one pass below.
        let (src_stride, dst_stride) = if multi {
            (block_bytes, block_bytes)
        } else {
            single_row_strides(runs, block_bytes)
        };
        let max = u64::from(PACKED_MAX_BLOCK_ID);
        if !multi {
            // Scattered parts (every row its own run, the common case): one
            // branch-free pass into an exactly sized Vec, the checks folded
            // into one flag, instead of a test and a push per run (4096
            // runs: 11.6 -> see cpu/plan_build rows).
            let mut bad = false;
            let words = runs
                .iter()
                .map(|r| {
                    let (s, d) = (u64::from(r.src_block), u64::from(r.dst_block));
                    bad |= (s * src_stride != r.src_offset)
                        | (d * dst_stride != r.dst_offset)
                        | (s.max(d) > max)
                        | (r.blocks != 1);
                    r.src_block << 16 | (r.dst_block & 0xFFFF)
                })
                .collect();
            if !bad {
                return Some(Self {
                    src_stride,
                    dst_stride,
                    words,
                });
            }
            // Refused (or an empty run): the loop below decides.
        }
        let mut words = Vec::with_capacity(n);
        for r in runs {
            let (s, d, k) = (
                u64::from(r.src_block),
                u64::from(r.dst_block),
                u64::from(r.blocks.max(1)),
            );
            if s * src_stride != r.src_offset
                || d * dst_stride != r.dst_offset
                || s + k - 1 > max
                || d + k - 1 > max
            {
                return None;
            }
            if r.blocks == 1 {
                words.push(r.src_block << 16 | r.dst_block);
            } else {
                words.extend((0..r.blocks).map(|k| (r.src_block + k) << 16 | (r.dst_block + k)));
            }
        }
        Some(Self {
            src_stride,
            dst_stride,
            words,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(s: u32, d: u32, blocks: u32, ss: u64, ds: u64, bb: u64) -> CopyRun {
        CopyRun {
            src_block: s,
            dst_block: d,
            blocks,
            src_offset: u64::from(s) * ss,
            dst_offset: u64::from(d) * ds,
            len: u64::from(blocks) * bb,
        }
    }

    #[test]
    fn runs_pack_with_their_strides_or_not_at_all() {
        let bb = 16 << 10;
        // 4096 single-block runs over a padded donor (stride 20 KiB).
        let runs: Vec<CopyRun> = (0..4096)
            .map(|i| run(2 * i + 1, i, 1, 20 << 10, bb, bb))
            .collect();
        let p = PackedIds::of_runs(&runs, bb, 4096, false).unwrap();
        assert_eq!((p.src_stride, p.dst_stride), (20 << 10, bb));
        assert_eq!(p.words[3], 7 << 16 | 3);
        assert_eq!(p.words.len(), 4096);
        // Multi-block runs: consecutive ids.
        let runs = [run(10, 0, 3000, bb, bb, bb)];
        let p = PackedIds::of_runs(&runs, bb, 3000, true).unwrap();
        assert_eq!(p.words[2999], 3009 << 16 | 2999);
        // Too few blocks to need it, ids past 16 bits, a non-uniform offset.
        assert!(PackedIds::of_runs(&runs[..], bb, 128, true).is_none());
        assert!(PackedIds::of_runs(&runs[..], bb, 129, true).is_some());
        let far = [run(65_000, 0, 3000, bb, bb, bb)];
        assert!(PackedIds::of_runs(&far, bb, 3000, true).is_none());
        let mut odd: Vec<CopyRun> = (0..3000).map(|i| run(i, i, 1, bb, bb, bb)).collect();
        odd[7].src_offset += 16;
        assert!(PackedIds::of_runs(&odd, bb, 3000, false).is_none());
    }

    #[test]
    fn moves_pack_below_16_bit_ids() {
        let moves: Vec<(u32, u32)> = (0..3000).map(|i| (i + 7, 2999 - i)).collect();
        let p = PackedIds::of_moves(&moves, 64, 128).unwrap();
        assert_eq!(p.words[0], 7 << 16 | 2999);
        assert!(PackedIds::of_moves(&moves[..100], 64, 128).is_none());
        let mut far = moves.clone();
        far[5].1 = 70_000;
        assert!(PackedIds::of_moves(&far, 64, 128).is_none());
    }
}
