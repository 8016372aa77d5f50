//! Property test: random sequences of stores, per-rank acks, failures, pins
//! and unpins on a TP2 bank, checked after every step against a model of
//! what must hold (pins, evictions, readiness, events, bytes).

mod common;

use std::collections::{HashMap, HashSet};

use common::*;
use kv_bank::{BankError, ManagerPin, PendingStore, StoreStatus};
use kv_descriptor::{KvEventData, SequenceHash, StoredBlock};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Store the first `n` blocks of chain `c`.
    Store { c: usize, n: usize },
    /// Ack rank `rank` of the `i`-th pending store (modulo count), after
    /// writing its every entry when `write` (else the ack is refused, or a
    /// repeated one of a rank that acked).
    Ack { i: usize, rank: u32, write: bool },
    /// Fail the `i`-th pending store.
    Fail { i: usize },
    /// Pin the first `n` blocks of chain `c`.
    Pin { c: usize, n: usize },
    /// Drop the `i`-th live pin.
    Unpin { i: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4usize, 1..=5usize).prop_map(|(c, n)| Op::Store { c, n }),
        4 => (0..8usize, 0..2u32, prop::bool::weighted(0.8))
            .prop_map(|(i, rank, write)| Op::Ack { i, rank, write }),
        1 => (0..8usize).prop_map(|i| Op::Fail { i }),
        2 => (0..4usize, 1..=5usize).prop_map(|(c, n)| Op::Pin { c, n }),
        2 => (0..8usize).prop_map(|i| Op::Unpin { i }),
    ]
}

