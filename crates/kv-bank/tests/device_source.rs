//! The device-source store path (`write_pending_from_device`) without a GPU:
//! which row lands in which slot, the counters, and the refusals. The copy
//! itself is a stand-in memory that records each `(offset, source address)`
//! and writes a byte naming the source row, so the mapping is checked on
//! the CPU; `tests/gpu_bank.rs` runs the real device-to-device copies.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use kv_bank::{
    BankConfig, BankError, BankManager, BankMemory, DeviceRows, HostShmMemory, MemoryKind,
    RankMemory, StoreStatus,
};
use kv_descriptor::{ExportHandle, MemoryLocation, OwnerLease, Role};

/// Source rows start here (a made-up device address; never dereferenced).
const SRC: u64 = 0x7f00_0000_0000;

/// Every `copy_from_device` call: (copies, bytes each, source ordinal).
type Calls = Arc<Mutex<Vec<(Vec<(usize, u64)>, usize, u32)>>>;

/// Host shm standing in for device memory: `copy_from_device` fills each
/// destination with the source row's index + 1 and records the call.
#[derive(Debug)]
struct RecordingMemory {
    inner: HostShmMemory,
    row_bytes: usize,
    calls: Calls,
}

impl BankMemory for RecordingMemory {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda { ordinal: 0 }
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn base_addr(&self) -> u64 {
        self.inner.base_addr()
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        self.inner.export_handle()
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.inner.read_bytes(offset, dst)
    }
    fn copy_from_device(
        &self,
        copies: &[(usize, u64)],
        len: usize,
        src_ordinal: u32,
    ) -> Result<(), BankError> {
        self.calls
            .lock()
            .unwrap()
            .push((copies.to_vec(), len, src_ordinal));
        for (offset, src) in copies {
            let row = ((src - SRC) as usize / self.row_bytes) as u8;
            self.inner.write_bytes(*offset, &vec![row + 1; len])?;
        }
        Ok(())
    }
}

fn recording_bank(slots: u64) -> (BankManager, Calls) {
    let l = layout(1);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        slots * l.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_secs(30);
    let calls: Calls = Arc::default();
    let c = calls.clone();
    let bank = BankManager::new(cfg, move |_, bytes| {
        Ok(RankMemory {
            memory: Arc::new(RecordingMemory {
                inner: HostShmMemory::create_unique("kvbank-tds", bytes)?,
                row_bytes: l.rank_block_bytes(),
                calls: c.clone(),
            }),
            location: MemoryLocation::Host {
                host_id: "test-host".into(),
            },
        })
    })
    .unwrap();
    (bank, calls)
}

fn rows(n: usize) -> DeviceRows {
    DeviceRows {
        ordinal: 0,
        addr: SRC,
        row_bytes: layout(1).rank_block_bytes(),
        rows: n,
    }
}

#[test]
fn device_rows_land_in_the_slots_of_their_entries_in_one_copy_call() {
    let (bank, calls) = recording_bank(8);
    let rbb = layout(1).rank_block_bytes();
    let p = bank.store(None, &chain(0, 4)).unwrap();
    // Rows 0..2 into entries 1..3: entry 0 stays for a second call.
    bank.write_pending_from_device(p.store_id, 0, 1, rows(3))
        .unwrap();
    bank.write_pending_from_device(p.store_id, 0, 0, rows(1))
        .unwrap();
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2, "one batched copy per call");
    let (first, len, ordinal) = &calls[0];
    assert_eq!((*len, *ordinal), (rbb, 0));
    let want: Vec<(usize, u64)> = p.entries[1..]
        .iter()
        .enumerate()
        .map(|(i, (_, s))| (*s as usize * rbb, SRC + (i * rbb) as u64))
        .collect();
    assert_eq!(first, &want);
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);
    let rb = bank.rank(0).unwrap();
    let mut out = vec![0u8; rbb];
    for (entry, want_row) in [(0usize, 0u8), (1, 0), (2, 1), (3, 2)] {
        rb.read_slot(p.entries[entry].1, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == want_row + 1), "entry {entry}");
    }
    let stats = bank.stats();
    assert_eq!(stats.store_bytes_from_device, 4 * rbb as u64);
    assert_eq!(stats.store_bytes_from_host, 0);
}

#[test]
fn host_writes_count_as_host_payload() {
    let b = bank(2, 8);
    let p = store_ready(&b, None, &chain(0, 3));
    let rbb = layout(2).rank_block_bytes() as u64;
    assert_eq!(p.entries.len(), 3);
    // store_ready writes every entry of both ranks through write_pending.
    assert_eq!(b.stats().store_bytes_from_host, 6 * rbb);
    let q = b.store(None, &chain(100, 2)).unwrap();
    for r in 0..2 {
        for i in 0..2 {
            b.write_pending(q.store_id, r, i, &vec![1; rbb as usize])
                .unwrap();
        }
    }
    assert_eq!(b.stats().store_bytes_from_host, 10 * rbb);
    assert_eq!(b.stats().store_bytes_from_device, 0);
}

#[test]
fn rows_past_the_entries_a_wrong_row_size_and_a_host_bank_are_refused() {
    let (bank, calls) = recording_bank(8);
    let p = bank.store(None, &chain(0, 2)).unwrap();
    match bank.write_pending_from_device(p.store_id, 0, 1, rows(2)) {
        Err(BankError::InvalidArgument {
            field: "index",
            reason,
        }) => {
            assert!(
                reason.contains("2 is not below the store's 2 entries"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    match bank.write_pending_from_device(p.store_id, 0, 0, rows(0)) {
        Err(BankError::InvalidArgument { field: "index", .. }) => {}
        other => panic!("{other:?}"),
    }
    let mut short = rows(1);
    short.row_bytes -= 4;
    match bank.write_pending_from_device(p.store_id, 0, 0, short) {
        Err(BankError::InvalidArgument {
            field: "source", ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(calls.lock().unwrap().is_empty(), "refused before any copy");
    // Nothing was marked as written: the right rows still store.
    bank.write_pending_from_device(p.store_id, 0, 0, rows(2))
        .unwrap();
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);

    let host = common::bank(1, 4);
    let q = host.store(None, &chain(0, 1)).unwrap();
    match host.write_pending_from_device(q.store_id, 0, 0, rows(1)) {
        Err(BankError::Unsupported { op, kind }) => {
            assert_eq!((op, kind.as_str()), ("copy_from_device", "host"))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(host.stats().store_bytes_from_device, 0);
}
