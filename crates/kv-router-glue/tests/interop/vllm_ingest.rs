//! vLLM events mapped into the inventory index (no sockets).

use std::sync::Arc;

use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerKey};
use kv_router_glue::vllm_events::*;

const BS: u32 = 4;

fn worker() -> VllmWorker {
    VllmWorker {
        key: WorkerKey(42),
        engine: EngineId::fresh(),
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0xF00D),
        tp_size: 1,
        tokens_per_block: BS,
    }
}

fn stored(names: &[u64], parent: Option<u64>, tokens: &[u32], medium: Option<&str>) -> VllmEvent {
    VllmEvent::BlockStored {
        block_hashes: names.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS,
        lora_id: None,
        medium: medium.map(str::to_owned),
        lora_name: None,
        extra_keys: vec![],
        group_idx: None,
    }
}

fn batch(events: Vec<VllmEvent>) -> VllmEventBatch {
    VllmEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    }
}

#[test]
fn stored_blocks_get_our_chained_sequence_hashes() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let tokens: Vec<u32> = (100..124).collect(); // 6 blocks
    let ours = sequence_hashes(&tokens, BS as usize);
    // Two events: blocks 0..2 as a root, then 2..6 as children of vLLM block 0xB1.
    let out = ingest.apply_batch(&batch(vec![
        stored(&[0xB0, 0xB1], None, &tokens[..8], Some("GPU")),
        stored(&[0xB2, 0xB3, 0xB4, 0xB5], Some(0xB1), &tokens[8..], None),
    ]));
    assert_eq!(out.applied, 2);
    assert_eq!(out.changed, 6);
    assert!(out.skipped.is_empty());
    for (i, h) in ours.iter().enumerate() {
        assert_eq!(ingest.sequence_hash(0xB0 + i as u64), Some(*h), "block {i}");
        assert_eq!(index.holds(w.engine, *h), vec![StorageTier::Device]);
    }
    // A lookup-style check: the same hashes a router computes from the
    // request tokens are what the index holds.
    assert_eq!(index.stats().held_blocks, [6, 0, 0, 0, 0]);
    let (key, info) = index.worker(w.engine).unwrap();
    assert_eq!(key, WorkerKey(42));
    assert_eq!(info.role, Role::Decode);
}

#[test]
fn removals_and_tiers_follow_the_medium() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let ours = sequence_hashes(&tokens, BS as usize);
    let out = ingest.apply_batch(&batch(vec![
        stored(&[1, 2], None, &tokens, Some("GPU")),
        // A CPU copy of block 1 alone does not chain in that tier: skipped
        // (the index would refuse it and mark the worker for resync).
        stored(&[2], Some(1), &tokens[4..], Some("CPU")),
        // Offloaded copies of blocks 0 and 1 in CPU memory, same vLLM names.
        stored(&[1, 2], None, &tokens, Some("CPU")),
    ]));
    assert_eq!(out.skipped, vec![(1, SkipReason::ParentNotHeld)]);
    assert!(index.workers_needing_resync().is_empty());
    assert_eq!(
        index.holds(w.engine, ours[1]),
        vec![StorageTier::Device, StorageTier::HostPinned]
    );
    let out = ingest.apply_batch(&batch(vec![VllmEvent::BlockRemoved {
        block_hashes: vec![2, 999],
        medium: Some("GPU".into()),
        group_idx: None,
    }]));
    assert_eq!(out.unknown_removals, 1);
    assert_eq!(
        index.holds(w.engine, ours[1]),
        vec![StorageTier::HostPinned]
    );
    assert_eq!(
        index.holds(w.engine, ours[0]),
        vec![StorageTier::Device, StorageTier::HostPinned]
    );
    // A GPU child of the evicted GPU block does not chain there; a CPU
    // child chains onto the CPU copy.
    let more: Vec<u32> = (8..12).collect();
    let all: Vec<u32> = (0..12).collect();
    let out = ingest.apply_batch(&batch(vec![
        stored(&[3], Some(2), &more, None),
        stored(&[3], Some(2), &more, Some("CPU")),
    ]));
    assert_eq!(out.skipped, vec![(0, SkipReason::ParentNotHeld)]);
    assert_eq!(out.changed, 1);
    assert_eq!(
        index.holds(w.engine, sequence_hashes(&all, BS as usize)[2]),
        vec![StorageTier::HostPinned]
    );
    // Cleared drops every tier this stream stored into.
    let out = ingest.apply_batch(&batch(vec![VllmEvent::AllBlocksCleared]));
    assert_eq!(out.applied, 2, "one Cleared per tier seen (GPU, CPU)");
    assert_eq!(index.stats().held_blocks, [0; 5]);
    assert_eq!(ingest.stats().clears, 1);
}

