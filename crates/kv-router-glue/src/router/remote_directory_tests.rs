//! [`RemoteDonorDirectory`]'s memory on an injected clock: records of
//! engines no registry knows (another namespace's donors in a shared
//! bucket) are forgotten once quiet without a usable record, slot maps
//! with them; live records never are.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kv_descriptor::{
    KvEvent, KvEventData, LayoutFingerprint, OwnerLease, Role, SequenceHash, StorageTier,
    StoredBlock, TokenBlockHash,
};

use super::*;
use crate::plane::directory::tests_support::record;

const T0: u64 = 1_000_000;
const FORGET: u64 = HeardCache::FORGET_AFTER_MS;
const SWEEP: u64 = HeardCache::SWEEP_EVERY_MS;

/// A directory on a clock the test moves (Unix ms).
fn directory() -> (RemoteDonorDirectory, Arc<AtomicU64>) {
    let now = Arc::new(AtomicU64::new(T0));
    let clock = now.clone();
    let dir = RemoteDonorDirectory::with_clock(move || clock.load(Ordering::SeqCst));
    (dir, now)
}

fn owner(generation: u64) -> OwnerLease {
    OwnerLease {
        generation,
        ..OwnerLease::fresh(Role::Decode)
    }
}

/// `engine`'s retained block `hash` stored in slot `slot`.
fn stored(engine: EngineId, hash: u64, slot: u32) -> KvEvent {
    KvEvent {
        publisher: engine,
        event_id: 1,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0xF1),
        tp_size: 2,
        tier: StorageTier::RetainedGpuDirect,
        data: KvEventData::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                sequence_hash: SequenceHash(hash),
                token_hash: TokenBlockHash(hash),
                slot: Some(slot),
            }],
        },
    }
}

/// A record put, then deleted, by an engine the router never registered
/// (so `forget_for_good` is never called for it) is forgotten once nothing
/// of it was heard for the window, its slot map with it; until then it is
/// remembered, and a late put of an older generation refused.
#[test]
fn a_deleted_record_of_an_unregistered_engine_is_forgotten_after_the_window() {
    let (dir, now) = directory();
    let other_ns = owner(2);
    let engine = other_ns.engine_id;
    dir.apply_directory(DirectoryChange::Put(record(other_ns, T0 + 60_000)));
    assert_eq!(dir.ingest_event(&stored(engine, 7, 3)), 1);
    assert_eq!((dir.generations_known(), dir.slot_maps()), (1, 1));
    now.store(T0 + 1_000, Ordering::SeqCst);
    assert_eq!(
        dir.apply_directory(DirectoryChange::Delete(engine)),
        CacheUpdate::Deleted(engine)
    );
    assert!(!dir.holds_record(engine));
    // Events after the delete (its last ones in flight) make a map again.
    dir.ingest_event(&stored(engine, 8, 4));
    assert_eq!((dir.generations_known(), dir.slot_maps()), (1, 1));

    // Changes of another, live donor drive the sweeps.
    let live = owner(1);
    let heard_live = |at: u64| {
        now.store(at, Ordering::SeqCst);
        dir.apply_directory(DirectoryChange::Put(record(live, u64::MAX - 1)));
    };
    // Inside the window (a sweep runs at this very ms): still known.
    heard_live(T0 + 1_000 + FORGET);
    assert_eq!((dir.generations_known(), dir.slot_maps()), (2, 1));
    // The next sweep past the window: forgotten, slot map too.
    heard_live(T0 + 1_000 + FORGET + SWEEP);
    assert_eq!((dir.generations_known(), dir.slot_maps()), (1, 0));
    assert_eq!(
        dir.resolve(engine, &[SequenceHash(8)]).unwrap_err(),
        ResolveError::UnknownDonor { donor: engine }
    );
    // Forgotten for good: a put of it now is a new generation.
    let older = OwnerLease {
        generation: 1,
        ..other_ns
    };
    assert_eq!(
        dir.apply_directory(DirectoryChange::Put(record(older, u64::MAX - 1))),
        CacheUpdate::NewGeneration {
            engine,
            generation: 1
        }
    );
}

/// Inside the window a late put of an older generation is refused, even
/// after sweeps ran: the newest generation seen is still remembered.
#[test]
fn a_late_put_of_an_older_generation_inside_the_window_is_refused() {
    let (dir, now) = directory();
    let g2 = owner(2);
    let engine = g2.engine_id;
    dir.apply_directory(DirectoryChange::Put(record(g2, T0 + 60_000)));
    dir.apply_directory(DirectoryChange::Delete(engine));
    let live = owner(1);
    for at in (T0..T0 + FORGET).step_by(SWEEP as usize) {
        now.store(at, Ordering::SeqCst);
        dir.apply_directory(DirectoryChange::Put(record(live, u64::MAX - 1)));
    }
    now.store(T0 + FORGET, Ordering::SeqCst);
    let g1 = OwnerLease {
        generation: 1,
        ..g2
    };
    assert_eq!(
        dir.apply_directory(DirectoryChange::Put(record(g1, u64::MAX - 1))),
        CacheUpdate::Ignored(ResolveError::StaleGeneration {
            donor: engine,
            generation: 1,
            newest_seen: 2
        })
    );
    assert!(!dir.holds_record(engine));
    assert_eq!(dir.generations_known(), 2);
}

/// A record whose lease is still live is never dropped, however long since
/// its last put (a donor with a long lease renews it every fifth of it):
/// its slots keep resolving through many windows of other donors coming
/// and going.
#[test]
fn a_live_record_with_a_long_lease_is_never_dropped() {
    let (dir, now) = directory();
    let long = owner(1);
    let engine = long.engine_id;
    let ten_hours = 10 * 3_600_000;
    dir.apply_directory(DirectoryChange::Put(record(long, T0 + ten_hours)));
    dir.ingest_event(&stored(engine, 7, 3));
    let mut at = T0;
    let mut churned = 0;
    while at < T0 + 3 * FORGET {
        // One other donor put and deleted per sweep period.
        let passing = owner(1);
        now.store(at, Ordering::SeqCst);
        dir.apply_directory(DirectoryChange::Put(record(passing, at + 15_000)));
        dir.apply_directory(DirectoryChange::Delete(passing.engine_id));
        churned += 1;
        at += SWEEP;
    }
    assert_eq!(churned, 30);
    let resolved = dir.resolve(engine, &[SequenceHash(7)]).unwrap();
    assert_eq!(resolved.slot_ids, vec![3]);
    assert!(dir.holds_record(engine));
    assert_eq!(dir.slot_maps(), 1);
    // Remembered: the long-lived one, the ten passing donors heard within
    // the window at the last sweep, and the one put after that sweep; the
    // nineteen before are forgotten.
    assert_eq!(dir.generations_known(), (1 + FORGET / SWEEP + 1) as usize);
    assert_eq!(dir.generations_known(), 12);
}

/// The registry's path stays: `forget_for_good` drops an engine at once,
/// live record and slot map included.
#[test]
fn forget_for_good_drops_a_live_engine_at_once() {
    let (dir, _now) = directory();
    let o = owner(4);
    dir.apply_directory(DirectoryChange::Put(record(o, u64::MAX - 1)));
    dir.ingest_event(&stored(o.engine_id, 7, 3));
    dir.forget_for_good(o.engine_id);
    assert_eq!((dir.generations_known(), dir.slot_maps()), (0, 0));
    assert!(!dir.holds_record(o.engine_id));
}
