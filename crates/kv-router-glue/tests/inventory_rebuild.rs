//! A router that restarts rebuilds its inventory from the workers' snapshots
//! (issue 18): a worker publishes 6 events and goes idle; a new router (new
//! index and receiver, same registrations) must find the donor at its next
//! lookup, although the worker's replay ring (4) is shorter than its history
//! and the receiver reports `Lost 1..=6` once the worker speaks again.
//!
//! Tests share one lock (see `agents_common::serial`).

mod agents_common;

use std::sync::Arc;
use std::time::Duration;

use agents_common::*;
use kv_descriptor::*;
use kv_router_glue::*;

/// Stores `blocks` as 6 chained stores of 5 blocks: 6 `Stored` events.
async fn store_in_six(donor: &DonorAgent, blocks: &[StoredBlock]) {
    assert_eq!(blocks.len(), 30);
    for (k, chunk) in blocks.chunks(5).enumerate() {
        let parent = (k > 0).then(|| blocks[k * 5 - 1].sequence_hash);
        store_after(donor, parent, chunk).await;
    }
}

fn assert_hint_from(advice: &Advice, donor: EngineId, h: &[SequenceHash]) {
    assert!(advice.decision.admitted(), "{}", advice.decision);
    let env = advice.hint.as_ref().expect("hint attached");
    let hint = env.fetch_gpu_actions().unwrap().remove(0);
    assert_eq!(hint.donor_engine_id, donor);
    assert_eq!(hint.sequence_hashes, h);
    assert_eq!(hint.fetch_from, 0, "the whole prompt comes from the donor");
}

#[test]
fn a_restarted_router_finds_the_donor_of_an_idle_worker() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let target_id = EngineId::fresh();
        let mut cfg = donor_config("decode-0", &ep);
        cfg.event_ring = 4;
        let inventory: Arc<dyn InventoryPlane> = Arc::new(InProcessInventory::new());
        let mut old =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        let donor = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap();
        donor.serve_inventory(inventory.clone()).await.unwrap();
        let donor_id = donor.bank().owner().engine_id;
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store_in_six(&donor, &blocks).await;
        old.pump().await;
        assert_hint_from(&old.advisor.advise("r0", &h, target_id), donor_id, &h);
        assert_eq!(old.events.stats().delivered, 6, "six events");
        drop(old);

        // The router restarts: new index, new receiver; the worker is idle
        // (it only announces, as it does every period).
        let mut new =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        donor.tick().await.unwrap();
        new.pump().await;
        assert_eq!(new.registry.len(), 1, "same registrations");
        assert_hint_from(&new.advisor.advise("r1", &h, target_id), donor_id, &h);
        assert_eq!(
            new.synced,
            vec![(
                donor_id,
                SyncOutcome::Applied {
                    blocks: 30,
                    last_event_id: 6
                }
            )],
            "failures: {:?}",
            new.sync_failures
        );

        // The worker speaks again: the receiver cannot replay 1..=6 from a
        // ring of 4 and reports them lost; the snapshot already covers them.
        let more = prompt(1_000);
        store(&donor, &more).await;
        assert!(
            new.pump_until(Duration::from_secs(5), |r| !r.lost.is_empty()
                && r.events.stats().delivered >= 1)
                .await,
            "the receiver reported the lost range and delivered event 7"
        );
        assert_eq!(new.lost, vec![(donor_id, 1, 6)]);
        assert_eq!(
            new.lost_covered, 1,
            "the snapshot covers 1..=6: no new snapshot"
        );
        assert_eq!(new.synced.len(), 1);
        assert_hint_from(&new.advisor.advise("r2", &h, target_id), donor_id, &h);
        let hm = hashes(&more);
        assert_hint_from(&new.advisor.advise("r3", &hm, target_id), donor_id, &hm);
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}

/// `router` resolves every block of `h` to the donor's own slot (the
/// prompt is too short for the cost model to admit it, so no advise).
fn assert_resolves(router: &Router, donor: &DonorAgent, h: &[SequenceHash]) {
    let id = donor.bank().owner().engine_id;
    assert_index_holds(router, id, h, &[]);
    let resolved = router.remote.resolve(id, h).unwrap();
    let want: Vec<u32> = h.iter().map(|x| donor.bank().lookup(x).unwrap()).collect();
    assert_eq!(resolved.slot_ids, want, "the donor's own slots");
}

