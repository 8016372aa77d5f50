//! [`RouterInventory`]'s liveness (`follow_liveness.rs`): silence while the
//! router's own connection is down, a worker dropped for silence taken
//! back, and the one check of each donor layout.

use super::*;
use std::sync::atomic::AtomicU64;

/// The router's own disconnection (BUG 1 of trial h33): nobody is dropped
/// however long it lasts; once back, each worker gets a fresh deadline and
/// each decode worker is no donor until a new snapshot.
#[tokio::test]
async fn the_routers_own_disconnection_is_no_workers_silence() {
    let (inv, service) = inventory();
    let (d0, p0) = (EngineId::fresh(), EngineId::fresh());
    inv.on_announcement(&announcement("d0", d0, Role::Decode, "kv.t.decode.e"), 0)
        .await;
    inv.on_announcement(&announcement("p0", p0, Role::Prefill, "kv.t.prefill.e"), 0)
        .await;
    inv.on_event(KvStreamItem::Event(stored(d0, 1))).await;
    assert!(inv.index().workers_needing_resync().is_empty());
    // Unchanged state: nothing done.
    assert!(!inv.on_connection(true, 50).await);
    assert!(inv.on_connection(false, 100).await);
    assert!(!inv.on_connection(false, 200).await);
    // 10 s without announcements, more than 3 periods of 1 s.
    assert_eq!(inv.tick(10_000).await, 0);
    assert!(inv.on_connection(true, 10_000).await);
    // d0 never answered a snapshot (no inventory server here): it stays a
    // donor as before; one that did is excluded until its new snapshot
    // (`a_worker_dropped_for_silence_is_a_donor_again_after_its_snapshot`).
    assert!(inv.index().workers_needing_resync().is_empty());
    let req = crate::service::AdviseRequest {
        request_id: "r".into(),
        target: p0,
        keys: crate::service::AdviseKeys::SequenceHashes(vec![kv_descriptor::SequenceHash(1)]),
    };
    assert!(
        !matches!(
            service.advise(&req).result,
            crate::service::AdviseResult::Refused(crate::service::AdviseRefusal::UnknownTarget(_))
        ),
        "the prefill worker is still a target"
    );
    // Silence counts from the reconnection.
    assert_eq!(inv.tick(13_000).await, 0);
    assert_eq!(inv.workers().await, 2);
    assert_eq!(inv.tick(13_001).await, 2);
    let st = inv.stats();
    assert_eq!((st.connection_losses, st.workers_dropped), (1, 2), "{st:?}");
}

