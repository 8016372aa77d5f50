//! K/V storage of one sequence over a TP group, laid out block-major per
//! rank, with the export / import of sealed blocks that reuse moves.

use super::*;

/// One sequence's K/V over a TP group: one block-major f32 buffer per rank.
///
/// Holds `len_tokens` tokens; storage is allocated in whole blocks, so the
/// last block may be partial (unsealed). Only full blocks can be exported or
/// imported.
///
/// ```
/// use kv_testkit::model::{ModelConfig, ReferenceModel};
/// let m = ReferenceModel::new(ModelConfig::default()).unwrap();
/// let prompt: Vec<u32> = (0..40).collect();
/// let mut a = m.new_cache(2).unwrap();
/// m.prefill(&mut a, &prompt).unwrap();
/// assert_eq!(a.sealed_blocks(), 2); // 40 tokens = 2 full 16-token blocks + 8
/// let parts = a.export_blocks(0, 2).unwrap(); // one byte vector per rank
/// let mut b = m.new_cache(2).unwrap();
/// b.import_blocks(0, &parts).unwrap();
/// assert_eq!(b.len_tokens(), 32);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    pub(super) layout: KvLayout,
    pub(super) len_tokens: usize,
    pub(super) ranks: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache with `layout` (must be f32, block-major).
    pub fn new(layout: KvLayout) -> Self {
        Self {
            layout,
            len_tokens: 0,
            ranks: vec![Vec::new(); layout.tp_size() as usize],
        }
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }
    /// Tokens whose K/V the cache holds.
    pub fn len_tokens(&self) -> usize {
        self.len_tokens
    }
    /// Full (sealed) blocks: `len_tokens / tokens_per_block`.
    pub fn sealed_blocks(&self) -> usize {
        self.len_tokens / self.layout.tokens_per_block() as usize
    }

    pub(super) fn block_elems(&self) -> usize {
        self.layout.rank_block_bytes() / 4
    }

    pub(super) fn grow_to(&mut self, tokens: usize) {
        let bs = self.layout.tokens_per_block() as usize;
        let want = tokens.div_ceil(bs) * self.block_elems();
        for r in &mut self.ranks {
            if r.len() < want {
                r.resize(want, 0.0);
            }
        }
    }

    /// Element offset of `(pos, layer, kv, head_on_rank)` in a rank buffer.
    pub(super) fn offset(&self, layer: usize, kv: usize, pos: usize, local_head: usize) -> usize {
        let l = &self.layout;
        let bs = l.tokens_per_block() as usize;
        let (hpr, hd) = (l.heads_per_rank() as usize, l.head_dim() as usize);
        let (b, i) = (pos / bs, pos % bs);
        ((((b * l.num_layers() as usize + layer) * 2 + kv) * bs + i) * hpr + local_head) * hd
    }

    pub(super) fn write(&mut self, layer: usize, kv: usize, pos: usize, head: usize, vals: &[f32]) {
        let hpr = self.layout.heads_per_rank() as usize;
        let off = self.offset(layer, kv, pos, head % hpr);
        self.ranks[head / hpr][off..off + vals.len()].copy_from_slice(vals);
    }

    pub(super) fn read(&self, layer: usize, kv: usize, pos: usize, head: usize) -> &[f32] {
        let hpr = self.layout.heads_per_rank() as usize;
        let off = self.offset(layer, kv, pos, head % hpr);
        &self.ranks[head / hpr][off..off + self.layout.head_dim() as usize]
    }

    /// Bytes (little-endian f32) of sealed blocks `first..first + count`, one
    /// vector per rank of `count x rank_block_bytes` bytes: what a bank stores.
    ///
    /// # Errors
    /// [`ModelError::Blocks`] (`first_block`) when the range is not sealed.
    pub fn export_blocks(&self, first: usize, count: usize) -> Result<Vec<Vec<u8>>, ModelError> {
        if first + count > self.sealed_blocks() {
            return Err(ModelError::Blocks {
                field: "first_block",
                reason: format!(
                    "blocks {first}..{} requested, only {} sealed",
                    first + count,
                    self.sealed_blocks()
                ),
            });
        }
        let be = self.block_elems();
        Ok(self
            .ranks
            .iter()
            .map(|r| {
                r[first * be..(first + count) * be]
                    .iter()
                    .flat_map(|f| f.to_le_bytes())
                    .collect()
            })
            .collect())
    }

    /// Appends whole blocks given as bytes per rank (the inverse of
    /// [`KvCache::export_blocks`]); the cache must end exactly at block
    /// `first` (`len_tokens == first x tokens_per_block`).
    ///
    /// # Errors
    /// [`ModelError::Blocks`]: `first_block` not at the cache's end, `parts`
    /// count not `tp_size`, `parts[r].len` not an equal multiple of
    /// `rank_block_bytes` or zero. The cache is unchanged on error.
    pub fn import_blocks<B: AsRef<[u8]>>(
        &mut self,
        first: usize,
        parts: &[B],
    ) -> Result<(), ModelError> {
        let bs = self.layout.tokens_per_block() as usize;
        if self.len_tokens != first * bs {
            return Err(ModelError::Blocks {
                field: "first_block",
                reason: format!(
                    "cache holds {} tokens, block {first} starts at {}",
                    self.len_tokens,
                    first * bs
                ),
            });
        }
        if parts.len() != self.ranks.len() {
            return Err(ModelError::Blocks {
                field: "parts",
                reason: format!("{} parts for tp_size {}", parts.len(), self.ranks.len()),
            });
        }
        let rbb = self.layout.rank_block_bytes();
        let n0 = parts[0].as_ref().len();
        for (r, p) in parts.iter().enumerate() {
            let n = p.as_ref().len();
            if n == 0 || n % rbb != 0 || n != n0 {
                return Err(ModelError::Blocks {
                    field: "parts[r].len",
                    reason: format!("rank {r} has {n} bytes: need the same non-zero multiple of {rbb} on every rank"),
                });
            }
        }
        let count = n0 / rbb;
        self.grow_to((first + count) * bs);
        let be = self.block_elems();
        for (r, p) in parts.iter().enumerate() {
            let dst = &mut self.ranks[r][first * be..(first + count) * be];
            for (d, chunk) in dst.iter_mut().zip(p.as_ref().chunks_exact(4)) {
                *d = f32::from_le_bytes(chunk.try_into().expect("chunks of 4"));
            }
        }
        self.len_tokens = (first + count) * bs;
        Ok(())
    }

    /// Drops tokens beyond `tokens` (no-op if already shorter). Stale K/V
    /// left in a partial block is never read: reads stop at `len_tokens` and
    /// the next token overwrites its position.
    pub fn truncate(&mut self, tokens: usize) {
        if tokens < self.len_tokens {
            self.len_tokens = tokens;
            let bs = self.layout.tokens_per_block() as usize;
            let keep = tokens.div_ceil(bs) * self.block_elems();
            for r in &mut self.ranks {
                r.truncate(keep);
            }
        }
    }
}
