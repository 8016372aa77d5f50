//! Retired incarnations and [`InventoryIndex::forget_retired`]: what the
//! index remembers of a replaced or removed engine, and what a forgotten
//! one gets when it registers again or sends a stray event.

use kv_descriptor::{
    sequence_hashes, token_block_hashes, EngineId, KvEvent, KvEventData, LayoutFingerprint, Role,
    SequenceHash, StorageTier, StoredBlock,
};
use kv_lookup::{
    EventOutcome, InventoryIndex, LookupBudget, LookupError, NoDonorReason, Registration,
    WorkerInfo, WorkerKey,
};

const RET: StorageTier = StorageTier::RetainedGpuDirect;

fn info(role: Role) -> WorkerInfo {
    WorkerInfo {
        engine: EngineId::fresh(),
        role,
        layout_fingerprint: LayoutFingerprint(3),
        tp_size: 1,
    }
}

/// 6 chained blocks of 16 tokens: (sequence hashes, the Stored data of all).
fn chain() -> (Vec<SequenceHash>, KvEventData) {
    let tokens: Vec<u32> = (0..96).collect();
    let hashes = sequence_hashes(&tokens, 16);
    let blocks = hashes
        .iter()
        .zip(token_block_hashes(&tokens, 16))
        .map(|(&sequence_hash, token_hash)| StoredBlock {
            sequence_hash,
            token_hash,
            slot: None,
        })
        .collect();
    let stored = KvEventData::Stored {
        parent: None,
        blocks,
    };
    (hashes, stored)
}

fn event(w: &WorkerInfo, event_id: u64, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher: w.engine,
        event_id,
        role: w.role,
        layout_fingerprint: w.layout_fingerprint,
        tp_size: w.tp_size,
        tier: RET,
        data,
    }
}

/// A removed decode worker, forgotten, registers again as a new worker:
/// empty (its 6 blocks went with its removal), no donor until its events
/// show a gap and a resync repairs it; the index's count of retired
/// incarnations goes back down.
#[test]
fn a_forgotten_incarnation_registers_again_empty_and_is_no_donor_until_resynced() {
    let index = InventoryIndex::new();
    let (d, p) = (info(Role::Decode), info(Role::Prefill));
    let (hashes, stored) = chain();
    index.register_worker(WorkerKey(1), d).unwrap();
    index.register_worker(WorkerKey(2), p).unwrap();
    index.apply_event(&event(&d, 1, stored.clone())).unwrap();
    let donor = || {
        index
            .lookup(&hashes, p.engine, LookupBudget::default())
            .donor
    };
    assert_eq!(donor().unwrap().blocks, 6);

    assert!(index.remove_worker(d.engine));
    assert_eq!(index.stats().retired_incarnations, 1);
    assert_eq!(
        index.register_worker(WorkerKey(1), d),
        Err(LookupError::RetiredIncarnation { engine: d.engine })
    );
    let before = index.publications();
    assert!(index.forget_retired(d.engine));
    assert_eq!(index.publications(), before + 1, "one write, published");
    assert_eq!(index.stats().retired_incarnations, 0);

    assert_eq!(
        index.register_worker(WorkerKey(1), d),
        Ok(Registration::Registered)
    );
    assert!(index.holds(d.engine, hashes[0]).is_empty());
    assert_eq!(donor(), Err(NoDonorReason::NoRootCoverage));
    assert!(index.workers_needing_resync().is_empty());
    // Events 2..=4 were published while it was away.
    assert_eq!(
        index.apply_event(&event(&d, 5, stored)),
        Ok(EventOutcome::Gap {
            expected: 1,
            got: 5,
            changed: 6
        })
    );
    assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    assert_eq!(donor(), Err(NoDonorReason::NoCompatibleDonor));
    index
        .resync_worker(d.engine, 5, &[(RET, hashes[..3].to_vec())])
        .unwrap();
    assert_eq!(donor().unwrap().blocks, 3);
}

/// A replaced incarnation's late events are ignored while the index
/// remembers it; once forgotten, its stray event is not refused but
/// registers it as an unknown publisher's (under `WorkerKey::of_engine`),
/// after a gap, so it is no donor; its successor keeps its key until the
/// forgotten one registers under it again (a re-key that replaces it).
#[test]
fn a_stray_event_of_a_forgotten_incarnation_registers_it_as_an_unknown_publisher() {
    let index = InventoryIndex::new();
    let (old, p) = (info(Role::Decode), info(Role::Prefill));
    let new = WorkerInfo {
        engine: EngineId::fresh(),
        ..old
    };
    let (hashes, stored) = chain();
    index.register_worker(WorkerKey(1), old).unwrap();
    index.register_worker(WorkerKey(2), p).unwrap();
    index.apply_event(&event(&old, 1, stored.clone())).unwrap();
    assert_eq!(
        index.register_worker(WorkerKey(1), new),
        Ok(Registration::Replaced { old: old.engine })
    );
    index.apply_event(&event(&new, 1, stored.clone())).unwrap();
    assert_eq!(
        index.apply_event(&event(&old, 2, KvEventData::Cleared)),
        Ok(EventOutcome::FromRetiredIncarnation)
    );
    assert!(index.forget_retired(old.engine));

    let stray = index.apply_event(&event(&old, 3, stored));
    assert_eq!(
        stray,
        Ok(EventOutcome::Gap {
            expected: 1,
            got: 3,
            changed: 6
        })
    );
    assert_eq!(
        index.worker(old.engine),
        Some((WorkerKey::of_engine(old.engine), old))
    );
    assert_eq!(index.workers_needing_resync(), vec![old.engine]);
    let donor = index
        .lookup(&hashes, p.engine, LookupBudget::default())
        .donor
        .unwrap();
    assert_eq!((donor.engine, donor.tied), (new.engine, 1), "only `new`");
    assert_eq!(index.stats().workers, 3, "p, new and the stray one");

    assert_eq!(
        index.register_worker(WorkerKey(1), old),
        Ok(Registration::Replaced { old: new.engine })
    );
    assert_eq!(index.workers_needing_resync(), vec![old.engine]);
    assert_eq!(index.stats().retired_incarnations, 1, "`new` now");
}

/// Only a retired incarnation is forgotten: a live engine keeps its
/// entries and an unknown one stays unknown.
#[test]
fn forgetting_a_live_or_unknown_engine_changes_nothing() {
    let index = InventoryIndex::new();
    let d = info(Role::Decode);
    let (hashes, stored) = chain();
    index.apply_event(&event(&d, 1, stored)).unwrap();
    let stats = index.stats();
    assert!(!index.forget_retired(d.engine));
    assert!(!index.forget_retired(EngineId::fresh()));
    assert_eq!(index.stats(), stats);
    assert_eq!(index.holds(d.engine, hashes[5]), vec![RET]);
}
