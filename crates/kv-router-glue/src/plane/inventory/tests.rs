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

/// A server on `subject` that answers each request with the next of `replies`.
async fn scripted(plane: &InProcessInventory, subject: &crate::Subject, replies: Vec<Vec<u8>>) {
    let mut server = plane.serve(subject).await.unwrap();
    tokio::spawn(async move {
        for r in replies {
            let Some(req) = server.next().await else {
                return;
            };
            req.respond(r);
        }
        // Keep later requests unanswered (held, not dropped): they time out.
        let mut held = Vec::new();
        while let Some(r) = server.next().await {
            held.push(r);
        }
    });
}

#[tokio::test]
async fn a_bad_snapshot_is_refused_typed_and_applies_nothing() {
    use std::sync::Arc;

    use kv_descriptor::{Role, StorageTier};
    use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};

    let engine = EngineId(uuid::Uuid::from_u128(9));
    let index = InventoryIndex::new();
    index
        .register_worker(
            WorkerKey(1),
            WorkerInfo {
                engine,
                role: Role::Decode,
                layout_fingerprint: LayoutFingerprint(0xF1),
                tp_size: 2,
            },
        )
        .unwrap();
    let held = SequenceHash(424_242);
    index
        .resync_worker(engine, 3, &[(StorageTier::RetainedGpuDirect, vec![held])])
        .unwrap();
    let remote = crate::RemoteDonorDirectory::new();
    let registry = crate::WorkerRegistry::new(1000, 3);
    let plane = InProcessInventory::new();
    let subject = inventory_subject("qa", engine).unwrap();
    let reply = |s: InventorySnapshot| InventoryReply::Snapshot(s).to_wire().unwrap();

    let mut other = snapshot(vec![block(0, 2)]);
    other.engine_id = EngineId::fresh();
    let mut paged = snapshot(vec![block(0, 2)]);
    paged.next_slot = Some(1);
    let mut regenerated = snapshot(vec![block(1, 2)]);
    regenerated.bank_generation = 2;
    let mut stale = snapshot(vec![block(0, 2)]);
    stale.last_event_id = 2;
    scripted(
        &plane,
        &subject,
        vec![
            reply(other),
            InventoryReply::Refused(InventoryRefusal::Closed)
                .to_wire()
                .unwrap(),
            b"\xc1".to_vec(),
            reply(paged),
            reply(regenerated),
            reply(stale.clone()),
            reply(stale.clone()),
            reply(stale),
        ],
    )
    .await;
    let mut sync = InventorySync::new(Arc::new(plane), "qa", Duration::from_millis(200))
        .unwrap()
        .with_page_blocks(1);
    macro_rules! next {
        () => {
            sync.rebuild_worker(engine, &index, &remote, &registry)
                .await
                .unwrap_err()
        };
    }
    let e = next!();
    assert!(
        matches!(
            e,
            InventoryError::Mismatch {
                field: "engine_id",
                ..
            }
        ),
        "{e:?}"
    );
    let e = next!();
    assert!(
        matches!(
            e,
            InventoryError::Refused {
                refusal: InventoryRefusal::Closed,
                ..
            }
        ),
        "{e:?}"
    );
    let e = next!();
    assert!(
        matches!(e, InventoryError::Wire(InventoryWireError::Decode(_))),
        "{e:?}"
    );
    // Two pages of one snapshot from different bank generations.
    let e = next!();
    assert!(
        matches!(
            e,
            InventoryError::Mismatch {
                field: "bank_generation",
                ..
            }
        ),
        "{e:?}"
    );
    // Nothing was applied by any of them: the index still has its own state.
    assert!(!index.holds(engine, held).is_empty());
    assert!(index.holds(engine, block(0, 2).sequence_hash).is_empty());

    // Older than what the stream applied (event 3 via an applied event):
    // asked 3 times, then Stale.
    let ev = kv_descriptor::KvEvent {
        publisher: engine,
        event_id: 4,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0xF1),
        tp_size: 2,
        tier: StorageTier::RetainedGpuDirect,
        data: kv_descriptor::KvEventData::Removed {
            sequence_hashes: vec![held],
        },
    };
    sync.apply_event(&ev, &index, &remote, &registry).unwrap();
    let e = sync
        .rebuild_worker(engine, &index, &remote, &registry)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            InventoryError::Stale {
                snapshot_event_id: 2,
                applied_event_id: 4,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(sync.snapshot_event_id(engine).is_none());
    // The scripted server is exhausted: the next request times out, typed.
    let e = sync
        .rebuild_worker(engine, &index, &remote, &registry)
        .await
        .unwrap_err();
    assert!(matches!(e, InventoryError::Timeout { .. }), "{e:?}");
}

