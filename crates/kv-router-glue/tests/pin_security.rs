//! Who may pin: the pin protocol over TCP with its pre-shared-key
//! HMAC-SHA256 challenge-response (`kv.pin-auth@1`), a client without the
//! key or with a wrong one refused with nothing pinned, pins ending on
//! release, disconnect and the hold bound over TCP, and Unix sockets made
//! 0600. Raw clients speak the exchange from its documented layout
//! (`pin_transport::auth`), with their own HMAC, so the wire stays what
//! docs/security.md says.
//!
//! Tests share one lock: they count pins of one process.

mod common;
use common::*;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use kv_bank::BankManager;
use kv_descriptor::*;
use kv_router_glue::*;
use sha2::Sha256;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef-donor-key";

fn key() -> PinAuthKey {
    PinAuthKey::from_bytes(KEY.to_vec()).unwrap()
}

fn tcp_service(bank: &Arc<BankManager>, config: PinServiceConfig) -> PinService {
    PinService::bind_authenticated(bank.clone(), "tcp:127.0.0.1:0", config, key()).unwrap()
}

fn until(limit: Duration, f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

fn tcp_addr(endpoint: &str) -> &str {
    endpoint.strip_prefix("tcp:").unwrap()
}

fn mac(key: &[u8], role: &[u8], donor_nonce: &[u8], target_nonce: &[u8]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    m.update(role);
    m.update(donor_nonce);
    m.update(target_nonce);
    m
}

/// A raw TCP client: reads the challenge, proves `key`, returns the stream
/// and the donor's status byte (checking the donor's proof on success).
fn raw_handshake(endpoint: &str, key: &[u8]) -> (TcpStream, u8) {
    let (mut s, hello) = raw_challenge(endpoint);
    let status = raw_prove(&mut s, &hello, key);
    (s, status)
}

/// The first half of [`raw_handshake`]: connects and reads the challenge.
fn raw_challenge(endpoint: &str) -> (TcpStream, [u8; 40]) {
    let mut s = TcpStream::connect(tcp_addr(endpoint)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; 40];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], &AUTH_MAGIC);
    (s, hello)
}

/// The second half: proves `key` against `hello`, returns the status byte.
fn raw_prove(s: &mut TcpStream, hello: &[u8; 40], key: &[u8]) -> u8 {
    let donor_nonce = &hello[8..];
    let target_nonce = [7u8; 32];
    let tag = mac(key, b"kv.pin-auth@1 target", donor_nonce, &target_nonce)
        .finalize()
        .into_bytes();
    s.write_all(&target_nonce).unwrap();
    s.write_all(&tag).unwrap();
    let mut status = [0u8; 1];
    s.read_exact(&mut status).unwrap();
    if status[0] == 1 {
        let mut donor_tag = [0u8; 32];
        s.read_exact(&mut donor_tag).unwrap();
        mac(key, b"kv.pin-auth@1 donor", donor_nonce, &target_nonce)
            .verify_slice(&donor_tag)
            .expect("the donor proves the same key");
    }
    status[0]
}

#[test]
fn a_tcp_pin_with_the_key_holds_its_slots_until_released() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 3);
    let svc = tcp_service(&bank, PinServiceConfig::default());
    assert!(
        svc.endpoint().starts_with("tcp:127.0.0.1:"),
        "{}",
        svc.endpoint()
    );
    assert!(
        !svc.endpoint().ends_with(":0"),
        "the bound port is published"
    );
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(key());
    let mut pin = donor
        .pin_remote(&hint(&bank, &a[..2], svc.endpoint()))
        .unwrap();
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (1, 2));
    pin.release_now().unwrap();
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (0, 0));
    drop(pin);
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!(
        (stats.granted, stats.released, stats.auth_refused),
        (1, 1, 0)
    );
}