/// A decode worker dropped for silence (a partition of its own) is taken
/// back when it announces again, with the same engine id; its inventory is
/// not trusted until its new snapshot is applied (BUG 1 of trial h33: it
/// was ignored for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropped_for_silence_is_a_donor_again_after_its_snapshot() {
    use kv_descriptor::SequenceHash;

    let lease = kv_descriptor::OwnerLease::fresh(Role::Decode);
    let engine = lease.engine_id;
    let plane = crate::InProcessInventory::new();
    let mut server = plane
        .serve(&crate::inventory_subject("t", engine).unwrap())
        .await
        .unwrap();
    // The worker's snapshot: 3 blocks, consistent with event `at`, which
    // the test moves on between the two snapshots.
    let at = Arc::new(AtomicU64::new(3));
    let answering = {
        let at = at.clone();
        tokio::spawn(async move {
            while let Some(req) = server.next().await {
                let last_event_id = at.load(Ordering::SeqCst);
                let snapshot = snapshot_of(engine, lease.generation, last_event_id, 3);
                req.respond(snapshot);
            }
        })
    };
    let record = crate::plane::directory::tests_support::record(lease, u64::MAX - 1);
    let inv = inventory_on(plane, Duration::from_secs(2));
    let a = announcement("d0", engine, Role::Decode, "kv.t.decode.e");
    // Registered, followed, recorded, then snapshot at the next announcement.
    let subject = inv.on_announcement(&a, 0).await.expect("a new subject");
    inv.followed(&subject).await;
    inv.on_directory(DirectoryChange::Put(record.clone())).await;
    inv.on_announcement(&a, 100).await;
    assert!(!inv.index().holds(engine, SequenceHash(5002)).is_empty());
    assert!(inv.index().workers_needing_resync().is_empty());

    // Silent for more than 3 periods of 1 s: dropped.
    assert_eq!(inv.tick(3_101).await, 1);
    assert!(inv.index().worker(engine).is_none());
    // It announces again: taken back at once, but no donor (its events
    // while away were missed) until a snapshot; its subject was released
    // with it and is followed again first.
    at.store(9, Ordering::SeqCst);
    let again = inv.on_announcement(&a, 5_000).await;
    assert_eq!(again.as_ref().map(|s| s.as_str()), Some("kv.t.decode.e"));
    assert!(inv.index().worker(engine).is_some(), "taken back");
    assert_eq!(inv.index().workers_needing_resync(), vec![engine]);
    assert!(inv.index().holds(engine, SequenceHash(5002)).is_empty());
    // An event after the gap applies but makes it no donor.
    inv.on_event(KvStreamItem::Event(stored(engine, 8))).await;
    assert_eq!(inv.index().workers_needing_resync(), vec![engine]);
    inv.followed(&subject).await;
    // Its record renewal is applied again (ignored while it was away).
    inv.on_directory(DirectoryChange::Put(record)).await;
    inv.on_announcement(&a, 5_100).await;
    assert!(inv.index().workers_needing_resync().is_empty());
    assert!(!inv.index().holds(engine, SequenceHash(5002)).is_empty());
    // The router's own disconnection: no drop, but a worker that serves
    // snapshots is no donor until its next one (events were lost).
    assert!(inv.on_connection(false, 6_000).await);
    assert_eq!(inv.tick(20_000).await, 0);
    assert!(inv.on_connection(true, 20_000).await);
    assert_eq!(inv.index().workers_needing_resync(), vec![engine]);
    inv.on_announcement(&a, 20_100).await;
    assert!(inv.index().workers_needing_resync().is_empty());
    let st = inv.stats();
    assert_eq!(
        (
            st.workers_readmitted,
            st.snapshots_applied,
            st.announcements_ignored,
            st.directory_puts_ignored,
            st.connection_losses
        ),
        (1, 3, 0, 0, 1),
        "{st:?}"
    );
    answering.abort();
}

