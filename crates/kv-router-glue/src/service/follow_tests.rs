//! [`RouterInventory`] against in-process planes: registrations, retired
//! incarnations, silence, an unresponsive worker's snapshot request (asked
//! outside the state lock), and the stream resume of the followed receivers.

use kv_descriptor::{GpuIdentity, KvEvent, KvEventData, LayoutFingerprint, StorageTier, Wire};

use super::*;
use crate::{Advisor, CostModel, DecisionLog, InventoryPlane, LiveCostModel, ReuseSettings};

fn inventory() -> (Arc<RouterInventory>, Arc<RouterService>) {
    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(CostModel::new(ReuseSettings::default(), 16).unwrap()),
        Arc::new(DecisionLog::new(8)),
        1024,
    );
    let service = Arc::new(RouterService::new(Arc::new(advisor)));
    // No inventory server: a snapshot asked here would fail (none is,
    // since no subject is followed in these tests).
    let sync = crate::InventorySync::new(
        Arc::new(crate::InProcessInventory::new()),
        "t",
        Duration::from_secs(1),
    )
    .unwrap();
    let inv = RouterInventory::new(index, remote, service.clone(), sync, 1_000, 3);
    (Arc::new(inv), service)
}

fn announcement(key: &str, engine: EngineId, role: Role, subject: &str) -> Vec<u8> {
    WorkerAnnouncement {
        worker_key: key.into(),
        engine_id: engine,
        role,
        layout_fingerprint: LayoutFingerprint(9),
        tp_size: 1,
        gpus: vec![GpuIdentity::new(uuid::Uuid::from_u128(1), 0, "h").unwrap()],
        pin_endpoint: "unix:/tmp/p".into(),
        event_subject: subject.into(),
    }
    .to_wire()
    .unwrap()
}

fn stored(publisher: EngineId, event_id: u64) -> KvEvent {
    let blocks = kv_bank::sealed_blocks(None, &(0..32).collect::<Vec<u32>>(), 16);
    KvEvent {
        publisher,
        event_id,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(9),
        tp_size: 1,
        tier: StorageTier::RetainedGpuDirect,
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    }
}

#[test]
fn parse_subject_takes_only_our_four_token_subjects() {
    assert_eq!(
        parse_subject("kv.ns.decode.kv_events").unwrap().as_str(),
        "kv.ns.decode.kv_events"
    );
    for bad in [
        "other.ns.decode.x",
        "kv.ns.decode",
        "kv.ns.a.b.c",
        "kv.ns.*.x",
    ] {
        assert!(parse_subject(bad).is_err(), "{bad}");
    }
}

#[tokio::test]
async fn prefill_becomes_a_target_and_a_new_incarnation_drops_the_old_one() {
    let (inv, service) = inventory();
    let (old, new) = (EngineId::fresh(), EngineId::fresh());
    let subject = "kv.t.prefill.kv_events";
    let first = inv
        .on_announcement(&announcement("p0", old, Role::Prefill, subject), 0)
        .await;
    assert_eq!(
        first.map(|s| s.as_str().to_string()).as_deref(),
        Some(subject)
    );
    // The same subject again: already followed, nothing to subscribe.
    assert!(inv
        .on_announcement(&announcement("p0", old, Role::Prefill, subject), 10)
        .await
        .is_none());
    let req = |target| crate::service::AdviseRequest {
        request_id: "r".into(),
        target,
        keys: crate::service::AdviseKeys::SequenceHashes(vec![kv_descriptor::SequenceHash(1)]),
    };
    let known = |t| {
        !matches!(
            service.advise(&req(t)).result,
            crate::service::AdviseResult::Refused(crate::service::AdviseRefusal::UnknownTarget(_))
        )
    };
    assert!(known(old));
    inv.on_announcement(&announcement("p0", new, Role::Prefill, subject), 20)
        .await;
    assert!(!known(old), "replaced incarnation is no target");
    assert!(known(new));
    assert!(
        inv.index().worker(old).is_none(),
        "old engine left the index"
    );
    // The old incarnation's late announcement is ignored.
    inv.on_announcement(&announcement("p0", old, Role::Prefill, subject), 30)
        .await;
    assert!(!known(old));
    let st = inv.stats();
    assert_eq!(
        (
            st.announcements,
            st.announcements_ignored,
            st.workers_dropped
        ),
        (3, 1, 1)
    );
}