#[test]
fn a_wrong_key_is_refused_typed_and_pins_nothing() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let svc = tcp_service(&bank, PinServiceConfig::default());
    let wrong = PinAuthKey::from_bytes(b"ffffffffffffffffffffffffffffffff".to_vec()).unwrap();
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(wrong);
    let e = donor
        .pin_remote(&hint(&bank, &a, svc.endpoint()))
        .unwrap_err();
    assert!(matches!(e, PinError::Auth(PinAuthError::Refused)), "{e:?}");
    assert_eq!(e.label(), "pin_auth");
    assert!(until(Duration::from_secs(2), || svc.stats().auth_refused == 1));
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (0, 0));
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!((stats.granted, stats.refused), (0, 0));
}

#[test]
fn a_target_without_a_key_sends_nothing_and_a_raw_pin_frame_is_never_read() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let svc = tcp_service(&bank, PinServiceConfig::default());
    let keyless = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint()).unwrap();
    let e = keyless
        .pin_remote(&hint(&bank, &a, svc.endpoint()))
        .unwrap_err();
    assert!(
        matches!(e, PinError::Auth(PinAuthError::KeyMissing { .. })),
        "{e:?}"
    );
    assert_eq!(svc.stats().connections, 0, "no connection without a key");

    // A client that skips the exchange and sends a pin frame: the frame is
    // taken as a (bad) proof, refused with status 0, the connection closed.
    let mut s = TcpStream::connect(tcp_addr(svc.endpoint())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let req = PinRequest::for_hint(1, &hint(&bank, &a, svc.endpoint()));
    let frame = encode_pin_frame(&PinClientMessage::Pin(req)).unwrap();
    assert!(frame.len() >= 64, "the frame covers the proof's 64 bytes");
    s.write_all(&frame).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert_eq!(
        got.len(),
        41,
        "challenge (40) + refusal status (1): {got:?}"
    );
    assert_eq!((&got[..8], got[40]), (&AUTH_MAGIC[..], 0));
    assert!(until(Duration::from_secs(2), || svc.stats().auth_refused == 1));
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (0, 0));
    assert_eq!(svc.shutdown(Duration::ZERO).granted, 0);
}

#[test]
fn a_silent_tcp_client_is_dropped_at_io_timeout() {
    let _g = lock();
    let bank = bank(2, "pin-sec");
    let config = PinServiceConfig {
        io_timeout: Duration::from_millis(100),
        ..PinServiceConfig::default()
    };
    let svc = tcp_service(&bank, config);
    let mut s = TcpStream::connect(tcp_addr(svc.endpoint())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert_eq!(got.len(), 40, "only the challenge");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(until(Duration::from_secs(2), || svc.stats().auth_refused == 1));
    assert!(until(Duration::from_secs(2), || svc.active_connections() == 0));
    svc.shutdown(Duration::ZERO);
}

#[test]
fn a_donor_without_the_key_is_not_trusted() {
    let _g = lock();
    let bank = bank(2, "pin-sec");
    let a = store(&bank, 1);
    // A fake donor: a valid challenge, then "OK" with a MAC of another key.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = format!("tcp:{}", fake.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut hello = AUTH_MAGIC.to_vec();
        hello.extend_from_slice(&[3u8; 32]);
        s.write_all(&hello).unwrap();
        let mut proof = [0u8; 64];
        s.read_exact(&mut proof).unwrap();
        let mut verdict = vec![1u8];
        verdict.extend_from_slice(&[9u8; 32]);
        s.write_all(&verdict).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest.len()
    });
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), &ep)
        .unwrap()
        .with_auth_key(key());
    let e = donor.pin_remote(&hint(&bank, &a, &ep)).unwrap_err();
    assert!(
        matches!(e, PinError::Auth(PinAuthError::DonorProof)),
        "{e:?}"
    );
    drop(donor);
    assert_eq!(
        server.join().unwrap(),
        0,
        "no pin frame sent to an unproven donor"
    );
}

