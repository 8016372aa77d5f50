//! The index against the reference model on layouts the walk must cross:
//! a block stored again elsewhere, cold-tier holes, compacted runs.

use kv_descriptor::{EngineId, KvEvent, KvEventData, Role, SequenceHash, StorageTier};
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};

use crate::common::*;

/// Applies `e` to both, asserting the same outcome.
fn both_apply(index: &InventoryIndex, naive: &mut kv_lookup::reference::NaiveIndex, e: KvEvent) {
    assert_eq!(index.apply_event(&e).ok(), naive.apply(&e), "{e:?}");
}

/// Every prefix end of `h` looked up on `target`: donor coverage, tie count
/// and baseline as the reference model finds them; `holds` alike for
/// every block and worker.
fn assert_agrees(
    index: &InventoryIndex,
    naive: &kv_lookup::reference::NaiveIndex,
    h: &[SequenceHash],
    target: EngineId,
    workers: &[WorkerInfo],
) {
    for end in 1..=h.len() {
        let want = naive.lookup(&h[..end], target).unwrap();
        let got = index.lookup(&h[..end], target, BIG);
        let ctx = format!("end {end}: {got:?} {want:?}");
        assert_eq!(
            (got.baseline.native_blocks, got.baseline.retained_blocks),
            (want.native_blocks, want.retained_blocks),
            "{ctx}"
        );
        match got.donor {
            Ok(d) => {
                assert_eq!(d.blocks, want.donor_blocks, "{ctx}");
                assert!(want.best_donors.contains(&d.engine), "{ctx}");
                assert_eq!(d.tied as usize, want.best_donors.len(), "{ctx}");
            }
            Err(_) => assert!(
                want.donor_blocks <= want.native_blocks.max(want.retained_blocks),
                "{ctx}"
            ),
        }
    }
    for &b in h {
        for w in workers {
            assert_eq!(index.holds(w.engine, b), naive.holds(w.engine, b));
        }
    }
}

