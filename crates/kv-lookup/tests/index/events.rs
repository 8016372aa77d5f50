//! Event application: stored, removed and cleared blocks, duplicates and
//! gaps, stores that do not chain, new incarnations, events that contradict
//! the registration.

use kv_descriptor::{KvEventData, Role, SequenceHash, StorageTier};
use kv_lookup::{
    EventOutcome, InventoryIndex, LookupError, NoDonorReason, Registration, UnchainedStore,
    WorkerKey,
};

use crate::common::*;

#[test]
fn stored_removed_cleared_change_holdings() {
    let index = InventoryIndex::new();
    let d = registered(&index, 1, Role::Decode);
    let h = chain(1, 6);
    assert_eq!(
        index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap(),
        EventOutcome::Applied { changed: 6 }
    );
    assert_eq!(
        index
            .apply_event(&event(&d, 2, DEV, stored(&h[..2])))
            .unwrap(),
        EventOutcome::Applied { changed: 2 }
    );
    assert_eq!(index.holds(d.engine, h[0]), vec![DEV, RET]);
    assert_eq!(index.holds(d.engine, h[5]), vec![RET]);
    // Removing two held and one absent hash flips two bits.
    let mut gone = h[4..].to_vec();
    gone.push(SequenceHash(12345));
    assert_eq!(
        index
            .apply_event(&event(&d, 3, RET, removed(&gone)))
            .unwrap(),
        EventOutcome::Applied { changed: 2 }
    );
    assert_eq!(index.holds(d.engine, h[4]), Vec::<StorageTier>::new());
    assert_eq!(index.stats().held_blocks, [2, 0, 0, 0, 4]);
    // Clearing the retained tier leaves the device tier alone.
    assert_eq!(
        index
            .apply_event(&event(&d, 4, RET, KvEventData::Cleared))
            .unwrap(),
        EventOutcome::Applied { changed: 4 }
    );
    assert_eq!(index.holds(d.engine, h[0]), vec![DEV]);
    let s = index.stats();
    assert_eq!(
        (s.held_blocks, s.entries, s.events_applied),
        ([2, 0, 0, 0, 0], 2, 4)
    );
}

#[test]
fn duplicates_are_ignored_and_gaps_need_a_resync() {
    let index = InventoryIndex::new();
    let d = registered(&index, 1, Role::Decode);
    let p = registered(&index, 2, Role::Prefill);
    let h = chain(2, 8);
    index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap();
    // A replayed older event must not undo anything.
    assert_eq!(
        index.apply_event(&event(&d, 1, RET, removed(&h))).unwrap(),
        EventOutcome::Duplicate { last_event_id: 1 }
    );
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 8);

    // Event 3 after 1: event 2 was lost.
    assert_eq!(
        index
            .apply_event(&event(&d, 3, RET, removed(&h[6..])))
            .unwrap(),
        EventOutcome::Gap {
            expected: 2,
            got: 3,
            changed: 2
        }
    );
    assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    assert_eq!(
        index.lookup(&h, p.engine, BIG).donor,
        Err(NoDonorReason::NoCompatibleDonor)
    );
    assert_eq!(index.stats().gaps, 1);

    index
        .resync_worker(d.engine, 5, &[(RET, h[..5].to_vec())])
        .unwrap();
    assert!(index.workers_needing_resync().is_empty());
    assert_eq!(index.lookup(&h, p.engine, BIG).donor.unwrap().blocks, 5);
    // Events up to the snapshot's id are duplicates, the next one applies.
    assert!(matches!(
        index.apply_event(&event(&d, 5, RET, stored(&h))).unwrap(),
        EventOutcome::Duplicate { .. }
    ));
    assert_eq!(
        index.apply_event(&event(&d, 6, RET, stored(&h))).unwrap(),
        EventOutcome::Applied { changed: 3 }
    );

    // A publisher first seen at id 4 missed 1..=3.
    let late = info(Role::Decode);
    assert_eq!(
        index
            .apply_event(&event(&late, 4, RET, stored(&h)))
            .unwrap(),
        EventOutcome::Gap {
            expected: 1,
            got: 4,
            changed: 8
        }
    );
}

