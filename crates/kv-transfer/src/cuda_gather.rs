//! The converting gather kernel: its CUDA C source, the tables it reads,
//! its launch geometry, and (in `cuda_gather/mirror.rs`, tests only) a
//! pure-Rust mirror of its per-thread index math.
//!
//! One launch per rank per fetch moves every fetched KV block from the donor
//! region to the target region and converts the memory order on the way:
//! each block is cut into *pieces*, the longest byte ranges that are
//! contiguous in both the donor's and the target's [`KvRegionLayout`] (a
//! whole block for block-major -> block-major, one `[block_size, heads,
//! head_dim]` slab per layer and K/V for vLLM per-layer, one `head_dim` row
//! for HF `[.., heads, tokens, head_dim]`). Piece offsets are the same for
//! every block, so the kernel reads two small tables:
//! - block table, `2n` u64: donor block base addresses, then target block
//!   base addresses (absolute device addresses);
//! - piece table, `2P` u64: piece offsets within a donor block, then within a
//!   target block (bytes, from [`KvRegionLayout::run_offset`] of block 0).
//!
//! Work item `r in 0..n*P` is block `r / P`, piece `r % P`. Threads form
//! groups of `G = 2^group_shift` lanes; a group copies one work item at a
//! time (lane `l` takes elements `l, l+G, ..`, four loads in flight before
//! the four stores) and strides over items by the number of groups in the
//! grid. Loads go through the read-only path (`__ldg`: the donor blocks are
//! pinned, nothing writes them during the fetch) and stores are `__stcg`
//! (L2 only), both global-space accesses rather than generic ones. The element width (16, 8, 4, 2 or 1 bytes) is the largest that
//! divides every address, offset and the piece length; it is chosen on the
//! host, so the kernel has no per-element alignment branch.
//!
//! Nothing here calls CUDA: `cuda.rs` compiles [`CONVERT_KERNEL_SRC`] with
//! NVRTC and launches the kernel that [`LaunchGeometry::kernel_name`] names.

use std::sync::Arc;

use kv_descriptor::{KvRegionLayout, RegionLayoutError};

use crate::plan::CopyRun;

#[cfg(test)]
mod mirror;

mod packed;
mod pieces;
mod reference;
mod rows;
mod runs;
mod shape;
mod source;
mod upload;
pub use packed::{PackedIds, PackedRef};
pub use pieces::PieceTable;
pub use reference::reference_convert;
pub use rows::{contiguous_piece_bytes, ContiguousPieces, PackedRows, RowsGather};
pub use runs::{BlockSource, RunsGather};
pub use shape::{ConvertShape, LayeredShape};
pub use source::{
    wide_piece, TablePlacement, CONVERT_KERNEL_SRC, INLINE_KERNEL_DEFINE, INLINE_LARGE_BLOCKS,
    INLINE_LARGE_ENTRIES, INLINE_LARGE_NAMES, INLINE_PACKED_BLOCKS, INLINE_PACKED_ENTRIES,
    INLINE_PACKED_NAMES, INLINE_SMALL_BLOCKS, INLINE_SMALL_ENTRIES, INLINE_SMALL_NAMES,
    KERNEL_NAMES, PACKED_MAX_BLOCK_ID, PACKED_TIER_NAMES, WIDE_KERNEL_NAME,
};
pub use upload::{
    BlockChunks, GatherUpload, Pipeline, PipelineChunks, PIPELINE_FIRST_ENV, PIPELINE_GROWTH_ENV,
    PIPELINE_MIN_RUNS, UPLOAD_ENV,
};

/// Threads per CTA of the converting gather.
pub const THREADS: u32 = 256;
/// CTAs per SM the grid is capped at (8 x 256 threads = 2048, a full SM);
/// larger fetches stride.
pub const CTAS_PER_SM: u32 = 8;
/// Longest piece, in bytes: longer contiguous ranges are split so one work
/// item never serializes a whole 2 MiB block on one group.
pub const MAX_PIECE_BYTES: u64 = 64 << 10;
/// A fetch with fewer work items than this has its pieces split further
/// (down to [`MIN_SPLIT_PIECE_BYTES`]) so a small fetch still spreads over SMs.
const MIN_WORK_ITEMS: u64 = 1024;
/// Pieces are not split below this for small fetches.
const MIN_SPLIT_PIECE_BYTES: u64 = 4 << 10;
/// Most work items (blocks x pieces) of one launch: the kernel counts them in
/// 32 bits and steps by at most 2^21 groups, so `item + step` never wraps.
pub const MAX_WORK_ITEMS: u64 = (1 << 31) - 1;
/// Most pieces per block (the piece table stays in L2).
pub const MAX_PIECES: usize = 1 << 20;

