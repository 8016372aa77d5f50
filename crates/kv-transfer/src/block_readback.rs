//! Reading one KV block back out of a region in any engine layout, in the
//! bank's block-major byte order.
//!
//! Why: the donor hashes each pinned block as its bank keeps it (one
//! contiguous `rank_block_bytes` row, element order `[layer, kv, token,
//! head, head_dim]`, [`KvRegionLayout::block_major`]). A target that landed
//! the block in an engine layout (vLLM per layer, HF per layer) holds the
//! same elements scattered; gathering them back into block-major order
//! gives the exact bytes the donor hashed, so the same checksum applies.

use kv_bank::BankMemory;
use kv_descriptor::KvRegionLayout;

use crate::TransferError;

/// A span read covers at most this many times the bytes it needs; sparser
/// groups are split (per head, then per run) so a read never drags in a
/// whole HF cache for one block.
const MAX_SPAN_WASTE: u64 = 2;

/// The bytes of block `block` of `layout` in `memory`, in block-major order:
/// `geometry.rank_block_bytes()` bytes, element `(layer, kv, token, head, d)`
/// at `((((layer * 2 + kv) * tokens_per_block + token) * heads_per_rank +
/// head) * head_dim + d) * dtype_bytes` (the bank row, what
/// [`KvRegionLayout::block_major`] addresses for one block).
///
/// `layout`'s byte offsets are offsets into `memory`. Reads go through
/// [`BankMemory::read_bytes`], one per contiguous span: per `(layer, kv)`
/// when the block's runs there are dense (block-major, vLLM), else per
/// `(layer, kv, head)` (HF: tokens of one head are contiguous), else per
/// `head_dim` run. Device memory owned by this process reads through its
/// device-to-host copy; memory without read-back refuses.
///
/// # Errors
/// [`TransferError::InvalidInput`] naming `block` when it is not below
/// `layout.num_blocks()`, or `layout.region_bytes` when the layout
/// addresses past `memory.len()`; [`TransferError::Bank`] with the
/// memory's error when a span cannot be read (e.g.
/// [`kv_bank::BankError::Unsupported`] for an engine device pointer).
///
/// ```
/// use kv_bank::BankMemory;
/// use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
/// let g = KvLayout::new(2, 1, 2, DType::Fp8E4m3, 2, TensorOrder::BlockMajor, 1).unwrap();
/// // vLLM [2, num_blocks, block_size, heads, head_dim] per layer, 3 blocks
/// // of 2 x 1 x 2 bytes per K or V: 24 bytes a layer.
/// let l = KvRegionLayout::vllm_kv_first(g, 0, 0, 24, 3, 48).unwrap();
/// let m = kv_transfer::HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
/// let bytes: Vec<u8> = (0..l.region_bytes() as u8).collect();
/// m.write_bytes(0, &bytes).unwrap();
/// // Block 1: layer 0 K at 4..8, V at 16..20; layer 1 the same at +24.
/// assert_eq!(
///     kv_transfer::block_readback::read_block_major(&m, &l, 1).unwrap(),
///     [4, 5, 6, 7, 16, 17, 18, 19, 28, 29, 30, 31, 40, 41, 42, 43]
/// );
/// ```
pub fn read_block_major(
    memory: &dyn BankMemory,
    layout: &KvRegionLayout,
    block: u32,
) -> Result<Vec<u8>, TransferError> {
    if block >= layout.num_blocks() {
        return Err(TransferError::InvalidInput {
            field: "block",
            reason: format!(
                "block {block} is not below the layout's {} blocks",
                layout.num_blocks()
            ),
        });
    }
    if layout.region_bytes() > memory.len() as u64 {
        return Err(TransferError::InvalidInput {
            field: "layout.region_bytes",
            reason: format!(
                "the layout addresses {} bytes, the memory holds {}",
                layout.region_bytes(),
                memory.len()
            ),
        });
    }
    let g = layout.geometry();
    let elem = g.dtype().size_bytes() as u64;
    let (t, h, d) = (
        g.tokens_per_block(),
        g.heads_per_rank(),
        u64::from(g.head_dim()),
    );
    let runs = Runs {
        run_bytes: d * elem,
        elem,
        target_dim_bytes: layout.strides().dim * elem,
    };
    let mut out = vec![0u8; g.rank_block_bytes()];
    let mut donor = 0usize;
    let mut group = Vec::with_capacity((t * h) as usize);
    for layer in 0..g.num_layers() {
        for kv in 0..2 {
            group.clear();
            // Block-major order within (layer, kv): token, then head.
            for token in 0..t {
                for head in 0..h {
                    let at = layout
                        .run_offset(layer, block, kv, token, head)
                        .expect("indices below the geometry's dims");
                    group.push((at, head, donor));
                    donor += runs.run_bytes as usize;
                }
            }
            if runs.dense(&group) {
                runs.gather(memory, &group, &mut out)?;
                continue;
            }
            for head in 0..h {
                let of_head: Vec<_> = group.iter().copied().filter(|r| r.1 == head).collect();
                if runs.dense(&of_head) {
                    runs.gather(memory, &of_head, &mut out)?;
                } else {
                    for run in &of_head {
                        runs.gather(memory, std::slice::from_ref(run), &mut out)?;
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Geometry of the `head_dim` runs of one block.
struct Runs {
    /// Bytes of one run in block-major order (`head_dim x dtype`).
    run_bytes: u64,
    /// Element bytes.
    elem: u64,
    /// Byte distance of consecutive `d` in the target layout.
    target_dim_bytes: u64,
}

impl Runs {
    /// Byte range of the target covering `runs` (`(target offset, head,
    /// block-major offset)`).
    fn span(&self, runs: &[(u64, u32, usize)]) -> (u64, u64) {
        let last = self.run_bytes / self.elem - 1;
        let lo = runs.iter().map(|r| r.0).min().unwrap_or(0);
        let hi = runs
            .iter()
            .map(|r| r.0 + last * self.target_dim_bytes + self.elem)
            .max()
            .unwrap_or(0);
        (lo, hi)
    }

    /// True when one read of the span wastes little.
    fn dense(&self, runs: &[(u64, u32, usize)]) -> bool {
        let (lo, hi) = self.span(runs);
        hi - lo <= MAX_SPAN_WASTE * self.run_bytes * runs.len() as u64
    }

    /// Reads the span of `runs` once and scatters each run into `out` at
    /// its block-major offset.
    fn gather(
        &self,
        memory: &dyn BankMemory,
        runs: &[(u64, u32, usize)],
        out: &mut [u8],
    ) -> Result<(), TransferError> {
        let (lo, hi) = self.span(runs);
        let span = memory.read_vec(lo as usize, (hi - lo) as usize)?;
        let (rb, e) = (self.run_bytes as usize, self.elem as usize);
        for &(at, _, dst) in runs {
            let src = (at - lo) as usize;
            if self.target_dim_bytes == self.elem {
                out[dst..dst + rb].copy_from_slice(&span[src..src + rb]);
            } else {
                for i in 0..rb / e {
                    let s = src + i * self.target_dim_bytes as usize;
                    out[dst + i * e..dst + (i + 1) * e].copy_from_slice(&span[s..s + e]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};

    use super::read_block_major;
    use crate::{HostBuffer, TransferError};

    fn geometry() -> KvLayout {
        // 3 layers, 4 KV heads over TP 2 (2 per rank), head_dim 8, F16,
        // 4 tokens per block.
        KvLayout::new(3, 4, 8, DType::Fp16, 4, TensorOrder::BlockMajor, 2).unwrap()
    }

    /// Fills `memory` so element `(layer, block, kv, token, head, d)` of `l`
    /// holds a value unique to it, and returns block `block`'s expected
    /// block-major bytes.
    fn fill(memory: &HostBuffer, l: &KvRegionLayout, block: u32) -> Vec<u8> {
        let g = l.geometry();
        let e = g.dtype().size_bytes();
        let mut want = Vec::new();
        for b in 0..l.num_blocks() {
            for layer in 0..g.num_layers() {
                for kv in 0..2 {
                    for token in 0..g.tokens_per_block() {
                        for head in 0..g.heads_per_rank() {
                            let at = l.run_offset(layer, b, kv, token, head).unwrap();
                            for d in 0..u64::from(g.head_dim()) {
                                let v = (b * 131 + layer * 31 + kv * 17 + token * 7 + head * 3)
                                    as u16
                                    ^ ((d as u16) << 11);
                                let off = at + d * l.strides().dim * e as u64;
                                memory.write_bytes(off as usize, &v.to_le_bytes()).unwrap();
                                if b == block {
                                    want.extend_from_slice(&v.to_le_bytes());
                                }
                            }
                        }
                    }
                }
            }
        }
        want
    }

    fn layouts() -> Vec<KvRegionLayout> {
        let g = geometry();
        let rbb = g.rank_block_bytes() as u64;
        let blocks = 5u32;
        // Per layer, one tensor of `blocks` blocks, with 64 bytes of
        // padding between layers so offsets are not all multiples of it.
        let layer = u64::from(blocks) * rbb / 3 + 64;
        let hf_layer = 2 * 2 * g.heads_per_rank() as u64 * 40 * g.head_dim() as u64 * 2;
        vec![
            KvRegionLayout::block_major(g, 1, 0, blocks, u64::from(blocks) * rbb).unwrap(),
            KvRegionLayout::vllm_kv_first(g, 1, 32, layer, blocks, 32 + 3 * layer).unwrap(),
            KvRegionLayout::vllm_block_first(g, 1, 0, layer, blocks, 3 * layer).unwrap(),
            // HF [2, batch 2, heads, 40 tokens, head_dim], sequence 1 from
            // token 12.
            KvRegionLayout::hf_tokens(g, 1, 0, hf_layer, 2, 1, 40, 12, 5, 3 * hf_layer).unwrap(),
        ]
    }

    #[test]
    fn every_layout_reads_back_the_bank_row_of_each_block() {
        for l in layouts() {
            let m = HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
            for block in [0, 3, 4] {
                let want = fill(&m, &l, block);
                assert_eq!(want.len(), geometry().rank_block_bytes());
                let got = read_block_major(&m, &l, block).unwrap();
                assert!(got == want, "{:?} block {block}", l.order());
            }
        }
    }

    #[test]
    fn an_out_of_range_block_or_short_memory_names_the_field() {
        let l = layouts().remove(1);
        let m = HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
        match read_block_major(&m, &l, 5) {
            Err(TransferError::InvalidInput { field: "block", .. }) => {}
            other => panic!("expected block refused, got {other:?}"),
        }
        let short = HostBuffer::zeroed(l.region_bytes() as usize - 1).unwrap();
        match read_block_major(&short, &l, 0) {
            Err(TransferError::InvalidInput {
                field: "layout.region_bytes",
                ..
            }) => {}
            other => panic!("expected region_bytes refused, got {other:?}"),
        }
    }
}

/// The cost of the target's check on CPU, for the report: 512 blocks of
/// 2 MiB (a 32-layer, 8-KV-head-per-rank, 128-dim bf16 block of 16
/// tokens) gathered from a vLLM per-layer region and hashed (XXH3-64).
/// Run with `cargo test --release -p kv-transfer --lib block_readback_cost
/// -- --ignored --nocapture`.
#[cfg(test)]
mod cost {
    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};

    #[test]
    #[ignore = "timing, release build"]
    fn block_readback_cost() {
        let g = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
        let rbb = g.rank_block_bytes() as u64;
        assert_eq!(rbb, 2 << 20);
        let blocks = 512u32;
        let layer = u64::from(blocks) * rbb / 32;
        let l = KvRegionLayout::vllm_kv_first(g, 0, 0, layer, blocks, 32 * layer).unwrap();
        let m = crate::HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
        let fill: Vec<u8> = (0..l.region_bytes()).map(|i| (i * 7 + 3) as u8).collect();
        m.write_bytes(0, &fill).unwrap();
        drop(fill);
        let t = std::time::Instant::now();
        let mut acc = 0u64;
        for b in 0..blocks {
            acc ^= xxhash_rust::xxh3::xxh3_64(
                &m.read_vec((u64::from(b) * rbb) as usize, rbb as usize)
                    .unwrap(),
            );
        }
        let dense = t.elapsed();
        let t = std::time::Instant::now();
        for b in 0..blocks {
            let bytes = super::read_block_major(&m, &l, b).unwrap();
            acc ^= xxhash_rust::xxh3::xxh3_64(&bytes);
        }
        let gathered = t.elapsed();
        let gib = f64::from(blocks) * rbb as f64 / f64::from(1 << 30);
        println!(
            "COST 512 x 2 MiB: dense read+hash {:.1} ms ({:.1} GiB/s), vLLM gather+hash {:.1} ms ({:.1} GiB/s) [{acc:x}]",
            dense.as_secs_f64() * 1e3,
            gib / dense.as_secs_f64(),
            gathered.as_secs_f64() * 1e3,
            gib / gathered.as_secs_f64()
        );
    }
}
