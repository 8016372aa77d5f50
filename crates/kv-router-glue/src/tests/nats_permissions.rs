//! docs/nats-permissions.conf against a real `nats-server` (skipped with a
//! printed reason when the binary is missing, failed under `CI=true`): each
//! role's user can publish and subscribe its own subjects; a client without
//! credentials or with a wrong password is refused at connect; a target that
//! publishes KV events or writes the directory, or subscribes to KV events,
//! and a donor that answers advise requests, get a permissions violation
//! from the server and reach nobody.

use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerError};
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::qualify::nats_server::NatsServer;

/// A worker announcement subject (`plane::registry`: `kv.<namespace>.workers.announce`).
const ANNOUNCE: &str = "kv.qa.workers.announce";
const EVENTS: &str = "kv.qa.decode.kv_events";
const RESYNC: &str = "kv.qa.decode.kv_events_resync";
const ADVISE: &str = "kv_reuse.advise";
/// One namespace's advise subject (docs/router-service.md, "Namespaces on
/// one NATS server").
const NAMESPACE_ADVISE: &str = "kv_reuse.prod.advise";
const DIRECTORY_KEY: &str = "$KV.kv_donors.decode-0";

/// The documented config with its environment references filled in (the
/// same substitution nats-server does, done here so that tests running in
/// parallel never set process environment).
fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let doc = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/nats-permissions.conf"
    );
    let text = std::fs::read_to_string(doc).unwrap();
    let text = text
        .replace("$NATS_STORE_DIR", &dir.join("js").display().to_string())
        .replace("$NATS_ROUTER_PASSWORD", "router-pw")
        .replace("$NATS_DONOR_PASSWORD", "donor-pw")
        .replace("$NATS_TARGET_PASSWORD", "target-pw");
    assert!(!text.contains("$NATS_"), "an unfilled variable is left");
    let path = dir.join("nats.conf");
    std::fs::write(&path, text).unwrap();
    path
}

/// A client of `user`, and the server errors it is sent (permission
/// violations arrive as `-ERR` lines, not as publish results).
async fn client(
    server: &NatsServer,
    user: &str,
    password: &str,
) -> Result<(async_nats::Client, mpsc::UnboundedReceiver<String>), async_nats::ConnectError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let c = ConnectOptions::with_user_and_password(user.into(), password.into())
        .connection_timeout(Duration::from_secs(2))
        // The documented config lets each role subscribe to its own inbox only.
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .event_callback(move |ev| {
            let tx = tx.clone();
            async move {
                if let Event::ServerError(e) = ev {
                    let text = match e {
                        ServerError::Other(s) => s,
                        other => format!("{other:?}"),
                    };
                    let _ = tx.send(text);
                }
            }
        })
        .connect(server.url())
        .await?;
    Ok((c, rx))
}

async fn next_error(rx: &mut mpsc::UnboundedReceiver<String>) -> Option<String> {
    tokio::time::timeout(Duration::from_secs(3), rx.recv())
        .await
        .ok()
        .flatten()
}

/// Waits until `sub` (another connection's subscription) is registered at
/// the server: a flush does not wait for the server to process a SUB, so
/// `publisher` sends probes until one arrives. Later probes are drained.
async fn ready(publisher: &async_nats::Client, sub: &mut async_nats::Subscriber, subject: &str) {
    for _ in 0..60 {
        publisher
            .publish(subject.to_owned(), "probe".into())
            .await
            .unwrap();
        publisher.flush().await.unwrap();
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(50), sub.next()).await {
            while let Ok(Some(_)) =
                tokio::time::timeout(Duration::from_millis(50), sub.next()).await
            {}
            return;
        }
    }
    panic!("subscription on {subject} never became ready");
}

/// The next message on `sub` within 3 s: (subject, payload).
async fn next_message(sub: &mut async_nats::Subscriber) -> (String, Vec<u8>) {
    let m = tokio::time::timeout(Duration::from_secs(3), sub.next())
        .await
        .expect("no message")
        .unwrap();
    (m.subject.to_string(), m.payload.to_vec())
}

fn start(test: &str) -> Option<(tempfile::TempDir, NatsServer)> {
    NatsServer::start_or_skip(test)?;
    let dir = tempfile::tempdir().unwrap();
    let conf = config(dir.path());
    let server = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    Some((dir, server))
}

