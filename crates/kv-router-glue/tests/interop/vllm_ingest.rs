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
        has_extra_keys: false,
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
    ingest.apply_batch(&batch(vec![
        stored(&[1, 2], None, &tokens, Some("GPU")),
        // Offloaded copy of block 1 in CPU memory, under the same vLLM name.
        stored(&[2], Some(1), &tokens[4..], Some("CPU")),
    ]));
    assert_eq!(
        index.holds(w.engine, ours[1]),
        vec![StorageTier::Device, StorageTier::HostPinned]
    );
    let out = ingest.apply_batch(&batch(vec![VllmEvent::BlockRemoved {
        block_hashes: vec![2, 999],
        medium: Some("GPU".into()),
    }]));
    assert_eq!(out.unknown_removals, 1);
    assert_eq!(
        index.holds(w.engine, ours[1]),
        vec![StorageTier::HostPinned]
    );
    assert_eq!(index.holds(w.engine, ours[0]), vec![StorageTier::Device]);
    // A child of the evicted GPU block still chains: the name is known.
    let more: Vec<u32> = (8..12).collect();
    let all: Vec<u32> = (0..12).collect();
    let out = ingest.apply_batch(&batch(vec![stored(&[3], Some(2), &more, None)]));
    assert_eq!(out.changed, 1);
    assert_eq!(
        index.holds(w.engine, sequence_hashes(&all, BS as usize)[2]),
        vec![StorageTier::Device]
    );
    // Cleared drops every tier this stream stored into.
    let out = ingest.apply_batch(&batch(vec![VllmEvent::AllBlocksCleared]));
    assert_eq!(out.applied, 2, "one Cleared per tier seen (GPU, CPU)");
    assert_eq!(index.stats().held_blocks, [0; 5]);
    assert_eq!(ingest.stats().clears, 1);
}

#[test]
fn blocks_not_named_by_tokens_alone_are_skipped_with_their_children() {
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
        lora_name: Some("adapter".into()),
        has_extra_keys: false,
    };
    let mm = VllmEvent::BlockStored {
        block_hashes: vec![11],
        parent_block_hash: None,
        token_ids: t.clone(),
        block_size: BS,
        lora_id: None,
        medium: None,
        lora_name: None,
        has_extra_keys: true,
    };
    let wrong_bs = VllmEvent::BlockStored {
        block_hashes: vec![12],
        parent_block_hash: None,
        token_ids: (0..8).collect(),
        block_size: 8,
        lora_id: None,
        medium: None,
        lora_name: None,
        has_extra_keys: false,
    };
    let short = stored(&[13, 14], None, &t, None);
    let tape = stored(&[15], None, &t, Some("TAPE"));
    let orphan_of_lora = stored(&[16], Some(10), &t, None);
    let out = ingest.apply_batch(&batch(vec![
        lora,
        mm,
        wrong_bs,
        short,
        tape,
        orphan_of_lora,
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
        ]
    );
    assert_eq!(out.applied, 0);
    assert_eq!(index.stats().held_blocks, [0; 5]);
    for r in SkipReason::ALL {
        assert_eq!(ingest.stats().skipped(r), 1, "{}", r.as_str());
    }
    for name in 10..=16 {
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
    // A child stored after the reset chains onto the remembered name.
    let out = ingest.apply_batch(&batch(vec![stored(&[2], Some(1), &tokens[4..], None)]));
    assert_eq!(out.changed, 1);
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
