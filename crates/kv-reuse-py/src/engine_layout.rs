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
pub(crate) const NAMES: &str = "block_major, vllm_kv_first, vllm_block_first, hf";

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
    /// HF-style per-layer caches `[1, H, capacity, D]`, K and V per layer
    /// (2 * L tensors per rank, [`hf_region`]); block `b` = tokens `b*T ..`.
    Hf,
}

impl EngineOrder {
    /// Parses a `kv_layout` name, naming the argument on error.
    pub(crate) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "block_major" => Ok(Self::BlockMajor),
            "vllm_kv_first" => Ok(Self::VllmKvFirst),
            "vllm_block_first" => Ok(Self::VllmBlockFirst),
            "hf" => Ok(Self::Hf),
            other => Err(bad_argument(
                "kv_layout",
                format!("`{other}` is not one of {NAMES}"),
            )),
        }
    }

    /// The `kv_layout` name `parse` takes for this order.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::BlockMajor => "block_major",
            Self::VllmKvFirst => "vllm_kv_first",
            Self::VllmBlockFirst => "vllm_block_first",
            Self::Hf => "hf",
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
            // Per tensor, capacity at least rows * T (checked by hf_region).
            Self::Hf => vec![1, h, rows * t, d],
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
            // Built from the tensors' addresses by `hf_region`, never here.
            Self::Hf => Err(RegionLayoutError::Zero {
                field: "region.layer_offsets",
            }),
        }
    }
}

/// `kv_layout="hf"`: one TP rank's HF-style per-layer caches, `2 * L`
/// tensors `[1, H, capacity, D]` (K0, V0, K1, V1, ...), each with a dense
/// last axis and the same strides; block `b` is tokens `b*T .. (b+1)*T`.
///
/// The region spans every tensor from the lowest address; kv_descriptor's
/// `KvRegionLayout` has one K-to-V distance for all layers, so `V_l - K_l`
/// must be the same in every layer (the caches are views of one buffer,
/// e.g. `buf[l, 0]`, `buf[l, 1]` of `[L, 2, 1, H, capacity, D]`).
///
/// Returns the region layout, the region's base address and length.
///
/// # Errors
/// `BadArgument` naming `kv_caches[r][i]` (shape, strides, a V at another
/// distance from its K than layer 0's, capacity below `rows * T`) or
/// `kv_layout` (kv_descriptor's refusal).
pub(crate) fn hf_region(
    g: KvLayout,
    rank: u32,
    rows: u32,
    views: &[crate::array::ArrayView<'_>],
) -> PyResult<(KvRegionLayout, usize, usize)> {
    let (l, t, h, d) = (
        g.num_layers() as usize,
        g.tokens_per_block() as usize,
        g.heads_per_rank() as usize,
        g.head_dim() as usize,
    );
    let elem = g.dtype().size_bytes();
    let arg = |i: usize| format!("kv_caches[{rank}][{i}]");
    let need = rows as usize * t;
    let strides = views[0].strides().to_vec();
    for (i, v) in views.iter().enumerate() {
        let s = v.shape();
        if s.len() != 4 || s[0] != 1 || s[1] != h || s[3] != d {
            return Err(bad_argument(
                &arg(i),
                format!("shape {s:?}, expected [1, {h}, capacity, {d}]"),
            ));
        }
        if s[2] < need {
            return Err(bad_argument(
                &arg(i),
                format!(
                    "capacity {} tokens < rows * tokens_per_block = {need}",
                    s[2]
                ),
            ));
        }
        if v.strides()[1..] != strides[1..] {
            return Err(bad_argument(
                &arg(i),
                format!(
                    "strides {:?} differ from kv_caches[{rank}][0]'s {strides:?}",
                    v.strides()
                ),
            ));
        }
    }
    let base = views.iter().map(|v| v.addr()).min().unwrap_or(0);
    let end = views
        .iter()
        .map(|v| v.addr() + v.span_bytes())
        .max()
        .unwrap_or(0);
    let kv_bytes = views[1].addr() as i128 - views[0].addr() as i128;
    for layer in 0..l {
        let dist = views[2 * layer + 1].addr() as i128 - views[2 * layer].addr() as i128;
        if dist != kv_bytes || dist <= 0 || dist % elem as i128 != 0 {
            return Err(bad_argument(
                &arg(2 * layer + 1),
                format!(
                    "V lies {dist} bytes from its K, layer 0's {kv_bytes}: one positive \
                     K-to-V distance for every layer is needed (views of one buffer)"
                ),
            ));
        }
    }
    let el = |b: isize| b as u64 / elem as u64;
    let token = el(strides[2]);
    let offsets = (0..l)
        .map(|layer| (views[2 * layer].addr() - base) as u64)
        .collect();
    let layout = KvRegionLayout::new(
        g,
        rank,
        kv_descriptor::RegionOrder::HfTokens { token_offset: 0 },
        offsets,
        kv_descriptor::ElementStrides {
            block: t as u64 * token,
            kv: kv_bytes as u64 / elem as u64,
            token,
            head: el(strides[1]),
            dim: 1,
        },
        rows,
        (end - base) as u64,
    )
    .map_err(|e| bad_argument("kv_layout", format!("rank {rank}: {e}")))?;
    Ok((layout, base, end - base))
}
