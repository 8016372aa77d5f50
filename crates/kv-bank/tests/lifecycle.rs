//! Lifecycle tests of the bank manager, one per point of the issue.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use kv_bank::*;
use kv_descriptor::*;

/// `blocks` as the bank's events carry them: each with its logical slot.
fn with_slots(blocks: &[StoredBlock], slots: &[u32]) -> Vec<StoredBlock> {
    assert_eq!(blocks.len(), slots.len());
    blocks
        .iter()
        .zip(slots)
        .map(|(b, &s)| StoredBlock {
            slot: Some(s),
            ..*b
        })
        .collect()
}

#[test]
fn store_is_ready_only_after_every_rank_acked_and_then_emits_one_event() {
    let bank = bank(4, 8);
    let blocks = chain(0, 3);
    let p = bank.store(None, &blocks).unwrap();
    assert_eq!(
        p.entries.iter().map(|e| e.1).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    for r in 0..3 {
        assert!(matches!(
            write_and_ack(&bank, &p, r),
            StoreStatus::Waiting { .. }
        ));
        assert!(
            bank.inventory().ready.is_empty(),
            "visible before rank 3 acked"
        );
        assert!(bank.lookup(&blocks[0].sequence_hash).is_none());
        assert!(matches!(
            bank.pin_prefix(&hashes(&blocks)),
            Err(BankError::NotRetained(_))
        ));
        assert!(bank.drain_events().is_empty());
    }
    assert_eq!(bank.inventory().pending_slots, 3);
    assert_eq!(write_and_ack(&bank, &p, 3), StoreStatus::Ready);
    assert_eq!(bank.inventory().ready, hashes(&blocks));
    let ev = bank.drain_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].event_id, 1);
    assert_eq!(ev[0].tier, StorageTier::RetainedGpuDirect);
    assert_eq!(ev[0].publisher, bank.owner().engine_id);
    assert_eq!(ev[0].tp_size, 4);
    assert_eq!(ev[0].layout_fingerprint, layout(4).fingerprint());
    assert_eq!(
        ev[0].data,
        KvEventData::Stored {
            parent: None,
            // Each block names the logical slot it was stored in.
            blocks: with_slots(&blocks, &[0, 1, 2])
        }
    );
    // Every rank holds its own part in the shared logical slot.
    for r in 0..4 {
        let rb = bank.rank(r).unwrap();
        let mut out = vec![0u8; rb.descriptor().slot_bytes() as usize];
        rb.read_slot(2, &mut out).unwrap();
        assert_eq!(out, pattern(blocks[2].sequence_hash, r, out.len()));
    }
    // Re-storing a longer prefix writes only the new block, chained to the old tail.
    let longer = chain(0, 4);
    let q = store_ready(&bank, None, &longer);
    assert_eq!((q.entries.len(), q.already_retained), (1, 3));
    let ev = bank.drain_events();
    assert_eq!(ev[0].event_id, 2);
    assert_eq!(
        ev[0].data,
        KvEventData::Stored {
            parent: Some(blocks[2].sequence_hash),
            blocks: with_slots(&longer[3..], &[q.entries[0].1])
        }
    );
}

#[test]
fn failed_rank_rolls_back_the_store_on_all_ranks() {
    let bank = bank(2, 4);
    let blocks = chain(10, 4);
    let p = bank.store(None, &blocks).unwrap();
    write_and_ack(&bank, &p, 0);
    bank.fail(p.store_id, 1).unwrap();
    let inv = bank.inventory();
    assert_eq!(
        (inv.ready.len(), inv.pending_slots, inv.free_slots),
        (0, 0, 4)
    );
    assert!(matches!(
        bank.ack(p.store_id, 1),
        Err(BankError::UnknownStore(_))
    ));
    assert!(
        bank.drain_events().is_empty(),
        "a rolled-back store never appears in events"
    );
    assert_eq!(bank.stats().stores_rolled_back, 1);
    // The slots are usable again.
    store_ready(&bank, None, &blocks);
    assert_eq!(bank.inventory().ready.len(), 4);

    // Rank 1 fails while rank 0 has not answered: rank 0 may still be
    // copying, so the slots are quarantined (not reused) for a store timeout.
    let bank = common::bank(2, 4);
    let p = bank.store(None, &chain(20, 3)).unwrap();
    bank.fail(p.store_id, 1).unwrap();
    let inv = bank.inventory();
    assert_eq!(
        (inv.pending_slots, inv.quarantined_slots, inv.free_slots),
        (0, 3, 1)
    );
    assert!(matches!(
        bank.store(None, &chain(30, 2)),
        Err(BankError::BankFull { available: 1, .. })
    ));
}