#[test]
fn a_store_whose_parent_is_not_held_creates_nothing_and_needs_a_resync() {
    // Issue 15 item 9: `Stored { parent: Some(P0), blocks: [P1, P2, P3] }`
    // with P0 never stored was applied with `changed: 3`, no resync, and a
    // request starting at P1 matched 3 blocks "from the root".
    let index = InventoryIndex::new();
    let t = registered(&index, 0, Role::Prefill);
    let d = registered(&index, 1, Role::Decode);
    let h = chain(40, 4);
    assert_eq!(
        index
            .apply_event(&event(&d, 1, RET, stored_after(Some(h[0]), &h[1..])))
            .unwrap(),
        EventOutcome::Unchained {
            cause: UnchainedStore::ParentNotHeld { parent: h[0] }
        }
    );
    for b in &h[1..] {
        assert!(index.holds(d.engine, *b).is_empty(), "{b:?} was indexed");
    }
    assert_eq!(index.stats().entries, 0);
    assert_eq!(index.stats().unchained, 1);
    assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    assert_eq!(
        index.lookup(&h[1..], t.engine, BIG).donor,
        Err(NoDonorReason::NoCompatibleDonor)
    );
    // Its id was consumed: the next one is in order, not a gap.
    assert_eq!(
        index
            .apply_event(&event(&d, 2, RET, stored(&h[..1])))
            .unwrap(),
        EventOutcome::Applied { changed: 1 }
    );
    // A parent held in another tier does not count; one held in the tier does.
    let dev = event(&d, 3, DEV, stored_after(Some(h[0]), &h[1..]));
    assert!(matches!(
        index.apply_event(&dev).unwrap(),
        EventOutcome::Unchained { .. }
    ));
    assert_eq!(
        index
            .apply_event(&event(&d, 4, RET, stored_after(Some(h[0]), &h[1..])))
            .unwrap(),
        EventOutcome::Applied { changed: 3 }
    );
    // A resync makes the worker a donor again, covering from the root.
    index
        .resync_worker(d.engine, 4, &[(RET, h.clone())])
        .unwrap();
    assert_eq!(index.lookup(&h, t.engine, BIG).donor.unwrap().blocks, 4);
    // A removed parent is not held either.
    index
        .apply_event(&event(&d, 5, RET, removed(&h[3..])))
        .unwrap();
    index
        .apply_event(&event(&d, 6, RET, removed(&h[2..3])))
        .unwrap();
    let report = index.apply_events(&[event(&d, 7, RET, stored_after(Some(h[2]), &h[3..]))]);
    assert_eq!(
        report.unchained,
        vec![(d.engine, 7, UnchainedStore::ParentNotHeld { parent: h[2] })]
    );
    assert_eq!((report.applied, report.changed), (0, 0));
    assert!(index.holds(d.engine, h[3]).is_empty());
}

