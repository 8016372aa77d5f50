//! Against a real `nats-server` on a loopback port (skipped with a printed
//! reason when the binary is missing, failed under `CI=true`).

use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::*;

use crate::qualify::nats_server::NatsServer;
use crate::qualify::test_pki::TestPki;
use crate::*;

async fn connect(server: &NatsServer, name: &str) -> NatsPlane {
    NatsPlane::connect(
        &server.url(),
        NatsOptions {
            name: name.into(),
            max_reconnect_delay: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(2),
            ..NatsOptions::default()
        },
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn nats_barrier_is_not_passed_by_the_servers_no_responders_answer() {
    const TEST: &str = "nats_barrier_is_not_passed_by_the_servers_no_responders_answer";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let publisher = connect(&server, "publisher").await;
    let subject = Subject::new("qa", "barrier", "events").unwrap();
    // No subscriber: the server answers each probe itself with "no
    // responders", which once counted as one ready subscriber.
    match publisher
        .wait_for_subscribers(&subject, 1, Duration::from_millis(400))
        .await
    {
        Err(PlaneError::NotReady { ready, wanted, .. }) => assert_eq!((ready, wanted), (0, 1)),
        other => panic!("a barrier with no subscriber must not pass: {other:?}"),
    }
    // One real subscriber, registered on return: the barrier counts it, and
    // an event published right after reaches it.
    let subscriber = connect(&server, "subscriber").await;
    let mut sub = subscriber.subscribe(&subject).await.unwrap();
    assert_eq!(
        publisher
            .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
            .await
            .unwrap(),
        1
    );
    publisher.publish(&subject, b"one".to_vec()).await.unwrap();
    let m = sub.next_timeout(Duration::from_secs(5)).await.unwrap();
    assert_eq!(m.payload, b"one");
    publisher.flush().await.unwrap();
}

#[tokio::test]
async fn nats_one_shot_event_reaches_every_subscriber_after_the_barrier() {
    let Some(server) =
        NatsServer::start_or_skip("nats_one_shot_event_reaches_every_subscriber_after_the_barrier")
    else {
        return;
    };
    let publisher = connect(&server, "pub").await;
    let (c1, c2) = (
        connect(&server, "sub1").await,
        connect(&server, "sub2").await,
    );
    let subject = Subject::new("qa", "router", "manifest").unwrap();
    let other_ns = Subject::new("qb", "router", "manifest").unwrap();
    // Subscribers come up concurrently with the publisher's barrier.
    let barrier = tokio::spawn({
        let p = publisher.clone();
        let s = subject.clone();
        async move { p.wait_for_subscribers(&s, 2, Duration::from_secs(5)).await }
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut s1 = c1.subscribe(&subject).await.unwrap();
    let mut s2 = c2.subscribe(&subject).await.unwrap();
    let mut isolated = c2.subscribe(&other_ns).await.unwrap();
    assert_eq!(barrier.await.unwrap().unwrap(), 2);
    publisher
        .publish(&subject, b"one-shot".to_vec())
        .await
        .unwrap();
    for s in [&mut s1, &mut s2] {
        let m = s
            .next_timeout(Duration::from_secs(5))
            .await
            .expect("one-shot event lost");
        assert_eq!(
            (m.subject.as_str(), m.payload.as_slice()),
            ("kv.qa.router.manifest", &b"one-shot"[..])
        );
    }
    assert_eq!(isolated.next_timeout(Duration::from_millis(50)).await, None);
    // With one subscriber gone, a barrier for two fails and says how many answered.
    drop(s2);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let e = publisher
        .wait_for_subscribers(&subject, 2, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            PlaneError::NotReady {
                ready: 1,
                wanted: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn nats_kv_event_gap_is_repaired_by_resync_across_clients() {
    let Some(server) =
        NatsServer::start_or_skip("nats_kv_event_gap_is_repaired_by_resync_across_clients")
    else {
        return;
    };
    let pub_nats = connect(&server, "decode").await;
    let pub_plane: Arc<dyn EventPlane> = Arc::new(pub_nats.clone());
    let sub_plane: Arc<dyn EventPlane> = Arc::new(connect(&server, "router").await);
    let subject = Subject::new("qa", "decode", "kv_events").unwrap();
    let header = PublisherHeader {
        publisher: EngineId::fresh(),
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(1),
        tp_size: 1,
    };
    let publisher = Arc::new(KvEventPublisher::new(
        pub_plane.clone(),
        subject.clone(),
        header,
        64,
    ));
    let server_task = publisher.serve_resync().await.unwrap();
    let cleared = KvEventData::Cleared;
    // Event 1 is published before the router subscribes: the router sees 2
    // first, detects the gap and gets 1 replayed.
    publisher
        .publish(StorageTier::RetainedGpuDirect, cleared.clone())
        .await
        .unwrap();
    // A flush only empties the client's socket buffer; the server may still
    // route event 1 after the router's SUB arrives on the other connection
    // (seen under load on 2 cores). Give the server time to route it to no one,
    // so that the gap this test is about really happens.
    pub_nats.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut rx = KvEventReceiver::subscribe(sub_plane, &subject, Duration::from_secs(2))
        .await
        .unwrap();
    pub_plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .unwrap();
    publisher
        .publish(StorageTier::RetainedGpuDirect, cleared.clone())
        .await
        .unwrap();
    publisher
        .publish(StorageTier::RetainedGpuDirect, cleared)
        .await
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        match rx
            .next_timeout(Duration::from_secs(5))
            .await
            .expect("event missing")
        {
            KvStreamItem::Event(e) => got.push(e.event_id),
            lost => panic!("unexpected {lost:?}"),
        }
    }
    assert_eq!(got, [1, 2, 3]);
    assert_eq!(rx.stats().gaps, 1);
    server_task.abort();
}

#[tokio::test]
async fn nats_client_reconnects_after_server_restart() {
    let Some(mut server) = NatsServer::start_or_skip("nats_client_reconnects_after_server_restart")
    else {
        return;
    };
    let publisher = connect(&server, "pub").await;
    let subscriber = connect(&server, "sub").await;
    let subject = Subject::new("qa", "router", "events").unwrap();
    let mut sub = subscriber.subscribe(&subject).await.unwrap();
    publisher
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .unwrap();
    publisher
        .publish(&subject, b"before".to_vec())
        .await
        .unwrap();
    assert_eq!(
        sub.next_timeout(Duration::from_secs(5))
            .await
            .unwrap()
            .payload,
        b"before"
    );

    server.restart().unwrap();
    // The barrier keeps probing until both clients are back and the
    // subscription was re-established on the new server.
    let n = publisher
        .wait_for_subscribers(&subject, 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert!(publisher.is_connected() && subscriber.is_connected());
    // Core NATS is at-most-once: a message can still be lost while a client
    // settles after the restart (seen about once in ten runs on a loaded
    // machine, although the barrier had passed); the KV event ids detect
    // such a loss and resync. What must hold is that delivery resumes, so
    // publish until one arrives, within 5 s.
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut sent = 0u32;
    let delivered = loop {
        sent += 1;
        publisher
            .publish(&subject, format!("after-{sent}").into_bytes())
            .await
            .unwrap();
        if let Some(m) = sub.next_timeout(Duration::from_millis(250)).await {
            break Some(m);
        }
        if tokio::time::Instant::now() >= until {
            break None;
        }
    };
    let m = delivered.expect("no delivery within 5 s after the restart");
    assert!(m.payload.starts_with(b"after-"), "{:?}", m.payload);
}

async fn connect_with(
    server: &NatsServer,
    auth: NatsAuth,
    tls: NatsTls,
) -> Result<NatsPlane, PlaneError> {
    NatsPlane::connect(
        &server.url(),
        NatsOptions {
            name: "auth-test".into(),
            connect_timeout: Duration::from_secs(2),
            auth,
            tls,
            ..NatsOptions::default()
        },
    )
    .await
}

/// Publishes one message through `plane` to itself and checks it arrives.
async fn round_trip(plane: &NatsPlane) {
    deliver(plane, plane, b"x").await;
}

/// Publishes `payload` through `publisher` and checks that `subscriber`
/// receives exactly it on the expected subject.
async fn deliver(publisher: &NatsPlane, subscriber: &NatsPlane, payload: &[u8]) {
    let subject = Subject::new("qa", "auth", "events").unwrap();
    let mut sub = subscriber.subscribe(&subject).await.unwrap();
    publisher
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .unwrap();
    publisher.publish(&subject, payload.to_vec()).await.unwrap();
    let m = sub
        .next_timeout(Duration::from_secs(5))
        .await
        .expect("event not delivered");
    assert_eq!(
        (m.subject.as_str(), m.payload.as_slice()),
        ("kv.qa.auth.events", payload)
    );
}

#[tokio::test]
async fn credentials_are_sent_and_wrong_ones_are_refused() {
    if NatsServer::start_or_skip("credentials_are_sent_and_wrong_ones_are_refused").is_none() {
        return;
    }
    let server = NatsServer::start_with_args(&["--user", "kv", "--pass", "s3cret"]).unwrap();
    let good = NatsAuth::UserPassword {
        user: "kv".into(),
        password: "s3cret".into(),
    };
    round_trip(
        &connect_with(&server, good, NatsTls::default())
            .await
            .unwrap(),
    )
    .await;
    for bad in [
        NatsAuth::None,
        NatsAuth::UserPassword {
            user: "kv".into(),
            password: "wrong".into(),
        },
        NatsAuth::Token("s3cret".into()),
    ] {
        let shown = format!("{bad:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("wrong"),
            "secret in {shown}"
        );
        match connect_with(&server, bad, NatsTls::default()).await {
            Err(PlaneError::Connect { url, reason }) => {
                assert_eq!(url, server.url());
                assert!(!reason.is_empty());
            }
            Ok(_) => panic!("{shown} was accepted by a server that requires kv/s3cret"),
            Err(other) => panic!("{shown}: unexpected {other}"),
        }
    }
    let token_server = NatsServer::start_with_args(&["--auth", "t0ken"]).unwrap();
    round_trip(
        &connect_with(
            &token_server,
            NatsAuth::Token("t0ken".into()),
            NatsTls::default(),
        )
        .await
        .unwrap(),
    )
    .await;
}

/// Asserts that connecting with `tls` is refused with [`PlaneError::Connect`]
/// and returns the reason.
async fn assert_refused(server: &NatsServer, tls: NatsTls, why: &str) -> String {
    match connect_with(server, NatsAuth::None, tls).await {
        Err(PlaneError::Connect { url, reason }) => {
            assert_eq!(url, server.url());
            assert!(!reason.is_empty());
            reason
        }
        Ok(_) => panic!("{why}: the connection was accepted"),
        Err(other) => panic!("{why}: unexpected {other}"),
    }
}

/// The refusal came from the server's TLS layer rejecting the client
/// certificate (rustls reports e.g. `received fatal alert: BadCertificate`;
/// newer servers may send `CertificateRequired` or `UnknownCA`), not from
/// some other failure such as the client distrusting the server.
fn assert_tls_alert(reason: &str) {
    assert!(reason.contains("received fatal alert"), "{reason}");
}

#[tokio::test]
async fn tls_with_the_servers_ca_connects_and_without_it_is_refused() {
    const TEST: &str = "tls_with_the_servers_ca_connects_and_without_it_is_refused";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let Some(pki) = TestPki::new_or_skip(TEST) else {
        return;
    };
    let server = pki.start_server(&[]);
    round_trip(
        &connect_with(&server, NatsAuth::None, pki.client_tls(None))
            .await
            .unwrap(),
    )
    .await;
    let untrusted = NatsTls {
        require: true,
        ..NatsTls::default()
    };
    assert_refused(
        &server,
        untrusted,
        "a server certificate signed by an unknown CA must be refused",
    )
    .await;
    let missing = NatsTls {
        root_certificates: Some(pki.path("nope.pem")),
        ..NatsTls::default()
    };
    let reason = assert_refused(&server, missing, "a missing CA file must be refused").await;
    assert!(reason.contains("tls.root_certificates"), "{reason}");
    assert!(reason.contains("No such file"), "{reason}");
}

#[tokio::test]
async fn a_configured_ca_file_refuses_a_server_without_tls() {
    const TEST: &str = "a_configured_ca_file_refuses_a_server_without_tls";
    let Some(plain) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let Some(pki) = TestPki::new_or_skip(TEST) else {
        return;
    };
    // `require: false`, but a CA file is set: connecting over plain TCP
    // would silently ignore it, so the connection must be refused.
    let tls = NatsTls {
        require: false,
        ..pki.client_tls(None)
    };
    let reason = assert_refused(&plain, tls, "a CA file must imply TLS").await;
    assert!(reason.contains("TLS in force"), "{reason}");
    // Without any TLS material the same server is fine.
    round_trip(
        &connect_with(&plain, NatsAuth::None, NatsTls::default())
            .await
            .unwrap(),
    )
    .await;
}

#[tokio::test]
async fn mutual_tls_accepts_a_client_certificate_of_the_ca_and_refuses_others() {
    const TEST: &str = "mutual_tls_accepts_a_client_certificate_of_the_ca_and_refuses_others";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let Some(pki) = TestPki::new_or_skip(TEST) else {
        return;
    };
    let router = pki.issue_client("ca", "router");
    let decode = pki.issue_client("ca", "decode");
    // A client certificate from a CA the server does not know; the client
    // still trusts the server's CA, so only its own certificate can fail.
    pki.make_ca("rogue-ca").unwrap();
    let rogue = pki.issue_client("rogue-ca", "rogue");
    let ca = pki.arg("ca.pem");
    let server = pki.start_server(&["--tlsverify", "--tlscacert", &ca]);

    // Two mutually authenticated connections: an event goes end to end.
    let publisher = connect_with(&server, NatsAuth::None, pki.client_tls(Some(decode)))
        .await
        .unwrap();
    let subscriber = connect_with(&server, NatsAuth::None, pki.client_tls(Some(router)))
        .await
        .unwrap();
    deliver(&publisher, &subscriber, b"mtls-event-1").await;
    assert!(publisher.is_connected() && subscriber.is_connected());

    let reason = assert_refused(
        &server,
        pki.client_tls(None),
        "a client without a certificate must be refused by a verifying server",
    )
    .await;
    assert_tls_alert(&reason);
    println!("{TEST}: no client certificate refused: {reason}");
    let reason = assert_refused(
        &server,
        pki.client_tls(Some(rogue)),
        "a client certificate signed by an unknown CA must be refused",
    )
    .await;
    assert_tls_alert(&reason);
    println!("{TEST}: unknown-CA client certificate refused: {reason}");
    // A missing key file is named before any handshake.
    let no_key = (pki.path("router.pem"), pki.path("nope.key"));
    let reason = assert_refused(
        &server,
        pki.client_tls(Some(no_key)),
        "a missing client key file must be refused",
    )
    .await;
    assert!(reason.contains("tls.client_key"), "{reason}");
}

/// A password embedded in the URL (`nats://user:password@host`) is not
/// repeated in the connection error, which the router binary prints and
/// logs: `kv-reuse-router --nats-url nats://router:s3cr3t@127.0.0.1:1`
/// printed "cannot connect to NATS at nats://router:s3cr3t@127.0.0.1:1".
#[tokio::test]
async fn a_password_in_the_url_is_not_printed_in_the_connect_error() {
    // Port 1: nothing listens, the connection is refused at once.
    let err = NatsPlane::connect(
        "nats://router:s3cr3t@127.0.0.1:1",
        NatsOptions {
            connect_timeout: Duration::from_secs(2),
            ..NatsOptions::default()
        },
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(!text.contains("s3cr3t"), "{text}");
    assert!(text.contains("nats://router:***@127.0.0.1:1"), "{text}");
    assert!(!format!("{err:?}").contains("s3cr3t"), "{err:?}");
}

/// The slow-consumer tests, one at a time: each reads the process-wide
/// drop count.
static SLOW_CONSUMER_TESTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A subscriber that does not read holds exactly [`FORWARD_CAPACITY`]
/// messages, the first ones in publish order; every later one is dropped
/// and counted by `nats_slow_consumer_drops` (and `/metrics`' total).
/// Before, an unbounded channel held all 100,000; then, with async-nats'
/// buffer overflowing, only its drop reports were counted (one
/// `Event::SlowConsumer` per drop through a 128-slot queue written with
/// `try_send`: 33,439 dropped, 13,310 counted).
#[tokio::test]
async fn nats_a_subscriber_that_falls_behind_holds_the_forward_capacity_and_every_drop_is_counted()
{
    const TEST: &str = "nats_a_subscriber_that_falls_behind_holds_the_forward_capacity";
    let _one_at_a_time = SLOW_CONSUMER_TESTS.lock().await;
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    const SENT: usize = 100_000;
    let publisher = connect(&server, "publisher").await;
    let subscriber = connect(&server, "slow").await;
    let subject = Subject::new("qa", "slow", "events").unwrap();
    let mut sub = subscriber.subscribe(&subject).await.unwrap();
    let drops_before = nats_slow_consumer_drops();
    // Nobody reads while all of it is published and taken in.
    for i in 0..SENT as u32 {
        publisher
            .publish(&subject, i.to_le_bytes().to_vec())
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();
    let overflow = (SENT - FORWARD_CAPACITY) as u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while nats_slow_consumer_drops() - drops_before < overflow {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {overflow} drops counted",
            nats_slow_consumer_drops() - drops_before
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut got = Vec::new();
    while let Some(m) = sub.next_timeout(Duration::from_millis(500)).await {
        got.push(u32::from_le_bytes(m.payload[..4].try_into().unwrap()));
    }
    assert_eq!(nats_slow_consumer_drops() - drops_before, overflow);
    assert_eq!(
        got.len(),
        FORWARD_CAPACITY,
        "held for a subscriber that did not read"
    );
    assert!(
        got.iter().enumerate().all(|(i, &v)| v == i as u32),
        "the first messages are held in publish order, the newest dropped"
    );
    // The subscription still works after the overflow.
    publisher
        .publish(&subject, u32::MAX.to_le_bytes().to_vec())
        .await
        .unwrap();
    let m = sub.next_timeout(Duration::from_secs(5)).await.unwrap();
    assert_eq!(m.payload, u32::MAX.to_le_bytes());
}

/// A subscription whose holder is FORWARD_CAPACITY messages behind still
/// answers readiness probes. When the forwarding task waited in `send`, the
/// probe stayed unread behind the backlog and `wait_for_subscribers`
/// reported a registered subscription as not ready (`NotReady`, 0 of 1).
#[tokio::test]
async fn nats_a_subscription_behind_by_more_than_the_forward_capacity_still_answers_probes() {
    const TEST: &str =
        "nats_a_subscription_behind_by_more_than_the_forward_capacity_still_answers_probes";
    // Its 10 drops count in the process-wide total the test above checks.
    let _one_at_a_time = SLOW_CONSUMER_TESTS.lock().await;
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let publisher = connect(&server, "publisher").await;
    let subscriber = connect(&server, "behind").await;
    let subject = Subject::new("qa", "behind", "events").unwrap();
    let _sub = subscriber.subscribe(&subject).await.unwrap();
    for i in 0..(FORWARD_CAPACITY as u32 + 10) {
        publisher
            .publish(&subject, i.to_le_bytes().to_vec())
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();
    let ready = publisher
        .wait_for_subscribers(&subject, 1, Duration::from_secs(3))
        .await;
    assert_eq!(ready.as_ref().ok(), Some(&1), "{ready:?}");
}

/// `server`'s URL with `userinfo@` before its host.
fn url_with(server: &NatsServer, userinfo: &str) -> String {
    server
        .url()
        .replacen("nats://", &format!("nats://{userinfo}@"), 1)
}

fn url_options() -> NatsOptions {
    NatsOptions {
        name: "url-auth-test".into(),
        connect_timeout: Duration::from_secs(2),
        ..NatsOptions::default()
    }
}

/// Credentials written in the URL log in, as with the nats CLI, nats.go or
/// nats.py: `user:password@` (percent-decoded: `%40` is the password's
/// `@`) and `token@`. async-nats 0.51 ignores the URL's user info, so
/// both were refused with "authorization violation" before
/// `NatsOptions::connect_options` took them from it.
#[tokio::test]
async fn credentials_in_the_url_log_in_to_an_authenticating_server() {
    const TEST: &str = "credentials_in_the_url_log_in_to_an_authenticating_server";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let server = NatsServer::start_with_args(&["--user", "kv", "--pass", "s3@cret"]).unwrap();
    let url = url_with(&server, "kv:s3%40cret");
    let plane = NatsPlane::connect(&url, url_options())
        .await
        .unwrap_or_else(|e| panic!("user and password in the URL: {e}"));
    round_trip(&plane).await;
    // The same URL, comma-listed twice: one set of credentials for both.
    let listed = format!("{url},{url}");
    round_trip(&NatsPlane::connect(&listed, url_options()).await.unwrap()).await;
    // A wrong password in the URL is sent, and refused.
    let wrong = url_with(&server, "kv:wrong");
    match NatsPlane::connect(&wrong, url_options()).await {
        Err(PlaneError::Connect { url, reason }) => {
            assert_eq!(url, url_with(&server, "kv:***"));
            assert!(reason.contains("authorization"), "{reason}");
        }
        other => panic!("a wrong password in the URL: {other:?}"),
    }

    let token_server = NatsServer::start_with_args(&["--auth", "t0ken"]).unwrap();
    let plane = NatsPlane::connect(&url_with(&token_server, "t0ken"), url_options())
        .await
        .unwrap_or_else(|e| panic!("a token in the URL: {e}"));
    round_trip(&plane).await;
}

/// The router service's advise client takes the URL's credentials too
/// (through `NatsOptions::connect_options`, as the wheel's `RouterClient`).
#[test]
fn the_advise_client_logs_in_with_credentials_in_the_url() {
    const TEST: &str = "the_advise_client_logs_in_with_credentials_in_the_url";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let server = NatsServer::start_with_args(&["--user", "kv", "--pass", "s3cret"]).unwrap();
    let token_server = NatsServer::start_with_args(&["--auth", "t0ken"]).unwrap();
    for url in [
        url_with(&server, "kv:s3cret"),
        url_with(&token_server, "t0ken"),
    ] {
        let options = url_options().connect_options(&url).unwrap();
        let client = crate::service::AdviseClient::connect(
            &url,
            options,
            crate::service::ADVISE_SUBJECT,
            Duration::from_secs(5),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", redact_url(&url)));
        assert_eq!(client.connection_count(), 1);
    }
}

/// Credentials both in the URL and in `auth`, and servers of one list with
/// different credentials, are refused naming `nats_url`, before any
/// connection (nothing listens on port 1), with no secret in the message.
#[tokio::test]
async fn mixed_or_differing_credentials_in_the_url_are_refused_without_the_secret() {
    let refused = |url: &'static str, auth: NatsAuth| async move {
        let options = NatsOptions {
            auth,
            ..url_options()
        };
        match NatsPlane::connect(url, options).await {
            Err(e @ PlaneError::Connect { .. }) => {
                let shown = format!("{e} / {e:?}");
                for secret in ["s3cret", "0ther", "t0ken"] {
                    assert!(!shown.contains(secret), "{secret} in {shown}");
                }
                e.to_string()
            }
            other => panic!("{url}: {other:?}"),
        }
    };
    let token = || NatsAuth::Token("t0ken".into());
    let text = refused("nats://kv:s3cret@127.0.0.1:1", token()).await;
    assert!(
        text.ends_with(
            "`nats_url` carries credentials (user and password) and credentials are given \
             separately too (token): give them in one place, not both"
        ),
        "{text}"
    );
    // Equal ones too: one place for credentials, as for any two kinds.
    let same = NatsAuth::UserPassword {
        user: "kv".into(),
        password: "s3cret".into(),
    };
    let text = refused("nats://kv:s3cret@127.0.0.1:1", same).await;
    assert!(text.contains("`nats_url` carries credentials"), "{text}");
    let text = refused(
        "nats://t0ken@127.0.0.1:1",
        NatsAuth::CredentialsFile("/x.creds".into()),
    )
    .await;
    assert!(
        text.contains("carries credentials (token) and credentials are given separately too (credentials file)"),
        "{text}"
    );
    let differing = "`nats_url` has servers with different credentials: give every server \
                     the same user info, or none";
    for url in [
        "nats://kv:s3cret@127.0.0.1:1,nats://kv:0ther@127.0.0.1:2",
        "nats://kv:s3cret@127.0.0.1:1,nats://127.0.0.1:2",
        "nats://t0ken@127.0.0.1:1,nats://kv:s3cret@127.0.0.1:2",
    ] {
        let text = refused(url, NatsAuth::None).await;
        assert!(text.ends_with(differing), "{text}");
    }
    let text = refused("nats://:s3cret@127.0.0.1:1", NatsAuth::None).await;
    assert!(
        text.ends_with("`nats_url` has a password but no user (`user:password@host`)"),
        "{text}"
    );
}

/// The user info of a NATS URL read as nats.go reads it (no server):
/// `u:@` is user `u` with an empty password (the url crate drops an empty
/// password, which made it the token `u`), `u@` a token, `u:p@` a user and
/// password, and only a literal `:` separates the two (`%3A` is part of a
/// name).
#[test]
fn url_user_info_is_read_as_nats_go_reads_it() {
    let read = |url: &str| {
        NatsOptions::default()
            .with_url_credentials(url)
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .auth
    };
    let user = |user: &str, password: &str| NatsAuth::UserPassword {
        user: user.into(),
        password: password.into(),
    };
    let cases = [
        ("nats://u:@host", user("u", "")),
        ("nats://u:@host:4222/", user("u", "")),
        ("u:@host", user("u", "")),
        ("nats://u:@n1, nats://u:@n2", user("u", "")),
        ("nats://u@host", NatsAuth::Token("u".into())),
        ("nats://u:p@host", user("u", "p")),
        ("nats://u%3Ap@host", NatsAuth::Token("u:p".into())),
        ("nats://u%3A@host", NatsAuth::Token("u:".into())),
        ("nats://u:p%3Aq@host", user("u", "p:q")),
        ("nats://u:p:q@host", user("u", "p:q")),
        ("nats://u%3Ax:@host", user("u:x", "")),
        ("nats://:@host", NatsAuth::None),
        ("nats://host", NatsAuth::None),
    ];
    for (url, want) in cases {
        assert_eq!(read(url), want, "{url}");
    }
    // An empty password is credentials of their own: not those of a token
    // `u` on another server of the list.
    let e = NatsOptions::default()
        .with_url_credentials("nats://u:@n1,nats://u@n2")
        .unwrap_err();
    assert_eq!(e.field, "nats_url");
    assert!(
        e.reason
            .starts_with("has servers with different credentials"),
        "{e}"
    );
}

/// nats-server accepts an empty password (`--user u --pass ''`), and
/// `nats://u:@host` logs in to it; `nats://u@host` (a token) is refused.
#[tokio::test]
async fn an_empty_password_in_the_url_logs_in() {
    const TEST: &str = "an_empty_password_in_the_url_logs_in";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let server = NatsServer::start_with_args(&["--user", "u", "--pass", ""]).unwrap();
    let plane = NatsPlane::connect(&url_with(&server, "u:"), url_options())
        .await
        .unwrap_or_else(|e| panic!("user and empty password in the URL: {e}"));
    round_trip(&plane).await;
    match NatsPlane::connect(&url_with(&server, "u"), url_options()).await {
        Err(PlaneError::Connect { reason, .. }) => {
            assert!(reason.contains("authorization"), "{reason}")
        }
        other => panic!("the token `u` was accepted: {other:?}"),
    }
}
