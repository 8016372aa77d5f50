//! Lookups against writers: no wait for a write batch, groups past 64
//! workers, churn, concurrent events and lookups, the reference model on
//! random workloads, batches, and `holds` inside a cancellation check.

use std::sync::Arc;

use kv_descriptor::{KvEvent, KvEventData, Role};
use kv_lookup::{
    EventOutcome, InventoryIndex, LookupBudget, LookupError, NoDonorReason, WorkerKey,
};

use crate::common::*;

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
