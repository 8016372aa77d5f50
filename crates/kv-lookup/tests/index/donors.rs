//! Donor and target rules, the baseline, budgets, run ends and
//! cancellation.

use kv_descriptor::{sequence_hashes, EngineId, LayoutFingerprint, Role, SequenceHash};
use kv_lookup::{InventoryIndex, LookupBudget, NoDonorReason, WorkerInfo, WorkerKey};

use crate::common::*;

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