#[test]
fn an_aborted_store_frees_its_slots_at_once() {
    let bank = bank(2, 4);
    // Nothing was written.
    let p = bank.store(None, &chain(20, 3)).unwrap();
    bank.abort(p.store_id).unwrap();
    let inv = bank.inventory();
    assert_eq!(
        (inv.pending_slots, inv.quarantined_slots, inv.free_slots),
        (0, 0, 4)
    );
    // One rank wrote every entry (its copies returned), the other none:
    // `fail` would quarantine the slots for a store timeout, `abort` does not.
    let p = bank.store(None, &chain(40, 3)).unwrap();
    let n = bank.manifest().parts()[0].slot_bytes() as usize;
    for (i, (h, _)) in p.entries.iter().enumerate() {
        bank.write_pending(p.store_id, 0, i, &pattern(*h, 0, n))
            .unwrap();
    }
    bank.abort(p.store_id).unwrap();
    let inv = bank.inventory();
    assert_eq!(
        (inv.pending_slots, inv.quarantined_slots, inv.free_slots),
        (0, 0, 4)
    );
    assert_eq!(bank.stats().stores_rolled_back, 2);
    assert!(
        bank.drain_events().is_empty(),
        "an aborted store is never announced"
    );
    // The store is gone: no write, ack or second abort reaches it.
    assert!(matches!(
        bank.write_pending(p.store_id, 1, 0, &vec![0; n]),
        Err(BankError::UnknownStore(_))
    ));
    assert!(matches!(
        bank.ack(p.store_id, 0),
        Err(BankError::UnknownStore(_))
    ));
    assert!(matches!(
        bank.abort(p.store_id),
        Err(BankError::UnknownStore(_))
    ));
    // Every slot is usable by the next store.
    let q = store_ready(&bank, None, &chain(60, 4));
    assert_eq!(q.entries.len(), 4);
    assert_eq!(bank.inventory().ready.len(), 4);
}

#[test]
fn bank_full_names_the_quarantined_slots_and_when_they_return() {
    let bank = bank(2, 4); // store timeout 30 s
    let pinned = store_ready(&bank, None, &chain(0, 1));
    let _pin = bank.pin_prefix(&[pinned.entries[0].0]).unwrap();
    let p = bank.store(None, &chain(20, 2)).unwrap();
    // Rank 0 neither acked nor failed: it may still be copying.
    bank.fail(p.store_id, 1).unwrap();
    let err = bank.store(None, &chain(40, 2)).unwrap_err();
    match err {
        BankError::BankFull {
            needed: 2,
            available: 1,
            slot_count: 4,
            pinned: 1,
            pending: 0,
            quarantined: 2,
            quarantine_release_ms: Some(ms),
        } => assert!(
            (29_000..=30_000).contains(&ms),
            "released one store timeout after the rollback, got {ms} ms"
        ),
        ref other => panic!("expected BankFull with 2 quarantined slots, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(
            "1 pinned, 0 pending in open stores, 2 quarantined after a rolled-back store"
        ),
        "{text}"
    );
    assert!(text.contains("ms from now"), "{text}");
    // Without a quarantine the message has no such part.
    let small = common::bank(1, 1);
    let _open = small.store(None, &chain(0, 1)).unwrap();
    let text = small.store(None, &chain(40, 1)).unwrap_err().to_string();
    assert!(
        text.ends_with("(0 pinned, 1 pending in open stores)"),
        "{text}"
    );
}

/// A host bank of 4 slots (TP 2) whose stores time out after 30 ms.
fn four_slot_bank_with_a_30ms_store_timeout() -> (KvLayout, BankManager) {
    let l = layout(2);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        4 * l.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_millis(30);
    (l, BankManager::new_host_shm(cfg, "h").unwrap())
}