#[test]
fn blocks_whose_keys_cannot_be_mapped_are_skipped_with_their_children() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let t: Vec<u32> = (0..4).collect();
    let lora = VllmEvent::BlockStored {
        block_hashes: vec![10],
        parent_block_hash: None,
        token_ids: t.clone(),
        block_size: BS,
        lora_id: Some(3),
        medium: None,
        lora_name: None,
        extra_keys: vec![],
        group_idx: None,
    };
    let mm = VllmEvent::BlockStored {
        block_hashes: vec![11],
        parent_block_hash: None,
        token_ids: t.clone(),
        block_size: BS,
        lora_id: None,
        medium: None,
        lora_name: None,
        // A prompt-embeddings digest: nothing a router request can hash.
        extra_keys: vec![Some(vec![VllmExtraKey::Digest(vec![7; 32])])],
        group_idx: None,
    };
    let wrong_bs = VllmEvent::BlockStored {
        block_hashes: vec![12],
        parent_block_hash: None,
        token_ids: (0..8).collect(),
        block_size: 8,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: vec![],
        group_idx: None,
    };
    let short = stored(&[13, 14], None, &t, None);
    let tape = stored(&[15], None, &t, Some("TAPE"));
    let orphan_of_lora = stored(&[16], Some(10), &t, None);
    let mut group_40 = stored(&[17], None, &t, None);
    if let VllmEvent::BlockStored { group_idx, .. } = &mut group_40 {
        *group_idx = Some(40);
    }
    let out = ingest.apply_batch(&batch(vec![
        lora,
        mm,
        wrong_bs,
        short,
        tape,
        orphan_of_lora,
        group_40,
    ]));
    assert_eq!(
        out.skipped,
        vec![
            (0, SkipReason::Lora),
            (1, SkipReason::ExtraKeys),
            (2, SkipReason::BlockSizeMismatch),
            (3, SkipReason::TokenCountMismatch),
            (4, SkipReason::UnknownMedium),
            (5, SkipReason::UnknownParent),
            (6, SkipReason::GroupIndex),
        ]
    );
    assert_eq!(out.applied, 0);
    assert_eq!(index.stats().held_blocks, [0; 5]);
    // ParentNotHeld needs a stored parent: see the tiers and reset tests.
    for r in SkipReason::ALL
        .into_iter()
        .filter(|r| *r != SkipReason::ParentNotHeld)
    {
        assert_eq!(ingest.stats().skipped(r), 1, "{}", r.as_str());
    }
    for name in 10..=17 {
        assert_eq!(ingest.sequence_hash(name), None);
    }
}

#[test]
fn reset_drops_the_inventory_but_keeps_names() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let ours = sequence_hashes(&tokens, BS as usize);
    ingest.apply_batch(&batch(vec![stored(&[1], None, &tokens[..4], None)]));
    ingest.reset().unwrap();
    assert!(index.holds(w.engine, ours[0]).is_empty());
    assert_eq!(ingest.stats().resets, 1);
    // A child of a block the reset dropped does not chain in the index:
    // skipped, not indexed as an orphan.
    let child = || stored(&[2], Some(1), &tokens[4..], None);
    let out = ingest.apply_batch(&batch(vec![child()]));
    assert_eq!(out.skipped, vec![(0, SkipReason::ParentNotHeld)]);
    assert!(index.workers_needing_resync().is_empty());
    // Once vLLM stores the parent again the child chains onto it.
    let out = ingest.apply_batch(&batch(vec![
        stored(&[1], None, &tokens[..4], None),
        child(),
    ]));
    assert_eq!(out.changed, 2);
    assert_eq!(index.holds(w.engine, ours[1]), vec![StorageTier::Device]);
    // Event ids continued past the reset: nothing was taken as a duplicate.
    assert_eq!(index.stats().duplicates, 0);
}

