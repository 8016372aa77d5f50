//! Inventory wire bounds and decoders, and the in-process request/reply.

use std::time::Duration;

use kv_descriptor::{EngineId, LayoutFingerprint, SequenceHash, TokenBlockHash, Wire};
use proptest::prelude::*;

use super::*;

fn block(slot: u32, tp: u32) -> SnapshotBlock {
    SnapshotBlock {
        sequence_hash: SequenceHash(1000 + u64::from(slot)),
        token_hash: TokenBlockHash(7),
        parent: (slot > 0).then(|| SequenceHash(999 + u64::from(slot))),
        slot,
        rank_acks: all_ranks(tp),
    }
}

fn snapshot(blocks: Vec<SnapshotBlock>) -> InventorySnapshot {
    InventorySnapshot {
        engine_id: EngineId(uuid::Uuid::from_u128(9)),
        bank_generation: 1,
        layout_fingerprint: LayoutFingerprint(0xF1),
        tp_size: 2,
        last_event_id: 6,
        blocks,
        next_slot: None,
    }
}

fn field_of(e: InventoryWireError) -> String {
    match e {
        InventoryWireError::Decode(d) => d.to_string(),
        other => panic!("expected a decode error naming the field, got {other:?}"),
    }
}

#[test]
fn a_snapshot_round_trips_and_bad_fields_are_named() {
    let ok = snapshot((0..3).map(|s| block(s * 2, 2)).collect());
    let bytes = InventoryReply::Snapshot(ok.clone()).to_wire().unwrap();
    assert_eq!(
        InventoryReply::decode(&bytes).unwrap(),
        InventoryReply::Snapshot(ok.clone())
    );

    let mut unordered = ok.clone();
    unordered.blocks.swap(0, 1);
    let bytes = InventoryReply::Snapshot(unordered).to_wire().unwrap();
    let msg = field_of(InventoryReply::decode(&bytes).unwrap_err());
    assert!(msg.contains("inventory_snapshot.blocks.slot"), "{msg}");

    let mut half_acked = ok.clone();
    half_acked.blocks[1].rank_acks = 0b01;
    let bytes = InventoryReply::Snapshot(half_acked).to_wire().unwrap();
    let msg = field_of(InventoryReply::decode(&bytes).unwrap_err());
    assert!(msg.contains("inventory_snapshot.blocks.rank_acks"), "{msg}");

    let mut tp0 = ok.clone();
    tp0.tp_size = 0;
    let bytes = InventoryReply::Snapshot(tp0).to_wire().unwrap();
    let msg = field_of(InventoryReply::decode(&bytes).unwrap_err());
    assert!(msg.contains("inventory_snapshot.tp_size"), "{msg}");

    let mut back = ok.clone();
    back.next_slot = Some(3);
    let bytes = InventoryReply::Snapshot(back).to_wire().unwrap();
    let msg = field_of(InventoryReply::decode(&bytes).unwrap_err());
    assert!(msg.contains("inventory_snapshot.next_slot"), "{msg}");

    let big = vec![0u8; MAX_INVENTORY_REPLY_BYTES + 1];
    assert!(matches!(
        InventoryReply::decode(&big),
        Err(InventoryWireError::TooLarge {
            what: "inventory_reply",
            size,
            limit: MAX_INVENTORY_REPLY_BYTES,
        }) if size == MAX_INVENTORY_REPLY_BYTES + 1
    ));
}

#[test]
fn a_full_page_fits_the_reply_bound() {
    let tp = MAX_SNAPSHOT_TP;
    let mut s = snapshot(
        (0..MAX_SNAPSHOT_PAGE_BLOCKS)
            .map(|i| SnapshotBlock {
                sequence_hash: SequenceHash(u64::MAX - u64::from(i)),
                token_hash: TokenBlockHash(u64::MAX),
                parent: Some(SequenceHash(u64::MAX / 3)),
                slot: u32::MAX - MAX_SNAPSHOT_PAGE_BLOCKS + i,
                rank_acks: all_ranks(tp),
            })
            .collect(),
    );
    s.tp_size = tp;
    s.last_event_id = u64::MAX;
    let bytes = InventoryReply::Snapshot(s).to_wire().unwrap();
    assert!(
        bytes.len() <= MAX_INVENTORY_REPLY_BYTES,
        "{} bytes for a full page",
        bytes.len()
    );
    InventoryReply::decode(&bytes).unwrap();
}

#[test]
fn requests_are_bounded() {
    let r = InventoryRequest {
        engine_id: EngineId::fresh(),
        from_slot: 5,
        max_blocks: 10,
    };
    assert_eq!(InventoryRequest::decode(&r.to_wire().unwrap()).unwrap(), r);
    for max_blocks in [0, MAX_SNAPSHOT_PAGE_BLOCKS + 1] {
        let bad = InventoryRequest { max_blocks, ..r };
        let msg = field_of(InventoryRequest::decode(&bad.to_wire().unwrap()).unwrap_err());
        assert!(msg.contains("inventory_request.max_blocks"), "{msg}");
    }
    let big = vec![0x90u8; MAX_INVENTORY_REQUEST_BYTES + 1];
    assert!(matches!(
        InventoryRequest::decode(&big),
        Err(InventoryWireError::TooLarge {
            what: "inventory_request",
            ..
        })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// The decoders never panic on arbitrary bytes.
    #[test]
    fn inventory_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = InventoryRequest::decode(&bytes);
        let _ = InventoryReply::decode(&bytes);
    }

    /// Mutated valid replies never panic either (most structure survives).
    #[test]
    fn mutated_replies_never_panic(i in 0usize..4096, b in any::<u8>()) {
        let s = snapshot((0..8).map(|s| block(s, 2)).collect());
        let mut bytes = InventoryReply::Snapshot(s).to_wire().unwrap();
        let at = i % bytes.len();
        bytes[at] = b;
        let _ = InventoryReply::decode(&bytes);
    }
}

#[tokio::test]
async fn in_process_request_reply_and_its_errors() {
    let plane = InProcessInventory::new();
    let engine = EngineId::fresh();
    let subject = inventory_subject("qa", engine).unwrap();
    assert_eq!(subject.as_str(), format!("kv.qa.inventory.{engine}"));
    let e = plane
        .request(&subject, b"x".to_vec(), Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(matches!(e, InventoryError::NoResponder { .. }), "{e:?}");

    let mut server = plane.serve(&subject).await.unwrap();
    let answering = tokio::spawn(async move {
        let req = server.next().await.unwrap();
        let mut back = req.payload.clone();
        back.reverse();
        req.respond(back);
        // The second request is never answered.
        let _held = server.next().await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let got = plane
        .request(&subject, b"abc".to_vec(), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(got, b"cba");
    let e = plane
        .request(&subject, b"abc".to_vec(), Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(
        matches!(e, InventoryError::Timeout { waited_ms: 50, .. }),
        "{e:?}"
    );
    answering.abort();
}
