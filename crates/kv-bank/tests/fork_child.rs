//! A child forked from a bank's creator (Python's `os.fork`,
//! multiprocessing's default start method on Linux) inherits the bank but
//! not its ownership nor its lease-renewal thread. When the child drops its
//! copy (a helper that simply exits runs every destructor), the creator's
//! segments and leases must stay, and the drop must not panic; a store in
//! the child, which would write the creator's memory behind its slot table,
//! is refused, and `unlink_names` (the Python wheel's exit hook) removes
//! nothing of the creator's.
//!
//! One test in this binary: `fork` copies only the calling thread, and no
//! other test thread may hold a lock the child would need.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use kv_bank::{BankError, BankManager, BankMemory, HostShmMemory, LeaseConfig, SHM_DIR};
use kv_descriptor::ExportHandle;

/// What the child reports through its exit status.
const CHILD_OK: i32 = 0;
const CHILD_STORE_NOT_REFUSED: i32 = 3;
const CHILD_RENEW_NOT_REFUSED: i32 = 4;
const CHILD_PANICKED: i32 = 5;
const CHILD_UNLINKED: i32 = 6;

/// Runs in the forked child: tries to store and renew (both must be
/// refused), then drops the bank; never returns.
fn child(bank: BankManager) -> ! {
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        if !matches!(
            bank.store(None, &chain(500, 1)),
            Err(BankError::NotCreator { op: "store", .. })
        ) {
            return CHILD_STORE_NOT_REFUSED;
        }
        if !matches!(
            bank.renew_lease(),
            Err(BankError::NotCreator {
                op: "renew_lease",
                ..
            })
        ) {
            return CHILD_RENEW_NOT_REFUSED;
        }
        // The Python wheel's exit hook runs in a forked child that exits
        // normally: it must remove none of the creator's names.
        if !bank.unlink_names().is_empty() {
            return CHILD_UNLINKED;
        }
        // The drop an exiting helper runs: renewal thread, leases, segments.
        drop(bank);
        CHILD_OK
    }))
    .unwrap_or(CHILD_PANICKED);
    // SAFETY: `_exit` ends the forked child at once, without running the
    // test harness's exit path (atexit handlers, flushing buffers copied
    // from the parent) a second time; it takes a plain int.
    unsafe { libc::_exit(code) }
}

fn shm_entry(name: &str) -> bool {
    Path::new(&format!("{SHM_DIR}{name}")).exists()
}

#[test]
fn a_forked_child_dropping_the_bank_leaves_the_creators_segments_and_leases() {
    let l = layout(2);
    let mut cfg = kv_bank::BankConfig::new(
        l,
        kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode),
        4 * l.block_bytes() as u64,
    );
    // A renewal thread that runs often: the child inherits its handle but
    // not the thread.
    cfg.lease = LeaseConfig::background(Duration::from_secs(2), Duration::from_millis(50));
    let bank = BankManager::new_host_shm(cfg, "test-host").unwrap();
    let blocks = chain(0, 2);
    let p = store_ready(&bank, None, &blocks);
    let segments: Vec<String> = bank
        .manifest()
        .parts()
        .iter()
        .map(|d| match d.export() {
            ExportHandle::HostShm { name } => name.clone(),
            other => panic!("a host bank exports shm, got {other:?}"),
        })
        .collect();
    let leases = bank.lease_status().names;
    assert_eq!((segments.len(), leases.len()), (2, 2));
    assert!(segments.iter().chain(&leases).all(|n| shm_entry(n)));

    // SAFETY: this test binary runs this one test, so the only other
    // threads are the harness's main thread (waiting for this one) and the
    // bank's renewal thread, which holds no lock the child takes (it renews
    // through atomics in the lease mapping). The child only drops values and
    // calls `_exit` (see `child`).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        child(bank);
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid int.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);

    // The creator's bank is untouched: names, live leases, bytes.
    for n in segments.iter().chain(&leases) {
        assert!(shm_entry(n), "{n} was removed by the child's drop");
    }
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        CHILD_OK,
        "child: 3 store not refused, 4 renew not refused, 5 panicked while dropping, \
         6 unlink_names removed the creator's names"
    );
    let status = bank.lease_status();
    assert!(
        status.live,
        "the child's drop revoked the lease: {status:?}"
    );
    // Still importable by another process (the descriptor's lease checked)
    // and holding what was stored.
    let slot_bytes = l.rank_block_bytes();
    for (rank, d) in bank.manifest().parts().iter().enumerate() {
        let imported = HostShmMemory::open_descriptor(d).unwrap();
        let off = p.entries[1].1 as usize * slot_bytes;
        let mut got = vec![0u8; slot_bytes];
        imported.read_bytes(off, &mut got).unwrap();
        assert_eq!(got, pattern(p.entries[1].0, rank as u32, slot_bytes));
    }
    // The creator goes on storing and renewing.
    store_ready(&bank, None, &chain(100, 1));
    assert!(bank.renew_lease().unwrap().live);
    // And its own drop still removes everything.
    drop(bank);
    for n in segments.iter().chain(&leases) {
        assert!(!shm_entry(n), "{n} left behind by the creator's drop");
    }
}
