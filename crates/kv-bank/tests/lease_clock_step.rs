//! A wall-clock step must not lapse a live bank's lease.
//!
//! Stepping the host's real clock needs `CAP_SYS_TIME` and would disturb
//! every process of the machine, so this test binary steps the wall clock
//! of its own process only: it defines `clock_gettime`, which the linker
//! binds ahead of glibc's for every caller in this executable (std's
//! `SystemTime::now` included), and adds [`STEP_S`] seconds to
//! `CLOCK_REALTIME` readings once the step is switched on. Every other
//! clock passes through unchanged, as a real `settimeofday` step leaves
//! `CLOCK_BOOTTIME` / `CLOCK_MONOTONIC` alone. The test first checks that
//! the step took effect (else it prints `SKIP` and returns), so it cannot
//! pass without the wall clock having jumped.
//!
//! The owner (renewal thread, `renew_lease`, the store path's own liveness
//! check), the importer (`HostShmMemory::open_descriptor`,
//! `check_descriptor_lease`) and the reclaimer all run in this one process,
//! so all of them see the step, as all processes of a host would.

mod common;

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use kv_bank::{sealed_blocks, BankConfig, BankManager, HostShmMemory, LeaseConfig, StoreStatus};
use kv_descriptor::{OwnerLease, Role};

/// Size of the step: an hour, far beyond the lease (1 s here, 15 s by default).
const STEP_S: i64 = 3600;

/// Seconds added to `CLOCK_REALTIME` readings of this process (0 = no step).
static WALL_OFFSET_S: AtomicI64 = AtomicI64::new(0);

/// `clock_gettime(2)` for this test binary: the kernel's value (raw system
/// call, so no recursion into this symbol), plus [`WALL_OFFSET_S`] for
/// `CLOCK_REALTIME`.
///
/// # Safety
/// Same contract as libc's `clock_gettime`: `tp` points to a writable
/// `timespec`.
#[no_mangle]
pub unsafe extern "C" fn clock_gettime(
    clk: libc::clockid_t,
    tp: *mut libc::timespec,
) -> libc::c_int {
    // SAFETY: forwards the caller's arguments to the system call with the
    // same contract; `tp` is the caller's writable timespec.
    let r = unsafe { libc::syscall(libc::SYS_clock_gettime, clk, tp) } as libc::c_int;
    if r == 0 && clk == libc::CLOCK_REALTIME {
        // SAFETY: the system call succeeded, so `tp` is valid and initialised.
        unsafe { (*tp).tv_sec += WALL_OFFSET_S.load(Ordering::SeqCst) };
    }
    r
}

#[test]
fn wall_clock_step_does_not_lapse_a_live_lease() {
    let prefix = format!("kvbank-tstep{:08x}", uuid::Uuid::new_v4().as_u128() as u32);
    let l = common::layout(2);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        8 * l.block_bytes() as u64,
    );
    cfg.shm_prefix = prefix.clone();
    cfg.lease = LeaseConfig::background(Duration::from_secs(1), Duration::from_millis(100));
    let bank = BankManager::new_host_shm(cfg, "test-host").unwrap();
    let d = bank.manifest().parts()[0].clone();
    let blocks = sealed_blocks(
        None,
        &(0..8).collect::<Vec<u32>>(),
        l.tokens_per_block() as usize,
    );
    common::store_ready(&bank, None, &blocks[..1]);

    let before = SystemTime::now();
    WALL_OFFSET_S.store(STEP_S, Ordering::SeqCst);
    let jumped = SystemTime::now().duration_since(before).unwrap_or_default();
    if jumped < Duration::from_secs(STEP_S as u64 - 60) {
        WALL_OFFSET_S.store(0, Ordering::SeqCst);
        println!("SKIP wall_clock_step: the clock_gettime interposer is not in effect (wall clock moved {jumped:?})");
        return;
    }
    // Several background renewals run on the stepped clock.
    std::thread::sleep(Duration::from_millis(400));

    let status = bank.lease_status();
    let manual = bank.renew_lease();
    let import = HostShmMemory::open_descriptor(&d).map(|_| ());
    let checked = kv_bank::check_descriptor_lease(&d, kv_bank::LeaseInstant::now()).map(|_| ());
    let reclaim = kv_bank::reclaim_stale(&prefix, kv_bank::reclaim::ScanTime::now()).unwrap();
    let next = bank.store(blocks.first().map(|b| b.sequence_hash), &blocks[1..2]);
    WALL_OFFSET_S.store(0, Ordering::SeqCst);

    assert!(status.live, "owner's view after the step: {status:?}");
    assert!(manual.is_ok(), "renewal after the step: {manual:?}");
    assert!(import.is_ok(), "importer after the step: {import:?}");
    assert!(
        checked.is_ok(),
        "descriptor lease check after the step: {checked:?}"
    );
    assert!(
        reclaim.reclaimed.is_empty(),
        "reclaimer took a live bank: {reclaim:?}"
    );
    assert_eq!(reclaim.live, 2, "both ranks' leases are live: {reclaim:?}");
    let next = next.expect("store after the step");
    assert_eq!(
        common::write_and_ack(&bank, &next, 0),
        StoreStatus::Waiting { missing: vec![1] }
    );
    assert_eq!(common::write_and_ack(&bank, &next, 1), StoreStatus::Ready);
    assert_eq!(
        bank.ready_prefix_len(&blocks.iter().map(|b| b.sequence_hash).collect::<Vec<_>>()),
        2
    );
    bank.close(Duration::from_secs(1)).unwrap();
}
