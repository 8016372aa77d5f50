//! `write_pending` copies run outside the bank's lock: a slow copy (a
//! blocking host-to-device copy on the GPU profile) must not stall other
//! bank operations, and a store rolled back while one of its copies runs
//! must not hand that slot to another store before the copy ended.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use kv_bank::{
    BankConfig, BankError, BankManager, BankMemory, HostShmMemory, MemoryKind, PendingStore,
    RankMemory, StoreStatus,
};
use kv_descriptor::{ExportHandle, MemoryLocation, OwnerLease, Role};

/// Host shm whose `write_bytes` at one offset announces itself and then
/// blocks until released: a copy that takes as long as the test wants.
#[derive(Debug)]
struct GatedMemory {
    inner: HostShmMemory,
    gated_offset: usize,
    entered: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl BankMemory for GatedMemory {
    fn kind(&self) -> MemoryKind {
        self.inner.kind()
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
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        if offset == self.gated_offset {
            if let Some(tx) = self.entered.lock().unwrap().take() {
                tx.send(()).unwrap();
                let _ = self
                    .release
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(30));
            }
        }
        self.inner.write_bytes(offset, src)
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.inner.read_bytes(offset, dst)
    }
}

/// A TP1 bank of `slots` slots whose first write to slot `gated_slot` blocks;
/// returns the bank, "the copy entered", and the release handle.
fn gated_bank(slots: u64, gated_slot: u32) -> (BankManager, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let l = layout(1);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        slots * l.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_secs(30);
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let gate = Mutex::new(Some((entered_tx, release_rx)));
    let bank = BankManager::new(cfg, move |_, bytes| {
        let (tx, rx) = gate.lock().unwrap().take().expect("one rank");
        Ok(RankMemory {
            memory: Arc::new(GatedMemory {
                inner: HostShmMemory::create_unique("kvbank-twp", bytes)?,
                gated_offset: gated_slot as usize * l.rank_block_bytes(),
                entered: Mutex::new(Some(tx)),
                release: Mutex::new(rx),
            }),
            location: MemoryLocation::Host {
                host_id: "test-host".into(),
            },
        })
    })
    .unwrap();
    (bank, entered, release)
}

/// A 2-block store on a gated 2-slot bank whose copy into slot 0 is held
/// inside the gate while `roll_back(bank, store_id)` (named `what`) runs,
/// which must return within 3 s instead of waiting for the copy. Returns
/// the bank, the store, the writer thread and the gate's release.
#[allow(clippy::type_complexity)]
fn rolled_back_mid_copy(
    what: &str,
    roll_back: fn(&BankManager, u64) -> Result<(), BankError>,
) -> (
    BankManager,
    PendingStore,
    std::thread::JoinHandle<Result<(), BankError>>,
    mpsc::Sender<()>,
) {
    let (bank, entered, release) = gated_bank(2, 0);
    let p = bank.store(None, &chain(0, 2)).unwrap();
    let n = bank.manifest().parts()[0].slot_bytes() as usize;
    let writer = {
        let (bank, id) = (bank.clone(), p.store_id);
        std::thread::spawn(move || bank.write_pending(id, 0, 0, &vec![7u8; n]))
    };
    entered.recv_timeout(Duration::from_secs(10)).unwrap();
    let (b, id) = (bank.clone(), p.store_id);
    within(Duration::from_secs(3), move || roll_back(&b, id))
        .unwrap_or_else(|| panic!("{what} blocked behind a running copy"))
        .unwrap();
    (bank, p, writer, release)
}

/// Runs `f` on another thread and waits at most `limit` for it.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