const SLOTS: u64 = 8;

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn pins_evictions_and_readiness_hold(ops in proptest::collection::vec(op(), 1..60)) {
        let bank = bank(2, SLOTS);
        let chains: Vec<Vec<StoredBlock>> = (0..4).map(|c| chain(c as u32 * 1000, 5)).collect();
        let slot_bytes = bank.manifest().parts()[0].slot_bytes() as usize;
        let mut pending: Vec<(PendingStore, [bool; 2])> = Vec::new();
        let mut pins: Vec<ManagerPin> = Vec::new();
        // Model: hashes made ready by a store every rank acked (minus Removed events).
        let mut retained: HashSet<SequenceHash> = HashSet::new();
        let mut next_event = 1u64;

        for op in ops {
            match op {
                Op::Store { c, n } => {
                    let pinned: usize = bank.inventory().pinned_slots;
                    match bank.store(None, &chains[c][..n]) {
                        Ok(p) => {
                            for (h, _) in &p.entries {
                                prop_assert!(!retained.contains(h), "re-stored a retained block");
                            }
                            if !p.is_empty() {
                                pending.push((p, [false; 2]));
                            }
                        }
                        Err(BankError::BankFull { available, .. }) => {
                            prop_assert!(available < n);
                            prop_assert!(
                                pinned > 0 || !pending.is_empty() || bank.inventory().quarantined_slots > 0,
                                "full with nothing pinned, pending or quarantined"
                            );
                        }
                        Err(e) => prop_assert!(false, "unexpected store error {e}"),
                    }
                }
                Op::Ack { i, rank, write } if !pending.is_empty() => {
                    let i = i % pending.len();
                    let (p, acked) = &mut pending[i];
                    let sealed = acked[rank as usize];
                    if sealed {
                        // Sealed: a second write is refused, a second ack is not.
                        let again = bank.write_pending(p.store_id, rank, 0, &vec![0; slot_bytes]);
                        prop_assert!(
                            matches!(again, Err(BankError::RankAcked { index: 0, .. })),
                            "write after ack: {:?}", again
                        );
                    } else if write {
                        write_raw(&bank, p, rank, slot_bytes);
                    }
                    if sealed || write {
                        acked[rank as usize] = true;
                        let status = bank.ack(p.store_id, rank).unwrap();
                        if acked.iter().all(|&a| a) {
                            prop_assert_eq!(status, StoreStatus::Ready);
                            retained.extend(p.entries.iter().map(|e| e.0));
                            pending.remove(i);
                        } else {
                            prop_assert!(matches!(status, StoreStatus::Waiting { .. }), "expected waiting");
                        }
                    } else {
                        // Never written: refused, the store stays pending, nothing published.
                        let refused = bank.ack(p.store_id, rank);
                        prop_assert!(
                            matches!(
                                refused,
                                Err(BankError::Unwritten { missing, first: 0, .. })
                                    if missing == p.entries.len()
                            ),
                            "ack without writes: {:?}", refused
                        );
                    }
                }
                Op::Fail { i } if !pending.is_empty() => {
                    let (p, _) = pending.remove(i % pending.len());
                    bank.fail(p.store_id, 1).unwrap();
                }
                Op::Pin { c, n } => {
                    let want = &hashes(&chains[c][..n]);
                    match bank.pin_prefix(want) {
                        Ok(pin) => {
                            for h in want {
                                prop_assert!(retained.contains(h), "pinned a block the model says is not ready");
                            }
                            pins.push(pin);
                        }
                        Err(BankError::NotRetained(h)) => prop_assert!(!retained.contains(&h) || !want.contains(&h)),
                        Err(e) => prop_assert!(false, "unexpected pin error {e}"),
                    }
                }
                Op::Unpin { i } if !pins.is_empty() => {
                    pins.remove(i % pins.len());
                }
                _ => {}
            }

            // Events replayed onto the model must give exactly the inventory.
            for e in bank.drain_events() {
                prop_assert_eq!(e.event_id, next_event);
                next_event += 1;
                match e.data {
                    KvEventData::Stored { blocks, .. } => {
                        for b in blocks {
                            prop_assert!(retained.contains(&b.sequence_hash), "Stored before ready");
                        }
                    }
                    KvEventData::Removed { sequence_hashes } => {
                        for h in sequence_hashes {
                            prop_assert!(retained.remove(&h), "removed a block that was not retained");
                        }
                    }
                    KvEventData::Cleared => prop_assert!(false, "no close in this test"),
                }
            }
            let inv = bank.inventory();
            let ready: HashSet<SequenceHash> = inv.ready.iter().copied().collect();
            prop_assert_eq!(&ready, &retained);
            let pending_slots: usize = pending.iter().map(|(p, _)| p.entries.len()).sum();
            prop_assert_eq!(inv.pending_slots, pending_slots);
            prop_assert_eq!(
                inv.ready.len() + inv.pending_slots + inv.quarantined_slots + inv.free_slots,
                SLOTS as usize
            );
            // Pending blocks are invisible until every rank acked.
            for (p, _) in &pending {
                for (h, _) in &p.entries {
                    prop_assert!(bank.lookup(h).is_none());
                }
            }
            // Every pinned block is still ready, in the same slot, with intact bytes on every rank.
            let mut pinned_at: HashMap<u32, SequenceHash> = HashMap::new();
            for pin in &pins {
                for (h, &slot) in pin.hashes().iter().zip(pin.slots()) {
                    prop_assert_eq!(bank.lookup(h), Some(slot), "pinned block evicted or moved");
                    pinned_at.insert(slot, *h);
                }
            }
            prop_assert_eq!(inv.pinned_slots, pinned_at.len());
            for (&slot, h) in &pinned_at {
                for rank in 0..2 {
                    let mut out = vec![0u8; slot_bytes];
                    bank.rank(rank).unwrap().read_slot(slot, &mut out).unwrap();
                    prop_assert_eq!(&out, &pattern(*h, rank, slot_bytes));
                }
            }
        }
    }
}

/// Writes rank `rank`'s pattern into every entry of `p` (`write_pending`).
fn write_raw(bank: &kv_bank::BankManager, p: &PendingStore, rank: u32, n: usize) {
    for (i, (h, _)) in p.entries.iter().enumerate() {
        bank.write_pending(p.store_id, rank, i, &pattern(*h, rank, n))
            .unwrap();
    }
}
