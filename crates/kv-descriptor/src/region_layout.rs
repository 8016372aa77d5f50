//! KV regions as engines hold them: where each element of each block lives.
//!
//! A [`KvLayout`] says what a model's KV cache *is* (layers, heads, dtype,
//! tokens per block, TP); a [`KvRegionLayout`] says where one TP rank's part of
//! it sits inside one memory region: a byte offset per layer and element
//! strides for block, K/V, token, head and head_dim. Donor banks are
//! block-major ([`KvRegionLayout::block_major`]); targets may be vLLM per-layer
//! tensors or HF-style caches at a token offset. A fetch between two regions
//! is allowed only when [`KvRegionLayout::check_compatible`] passes: same
//! geometry and TP rank, any memory order (converting, never resharding).
//!
//! Nothing here goes on the wire: [`KvLayout::fingerprint`] is unchanged and
//! stays the only layout identity exchanged between processes.

use crate::{DType, KvLayout};

/// Why a region layout was refused. Every variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionLayoutError {
    /// A size or count that must be at least 1 was 0.
    #[error("invalid `{field}`: must be at least 1, got 0")]
    Zero {
        /// Dotted field path, e.g. `region.num_blocks`.
        field: &'static str,
    },
    /// The number of per-layer offsets differs from the geometry's layers.
    #[error("invalid `region.layer_offsets`: {got} offsets for {expected} layers")]
    LayerCount {
        /// `num_layers` of the geometry.
        expected: u32,
        /// Offsets given.
        got: usize,
    },
    /// `tp_rank` is not below the geometry's `tp_size`.
    #[error("invalid `region.tp_rank`: {tp_rank} is not below tp_size {tp_size}")]
    TpRank {
        /// Rank given.
        tp_rank: u32,
        /// Group size of the geometry.
        tp_size: u32,
    },
    /// A byte offset is not a multiple of the element size.
    #[error("invalid `{field}`: byte offset {offset} is not a multiple of the {elem}-byte dtype")]
    Misaligned {
        /// Dotted field path (`region.layer_offsets`).
        field: &'static str,
        /// Offending offset in bytes.
        offset: u64,
        /// Element size in bytes.
        elem: usize,
    },
    /// Two dimensions (or two layers) address the same bytes.
    #[error("invalid `{field}`: overlaps `{other}` (distinct elements would share bytes)")]
    Overlap {
        /// The dimension or layer found overlapping (`region.strides.head`).
        field: &'static str,
        /// The one it overlaps.
        other: &'static str,
    },
    /// The last byte addressed lies beyond the region.
    #[error("invalid `{field}`: addresses bytes up to {end}, region has {region_bytes}")]
    OutOfBounds {
        /// Dotted field path (`region.layer_offsets`, `region.strides.block`).
        field: &'static str,
        /// One past the last byte addressed.
        end: u64,
        /// Region size in bytes.
        region_bytes: u64,
    },
    /// Arithmetic on the description overflowed `u64`.
    #[error("invalid `{field}`: offsets overflow 64 bits")]
    Overflow {
        /// Dotted field path.
        field: &'static str,
    },
    /// Donor and target describe different geometries: refused before a byte moves.
    #[error("incompatible `{field}`: donor {donor}, target {target} (conversion never reshards)")]
    Incompatible {
        /// Geometry field that differs (`geometry.dtype`, `region.tp_rank`, ...).
        field: &'static str,
        /// Donor's value.
        donor: String,
        /// Target's value.
        target: String,
    },
}

/// Element strides of one layer's tensor, in elements (not bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ElementStrides {
    /// Between consecutive KV blocks (block ids).
    pub block: u64,
    /// Between K (index 0) and V (index 1).
    pub kv: u64,
    /// Between consecutive tokens of a block.
    pub token: u64,
    /// Between consecutive KV heads of this rank.
    pub head: u64,
    /// Between consecutive head_dim elements.
    pub dim: u64,
}

/// Which engine convention a region follows (for reports; the strides decide).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionOrder {
    /// `[num_blocks, num_layers, 2, block_size, heads, head_dim]`: the bank layout.
    BlockMajor,
    /// vLLM per layer `[2, num_blocks, block_size, heads, head_dim]`.
    VllmKvFirst,
    /// vLLM per layer `[num_blocks, 2, block_size, heads, head_dim]`.
    VllmBlockFirst,
    /// HF per layer `[2, batch, heads, tokens, head_dim]` (K and V caches
    /// stacked), block `b` holding tokens `token_offset + b x block_size ..`.
    HfTokens {
        /// Token index where block 0 starts.
        token_offset: u64,
    },
}

