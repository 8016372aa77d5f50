//! Transfer-path correctness of the fetch executor: every donor mapping is
//! bound to the manifest part it claims to be, a multipart delivery with one
//! read still in flight keeps its rows out of the pool, and what can be
//! checked locally is checked before the donor is asked for a pin.
//!
//! Tests share one lock: host shm segments and leases are process-wide names.

mod common;
use common::*;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_bank::{BankManager, BankMemory, DestinationPool, HostShmMemory};
use kv_descriptor::*;
use kv_router_glue::*;
use kv_transfer::plan::PartPlan;
use kv_transfer::{
    CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, PartOutcome, RankIo, TransferError,
};

fn envelope(bank: &BankManager, entries: &[(SequenceHash, u32)], endpoint: &str) -> HintEnvelope {
    HintEnvelope::fetch_gpu("req-1", "a0", &hint(bank, entries, endpoint)).unwrap()
}

fn shm_map(d: &BankDescriptor) -> Arc<dyn BankMemory> {
    Arc::new(HostShmMemory::open_descriptor(d).unwrap())
}

#[test]
fn mappings_handed_in_for_the_wrong_rank_are_refused_before_a_pin() {
    let _g = lock();
    let dir = tempfile::tempdir().unwrap();
    let ep = format!("unix:{}", dir.path().join("pin.sock").display());
    let bank = bank(8, "xfer-path");
    let svc = PinService::bind(bank.clone(), &ep, PinServiceConfig::default()).unwrap();
    let a = store(&bank, 4);
    let m = bank.manifest().clone();
    let parts = m.parts();

    // Rank 1's mapping as rank 0 and the reverse: refused, naming rank 0.
    let swapped = vec![shm_map(&parts[1]), shm_map(&parts[0])];
    let e = RemoteDonor::new(m.clone(), swapped, &ep).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("maps[0].export"), "{text}");
    assert!(text.contains("rank 1"), "says whose part it is: {text}");

    // Process-private memory has no export identity: refused.
    let private: Vec<Arc<dyn BankMemory>> = (0..TP)
        .map(|_| {
            Arc::new(HostBuffer::zeroed(parts[0].region_bytes() as usize).unwrap())
                as Arc<dyn BankMemory>
        })
        .collect();
    let e = RemoteDonor::new(m.clone(), private, &ep).unwrap_err();
    assert!(e.to_string().contains("maps[0].export"), "{e}");

    // The right segment mapped too short: refused by length.
    let ExportHandle::HostShm { name } = parts[1].export() else {
        panic!("host bank")
    };
    let short = vec![
        shm_map(&parts[0]),
        Arc::new(HostShmMemory::open(name, rbb()).unwrap()) as Arc<dyn BankMemory>,
    ];
    let e = RemoteDonor::new(m.clone(), short, &ep).unwrap_err();
    assert!(e.to_string().contains("maps[1].len"), "{e}");
    assert_eq!(svc.stats().granted, 0, "no check asked the donor");

    // Control: the right order fetches every rank's own bytes.
    let donor =
        RemoteDonor::new(m.clone(), vec![shm_map(&parts[0]), shm_map(&parts[1])], &ep).unwrap();
    let rows = 8;
    let target = regions(rows);
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(rows),
        dyn_regions(&target),
        rows,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    let out = exec
        .execute(&envelope(&bank, &a, &ep), &donor, &DeliveryControl::new())
        .unwrap();
    for (k, &row) in out.target_blocks.iter().enumerate() {
        for rank in 0..TP {
            let mut buf = vec![0u8; rbb()];
            target[rank as usize]
                .read_bytes(row as usize * rbb(), &mut buf)
                .unwrap();
            assert!(
                buf.iter()
                    .enumerate()
                    .all(|(i, &x)| x == pattern(a[k].0, rank, i)),
                "rank {rank} row {row} holds its own rank's bytes"
            );
        }
    }
    drop(out);
    svc.shutdown(Duration::ZERO);
}

