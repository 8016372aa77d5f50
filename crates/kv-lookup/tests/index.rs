//! Event application, donor rules, budgets and concurrency of `InventoryIndex`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use kv_descriptor::{
    sequence_hashes, token_block_hashes, EngineId, KvEvent, KvEventData, LayoutFingerprint, Role,
    SequenceHash, StorageTier, StoredBlock, TokenBlockHash,
};
use kv_lookup::{
    EventOutcome, InventoryIndex, LookupBudget, LookupError, NoDonorReason, Registration,
    UnchainedStore, WorkerInfo, WorkerKey,
};

const FP: LayoutFingerprint = LayoutFingerprint(0xABCD);
const RET: StorageTier = StorageTier::RetainedGpuDirect;
const DEV: StorageTier = StorageTier::Device;

/// Token hash of every sequence hash [`chain`] made, so that [`stored`]
/// sends true chains.
fn token_hashes() -> &'static Mutex<HashMap<SequenceHash, TokenBlockHash>> {
    static MAP: OnceLock<Mutex<HashMap<SequenceHash, TokenBlockHash>>> = OnceLock::new();
    MAP.get_or_init(Default::default)
}

fn chain(seed: u32, blocks: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..blocks as u32 * 16)
        .map(|t| t.wrapping_mul(2654435761).wrapping_add(seed))
        .collect();
    let hashes = sequence_hashes(&tokens, 16);
    let mut map = token_hashes().lock().unwrap();
    for (h, t) in hashes.iter().zip(token_block_hashes(&tokens, 16)) {
        map.insert(*h, t);
    }
    hashes
}

fn info(role: Role) -> WorkerInfo {
    WorkerInfo {
        engine: EngineId::fresh(),
        role,
        layout_fingerprint: FP,
        tp_size: 1,
    }
}

fn event(w: &WorkerInfo, id: u64, tier: StorageTier, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher: w.engine,
        event_id: id,
        role: w.role,
        layout_fingerprint: w.layout_fingerprint,
        tp_size: w.tp_size,
        tier,
        data,
    }
}

/// Stored event of `hashes` (made by [`chain`]), `parent: None`.
fn stored(hashes: &[SequenceHash]) -> KvEventData {
    stored_after(None, hashes)
}

fn stored_after(parent: Option<SequenceHash>, hashes: &[SequenceHash]) -> KvEventData {
    let map = token_hashes().lock().unwrap();
    KvEventData::Stored {
        parent,
        blocks: hashes
            .iter()
            .map(|&h| StoredBlock {
                sequence_hash: h,
                token_hash: map.get(&h).copied().unwrap_or(TokenBlockHash(h.0 ^ 1)),
                slot: None,
            })
            .collect(),
    }
}

fn removed(hashes: &[SequenceHash]) -> KvEventData {
    KvEventData::Removed {
        sequence_hashes: hashes.to_vec(),
    }
}

fn registered(index: &InventoryIndex, key: u64, role: Role) -> WorkerInfo {
    let w = info(role);
    assert_eq!(
        index.register_worker(WorkerKey(key), w).unwrap(),
        Registration::Registered
    );
    w
}

const BIG: LookupBudget = LookupBudget::new(1_000_000, u32::MAX);

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