/// One TP rank's KV cache as it lies in one memory region of `region_bytes`.
///
/// Element `(layer, block, kv, token, head, d)` is at byte
/// `layer_offsets[layer] + (block*s.block + kv*s.kv + token*s.token +
/// head*s.head + d*s.dim) * dtype_bytes`. Built only by the validating
/// constructors, so every addressed byte is inside the region and no two
/// elements share bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvRegionLayout {
    geometry: KvLayout,
    tp_rank: u32,
    order: RegionOrder,
    layer_offsets: Vec<u64>,
    strides: ElementStrides,
    num_blocks: u32,
    region_bytes: u64,
}

impl KvRegionLayout {
    /// Block-major region of `num_blocks` blocks at `base` (today's bank slot
    /// layout: one block = `geometry.rank_block_bytes()` contiguous bytes).
    ///
    /// # Errors
    /// As [`KvRegionLayout::new`].
    pub fn block_major(
        geometry: KvLayout,
        tp_rank: u32,
        base: u64,
        num_blocks: u32,
        region_bytes: u64,
    ) -> Result<Self, RegionLayoutError> {
        let (t, h, d) = dims(&geometry);
        let token = h * d;
        let kv = t * token;
        let layer = 2 * kv;
        let block = u64::from(geometry.num_layers()) * layer;
        let offsets = layer_offsets(&geometry, base, layer)?;
        Self::new(
            geometry,
            tp_rank,
            RegionOrder::BlockMajor,
            offsets,
            ElementStrides {
                block,
                kv,
                token,
                head: d,
                dim: 1,
            },
            num_blocks,
            region_bytes,
        )
    }

    /// vLLM per-layer tensors `[2, num_blocks, block_size, heads, head_dim]`,
    /// layer `l` at byte `base + l * layer_stride_bytes`.
    ///
    /// # Errors
    /// As [`KvRegionLayout::new`].
    pub fn vllm_kv_first(
        geometry: KvLayout,
        tp_rank: u32,
        base: u64,
        layer_stride_bytes: u64,
        num_blocks: u32,
        region_bytes: u64,
    ) -> Result<Self, RegionLayoutError> {
        let (t, h, d) = dims(&geometry);
        let token = h * d;
        let block = t * token;
        let kv = u64::from(num_blocks) * block;
        let offsets = byte_layer_offsets(&geometry, base, layer_stride_bytes)?;
        Self::new(
            geometry,
            tp_rank,
            RegionOrder::VllmKvFirst,
            offsets,
            ElementStrides {
                block,
                kv,
                token,
                head: d,
                dim: 1,
            },
            num_blocks,
            region_bytes,
        )
    }

    /// vLLM per-layer tensors `[num_blocks, 2, block_size, heads, head_dim]`,
    /// layer `l` at byte `base + l * layer_stride_bytes`.
    ///
    /// # Errors
    /// As [`KvRegionLayout::new`].
    pub fn vllm_block_first(
        geometry: KvLayout,
        tp_rank: u32,
        base: u64,
        layer_stride_bytes: u64,
        num_blocks: u32,
        region_bytes: u64,
    ) -> Result<Self, RegionLayoutError> {
        let (t, h, d) = dims(&geometry);
        let token = h * d;
        let kv = t * token;
        let block = 2 * kv;
        let offsets = byte_layer_offsets(&geometry, base, layer_stride_bytes)?;
        Self::new(
            geometry,
            tp_rank,
            RegionOrder::VllmBlockFirst,
            offsets,
            ElementStrides {
                block,
                kv,
                token,
                head: d,
                dim: 1,
            },
            num_blocks,
            region_bytes,
        )
    }

