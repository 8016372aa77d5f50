//! Pins from several threads while stores evict and the bank closes: pinned
//! bytes are never overwritten, and close drains every pin.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kv_bank::BankError;

#[test]
fn pinned_bytes_survive_concurrent_stores_and_close_drains_pins() {
    let bank = bank(2, 12);
    let slot_bytes = bank.manifest().parts()[0].slot_bytes() as usize;
    let chains: Vec<_> = (0..4).map(|c| chain(c * 100, 3)).collect();
    for c in &chains {
        store_ready(&bank, None, c);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let pinned_reads = Arc::new(AtomicU64::new(0));
    let mismatches = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..3)
        .map(|t| {
            let (bank, stop, reads, bad) = (
                bank.clone(),
                stop.clone(),
                pinned_reads.clone(),
                mismatches.clone(),
            );
            let chains = chains.clone();
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let c = &chains[i % chains.len()];
                    i += 1;
                    match bank.pin_prefix(&hashes(c)) {
                        Ok(pin) => {
                            for (h, &slot) in pin.hashes().iter().zip(pin.slots()) {
                                for rank in 0..2 {
                                    let mut out = vec![0u8; slot_bytes];
                                    pin.rank(rank).unwrap().read_slot(slot, &mut out).unwrap();
                                    if out != pattern(*h, rank, slot_bytes) {
                                        bad.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                            reads.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(BankError::NotRetained(_)) => {
                            // Evicted meanwhile: put it back (ignoring a full bank).
                            // The bank may close between these calls: errors then are expected.
                            if let Ok(p) = bank.store(None, c) {
                                for r in 0..2 {
                                    for (i, (h, _)) in p.entries.iter().enumerate() {
                                        let _ = bank.write_pending(
                                            p.store_id,
                                            r,
                                            i,
                                            &pattern(*h, r, slot_bytes),
                                        );
                                    }
                                    let _ = bank.ack(p.store_id, r);
                                }
                            }
                        }
                        Err(BankError::Closed { .. }) => return,
                        Err(BankError::BankFull { .. }) => {}
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
            })
        })
        .collect();
    // Let the readers pin before the churn starts: on few cores the churn
    // could otherwise finish and close before any reader ran.
    let t0 = std::time::Instant::now();
    while pinned_reads.load(Ordering::Relaxed) == 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::yield_now();
    }
    // Churn: stores that force evictions while readers pin.
    for k in 0..60u32 {
        if let Ok(p) = bank.store(None, &chain(10_000 + k * 10, 2)) {
            for r in 0..2 {
                write_and_ack(&bank, &p, r);
            }
        }
    }
    bank.close(Duration::from_secs(5)).unwrap();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(
        mismatches.load(Ordering::Relaxed),
        0,
        "a pinned slot was overwritten"
    );
    assert!(pinned_reads.load(Ordering::Relaxed) > 0);
    assert_eq!(bank.pins_outstanding(), 0);
    assert!(
        bank.stats().blocks_evicted > 0,
        "the churn must have evicted something"
    );
}
