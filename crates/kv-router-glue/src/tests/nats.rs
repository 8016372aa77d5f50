//! Against a real `nats-server` on a loopback port (skipped with a printed
//! reason when the binary is missing, failed under `CI=true`).

use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::*;

use crate::nats_server::NatsServer;
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
    let subject = Subject::new("qa", "auth", "events").unwrap();
    let mut sub = plane.subscribe(&subject).await.unwrap();
    plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .unwrap();
    plane.publish(&subject, b"x".to_vec()).await.unwrap();
    assert_eq!(
        sub.next_timeout(Duration::from_secs(5))
            .await
            .unwrap()
            .payload,
        b"x"
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

#[tokio::test]
async fn tls_with_the_servers_ca_connects_and_without_it_is_refused() {
    if NatsServer::start_or_skip("tls_with_the_servers_ca_connects_and_without_it_is_refused")
        .is_none()
    {
        return;
    }
    // A throwaway CA and a server certificate for 127.0.0.1, made with openssl.
    let dir = std::env::temp_dir().join(format!("kv-nats-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = |n: &str| dir.join(n).to_string_lossy().into_owned();
    let openssl = |args: &[&str]| {
        std::process::Command::new("openssl")
            .args(args)
            .output()
            .map(|o| o.status.success())
    };
    let made = openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kv-test-ca",
        "-keyout",
        &f("ca.key"),
        "-out",
        &f("ca.pem"),
    ])
    .and_then(|ok| {
        if ok {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=127.0.0.1",
                "-keyout",
                &f("server.key"),
                "-out",
                &f("server.csr"),
            ])
        } else {
            Ok(false)
        }
    })
    .and_then(|ok| {
        std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
        if ok {
            openssl(&[
                "x509",
                "-req",
                "-in",
                &f("server.csr"),
                "-CA",
                &f("ca.pem"),
                "-CAkey",
                &f("ca.key"),
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &f("ext.cnf"),
                "-out",
                &f("server.pem"),
            ])
        } else {
            Ok(false)
        }
    });
    if !matches!(made, Ok(true)) {
        let _ = std::fs::remove_dir_all(&dir);
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true and openssl could not make test certificates: {made:?}");
        }
        println!("SKIP tls test: openssl unavailable ({made:?})");
        return;
    }
    let server = NatsServer::start_with_args(&[
        "--tls",
        "--tlscert",
        &f("server.pem"),
        "--tlskey",
        &f("server.key"),
    ])
    .unwrap();
    let trusted = NatsTls {
        require: true,
        root_certificates: Some(dir.join("ca.pem")),
        client_certificate: None,
    };
    round_trip(
        &connect_with(&server, NatsAuth::None, trusted)
            .await
            .unwrap(),
    )
    .await;
    let untrusted = NatsTls {
        require: true,
        ..NatsTls::default()
    };
    assert!(
        matches!(
            connect_with(&server, NatsAuth::None, untrusted).await,
            Err(PlaneError::Connect { .. })
        ),
        "a server certificate signed by an unknown CA must be refused"
    );
    let missing = NatsTls {
        root_certificates: Some(dir.join("nope.pem")),
        ..NatsTls::default()
    };
    match connect_with(&server, NatsAuth::None, missing).await {
        Err(PlaneError::Connect { reason, .. }) => {
            assert!(reason.contains("tls.root_certificates"), "{reason}")
        }
        other => panic!(
            "a missing CA file must be refused naming the field, got {:?}",
            other.err()
        ),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
