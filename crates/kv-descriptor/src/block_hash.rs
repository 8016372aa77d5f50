//! Block identity: per-block token hashes and chained sequence hashes.
//!
//! The scheme is the Dynamo router's (`dynamo-kv-router` 1.6.1,
//! `protocols::compute_block_hash_for_seq` and `compute_seq_hash_for_block`,
//! no LoRA, no salt, no multimodal info):
//! - token hash of a full block = XXH3-64, seed 1337, over the block's token ids
//!   as little-endian `u32` bytes;
//! - sequence hash of block 0 = its token hash; of block `i > 0` = XXH3-64,
//!   seed 1337, over `parent_sequence_hash.to_le_bytes() ++ token_hash.to_le_bytes()`;
//! - a trailing partial block has no hash (only sealed, full blocks are named).

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::XXH3_SEED;

/// Hash of one block's tokens alone (Dynamo's `LocalBlockHash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenBlockHash(pub u64);

/// Hash of a block and its whole prefix (Dynamo's `SequenceHash` /
/// `ExternalSequenceBlockHash`): equal sequence hashes mean equal prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SequenceHash(pub u64);

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