#[test]
fn a_closed_tcp_connection_releases_its_pins() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 3);
    let svc = tcp_service(&bank, PinServiceConfig::default());
    let (mut s, status) = raw_handshake(svc.endpoint(), KEY);
    assert_eq!(status, 1);
    let req = PinRequest::for_hint(1, &hint(&bank, &a, svc.endpoint()));
    s.write_all(&encode_pin_frame(&PinClientMessage::Pin(req)).unwrap())
        .unwrap();
    assert!(matches!(
        read_pin_reply(&mut s),
        PinDonorMessage::Granted(_)
    ));
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (1, 3));
    drop(s); // no release
    assert!(
        until(Duration::from_secs(2), || bank.pins_outstanding() == 0),
        "pins outlived their TCP connection"
    );
    // The connection's thread releases the bank's pins, then its own count:
    // the two reach 0 one after the other, not at once (seen in CI-like runs).
    assert!(
        until(Duration::from_secs(2), || svc.active_pins() == 0),
        "the service still counts {} pins",
        svc.active_pins()
    );
    assert_eq!(svc.stats().dropped_on_disconnect, 1);
    svc.shutdown(Duration::ZERO);
}

#[test]
fn a_tcp_pin_past_its_hold_bound_reports_expired() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let config = PinServiceConfig {
        max_hold: Duration::from_millis(40),
        ..PinServiceConfig::default()
    };
    let svc = tcp_service(&bank, config);
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(key());
    let mut pin = donor.pin_remote(&hint(&bank, &a, svc.endpoint())).unwrap();
    assert!(
        until(Duration::from_secs(2), || bank.pins_outstanding() == 0),
        "the donor drops the pin at its bound without being asked"
    );
    let e = pin.release_now().unwrap_err();
    assert!(
        matches!(
            e,
            PinError::Expired {
                max_hold_ms: 40,
                ..
            }
        ),
        "{e:?}"
    );
    drop(pin);
    assert_eq!(svc.shutdown(Duration::ZERO).expired, 1);
}

#[test]
fn tcp_cannot_be_bound_without_a_key() {
    let bank = bank(2, "pin-sec");
    let e = PinService::bind(bank, "tcp:127.0.0.1:0", PinServiceConfig::default()).unwrap_err();
    assert!(matches!(e, PinServiceError::AuthRequired { .. }), "{e:?}");
}

#[test]
fn the_unix_socket_is_created_0600_and_a_plain_path_is_a_unix_endpoint() {
    let _g = lock();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.sock");
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 1);
    // A plain absolute path is read as `unix:`.
    let plain = path.display().to_string();
    let svc = PinService::bind(bank.clone(), &plain, PinServiceConfig::default()).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), &plain).unwrap();
    let pin = donor.pin_remote(&hint(&bank, &a, &plain)).unwrap();
    assert_eq!(bank.pins_outstanding(), 1);
    drop(pin);
    assert_eq!(svc.shutdown(Duration::ZERO).granted, 1);
    assert!(!path.exists());
}