#[test]
fn a_store_that_does_not_chain_from_its_stated_parent_creates_nothing() {
    let index = InventoryIndex::new();
    let t = registered(&index, 0, Role::Prefill);
    let d = registered(&index, 1, Role::Decode);
    let (a, b) = (chain(41, 3), chain(42, 3));
    index
        .apply_event(&event(&d, 1, RET, stored(&a[..1])))
        .unwrap();
    // b[1] chains from b[0], not from the stated parent a[0].
    let e = event(&d, 2, RET, stored_after(Some(a[0]), &b[1..]));
    let EventOutcome::Unchained {
        cause:
            UnchainedStore::BrokenLink {
                index: 0,
                sequence_hash,
                expected,
            },
    } = index.apply_event(&e).unwrap()
    else {
        panic!("not refused as a broken link");
    };
    assert_eq!(sequence_hash, b[1]);
    assert_ne!(expected, b[1]);
    assert!(index.holds(d.engine, b[1]).is_empty());
    assert!(index.holds(d.engine, b[2]).is_empty());
    assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    // Inside one event too: a[2] does not chain from b[1].
    index
        .resync_worker(d.engine, 2, &[(RET, a[..1].to_vec())])
        .unwrap();
    let mut blocks = match stored(&a[..2]) {
        KvEventData::Stored { blocks, .. } => blocks,
        _ => unreachable!(),
    };
    blocks.push(match stored(&b[1..2]) {
        KvEventData::Stored { blocks, .. } => blocks[0],
        _ => unreachable!(),
    });
    let e = event(
        &d,
        3,
        RET,
        KvEventData::Stored {
            parent: None,
            blocks,
        },
    );
    assert!(matches!(
        index.apply_event(&e).unwrap(),
        EventOutcome::Unchained {
            cause: UnchainedStore::BrokenLink { index: 2, .. }
        }
    ));
    assert!(
        index.holds(d.engine, a[1]).is_empty(),
        "nothing of it is stored"
    );
    assert_eq!(
        index.lookup(&a, t.engine, BIG).donor,
        Err(NoDonorReason::NoCompatibleDonor)
    );
    // After a gap an unchained store is reported as the gap, still not stored.
    index.resync_worker(d.engine, 3, &[]).unwrap();
    assert_eq!(
        index
            .apply_event(&event(&d, 9, RET, stored_after(Some(a[0]), &a[1..])))
            .unwrap(),
        EventOutcome::Gap {
            expected: 4,
            got: 9,
            changed: 0
        }
    );
    assert!(index.holds(d.engine, a[1]).is_empty());
}

#[test]
fn new_incarnation_drops_old_entries_and_late_events() {
    let index = InventoryIndex::new();
    let old = registered(&index, 7, Role::Decode);
    let p = registered(&index, 8, Role::Prefill);
    let h = chain(3, 4);
    index.apply_event(&event(&old, 1, RET, stored(&h))).unwrap();
    let new = info(Role::Decode);
    assert_eq!(
        index.register_worker(WorkerKey(7), new).unwrap(),
        Registration::Replaced { old: old.engine }
    );
    assert!(index.holds(old.engine, h[0]).is_empty());
    assert_eq!(index.stats().entries, 0);
    assert_eq!(
        index.lookup(&h, p.engine, BIG).donor,
        Err(NoDonorReason::NoRootCoverage)
    );
    assert_eq!(
        index.apply_event(&event(&old, 2, RET, stored(&h))).unwrap(),
        EventOutcome::FromRetiredIncarnation
    );
    assert_eq!(index.stats().entries, 0);
    assert_eq!(
        index.register_worker(WorkerKey(9), old),
        Err(LookupError::RetiredIncarnation { engine: old.engine })
    );
    // The new incarnation starts its own id sequence at 1.
    assert_eq!(
        index.apply_event(&event(&new, 1, RET, stored(&h))).unwrap(),
        EventOutcome::Applied { changed: 4 }
    );
    assert_eq!(
        index.lookup(&h, p.engine, BIG).donor.unwrap().engine,
        new.engine
    );
}

#[test]
fn an_event_that_contradicts_the_registration_is_refused_whole() {
    let index = InventoryIndex::new();
    let d = registered(&index, 1, Role::Decode);
    let h = chain(4, 3);
    let mut e = event(&d, 1, RET, stored(&h));
    e.role = Role::Prefill;
    let err = index.apply_event(&e).unwrap_err();
    assert!(err.to_string().contains("`role`"), "{err}");
    e.role = Role::Decode;
    e.tp_size = 2;
    assert!(index
        .apply_event(&e)
        .unwrap_err()
        .to_string()
        .contains("`tp_size`"));
    e.tp_size = 1;
    e.event_id = 0;
    assert_eq!(
        index.apply_event(&e),
        Err(LookupError::ZeroEventId { engine: d.engine })
    );
    assert_eq!(index.stats().entries, 0);
    // Refused events did not consume ids.
    e.event_id = 1;
    assert_eq!(
        index.apply_event(&e).unwrap(),
        EventOutcome::Applied { changed: 3 }
    );
}