/// Issue: after a snapshot at event N, a receiver that never saw 1..=N (a
/// restarted router) held event N + 1 behind a gap that the publisher's
/// ring (shorter than N) cannot replay, so N + 1 came out only after the
/// gap timeout. With the receiver's resume handle the sync moves the
/// stream past N and N + 1 is applied at once.
#[tokio::test]
async fn after_a_snapshot_the_next_event_is_applied_before_the_gap_timeout() {
    use std::sync::Arc;

    use kv_descriptor::{Role, StorageTier};
    use kv_lookup::{EventOutcome, InventoryIndex, WorkerInfo, WorkerKey};

    use crate::{EventPlane, InProcessPlane, KvEventReceiver, KvStreamItem};

    let engine = EngineId(uuid::Uuid::from_u128(9));
    let gap_timeout = Duration::from_secs(2);
    let events: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
    let subject = crate::Subject::new("qa", "decode", "kv_events").unwrap();
    // Events 1..=6 before the router (re)started: nobody heard them.
    let (publisher, _resync) = super::test_support::idle_worker_after_six_events(
        events.clone(),
        &subject,
        engine,
        LayoutFingerprint(0xF1),
        2,
    )
    .await;
    let stored = super::test_support::stored_at;
    let mut rx = KvEventReceiver::subscribe(events, &subject, gap_timeout)
        .await
        .unwrap();

    let index = InventoryIndex::new();
    index
        .register_worker(
            WorkerKey(1),
            WorkerInfo {
                engine,
                role: Role::Decode,
                layout_fingerprint: LayoutFingerprint(0xF1),
                tp_size: 2,
            },
        )
        .unwrap();
    let remote = crate::RemoteDonorDirectory::new();
    let registry = crate::WorkerRegistry::new(1000, 3);
    let plane = InProcessInventory::new();
    let inventory = inventory_subject("qa", engine).unwrap();
    let page = snapshot((0..6).map(|s| block(s, 2)).collect()); // at event 6
    scripted(
        &plane,
        &inventory,
        vec![InventoryReply::Snapshot(page).to_wire().unwrap()],
    )
    .await;
    let mut sync = InventorySync::new(Arc::new(plane), "qa", Duration::from_secs(1))
        .unwrap()
        .with_stream_resume(rx.resume_handle());
    assert_eq!(
        sync.rebuild_worker(engine, &index, &remote, &registry)
            .await
            .unwrap(),
        SyncOutcome::Applied {
            blocks: 6,
            last_event_id: 6
        }
    );

    // Event 7 comes out well before the gap timeout, with no Lost first.
    publisher
        .publish(StorageTier::RetainedGpuDirect, stored(6))
        .await
        .unwrap();
    let item = rx.next_timeout(gap_timeout / 4).await;
    let Some(KvStreamItem::Event(e)) = item else {
        panic!("event 7 not delivered within a quarter of the gap timeout: {item:?}");
    };
    assert_eq!((e.publisher, e.event_id), (engine, 7));
    assert!(matches!(
        sync.apply_event(&e, &index, &remote, &registry).unwrap(),
        EventOutcome::Applied { .. }
    ));
    assert!(!index.holds(engine, SequenceHash(5006)).is_empty());
    let st = rx.stats();
    assert_eq!((st.gaps, st.lost), (0, 0), "no gap was opened");
}