#[tokio::test]
async fn events_of_retired_or_silent_workers_are_ignored() {
    let (inv, _) = inventory();
    let (d0, d1) = (EngineId::fresh(), EngineId::fresh());
    inv.on_announcement(&announcement("d0", d0, Role::Decode, "kv.t.decode.e"), 0)
        .await;
    inv.on_event(KvStreamItem::Event(stored(d0, 1))).await;
    let h = kv_bank::sealed_blocks(None, &(0..32).collect::<Vec<u32>>(), 16)[0].sequence_hash;
    assert!(!inv.index().holds(d0, h).is_empty());
    // d0 restarts as d1: d0's inventory goes, its late event is ignored.
    inv.on_announcement(&announcement("d0", d1, Role::Decode, "kv.t.decode.e"), 100)
        .await;
    assert!(inv.index().holds(d0, h).is_empty());
    inv.on_event(KvStreamItem::Event(stored(d0, 2))).await;
    assert!(inv.index().holds(d0, h).is_empty());
    // d1 goes silent for more than 3 periods of 1 s: dropped.
    assert_eq!(inv.tick(100 + 3_000).await, 0);
    assert_eq!(inv.tick(100 + 3_001).await, 1);
    assert!(inv.index().worker(d1).is_none());
    let st = inv.stats();
    assert_eq!(
        (
            st.events_applied,
            st.late_events_ignored,
            st.workers_dropped
        ),
        (1, 1, 2)
    );
}

