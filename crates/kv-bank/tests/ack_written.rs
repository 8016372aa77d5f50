//! An ack seals a rank's part of a pending store only after that rank wrote
//! every entry through `write_pending` / `write_pending_from_device`, and a
//! sealed part is never written again. Without it a rank that acked without
//! writing published whatever its slots held before: the bytes of an
//! evicted block under the new block's sequence hash (a cross-request leak).

mod common;

use std::time::Duration;

use common::*;
use kv_bank::{BankConfig, BankError, BankManager, DeviceRows, StoreStatus};
use kv_descriptor::{KvEventData, OwnerLease, Role};

fn slot_bytes(bank: &BankManager) -> usize {
    bank.manifest().parts()[0].slot_bytes() as usize
}

/// Writes rank `rank`'s pattern into entries `indices` of store `p` through `write_pending`.
fn write_entries(bank: &BankManager, p: &kv_bank::PendingStore, rank: u32, indices: &[usize]) {
    let n = slot_bytes(bank);
    for &i in indices {
        bank.write_pending(p.store_id, rank, i, &pattern(p.entries[i].0, rank, n))
            .unwrap();
    }
}

fn read(bank: &BankManager, rank: u32, slot: u32) -> Vec<u8> {
    let mut out = vec![0u8; slot_bytes(bank)];
    bank.rank(rank).unwrap().read_slot(slot, &mut out).unwrap();
    out
}

