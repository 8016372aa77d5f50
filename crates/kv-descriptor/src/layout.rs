//! KV layout geometry: how one model's K/V cache is shaped and split across TP ranks.

use serde::{Deserialize, Serialize};

use crate::DescriptorError;

/// Element type of the K/V cache.
///
/// ```
/// use kv_descriptor::DType;
/// assert_eq!(DType::Bf16.size_bytes(), 2);
/// assert_eq!(DType::Fp8E4m3.size_bytes(), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    Fp16,
    /// FP8 E4M3 (the format vLLM calls `fp8`), 1 byte.
    Fp8E4m3,
    /// IEEE single, 4 bytes.
    F32,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Bf16 | DType::Fp16 => 2,
            DType::Fp8E4m3 => 1,
            DType::F32 => 4,
        }
    }
}

/// Order of the dimensions of the KV cache tensor in memory.
///
/// The order decides which bytes of one block are contiguous; two banks can
/// exchange blocks only if their orders are equal (part of the fingerprint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorOrder {
    /// vLLM's per-layer tensors `[2, num_blocks, block_size, kv_heads, head_dim]`:
    /// one block is `2 x num_layers` separate runs of
    /// `block_size x kv_heads x head_dim` elements.
    VllmPerLayer,
    /// Block-major `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`:
    /// one block (all layers, K and V) is a single contiguous run. Retained
    /// banks use this order so that one slot is one contiguous region.
    BlockMajor,
}

/// Geometry of one model's KV cache, as seen by the whole TP group.
///
/// Built only through [`KvLayout::new`], which checks every field and the
/// head-partition rule (`num_kv_heads % tp_size == 0`). Fewer KV heads than
/// ranks (head replication) is **not** supported: such a layout is refused.
///
/// ```
/// use kv_descriptor::{DType, KvLayout, TensorOrder};
/// // Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks, TP2.
/// let l = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
/// assert_eq!(l.heads_per_rank(), 4);
/// // 2 (K,V) x 32 layers x 16 tokens x 4 heads x 128 dims x 2 bytes
/// assert_eq!(l.rank_block_bytes(), 2 * 32 * 16 * 4 * 128 * 2);
/// assert!(KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 3).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawKvLayout")]
pub struct KvLayout {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: DType,
    tokens_per_block: u32,
    tensor_order: TensorOrder,
    tp_size: u32,
}

#[derive(Deserialize)]
struct RawKvLayout {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: DType,
    tokens_per_block: u32,
    tensor_order: TensorOrder,
    tp_size: u32,
}

impl TryFrom<RawKvLayout> for KvLayout {
    type Error = DescriptorError;
    fn try_from(r: RawKvLayout) -> Result<Self, Self::Error> {
        KvLayout::new(
            r.num_layers,
            r.num_kv_heads,
            r.head_dim,
            r.dtype,
            r.tokens_per_block,
            r.tensor_order,
            r.tp_size,
        )
    }
}

/// Upper bound on one rank's part of one block (1 GiB): anything larger is a
/// corrupted or hostile descriptor, not a model.
pub const MAX_RANK_BLOCK_BYTES: u64 = 1 << 30;

impl KvLayout {
    /// Validating constructor.
    ///
    /// # Errors
    /// [`DescriptorError::InvalidField`] naming `layout.<field>` when a count is
    /// zero, when `num_kv_heads` is not divisible by `tp_size`, or (naming
    /// `layout`) when one rank's block part would exceed
    /// [`MAX_RANK_BLOCK_BYTES`], a product past `u64` included.
    pub fn new(
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: DType,
        tokens_per_block: u32,
        tensor_order: TensorOrder,
        tp_size: u32,
    ) -> Result<Self, DescriptorError> {
        for (field, v) in [
            ("layout.num_layers", num_layers),
            ("layout.num_kv_heads", num_kv_heads),
            ("layout.head_dim", head_dim),
            ("layout.tokens_per_block", tokens_per_block),
            ("layout.tp_size", tp_size),
        ] {
            if v == 0 {
                return Err(DescriptorError::field(field, "must be at least 1, got 0"));
            }
        }
        if num_kv_heads % tp_size != 0 {
            return Err(DescriptorError::field(
                "layout.tp_size",
                format!(
                    "num_kv_heads {num_kv_heads} is not divisible by tp_size {tp_size} \
                     (head replication across ranks is not supported)"
                ),
            ));
        }
        let l = Self {
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            tokens_per_block,
            tensor_order,
            tp_size,
        };
        // Five u32 factors reach 2^131: multiplied checked, so that a
        // hostile layout is refused instead of panicking (debug builds) or
        // wrapping to a small size that passes the bound (release builds).
        let bytes = [
            u64::from(num_layers),
            u64::from(tokens_per_block),
            u64::from(l.heads_per_rank()),
            u64::from(head_dim),
            dtype.size_bytes() as u64,
        ]
        .into_iter()
        .try_fold(2u64, u64::checked_mul);
        match bytes {
            Some(b) if b <= MAX_RANK_BLOCK_BYTES => Ok(l),
            _ => Err(DescriptorError::field(
                "layout",
                format!(
                    "one rank's block part would be {}, above {MAX_RANK_BLOCK_BYTES}",
                    match bytes {
                        Some(b) => format!("{b} bytes"),
                        None => "more than 2^64 bytes".to_string(),
                    }
                ),
            )),
        }
    }

