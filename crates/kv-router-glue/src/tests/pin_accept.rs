//! The pin service's accept loop does no socket writes: a connection over
//! the limit whose refusal cannot be written (a target that does not read)
//! must not keep the next target's connection from being accepted.

use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kv_bank::{BankConfig, BankManager};
use kv_descriptor::{
    DType, KvLayout, OwnerLease, PinDonorMessage, PinRefusalReason, Role, TensorOrder,
};

use crate::pin_transport::{read_donor_message, unix_endpoint_path, PinStream};
use crate::{PinService, PinServiceConfig};

/// Gate of the stalling refusal writer: it reports that it started, then
/// waits for the release before writing.
static GATE: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>> = Mutex::new(None);

fn stalled_writer(stream: &mut PinStream, msg: &PinDonorMessage) -> std::io::Result<()> {
    if let Some((entered, release)) = GATE.lock().unwrap().take() {
        entered.send(()).unwrap();
        let _ = release.recv_timeout(Duration::from_secs(20));
    }
    let frame = kv_descriptor::encode_pin_frame(msg).map_err(std::io::Error::other)?;
    std::io::Write::write_all(stream, &frame)
}

fn until(limit: Duration, f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    f()
}

#[test]
fn a_stalled_over_limit_refusal_does_not_stop_the_accept_loop() {
    let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    let cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        4 * layout.block_bytes() as u64,
    );
    let bank = Arc::new(BankManager::new_host_shm(cfg, "pin-accept").unwrap());
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("unix:{}", dir.path().join("d.sock").display());
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    *GATE.lock().unwrap() = Some((entered_tx, release_rx));
    let config = PinServiceConfig {
        max_connections: 1,
        ..PinServiceConfig::default()
    };
    let svc = PinService::bind_with_refusal_writer(bank, &endpoint, config, None, stalled_writer)
        .unwrap();
    let path = unix_endpoint_path(&endpoint).unwrap();

    let mut a = UnixStream::connect(&path).unwrap();
    // A frame in progress: A is busy, so B is refused rather than A closed
    // to admit it (an idle connection would be).
    std::io::Write::write_all(&mut a, &[0u8]).unwrap();
    assert!(until(Duration::from_secs(2), || {
        svc.active_connections() == 1 && svc.idle_connections() == 0
    }));
    // Over the limit: its refusal's write stalls.
    let b = UnixStream::connect(&path).unwrap();
    entered
        .recv_timeout(Duration::from_secs(5))
        .expect("the refusal write started");
    // A leaves; C must be accepted and served while B's refusal is stalled.
    drop(a);
    assert!(until(Duration::from_secs(2), || svc.active_connections() == 0));
    let _c = UnixStream::connect(&path).unwrap();
    let accepted = until(Duration::from_secs(2), || svc.active_connections() == 1);
    let connections = svc.stats().connections;
    release.send(()).unwrap();
    assert!(accepted, "the accept loop is stuck behind a refusal write");
    assert_eq!(connections, 3);

    // B still gets its refusal once the write goes through.
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = PinStream::Unix(b);
    match read_donor_message(&mut b, Duration::from_secs(5)).unwrap() {
        PinDonorMessage::Refused(r) => {
            assert_eq!(r.reason, PinRefusalReason::TooManyPins);
            assert!(r.detail.contains("connection limit 1"), "{}", r.detail);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!(stats.connections_refused, 1);
}
