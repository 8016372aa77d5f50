//! Frames recorded from vLLM 0.33.0's own `ZmqEventPublisher`
//! (`tests/data/vllm-0.33.0-frames.json`, written by
//! `tests/vllm_publisher/harness.py record`): live `[topic, seq, payload]`
//! messages with integer and byte-string hashes and `group_idx`, a clear, and
//! the replies to a replay request from seq 1 with the end marker.

use std::sync::Arc;

use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerKey};
use kv_router_glue::vllm_events::*;

const RECORDED: &str = include_str!("../data/vllm-0.33.0-frames.json");

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn messages(key: &str) -> Vec<Vec<Vec<u8>>> {
    let v: serde_json::Value = serde_json::from_str(RECORDED).unwrap();
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_array()
                .unwrap()
                .iter()
                .map(|f| unhex(f.as_str().unwrap()))
                .collect()
        })
        .collect()
}

#[test]
fn replay_replies_of_vllm_0_33_are_four_frames_and_parse() {
    let replay = messages("replay");
    // Batches 1, 2, 3 and the end marker, each [empty, topic, seq, payload].
    assert_eq!(replay.len(), 4);
    assert!(replay.iter().all(|m| m.len() == 4));
    let parsed: Vec<_> = replay
        .iter()
        .map(|m| parse_replay_reply(m).unwrap())
        .collect();
    assert_eq!(parsed[3], None, "end marker");
    let live = messages("live");
    for (i, p) in parsed[..3].iter().enumerate() {
        let (seq, payload) = p.clone().unwrap();
        assert_eq!(seq, i as u64 + 1);
        // The replayed payload is the live one, byte for byte.
        assert_eq!(payload, live[i + 1][2]);
        assert_eq!(replay[i][1], b"kv", "topic frame");
    }
    // The shape before vLLM PR #45177 (no topic frame) still parses.
    let old = [Vec::new(), 5u64.to_be_bytes().to_vec(), b"x".to_vec()];
    assert_eq!(parse_replay_reply(&old).unwrap(), Some((5, b"x".to_vec())));
    let bad = [b"not-empty".to_vec(), vec![0; 8], vec![]];
    assert!(matches!(
        parse_replay_reply(&bad),
        Err(VllmEventError::Frame {
            field: "delimiter",
            ..
        })
    ));
}

#[test]
fn live_batches_of_vllm_0_33_decode_and_index_under_our_hashes() {
    let live = messages("live");
    assert_eq!(live.len(), 4);
    let batches: Vec<VllmEventBatch> = live
        .iter()
        .enumerate()
        .map(|(i, m)| {
            assert_eq!(m.len(), 3);
            assert_eq!(m[0], b"kv");
            assert_eq!(
                u64::from_be_bytes(m[1].clone().try_into().unwrap()),
                i as u64
            );
            decode_batch(&m[2]).unwrap()
        })
        .collect();
    // vLLM fills data_parallel_rank in the publisher.
    assert!(batches.iter().all(|b| b.data_parallel_rank == Some(0)));
    let VllmEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        group_idx,
        extra_keys,
        ..
    } = &batches[0].events[0]
    else {
        panic!("batch 0 starts with a store: {:?}", batches[0])
    };
    assert_eq!(*parent_block_hash, None);
    assert_eq!(*group_idx, None);
    assert!(extra_keys.is_empty());
    assert_eq!(token_ids.len(), block_hashes.len() * 16);
    let first_names = block_hashes.clone();
    let first_tokens = token_ids.clone();
    assert!(matches!(
        &batches[2].events[..],
        [
            VllmEvent::BlockStored {
                group_idx: Some(0),
                ..
            },
            VllmEvent::BlockRemoved {
                group_idx: Some(1),
                ..
            }
        ]
    ));
    assert_eq!(batches[3].events, vec![VllmEvent::AllBlocksCleared]);

    let index = Arc::new(InventoryIndex::new());
    let worker = VllmWorker {
        key: WorkerKey(3),
        engine: EngineId::fresh(),
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(1),
        tp_size: 1,
        tokens_per_block: 16,
    };
    let mut ingest = VllmIngest::new(index.clone(), worker).unwrap();
    for b in &batches[..3] {
        let out = ingest.apply_batch(b);
        assert!(out.skipped.is_empty(), "{out:?}");
    }
    let ours = sequence_hashes(&first_tokens, 16);
    for (name, want) in first_names.iter().zip(&ours) {
        assert_eq!(ingest.sequence_hash(*name), Some(*want));
        assert_eq!(index.holds(worker.engine, *want), vec![StorageTier::Device]);
    }
    // Group 1 removes a block it never stored: nothing the index holds changes.
    assert_eq!(ingest.stats().unknown_removals, 1);
    let held = index.stats().held_blocks[0];
    assert_eq!(
        held,
        ingest.stats().stored_blocks - ingest.stats().removed_blocks
    );
    ingest.apply_batch(&batches[3]);
    assert_eq!(index.stats().held_blocks, [0; 5]);
}