/// Pieces of at least this many bytes, copied as 16-byte elements, give each
/// lane eight elements in flight (the kernel's `_w` entry points, see
/// [`wide_piece`]); every other piece four.
pub const WIDE_PIECE_BYTES: u64 = 16 << 10;
/// Pieces of at most this many bytes (HF targets: one 256-byte `head_dim`
/// row) launch with [`SMALL_PIECE_THREADS`] x [`SMALL_PIECE_CTAS_PER_SM`]
/// under the default tuning.
pub const SMALL_PIECE_BYTES: u64 = 1 << 10;
/// Threads per CTA for small pieces under the default tuning: the H200
/// sweep's best geometry for the 8B -> HF row (t128_c4: 0.884 of raw,
/// against 0.834 at 256 x 8).
pub const SMALL_PIECE_THREADS: u32 = 128;
/// CTAs per SM for small pieces under the default tuning (see
/// [`SMALL_PIECE_THREADS`]).
pub const SMALL_PIECE_CTAS_PER_SM: u32 = 4;

/// Launch knobs of the converting gather. [`GatherTuning::default`] is the
/// product's setting: [`THREADS`] x [`CTAS_PER_SM`], pieces split to
/// [`MAX_PIECE_BYTES`], and for pieces of at most [`SMALL_PIECE_BYTES`]
/// [`SMALL_PIECE_THREADS`] x [`SMALL_PIECE_CTAS_PER_SM`] (the sweep's best
/// per shape). [`GatherTuning::new`] sets one geometry for every shape, so
/// the benchmark can sweep it on a device (`kvq bench transfer --profile gpu
/// --sweep`) and `KV_GATHER_*` overrides apply as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherTuning {
    threads: u32,
    ctas_per_sm: u32,
    max_piece_bytes: u64,
    /// `(threads, ctas_per_sm)` for pieces of at most [`SMALL_PIECE_BYTES`];
    /// `None`: `threads` / `ctas_per_sm` for every piece size.
    small_pieces: Option<(u32, u32)>,
}

impl Default for GatherTuning {
    fn default() -> Self {
        Self {
            threads: THREADS,
            ctas_per_sm: CTAS_PER_SM,
            max_piece_bytes: MAX_PIECE_BYTES,
            small_pieces: Some((SMALL_PIECE_THREADS, SMALL_PIECE_CTAS_PER_SM)),
        }
    }
}

impl GatherTuning {
    /// `threads` per CTA (a power of two, 32..=1024), at most `ctas_per_sm`
    /// CTAs per SM (1..=32, with `threads x ctas_per_sm <= 8192` so the
    /// kernel's 32-bit item counter cannot wrap), pieces split down to at
    /// most `max_piece_bytes` (a power of two, 1 KiB..=2 MiB).
    ///
    /// # Errors
    /// [`ConvertError::Tuning`] naming `threads`, `ctas_per_sm` or
    /// `max_piece_bytes`.
    pub fn new(threads: u32, ctas_per_sm: u32, max_piece_bytes: u64) -> Result<Self, ConvertError> {
        let bad = |field, got: u64| Err(ConvertError::Tuning { field, got });
        if !threads.is_power_of_two() || !(32..=1024).contains(&threads) {
            return bad("threads", u64::from(threads));
        }
        if !(1..=32).contains(&ctas_per_sm) || threads * ctas_per_sm > 8192 {
            return bad("ctas_per_sm", u64::from(ctas_per_sm));
        }
        if !max_piece_bytes.is_power_of_two() || !(1 << 10..=2 << 20).contains(&max_piece_bytes) {
            return bad("max_piece_bytes", max_piece_bytes);
        }
        Ok(Self {
            threads,
            ctas_per_sm,
            max_piece_bytes,
            small_pieces: None,
        })
    }
    /// `(threads per CTA, most CTAs per SM)` of a launch whose pieces are
    /// `piece_bytes` long.
    pub fn geometry_for(&self, piece_bytes: u64) -> (u32, u32) {
        match self.small_pieces {
            Some(small) if piece_bytes <= SMALL_PIECE_BYTES => small,
            _ => (self.threads, self.ctas_per_sm),
        }
    }
    /// Threads per CTA (pieces over [`SMALL_PIECE_BYTES`] under the
    /// default tuning; see [`GatherTuning::geometry_for`]).
    pub fn threads(&self) -> u32 {
        self.threads
    }
    /// Most CTAs per SM.
    pub fn ctas_per_sm(&self) -> u32 {
        self.ctas_per_sm
    }
    /// Longest piece after splitting, bytes.
    pub fn max_piece_bytes(&self) -> u64 {
        self.max_piece_bytes
    }
}

