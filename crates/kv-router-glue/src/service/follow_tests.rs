//! [`RouterInventory`] against in-process planes: registrations, retired
//! incarnations, silence, an unresponsive worker's snapshot request (asked
//! outside the state lock), the stream resume of the followed receivers, and
//! group commit (a burst applied in runs, one index publication each, with
//! the same result as one event at a time).

use kv_descriptor::{GpuIdentity, KvEvent, KvEventData, LayoutFingerprint, StorageTier, Wire};

use tokio::task::JoinSet;

use super::*;
use crate::{
    Advisor, CostModel, DecisionLog, DirectoryPlane, EventPlane, InventoryPlane, KvEventReceiver,
    LiveCostModel, ReuseSettings,
};

fn inventory() -> (Arc<RouterInventory>, Arc<RouterService>) {
    inventory_of(CostModel::new(ReuseSettings::default(), 16).unwrap())
}

/// [`inventory`] deciding with `model`.
fn inventory_of(model: CostModel) -> (Arc<RouterInventory>, Arc<RouterService>) {
    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(model),
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

/// A whole inventory snapshot (wire form) of `engine`'s bank generation
/// `generation` at `last_event_id`: `blocks` unchained blocks in slots
/// `0..blocks`, hashes `5000..`, of the layout these tests announce.
fn snapshot_of(engine: EngineId, generation: u64, last_event_id: u64, blocks: u32) -> Vec<u8> {
    crate::InventoryReply::Snapshot(crate::InventorySnapshot {
        engine_id: engine,
        bank_generation: generation,
        layout_fingerprint: LayoutFingerprint(9),
        tp_size: 1,
        last_event_id,
        blocks: (0..blocks)
            .map(|slot| crate::SnapshotBlock {
                sequence_hash: kv_descriptor::SequenceHash(5000 + u64::from(slot)),
                token_hash: kv_descriptor::TokenBlockHash(7),
                parent: None,
                slot,
                rank_acks: crate::plane::inventory::all_ranks(1),
            })
            .collect(),
        next_slot: None,
    })
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
    use kv_descriptor::SequenceHash;

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
    let snapshot = snapshot_of(engine, lease.generation, 6, 6);
    let answering = tokio::spawn(async move {
        while let Some(req) = server.next().await {
            req.respond(snapshot.clone());
        }
    });
    let directory = Arc::new(InProcessDirectory::new());
    directory
        .put(&crate::plane::directory::tests_support::record(
            lease,
            u64::MAX - 1,
        ))
        .await
        .unwrap();

    // The router as the binary runs it: `follow`, one receiver per subject.
    let inv = inventory_on(plane, Duration::from_secs(2));
    let (_followers, stop) = follow_in_process(&inv, events.clone(), directory.clone()).await;
    let announce = crate::announce_subject("t").unwrap();
    let a = announcement("d0", engine, Role::Decode, subject.as_str());
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

// --- Group commit on the follow path -------------------------------------

/// A Stored event of `publisher` at `event_id`: one root chain of two
/// blocks made from `seed`, with slots `2 * seed` and `2 * seed + 1`.
fn stored_chain(publisher: EngineId, event_id: u64, seed: u32) -> KvEvent {
    let tokens: Vec<u32> = (0..32).map(|t| seed * 1_000 + t).collect();
    let mut blocks = kv_bank::sealed_blocks(None, &tokens, 16);
    for (i, b) in blocks.iter_mut().enumerate() {
        b.slot = Some(2 * seed + i as u32);
    }
    KvEvent {
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
        ..stored(publisher, event_id)
    }
}

/// The sequence hashes [`stored_chain`] stores for `seed`.
fn chain_hashes(seed: u32) -> Vec<kv_descriptor::SequenceHash> {
    let tokens: Vec<u32> = (0..32).map(|t| seed * 1_000 + t).collect();
    kv_bank::sealed_blocks(None, &tokens, 16)
        .iter()
        .map(|b| b.sequence_hash)
        .collect()
}

/// Removes the last block of `seed`'s chain.
fn removed_tail(publisher: EngineId, event_id: u64, seed: u32) -> KvEvent {
    KvEvent {
        data: KvEventData::Removed {
            sequence_hashes: vec![chain_hashes(seed)[1]],
        },
        ..stored(publisher, event_id)
    }
}

/// Two router inventories with the same workers: decode `d0` (with a
/// directory record, so its slot maps resolve), decode `d1`, and `old`,
/// replaced by `new` under one worker key. Nothing is followed.
struct Twins {
    batched: Arc<RouterInventory>,
    per_event: Arc<RouterInventory>,
    d0: EngineId,
    d1: EngineId,
    old: EngineId,
    new: EngineId,
}

async fn twins(plane: &crate::InProcessInventory) -> Twins {
    let lease = kv_descriptor::OwnerLease::fresh(Role::Decode);
    let (d0, d1) = (lease.engine_id, EngineId::fresh());
    let (old, new) = (EngineId::fresh(), EngineId::fresh());
    let subject = "kv.t.decode.e";
    let make = || async {
        let inv = inventory_on(plane.clone(), Duration::from_secs(2));
        for (key, engine) in [("d0", d0), ("d1", d1), ("d2", old), ("d2", new)] {
            inv.on_announcement(&announcement(key, engine, Role::Decode, subject), 0)
                .await;
        }
        let record = crate::plane::directory::tests_support::record(lease, u64::MAX - 1);
        inv.on_directory(DirectoryChange::Put(record)).await;
        inv
    };
    Twins {
        batched: make().await,
        per_event: make().await,
        d0,
        d1,
        old,
        new,
    }
}

impl Twins {
    /// Applies `items` one at a time to `per_event` (the reference).
    async fn one_by_one(&self, items: &[KvStreamItem]) {
        for item in items {
            self.per_event.on_event(item.clone()).await;
        }
    }

    /// Both inventories hold the same: index content and counters, donor
    /// slot maps of `d0`, applied high-water marks, follow counters.
    async fn assert_same(&self, seeds: impl IntoIterator<Item = u32>) {
        let (a, b) = (&self.batched, &self.per_event);
        assert_eq!(a.stats(), b.stats());
        assert_eq!(a.index().stats(), b.index().stats());
        use crate::DonorDirectory as _;
        for seed in seeds {
            for h in chain_hashes(seed) {
                for e in [self.d0, self.d1, self.old, self.new] {
                    assert_eq!(a.index().holds(e, h), b.index().holds(e, h), "{seed}");
                }
                assert_eq!(
                    a.remote.resolve(self.d0, &[h]).map(|r| r.slot_ids),
                    b.remote.resolve(self.d0, &[h]).map(|r| r.slot_ids),
                    "{seed}"
                );
            }
        }
        let (sa, sb) = (a.state.lock().await, b.state.lock().await);
        for e in [self.d0, self.d1, self.old, self.new] {
            assert_eq!(sa.sync.applied_event_id(e), sb.sync.applied_event_id(e));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_queued_before_the_follower_runs_is_applied_with_fewer_publications() {
    use crate::InProcessPlane;

    let t = twins(&crate::InProcessInventory::new()).await;
    // 310 events on one subject: d0 and d1 interleaved (150 each, every
    // fifth one a removal, d1's 40th of another layout), then 10 late
    // events of the retired `old`.
    let mut events = Vec::new();
    for id in 1..=150u64 {
        for (n, engine) in [(0u32, t.d0), (1, t.d1)] {
            let seed = 2 * id as u32 + n;
            let mut e = if id % 5 == 0 {
                removed_tail(engine, id, seed - 2)
            } else {
                stored_chain(engine, id, seed)
            };
            if engine == t.d1 && id == 40 {
                e.layout_fingerprint = LayoutFingerprint(10);
            }
            events.push(e);
        }
    }
    events.extend((1..=10).map(|id| stored_chain(t.old, id, 1_000 + id as u32)));
    let items: Vec<KvStreamItem> = events.iter().cloned().map(KvStreamItem::Event).collect();

    let events_plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
    let subject = crate::Subject::new("t", "decode", "e").unwrap();
    let rx = KvEventReceiver::subscribe(events_plane.clone(), &subject, Duration::from_secs(1))
        .await
        .unwrap();
    for e in &events {
        events_plane
            .publish(&subject, e.to_wire().unwrap())
            .await
            .unwrap();
    }
    let before = t.batched.index().publications();
    let stop = CancellationToken::new();
    let follower = tokio::spawn(t.batched.clone().follow_receiver(
        rx,
        subject.clone(),
        0,
        CancellationToken::new(),
        stop.clone(),
    ));
    let taken = |s: FollowStats| {
        s.events_applied + s.events_duplicate + s.late_events_ignored + s.events_refused
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while taken(t.batched.stats()) < 310 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            t.batched.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // All 310 were queued when the follower started: 256, then 54, each
    // run with one publication.
    assert_eq!(t.batched.index().publications() - before, 2);

    let before = t.per_event.index().publications();
    t.one_by_one(&items).await;
    // One by one: one per event that reaches the index (not the retired).
    assert_eq!(t.per_event.index().publications() - before, 300);
    t.assert_same((0..=302).chain(1_001..=1_010)).await;
    let st = t.batched.stats();
    assert_eq!(
        (
            st.events_applied,
            st.events_duplicate,
            st.late_events_ignored,
            st.events_refused
        ),
        (299, 0, 10, 1),
        "{st:?}"
    );
    // What the events left: d0 holds seed 2 whole, seed 8's tail removed
    // (event 5 removed it), a held slot resolves.
    let (d0, idx) = (t.d0, t.batched.index());
    assert!(!idx.holds(d0, chain_hashes(2)[1]).is_empty());
    assert!(!idx.holds(d0, chain_hashes(8)[0]).is_empty());
    assert!(idx.holds(d0, chain_hashes(8)[1]).is_empty());
    assert!(idx.holds(t.old, chain_hashes(1_001)[0]).is_empty());
    {
        use crate::DonorDirectory as _;
        assert_eq!(
            t.batched
                .remote
                .resolve(d0, &[chain_hashes(2)[1]])
                .unwrap()
                .slot_ids,
            vec![5]
        );
    }
    assert_eq!(
        t.batched.state.lock().await.sync.applied_event_id(d0),
        Some(150)
    );

    // An idle stream: a lone event is applied at once, with one publication.
    let before = t.batched.index().publications();
    events_plane
        .publish(&subject, stored_chain(d0, 151, 2_000).to_wire().unwrap())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while t.batched.stats().events_applied < 300 {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            t.batched.stats()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(t.batched.index().publications() - before, 1);
    assert!(!idx.holds(d0, chain_hashes(2_000)[1]).is_empty());
    stop.cancel();
    follower.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_range_inside_a_burst_is_handled_between_the_events_around_it() {
    use kv_descriptor::SequenceHash;

    // d0's snapshot: one block, consistent with event 2.
    let plane = crate::InProcessInventory::new();
    let t = twins(&plane).await;
    let d0 = t.d0;
    let mut server = plane
        .serve(&crate::inventory_subject("t", d0).unwrap())
        .await
        .unwrap();
    let snapshot = snapshot_of(d0, 1, 2, 1);
    let answering = tokio::spawn(async move {
        while let Some(req) = server.next().await {
            req.respond(snapshot.clone());
        }
    });
    let items = vec![
        KvStreamItem::Event(stored_chain(d0, 1, 1)),
        KvStreamItem::Event(stored_chain(d0, 2, 2)),
        KvStreamItem::Lost {
            publisher: d0,
            from_event_id: 3,
            to_event_id: 4,
        },
        KvStreamItem::Event(stored_chain(d0, 5, 5)),
        KvStreamItem::Event(removed_tail(d0, 6, 5)),
    ];
    let before = t.batched.index().publications();
    t.batched.on_events(items.clone()).await;
    // Events 1-2 (one publication), the snapshot, events 5-6 (one).
    assert_eq!(t.batched.index().publications() - before, 3);
    let st = t.batched.stats();
    // Events 1 and 2 applied before the snapshot (after it they would be
    // duplicates of it), 5 and 6 after it (before it, the snapshot at 2
    // would be stale against 6 and fail).
    assert_eq!(
        (
            st.events_applied,
            st.events_duplicate,
            st.lost_ranges,
            st.lost_covered,
            st.snapshots_applied,
            st.snapshots_failed
        ),
        (4, 0, 1, 0, 1, 0),
        "{st:?}"
    );
    let idx = t.batched.index();
    assert!(!idx.holds(d0, SequenceHash(5000)).is_empty());
    assert!(
        idx.holds(d0, chain_hashes(1)[0]).is_empty(),
        "replaced by the snapshot"
    );
    assert!(
        idx.holds(d0, chain_hashes(2)[1]).is_empty(),
        "replaced by the snapshot"
    );
    assert!(!idx.holds(d0, chain_hashes(5)[0]).is_empty());
    assert!(
        idx.holds(d0, chain_hashes(5)[1]).is_empty(),
        "removed by event 6"
    );
    assert_eq!(
        t.batched.state.lock().await.sync.applied_event_id(d0),
        Some(6)
    );
    t.one_by_one(&items).await;
    t.assert_same([1, 2, 5]).await;
    answering.abort();
}

#[tokio::test]
async fn duplicates_and_a_retired_incarnation_inside_a_batch_count_as_before() {
    let t = twins(&crate::InProcessInventory::new()).await;
    let (d0, d1, old, new) = (t.d0, t.d1, t.old, t.new);
    let mut other_layout = stored_chain(d1, 3, 31);
    other_layout.layout_fingerprint = LayoutFingerprint(10);
    let mut unchained = stored_chain(d1, 2, 32);
    if let KvEventData::Stored { parent, .. } = &mut unchained.data {
        // A parent d1 does not hold.
        *parent = Some(chain_hashes(99)[1]);
    }
    let items: Vec<KvStreamItem> = [
        stored_chain(d0, 1, 1),
        stored_chain(d0, 1, 1), // duplicate
        stored_chain(d0, 2, 2),
        stored_chain(old, 1, 3), // retired incarnation
        stored_chain(d0, 2, 2),  // duplicate
        stored_chain(new, 1, 4),
        stored_chain(d1, 1, 30),
        unchained,               // refused: does not chain
        other_layout,            // refused by the index
        stored_chain(old, 2, 5), // retired incarnation
        removed_tail(d0, 3, 1),
    ]
    .into_iter()
    .map(KvStreamItem::Event)
    .collect();
    let before = t.batched.index().publications();
    t.batched.on_events(items.clone()).await;
    assert_eq!(t.batched.index().publications() - before, 1);
    let st = t.batched.stats();
    assert_eq!(
        (
            st.events_applied,
            st.events_duplicate,
            st.late_events_ignored,
            st.events_refused
        ),
        (5, 2, 2, 2),
        "{st:?}"
    );
    assert!(t.batched.index().holds(old, chain_hashes(3)[0]).is_empty());
    assert!(!t.batched.index().holds(new, chain_hashes(4)[0]).is_empty());
    assert!(t.batched.index().holds(d0, chain_hashes(1)[1]).is_empty());
    assert!(!t.batched.index().holds(d0, chain_hashes(2)[1]).is_empty());
    {
        let st = t.batched.state.lock().await;
        assert_eq!(st.sync.applied_event_id(d0), Some(3));
        assert_eq!(st.sync.applied_event_id(d1), Some(1));
        assert_eq!(st.sync.applied_event_id(old), None);
    }
    t.one_by_one(&items).await;
    t.assert_same([1, 2, 3, 4, 5, 30, 31, 32, 99]).await;
}

/// Runs `inv`'s followers on `plane` and `directory` (namespace `t`,
/// announce period 1 s) as the binary does; they stop when the returned
/// token is cancelled or the task set is dropped.
async fn follow_in_process(
    inv: &Arc<RouterInventory>,
    plane: Arc<dyn EventPlane>,
    directory: Arc<dyn DirectoryPlane>,
) -> (JoinSet<()>, CancellationToken) {
    let stop = CancellationToken::new();
    let followers = inv
        .follow(plane, directory, "t", Duration::from_secs(1), stop.clone())
        .await
        .unwrap();
    (followers, stop)
}

#[path = "follow_reopen_tests.rs"]
mod reopen;

#[path = "follow_release_tests.rs"]
mod release;

#[path = "follow_liveness_tests.rs"]
mod liveness;