fn stored_hashes(events: &[kv_descriptor::KvEvent]) -> Vec<kv_descriptor::SequenceHash> {
    events
        .iter()
        .flat_map(|e| match &e.data {
            KvEventData::Stored { blocks, .. } => blocks.iter().map(|b| b.sequence_hash).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// The reviewer's scenario: store A written and acked fills the bank; store B
/// evicts A's slots and both ranks ack B without writing. B must not become
/// ready (its slots hold A's bytes), no `Stored` event for B, and once B is
/// written the acks publish B's own bytes.
#[test]
fn an_ack_without_writes_is_refused_and_never_publishes_the_evicted_blocks_bytes() {
    let bank = bank(2, 4);
    let n = slot_bytes(&bank);
    let a = chain(0, 4);
    let pa = bank.store(None, &a).unwrap();
    for r in 0..2 {
        write_entries(&bank, &pa, r, &[0, 1, 2, 3]);
        bank.ack(pa.store_id, r).unwrap();
    }
    assert_eq!(bank.inventory().ready, hashes(&a));
    bank.drain_events();

    let b = chain(1000, 4);
    let pb = bank.store(None, &b).unwrap();
    let mut slots_b: Vec<u32> = pb.entries.iter().map(|e| e.1).collect();
    slots_b.sort_unstable();
    assert_eq!(slots_b, [0, 1, 2, 3], "B took every slot of A");
    // The slots still hold A's bytes.
    let a_bytes = read(&bank, 0, pb.entries[0].1);
    assert!(pa.entries.iter().any(|(h, _)| pattern(*h, 0, n) == a_bytes));

    for r in 0..2 {
        match bank.ack(pb.store_id, r) {
            Err(BankError::Unwritten {
                store_id,
                rank,
                missing,
                first,
            }) => assert_eq!((store_id, rank, missing, first), (pb.store_id, r, 4, 0)),
            other => panic!("rank {r}: expected Unwritten, got {other:?}"),
        }
    }
    // Nothing published: not ready, no lookup, no pin, no Stored event.
    assert!(bank.inventory().ready.is_empty());
    assert_eq!(bank.inventory().pending_slots, 4);
    assert_eq!(bank.ready_prefix_len(&hashes(&b)), 0);
    assert!(bank.pin_prefix(&hashes(&b)).is_err());
    let events = bank.drain_events();
    assert!(
        stored_hashes(&events).is_empty(),
        "no Stored event after refused acks: {events:?}"
    );
    assert_eq!(bank.stats().stores_ready, 1);

    // The store stayed pending: the ranks write and ack, B's bytes are published.
    for r in 0..2 {
        write_entries(&bank, &pb, r, &[0, 1, 2, 3]);
    }
    assert!(matches!(
        bank.ack(pb.store_id, 0).unwrap(),
        StoreStatus::Waiting { ref missing } if missing == &[1]
    ));
    assert_eq!(bank.ack(pb.store_id, 1).unwrap(), StoreStatus::Ready);
    assert_eq!(stored_hashes(&bank.drain_events()), hashes(&b));
    let pin = bank.pin_prefix(&hashes(&b)).unwrap();
    for r in 0..2 {
        for (h, slot) in pin.hashes().iter().zip(pin.slots()) {
            assert_eq!(
                read(&bank, r, *slot),
                pattern(*h, r, n),
                "rank {r} block {h:?}"
            );
        }
    }
}

#[test]
fn a_partly_written_rank_is_refused_naming_its_first_missing_entry() {
    let bank = bank(2, 8);
    let p = bank.store(None, &chain(0, 5)).unwrap();
    write_entries(&bank, &p, 0, &[0, 1, 2, 3, 4]);
    write_entries(&bank, &p, 1, &[0, 2, 4]);
    assert!(matches!(
        bank.ack(p.store_id, 0).unwrap(),
        StoreStatus::Waiting { ref missing } if missing == &[1]
    ));
    let err = bank.ack(p.store_id, 1).unwrap_err();
    assert!(
        matches!(
            err,
            BankError::Unwritten {
                rank: 1,
                missing: 2,
                first: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("`rank` 1") && msg.contains("2 unwritten") && msg.contains("`index` 1"),
        "{msg}"
    );
    // Rank 1 did not become acked: still the one missing.
    write_entries(&bank, &p, 1, &[1]);
    match bank.ack(p.store_id, 1) {
        Err(BankError::Unwritten { missing, first, .. }) => assert_eq!((missing, first), (1, 3)),
        other => panic!("expected Unwritten, got {other:?}"),
    }
    write_entries(&bank, &p, 1, &[3]);
    assert_eq!(bank.ack(p.store_id, 1).unwrap(), StoreStatus::Ready);
    assert_eq!(bank.inventory().ready.len(), 5);
}

#[test]
fn a_write_after_the_ranks_ack_is_refused_and_changes_no_byte() {
    let bank = bank(2, 4);
    let n = slot_bytes(&bank);
    let p = bank.store(None, &chain(0, 2)).unwrap();
    write_entries(&bank, &p, 0, &[0, 1]);
    bank.ack(p.store_id, 0).unwrap();
    let slot = p.entries[1].1;
    let before = read(&bank, 0, slot);
    match bank.write_pending(p.store_id, 0, 1, &vec![0xAB; n]) {
        Err(BankError::RankAcked {
            store_id,
            rank,
            index,
        }) => assert_eq!((store_id, rank, index), (p.store_id, 0, 1)),
        other => panic!("expected RankAcked, got {other:?}"),
    }
    assert_eq!(
        read(&bank, 0, slot),
        before,
        "a sealed rank's bytes changed"
    );
    // The device path is refused the same way, before any copy.
    let rows = DeviceRows {
        ordinal: 0,
        addr: 0x1000,
        row_bytes: n,
        rows: 2,
    };
    assert!(matches!(
        bank.write_pending_from_device(p.store_id, 0, 0, rows),
        Err(BankError::RankAcked {
            rank: 0,
            index: 0,
            ..
        })
    ));
    // The other rank still writes and completes the store with the original bytes.
    write_entries(&bank, &p, 1, &[0, 1]);
    assert_eq!(bank.ack(p.store_id, 1).unwrap(), StoreStatus::Ready);
    assert_eq!(read(&bank, 0, slot), pattern(p.entries[1].0, 0, n));
    // Ready: the store is gone, a write names it unknown.
    assert!(matches!(
        bank.write_pending(p.store_id, 1, 0, &vec![0; n]),
        Err(BankError::UnknownStore(_))
    ));
}

#[test]
fn a_failed_write_does_not_count_as_written() {
    // On a host bank the device-source copy fails (Unsupported) inside the
    // copy: the entry stays unwritten, and one written before is unwritten
    // again (a failed copy may have left part of its bytes).
    let bank = bank(1, 4);
    let n = slot_bytes(&bank);
    let p = bank.store(None, &chain(0, 2)).unwrap();
    write_entries(&bank, &p, 0, &[0]);
    let rows = DeviceRows {
        ordinal: 0,
        addr: 0x1000,
        row_bytes: n,
        rows: 1,
    };
    assert!(matches!(
        bank.write_pending_from_device(p.store_id, 0, 1, rows),
        Err(BankError::Unsupported { .. })
    ));
    assert!(matches!(
        bank.ack(p.store_id, 0),
        Err(BankError::Unwritten {
            missing: 1,
            first: 1,
            ..
        })
    ));
    assert!(matches!(
        bank.write_pending_from_device(p.store_id, 0, 0, rows),
        Err(BankError::Unsupported { .. })
    ));
    assert!(matches!(
        bank.ack(p.store_id, 0),
        Err(BankError::Unwritten {
            missing: 2,
            first: 0,
            ..
        })
    ));
    // A refused argument (short bytes) never counts either.
    assert!(bank
        .write_pending(p.store_id, 0, 0, &vec![0; n - 1])
        .is_err());
    assert!(matches!(
        bank.ack(p.store_id, 0),
        Err(BankError::Unwritten { missing: 2, .. })
    ));
    write_entries(&bank, &p, 0, &[0, 1]);
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);
}

#[test]
fn a_refused_ack_leaves_the_store_pending_until_its_timeout_rolls_it_back() {
    let l = layout(2);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        4 * l.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_millis(40);
    let bank = BankManager::new_host_shm(cfg, "h").unwrap();
    let p = bank.store(None, &chain(0, 2)).unwrap();
    write_entries(&bank, &p, 0, &[0, 1]);
    bank.ack(p.store_id, 0).unwrap();
    assert!(matches!(
        bank.ack(p.store_id, 1),
        Err(BankError::Unwritten {
            rank: 1,
            missing: 2,
            first: 0,
            ..
        })
    ));
    let inv = bank.inventory();
    assert_eq!((inv.pending_slots, inv.ready.len()), (2, 0));
    std::thread::sleep(Duration::from_millis(60));
    // Past its deadline the ack reports the timeout (not Unwritten) and rolls back.
    match bank.ack(p.store_id, 1) {
        Err(BankError::StoreTimedOut { missing, .. }) => assert_eq!(missing, vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(bank.drain_events().is_empty());
    assert_eq!(bank.stats().stores_rolled_back, 1);
    // A store whose refused rank never comes back is expired by the sweep.
    let q = bank.store(None, &chain(100, 1)).unwrap();
    assert!(bank.ack(q.store_id, 0).is_err());
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(bank.expire_overdue(), vec![q.store_id]);
    assert!(bank.inventory().ready.is_empty());
}

#[test]
fn a_refused_ack_then_fail_rolls_back_at_once() {
    let bank = bank(2, 4);
    let p = bank.store(None, &chain(0, 2)).unwrap();
    write_entries(&bank, &p, 0, &[0, 1]);
    bank.ack(p.store_id, 0).unwrap();
    assert!(bank.ack(p.store_id, 1).is_err());
    bank.fail(p.store_id, 1).unwrap();
    let inv = bank.inventory();
    assert_eq!(
        (inv.pending_slots, inv.quarantined_slots, inv.free_slots),
        (0, 0, 4),
        "rank 0 acked, rank 1 failed: nobody can still write, the slots are free"
    );
    assert!(bank.drain_events().is_empty());
}