/// Why a converting gather was refused. Every variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// A [`GatherTuning`] knob is out of its range.
    #[error("invalid `tuning.{field}`: {got} is out of range")]
    Tuning {
        /// `threads`, `ctas_per_sm` or `max_piece_bytes`.
        field: &'static str,
        /// Value given.
        got: u64,
    },
    /// Donor and target region layouts are not the same geometry.
    #[error("donor/target region layouts: {0}")]
    Layout(#[from] RegionLayoutError),
    /// No block to move.
    #[error("invalid `moves`: at least one block must be moved")]
    Empty,
    /// A donor or target block id is not below the region's block count.
    #[error("invalid `{field}`: move {index} names block {block}, the region has {limit}")]
    BlockOutOfRange {
        /// `moves.src_block` or `moves.dst_block`.
        field: &'static str,
        /// Position in the move list.
        index: usize,
        /// Block id given.
        block: u32,
        /// Blocks in that region.
        limit: u32,
    },
    /// Two moves write the same target block.
    #[error("invalid `moves.dst_block`: move {index} writes block {block} a second time")]
    DuplicateTarget {
        /// Position in the move list of the second write.
        index: usize,
        /// Target block id.
        block: u32,
    },
    /// The layouts cut a block into more pieces than [`MAX_PIECES`], or the
    /// fetch has more than [`MAX_WORK_ITEMS`] work items.
    #[error("invalid `{field}`: {got} exceeds the kernel's limit {limit}")]
    TooLarge {
        /// `region.strides` (pieces per block) or `moves` (work items).
        field: &'static str,
        /// Count found.
        got: u64,
        /// Largest accepted.
        limit: u64,
    },
    /// A buffer is shorter than the region its layout describes.
    #[error("invalid `{field}`: {len} bytes, the layout addresses {need}")]
    ShortRegion {
        /// `src` or `dst`.
        field: &'static str,
        /// Bytes given.
        len: u64,
        /// Region bytes of the layout.
        need: u64,
    },
    /// A run of a block-major plan is not a whole number of blocks.
    #[error("invalid `runs.len`: run {index} has {len} bytes, not a multiple of the {block_bytes}-byte block")]
    RunLength {
        /// Position of the run.
        index: usize,
        /// Its length in bytes.
        len: u64,
        /// Rank block bytes.
        block_bytes: u64,
    },
}

/// A validated converting gather of one rank: which blocks, and how each is cut.
/// Block offsets are relative to the donor / target region's first byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertPlan {
    /// Shared with the [`ConvertShape`] that built the plan, so a launch
    /// recognises the piece table already on the device by pointer.
    pieces: Arc<PieceTable>,
    blocks: Blocks,
    src_region_bytes: u64,
    dst_region_bytes: u64,
    /// OR of the piece length, every piece offset and every block offset:
    /// its lowest set bit bounds the element width, so `geometry` is O(1)
    /// per launch instead of a fold over all blocks (for packed ids, the
    /// strides stand in for the offsets: `id x stride` has at least their
    /// alignment).
    offset_bits: u64,
}

/// The moved blocks of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Blocks {
    /// Donor and target block offsets, bytes from each region's first byte.
    Offsets { src: Vec<u64>, dst: Vec<u64> },
    /// Packed 16-bit ids, for fetch sizes that use the packed inline table
    /// ([`TablePlacement::InlinePacked`]); built in one pass, one Vec.
    Packed(PackedIds),
}