/// The registry forgets removed incarnations after its retention
/// (`incarnations_forgotten`), and the index forgets them with it: its
/// count of retired incarnations goes back down (it grew by one per
/// dropped worker for the router's whole life before). One that announces
/// after that registers as a new worker, empty, never from what the index
/// held of it before, and its first event (its ids went on while it was
/// away) is a gap that keeps it from donor choice until its snapshot.
/// Within the retention a replaced incarnation's stray announcement is
/// ignored.
#[tokio::test]
async fn an_incarnation_the_registry_forgot_is_forgotten_by_the_index_and_comes_back_empty() {
    use kv_lookup::{LookupBudget, NoDonorReason};

    let (inv, _) = inventory();
    let r = crate::WorkerRegistry::new(1_000, 3).retention_ms();
    let (silent, old, new, p0) = (
        EngineId::fresh(),
        EngineId::fresh(),
        EngineId::fresh(),
        EngineId::fresh(),
    );
    let ann = |key, engine| announcement(key, engine, Role::Decode, "kv.t.decode.e");
    let prefill = announcement("p0", p0, Role::Prefill, "kv.t.prefill.e");
    inv.on_announcement(&ann("d0", silent), 0).await;
    inv.on_announcement(&ann("d1", old), 0).await;
    inv.on_event(KvStreamItem::Event(stored(silent, 1))).await;
    inv.on_event(KvStreamItem::Event(stored(old, 1))).await;
    let hashes: Vec<_> = match &stored(silent, 1).data {
        KvEventData::Stored { blocks, .. } => blocks.iter().map(|b| b.sequence_hash).collect(),
        _ => unreachable!("a store"),
    };
    let donor = || {
        inv.index()
            .lookup(&hashes, p0, LookupBudget::default())
            .donor
            .map(|d| d.engine)
    };
    inv.on_announcement(&prefill, 1_000).await;
    assert!(donor().is_ok(), "both hold the 2 blocks");
    inv.on_announcement(&ann("d1", new), 1_000).await;
    assert_eq!(inv.tick(3_001).await, 1, "d0 silent");
    let retired = || inv.index().stats().retired_incarnations;
    assert_eq!(retired(), 2, "old replaced, d0 dropped");
    assert_eq!(donor(), Err(NoDonorReason::NoRootCoverage));
    // A stray announcement of the replaced one, within the retention.
    inv.on_announcement(&ann("d1", old), 3_500).await;
    assert_eq!(inv.stats().announcements_ignored, 1);
    assert!(inv.index().worker(old).is_none());
    // d1 (new) and p0 stay live; nothing more is heard of d0 after its
    // drop (3_001) nor of old after its stray announcement (3_500).
    let forgotten_at = |t: u64| {
        let (inv, prefill) = (inv.clone(), prefill.clone());
        async move {
            inv.on_announcement(&ann("d1", new), t).await;
            inv.on_announcement(&prefill, t).await;
            assert_eq!(inv.tick(t).await, 0);
            inv.stats().incarnations_forgotten
        }
    };
    assert_eq!(forgotten_at(3_001 + r).await, 0);
    assert_eq!(retired(), 2);
    assert_eq!(forgotten_at(3_002 + r).await, 1, "d0");
    assert_eq!(retired(), 1);
    assert_eq!(forgotten_at(3_500 + r).await, 1);
    assert_eq!(forgotten_at(3_501 + r).await, 2, "old");
    assert_eq!(retired(), 0, "the index forgot both with the registry");

    // d0 registers as new: nothing of what it held before its drop.
    inv.on_announcement(&ann("d0", silent), 3_502 + r).await;
    assert!(inv.index().worker(silent).is_some(), "registered again");
    assert!(inv.index().holds(silent, hashes[0]).is_empty());
    assert_eq!(donor(), Err(NoDonorReason::NoRootCoverage));
    // The forgotten replaced one is a new incarnation now: it takes d1's
    // key (as a restart would), and holds nothing either.
    inv.on_announcement(&ann("d1", old), 3_502 + r).await;
    assert!(inv.index().worker(new).is_none());
    assert_eq!(retired(), 1, "new, replaced");
    assert!(inv.index().holds(old, hashes[0]).is_empty());
    // Their next events store the blocks again, after a gap: held, but
    // neither is a donor until its snapshot.
    inv.on_event(KvStreamItem::Event(stored(silent, 8))).await;
    inv.on_event(KvStreamItem::Event(stored(old, 2))).await;
    assert!(!inv.index().holds(silent, hashes[0]).is_empty());
    let mut resync = inv.index().workers_needing_resync();
    resync.sort();
    let mut want = vec![silent, old];
    want.sort();
    assert_eq!(resync, want);
    assert_eq!(donor(), Err(NoDonorReason::NoCompatibleDonor));
    let st = inv.stats();
    assert_eq!(
        (
            st.workers_readmitted,
            st.incarnations_forgotten,
            st.workers_dropped,
            st.events_applied
        ),
        (0, 2, 3, 4),
        "{st:?}"
    );
}