#[test]
fn donor_must_be_compatible_decode_with_retained_root_coverage() {
    let index = InventoryIndex::new();
    let target = registered(&index, 1, Role::Prefill);
    let h = chain(5, 10);
    // A prefill worker's retained blocks never make it a donor.
    let other_prefill = registered(&index, 2, Role::Prefill);
    index
        .apply_event(&event(&other_prefill, 1, RET, stored(&h)))
        .unwrap();
    assert_eq!(
        index.lookup(&h, target.engine, BIG).donor,
        Err(NoDonorReason::NoCompatibleDonor)
    );
    // A decode worker holding the prefix only in its device cache is no donor.
    let d_dev = registered(&index, 3, Role::Decode);
    index
        .apply_event(&event(&d_dev, 1, DEV, stored(&h)))
        .unwrap();
    assert_eq!(
        index.lookup(&h, target.engine, BIG).donor,
        Err(NoDonorReason::NoRootCoverage)
    );
    // Holding everything but the root block is no coverage.
    let d_hole = registered(&index, 4, Role::Decode);
    index
        .apply_event(&event(&d_hole, 1, RET, stored(&h[1..])))
        .unwrap();
    assert_eq!(
        index.lookup(&h, target.engine, BIG).donor,
        Err(NoDonorReason::NoRootCoverage)
    );
    // Other layout or other TP: incompatible even with full coverage.
    for (k, w) in [
        (
            5,
            WorkerInfo {
                layout_fingerprint: LayoutFingerprint(1),
                ..info(Role::Decode)
            },
        ),
        (
            6,
            WorkerInfo {
                tp_size: 2,
                ..info(Role::Decode)
            },
        ),
    ] {
        index.register_worker(WorkerKey(k), w).unwrap();
        index.apply_event(&event(&w, 1, RET, stored(&h))).unwrap();
    }
    assert_eq!(
        index.lookup(&h, target.engine, BIG).donor,
        Err(NoDonorReason::NoRootCoverage)
    );
    // A hole in the middle cuts coverage there.
    let good = registered(&index, 7, Role::Decode);
    index
        .apply_event(&event(&good, 1, RET, stored(&h)))
        .unwrap();
    index
        .apply_event(&event(&good, 2, RET, removed(&h[6..7])))
        .unwrap();
    let d = index.lookup(&h, target.engine, BIG).donor.unwrap();
    assert_eq!(
        (d.engine, d.worker, d.blocks, d.tied),
        (good.engine, WorkerKey(7), 6, 1)
    );
    // The longest of several donors wins.
    let longer = registered(&index, 8, Role::Decode);
    index
        .apply_event(&event(&longer, 1, RET, stored(&h[..9])))
        .unwrap();
    assert_eq!(
        index.lookup(&h, target.engine, BIG).donor.unwrap().engine,
        longer.engine
    );
}

#[test]
fn target_rules_and_baseline() {
    let index = InventoryIndex::new();
    let t = registered(&index, 1, Role::Prefill);
    let d = registered(&index, 2, Role::Decode);
    let h = chain(6, 10);
    assert_eq!(
        index.lookup(&[], t.engine, BIG).donor,
        Err(NoDonorReason::EmptyRequest)
    );
    let stranger = EngineId::fresh();
    assert_eq!(
        index.lookup(&h, stranger, BIG).donor,
        Err(NoDonorReason::UnknownTarget(stranger))
    );
    assert_eq!(
        index.lookup(&h, d.engine, BIG).donor,
        Err(NoDonorReason::TargetNotPrefill(d.engine, Role::Decode))
    );

    index
        .apply_event(&event(&d, 1, RET, stored(&h[..6])))
        .unwrap();
    index
        .apply_event(&event(&t, 1, DEV, stored(&h[..3])))
        .unwrap();
    index
        .apply_event(&event(&t, 2, RET, stored(&h[..4])))
        .unwrap();
    let out = index.lookup(&h, t.engine, BIG);
    assert_eq!(
        (
            out.baseline.native_blocks,
            out.baseline.retained_blocks,
            out.baseline.blocks()
        ),
        (3, 4, 4)
    );
    assert_eq!(out.donor.unwrap().blocks, 6);
    // The target's own retained inventory raises the bar but is never a donor.
    index
        .apply_event(&event(&t, 3, RET, stored(&h[..8])))
        .unwrap();
    let out = index.lookup(&h, t.engine, BIG);
    assert_eq!(out.baseline.retained_blocks, 8);
    assert_eq!(
        out.donor,
        Err(NoDonorReason::NotBeyondBaseline {
            donor_blocks: 6,
            baseline_blocks: 8
        })
    );
}

#[test]
fn budget_exhaustion_returns_best_so_far_flagged() {
    let index = InventoryIndex::new();
    let t = registered(&index, 1, Role::Prefill);
    let d = registered(&index, 2, Role::Decode);
    let h = chain(7, 40);
    index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap();
    let out = index.lookup(&h, t.engine, LookupBudget::new(1_000_000, 5));
    assert!(out.budget_exhausted);
    assert_eq!((out.probes, out.donor.unwrap().blocks), (5, 5));
    let out = index.lookup(&h, t.engine, LookupBudget::new(1_000_000, 0));
    assert_eq!(
        (out.budget_exhausted, out.donor),
        (true, Err(NoDonorReason::BudgetExhausted { probes: 0 }))
    );
    let out = index.lookup(&h, t.engine, LookupBudget::new(0, u32::MAX));
    assert!(out.budget_exhausted && out.donor.is_err(), "{out:?}");
    let out = index.lookup(&h, t.engine, BIG);
    assert_eq!(
        (out.budget_exhausted, out.probes, out.donor.unwrap().blocks),
        (false, 40, 40)
    );
}