/// Rank 0 fails with `Cancelled` (nothing in flight); rank 1 abandons a
/// read that may still land (`NotQuiesced`) and stays in flight until
/// `in_flight` is set to 0.
struct StalledRank1 {
    in_flight: AtomicUsize,
}

impl CopyBackend for StalledRank1 {
    fn name(&self) -> &'static str {
        "stalled_rank1"
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        _io: &RankIo<'_>,
        _c: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        if part.tp_rank() == 0 {
            return Err(TransferError::Cancelled);
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Err(TransferError::NotQuiesced {
            rank: part.tp_rank(),
            reason: "injected: read stalled on a cut link".into(),
        })
    }
    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

#[test]
fn rows_of_a_read_still_in_flight_stay_out_of_the_pool_whatever_rank_0_reports() {
    let _g = lock();
    let bank = bank(8, "xfer-path");
    let a = store(&bank, 3);
    let rows = 8;
    let target = regions(rows);
    let backend = Arc::new(StalledRank1 {
        in_flight: AtomicUsize::new(0),
    });
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(rows),
        dyn_regions(&target),
        rows,
        backend.clone(),
    )
    .unwrap();
    let env = envelope(&bank, &a, "unix:/unused");
    let e = exec
        .execute(&env, bank.as_ref(), &DeliveryControl::new())
        .unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::Fallback {
                stage: "transfer",
                ref cause,
            } if cause.may_still_write()
        ),
        "{e}"
    );
    assert_eq!(
        (exec.pool().orphaned_blocks(), exec.pool().free_blocks()),
        (3, 5),
        "the 3 rows rank 1's read may still write stay quarantined"
    );
    // A later execute while the read is still in flight reclaims nothing.
    assert_eq!(exec.reclaim_quiesced(), 0);
    assert_eq!(exec.pool().free_blocks(), 5);
    // Once the backend reports the read ended, the rows come back.
    backend.in_flight.store(0, Ordering::SeqCst);
    assert_eq!(exec.reclaim_quiesced(), 3);
    assert_eq!(exec.pool().free_blocks(), rows as usize);
    assert_eq!(bank.pins_outstanding(), 0);
}

/// The in-process bank, counting the pins it was asked for.
struct CountingDonor {
    bank: Arc<BankManager>,
    pins: AtomicU32,
}

impl DonorSource for CountingDonor {
    fn manifest(&self) -> &BankManifest {
        self.bank.manifest()
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        self.pins.fetch_add(1, Ordering::SeqCst);
        self.bank.pin(hint)
    }
}

#[test]
fn a_pool_larger_than_the_regions_is_refused_before_any_fetch_asks_the_donor() {
    let _g = lock();
    let bank = bank(8, "xfer-path");
    let a = store(&bank, 6);
    let donor = CountingDonor {
        bank: bank.clone(),
        pins: AtomicU32::new(0),
    };
    // The pool hands out rows 0..16 but the regions hold 4: a fetch of 6
    // blocks would get rows 4 and 5, which the plan refuses.
    let target = regions(4);
    let made = FetchExecutor::new(
        layout(),
        DestinationPool::new(16),
        dyn_regions(&target),
        4,
        Arc::new(HostCopyBackend),
    );
    match made {
        Err(FetchError::LayoutMismatch { field: "pool", .. }) => {}
        Err(other) => panic!("unexpected {other}"),
        Ok(exec) => {
            let r = exec.execute(
                &envelope(&bank, &a, "unix:/unused"),
                &donor,
                &DeliveryControl::new(),
            );
            panic!(
                "accepted; the fetch then asked the donor for {} pin(s) and ended {r:?}",
                donor.pins.load(Ordering::SeqCst)
            );
        }
    }
    assert_eq!(donor.pins.load(Ordering::SeqCst), 0);
}
