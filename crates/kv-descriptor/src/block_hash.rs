//! Block identity: per-block token hashes and chained sequence hashes.
//!
//! The scheme is the Dynamo router's (`dynamo-kv-router` 1.6.1,
//! `protocols::compute_block_hash_for_seq` and `compute_seq_hash_for_block`):
//! - token hash of a full block = XXH3-64 over the block's token ids as
//!   little-endian `u32` bytes, followed by the block's multimodal object
//!   hashes (sorted, little-endian `u64`) when it has any; the seed is 1337
//!   without a [`HashNamespace`], else [`HashNamespace::seed`] (Dynamo's
//!   `compute_salt_hash(cache_namespace, lora_name)`);
//! - sequence hash of block 0 = its token hash; of block `i > 0` = XXH3-64,
//!   seed 1337, over `parent_sequence_hash.to_le_bytes() ++ token_hash.to_le_bytes()`;
//! - a trailing partial block has no hash (only sealed, full blocks are named).

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::{StoredBlock, XXH3_SEED};

/// Hash of one block's tokens alone (Dynamo's `LocalBlockHash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenBlockHash(pub u64);

/// Hash of a block and its whole prefix (Dynamo's `SequenceHash` /
/// `ExternalSequenceBlockHash`): equal sequence hashes mean equal prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SequenceHash(pub u64);

/// The extra keys that put a block into a separate cache namespace: the same
/// tokens under another LoRA adapter or cache salt are different KV.
///
/// vLLM mixes the same identities into its block hashes (`lora_name`,
/// `cache_salt` and multimodal hashes in `generate_block_hash_extra_keys`);
/// Dynamo's router mixes `lora_name` and `cache_namespace` into the XXH3 seed
/// (`dynamo-kv-hashing` `compute_salt_hash`), which [`HashNamespace::seed`]
/// reproduces. Empty strings count as absent (as in Dynamo), so the default
/// namespace hashes exactly like the unkeyed functions.
///
/// ```
/// use kv_descriptor::{sequence_hashes, sequence_hashes_keyed, HashNamespace};
/// let t: Vec<u32> = (0..32).collect();
/// assert_eq!(sequence_hashes_keyed(&t, 16, &HashNamespace::default(), &[]), sequence_hashes(&t, 16));
/// let a = HashNamespace::lora("adapter-a");
/// assert_ne!(sequence_hashes_keyed(&t, 16, &a, &[]), sequence_hashes(&t, 16));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HashNamespace {
    /// LoRA adapter name (vLLM `lora_name`, Dynamo `lora_name`); `None` or
    /// empty: the base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// Cache salt (vLLM `cache_salt`, Dynamo `cache_namespace`); `None` or
    /// empty: unsalted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

impl HashNamespace {
    /// Namespace of one LoRA adapter, unsalted.
    pub fn lora(name: impl Into<String>) -> Self {
        Self {
            lora_name: Some(name.into()),
            cache_salt: None,
        }
    }

    /// True for the base model without salt (hashes as the unkeyed functions).
    pub fn is_default(&self) -> bool {
        self.lora_str().is_none() && self.salt_str().is_none()
    }

    fn lora_str(&self) -> Option<&str> {
        self.lora_name.as_deref().filter(|s| !s.is_empty())
    }

    fn salt_str(&self) -> Option<&str> {
        self.cache_salt.as_deref().filter(|s| !s.is_empty())
    }

    /// XXH3 seed of token hashes in this namespace: 1337, plus
    /// `XXH3-64(lora_name, seed 0)`, plus `XXH3-64(cache_salt, seed 1)`
    /// (wrapping adds; Dynamo's `compute_salt_hash`).
    pub fn seed(&self) -> u64 {
        let mut seed = XXH3_SEED;
        if let Some(l) = self.lora_str() {
            seed = seed.wrapping_add(xxh3_64_with_seed(l.as_bytes(), 0));
        }
        if let Some(s) = self.salt_str() {
            seed = seed.wrapping_add(xxh3_64_with_seed(s.as_bytes(), 1));
        }
        seed
    }
}

/// Token hash of one full block in a namespace, with the hashes of the
/// multimodal objects whose placeholders lie in the block (any order; they
/// are sorted here, as Dynamo does). Equal to [`token_block_hash`] for the
/// default namespace and no multimodal hashes.
pub fn token_block_hash_keyed(
    tokens: &[u32],
    namespace: &HashNamespace,
    mm_hashes: &[u64],
) -> TokenBlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4 + mm_hashes.len() * 8);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let mut mm = mm_hashes.to_vec();
    mm.sort_unstable();
    for h in mm {
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    TokenBlockHash(xxh3_64_with_seed(&bytes, namespace.seed()))
}

