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
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
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