#[test]
fn a_slow_write_pending_copy_does_not_block_other_bank_operations() {
    let first = chain(0, 1);
    let other = chain(1000, 2);
    let (bank, entered, release) = gated_bank(4, 0);
    let p = bank.store(None, &first).unwrap();
    assert_eq!(p.entries[0].1, 0, "the first free slot is slot 0");
    let slot_bytes = bank.manifest().parts()[0].slot_bytes() as usize;
    let bytes = pattern(p.entries[0].0, 0, slot_bytes);
    let writer = {
        let (bank, bytes, id) = (bank.clone(), bytes.clone(), p.store_id);
        std::thread::spawn(move || bank.write_pending(id, 0, 0, &bytes))
    };
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the copy started");

    // While that copy is stalled: a store of other blocks, its write and ack
    // (the whole store path), an inventory read and a pin all complete.
    let b = bank.clone();
    let done = within(Duration::from_secs(3), move || {
        let q = b.store(None, &other).unwrap();
        let n = b.manifest().parts()[0].slot_bytes() as usize;
        for (i, (h, _)) in q.entries.iter().enumerate() {
            b.write_pending(q.store_id, 0, i, &pattern(*h, 0, n))
                .unwrap();
        }
        let status = b.ack(q.store_id, 0).unwrap();
        let pinned = b.pin_prefix(&hashes(&other)).unwrap().slots().len();
        (status, b.inventory().ready.len(), pinned)
    });
    let _ = release.send(());
    let done = done.expect("bank operations blocked behind a running write_pending copy");
    assert_eq!(done, (StoreStatus::Ready, 2, 2));

    writer.join().unwrap().unwrap();
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);
    let mut back = vec![0u8; slot_bytes];
    bank.rank(0).unwrap().read_slot(0, &mut back).unwrap();
    assert_eq!(
        back, bytes,
        "the stalled copy's bytes are what slot 0 holds"
    );
}

#[test]
fn the_ack_that_makes_a_store_ready_waits_for_its_running_copy() {
    let first = chain(0, 1);
    let (bank, entered, release) = gated_bank(2, 0);
    let p = bank.store(None, &first).unwrap();
    let slot_bytes = bank.manifest().parts()[0].slot_bytes() as usize;
    let bytes = pattern(p.entries[0].0, 0, slot_bytes);
    let writer = {
        let (bank, bytes, id) = (bank.clone(), bytes.clone(), p.store_id);
        std::thread::spawn(move || bank.write_pending(id, 0, 0, &bytes))
    };
    entered.recv_timeout(Duration::from_secs(10)).unwrap();
    let b = bank.clone();
    let id = p.store_id;
    let (acked_tx, acked) = mpsc::channel();
    std::thread::spawn(move || acked_tx.send(b.ack(id, 0)).unwrap());
    // The ack must not make the block ready while its bytes are still written.
    assert!(acked.recv_timeout(Duration::from_millis(300)).is_err());
    assert!(bank.inventory().ready.is_empty());
    release.send(()).unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(
        acked
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .unwrap(),
        StoreStatus::Ready
    );
    assert_eq!(bank.ready_prefix_len(&hashes(&first)), 1);
}

#[test]
fn a_slot_rolled_back_mid_copy_is_not_reused_until_the_copy_ended() {
    let (bank, p, writer, release) = rolled_back_mid_copy("fail", |b, id| b.fail(id, 0));
    assert_eq!(p.entries.iter().map(|e| e.1).collect::<Vec<_>>(), [0, 1]);
    // Slot 1 is free again; slot 0 is still being written, so a 2-block
    // store does not fit and a 1-block store gets slot 1.
    assert!(matches!(
        bank.store(None, &chain(100, 2)),
        Err(BankError::BankFull { .. })
    ));
    let q = bank.store(None, &chain(200, 1)).unwrap();
    assert_eq!(q.entries[0].1, 1);
    release.send(()).unwrap();
    assert!(
        matches!(writer.join().unwrap(), Err(BankError::UnknownStore(s)) if s == p.store_id),
        "a copy whose store was rolled back reports it"
    );
    // The copy ended: slot 0 is free for the next store.
    let r = bank.store(None, &chain(300, 1)).unwrap();
    assert_eq!(r.entries[0].1, 0);
}

#[test]
fn an_abort_mid_copy_frees_the_slot_only_when_the_copy_ended() {
    let (bank, p, writer, release) = rolled_back_mid_copy("abort", |b, id| b.abort(id));
    // Slot 1 (not being written) is free at once, slot 0 is not: the copy
    // into it still runs, and a new store there could be overwritten by it.
    let inv = bank.inventory();
    assert_eq!((inv.free_slots, inv.quarantined_slots), (1, 0));
    assert!(matches!(
        bank.store(None, &chain(100, 2)),
        Err(BankError::BankFull { available: 1, .. })
    ));
    release.send(()).unwrap();
    assert!(
        matches!(writer.join().unwrap(), Err(BankError::UnknownStore(s)) if s == p.store_id),
        "a copy whose store was aborted reports it"
    );
    assert_eq!(bank.inventory().free_slots, 2);
    let q = bank.store(None, &chain(300, 2)).unwrap();
    assert_eq!(q.entries.len(), 2);
}