/// Lookups take whole chunks of a long run at once; every way a holder
/// can drop out inside a chunk must still end its coverage exactly there.
/// A chunk summary left stale by any of these events would let a walk
/// skip past the missing block (the per-block walk and the reference
/// model see it).
#[test]
fn long_runs_end_coverage_exactly_where_a_holder_drops_out() {
    let index = InventoryIndex::new();
    let t = registered(&index, 1, Role::Prefill);
    let a = registered(&index, 2, Role::Decode);
    let b = registered(&index, 3, Role::Decode);
    let h = chain(21, 2_100);
    index.apply_event(&event(&a, 1, RET, stored(&h))).unwrap();
    // B's store only sets bits on A's entries.
    index.apply_event(&event(&b, 1, RET, stored(&h))).unwrap();
    index
        .apply_event(&event(&t, 1, DEV, stored(&h[..1_500])))
        .unwrap();
    let look = |hashes: &[SequenceHash], budget| {
        let out = index.lookup(hashes, t.engine, budget);
        let d = out.donor.unwrap();
        (
            d.engine,
            d.blocks,
            d.tied,
            out.baseline.native_blocks,
            out.probes,
        )
    };
    let (_, blocks, tied, native, probes) = look(&h, BIG);
    assert_eq!((blocks, tied, native, probes), (2_100, 2, 1_500, 2_100));
    // A drops one block mid-chunk, B a range that ends mid-chunk.
    index
        .apply_event(&event(&a, 2, RET, removed(&h[1_000..1_001])))
        .unwrap();
    assert_eq!(look(&h, BIG), (b.engine, 2_100, 1, 1_500, 2_100));
    index
        .apply_event(&event(&b, 2, RET, removed(&h[1_990..1_995])))
        .unwrap();
    assert_eq!(look(&h, BIG), (b.engine, 1_990, 1, 1_500, 1_991));
    // The target's device copy loses a block: its baseline ends there.
    index
        .apply_event(&event(&t, 2, DEV, removed(&h[700..701])))
        .unwrap();
    assert_eq!(look(&h, BIG), (b.engine, 1_990, 1, 700, 1_991));
    // A request that ends mid-chunk, one that diverges inside a chunk
    // (same tokens up to a token of block 1_234), a budget that ends
    // mid-chunk.
    assert_eq!(look(&h[..1_234], BIG), (b.engine, 1_234, 1, 700, 1_234));
    let mut tokens: Vec<u32> = (0..2_100u32 * 16)
        .map(|t| t.wrapping_mul(2654435761).wrapping_add(21))
        .collect();
    tokens[1_234 * 16 + 3] ^= 1;
    let forked = sequence_hashes(&tokens, 16);
    assert_eq!(forked[..1_234], h[..1_234]);
    assert_eq!(look(&forked, BIG), (b.engine, 1_234, 1, 700, 1_235));
    let (_, blocks, tied, native, probes) = look(&h, LookupBudget::new(1_000_000, 777));
    assert_eq!((blocks, tied, native, probes), (777, 2, 700, 777));
    // A re-stores its block (a bit set on B's entry): both hold 0..1_990.
    index
        .apply_event(&event(
            &a,
            3,
            RET,
            stored_after(Some(h[999]), &h[1_000..1_001]),
        ))
        .unwrap();
    assert_eq!(look(&h, BIG), (a.engine, 2_100, 1, 700, 2_100));
    // A worker restart drops all of A; a resync brings part of it back as
    // an unchecked list in reverse order (bits set on B's entries, plus new
    // entries in a run that is never skipped).
    let a2 = WorkerInfo {
        engine: EngineId::fresh(),
        ..a
    };
    index.register_worker(WorkerKey(2), a2).unwrap();
    assert_eq!(look(&h, BIG), (b.engine, 1_990, 1, 700, 1_991));
    let mut back: Vec<SequenceHash> = h[..1_993].to_vec();
    back.reverse();
    index.resync_worker(a2.engine, 0, &[(RET, back)]).unwrap();
    assert_eq!(look(&h, BIG), (a2.engine, 1_993, 1, 700, 1_994));
}

