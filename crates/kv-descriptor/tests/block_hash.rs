//! Block identity equals the Dynamo router's (dynamo-kv-router 1.6.1).

use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions,
};
use kv_descriptor::*;
use proptest::prelude::*;

fn dynamo_token_hashes(tokens: &[u32], block: u32) -> Vec<u64> {
    compute_block_hash_for_seq(tokens, block, BlockHashOptions::default())
        .into_iter()
        .map(|h| h.0)
        .collect()
}

fn dynamo_sequence_hashes(tokens: &[u32], block: u32) -> Vec<u64> {
    compute_seq_hash_for_block(&compute_block_hash_for_seq(
        tokens,
        block,
        BlockHashOptions::default(),
    ))
}

#[test]
fn published_dynamo_test_vectors() {
    // Constants from dynamo-tokens 1.6.1's own tests (block size 4, seed 1337).
    let t: Vec<u32> = (1..=12).collect();
    let tok: Vec<u64> = token_block_hashes(&t, 4).into_iter().map(|h| h.0).collect();
    assert_eq!(
        tok,
        vec![
            14643705804678351452,
            16777012769546811212,
            483935686894639516
        ]
    );
    let seq: Vec<u64> = sequence_hashes(&t, 4).into_iter().map(|h| h.0).collect();
    assert_eq!(
        seq,
        vec![
            14643705804678351452,
            4945711292740353085,
            12583592247330656132
        ]
    );
}

#[test]
fn only_full_blocks_are_named() {
    let t: Vec<u32> = (0..35).collect();
    assert_eq!(sequence_hashes(&t, 16).len(), 2);
    assert_eq!(sequence_hashes(&t[..15], 16).len(), 0);
    // The unsealed tail does not change the sealed blocks' hashes.
    assert_eq!(sequence_hashes(&t, 16), sequence_hashes(&t[..32], 16));
    assert_eq!(dynamo_sequence_hashes(&t, 16).len(), 2);
}

#[test]
fn parent_chaining() {
    let a: Vec<u32> = (0..48).collect();
    let mut b = a.clone();
    b[0] = 999;
    let (ha, hb) = (sequence_hashes(&a, 16), sequence_hashes(&b, 16));
    // A change in block 0 changes every later sequence hash ...
    for i in 0..3 {
        assert_ne!(ha[i], hb[i], "block {i}");
    }
    // ... but not the later blocks' own token hashes.
    assert_eq!(
        token_block_hashes(&a, 16)[1..],
        token_block_hashes(&b, 16)[1..]
    );
    assert_eq!(chain_sequence_hash(None, token_block_hash(&a[..16])), ha[0]);
    assert_eq!(
        chain_sequence_hash(Some(ha[1]), token_block_hash(&a[32..48])),
        ha[2]
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn equal_to_dynamo(tokens in proptest::collection::vec(any::<u32>(), 0..400), block in 1u32..=64) {
        let ours_tok: Vec<u64> = token_block_hashes(&tokens, block as usize).into_iter().map(|h| h.0).collect();
        prop_assert_eq!(ours_tok, dynamo_token_hashes(&tokens, block));
        let ours_seq: Vec<u64> = sequence_hashes(&tokens, block as usize).into_iter().map(|h| h.0).collect();
        prop_assert_eq!(ours_seq, dynamo_sequence_hashes(&tokens, block));
    }

    /// Hashes of a prefix are the prefix of the hashes: what makes a retained
    /// conversation findable by a later, longer request.
    #[test]
    fn prefix_closed(tokens in proptest::collection::vec(0u32..50_000, 0..300), cut in 0usize..300, block in 1usize..=32) {
        let cut = cut.min(tokens.len());
        let full = sequence_hashes(&tokens, block);
        let pre = sequence_hashes(&tokens[..cut], block);
        prop_assert_eq!(&full[..pre.len()], &pre[..]);
    }
}
