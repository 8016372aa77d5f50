//! Converting parts: donor blocks described by one [`KvRegionLayout`] landing
//! at engine-chosen target blocks described by another.
//!
//! A [`Conversion`] is one rank's share of a converting plan
//! ([`crate::plan::TransferPlan::converting`]): the two region layouts (same
//! geometry and TP rank, checked by [`KvRegionLayout::check_compatible`]) and
//! the `(donor block, target block)` pairs of the present keys. It stores no
//! byte ranges: [`Conversion::pieces`] derives them on demand (a 512-block
//! 8B-shaped fetch into an HF cache is ~4M `head_dim` runs, which a GPU
//! kernel maps itself with [`KvRegionLayout::run_offset`] instead of reading
//! a host table).
//!
//! Element `(layer, block, kv, token, head, d)` of a block is read at the
//! donor's address of that tuple and written at the target's address of the
//! same tuple (the formula in [`KvRegionLayout`]), so any memory order on
//! either side converts in the one copy: nothing is staged.

use kv_descriptor::KvRegionLayout;

/// True when `layout` is block-major from byte 0 of its region (a bank's
/// slot rows, [`KvRegionLayout::block_major`] at base 0): a plan between two
/// such regions moves whole block rows and needs no converting backend.
///
/// ```
/// use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
/// let g = KvLayout::new(2, 2, 4, DType::F32, 2, TensorOrder::BlockMajor, 1).unwrap();
/// let bb = g.rank_block_bytes() as u64;
/// assert!(kv_transfer::convert::is_bank_rows(&KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap()));
/// assert!(!kv_transfer::convert::is_bank_rows(&KvRegionLayout::block_major(g, 0, 64, 4, 4 * bb + 64).unwrap()));
/// let vllm = KvRegionLayout::vllm_kv_first(g, 0, 0, 2 * bb, 4, 4 * bb).unwrap();
/// assert!(!kv_transfer::convert::is_bank_rows(&vllm));
/// ```
pub fn is_bank_rows(layout: &KvRegionLayout) -> bool {
    KvRegionLayout::block_major(
        *layout.geometry(),
        layout.tp_rank(),
        0,
        layout.num_blocks(),
        layout.region_bytes(),
    )
    .is_ok_and(|rows| {
        rows.layer_offsets() == layout.layer_offsets() && rows.strides() == layout.strides()
    })
}

/// A donor block and the target block that receives it (ids of the two
/// region layouts, `0..num_blocks()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockPair {
    /// Donor block (slot) id.
    pub src_block: u32,
    /// Target block id, as the engine's allocator chose it.
    pub dst_block: u32,
}

/// One contiguous byte range to copy: `len` bytes from donor offset
/// `src_offset` to target offset `dst_offset`, both relative to the first byte
/// of the rank's region (what `BankMemory::base_addr` points at).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Byte offset in the donor region.
    pub src_offset: u64,
    /// Byte offset in the target region.
    pub dst_offset: u64,
    /// Bytes (a multiple of the dtype size, at least one element).
    pub len: u64,
}

/// One rank's converting copy: donor layout, target layout, block pairs.
///
/// Built only by [`crate::plan::TransferPlan::converting`], after both
/// layouts passed [`KvRegionLayout::check_compatible`] and every block id was
/// checked against its layout's `num_blocks`, so every piece lies inside
/// both regions (`src().region_bytes()`, `dst().region_bytes()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversion {
    src: KvRegionLayout,
    dst: KvRegionLayout,
    pairs: Vec<BlockPair>,
}

impl Conversion {
    pub(crate) fn new(src: KvRegionLayout, dst: KvRegionLayout, pairs: Vec<BlockPair>) -> Self {
        Self { src, dst, pairs }
    }

    /// Donor region layout (block-major for a bank).
    pub fn src(&self) -> &KvRegionLayout {
        &self.src
    }
    /// Target region layout (the engine's own tensors).
    pub fn dst(&self) -> &KvRegionLayout {
        &self.dst
    }
    /// Present blocks, sorted by donor block.
    pub fn pairs(&self) -> &[BlockPair] {
        &self.pairs
    }