/// A block removed from the middle of a stored chain (its entry dies, the
/// next one becomes an entry point), stored again by another worker (a new
/// entry in another run) and then by the first again, with a parent: walks
/// cross from run to run and back; then the tail leaves leaf first.
#[test]
fn a_middle_block_removed_and_stored_again_elsewhere_is_walked_across() {
    let index = InventoryIndex::new();
    let mut naive = kv_lookup::reference::NaiveIndex::default();
    let ws: Vec<WorkerInfo> = [Role::Decode, Role::Decode, Role::Prefill]
        .iter()
        .enumerate()
        .map(|(k, &r)| {
            let w = info(r);
            index.register_worker(WorkerKey(k as u64), w).unwrap();
            naive.register(WorkerKey(k as u64), w);
            w
        })
        .collect();
    let (d1, d2, p) = (ws[0], ws[1], ws[2]);
    let h = chain(71, 100);
    both_apply(&index, &mut naive, event(&d1, 1, RET, stored(&h)));
    both_apply(&index, &mut naive, event(&d1, 2, RET, removed(&h[40..41])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 40);
    both_apply(&index, &mut naive, event(&d2, 1, RET, stored(&h[..41])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    both_apply(
        &index,
        &mut naive,
        event(&d1, 3, RET, stored_after(Some(h[39]), &h[40..41])),
    );
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 100);
    // d2 drops the block it stored first: d1's bit keeps the entry.
    both_apply(&index, &mut naive, event(&d2, 2, RET, removed(&h[40..41])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 100);
    // The tail, leaf first, in pieces.
    let tail: Vec<SequenceHash> = h[60..].iter().rev().copied().collect();
    both_apply(&index, &mut naive, event(&d1, 4, RET, removed(&tail[..20])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    both_apply(&index, &mut naive, event(&d1, 5, RET, removed(&tail[20..])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 60);
}

/// Blocks a worker holds only in a cold tier, between blocks it holds in
/// its retained tier (a resync's unordered list), then stored in the
/// retained tier by a chained event: the entries the walk crosses exist
/// (cold bits only) before and after.
#[test]
fn blocks_held_only_in_a_cold_tier_between_hot_ones() {
    let index = InventoryIndex::new();
    let mut naive = kv_lookup::reference::NaiveIndex::default();
    let (d, p) = (info(Role::Decode), info(Role::Prefill));
    for (k, w) in [d, p].iter().enumerate() {
        index.register_worker(WorkerKey(k as u64), *w).unwrap();
        naive.register(WorkerKey(k as u64), *w);
    }
    let ws = [d, p];
    let h = chain(72, 80);
    let hot: Vec<SequenceHash> = h[..10].iter().chain(&h[12..80]).copied().collect();
    let cold = StorageTier::HostPinned;
    // The cold list first: the retained tier's entries come second.
    let inventory = [(cold, h[..20].to_vec()), (RET, hot)];
    index.resync_worker(d.engine, 0, &inventory).unwrap();
    naive.resync(d.engine, 0, &inventory);
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 10);
    both_apply(
        &index,
        &mut naive,
        event(&d, 1, RET, stored_after(Some(h[9]), &h[10..12])),
    );
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 80);
    // The cold copies go; the retained ones stay.
    both_apply(&index, &mut naive, event(&d, 2, cold, KvEventData::Cleared));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 80);
    // Retained gone from the middle, held in the cold tier again.
    both_apply(&index, &mut naive, event(&d, 3, RET, removed(&h[30..32])));
    both_apply(&index, &mut naive, event(&d, 4, cold, stored(&h[..40])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 30);
    // A block's retained copy goes, its cold copy keeps the entry alive,
    // and the retained one comes back to the same entry.
    both_apply(&index, &mut naive, event(&d, 5, RET, removed(&h[5..6])));
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 5);
    both_apply(
        &index,
        &mut naive,
        event(&d, 6, RET, stored_after(Some(h[4]), &h[5..6])),
    );
    assert_agrees(&index, &naive, &h, p.engine, &ws);
    assert_eq!(index.holds(d.engine, h[5]), vec![cold, RET]);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 30);
}

/// A long run mostly removed (under a quarter live, so compacted into a
/// fresh run that keeps followers after their parents and moves entry
/// points), then walked across into another worker's run and back, over
/// two worker groups.
#[test]
fn lookups_after_a_run_is_compacted_across_groups() {
    let index = InventoryIndex::new();
    let mut naive = kv_lookup::reference::NaiveIndex::default();
    let mut ws = Vec::new();
    for k in 0..70u64 {
        let w = info(if k % 5 == 0 {
            Role::Prefill
        } else {
            Role::Decode
        });
        index.register_worker(WorkerKey(k), w).unwrap();
        naive.register(WorkerKey(k), w);
        ws.push(w);
    }
    // Decode workers 1 (group 0) and 66 (group 1), prefill 65 (group 1).
    let (a, b, p) = (ws[1], ws[66], ws[65]);
    let h = chain(73, 300);
    for d in [a, b] {
        both_apply(&index, &mut naive, event(&d, 1, RET, stored(&h)));
    }
    // Keep 0..20, 100 and 280..300 (under a quarter of 300), in 3 events.
    both_apply(&index, &mut naive, event(&a, 2, RET, removed(&h[20..100])));
    both_apply(&index, &mut naive, event(&a, 3, RET, removed(&h[101..280])));
    assert_agrees(&index, &naive, &h, p.engine, &[a, b, p]);
    // Worker a's blocks 20..100 again, in a new run between its survivors.
    both_apply(
        &index,
        &mut naive,
        event(&a, 4, RET, stored_after(Some(h[19]), &h[20..100])),
    );
    assert_agrees(&index, &naive, &h, p.engine, &[a, b, p]);
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 300);
    both_apply(&index, &mut naive, event(&b, 2, RET, removed(&h[150..])));
    assert_agrees(&index, &naive, &h, p.engine, &[a, b, p]);
    let d = index.lookup(&h, p.engine, BIG).donor.unwrap();
    assert_eq!((d.engine, d.blocks), (b.engine, 150)); // a: 101
    both_apply(
        &index,
        &mut naive,
        event(&a, 5, RET, stored_after(Some(h[100]), &h[101..280])),
    );
    assert_agrees(&index, &naive, &h, p.engine, &[a, b, p]);
    let d = index.lookup(&h, p.engine, BIG).donor.unwrap();
    assert_eq!((d.engine, d.blocks), (a.engine, 300));
}
