//! How an engine's KV tensors are laid out (the `kv_layout=` names of
//! `Target`), as kv_descriptor's `KvRegionLayout`, and the tensor shape each
//! name expects of one TP rank's cache.
//!
//! One tensor per TP rank holds every layer, layer `l` at
//! `l * layer_stride_bytes` (vLLM's per-layer tensors stacked: the engine
//! allocates them as one buffer and views it per layer). `rows` = the
//! engine's block count; `T` tokens per block, `H` KV heads of this rank,
//! `D` head dim, `L` layers.

use pyo3::prelude::*;

use kv_descriptor::{KvLayout, KvRegionLayout, RegionLayoutError};

use crate::errors::bad_argument;

/// The accepted `kv_layout` names.
pub(crate) const NAMES: &str = "block_major, vllm_kv_first, vllm_block_first";

/// A supported engine tensor order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EngineOrder {
    /// `[rows, rank_block_elems]`: a block's bytes contiguous, ordered
    /// layer, K/V, token, head, dim (the bank's own slot layout).
    BlockMajor,
    /// vLLM `[L, 2, rows, T, H, D]` (per layer `[2, num_blocks, T, H, D]`).
    VllmKvFirst,
    /// vLLM `[L, rows, 2, T, H, D]` (per layer `[num_blocks, 2, T, H, D]`).
    VllmBlockFirst,
}

impl EngineOrder {
    /// Parses a `kv_layout` name, naming the argument on error.
    pub(crate) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "block_major" => Ok(Self::BlockMajor),
            "vllm_kv_first" => Ok(Self::VllmKvFirst),
            "vllm_block_first" => Ok(Self::VllmBlockFirst),
            other => Err(bad_argument(
                "kv_layout",
                format!("`{other}` is not one of {NAMES}"),
            )),
        }
    }

    /// The shape one rank's tensor must have for `rows` blocks.
    pub(crate) fn shape(self, g: &KvLayout, rows: u32) -> Vec<usize> {
        let (l, t, h, d) = (
            g.num_layers() as usize,
            g.tokens_per_block() as usize,
            g.heads_per_rank() as usize,
            g.head_dim() as usize,
        );
        let rows = rows as usize;
        match self {
            Self::BlockMajor => vec![rows, g.rank_block_bytes() / g.dtype().size_bytes()],
            Self::VllmKvFirst => vec![l, 2, rows, t, h, d],
            Self::VllmBlockFirst => vec![l, rows, 2, t, h, d],
        }
    }

    /// Where each element of each block of rank `rank` lies in a tensor of
    /// [`EngineOrder::shape`] (C-contiguous, from byte 0).
    ///
    /// # Errors
    /// kv_descriptor's refusal (it names the field), e.g. an overflow.
    pub(crate) fn region(
        self,
        g: KvLayout,
        rank: u32,
        rows: u32,
    ) -> Result<KvRegionLayout, RegionLayoutError> {
        let rank_bytes = u64::from(rows) * g.rank_block_bytes() as u64;
        // One layer of every block, K and V: the stride between stacked layers.
        let layer_stride = rank_bytes / u64::from(g.num_layers());
        match self {
            Self::BlockMajor => KvRegionLayout::block_major(g, rank, 0, rows, rank_bytes),
            Self::VllmKvFirst => {
                KvRegionLayout::vllm_kv_first(g, rank, 0, layer_stride, rows, rank_bytes)
            }
            Self::VllmBlockFirst => {
                KvRegionLayout::vllm_block_first(g, rank, 0, layer_stride, rows, rank_bytes)
            }
        }
    }
}