#[test]
fn a_cancelled_lookup_stops_walking_and_proposes_no_donor() {
    use std::cell::Cell;
    let index = InventoryIndex::new();
    let t = registered(&index, 1, Role::Prefill);
    let d = registered(&index, 2, Role::Decode);
    let h = chain(9, 2_000);
    index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap();
    // Never cancelled: the same answer as a plain lookup.
    let out = index.lookup_cancellable(&h, t.engine, BIG, &|| false);
    assert_eq!((out.probes, out.donor.unwrap().blocks), (2_000, 2_000));
    // Cancelled before the first probe.
    let out = index.lookup_cancellable(&h, t.engine, BIG, &|| true);
    assert_eq!(out.donor, Err(NoDonorReason::Cancelled { probes: 0 }));
    assert!(!out.budget_exhausted);
    // Cancelled mid-walk (at the third check): a donor was already found,
    // yet none is proposed, and the walk stopped early.
    let asked = Cell::new(0u32);
    let out = index.lookup_cancellable(&h, t.engine, BIG, &|| {
        asked.set(asked.get() + 1);
        asked.get() >= 3
    });
    match out.donor {
        Err(NoDonorReason::Cancelled { probes }) => {
            assert!(probes > 0 && probes < 2_000, "{probes}");
            assert_eq!(probes, out.probes);
        }
        other => panic!("expected a cancelled lookup, got {other:?}"),
    }
    assert_eq!(asked.get(), 3);
}