#[test]
fn configuration_errors_name_the_field() {
    let index = Arc::new(InventoryIndex::new());
    let e = VllmIngest::new(
        index.clone(),
        VllmWorker {
            tokens_per_block: 0,
            ..worker()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("`tokens_per_block`"), "{e}");
    // The same engine registered with another role is refused by the index.
    let w = worker();
    VllmIngest::new(index.clone(), w).unwrap();
    let e = VllmIngest::new(
        index,
        VllmWorker {
            role: Role::Prefill,
            ..w
        },
    )
    .unwrap_err();
    assert!(matches!(e, VllmEventError::Index(_)), "{e}");
}

fn with_keys(
    mut e: VllmEvent,
    lora: Option<&str>,
    keys: Vec<Option<Vec<VllmExtraKey>>>,
    group: Option<u32>,
) -> VllmEvent {
    if let VllmEvent::BlockStored {
        lora_name,
        lora_id,
        extra_keys,
        group_idx,
        ..
    } = &mut e
    {
        *lora_name = lora.map(str::to_owned);
        *lora_id = lora.map(|_| 1);
        *extra_keys = keys;
        *group_idx = group;
    }
    e
}

#[test]
fn lora_salt_and_multimodal_blocks_are_indexed_in_their_own_namespace() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let t: Vec<u32> = (0..8).collect();
    let text = |s: &str| VllmExtraKey::Text(s.into());
    let image = VllmExtraKey::Multimodal {
        identifier: "9f86d081884c7d65".into(),
        offset: 2,
    };
    // The same two blocks of tokens under adapter A, adapter B, a cache salt
    // (first block only, as vLLM publishes it; the child inherits it through
    // its parent in a later event) and with an image in block 1.
    let a = with_keys(
        stored(&[1, 2], None, &t, None),
        Some("adapter-a"),
        vec![Some(vec![text("adapter-a")]), Some(vec![text("adapter-a")])],
        None,
    );
    let b = with_keys(
        stored(&[3, 4], None, &t, None),
        Some("adapter-b"),
        vec![Some(vec![text("adapter-b")]), Some(vec![text("adapter-b")])],
        None,
    );
    let salted_root = with_keys(
        stored(&[5], None, &t[..4], None),
        None,
        vec![Some(vec![text("tenant-1")])],
        None,
    );
    let salted_child = stored(&[6], Some(5), &t[4..], None);
    let mm = with_keys(
        stored(&[7, 8], None, &t, None),
        None,
        vec![None, Some(vec![image])],
        None,
    );
    let out = ingest.apply_batch(&batch(vec![a, b, salted_root, salted_child, mm]));
    assert!(out.skipped.is_empty(), "{out:?}");
    let ns = |l: Option<&str>, s: Option<&str>| HashNamespace {
        lora_name: l.map(str::to_owned),
        cache_salt: s.map(str::to_owned),
    };
    let want = [
        (
            2,
            sequence_hashes_keyed(&t, 4, &ns(Some("adapter-a"), None), &[]),
        ),
        (
            4,
            sequence_hashes_keyed(&t, 4, &ns(Some("adapter-b"), None), &[]),
        ),
        (
            6,
            sequence_hashes_keyed(&t, 4, &ns(None, Some("tenant-1")), &[]),
        ),
        (
            8,
            sequence_hashes_keyed(
                &t,
                4,
                &HashNamespace::default(),
                &[vec![], vec![mm_hash_of_identifier("9f86d081884c7d65")]],
            ),
        ),
    ];
    let plain = sequence_hashes(&t, 4);
    let mut seen = std::collections::HashSet::new();
    for (name, hashes) in &want {
        assert_eq!(ingest.sequence_hash(*name), Some(hashes[1]), "block {name}");
        assert_eq!(index.holds(w.engine, hashes[1]), vec![StorageTier::Device]);
        assert_ne!(
            hashes[1], plain[1],
            "block {name} differs from the base model's"
        );
        seen.insert(hashes[1]);
    }
    assert_eq!(
        seen.len(),
        4,
        "adapters, salt and image all name different blocks"
    );
    // A request for the base model finds nothing of them.
    assert!(index.holds(w.engine, plain[1]).is_empty());
}

#[test]
fn a_block_stays_indexed_while_any_kv_cache_group_holds_it() {
    let index = Arc::new(InventoryIndex::new());
    let w = worker();
    let mut ingest = VllmIngest::new(index.clone(), w).unwrap();
    let t: Vec<u32> = (0..8).collect();
    let full = with_keys(stored(&[1, 2], None, &t, None), None, vec![], Some(0));
    let window = with_keys(stored(&[1, 2], None, &t, None), None, vec![], Some(1));
    ingest.apply_batch(&batch(vec![full, window]));
    let ours = sequence_hashes(&t, 4);
    // The sliding-window group frees block 0: the full-attention group keeps it.
    let freed = |g| VllmEvent::BlockRemoved {
        block_hashes: vec![1],
        medium: None,
        group_idx: Some(g),
    };
    ingest.apply_batch(&batch(vec![freed(1)]));
    assert_eq!(index.holds(w.engine, ours[0]), vec![StorageTier::Device]);
    assert_eq!(index.stats().held_blocks[0], 2);
    ingest.apply_batch(&batch(vec![freed(0)]));
    assert!(index.holds(w.engine, ours[0]).is_empty());
    assert_eq!(index.holds(w.engine, ours[1]), vec![StorageTier::Device]);
    assert_eq!(ingest.stats().removed_blocks, 1);
}