#[test]
fn timed_out_rank_rolls_the_store_back() {
    let (_, bank) = four_slot_bank_with_a_30ms_store_timeout();
    let p = bank.store(None, &chain(0, 2)).unwrap();
    write_and_ack(&bank, &p, 0);
    std::thread::sleep(Duration::from_millis(40));
    match bank.ack(p.store_id, 1) {
        Err(BankError::StoreTimedOut { missing, .. }) => assert_eq!(missing, vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
    // Rank 1 may still be copying: the slots are not reusable yet.
    let inv = bank.inventory();
    assert_eq!(
        (inv.pending_slots, inv.quarantined_slots, inv.free_slots),
        (0, 2, 2)
    );
    std::thread::sleep(Duration::from_millis(40));
    assert!(bank.expire_overdue().is_empty());
    assert_eq!(bank.inventory().free_slots, 4);
    // A store nobody acks is expired by the sweep as well.
    let q = bank.store(None, &chain(100, 2)).unwrap();
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(bank.expire_overdue(), vec![q.store_id]);
    assert_eq!(bank.inventory().quarantined_slots, 2);
    std::thread::sleep(Duration::from_millis(40));
    bank.expire_overdue();
    assert_eq!(bank.inventory().free_slots, 4);
    assert!(bank.drain_events().is_empty());
}

/// A write into a store past its deadline is refused and rolls the store
/// back, as the ack past it does: it could never become ready, and it was
/// copied into for nothing. The error names the store timeout itself, not
/// only the time that passed.
#[test]
fn a_write_past_the_store_deadline_is_refused_and_rolls_the_store_back() {
    let (l, bank) = four_slot_bank_with_a_30ms_store_timeout();
    let p = bank.store(None, &chain(0, 2)).unwrap();
    let part = pattern(p.entries[0].0, 0, l.rank_block_bytes());
    bank.write_pending(p.store_id, 0, 0, &part).unwrap(); // in time
    std::thread::sleep(Duration::from_millis(40));
    let e = bank.write_pending(p.store_id, 0, 1, &part).unwrap_err();
    match &e {
        BankError::StoreTimedOut {
            store_id,
            timeout_ms,
            waited_ms,
            missing,
        } => {
            assert_eq!(
                (*store_id, *timeout_ms, missing.clone()),
                (p.store_id, 30, vec![0, 1])
            );
            assert!(*waited_ms >= 30, "{e}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        e.to_string().contains("within the store timeout of 30 ms"),
        "{e}"
    );
    // Rolled back: no rank acked, so the slots are quarantined, and the
    // store is gone for every later call.
    let inv = bank.inventory();
    assert_eq!((inv.pending_slots, inv.quarantined_slots), (0, 2));
    assert!(matches!(
        bank.write_pending(p.store_id, 1, 0, &part),
        Err(BankError::UnknownStore(id)) if id == p.store_id
    ));
    assert!(matches!(
        bank.ack(p.store_id, 0),
        Err(BankError::UnknownStore(id)) if id == p.store_id
    ));
    assert_eq!(bank.stats().store_bytes_from_host, part.len() as u64);
}

#[test]
fn lru_eviction_skips_pinned_slots_and_pins_are_raii() {
    let bank = bank(2, 4);
    let a = chain(0, 2);
    let b = chain(1000, 2);
    store_ready(&bank, None, &a);
    store_ready(&bank, None, &b);
    bank.drain_events();
    let pin_a = bank.pin_prefix(&hashes(&a)).unwrap();
    assert_eq!(pin_a.slots(), &[0, 1]);
    // b is older in use than a? a was pinned (not in LRU), so b is evicted.
    let c = chain(5000, 2);
    store_ready(&bank, None, &c);
    assert_eq!(bank.ready_prefix_len(&hashes(&a)), 2);
    assert_eq!(bank.ready_prefix_len(&hashes(&b)), 0);
    let ev = bank.drain_events();
    assert_eq!(
        ev[0].data,
        KvEventData::Removed {
            sequence_hashes: vec![b[1].sequence_hash, b[0].sequence_hash]
        },
        "the tail of a prefix is evicted before its root"
    );
    // With a and c both pinned nothing is evictable.
    let pin_c = bank.pin_prefix(&hashes(&c)).unwrap();
    let err = bank.store(None, &chain(9000, 1)).unwrap_err();
    assert!(
        matches!(
            err,
            BankError::BankFull {
                needed: 1,
                available: 0,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(bank.inventory().pinned_slots, 4);
    // The pinned bytes are intact.
    let rb = pin_a.rank(1).unwrap();
    let mut out = vec![0u8; rb.descriptor().slot_bytes() as usize];
    rb.read_slot(pin_a.slots()[1], &mut out).unwrap();
    assert_eq!(out, pattern(a[1].sequence_hash, 1, out.len()));
    drop(pin_a);
    drop(pin_c);
    assert_eq!(bank.pins_outstanding(), 0);
    store_ready(&bank, None, &chain(9000, 1));
    assert_eq!(bank.inventory().ready.len(), 4);
}

#[test]
fn budget_is_divided_across_ranks() {
    let l = layout(2);
    let cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        10 * l.block_bytes() as u64 + 5,
    );
    assert_eq!(cfg.slot_count(), 10);
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let s2 = sizes.clone();
    let bank = BankManager::new(cfg, move |rank, bytes| {
        s2.lock().unwrap().push((rank, bytes));
        Ok(RankMemory {
            memory: Arc::new(HostShmMemory::create_unique("kvbank-test", bytes)?),
            location: MemoryLocation::Host {
                host_id: "h".into(),
            },
        })
    })
    .unwrap();
    let rank_bytes = 10 * l.rank_block_bytes();
    assert_eq!(
        *sizes.lock().unwrap(),
        vec![(0, rank_bytes), (1, rank_bytes)]
    );
    assert_eq!(bank.manifest().parts()[1].region_bytes(), rank_bytes as u64);
    let small = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        l.block_bytes() as u64 - 1,
    );
    let e = BankManager::new_host_shm(small, "h").unwrap_err();
    assert!(e.to_string().contains("`budget_bytes`"), "{e}");
}

#[test]
fn allocation_failure_on_a_later_rank_leaves_nothing_behind() {
    let l = layout(2);
    let cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        4 * l.block_bytes() as u64,
    );
    let names = Arc::new(Mutex::new(Vec::new()));
    let n2 = names.clone();
    let e = BankManager::new(cfg, move |rank, bytes| {
        if rank == 1 {
            return Err(BankError::HostMemory {
                name: "/rank1".into(),
                op: "mmap",
                source: std::io::Error::from_raw_os_error(libc_enomem()),
            });
        }
        let m = HostShmMemory::create_unique("kvbank-test", bytes)?;
        n2.lock().unwrap().push(m.name().to_string());
        Ok(RankMemory {
            memory: Arc::new(m),
            location: MemoryLocation::Host {
                host_id: "h".into(),
            },
        })
    })
    .unwrap_err();
    assert!(e.to_string().contains("mmap"), "{e}");
    let names = names.lock().unwrap();
    assert_eq!(names.len(), 1);
    assert!(
        !std::path::Path::new(&format!("/dev/shm{}", names[0])).exists(),
        "rank 0 memory must be freed"
    );
    // A real host allocation failure: an absurd size is refused by the OS,
    // by the page reservation on a sized /dev/shm (ShmNoSpace), by `mmap`
    // on one without a size limit (no reservation there).
    let e = HostShmMemory::create_unique("kvbank-test", 1 << 50).unwrap_err();
    assert!(
        matches!(
            e,
            BankError::ShmNoSpace {
                field: "len",
                bytes: 1_125_899_906_842_624,
                ..
            } | BankError::HostMemory { op: "mmap", .. }
        ),
        "{e}"
    );
}

fn libc_enomem() -> i32 {
    12
}

#[test]
fn retained_blocks_are_copies_independent_of_the_native_cache() {
    let bank = bank(1, 4);
    let n = layout(1).rank_block_bytes();
    // The engine's native cache, with one block of KV in native block 3.
    let native = HostShmMemory::create_unique("kvbank-native", 8 * n).unwrap();
    let kv: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    native.write_bytes(3 * n, &kv).unwrap();
    let blocks = chain(0, 1);
    let p = bank.store(None, &blocks).unwrap();
    let mut buf = vec![0u8; n];
    native.read_bytes(3 * n, &mut buf).unwrap();
    bank.write_pending(p.store_id, 0, 0, &buf).unwrap();
    bank.ack(p.store_id, 0).unwrap();
    let before = bank.inventory();
    // Native clear: the engine wipes and reuses its blocks.
    native.write_bytes(0, &vec![0xEE; 8 * n]).unwrap();
    assert_eq!(bank.native_cleared(), before);
    let mut out = vec![0u8; n];
    bank.rank(0)
        .unwrap()
        .read_slot(p.entries[0].1, &mut out)
        .unwrap();
    assert_eq!(out, kv);
    assert!(bank.pin_prefix(&hashes(&blocks)).is_ok());
}

#[test]
fn multimodal_lineage_is_never_exported_and_survives_native_clears_and_generations() {
    let l = layout(1);
    let lineage = Arc::new(ExclusionLineage::default());
    let owner = OwnerLease::fresh(Role::Decode);
    let mut cfg = BankConfig::new(l, owner, 8 * l.block_bytes() as u64);
    cfg.lineage = lineage.clone();
    let bank = BankManager::new_host_shm(cfg.clone(), "h").unwrap();
    // Request: 2 text blocks, then a block holding an excluded image, then 2 more.
    let blocks = chain(0, 5);
    lineage.mark(&[blocks[2].sequence_hash]);
    let p = store_ready(&bank, None, &blocks);
    assert_eq!((p.entries.len(), p.excluded), (2, 3));
    assert!(
        lineage.is_excluded(&blocks[4].sequence_hash),
        "descendants join the lineage"
    );
    bank.native_cleared();
    // Stored again later from the parent: still refused.
    let q = bank
        .store(Some(blocks[1].sequence_hash), &blocks[2..])
        .unwrap();
    assert!(q.is_empty() && q.excluded == 3);
    // A block marked after it was stored is removed and can no longer be pinned.
    bank.drain_events();
    bank.exclude(&[blocks[1].sequence_hash]);
    assert_eq!(
        bank.drain_events()[0].data,
        KvEventData::Removed {
            sequence_hashes: vec![blocks[1].sequence_hash]
        }
    );
    assert!(matches!(
        bank.pin_prefix(&hashes(&blocks[1..2])),
        Err(BankError::Excluded(_))
    ));
    // The next bank generation shares the engine's lineage.
    bank.close(Duration::from_secs(1)).unwrap();
    cfg.owner = owner.next_generation();
    let gen2 = BankManager::new_host_shm(cfg, "h").unwrap();
    let r = gen2.store(None, &blocks).unwrap();
    assert_eq!((r.entries.len(), r.excluded), (1, 4));
}

#[test]
fn only_sealed_chained_blocks_are_accepted() {
    let bank = bank(1, 4);
    let tokens: Vec<u32> = (0..11).collect();
    let b = sealed_blocks(None, &tokens, 4);
    assert_eq!(b.len(), 2, "11 tokens hold 2 sealed blocks of 4");
    let mut broken = b.clone();
    broken[1].sequence_hash = SequenceHash(broken[1].sequence_hash.0 ^ 1);
    let e = bank.store(None, &broken).unwrap_err();
    assert!(matches!(e, BankError::BrokenChain { index: 1, .. }), "{e}");
    // The wrong parent also breaks the chain.
    assert!(bank.store(Some(SequenceHash(5)), &b).is_err());
    assert_eq!(
        bank.inventory().free_slots,
        4,
        "a refused store changes nothing"
    );
}

fn hint_for(bank: &BankManager, blocks: &[StoredBlock], slots: Vec<u32>) -> FetchGpuHint {
    let tp = bank.manifest().tp_size();
    let n = bank.manifest().parts()[0].slot_bytes();
    FetchGpuHint {
        donor_engine_id: bank.owner().engine_id,
        bank_generation: bank.owner().generation,
        layout_fingerprint: bank.manifest().layout().fingerprint(),
        tp_size: tp,
        sequence_hashes: hashes(blocks),
        fetch_from: 1,
        parts: (0..tp)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: slots.len() as u64 * n,
            })
            .collect(),
        donor_control_endpoint: "local".into(),
    }
}

#[test]
fn pin_hint_checks_owner_generation_layout_and_slots() {
    let bank = bank(2, 4);
    let blocks = chain(0, 3);
    store_ready(&bank, None, &blocks);
    let good = hint_for(&bank, &blocks, vec![1, 2]);
    let pin = bank.pin_hint(&good).unwrap();
    assert_eq!(pin.hashes(), &hashes(&blocks)[1..]);
    assert_eq!(bank.inventory().pinned_slots, 2);
    drop(pin);
    let swapped = hint_for(&bank, &blocks, vec![2, 1]);
    assert!(matches!(
        bank.pin_hint(&swapped),
        Err(BankError::SlotMismatch {
            index: 0,
            slot: 2,
            ..
        })
    ));
    let mut stale = good.clone();
    stale.bank_generation += 1;
    assert!(matches!(
        bank.pin_hint(&stale),
        Err(BankError::StaleOwner {
            field: "bank_generation",
            ..
        })
    ));
    let mut other = good.clone();
    other.layout_fingerprint = LayoutFingerprint(1);
    assert!(matches!(
        bank.pin_hint(&other),
        Err(BankError::StaleOwner {
            field: "layout_fingerprint",
            ..
        })
    ));
    let mut uneven = good.clone();
    uneven.parts[1].slot_ids = vec![1];
    assert!(bank.pin_hint(&uneven).is_err());
    assert_eq!(bank.pins_outstanding(), 0, "refused hints pin nothing");
}

#[test]
fn close_waits_for_pins_refuses_new_ones_and_kills_the_generation() {
    let bank = bank(2, 4);
    let blocks = chain(0, 2);
    store_ready(&bank, None, &blocks);
    let pending = bank.store(None, &chain(50, 1)).unwrap();
    let hint = hint_for(&bank, &blocks, vec![1]);
    let pin = bank.pin_prefix(&hashes(&blocks)).unwrap();
    let name = match bank.manifest().parts()[0].export() {
        ExportHandle::HostShm { name } => name.clone(),
        other => panic!("{other:?}"),
    };
    // A transfer releases its pin 50 ms into the close.
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(pin);
    });
    let t0 = std::time::Instant::now();
    bank.close(Duration::from_secs(5)).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(45),
        "close returned before the pin drained"
    );
    t.join().unwrap();
    assert!(bank.is_closed());
    assert!(matches!(
        bank.pin_prefix(&hashes(&blocks)),
        Err(BankError::Closed { .. })
    ));
    assert!(matches!(
        bank.pin_hint(&hint),
        Err(BankError::Closed { .. })
    ));
    assert!(bank.store(None, &chain(70, 1)).is_err());
    assert!(
        matches!(
            bank.ack(pending.store_id, 0),
            Err(BankError::UnknownStore(_))
        ),
        "pending stores rolled back"
    );
    assert!(bank.check_descriptor(&bank.manifest().parts()[0]).is_err());
    assert!(bank.rank(0).is_err());
    assert!(
        !std::path::Path::new(&format!("/dev/shm{name}")).exists(),
        "memory freed"
    );
    let ev = bank.drain_events();
    assert_eq!(ev.last().unwrap().data, KvEventData::Cleared);
    // Bounded: a pin that never drains makes close time out, not hang.
    let bank2 = common::bank(1, 2);
    store_ready(&bank2, None, &chain(0, 1));
    let stuck = bank2.pin_prefix(&hashes(&chain(0, 1))).unwrap();
    let e = bank2.close(Duration::from_millis(20)).unwrap_err();
    assert!(matches!(e, BankError::CloseTimedOut { pins: 1, .. }), "{e}");
    assert!(bank2.pin_prefix(&hashes(&chain(0, 1))).is_err());
    // The memory stays valid for the pin holder, and goes with the last pin.
    let rb = stuck.rank(0).unwrap().clone();
    let mut out = vec![0u8; rb.descriptor().slot_bytes() as usize];
    rb.read_slot(0, &mut out).unwrap();
    assert_eq!(out, pattern(chain(0, 1)[0].sequence_hash, 0, out.len()));
    drop(rb);
    drop(stuck);
    assert!(bank2.rank(0).is_err());
}