#[tokio::test]
async fn each_role_reaches_its_own_subjects() {
    let Some((_dir, server)) = start("each_role_reaches_its_own_subjects") else {
        return;
    };
    let (router, mut router_err) = client(&server, "router", "router-pw").await.unwrap();
    let (donor, mut donor_err) = client(&server, "donor", "donor-pw").await.unwrap();
    let (target, mut target_err) = client(&server, "target", "target-pw").await.unwrap();

    // KV events: donor -> router.
    let mut events = router.subscribe(EVENTS).await.unwrap();
    // Advise: target requests, router answers.
    let mut advise = router.subscribe(ADVISE).await.unwrap();
    // Resync: router requests, donor answers.
    let mut resync = donor.subscribe(RESYNC).await.unwrap();
    router.flush().await.unwrap();
    donor.flush().await.unwrap();
    ready(&donor, &mut events, EVENTS).await;
    ready(&target, &mut advise, ADVISE).await;
    ready(&router, &mut resync, RESYNC).await;

    donor.publish(EVENTS, "stored".into()).await.unwrap();
    donor.publish(DIRECTORY_KEY, "entry".into()).await.unwrap();
    donor.flush().await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(3), events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (m.subject.as_str(), &m.payload[..]),
        (EVENTS, &b"stored"[..])
    );

    // Worker announcements: donors and targets -> router.
    let mut announce = router.subscribe(ANNOUNCE).await.unwrap();
    router.flush().await.unwrap();
    ready(&donor, &mut announce, ANNOUNCE).await;
    for (who, c) in [("donor", &donor), ("target", &target)] {
        c.publish(ANNOUNCE, who.to_string().into()).await.unwrap();
        c.flush().await.unwrap();
        let m = tokio::time::timeout(Duration::from_secs(3), announce.next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&m.payload[..], who.as_bytes());
    }

    let answer_advise = tokio::spawn({
        let router = router.clone();
        async move {
            let req = advise.next().await.unwrap();
            router
                .publish(req.reply.unwrap(), "admitted".into())
                .await
                .unwrap();
            router.flush().await.unwrap();
        }
    });
    let reply = tokio::time::timeout(
        Duration::from_secs(3),
        target.request(ADVISE, "prompt".into()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(&reply.payload[..], b"admitted");
    answer_advise.await.unwrap();

    // A namespace's own advise subject (`--advise-subject`,
    // `kv_reuse.<namespace>.advise`): the same two roles.
    let mut own = router.subscribe(NAMESPACE_ADVISE).await.unwrap();
    router.flush().await.unwrap();
    ready(&target, &mut own, NAMESPACE_ADVISE).await;
    let answer_own = tokio::spawn({
        let router = router.clone();
        async move {
            let req = own.next().await.unwrap();
            router
                .publish(req.reply.unwrap(), "own".into())
                .await
                .unwrap();
            router.flush().await.unwrap();
        }
    });
    let reply = tokio::time::timeout(
        Duration::from_secs(3),
        target.request(NAMESPACE_ADVISE, "prompt".into()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(&reply.payload[..], b"own");
    answer_own.await.unwrap();

    let answer_resync = tokio::spawn({
        let donor = donor.clone();
        async move {
            let req = resync.next().await.unwrap();
            donor
                .publish(req.reply.unwrap(), "resent".into())
                .await
                .unwrap();
            donor.flush().await.unwrap();
        }
    });
    let reply = tokio::time::timeout(
        Duration::from_secs(3),
        router.request(RESYNC, "from 1".into()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(&reply.payload[..], b"resent");
    answer_resync.await.unwrap();

    for (who, rx) in [
        ("router", &mut router_err),
        ("donor", &mut donor_err),
        ("target", &mut target_err),
    ] {
        assert_eq!(rx.try_recv().ok(), None, "{who} got a server error");
    }
}

#[tokio::test]
async fn clients_without_credentials_or_outside_their_role_are_refused() {
    let Some((_dir, server)) =
        start("clients_without_credentials_or_outside_their_role_are_refused")
    else {
        return;
    };
    // No credentials, or a wrong password: refused at connect.
    let anonymous = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .connect(server.url())
        .await;
    match anonymous {
        Err(e) => assert_eq!(e.kind(), ConnectErrorKind::AuthorizationViolation, "{e}"),
        Ok(_) => panic!("a client without credentials was accepted"),
    }
    match client(&server, "target", "router-pw").await {
        Err(e) => assert_eq!(e.kind(), ConnectErrorKind::AuthorizationViolation, "{e}"),
        Ok(_) => panic!("a wrong password was accepted"),
    }

    let (router, _router_err) = client(&server, "router", "router-pw").await.unwrap();
    let (target, mut target_err) = client(&server, "target", "target-pw").await.unwrap();
    let (donor, mut donor_err) = client(&server, "donor", "donor-pw").await.unwrap();
    let mut events = router.subscribe(EVENTS).await.unwrap();
    let mut advise = router.subscribe(ADVISE).await.unwrap();
    router.flush().await.unwrap();
    ready(&donor, &mut events, EVENTS).await;
    ready(&target, &mut advise, ADVISE).await;

    // A target publishing KV events (forged inventory) is refused and
    // reaches no router.
    target.publish(EVENTS, "forged".into()).await.unwrap();
    target.flush().await.unwrap();
    let e = next_error(&mut target_err)
        .await
        .expect("no violation reported");
    assert!(
        e.to_lowercase().contains(&format!(
            "permissions violation for publish to \"{EVENTS}\""
        )),
        "{e}"
    );
    // A target writing the directory (pointing targets at its own memory).
    target
        .publish(DIRECTORY_KEY, "forged".into())
        .await
        .unwrap();
    target.flush().await.unwrap();
    let e = next_error(&mut target_err)
        .await
        .expect("no violation reported");
    assert!(
        e.to_lowercase()
            .contains("permissions violation for publish"),
        "{e}"
    );
    assert!(e.contains(DIRECTORY_KEY), "{e}");
    // A target subscribing to other workers' KV events, to the router's
    // replies, or to every inbox.
    for subject in [EVENTS, "_INBOX_router.>", "_INBOX.>"] {
        let _sub = target.subscribe(subject).await.unwrap();
        target.flush().await.unwrap();
        let e = next_error(&mut target_err)
            .await
            .expect("no violation reported");
        assert!(
            e.to_lowercase()
                .contains("permissions violation for subscription")
                && e.contains(subject),
            "{subject}: {e}"
        );
    }
    // A donor posing as a target on the advise subject.
    donor.publish(ADVISE, "prompt".into()).await.unwrap();
    donor.flush().await.unwrap();
    let e = next_error(&mut donor_err)
        .await
        .expect("no violation reported");
    assert!(
        e.to_lowercase()
            .contains("permissions violation for publish"),
        "{e}"
    );

    // Nothing refused was delivered: the next message on each subject is
    // the allowed one sent after the refused ones.
    donor.publish(EVENTS, "real".into()).await.unwrap();
    donor.flush().await.unwrap();
    assert_eq!(
        next_message(&mut events).await,
        (EVENTS.into(), b"real".to_vec())
    );
    target.publish(ADVISE, "real".into()).await.unwrap();
    target.flush().await.unwrap();
    assert_eq!(
        next_message(&mut advise).await,
        (ADVISE.into(), b"real".to_vec())
    );
}

/// The router role may not create the directory bucket: a directory on a
/// [`crate::NatsPlane`] is refused at once, naming the subject and the
/// server's text, instead of the `timed out` a dropped request ends in; on
/// a bare client (which shows it no server error) the timeout says what a
/// missing permission looks like.
#[tokio::test]
async fn a_role_that_may_not_create_the_bucket_is_told_which_permission() {
    use crate::{NatsAuth, NatsDirectory, NatsOptions, NatsPlane, PlaneError};
    const CREATE: &str = "$JS.API.STREAM.CREATE.KV_kv_donors";
    let Some((_dir, server)) =
        start("a_role_that_may_not_create_the_bucket_is_told_which_permission")
    else {
        return;
    };
    let options = NatsOptions {
        auth: NatsAuth::UserPassword {
            user: "router".into(),
            password: "router-pw".into(),
        },
        inbox_prefix: Some("_INBOX_router".into()),
        ..NatsOptions::default()
    };
    let plane = NatsPlane::connect(&server.url(), options).await.unwrap();
    let ttl = Duration::from_secs(30);
    let started = std::time::Instant::now();
    match NatsDirectory::from_plane(&plane, &server.url(), "kv_donors", ttl).await {
        Err(e @ PlaneError::BucketCreateRefused { .. }) => {
            let PlaneError::BucketCreateRefused {
                url,
                bucket,
                subject,
                server: text,
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(
                (url.as_str(), bucket.as_str(), subject.as_str()),
                (server.url().as_str(), "kv_donors", CREATE)
            );
            assert_eq!(
                text.to_lowercase(),
                format!(
                    "permissions violation for publish to \"{}\"",
                    CREATE.to_lowercase()
                )
            );
            let shown = e.to_string();
            assert!(
                shown.contains(&format!("may not publish to `{CREATE}`")),
                "{shown}"
            );
        }
        other => panic!("expected BucketCreateRefused, got {other:?}"),
    }
    // At once, not after the JetStream request's 10 s timeout.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );

    // A bare client: the timeout, saying what it may mean.
    match NatsDirectory::from_client(plane.client().clone(), &server.url(), "kv_donors", ttl).await
    {
        Err(PlaneError::BucketUnavailable { reason, .. }) => {
            assert!(reason.contains("timed out"), "{reason}");
            assert!(
                reason.contains(&format!(
                    "may not publish to `{CREATE}` times out like this"
                )),
                "{reason}"
            );
        }
        other => panic!("expected BucketUnavailable, got {other:?}"),
    }
}