impl ConvertPlan {
    /// Moves donor block `moves[i].0` of `donor` to target block `moves[i].1`
    /// of `target` (ids as in [`KvRegionLayout::run_offset`]; for an HF
    /// target, block `b` lands at tokens `token_offset + b x block_size`).
    ///
    /// # Errors
    /// [`ConvertError::Layout`] (incompatible geometry, TP rank),
    /// [`ConvertError::Empty`], [`ConvertError::BlockOutOfRange`] naming
    /// `moves.src_block` / `moves.dst_block`, [`ConvertError::DuplicateTarget`],
    /// [`ConvertError::TooLarge`].
    pub fn new(
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        moves: &[(u32, u32)],
    ) -> Result<Self, ConvertError> {
        Self::new_tuned(donor, target, moves, &GatherTuning::default())
    }

    /// [`ConvertPlan::new`] with pieces split to `tuning.max_piece_bytes()`.
    ///
    /// # Errors
    /// As [`ConvertPlan::new`].
    pub fn new_tuned(
        donor: &KvRegionLayout,
        target: &KvRegionLayout,
        moves: &[(u32, u32)],
        tuning: &GatherTuning,
    ) -> Result<Self, ConvertError> {
        ConvertShape::new(donor, target, tuning)?.plan(moves)
    }

    /// The block-major rows of `runs` (as planned by
    /// [`crate::plan::TransferPlan`]: each run `blocks` rows of `block_bytes`,
    /// contiguous on both sides) as a plan over regions of the given sizes.
    ///
    /// # Errors
    /// [`ConvertError::Empty`], [`ConvertError::RunLength`],
    /// [`ConvertError::TooLarge`].
    pub fn from_runs(
        runs: &[CopyRun],
        block_bytes: u64,
        src_region_bytes: u64,
        dst_region_bytes: u64,
    ) -> Result<Self, ConvertError> {
        Self::from_runs_tuned(
            runs,
            block_bytes,
            src_region_bytes,
            dst_region_bytes,
            &GatherTuning::default(),
        )
    }

    /// [`ConvertPlan::from_runs`] with pieces split to `tuning.max_piece_bytes()`.
    ///
    /// # Errors
    /// As [`ConvertPlan::from_runs`].
    pub fn from_runs_tuned(
        runs: &[CopyRun],
        block_bytes: u64,
        src_region_bytes: u64,
        dst_region_bytes: u64,
        tuning: &GatherTuning,
    ) -> Result<Self, ConvertError> {
        if runs.is_empty() || block_bytes == 0 {
            return Err(ConvertError::Empty);
        }
        // One pass over the runs for the block count, the run lengths and
        // whether any run has several rows: a 4096-run part is 160 KiB of
        // runs, and every pass over it costs microseconds.
        let (mut n, mut multi) = (0usize, false);
        for (index, r) in runs.iter().enumerate() {
            if r.len != u64::from(r.blocks) * block_bytes {
                return Err(ConvertError::RunLength {
                    index,
                    len: r.len,
                    block_bytes,
                });
            }
            n += r.blocks as usize;
            multi |= r.blocks > 1;
        }
        if let Some(p) = PackedIds::of_runs(runs, block_bytes, n, multi) {
            return Self::checked(
                PieceTable::contiguous(block_bytes),
                Blocks::Packed(p),
                src_region_bytes,
                dst_region_bytes,
                tuning,
            );
        }
        let (mut src_blocks, mut dst_blocks) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for r in runs {
            if r.blocks == 1 {
                // Scattered fetches: every row its own run.
                src_blocks.push(r.src_offset);
                dst_blocks.push(r.dst_offset);
                continue;
            }
            for k in 0..u64::from(r.blocks) {
                src_blocks.push(r.src_offset + k * block_bytes);
                dst_blocks.push(r.dst_offset + k * block_bytes);
            }
        }
        Self::checked(
            PieceTable::contiguous(block_bytes),
            Blocks::Offsets {
                src: src_blocks,
                dst: dst_blocks,
            },
            src_region_bytes,
            dst_region_bytes,
            tuning,
        )
    }