#[test]
fn endpoints_and_keys_refuse_bad_input_naming_the_field() {
    for (ep, want) in [
        ("tcp:10.0.0.1", "tcp"),
        ("tcp::7301", "tcp"),
        ("tcp:h:99999", "tcp"),
        ("pid:42", "scheme"),
        ("relative/d.sock", "scheme"),
        ("unix:", "path"),
        ("unix:run/d.sock", "relative"),
        ("unix:./d.sock", "relative"),
        ("unix:/run/d\0.sock", "nul"),
        ("/run/\0", "nul"),
    ] {
        let got = match PinEndpoint::parse(ep) {
            Err(PinEndpointError::TcpAddress { .. }) => "tcp",
            Err(PinEndpointError::Scheme { .. }) => "scheme",
            Err(PinEndpointError::PathLength { .. }) => "path",
            Err(PinEndpointError::RelativePath { .. }) => "relative",
            Err(PinEndpointError::NulInPath { .. }) => "nul",
            Ok(p) => panic!("{ep} parsed as {p:?}"),
        };
        assert_eq!(got, want, "{ep}");
    }
    assert!(matches!(
        PinAuthKey::from_bytes(vec![1; MIN_KEY_BYTES - 1]),
        Err(PinAuthError::KeyLength { len: 31 })
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pin.key");
    std::fs::write(&file, [KEY, b"\n"].concat()).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(matches!(
        PinAuthKey::from_file(&file),
        Err(PinAuthError::KeyFileMode { mode: 0o644, .. })
    ));
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let k = PinAuthKey::from_file(&file).unwrap();
    assert_eq!(
        format!("{k:?}"),
        format!("PinAuthKey({} bytes)", KEY.len()),
        "newline trimmed, key not printed"
    );
    assert!(matches!(
        PinAuthKey::from_file(&dir.path().join("absent")),
        Err(PinAuthError::KeyFile { .. })
    ));
}

#[test]
fn an_over_limit_tcp_connection_is_closed_before_any_byte() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let config = PinServiceConfig {
        max_connections: 1,
        ..PinServiceConfig::default()
    };
    let svc = tcp_service(&bank, config);
    let (mut held, status) = raw_handshake(svc.endpoint(), KEY);
    assert_eq!(status, 1);
    // A frame in progress: the connection is busy, so it is not closed to
    // admit a newcomer (an idle one would be).
    held.write_all(&[0u8]).unwrap();
    assert!(until(Duration::from_secs(2), || {
        svc.active_connections() == 1 && svc.idle_connections() == 0
    }));
    // Over the limit: no refusal frame to a peer that has not
    // authenticated, the connection is just closed.
    let mut s = TcpStream::connect(tcp_addr(svc.endpoint())).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "{got:?}");
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(key());
    let e = donor
        .pin_remote(&hint(&bank, &a, svc.endpoint()))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PinError::Auth(PinAuthError::Io {
                op: "challenge",
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (0, 0));
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!((stats.connections_refused, stats.granted), (2, 0));
}

/// At the connection limit, an over-limit TCP newcomer closes a target's
/// idle kept connection only after it proved the key: one with a wrong key
/// leaves the kept connection serving, one with the key takes its place.
#[test]
fn at_the_limit_only_a_peer_with_the_key_closes_an_idle_kept_connection() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let config = PinServiceConfig {
        max_connections: 1,
        ..PinServiceConfig::default()
    };
    let svc = tcp_service(&bank, config);
    let h = hint(&bank, &a, svc.endpoint());
    let open = |k: PinAuthKey| {
        RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
            .unwrap()
            .with_auth_key(k)
    };
    let kept = open(key());
    kept.pin_remote(&h).unwrap().release_now().unwrap();
    assert!(until(Duration::from_secs(2), || svc.idle_connections() == 1));
    // A wrong key over the limit: admitted to the exchange, refused, and
    // the idle connection is left alone.
    let wrong = PinAuthKey::from_bytes(b"ffffffffffffffffffffffffffffffff".to_vec()).unwrap();
    let e = open(wrong).pin_remote(&h).unwrap_err();
    assert!(matches!(e, PinError::Auth(PinAuthError::Refused)), "{e:?}");
    assert!(until(Duration::from_secs(2), || svc.stats().auth_refused == 1));
    assert_eq!(svc.stats().idle_closed, 0);
    // The kept connection still carries the next pin (no new connection).
    kept.pin_remote(&h).unwrap().release_now().unwrap();
    assert_eq!(svc.stats().connections, 2);
    assert!(until(Duration::from_secs(2), || svc.idle_connections() == 1));
    // The right key over the limit closes the idle connection and pins.
    let other = open(key());
    let mut p = other.pin_remote(&h).unwrap();
    assert_eq!(bank.pins_outstanding(), 2);
    p.release_now().unwrap();
    drop(p);
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!(
        (
            stats.idle_closed,
            stats.auth_refused,
            stats.granted,
            stats.connections_refused
        ),
        (1, 1, 3, 0)
    );
    assert_eq!(bank.pins_outstanding(), 0);
}

