//! Security of `pin_hint`: a hint can only reference slots of a bank whose
//! owner, generation and lease match; forged, out-of-range and
//! wrong-incarnation hints are refused without reading bank memory (the bank
//! lives on `TripwireMemory`, which counts every read and address handed out).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_bank::faults::{forged_variants, hint_for, tripwire_bank};
use kv_bank::{sealed_blocks, BankError, BankManager};
use kv_descriptor::SequenceHash;

fn stored(bank: &BankManager, n: u32) -> Vec<(SequenceHash, u32)> {
    let blocks = sealed_blocks(None, &(0..4 * n).collect::<Vec<u32>>(), 4);
    let p = bank.store(None, &blocks).unwrap();
    for r in 0..2 {
        let len = bank.manifest().parts()[r as usize].slot_bytes() as usize;
        for (i, (h, _)) in p.entries.iter().enumerate() {
            bank.write_pending(p.store_id, r, i, &vec![h.0 as u8; len])
                .unwrap();
        }
        bank.ack(p.store_id, r).unwrap();
    }
    p.entries
}

#[test]
fn every_forged_hint_is_refused_by_name_without_touching_memory() {
    let reads = Arc::new(AtomicU64::new(0));
    let bank = tripwire_bank(reads.clone()).unwrap();
    let entries = stored(&bank, 3);
    let good = hint_for(&bank, &entries);
    let before = reads.load(Ordering::Relaxed);
    let variants = forged_variants(&bank, &good);
    assert_eq!(variants.len(), 5);
    for (name, h) in &variants {
        let e = bank.pin_hint(h).unwrap_err();
        let ok = match *name {
            "wrong_engine_id" => matches!(
                e,
                BankError::StaleOwner {
                    field: "engine_id",
                    ..
                }
            ),
            "wrong_generation" => {
                matches!(
                    e,
                    BankError::StaleOwner {
                        field: "bank_generation",
                        ..
                    }
                )
            }
            "out_of_range_slot" => matches!(
                e,
                BankError::SlotOutOfRange {
                    rank: 0,
                    index: 0,
                    slot: 8,
                    slot_count: 8
                }
            ),
            "slot_holds_another_block" => matches!(e, BankError::SlotMismatch { index: 0, .. }),
            "wrong_layout" => {
                matches!(
                    e,
                    BankError::StaleOwner {
                        field: "layout_fingerprint",
                        ..
                    }
                )
            }
            other => panic!("unexpected variant {other}"),
        };
        assert!(ok, "{name}: {e}");
    }
    assert_eq!(
        reads.load(Ordering::Relaxed),
        before,
        "no memory read for a refusal"
    );
    assert_eq!(bank.pins_outstanding(), 0, "refusals pin nothing");
    // The honest hint is accepted, still without reading memory: pinning is bookkeeping.
    let pin = bank.pin_hint(&good).unwrap();
    assert_eq!(
        pin.slots(),
        &entries.iter().map(|e| e.1).collect::<Vec<_>>()[..]
    );
    assert_eq!(reads.load(Ordering::Relaxed), before);
    drop(pin);
    // The tripwire does count real reads (the check above could fail).
    let mut b = vec![0u8; 16];
    bank.rank(0)
        .unwrap()
        .memory()
        .read_bytes(0, &mut b)
        .unwrap();
    assert_eq!(reads.load(Ordering::Relaxed), before + 1);
}

#[test]
fn hints_to_a_bank_whose_lease_lapsed_or_generation_closed_are_refused() {
    let reads = Arc::new(AtomicU64::new(0));
    let bank = tripwire_bank(reads.clone()).unwrap();
    let entries = stored(&bank, 2);
    let good = hint_for(&bank, &entries);
    bank.close(Duration::from_secs(1)).unwrap();
    let before = reads.load(Ordering::Relaxed);
    assert!(matches!(
        bank.pin_hint(&good),
        Err(BankError::Closed { generation: 1 })
    ));
    assert_eq!(reads.load(Ordering::Relaxed), before);
}