    /// Byte ranges to copy, adjacent ranges (contiguous on both sides) merged.
    ///
    /// Order: block pairs, then layers, then the K/V, token and head indices
    /// in the donor's memory order (largest donor stride outermost), so reads
    /// walk the donor forwards and equal orders merge into whole blocks. A
    /// range is one `head_dim` run when both sides have `strides.dim == 1`,
    /// else one element. The pieces cover exactly `pairs().len() x
    /// rank_block_bytes` bytes and no two of them share a target byte.
    ///
    /// ```
    /// use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
    /// use kv_transfer::plan::{BlockMove, TransferPlan};
    /// use kv_descriptor::SequenceHash;
    /// // 1 layer, 1 head, head_dim 2, f32, 2 tokens: a rank block is 32 bytes.
    /// let g = KvLayout::new(1, 1, 2, DType::F32, 2, TensorOrder::BlockMajor, 1).unwrap();
    /// let donor = KvRegionLayout::block_major(g, 0, 0, 4, 128).unwrap();
    /// // vLLM `[2, 8, 2, 1, 2]`: K of all 8 blocks (16 bytes each), then V.
    /// let target = KvRegionLayout::vllm_kv_first(g, 0, 0, 256, 8, 256).unwrap();
    /// let m = BlockMove { key: SequenceHash(1), src_slot: Some(3), dst_block: 5 };
    /// let plan = TransferPlan::converting(&[donor], &[target], &[m]).unwrap();
    /// let conv = plan.parts()[0].conversion().unwrap();
    /// let p: Vec<_> = conv.pieces().map(|p| (p.src_offset, p.dst_offset, p.len)).collect();
    /// // K of block 3 (16 bytes) to K of block 5, V to V at 128 + 5 x 16.
    /// assert_eq!(p, [(96, 80, 16), (112, 208, 16)]);
    /// ```
    pub fn pieces(&self) -> Pieces<'_> {
        Pieces::new(self)
    }

    /// Bytes the pieces cover: `pairs().len() x rank_block_bytes`.
    pub fn bytes(&self) -> u64 {
        self.pairs.len() as u64 * self.src.geometry().rank_block_bytes() as u64
    }
}

/// Iterator over a [`Conversion`]'s merged [`Piece`]s.
#[derive(Debug, Clone)]
pub struct Pieces<'a> {
    conv: &'a Conversion,
    /// Inner dimensions outermost first: (extent, donor stride, target stride), elements.
    dims: [(u64, u64, u64); 4],
    run_bytes: u64,
    elem: u64,
    pair: usize,
    layer: usize,
    idx: [u64; 4],
    pending: Option<Piece>,
}

impl<'a> Pieces<'a> {
    fn new(conv: &'a Conversion) -> Self {
        let g = conv.src.geometry();
        let (t, h, d) = (
            u64::from(g.tokens_per_block()),
            u64::from(g.heads_per_rank()),
            u64::from(g.head_dim()),
        );
        let (s, q) = (conv.src.strides(), conv.dst.strides());
        let elem = g.dtype().size_bytes() as u64;
        // A `head_dim` run is one memcpy only when it is dense on both sides.
        let dense_dim = s.dim == 1 && q.dim == 1;
        let mut dims = [
            (2, s.kv, q.kv),
            (t, s.token, q.token),
            (h, s.head, q.head),
            if dense_dim {
                (1, 0, 0)
            } else {
                (d, s.dim, q.dim)
            },
        ];
        // Donor memory order: reads go forwards, and when the target has the
        // same order consecutive runs merge.
        dims.sort_by_key(|&(_, src, dst)| std::cmp::Reverse((src, dst)));
        Self {
            conv,
            dims,
            run_bytes: if dense_dim { d * elem } else { elem },
            elem,
            pair: 0,
            layer: 0,
            idx: [0; 4],
            pending: None,
        }
    }

