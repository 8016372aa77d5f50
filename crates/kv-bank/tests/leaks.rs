//! Leak accounting: a full bank cycle leaves every counted resource as it
//! found it, and the snapshot does see what is held (negative controls).
//! One test in this binary, so process-wide counts are not disturbed.

mod common;

use std::time::Duration;

use kv_bank::{leaks, BankConfig, BankManager, DestinationPool, HostShmMemory, LeaseConfig};
use kv_descriptor::{OwnerLease, Role};

fn resources(l: &[kv_bank::Leak]) -> Vec<&'static str> {
    l.iter().map(|l| l.resource).collect()
}

#[test]
fn full_store_pin_import_reserve_close_cycle_leaks_nothing() {
    let before = leaks::snapshot();
    assert!(before.open_fds > 0, "/proc/self/fd is readable");

    let l = common::layout(2);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        6 * l.block_bytes() as u64,
    );
    cfg.lease = LeaseConfig::background(Duration::from_secs(5), Duration::from_millis(20));
    let bank = BankManager::new_host_shm(cfg, "test-host").unwrap();
    let blocks = common::chain(10, 3);
    common::store_ready(&bank, None, &blocks);
    let pin = bank.pin_prefix(&common::hashes(&blocks)).unwrap();
    let imported = HostShmMemory::open_descriptor(&bank.manifest().parts()[1]).unwrap();
    let pool = DestinationPool::new(8);
    let done = pool.reserve(3).unwrap();
    let cancelled = pool.reserve(2).unwrap();

    let during = leaks::snapshot();
    let held = during.leaks_since(&before);
    let r = resources(&held);
    for want in [
        "shm_entries",
        "shm_mappings",
        "pins",
        "reserved_blocks",
        "lease_holders",
        "background_threads",
    ] {
        assert!(r.contains(&want), "{want} not seen while held: {held:?}");
    }
    let entries = held.iter().find(|l| l.resource == "shm_entries").unwrap();
    assert_eq!(
        entries.names.len(),
        4,
        "2 segments + 2 leases: {:?}",
        entries.names
    );
    assert_eq!(during.pins - before.pins, 1);
    assert_eq!(during.reserved_blocks - before.reserved_blocks, 5);
    assert_eq!(
        during.shm_mappings - before.shm_mappings,
        3,
        "2 owned + 1 import"
    );

    done.complete();
    cancelled.cancel().quiesced();
    drop(imported);
    drop(pin);
    bank.close(Duration::from_secs(1)).unwrap();
    drop(bank);
    drop(pool);
    let after = leaks::snapshot();
    assert_eq!(
        after.leaks_since(&before),
        vec![],
        "{after:?} vs {before:?}"
    );

    // An orphaned reservation is a leak until reclaimed after quiescence.
    let pool = DestinationPool::new(4);
    drop(pool.reserve(2).unwrap());
    let orphaned = leaks::snapshot().leaks_since(&before);
    assert_eq!(resources(&orphaned), vec!["reserved_blocks"]);
    assert_eq!(pool.reclaim_orphans_after_quiesce(), 2);
    assert!(leaks::snapshot().leaks_since(&before).is_empty());
}