    /// Number of transformer layers.
    pub fn num_layers(&self) -> u32 {
        self.num_layers
    }
    /// Total KV heads of the model (all ranks together).
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Tokens in one KV block.
    pub fn tokens_per_block(&self) -> u32 {
        self.tokens_per_block
    }
    /// Memory order of the cache tensor.
    pub fn tensor_order(&self) -> TensorOrder {
        self.tensor_order
    }
    /// Tensor-parallel group size.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }
    /// KV heads held by each rank: `num_kv_heads / tp_size`.
    pub fn heads_per_rank(&self) -> u32 {
        self.num_kv_heads / self.tp_size
    }

    /// Bytes of one rank's part of one block across all layers, K and V:
    /// `2 x num_layers x tokens_per_block x heads_per_rank x head_dim x dtype`.
    ///
    /// At most [`MAX_RANK_BLOCK_BYTES`] (checked by [`KvLayout::new`]), so
    /// the product cannot overflow here.
    pub fn rank_block_bytes(&self) -> usize {
        2 * self.num_layers as usize
            * self.tokens_per_block as usize
            * self.heads_per_rank() as usize
            * self.head_dim as usize
            * self.dtype.size_bytes()
    }

    /// Bytes of one block over the whole TP group (`rank_block_bytes x tp_size`).
    ///
    /// At most `2^30 x 2^32` (`tp_size` divides `num_kv_heads`, a `u32`),
    /// which fits a 64-bit `usize`.
    pub fn block_bytes(&self) -> usize {
        self.rank_block_bytes() * self.tp_size as usize
    }

    /// Bytes of K/V for one token on one rank, all layers.
    pub fn rank_token_bytes(&self) -> usize {
        self.rank_block_bytes() / self.tokens_per_block as usize
    }

    /// Stable 64-bit fingerprint of the geometry (all fields, no rank).
    ///
    /// XXH3-64 (seed 1337) over a fixed little-endian encoding, so it is the
    /// same on every host and release as long as the fields are equal. Two
    /// banks may exchange blocks only if their fingerprints are equal.
    ///
    /// ```
    /// use kv_descriptor::{DType, KvLayout, TensorOrder};
    /// let a = KvLayout::new(4, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
    /// let b = KvLayout::new(4, 8, 64, DType::Fp16, 16, TensorOrder::BlockMajor, 2).unwrap();
    /// assert_ne!(a.fingerprint(), b.fingerprint());
    /// ```
    pub fn fingerprint(&self) -> LayoutFingerprint {
        let mut buf = Vec::with_capacity(32);
        buf.extend_from_slice(b"kvlayout1");
        for v in [
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.tokens_per_block,
            self.tp_size,
        ] {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        buf.push(match self.dtype {
            DType::Bf16 => 1,
            DType::Fp16 => 2,
            DType::Fp8E4m3 => 3,
            DType::F32 => 4,
        });
        buf.push(match self.tensor_order {
            TensorOrder::VllmPerLayer => 1,
            TensorOrder::BlockMajor => 2,
        });
        LayoutFingerprint(xxhash_rust::xxh3::xxh3_64_with_seed(&buf, crate::XXH3_SEED))
    }
}

/// Fingerprint of a [`KvLayout`]; see [`KvLayout::fingerprint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LayoutFingerprint(pub u64);

impl std::fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}