/// A decode worker dropped for silence and forgotten by the registry and
/// the index comes back as a new worker: no donor after its first event
/// (a gap), a donor again once its inventory snapshot is applied, which
/// the router asks as for any decode worker without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_worker_that_comes_back_is_a_donor_after_its_snapshot() {
    use kv_descriptor::SequenceHash;

    let lease = kv_descriptor::OwnerLease::fresh(Role::Decode);
    let engine = lease.engine_id;
    let plane = crate::InProcessInventory::new();
    let mut server = plane
        .serve(&crate::inventory_subject("t", engine).unwrap())
        .await
        .unwrap();
    // Its snapshot: 3 blocks, consistent with event 9 once it is back.
    let answering = tokio::spawn(async move {
        while let Some(req) = server.next().await {
            req.respond(snapshot_of(engine, lease.generation, 9, 3));
        }
    });
    let record = crate::plane::directory::tests_support::record(lease, u64::MAX - 1);
    let inv = inventory_on(plane, Duration::from_secs(2));
    let r = crate::WorkerRegistry::new(1_000, 3).retention_ms();
    let a = announcement("d0", engine, Role::Decode, "kv.t.decode.e");
    inv.on_announcement(&a, 0).await.expect("a new subject");
    inv.on_event(KvStreamItem::Event(stored(engine, 1))).await;
    assert_eq!(inv.tick(3_001).await, 1);
    assert_eq!(inv.index().stats().retired_incarnations, 1);
    assert_eq!(inv.tick(3_002 + r).await, 0);
    assert_eq!(inv.stats().incarnations_forgotten, 1);
    assert_eq!(inv.index().stats().retired_incarnations, 0);

    // Back: registered as new, its subject followed again, its record
    // applied again (ignored while the registry remembered it).
    let subject = inv
        .on_announcement(&a, 4_000 + r)
        .await
        .expect("released before");
    inv.followed(&subject).await;
    inv.on_directory(DirectoryChange::Put(record)).await;
    assert_eq!(inv.stats().directory_puts_ignored, 0);
    assert!(inv.index().workers_needing_resync().is_empty());
    inv.on_event(KvStreamItem::Event(stored(engine, 8))).await;
    assert_eq!(inv.index().workers_needing_resync(), vec![engine]);
    // Its next announcement asks the snapshot: a donor again, with it.
    inv.on_announcement(&a, 4_100 + r).await;
    assert!(inv.index().workers_needing_resync().is_empty());
    assert!(!inv.index().holds(engine, SequenceHash(5002)).is_empty());
    let st = inv.stats();
    assert_eq!(
        (
            st.workers_readmitted,
            st.snapshots_applied,
            st.snapshots_failed
        ),
        (0, 1, 0),
        "{st:?}"
    );
    answering.abort();
}

/// Each donor layout's block size is checked once, when its first record
/// arrives (trial h33, BUG 2): the records here have 4-token blocks, which
/// recompute in 4 x 30 µs = 120 µs, below the default 400 µs a host block
/// costs, so no fetch of them can save time; a `--tokens-per-block` of 64
/// given at start is named as differing.
#[tokio::test]
async fn each_donor_layout_is_checked_once_against_the_settings() {
    use crate::plane::directory::tests_support::record;
    let enabled = ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        ..ReuseSettings::default()
    };
    let cheap = ReuseSettings {
        transfer_source_estimated_block_us: 100.0,
        ..enabled.clone()
    };
    for (model, expected) in [
        (CostModel::new(enabled.clone(), 64).unwrap(), (1, 1)),
        (CostModel::for_announced_layouts(enabled).unwrap(), (1, 0)),
        (CostModel::for_announced_layouts(cheap).unwrap(), (0, 0)),
    ] {
        let inv = inventory_of(model).0;
        for _ in 0..2 {
            let r = record(kv_descriptor::OwnerLease::fresh(Role::Decode), u64::MAX - 1);
            assert_eq!(r.manifest().layout().tokens_per_block(), 4);
            inv.on_directory(DirectoryChange::Put(r)).await;
        }
        let st = inv.stats();
        assert_eq!(
            (
                st.donor_layouts_unprofitable,
                st.donor_layouts_block_size_mismatch
            ),
            expected,
            "{st:?}"
        );
        assert_eq!(st.directory_changes, 2);
    }
}