/// An id past the pool or listed twice is the caller's bug, told apart from
/// contention (`AlreadyReserved`, which callers count as a fallback): typed,
/// naming the entry, and decided before the pool's state is looked at, so a
/// list holding both a busy block and a bad id is refused as the bad id.
#[test]
fn reserve_exact_tells_caller_bugs_from_contention() {
    let pool = DestinationPool::new(6);
    let held = pool.reserve_exact(&[2]).unwrap();
    let refused = |blocks: &[u32]| match pool.reserve_exact(blocks) {
        Err(e) => e,
        Ok(r) => panic!("{blocks:?} reserved {:?}", r.blocks()),
    };
    let e = refused(&[1, 6]);
    assert!(
        matches!(
            e,
            BankError::BlockOutOfRange {
                index: 1,
                block: 6,
                capacity: 6
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "`blocks[1]` = 6 is not below the destination pool's capacity 6"
    );
    let e = refused(&[u32::MAX]);
    assert!(
        matches!(
            e,
            BankError::BlockOutOfRange {
                index: 0,
                block: u32::MAX,
                capacity: 6
            }
        ),
        "{e:?}"
    );
    let e = refused(&[3, 0, 3]);
    assert!(
        matches!(
            e,
            BankError::DuplicateBlock {
                index: 2,
                block: 3,
                first: 0
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "`blocks[2]` = 3 repeats `blocks[0]`");
    // Block 2 is held (contention) but the list is also bad: the bug wins,
    // whichever comes first in the list.
    let e = refused(&[2, 9]);
    assert!(
        matches!(
            e,
            BankError::BlockOutOfRange {
                index: 1,
                block: 9,
                ..
            }
        ),
        "{e:?}"
    );
    let e = refused(&[2, 1, 1]);
    assert!(
        matches!(
            e,
            BankError::DuplicateBlock {
                index: 2,
                block: 1,
                first: 1
            }
        ),
        "{e:?}"
    );
    // A valid list with a held block is contention, naming the block.
    let e = refused(&[1, 2]);
    assert!(
        matches!(e, BankError::AlreadyReserved { block: 2 }),
        "{e:?}"
    );
    // `check_blocks` decides the same without reserving or reading state.
    assert!(matches!(
        pool.check_blocks(&[5, 6]),
        Err(BankError::BlockOutOfRange {
            index: 1,
            block: 6,
            capacity: 6
        })
    ));
    pool.check_blocks(&[2, 5, 0]).unwrap();
    assert_eq!(pool.free_blocks(), 5, "refused requests reserved nothing");
    held.cancel().quiesced();
    assert_eq!(pool.free_blocks(), 6);
}

#[test]
fn destination_reservations_hold_blocks_until_complete_or_quiesced() {
    let pool = DestinationPool::new(6);
    let a = pool.reserve(4).unwrap();
    assert_eq!(a.blocks(), &[0, 1, 2, 3]);
    assert!(matches!(
        pool.reserve(3),
        Err(BankError::DestinationFull { needed: 3, free: 2 })
    ));
    assert!(matches!(
        pool.reserve_exact(&[4, 2]),
        Err(BankError::AlreadyReserved { block: 2 })
    ));
    assert!(
        matches!(
            pool.reserve_exact(&[4, 4]),
            Err(BankError::DuplicateBlock {
                index: 1,
                block: 4,
                first: 0
            })
        ),
        "duplicates refused as a caller bug"
    );
    assert_eq!(
        pool.free_blocks(),
        2,
        "refused reservations reserve nothing"
    );
    let c = a.cancel();
    assert!(
        pool.is_reserved(0),
        "cancelled but not quiesced: still reserved"
    );
    assert!(pool.reserve(3).is_err());
    c.quiesced();
    assert_eq!(pool.free_blocks(), 6);
    let b = pool.reserve_exact(&[5, 1]).unwrap();
    let done = b.complete();
    assert_eq!(&done[..], &[5, 1]);
    assert!(!pool.is_reserved(5));
    // Completed blocks hold the fetch's KV: not free while the guard is held.
    assert_eq!(pool.free_blocks(), 4);
    assert!(pool.reserve_exact(&[5]).is_err());
    drop(done);
    assert_eq!(pool.free_blocks(), 6);
    // Dropped without an outcome: orphaned until the transfer engine quiesced.
    let d = pool.reserve(2).unwrap();
    drop(d);
    assert_eq!((pool.orphaned_blocks(), pool.free_blocks()), (2, 4));
    assert!(pool.is_reserved(0));
    assert_eq!(pool.reclaim_orphans_after_quiesce(), 2);
    assert_eq!(pool.free_blocks(), 6);
    let e = pool.reserve(1).unwrap().cancel();
    drop(e);
    assert_eq!(
        pool.orphaned_blocks(),
        1,
        "a cancelled reservation dropped unquiesced stays held"
    );
}

#[test]
fn manifest_round_trips_and_names_each_rank() {
    let bank = bank(2, 3);
    let m = bank.manifest();
    let back = BankManifest::from_wire(&m.to_wire().unwrap()).unwrap();
    assert_eq!(&back, m);
    for (r, d) in m.parts().iter().enumerate() {
        assert_eq!(d.tp_rank(), r as u32);
        assert_eq!(d.slot_count(), 3);
        bank.check_descriptor(d).unwrap();
        let ExportHandle::HostShm { name } = d.export() else {
            panic!()
        };
        // An importer maps the rank's region by name and sees the same bytes.
        let imp = HostShmMemory::open(name, d.region_bytes() as usize).unwrap();
        assert_eq!(imp.len() as u64, d.region_bytes());
    }
}

#[test]
fn write_pending_only_writes_slots_of_that_pending_store() {
    let bank = bank(2, 4);
    let n = bank.manifest().parts()[0].slot_bytes() as usize;
    let a = chain(0, 1);
    let done = store_ready(&bank, None, &a);
    assert!(matches!(
        bank.write_pending(done.store_id, 0, 0, &vec![0; n]),
        Err(BankError::UnknownStore(_))
    ));
    let p = bank.store(None, &chain(50, 2)).unwrap();
    assert!(
        bank.write_pending(p.store_id, 0, 2, &vec![0; n]).is_err(),
        "index out of range"
    );
    assert!(
        bank.write_pending(p.store_id, 2, 0, &vec![0; n]).is_err(),
        "rank out of range"
    );
    assert!(
        bank.write_pending(p.store_id, 0, 0, &vec![0; n - 1])
            .is_err(),
        "short part"
    );
    for r in 0..2 {
        for (i, (h, _)) in p.entries.iter().enumerate() {
            bank.write_pending(p.store_id, r, i, &pattern(*h, r, n))
                .unwrap();
        }
        bank.ack(p.store_id, r).unwrap();
    }
    let pin = bank.pin_prefix(&hashes(&chain(50, 2))).unwrap();
    let mut out = vec![0u8; n];
    pin.rank(1)
        .unwrap()
        .read_slot(pin.slots()[1], &mut out)
        .unwrap();
    assert_eq!(out, pattern(pin.hashes()[1], 1, n));
}

#[test]
fn empty_store_id_never_names_a_later_store() {
    // A store with nothing new (its blocks pending in another store) must
    // not hand out the id the next real store gets: acking it would commit
    // that store before its ranks wrote, and make their own ack fail.
    let bank = bank(2, 8);
    let a = chain(0, 2);
    let pa = bank.store(None, &a).unwrap();
    let empty = bank.store(None, &a).unwrap();
    assert!(empty.is_empty() && empty.already_retained == 2);
    let pb = bank.store(None, &chain(100, 2)).unwrap();
    assert_ne!(empty.store_id, pb.store_id);
    assert_ne!(empty.store_id, pa.store_id);
    for r in 0..2 {
        assert!(matches!(
            bank.ack(empty.store_id, r),
            Err(BankError::UnknownStore(_))
        ));
    }
    assert_eq!(bank.inventory().pending_slots, 4);
    for r in 0..2 {
        write_and_ack(&bank, &pa, r);
        write_and_ack(&bank, &pb, r);
    }
    assert_eq!(bank.inventory().ready.len(), 4);
}

#[test]
fn blocks_excluded_while_their_store_is_pending_never_become_ready() {
    // The engine learns that block 0 depends on an excluded image while the
    // store holding it (and its descendant, block 1) waits for the ranks. The
    // acks must not make either block ready: block 1's K/V attends to the
    // excluded input too, so it must join the lineage and never be exported.
    let bank = bank(2, 4);
    let blocks = chain(0, 2);
    let p = bank.store(None, &blocks).unwrap();
    assert_eq!(p.entries.len(), 2);
    bank.drain_events();
    bank.exclude(&[blocks[0].sequence_hash]);
    for r in 0..2 {
        write_and_ack(&bank, &p, r);
    }
    let inv = bank.inventory();
    assert!(
        inv.ready.is_empty(),
        "excluded blocks became ready: {inv:?}"
    );
    assert_eq!(inv.free_slots, 4, "their slots are free again");
    assert!(
        !bank
            .drain_events()
            .iter()
            .any(|e| matches!(e.data, KvEventData::Stored { .. })),
        "no Stored event for excluded blocks"
    );
    assert!(
        bank.config().lineage.is_excluded(&blocks[1].sequence_hash),
        "the descendant joins the lineage"
    );
    assert!(bank.pin_prefix(&hashes(&blocks[1..])).is_err());
    // A hint fetching only the descendant (the consumer holds block 0) is refused.
    let slot_of_1 = p.entries[1].1;
    assert!(bank
        .pin_hint(&hint_for(&bank, &blocks, vec![slot_of_1]))
        .is_err());
    assert_eq!(bank.pins_outstanding(), 0);
}

#[test]
fn a_dead_generation_reports_nothing_retained() {
    // After close the `Cleared` event says the bank retains nothing, and the
    // memory is freed: lookups and the inventory must agree with it, or a
    // resync / metrics / donor directory would keep advertising dead blocks.
    let bank = bank(2, 4);
    let blocks = chain(0, 2);
    store_ready(&bank, None, &blocks);
    assert_eq!(bank.inventory().ready.len(), 2);
    bank.close(Duration::from_secs(1)).unwrap();
    assert_eq!(
        bank.drain_events().last().unwrap().data,
        KvEventData::Cleared
    );
    assert!(bank.inventory().ready.is_empty(), "{:?}", bank.inventory());
    assert_eq!(bank.lookup(&blocks[0].sequence_hash), None);
    assert_eq!(bank.ready_prefix_len(&hashes(&blocks)), 0);
}

/// A full bank extending a held chain evicts another chain's block, never
/// the parent it is about to announce: before, the parent was the LRU head
/// (the tail of its prefix), so the bank sent `Removed [parent]` and then
/// `Stored { parent }`, which the router's index refuses as unchained.
#[test]
fn a_store_into_a_full_bank_keeps_the_parent_it_announces() {
    let bank = bank(2, 4);
    let a = chain(0, 3);
    let b = chain(1000, 2);
    store_ready(&bank, None, &a[..2]);
    store_ready(&bank, None, &b);
    bank.drain_events();
    let parent = a[1].sequence_hash;
    store_ready(&bank, Some(parent), &a[2..]);
    let ev = bank.drain_events();
    let removed: Vec<SequenceHash> = ev
        .iter()
        .filter_map(|e| match &e.data {
            KvEventData::Removed { sequence_hashes } => Some(sequence_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(
        !removed.contains(&parent),
        "evicted the parent it extends: {removed:?}"
    );
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert!(
        bank.lookup(&parent).is_some(),
        "the announced parent is still held"
    );
    assert!(ev.iter().any(|e| matches!(&e.data,
        KvEventData::Stored { parent: Some(p), .. } if *p == parent)));
}

/// `unlink_names` (the Python wheel's exit hook) removes the bank's names
/// from /dev/shm (every segment and lease) and nothing else: a mapping made
/// before keeps reading, the creator keeps storing into its memory, a new
/// import is refused (no lease), and the drop afterwards finds the names
/// gone without complaint.
#[test]
fn unlink_names_removes_the_names_and_leaves_the_bank_working() {
    let bank = bank(2, 4);
    let l = layout(2);
    let first = store_ready(&bank, None, &chain(0, 1));
    let parts = bank.manifest().parts().to_vec();
    let mapped = HostShmMemory::open_descriptor(&parts[1]).unwrap();
    let mut names: Vec<String> = parts
        .iter()
        .map(|d| match d.export() {
            ExportHandle::HostShm { name } => name.clone(),
            other => panic!("a host bank exports shm, got {other:?}"),
        })
        .chain(bank.lease_status().names)
        .collect();
    names.sort();
    let exists = |n: &str| std::path::Path::new(&format!("{SHM_DIR}{n}")).exists();
    assert!(names.iter().all(|n| exists(n)), "{names:?}");

    let mut removed = bank.unlink_names();
    removed.sort();
    assert_eq!(removed, names, "every segment and lease, nothing else");
    assert!(names.iter().all(|n| !exists(n)), "{names:?}");
    assert!(
        bank.unlink_names().is_empty(),
        "a second call finds nothing"
    );

    // The memory stays: the creator stores, the earlier mapping reads.
    let second = store_ready(&bank, None, &chain(100, 1));
    let slot_bytes = l.rank_block_bytes();
    for (p, hash) in [(&first, first.entries[0].0), (&second, second.entries[0].0)] {
        let off = p.entries[0].1 as usize * slot_bytes;
        let mut got = vec![0u8; slot_bytes];
        mapped.read_bytes(off, &mut got).unwrap();
        assert_eq!(got, pattern(hash, 1, slot_bytes));
    }
    // No new importer: the lease is gone with its name.
    assert!(matches!(
        HostShmMemory::open_descriptor(&parts[0]),
        Err(BankError::LeaseMissing { .. })
    ));
    drop(mapped);
    bank.close(Duration::from_secs(1)).unwrap();
    drop(bank);
    assert!(names.iter().all(|n| !exists(n)));
}