#[test]
fn lookups_never_wait_for_a_long_write_batch() {
    // Event application mutates the standby copy while lookups read the
    // published one: a lookup during a long batch completes with the state
    // before or after it, never flagged for a wait (a 4-block walk never
    // reads the clock, so only a lock wait could exhaust its budget).
    let index = Arc::new(InventoryIndex::new());
    let t = registered(&index, 1, Role::Prefill);
    let d = registered(&index, 2, Role::Decode);
    let h = chain(8, 4);
    index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap();
    let many: Vec<KvEvent> = (2..=400u64)
        .map(|i| event(&d, i, RET, stored(&chain(i as u32 + 100, 64))))
        .collect();
    let writer = {
        let index = index.clone();
        std::thread::spawn(move || index.apply_events(&many))
    };
    let (mut found, mut flagged) = (0, 0);
    while !writer.is_finished() {
        let out = index.lookup(&h, t.engine, LookupBudget::new(200, 1_000));
        match out.donor {
            Ok(d) => {
                assert_eq!(d.blocks, 4);
                found += 1;
            }
            Err(NoDonorReason::BudgetExhausted { probes: 0 }) => flagged += 1,
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    let report = writer.join().unwrap();
    assert_eq!((report.applied, report.gaps.len()), (399, 0));
    assert_eq!(
        flagged, 0,
        "{flagged} lookups waited out their budget ({found} found)"
    );
    assert!(found > 0);
}

#[test]
fn more_than_64_workers_span_groups() {
    let index = InventoryIndex::new();
    let h = chain(9, 12);
    let t = registered(&index, 0, Role::Prefill);
    let mut donors = Vec::new();
    for k in 1..150u64 {
        let w = registered(
            &index,
            k,
            if k % 2 == 0 {
                Role::Prefill
            } else {
                Role::Decode
            },
        );
        let n = if k == 131 { 11 } else { (k % 9) as usize };
        index
            .apply_event(&event(&w, 1, RET, stored(&h[..n])))
            .unwrap();
        donors.push(w);
    }
    let out = index.lookup(&h, t.engine, BIG);
    let d = out.donor.unwrap();
    assert_eq!((d.engine, d.blocks, d.tied), (donors[130].engine, 11, 1));
    // Removing the best one falls back to the 8-block donors (k % 9 == 8, odd k).
    assert!(index.remove_worker(donors[130].engine));
    let d = index.lookup(&h, t.engine, BIG).donor.unwrap();
    let expect: Vec<u64> = (1..150u64).filter(|k| k % 2 == 1 && k % 9 == 8).collect();
    assert_eq!((d.blocks, d.tied as usize), (8, expect.len()));
}

#[test]
fn churn_then_clear_leaves_nothing_behind() {
    // Store/remove cycles grow the worker's log; compaction must keep clears exact.
    let index = InventoryIndex::new();
    let d = registered(&index, 1, Role::Decode);
    let h = chain(10, 50);
    let mut id = 0;
    for round in 0..200 {
        id += 1;
        index.apply_event(&event(&d, id, RET, stored(&h))).unwrap();
        id += 1;
        let keep = round % 50;
        index
            .apply_event(&event(&d, id, RET, removed(&h[keep..])))
            .unwrap();
    }
    assert_eq!(index.stats().held_blocks[4], 49);
    id += 1;
    assert_eq!(
        index
            .apply_event(&event(&d, id, RET, KvEventData::Cleared))
            .unwrap(),
        EventOutcome::Applied { changed: 49 }
    );
    assert_eq!(index.stats().entries, 0);
}

#[test]
fn concurrent_events_and_lookups() {
    // Writers only grow decode chains block by block, so every lookup must see
    // a coverage between the previous one it saw and the full chain.
    let index = Arc::new(InventoryIndex::new());
    let t = registered(&index, 0, Role::Prefill);
    let h = Arc::new(chain(11, 64));
    let writers: Vec<_> = (1..=3u64)
        .map(|k| {
            let w = registered(&index, k, Role::Decode);
            let (index, h) = (index.clone(), h.clone());
            std::thread::spawn(move || {
                for (i, b) in h.iter().enumerate() {
                    index
                        .apply_event(&event(&w, 2 * i as u64 + 1, RET, stored(&[*b])))
                        .unwrap();
                    // Unrelated churn in between.
                    let noise = chain(1000 + i as u32, 4);
                    index
                        .apply_event(&event(&w, 2 * i as u64 + 2, DEV, stored(&noise)))
                        .unwrap();
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, h) = (index.clone(), h.clone());
            std::thread::spawn(move || {
                let mut seen = 0;
                for _ in 0..5_000 {
                    let out = index.lookup(&h, t.engine, BIG);
                    if let Ok(d) = out.donor {
                        assert!(
                            d.blocks >= seen && d.blocks <= 64,
                            "{} after {seen}",
                            d.blocks
                        );
                        seen = d.blocks;
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    for r in readers {
        r.join().unwrap();
    }
    let d = index.lookup(&h, t.engine, BIG).donor.unwrap();
    assert_eq!((d.blocks, d.tied), (64, 3));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]
    /// The index agrees with the naive reference model on random workloads
    /// with restarts, resyncs, duplicates and gaps.
    #[test]
    fn agrees_with_reference_model(seed in proptest::prelude::any::<u64>()) {
        let r = kv_lookup::reference::cross_check(seed, 1_500);
        proptest::prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

/// `apply_events` reports, per event and in order, what `apply_event` one
/// by one reports, leaves the same state, and publishes once.
#[test]
fn a_batch_reports_each_events_outcome_as_one_by_one_and_publishes_once() {
    let (per_event, batched) = (InventoryIndex::new(), InventoryIndex::new());
    // The same workers (same engine ids) in both: `d`, and `old`, which is
    // replaced by `new` under key 2 before the events.
    let d = info(Role::Decode);
    let (old, new) = (info(Role::Decode), info(Role::Decode));
    for index in [&per_event, &batched] {
        index.register_worker(WorkerKey(1), d).unwrap();
        index.register_worker(WorkerKey(2), old).unwrap();
        index.register_worker(WorkerKey(2), new).unwrap();
    }
    let (a, b) = (chain(61, 3), chain(62, 2));
    let mut wrong_tp = event(&d, 7, RET, stored(&b));
    wrong_tp.tp_size = 2;
    let events = vec![
        event(&d, 1, RET, stored(&a)),
        event(&d, 1, RET, stored(&a)),       // duplicate
        event(&d, 0, RET, stored(&b)),       // refused: id 0
        event(&d, 2, RET, removed(&a[2..])), // in order
        event(&d, 4, RET, stored(&b)),       // gap (3 lost)
        event(&old, 1, RET, stored(&b)),     // retired
        event(&new, 1, RET, stored_after(Some(a[0]), &b[1..])), // unchained
        wrong_tp,                            // refused: TP
        event(&new, 2, DEV, stored(&b)),
    ];
    let one_by_one: Vec<_> = events.iter().map(|e| per_event.apply_event(e)).collect();
    let before = batched.publications();
    let report = batched.apply_events(&events);
    assert_eq!(
        batched.publications() - before,
        1,
        "one publication per batch"
    );
    assert_eq!(report.outcomes, one_by_one);
    assert_eq!(report.outcomes.len(), events.len());
    assert_eq!(report.outcomes[0], Ok(EventOutcome::Applied { changed: 3 }));
    assert_eq!(
        report.outcomes[1],
        Ok(EventOutcome::Duplicate { last_event_id: 1 })
    );
    assert_eq!(
        report.outcomes[2],
        Err(LookupError::ZeroEventId { engine: d.engine })
    );
    assert_eq!(
        report.outcomes[4],
        Ok(EventOutcome::Gap {
            expected: 3,
            got: 4,
            changed: 2
        })
    );
    assert_eq!(report.outcomes[5], Ok(EventOutcome::FromRetiredIncarnation));
    assert!(matches!(
        report.outcomes[6],
        Ok(EventOutcome::Unchained { .. })
    ));
    assert!(matches!(
        report.outcomes[7],
        Err(LookupError::IdentityMismatch {
            field: "tp_size",
            ..
        })
    ));
    // The totals agree with the outcomes.
    assert_eq!(
        (report.applied, report.duplicates, report.from_retired),
        (4, 1, 1)
    );
    assert_eq!(report.changed, 3 + 1 + 2 + 2);
    assert_eq!(report.gaps, vec![(d.engine, 3, 4)]);
    assert_eq!(
        report.refused.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![2, 7]
    );
    assert_eq!(report.unchained.len(), 1);
    // Same state either way.
    assert_eq!(batched.stats(), per_event.stats());
    for h in a.iter().chain(&b) {
        for w in [&d, &new] {
            assert_eq!(batched.holds(w.engine, *h), per_event.holds(w.engine, *h));
        }
    }
    assert_eq!(batched.holds(d.engine, a[0]), vec![RET]);
    assert!(batched.holds(d.engine, a[2]).is_empty());
    assert_eq!(batched.holds(new.engine, b[1]), vec![DEV]);
    // An empty batch publishes nothing.
    let before = batched.publications();
    assert!(batched.apply_events(&[]).outcomes.is_empty());
    assert_eq!(batched.publications(), before);
}

/// `holds` reads the writer's full map under the writer lock; a thread
/// that holds a copy of the index (a lookup, whose cancellation check is
/// the only caller code run inside it) may still call it: a writer that
/// waits for that copy keeps the lock, and after `HOLDS_LOCK_WAIT` `holds`
/// answers from the published copy instead. Without the fallback this
/// deadlocked (the 10 s timeout below).
#[test]
fn holds_inside_a_cancellation_check_while_a_writer_waits_for_the_lookups_copy() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    let index = Arc::new(InventoryIndex::new());
    let d = registered(&index, 1, Role::Decode);
    let p = registered(&index, 2, Role::Prefill);
    let h = chain(90, 4);
    index.apply_event(&event(&d, 1, RET, stored(&h))).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let index = index.clone();
        std::thread::spawn(move || {
            let asked = AtomicBool::new(false);
            let cancelled = || {
                if !asked.swap(true, Ordering::SeqCst) {
                    // While this lookup holds the published copy: one write
                    // publishes the other copy, the next waits for this one.
                    let w = index.clone();
                    let hs = h.clone();
                    std::thread::spawn(move || {
                        w.apply_event(&event(&d, 2, RET, removed(&hs[3..])))
                            .unwrap();
                        w.apply_event(&event(&d, 3, RET, removed(&hs[2..3])))
                            .unwrap();
                    });
                    std::thread::sleep(Duration::from_millis(200));
                    assert_eq!(index.holds(d.engine, h[0]), vec![RET]);
                }
                false
            };
            let out = index.lookup_cancellable(&h, p.engine, BIG, &cancelled);
            tx.send(out.donor.map(|m| m.blocks)).unwrap();
        });
    }
    let got = rx.recv_timeout(Duration::from_secs(10));
    assert_eq!(got.expect("the lookup returned"), Ok(4));
}

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