/// Whether `router`'s index holds exactly `held` and none of `gone` for `donor`.
fn assert_index_holds(
    router: &Router,
    donor: EngineId,
    held: &[SequenceHash],
    gone: &[SequenceHash],
) {
    for h in held {
        assert!(!router.index.holds(donor, *h).is_empty(), "{h:?} held");
    }
    for h in gone {
        assert!(router.index.holds(donor, *h).is_empty(), "{h:?} not held");
    }
}

#[test]
fn a_router_restarted_mid_stream_takes_the_stream_from_the_snapshot_on() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let inventory: Arc<dyn InventoryPlane> = Arc::new(InProcessInventory::new());
        let target_id = EngineId::fresh();
        let mut cfg = donor_config("decode-0", &ep);
        cfg.event_ring = 4;
        let donor = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap();
        donor.serve_inventory(inventory.clone()).await.unwrap();
        let donor_id = donor.bank().owner().engine_id;
        let mut old =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        let a = prompt(0);
        store_in_six(&donor, &a).await; // events 1..=6
        old.pump().await;
        drop(old);

        // While no router runs: events 7..=9.
        let b = prompt(2_000);
        let b = &b[..15];
        for (k, chunk) in b.chunks(5).enumerate() {
            let parent = (k > 0).then(|| b[k * 5 - 1].sequence_hash);
            store_after(&donor, parent, chunk).await;
        }
        let mut new =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        // Pages of 7 blocks: the 45 blocks take 7 pages.
        new.sync = InventorySync::new(inventory.clone(), NS, Duration::from_secs(1))
            .unwrap()
            .with_page_blocks(7);
        // Event 10 reaches the new receiver before the snapshot is asked.
        let c = prompt(3_000);
        let c = &c[..5];
        store(&donor, c).await;
        donor.tick().await.unwrap();
        new.pump().await;
        assert_eq!(
            new.synced,
            vec![(
                donor_id,
                SyncOutcome::Applied {
                    blocks: 50,
                    last_event_id: 10
                }
            )],
            "failures: {:?}",
            new.sync_failures
        );
        let all: Vec<SequenceHash> = hashes(&a)
            .into_iter()
            .chain(hashes(b))
            .chain(hashes(c))
            .collect();
        assert_index_holds(&new, donor_id, &all, &[]);

        // Event 11 after the snapshot: a removal, applied once.
        donor.bank().exclude(&[a[0].sequence_hash]);
        donor.publish_events().await.unwrap();
        assert!(
            new.pump_until(Duration::from_secs(5), |r| r
                .index
                .holds(donor_id, a[0].sequence_hash)
                .is_empty())
                .await,
            "event 11 applied"
        );
        // The receiver reported 1..=9 lost (ring of 4), which the snapshot
        // covers; event 10 arrived and counted nothing twice.
        assert_eq!(new.lost, vec![(donor_id, 1, 9)]);
        assert_eq!(new.lost_covered, 1);
        assert_eq!(new.duplicates, 1, "event 10 was already in the snapshot");
        assert_index_holds(&new, donor_id, &all[1..], &all[..1]);
        let advice = new.advisor.advise("a", &hashes(&a), target_id);
        assert!(advice.hint.is_none(), "A's root left: {}", advice.decision);
        assert_resolves(&new, &donor, &hashes(b));
        assert_resolves(&new, &donor, &hashes(c));
        assert_eq!(new.synced.len(), 1, "one snapshot, no second");
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}

#[test]
fn two_router_replicas_on_one_stream_both_find_the_donor() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let inventory: Arc<dyn InventoryPlane> = Arc::new(InProcessInventory::new());
        let target_id = EngineId::fresh();
        let donor = p.donor("decode-0", &ep).await;
        donor.serve_inventory(inventory.clone()).await.unwrap();
        let donor_id = donor.bank().owner().engine_id;
        // Replica 1 runs from the start; replica 2 starts after the worker
        // went idle.
        let mut r1 =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        let a = prompt(0);
        store_in_six(&donor, &a).await;
        let mut r2 =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        donor.tick().await.unwrap();
        r1.pump().await;
        r2.pump().await;
        let ha = hashes(&a);
        for (name, r) in [("r1", &r1), ("r2", &r2)] {
            assert_hint_from(&r.advisor.advise(name, &ha, target_id), donor_id, &ha);
            assert_eq!(r.synced.len(), 1, "{name}: {:?}", r.sync_failures);
        }
        // Both take the next event once.
        let b = prompt(5_000);
        store(&donor, &b[..5]).await;
        let hb = hashes(&b[..5]);
        for (name, r) in [("r1", &mut r1), ("r2", &mut r2)] {
            assert!(
                r.pump_until(Duration::from_secs(5), |r| !r
                    .index
                    .holds(donor_id, hb[0])
                    .is_empty())
                    .await,
                "{name} applied event 7"
            );
            assert_resolves(r, &donor, &hb);
        }
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}