    fn next_raw(&mut self) -> Option<Piece> {
        let pair = *self.conv.pairs.get(self.pair)?;
        let (s, q) = (self.conv.src.strides(), self.conv.dst.strides());
        let (mut so, mut dof) = (
            u64::from(pair.src_block) * s.block,
            u64::from(pair.dst_block) * q.block,
        );
        for (i, &(_, ss, ds)) in self.idx.iter().zip(&self.dims) {
            so += i * ss;
            dof += i * ds;
        }
        let piece = Piece {
            src_offset: self.conv.src.layer_offsets()[self.layer] + so * self.elem,
            dst_offset: self.conv.dst.layer_offsets()[self.layer] + dof * self.elem,
            len: self.run_bytes,
        };
        // Mixed-radix increment: innermost dimension first, then layer, then pair.
        let mut k = 4;
        loop {
            if k == 0 {
                self.idx = [0; 4];
                self.layer += 1;
                if self.layer == self.conv.src.layer_offsets().len() {
                    self.layer = 0;
                    self.pair += 1;
                }
                break;
            }
            k -= 1;
            self.idx[k] += 1;
            if self.idx[k] < self.dims[k].0 {
                break;
            }
            self.idx[k] = 0;
        }
        Some(piece)
    }
}

impl Iterator for Pieces<'_> {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        let mut cur = self.pending.take().or_else(|| self.next_raw())?;
        while let Some(n) = self.next_raw() {
            if n.src_offset == cur.src_offset + cur.len && n.dst_offset == cur.dst_offset + cur.len
            {
                cur.len += n.len;
            } else {
                self.pending = Some(n);
                break;
            }
        }
        Some(cur)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_descriptor::{DType, KvLayout, TensorOrder};

    fn geom() -> KvLayout {
        // 2 layers, 2 heads, head_dim 4, f32, 2 tokens: 128 bytes a layer-block.
        KvLayout::new(2, 2, 4, DType::F32, 2, TensorOrder::BlockMajor, 1).unwrap()
    }

    #[test]
    fn equal_block_major_orders_merge_into_one_block_range() {
        let g = geom();
        let bb = g.rank_block_bytes() as u64;
        let a = KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap();
        let b = KvRegionLayout::block_major(g, 0, 64, 4, 4 * bb + 64).unwrap();
        let pairs = vec![
            BlockPair {
                src_block: 1,
                dst_block: 2,
            },
            BlockPair {
                src_block: 2,
                dst_block: 3,
            },
        ];
        let c = Conversion::new(a, b, pairs);
        let p: Vec<_> = c.pieces().collect();
        // Consecutive on both sides: one range of two blocks, shifted by the base.
        assert_eq!(
            p,
            [Piece {
                src_offset: bb,
                dst_offset: 2 * bb + 64,
                len: 2 * bb
            }]
        );
        assert_eq!(c.bytes(), 2 * bb);
    }

    #[test]
    fn hf_target_gets_one_head_dim_run_per_token_and_head() {
        let g = geom();
        let bb = g.rank_block_bytes() as u64;
        let a = KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap();
        // [2, 1, 2 heads, 8 tokens, 4] per layer, f32: 512 bytes a layer.
        let b = KvRegionLayout::hf_tokens(g, 0, 0, 512, 1, 0, 8, 2, 3, 1024).unwrap();
        let c = Conversion::new(
            a,
            b,
            vec![BlockPair {
                src_block: 0,
                dst_block: 1,
            }],
        );
        let p: Vec<_> = c.pieces().collect();
        // 2 layers x 2 kv x 2 tokens x 2 heads, 16 bytes each: walking the
        // donor (token-major) never steps forwards on the HF side (head-major).
        assert_eq!(p.len(), 16);
        assert!(p.iter().all(|p| p.len == 16));
        // Layer 0, K, token 0, head 1 of block 1 at token offset 2:
        // token 2 + 2 = 4, head 1 -> (1*32 + 4*4) * 4 bytes = 192.
        assert_eq!((p[1].src_offset, p[1].dst_offset), (16, 192));
        assert_eq!(p.iter().map(|p| p.len).sum::<u64>(), bb);
    }
}
