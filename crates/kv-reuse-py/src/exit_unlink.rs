//! The exit hook that removes every live bank's `/dev/shm` names
//! (`kvbank-<pid>-*` segments and their `.lease` files) when the
//! interpreter exits.
//!
//! A bank's names are normally removed by its Rust drop, which interpreter
//! finalization reaches through the module globals that hold the bank. Not
//! when a daemon thread is still alive whose stack references those globals
//! (its target is a function of the script, a server loop blocked in
//! `socket.accept()`) or the bank itself: CPython cannot clear a running
//! thread's frames at exit, and a module's dict is cleared only when the
//! module held its last reference, so the bank is never dropped and its
//! names stayed in `/dev/shm` until a `reclaim_stale` after its lease lapsed.
//!
//! So every bank this process opens (`DonorBank`, a `WorkerPublisher.donor`'s
//! bank) is registered here, weakly (the registry keeps nothing alive), and an
//! `atexit` hook registered at module import calls
//! `kv_bank::BankManager::unlink_names` on each bank still alive: names
//! only, so the memory stays mapped for any thread still using it, and the
//! bank's own drop, if it comes later, finds the names gone. In a forked
//! child the parent's banks (inherited entries of this registry) remove
//! nothing: `unlink_names` does nothing outside the creating process.

use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::time::{Duration, Instant};

use kv_bank::BankManager;
use pyo3::prelude::*;

/// Every bank opened in this process (and, in a forked child, its parent's),
/// weakly.
static BANKS: Mutex<Vec<Weak<BankManager>>> = Mutex::new(Vec::new());

/// Runs `f` on the registry. The lock is held for a few instructions at a
/// time, but a child forked while another thread of the parent held it has
/// a copy that no thread will ever release: after a bounded wait `f` is
/// skipped (the child's bank then goes unregistered, its exit hook finds
/// nothing) rather than hanging the child's `DonorBank()` or its exit.
fn with_banks(f: impl FnOnce(&mut Vec<Weak<BankManager>>)) {
    let give_up = Instant::now() + Duration::from_secs(1);
    loop {
        match BANKS.try_lock() {
            Ok(mut banks) => return f(&mut banks),
            // A panic while held cannot leave the Vec half-changed (push,
            // retain): use it.
            Err(TryLockError::Poisoned(p)) => return f(&mut p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => return,
        }
    }
}

/// Registers `bank` for the exit hook; forgets banks dropped meanwhile.
pub(crate) fn register(bank: &Arc<BankManager>) {
    with_banks(|banks| {
        banks.retain(|b| b.strong_count() > 0);
        banks.push(Arc::downgrade(bank));
    });
}

/// The `atexit` hook: removes the `/dev/shm` names of every registered bank
/// still alive that this process created. Returns the names removed (for
/// tests; `atexit` ignores it).
#[pyfunction]
fn unlink_live_banks() -> Vec<String> {
    let mut live = Vec::new();
    with_banks(|banks| live.extend(banks.iter().filter_map(Weak::upgrade)));
    // Outside the registry's lock: unlinking is a few syscalls per bank, and
    // dropping the last strong reference here (a bank dropped meanwhile on
    // another thread) runs the bank's drop.
    live.iter().flat_map(|b| b.unlink_names()).collect()
}

/// Registers [`unlink_live_banks`] with `atexit` (at module import).
///
/// The hook runs once the non-daemon threads were joined and before
/// finalization clears the modules; hooks registered after this import run
/// before it (atexit runs them last in, first out), so they still find the
/// banks' names.
pub(crate) fn register_hook(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(unlink_live_banks, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