/// The donor directory forgets the newest generation of an incarnation
/// the registry forgot (trial h39, 2: the cache kept it for every engine
/// that ever published a record, one entry per donor restart for the
/// router's whole life, while `incarnations_forgotten` counted them as
/// forgotten).
#[tokio::test]
async fn the_directory_forgets_the_generations_of_forgotten_incarnations() {
    use crate::plane::directory::tests_support::record;
    use kv_descriptor::OwnerLease;

    let (inv, _) = inventory();
    let r = crate::WorkerRegistry::new(1_000, 3).retention_ms();
    let (l1, l2) = (
        OwnerLease::fresh(Role::Decode),
        OwnerLease::fresh(Role::Decode),
    );
    let ann = |engine| announcement("d0", engine, Role::Decode, "kv.t.decode.e");
    inv.on_announcement(&ann(l1.engine_id), 0).await;
    inv.on_directory(DirectoryChange::Put(record(l1, u64::MAX - 1)))
        .await;
    assert_eq!(inv.remote.generations_known(), 1);
    // l2 replaces l1 and publishes its own record.
    inv.on_announcement(&ann(l2.engine_id), 1_000).await;
    inv.on_directory(DirectoryChange::Put(record(l2, u64::MAX - 1)))
        .await;
    assert_eq!(
        inv.remote.generations_known(),
        2,
        "l1's kept after its drop"
    );
    inv.on_announcement(&ann(l2.engine_id), 1_000 + r).await;
    assert_eq!(inv.stats().incarnations_forgotten, 0);
    assert_eq!(inv.remote.generations_known(), 2);
    // Past l1's retention, l2 still announcing.
    inv.on_announcement(&ann(l2.engine_id), 1_001 + r).await;
    assert_eq!(inv.stats().incarnations_forgotten, 1);
    assert_eq!(inv.remote.generations_known(), 1, "l1's forgotten with it");
}

/// Trial h44, 6: a prefill engine re-announcing itself as a decode worker
/// was taken as a refresh, refused by the index at every announcement, and
/// stayed an advise target. It is ignored (`announcements_ignored`) and
/// not heard: dropped for silence (no target then), then taken back as
/// what it announces.
#[tokio::test]
async fn an_engine_changing_its_role_is_ignored_and_dropped_for_silence() {
    let (inv, service) = inventory();
    let p = EngineId::fresh();
    let subject = "kv.t.prefill.e";
    inv.on_announcement(&announcement("p0", p, Role::Prefill, subject), 0)
        .await;
    let target = || {
        let req = crate::service::AdviseRequest {
            request_id: "r".into(),
            target: p,
            keys: crate::service::AdviseKeys::SequenceHashes(vec![kv_descriptor::SequenceHash(1)]),
        };
        !matches!(
            service.advise(&req).result,
            crate::service::AdviseResult::Refused(crate::service::AdviseRefusal::UnknownTarget(_))
        )
    };
    let as_decode = announcement("p0", p, Role::Decode, subject);
    inv.on_announcement(&as_decode, 1_000).await;
    inv.on_announcement(&as_decode, 2_000).await;
    let st = inv.stats();
    assert_eq!(
        (st.announcements, st.announcements_ignored),
        (1, 2),
        "{st:?}"
    );
    assert!(target(), "still the prefill target it registered as");
    assert_eq!(
        inv.index().worker(p).map(|(_, w)| w.role),
        Some(Role::Prefill)
    );
    assert_eq!(inv.tick(3_001).await, 1, "not renewed since 0");
    assert!(!target());
    inv.on_announcement(&as_decode, 3_500).await;
    assert!(!target(), "a decode worker is no target");
    assert_eq!(
        inv.index().worker(p).map(|(_, w)| w.role),
        Some(Role::Decode)
    );
    let st = inv.stats();
    assert_eq!(
        (
            st.announcements,
            st.announcements_ignored,
            st.workers_dropped,
            st.workers_readmitted
        ),
        (2, 2, 1, 1),
        "{st:?}"
    );
}