    fn checked(
        pieces: PieceTable,
        blocks: Blocks,
        src_region_bytes: u64,
        dst_region_bytes: u64,
        tuning: &GatherTuning,
    ) -> Result<Self, ConvertError> {
        let n = blocks.len() as u64;
        let items = n * pieces.len() as u64;
        if items > MAX_WORK_ITEMS {
            return Err(ConvertError::TooLarge {
                field: "moves",
                got: items,
                limit: MAX_WORK_ITEMS,
            });
        }
        let pieces = pieces.split_for(n, tuning.max_piece_bytes);
        let offset_bits = pieces
            .src
            .iter()
            .chain(&pieces.dst)
            .fold(pieces.piece_bytes | blocks.bits(), |a, b| a | b);
        Ok(Self {
            pieces: Arc::new(pieces),
            blocks,
            src_region_bytes,
            dst_region_bytes,
            offset_bits,
        })
    }

    /// How each block is cut.
    pub fn pieces(&self) -> &PieceTable {
        &self.pieces
    }
    /// The blocks as packed 16-bit ids with one stride per side, when the
    /// fetch has 2,033..=8,128 blocks whose ids fit (see [`PackedIds`]).
    pub fn packed(&self) -> Option<&PackedIds> {
        match &self.blocks {
            Blocks::Packed(p) => Some(p),
            Blocks::Offsets { .. } => None,
        }
    }
    /// The piece table as shared by every plan of one [`ConvertShape`].
    pub fn pieces_arc(&self) -> &Arc<PieceTable> {
        &self.pieces
    }
    /// Blocks moved.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
    /// Payload bytes moved: blocks x pieces x piece bytes.
    pub fn bytes(&self) -> u64 {
        self.blocks() as u64 * self.pieces.len() as u64 * self.pieces.piece_bytes
    }
    /// Bytes the donor region must have (every addressed byte lies below).
    pub fn src_region_bytes(&self) -> u64 {
        self.src_region_bytes
    }
    /// Bytes the target region must have.
    pub fn dst_region_bytes(&self) -> u64 {
        self.dst_region_bytes
    }

    /// The block table for regions at `src_base` / `dst_base` (absolute
    /// addresses): `n` donor block bases, then `n` target block bases.
    pub fn block_table(&self, src_base: u64, dst_base: u64) -> Vec<u64> {
        let mut t = vec![0; 2 * self.blocks()];
        self.write_block_table(src_base, dst_base, &mut t);
        t
    }

    /// [`ConvertPlan::block_table`] written into `out[..2n]` (the launch
    /// writes straight into its page-locked staging buffer, no Vec per fetch).
    ///
    /// # Panics
    /// When `out` is shorter than `2 x blocks()` (a caller bug: the launch
    /// sizes its buffer from `blocks()`).
    pub fn write_block_table(&self, src_base: u64, dst_base: u64, out: &mut [u64]) {
        let n = self.blocks();
        let (s, d) = out[..2 * n].split_at_mut(n);
        match &self.blocks {
            Blocks::Offsets { src, dst } => {
                for (o, b) in s.iter_mut().zip(src) {
                    *o = src_base + b;
                }
                for (o, b) in d.iter_mut().zip(dst) {
                    *o = dst_base + b;
                }
            }
            // The device table of a packed plan (no inline module): the
            // addresses the packed entry points would form.
            Blocks::Packed(p) => p.view().write_block_table(src_base, dst_base, out),
        }
    }

    /// The piece table: `P` donor offsets, then `P` target offsets.
    pub fn piece_table(&self) -> Vec<u64> {
        let mut t = Vec::with_capacity(2 * self.pieces.len());
        t.extend(&self.pieces.src);
        t.extend(&self.pieces.dst);
        t
    }

    /// Launch geometry for regions at `src_base` / `dst_base` on a device
    /// with `sms` streaming multiprocessors, default [`GatherTuning`].
    pub fn geometry(&self, src_base: u64, dst_base: u64, sms: u32) -> LaunchGeometry {
        self.geometry_tuned(src_base, dst_base, sms, &GatherTuning::default())
    }

    /// [`ConvertPlan::geometry`] with `tuning`'s CTA size and grid cap. O(1):
    /// the element width comes from the OR kept at construction.
    pub fn geometry_tuned(
        &self,
        src_base: u64,
        dst_base: u64,
        sms: u32,
        tuning: &GatherTuning,
    ) -> LaunchGeometry {
        launch_geometry(
            &self.pieces,
            self.blocks(),
            self.offset_bits | src_base | dst_base,
            sms,
            tuning,
        )
    }
}