#[test]
fn a_retired_incarnations_snapshot_is_ignored() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep_a = p.endpoint("a");
        let ep_b = p.endpoint("b");
        let inventory: Arc<dyn InventoryPlane> = Arc::new(InProcessInventory::new());
        let target_id = EngineId::fresh();
        let old = p.donor("decode-0", &ep_a).await;
        old.serve_inventory(inventory.clone()).await.unwrap();
        let old_id = old.bank().owner().engine_id;
        let a = prompt(0);
        store_in_six(&old, &a).await;
        // The worker restarts under the same key; the old incarnation still
        // answers (a crash whose process lingers).
        let new = p.donor("decode-0", &ep_b).await;
        new.serve_inventory(inventory.clone()).await.unwrap();
        let new_id = new.bank().owner().engine_id;
        let mut r =
            Router::with_inventory(plane.clone(), dir.as_ref(), target_id, inventory.clone()).await;
        old.announce().await.unwrap();
        new.announce().await.unwrap();
        r.pump().await;
        assert!(r.registry.is_retired(old_id));
        let outcome = r
            .sync
            .rebuild_worker(old_id, &r.index, &r.remote, &r.registry)
            .await
            .unwrap();
        assert_eq!(outcome, SyncOutcome::Retired);
        assert_index_holds(&r, old_id, &[], &hashes(&a));
        assert!(r.sync.snapshot_event_id(old_id).is_none());
        assert_eq!(
            r.sync.snapshot_event_id(new_id),
            Some(0),
            "the new incarnation's (empty) snapshot"
        );

        // A worker answers only for itself, typed.
        let other = EngineId::fresh();
        let reply = old
            .inventory_page(&InventoryRequest {
                engine_id: other,
                from_slot: 0,
                max_blocks: 10,
            })
            .await;
        assert_eq!(
            reply,
            InventoryReply::Refused(InventoryRefusal::OtherEngine { actual: old_id })
        );
        // A closed worker serves nothing.
        old.close(Duration::from_secs(1)).await.unwrap();
        let e = r
            .sync
            .rebuild_worker(new_id, &r.index, &r.remote, &r.registry)
            .await
            .map(|_| ());
        assert!(e.is_ok(), "the live one still answers: {e:?}");
        let gone = inventory
            .request(
                &inventory_subject(NS, old_id).unwrap(),
                Vec::new(),
                Duration::from_millis(100),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(gone, InventoryError::NoResponder { .. }),
            "{gone:?}"
        );
        new.close(Duration::from_secs(1)).await.unwrap();
    });
}

#[test]
fn a_gap_the_ring_still_holds_is_replayed_not_lost() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let target_id = EngineId::fresh();
        // Ring of 64: the whole history. No inventory server: only the
        // stream can repair this router.
        let donor = p.donor("decode-0", &ep).await;
        let donor_id = donor.bank().owner().engine_id;
        let a = prompt(0);
        store_in_six(&donor, &a).await;
        let mut r = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        donor.tick().await.unwrap();
        r.pump().await;
        // Event 7 shows the gap 1..=6; the donor replays it from its ring.
        store(&donor, &prompt(9_000)[..5]).await;
        assert!(
            r.pump_until(Duration::from_secs(3), |r| r.events.stats().delivered >= 7)
                .await,
            "replayed: {:?}, lost {:?}",
            r.events.stats(),
            r.lost
        );
        assert!(r.lost.is_empty(), "{:?}", r.lost);
        let ha = hashes(&a);
        assert_hint_from(&r.advisor.advise("a", &ha, target_id), donor_id, &ha);
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}