/// Two over-limit TCP newcomers admitted while one connection is idle:
/// the first to prove the key closes it, the second, authenticated too,
/// finds none idle and gets a typed `too_many_pins` refusal.
#[test]
fn two_provisional_newcomers_share_one_idle_connection_and_the_second_is_refused_typed() {
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 2);
    let config = PinServiceConfig {
        max_connections: 1,
        ..PinServiceConfig::default()
    };
    let svc = tcp_service(&bank, config);
    let kept = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(key());
    kept.pin_remote(&hint(&bank, &a, svc.endpoint()))
        .unwrap()
        .release_now()
        .unwrap();
    assert!(until(Duration::from_secs(2), || svc.idle_connections() == 1));
    // Both get the challenge: each was admitted while the kept one was idle.
    let (mut first, hello1) = raw_challenge(svc.endpoint());
    let (mut second, hello2) = raw_challenge(svc.endpoint());
    assert_eq!(raw_prove(&mut first, &hello1, KEY), 1);
    assert!(until(Duration::from_secs(2), || svc.stats().idle_closed == 1));
    assert_eq!(raw_prove(&mut second, &hello2, KEY), 1);
    match read_pin_reply(&mut second) {
        PinDonorMessage::Refused(r) => {
            assert_eq!(r.reason, PinRefusalReason::TooManyPins);
            assert!(r.detail.contains("no idle connection"), "{}", r.detail);
        }
        other => panic!("{other:?}"),
    }
    drop((first, second));
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!(
        (stats.idle_closed, stats.connections_refused, stats.granted),
        (1, 1, 1)
    );
}

#[test]
fn a_service_bound_to_every_interface_pins_over_loopback_and_shuts_down() {
    let _g = lock();
    let bank = bank(2, "pin-sec");
    let a = store(&bank, 1);
    let svc = PinService::bind_authenticated(
        bank.clone(),
        "tcp:0.0.0.0:0",
        PinServiceConfig::default(),
        key(),
    )
    .unwrap();
    let port = svc.endpoint().rsplit_once(':').unwrap().1.to_owned();
    assert_eq!(svc.endpoint(), format!("tcp:0.0.0.0:{port}"));
    let ep = format!("tcp:127.0.0.1:{port}");
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), &ep)
        .unwrap()
        .with_auth_key(key());
    drop(donor.pin_remote(&hint(&bank, &a, &ep)).unwrap());
    let t0 = Instant::now();
    // Shutdown wakes its accept thread through loopback, not 0.0.0.0.
    let stats = svc.shutdown(Duration::ZERO);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!((stats.granted, stats.released), (1, 1));
}

#[test]
fn a_fetch_over_a_tcp_pin_completes_with_the_donor_bytes() {
    use kv_bank::BankMemory;
    use kv_transfer::DeliveryControl;
    let _g = lock();
    let bank = bank(4, "pin-sec");
    let a = store(&bank, 3);
    let svc = tcp_service(&bank, PinServiceConfig::default());
    let donor = RemoteDonor::open_host_shm(bank.manifest().clone(), svc.endpoint())
        .unwrap()
        .with_auth_key(key());
    let rbb = layout().rank_block_bytes();
    let (regions, exec) = host_executor(4);
    let env = HintEnvelope::fetch_gpu("req-tcp", "p0", &hint(&bank, &a, svc.endpoint())).unwrap();
    let out = exec.execute(&env, &donor, &DeliveryControl::new()).unwrap();
    assert_eq!(out.fetched.len(), a.len());
    for (k, &row) in out.target_blocks.iter().enumerate() {
        for rank in 0..TP {
            let mut buf = vec![0u8; rbb];
            regions[rank as usize]
                .read_bytes(row as usize * rbb, &mut buf)
                .unwrap();
            assert!(buf
                .iter()
                .enumerate()
                .all(|(i, &x)| x == pattern(a[k].0, rank, i)));
        }
    }
    assert_eq!((svc.active_pins(), bank.pins_outstanding()), (0, 0));
    let stats = svc.shutdown(Duration::ZERO);
    assert_eq!((stats.granted, stats.released), (1, 1));
}