/// Grid, CTA size and scalars for `blocks` blocks cut by `p`, where `bits`
/// is the OR of the region bases, block offsets, piece offsets and piece
/// length (its lowest set bit bounds the element width).
fn launch_geometry(
    p: &PieceTable,
    blocks: usize,
    bits: u64,
    sms: u32,
    tuning: &GatherTuning,
) -> LaunchGeometry {
    {
        let (threads, ctas_per_sm) = tuning.geometry_for(p.piece_bytes);
        // Lowest set bit of (base | offset) is at most that of (base + offset),
        // so the width divides every address the kernel forms.
        let width = 1u32 << bits.trailing_zeros().min(4);
        let piece_elems = (p.piece_bytes / u64::from(width)) as u32;
        // Each lane should have four elements of a piece in flight, eight
        // for pieces of 16 KiB and more (the kernel's eight-wide loop): a
        // 16 KiB row then takes 128 lanes, not 256, and each lane keeps
        // 128 bytes of loads in flight instead of 64 (the H200 ran 4096 x
        // 16 KiB rows at 0.81 of the raw copy with four).
        // Only 16-byte elements get the eight-wide entry point; the step
        // stays out of every other one (see `wide_piece`).
        let wide = wide_piece(p.piece_bytes, width);
        let per_lane = if wide { 8 } else { 4 };
        let group = (piece_elems / per_lane).clamp(1, threads);
        let group_shift = 31 - group.leading_zeros(); // floor(log2)
        let num_pieces = p.len() as u32;
        let total = blocks as u64 * u64::from(num_pieces);
        let groups_per_cta = u64::from(threads >> group_shift);
        let ctas = total
            .div_ceil(groups_per_cta)
            .clamp(1, u64::from(sms.max(1) * ctas_per_sm)) as u32;
        LaunchGeometry {
            width,
            grid_x: ctas,
            threads,
            n: blocks as u32,
            num_pieces,
            piece_shift: if num_pieces.is_power_of_two() {
                num_pieces.trailing_zeros()
            } else {
                u32::MAX
            },
            piece_elems,
            group_shift,
            wide,
        }
    }
}

impl Blocks {
    fn len(&self) -> usize {
        match self {
            Self::Offsets { src, .. } => src.len(),
            Self::Packed(p) => p.words.len(),
        }
    }
    /// OR of every block offset, or of the strides for packed ids.
    fn bits(&self) -> u64 {
        match self {
            Self::Offsets { src, dst } => src.iter().chain(dst).fold(0, |a, b| a | b),
            Self::Packed(p) => p.src_stride | p.dst_stride,
        }
    }
}

/// One launch of the converting gather: grid, CTA size and the scalar
/// arguments of [`CONVERT_KERNEL_SRC`] in order after the two table pointers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchGeometry {
    /// Element width in bytes (16, 8, 4, 2, 1); picks the entry point.
    pub width: u32,
    /// CTAs (1-D grid).
    pub grid_x: u32,
    /// Threads per CTA.
    pub threads: u32,
    /// Blocks moved (`n`).
    pub n: u32,
    /// Pieces per block (`np`).
    pub num_pieces: u32,
    /// `log2(num_pieces)`, or `u32::MAX` when not a power of two.
    pub piece_shift: u32,
    /// Elements of `width` bytes per piece (`pe`).
    pub piece_elems: u32,
    /// `log2` of the lanes per group.
    pub group_shift: u32,
    /// Launch the eight-wide entry point (`NAME_w`, [`wide_piece`]): lanes
    /// step eight elements while eight remain, and `G` is an eighth of the
    /// piece's elements instead of a quarter.
    pub wide: bool,
}

impl LaunchGeometry {
    /// Table-pointer entry point of [`CONVERT_KERNEL_SRC`] for this width
    /// (the eight-wide one when [`LaunchGeometry::wide`]).
    pub fn kernel_name(&self) -> &'static str {
        if self.wide {
            return WIDE_KERNEL_NAME;
        }
        KERNEL_NAMES
            .iter()
            .find(|(w, _)| *w == self.width)
            .map_or("kv_convert_1", |(_, n)| n)
    }
}

#[cfg(test)]
mod tests;
