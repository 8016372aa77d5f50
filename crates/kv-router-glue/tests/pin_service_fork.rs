//! A pin service inherited by a forked child (Python's `os.fork`,
//! multiprocessing's default start method on Linux): the child's drop or
//! shutdown must neither join the creator's threads (which do not exist in
//! the child: std's join panics) nor remove the creator's socket file; the
//! creator keeps serving pins.
//!
//! One test in this binary: `fork` copies only the calling thread, and no
//! other test thread may hold a lock the child would need.

mod common;
use common::*;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kv_descriptor::*;
use kv_router_glue::*;

const CHILD_OK: i32 = 0;
const CHILD_PANICKED: i32 = 5;

/// The forked child: drops the inherited service and bank; never returns.
fn child(svc: PinService, bank: std::sync::Arc<kv_bank::BankManager>) -> ! {
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        drop(svc);
        drop(bank);
        CHILD_OK
    }))
    .unwrap_or(CHILD_PANICKED);
    // SAFETY: `_exit` ends the forked child at once, without running the
    // harness's exit path a second time; it takes a plain int.
    unsafe { libc::_exit(code) }
}

fn pin_over(path: &Path, req: PinRequest) -> PinDonorMessage {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&encode_pin_frame(&PinClientMessage::Pin(req)).unwrap())
        .unwrap();
    read_pin_reply(&mut s)
}

#[test]
fn a_forked_child_dropping_the_pin_service_leaves_the_creator_serving() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pin.sock");
    let endpoint = format!("unix:{}", path.display());
    let bank = bank(4, "kvbank-pinfork");
    let entries = store(&bank, 2);
    let svc = PinService::bind(bank.clone(), &endpoint, PinServiceConfig::default()).unwrap();
    // A connection served by its own thread before the fork: the child
    // inherits its handle too.
    let before = pin_over(
        &path,
        PinRequest::for_hint(1, &hint(&bank, &entries, &endpoint)),
    );
    assert!(matches!(before, PinDonorMessage::Granted(_)), "{before:?}");

    // SAFETY: this binary runs this one test, so the other threads are the
    // harness's main thread (waiting) and the service's and bank's own
    // (accept, refuser, connection, lease renewal), none of which holds a
    // lock the child needs while it is idle: the child takes the connection
    // map's lock only with `try_lock`. The child only drops values and
    // calls `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        child(svc, bank);
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid int.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);

    assert!(
        path.exists(),
        "the child's drop removed the creator's socket"
    );
    let after = pin_over(
        &path,
        PinRequest::for_hint(2, &hint(&bank, &entries, &endpoint)),
    );
    assert!(
        matches!(after, PinDonorMessage::Granted(_)),
        "the creator stopped serving: {after:?}"
    );
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        CHILD_OK,
        "5: the child panicked while dropping"
    );
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!((stats.connections, stats.granted), (2, 2));
    assert!(
        !path.exists(),
        "the creator's own shutdown removes its socket"
    );
}