/// Chained sequence hashes of every full block of `tokens` in `namespace`,
/// root first. `block_mm_hashes[i]` lists the multimodal object hashes of
/// block `i` (blocks past its end have none). Equal to Dynamo's
/// `compute_seq_hash_for_block(compute_block_hash_for_seq(..))` with the same
/// `lora_name`, `cache_namespace` (= `cache_salt`) and `block_mm_infos`.
///
/// # Panics
/// If `tokens_per_block` is 0.
pub fn sequence_hashes_keyed(
    tokens: &[u32],
    tokens_per_block: usize,
    namespace: &HashNamespace,
    block_mm_hashes: &[Vec<u64>],
) -> Vec<SequenceHash> {
    assert!(tokens_per_block > 0, "tokens_per_block must be > 0");
    let mut parent = None;
    tokens
        .chunks_exact(tokens_per_block)
        .enumerate()
        .map(|(i, block)| {
            let mm = block_mm_hashes.get(i).map_or(&[][..], Vec::as_slice);
            let s = chain_sequence_hash(parent, token_block_hash_keyed(block, namespace, mm));
            parent = Some(s);
            s
        })
        .collect()
}

/// Token hash of one full block.
///
/// ```
/// use kv_descriptor::token_block_hash;
/// assert_ne!(token_block_hash(&[1, 2, 3, 4]), token_block_hash(&[1, 2, 3, 5]));
/// ```
pub fn token_block_hash(tokens: &[u32]) -> TokenBlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    TokenBlockHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
}

/// Sequence hash of a block given its parent's sequence hash (`None` for the root).
pub fn chain_sequence_hash(parent: Option<SequenceHash>, block: TokenBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(block.0),
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.0.to_le_bytes());
            bytes[8..].copy_from_slice(&block.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
        }
    }
}

/// Token hashes of every *full* block of `tokens`, root first; a trailing
/// partial block has none.
///
/// # Panics
/// If `tokens_per_block` is 0 (a layout never has that: [`crate::KvLayout`]
/// refuses it).
///
/// ```
/// use kv_descriptor::token_block_hashes;
/// assert_eq!(token_block_hashes(&[0; 35], 16).len(), 2); // 3 tokens left unsealed
/// ```
pub fn token_block_hashes(tokens: &[u32], tokens_per_block: usize) -> Vec<TokenBlockHash> {
    assert!(tokens_per_block > 0, "tokens_per_block must be > 0");
    tokens
        .chunks_exact(tokens_per_block)
        .map(token_block_hash)
        .collect()
}

/// Chained sequence hashes of every full block of `tokens`, root first:
/// equal to Dynamo's `compute_seq_hash_for_block(compute_block_hash_for_seq(..))`
/// with default options.
///
/// # Panics
/// If `tokens_per_block` is 0.
///
/// ```
/// use kv_descriptor::{sequence_hashes, chain_sequence_hash, token_block_hash};
/// let t: Vec<u32> = (0..32).collect();
/// let s = sequence_hashes(&t, 16);
/// assert_eq!(s[0].0, token_block_hash(&t[..16]).0);
/// assert_eq!(s[1], chain_sequence_hash(Some(s[0]), token_block_hash(&t[16..])));
/// ```
pub fn sequence_hashes(tokens: &[u32], tokens_per_block: usize) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(tokens.len() / tokens_per_block.max(1));
    let mut parent = None;
    for h in token_block_hashes(tokens, tokens_per_block) {
        let s = chain_sequence_hash(parent, h);
        out.push(s);
        parent = Some(s);
    }
    out
}

/// The [`StoredBlock`]s of a chain of blocks whose token hashes are
/// `token_hashes` (root first), the first a child of `parent` (`None`: the
/// chain starts at the root): each block's sequence hash chained from the
/// one before ([`chain_sequence_hash`]), its token hash, and no slot (a
/// retained bank's events set theirs when the slots are known).
///
/// `chain_stored_blocks(None, token_block_hashes(t, n))` names the same
/// blocks as [`sequence_hashes`]`(t, n)`, with their token hashes: what a
/// `Stored` event carries.
///
/// ```
/// use kv_descriptor::{chain_stored_blocks, sequence_hashes, token_block_hash, token_block_hashes};
/// let t: Vec<u32> = (0..48).collect();
/// let blocks = chain_stored_blocks(None, token_block_hashes(&t, 16));
/// let seq: Vec<_> = blocks.iter().map(|b| b.sequence_hash).collect();
/// assert_eq!(seq, sequence_hashes(&t, 16));
/// assert_eq!(blocks[2].token_hash, token_block_hash(&t[32..]));
/// assert!(blocks.iter().all(|b| b.slot.is_none()));
/// // From a parent: the rest of the same chain.
/// let tail = chain_stored_blocks(Some(seq[0]), token_block_hashes(&t[16..], 16));
/// assert_eq!(tail, blocks[1..]);
/// ```
pub fn chain_stored_blocks(
    parent: Option<SequenceHash>,
    token_hashes: impl IntoIterator<Item = TokenBlockHash>,
) -> Vec<StoredBlock> {
    let mut prev = parent;
    token_hashes
        .into_iter()
        .map(|token_hash| {
            let sequence_hash = chain_sequence_hash(prev, token_hash);
            prev = Some(sequence_hash);
            StoredBlock {
                sequence_hash,
                token_hash,
                slot: None,
            }
        })
        .collect()
}
