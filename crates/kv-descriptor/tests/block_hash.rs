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

/// Dynamo's hashes with extra keys: `lora_name`, `cache_namespace` (our
/// cache salt) and per-block multimodal hashes.
fn dynamo_keyed(tokens: &[u32], block: u32, ns: &HashNamespace, mm: &[Vec<u64>]) -> Vec<u64> {
    use dynamo_kv_router::protocols::{BlockExtraInfo, BlockMmObjectInfo};
    let infos: Vec<Option<BlockExtraInfo>> = mm
        .iter()
        .map(|hs| {
            (!hs.is_empty()).then(|| BlockExtraInfo {
                mm_objects: hs
                    .iter()
                    .map(|&mm_hash| BlockMmObjectInfo {
                        mm_hash,
                        offsets: vec![(0, 1)],
                    })
                    .collect(),
            })
        })
        .collect();
    let opts = BlockHashOptions {
        block_mm_infos: (!mm.is_empty()).then_some(infos.as_slice()),
        lora_name: ns.lora_name.as_deref(),
        cache_namespace: ns.cache_salt.as_deref(),
        is_eagle: None,
    };
    compute_seq_hash_for_block(&compute_block_hash_for_seq(tokens, block, opts))
}

fn ours_keyed(tokens: &[u32], block: u32, ns: &HashNamespace, mm: &[Vec<u64>]) -> Vec<u64> {
    sequence_hashes_keyed(tokens, block as usize, ns, mm)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

#[test]
fn namespaces_equal_dynamo_and_separate_adapters_and_salts() {
    let t: Vec<u32> = (100..164).collect();
    let ns = |l: Option<&str>, s: Option<&str>| HashNamespace {
        lora_name: l.map(str::to_owned),
        cache_salt: s.map(str::to_owned),
    };
    let cases = [
        ns(None, None),
        ns(Some("adapter-a"), None),
        ns(Some("adapter-b"), None),
        ns(None, Some("tenant-1")),
        ns(Some("adapter-a"), Some("tenant-1")),
        // Empty strings are absent, in Dynamo and here.
        ns(Some(""), Some("")),
    ];
    let mut seen = std::collections::HashSet::new();
    for c in &cases {
        let ours = ours_keyed(&t, 16, c, &[]);
        assert_eq!(ours, dynamo_keyed(&t, 16, c, &[]), "{c:?}");
        assert_eq!(ours.len(), 4);
        seen.insert(ours);
    }
    // The first and the last case are both the default namespace; every
    // other one names different blocks.
    assert_eq!(seen.len(), cases.len() - 1);
    assert_eq!(
        ours_keyed(&t, 16, &cases[0], &[]),
        dynamo_sequence_hashes(&t, 16)
    );
    assert!(cases[5].is_default() && !cases[1].is_default());
}

#[test]
fn multimodal_hashes_equal_dynamo_and_change_only_from_their_block_on() {
    let t: Vec<u32> = (0..64).collect();
    let plain = HashNamespace::default();
    // Block 1 holds two images (order does not matter), block 3 one.
    let mm = vec![vec![], vec![0xBEEF, 0x1234], vec![], vec![77]];
    let ours = ours_keyed(&t, 16, &plain, &mm);
    assert_eq!(ours, dynamo_keyed(&t, 16, &plain, &mm));
    let swapped = vec![vec![], vec![0x1234, 0xBEEF], vec![], vec![77]];
    assert_eq!(ours, ours_keyed(&t, 16, &plain, &swapped));
    let base = dynamo_sequence_hashes(&t, 16);
    assert_eq!(ours[0], base[0]);
    assert!(ours[1..].iter().zip(&base[1..]).all(|(a, b)| a != b));
    let other_image = vec![vec![], vec![0xBEEF, 0x1235], vec![], vec![77]];
    assert_ne!(ours[1], ours_keyed(&t, 16, &plain, &other_image)[1]);
}