    /// HF-style per-layer cache `[2, batch, heads, max_tokens, head_dim]`
    /// (K then V), landing blocks for sequence `batch_index` from token
    /// `token_offset`: block `b` is tokens `token_offset + b*block_size ..`,
    /// and `num_blocks` blocks fit in `max_tokens`. Layer `l` at byte
    /// `base + l * layer_stride_bytes`.
    ///
    /// # Errors
    /// [`RegionLayoutError::Zero`] for `region.batch` / `region.max_tokens`,
    /// [`RegionLayoutError::OutOfBounds`] naming `region.batch_index` or
    /// `region.token_offset` when they exceed the cache,
    /// [`RegionLayoutError::Overflow`] naming `region.max_tokens` or
    /// `region.batch` when the cache's strides pass `u64`; else as
    /// [`KvRegionLayout::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn hf_tokens(
        geometry: KvLayout,
        tp_rank: u32,
        base: u64,
        layer_stride_bytes: u64,
        batch: u32,
        batch_index: u32,
        max_tokens: u64,
        token_offset: u64,
        num_blocks: u32,
        region_bytes: u64,
    ) -> Result<Self, RegionLayoutError> {
        if batch == 0 {
            return Err(RegionLayoutError::Zero {
                field: "region.batch",
            });
        }
        if max_tokens == 0 {
            return Err(RegionLayoutError::Zero {
                field: "region.max_tokens",
            });
        }
        if batch_index >= batch {
            return Err(RegionLayoutError::OutOfBounds {
                field: "region.batch_index",
                end: u64::from(batch_index) + 1,
                region_bytes: u64::from(batch),
            });
        }
        let (t, h, d) = dims(&geometry);
        let end_token = token_offset.checked_add(u64::from(num_blocks) * t).ok_or(
            RegionLayoutError::Overflow {
                field: "region.token_offset",
            },
        )?;
        if end_token > max_tokens {
            return Err(RegionLayoutError::OutOfBounds {
                field: "region.token_offset",
                end: end_token,
                region_bytes: max_tokens,
            });
        }
        let token = d;
        // `max_tokens` and `batch` are the caller's: the strides they span
        // are multiplied checked, so an impossible cache is refused as
        // `Overflow` instead of panicking or wrapping into a small stride.
        let overflow = |field| RegionLayoutError::Overflow { field };
        let head = max_tokens
            .checked_mul(d)
            .ok_or(overflow("region.max_tokens"))?;
        let seq = h.checked_mul(head).ok_or(overflow("region.max_tokens"))?;
        let kv = u64::from(batch)
            .checked_mul(seq)
            .ok_or(overflow("region.batch"))?;
        let elem = geometry.dtype().size_bytes() as u64;
        // The sequence and the token offset shift each layer's origin; the
        // block stride then walks whole blocks of tokens. Both terms are
        // below `kv` (batch_index < batch, token_offset < max_tokens), so
        // only the byte scaling can overflow.
        let shift = (u64::from(batch_index) * seq + token_offset * token)
            .checked_mul(elem)
            .ok_or(overflow("region.token_offset"))?;
        let mut offsets = byte_layer_offsets(&geometry, base, layer_stride_bytes)?;
        for o in &mut offsets {
            *o = o.checked_add(shift).ok_or(RegionLayoutError::Overflow {
                field: "region.layer_offsets",
            })?;
        }
        Self::new(
            geometry,
            tp_rank,
            RegionOrder::HfTokens { token_offset },
            offsets,
            ElementStrides {
                block: t * token,
                kv,
                token,
                head,
                dim: 1,
            },
            num_blocks,
            region_bytes,
        )
    }

    /// General validating constructor.
    ///
    /// # Errors
    /// [`RegionLayoutError::Zero`] (`region.num_blocks`, `region.region_bytes`,
    /// a zero stride of a dimension longer than 1), [`RegionLayoutError::TpRank`],
    /// [`RegionLayoutError::LayerCount`], [`RegionLayoutError::Misaligned`],
    /// [`RegionLayoutError::Overlap`] (two dimensions of a layer, or two
    /// layers, address the same bytes), [`RegionLayoutError::OutOfBounds`]
    /// (an addressed byte at or beyond `region_bytes`),
    /// [`RegionLayoutError::Overflow`].
    pub fn new(
        geometry: KvLayout,
        tp_rank: u32,
        order: RegionOrder,
        layer_offsets: Vec<u64>,
        strides: ElementStrides,
        num_blocks: u32,
        region_bytes: u64,
    ) -> Result<Self, RegionLayoutError> {
        if num_blocks == 0 {
            return Err(RegionLayoutError::Zero {
                field: "region.num_blocks",
            });
        }
        if region_bytes == 0 {
            return Err(RegionLayoutError::Zero {
                field: "region.region_bytes",
            });
        }
        if tp_rank >= geometry.tp_size() {
            return Err(RegionLayoutError::TpRank {
                tp_rank,
                tp_size: geometry.tp_size(),
            });
        }
        if layer_offsets.len() != geometry.num_layers() as usize {
            return Err(RegionLayoutError::LayerCount {
                expected: geometry.num_layers(),
                got: layer_offsets.len(),
            });
        }
        let elem = geometry.dtype().size_bytes();
        let (t, h, d) = dims(&geometry);
        let mut ext = [
            ("region.strides.block", u64::from(num_blocks), strides.block),
            ("region.strides.kv", 2, strides.kv),
            ("region.strides.token", t, strides.token),
            ("region.strides.head", h, strides.head),
            ("region.strides.dim", d, strides.dim),
        ];
        // Sorted by stride, each dimension must step past everything the
        // smaller ones span; otherwise two index tuples meet at one element.
        ext.sort_by_key(|e| e.2);
        let mut span: u64 = 1;
        let mut prev: &'static str = "element";
        for (field, n, s) in ext {
            if n <= 1 {
                continue;
            }
            if s == 0 {
                return Err(RegionLayoutError::Zero { field });
            }
            if s < span {
                return Err(RegionLayoutError::Overlap { field, other: prev });
            }
            span = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(span))
                .ok_or(RegionLayoutError::Overflow { field })?;
            prev = field;
        }
        let span_bytes = span
            .checked_mul(elem as u64)
            .ok_or(RegionLayoutError::Overflow {
                field: "region.strides",
            })?;
        let mut ranges = Vec::with_capacity(layer_offsets.len());
        for &o in &layer_offsets {
            if o % elem as u64 != 0 {
                return Err(RegionLayoutError::Misaligned {
                    field: "region.layer_offsets",
                    offset: o,
                    elem,
                });
            }
            let end = o
                .checked_add(span_bytes)
                .ok_or(RegionLayoutError::Overflow {
                    field: "region.layer_offsets",
                })?;
            if end > region_bytes {
                return Err(RegionLayoutError::OutOfBounds {
                    field: "region.layer_offsets",
                    end,
                    region_bytes,
                });
            }
            ranges.push((o, end));
        }
        // Interleaved layers (block-major) are legal: check exact element
        // collisions only when spans overlap, by the cheap sufficient rule
        // that the layer offsets step by at least the smallest gap the
        // strides leave unused. Block-major leaves exactly one layer's worth.
        if !layers_disjoint(&ranges) && !interleave_ok(&layer_offsets, &strides, &geometry, elem) {
            return Err(RegionLayoutError::Overlap {
                field: "region.layer_offsets",
                other: "region.strides",
            });
        }
        Ok(Self {
            geometry,
            tp_rank,
            order,
            layer_offsets,
            strides,
            num_blocks,
            region_bytes,
        })
    }

    /// Model geometry (layers, heads, head_dim, dtype, tokens per block, TP).
    pub fn geometry(&self) -> &KvLayout {
        &self.geometry
    }
    /// TP rank whose heads this region holds.
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }
    /// Engine convention the region was built for.
    pub fn order(&self) -> RegionOrder {
        self.order
    }
    /// Byte offset of each layer's origin within the region.
    pub fn layer_offsets(&self) -> &[u64] {
        &self.layer_offsets
    }
    /// Element strides shared by all layers.
    pub fn strides(&self) -> ElementStrides {
        self.strides
    }
    /// Blocks addressable in the region (valid block ids `0..num_blocks`).
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }
    /// Size of the region in bytes.
    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }
    /// Element size in bytes.
    pub fn dtype(&self) -> DType {
        self.geometry.dtype()
    }

    /// Byte offset of the contiguous `head_dim` run of
    /// `(layer, block, kv, token, head)`, or `None` when an index is out of
    /// range. The run is contiguous iff `strides().dim == 1`.
    pub fn run_offset(
        &self,
        layer: u32,
        block: u32,
        kv: u32,
        token: u32,
        head: u32,
    ) -> Option<u64> {
        let (t, h, _) = dims(&self.geometry);
        if layer >= self.geometry.num_layers()
            || block >= self.num_blocks
            || kv >= 2
            || u64::from(token) >= t
            || u64::from(head) >= h
        {
            return None;
        }
        let s = self.strides;
        let e = u64::from(block) * s.block
            + u64::from(kv) * s.kv
            + u64::from(token) * s.token
            + u64::from(head) * s.head;
        Some(self.layer_offsets[layer as usize] + e * self.geometry.dtype().size_bytes() as u64)
    }

    /// Refuses a donor -> target pair that is not the same geometry.
    ///
    /// Compared: layers, KV heads, head_dim, dtype, tokens per block, TP size
    /// and TP rank. Memory order (the geometry's `tensor_order` and the
    /// region strides) may differ: that is what the converting gather is for.
    ///
    /// # Errors
    /// [`RegionLayoutError::Incompatible`] naming the first field that differs.
    pub fn check_compatible(&self, target: &KvRegionLayout) -> Result<(), RegionLayoutError> {
        let (a, b) = (&self.geometry, &target.geometry);
        let pairs: [(&'static str, String, String); 7] = [
            (
                "geometry.num_layers",
                a.num_layers().to_string(),
                b.num_layers().to_string(),
            ),
            (
                "geometry.num_kv_heads",
                a.num_kv_heads().to_string(),
                b.num_kv_heads().to_string(),
            ),
            (
                "geometry.head_dim",
                a.head_dim().to_string(),
                b.head_dim().to_string(),
            ),
            (
                "geometry.dtype",
                format!("{:?}", a.dtype()),
                format!("{:?}", b.dtype()),
            ),
            (
                "geometry.tokens_per_block",
                a.tokens_per_block().to_string(),
                b.tokens_per_block().to_string(),
            ),
            (
                "geometry.tp_size",
                a.tp_size().to_string(),
                b.tp_size().to_string(),
            ),
            (
                "region.tp_rank",
                self.tp_rank.to_string(),
                target.tp_rank.to_string(),
            ),
        ];
        for (field, donor, target) in pairs {
            if donor != target {
                return Err(RegionLayoutError::Incompatible {
                    field,
                    donor,
                    target,
                });
            }
        }
        Ok(())
    }
}