/// A router inventory asking snapshots over `plane` under namespace `t`
/// with a per-page timeout of `timeout`.
fn inventory_on(plane: crate::InProcessInventory, timeout: Duration) -> Arc<RouterInventory> {
    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(CostModel::new(ReuseSettings::default(), 16).unwrap()),
        Arc::new(DecisionLog::new(8)),
        1024,
    );
    let service = Arc::new(RouterService::new(Arc::new(advisor)));
    let sync = crate::InventorySync::new(Arc::new(plane), "t", timeout).unwrap();
    Arc::new(RouterInventory::new(index, remote, service, sync, 1_000, 3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresponsive_worker_does_not_hold_other_workers_events() {
    let plane = crate::InProcessInventory::new();
    let inv = inventory_on(plane.clone(), Duration::from_secs(2));
    let lease = kv_descriptor::OwnerLease::fresh(Role::Decode);
    let (silent, live) = (lease.engine_id, EngineId::fresh());
    let subject = "kv.t.decode.e";
    // The silent worker's inventory subject is served but never answered:
    // each snapshot request waits its full 2 s timeout.
    let mut unanswered = plane
        .serve(&crate::inventory_subject("t", silent).unwrap())
        .await
        .unwrap();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(r) = unanswered.next().await {
            held.push(r);
        }
    });
    for (key, engine) in [("d-silent", silent), ("d-live", live)] {
        inv.on_announcement(&announcement(key, engine, Role::Decode, subject), 0)
            .await;
    }
    inv.followed(&parse_subject(subject).unwrap()).await;
    let record = crate::plane::directory::tests_support::record(lease, u64::MAX - 1);
    inv.on_directory(DirectoryChange::Put(record)).await;
    let hashes: Vec<_> = kv_bank::sealed_blocks(None, &(0..32).collect::<Vec<u32>>(), 16)
        .iter()
        .map(|b| b.sequence_hash)
        .collect();

    // Both ways a snapshot is asked: the silent worker's announcement (it
    // has no snapshot yet), and a lost range of its events.
    let asks = [
        KvStreamItem::Lost {
            publisher: silent,
            from_event_id: 1,
            to_event_id: 6,
        },
        KvStreamItem::Lost {
            publisher: silent,
            from_event_id: 1,
            to_event_id: 6,
        },
    ];
    for (round, lost) in asks.into_iter().enumerate() {
        let asking = {
            let inv = inv.clone();
            let a = announcement("d-silent", silent, Role::Decode, subject);
            tokio::spawn(async move {
                if round == 0 {
                    inv.on_announcement(&a, 10).await;
                } else {
                    inv.on_event(lost).await;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !asking.is_finished(),
            "round {round}: the request is still waiting"
        );
        // Meanwhile the live worker's event is applied at once.
        let event = round as u64 + 1;
        let t = std::time::Instant::now();
        tokio::time::timeout(
            Duration::from_millis(500),
            inv.on_event(KvStreamItem::Event(stored(live, event))),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "round {round}: the live worker's event waited behind the silent worker's request"
            )
        });
        assert!(t.elapsed() < Duration::from_millis(500));
        assert!(
            !inv.index().holds(live, hashes[0]).is_empty(),
            "round {round}"
        );
        assert!(
            !asking.is_finished(),
            "round {round}: applied while the request waited"
        );
        asking.await.unwrap();
    }
    let st = inv.stats();
    assert_eq!((st.events_applied, st.snapshots_failed), (2, 2), "{st:?}");
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_receiver_resumes_after_the_snapshot() {
    use kv_descriptor::{SequenceHash, TokenBlockHash};

    use crate::{InProcessDirectory, InProcessPlane};

    let lease = kv_descriptor::OwnerLease::fresh(Role::Decode);
    let engine = lease.engine_id;
    let events: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
    let subject = crate::Subject::new("t", "decode", "kv_events").unwrap();
    // A replay ring of 2, shorter than the 6 events published before the
    // router started.
    let (publisher, _resync) = crate::plane::inventory::test_support::idle_worker_after_six_events(
        events.clone(),
        &subject,
        engine,
        LayoutFingerprint(9),
        1,
    )
    .await;
    let stored_at = crate::plane::inventory::test_support::stored_at;
    // The worker's snapshot: its 6 blocks, consistent with event 6.
    let plane = crate::InProcessInventory::new();
    let mut server = plane
        .serve(&crate::inventory_subject("t", engine).unwrap())
        .await
        .unwrap();
    let snapshot = crate::InventoryReply::Snapshot(crate::InventorySnapshot {
        engine_id: engine,
        bank_generation: lease.generation,
        layout_fingerprint: LayoutFingerprint(9),
        tp_size: 1,
        last_event_id: 6,
        blocks: (0..6)
            .map(|slot| crate::SnapshotBlock {
                sequence_hash: SequenceHash(5000 + u64::from(slot)),
                token_hash: TokenBlockHash(7),
                parent: None,
                slot,
                rank_acks: crate::plane::inventory::all_ranks(1),
            })
            .collect(),
        next_slot: None,
    })
    .to_wire()
    .unwrap();
    let answering = tokio::spawn(async move {
        while let Some(req) = server.next().await {
            req.respond(snapshot.clone());
        }
    });
    let directory = InProcessDirectory::new();
    directory
        .put(&crate::plane::directory::tests_support::record(
            lease,
            u64::MAX - 1,
        ))
        .await
        .unwrap();

    // The router as the binary runs it: `follow`, one receiver per subject.
    let inv = inventory_on(plane, Duration::from_secs(2));
    let stop = CancellationToken::new();
    let _followers = inv
        .follow(
            events.clone(),
            &directory,
            "t",
            Duration::from_secs(1),
            stop.clone(),
        )
        .await
        .unwrap();
    let announce = crate::announce_subject("t").unwrap();
    let a = WorkerAnnouncement {
        worker_key: "d0".into(),
        engine_id: engine,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(9),
        tp_size: 1,
        gpus: vec![GpuIdentity::new(uuid::Uuid::from_u128(1), 0, "h").unwrap()],
        pin_endpoint: "unix:/tmp/p".into(),
        event_subject: subject.as_str().into(),
    }
    .to_wire()
    .unwrap();
    // Announce until the snapshot is applied (the first announcement only
    // subscribes the subject).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while inv.stats().snapshots_applied == 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", inv.stats());
        events.publish(&announce, a.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!inv.index().holds(engine, SequenceHash(5005)).is_empty());

    // Event 7 is applied straight after the snapshot: no gap is opened, so
    // no resync and no `Lost` 1..=4 beyond the 2-event ring.
    publisher
        .publish(StorageTier::RetainedGpuDirect, stored_at(6))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while inv.index().holds(engine, SequenceHash(5006)).is_empty() {
        assert!(std::time::Instant::now() < deadline, "{:?}", inv.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = inv.stats();
    assert_eq!((st.lost_ranges, st.events_applied), (0, 1), "{st:?}");
    stop.cancel();
    answering.abort();
}