/// Tokens per block, heads per rank, head_dim as `u64`.
fn dims(g: &KvLayout) -> (u64, u64, u64) {
    (
        u64::from(g.tokens_per_block()),
        u64::from(g.heads_per_rank()),
        u64::from(g.head_dim()),
    )
}

/// Block-major layer origins: layer `l` at `base + l * layer_elems * dtype`.
fn layer_offsets(g: &KvLayout, base: u64, layer_elems: u64) -> Result<Vec<u64>, RegionLayoutError> {
    byte_layer_offsets(g, base, layer_elems * g.dtype().size_bytes() as u64)
}

fn byte_layer_offsets(g: &KvLayout, base: u64, stride: u64) -> Result<Vec<u64>, RegionLayoutError> {
    (0..u64::from(g.num_layers()))
        .map(|l| {
            l.checked_mul(stride)
                .and_then(|x| x.checked_add(base))
                .ok_or(RegionLayoutError::Overflow {
                    field: "region.layer_offsets",
                })
        })
        .collect()
}

fn layers_disjoint(ranges: &[(u64, u64)]) -> bool {
    let mut r = ranges.to_vec();
    r.sort_unstable();
    r.windows(2).all(|w| w[0].1 <= w[1].0)
}

/// Interleaved layers (block-major: the block stride spans all layers) are
/// disjoint when the layers sit at equal steps of at least one layer's dense
/// extent inside one block and all of them fit within the block stride.
fn interleave_ok(offsets: &[u64], s: &ElementStrides, g: &KvLayout, elem: usize) -> bool {
    let (t, h, d) = dims(g);
    // Within one block a layer must be dense `[2, t, h, d]` in some order.
    let dense = 2 * t * h * d;
    let mut inner = [(2, s.kv), (t, s.token), (h, s.head), (d, s.dim)];
    inner.sort_by_key(|e| e.1);
    let mut want = 1;
    for (n, st) in inner {
        if n > 1 && st != want {
            return false;
        }
        want *= n;
    }
    let mut o = offsets.to_vec();
    o.sort_unstable();
    let step = dense * elem as u64;
    o.windows(2).all(|w| w[1] - w[0] >= step)
        && (o[o.len() - 1] - o[0]) / elem as u64 + dense <= s.block
}
