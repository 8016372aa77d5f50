//! [`super::NatsDirectory`] against a real `nats-server -js` (skipped with a
//! printed reason when the binary is missing, failed under `CI=true`).

use std::time::Duration;

use kv_descriptor::*;

use super::tests_support::record;
use super::*;
use crate::qualify::nats_server::NatsServer;

async fn next(w: &mut DirectoryWatch) -> Option<DirectoryChange> {
    tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .ok()
        .flatten()
}

#[tokio::test]
async fn a_bad_bucket_name_is_refused_before_connecting() {
    // No server anywhere near: the refusal must come from the name alone,
    // not as a failed connection (port 1 is never a NATS server).
    for bucket in ["bad bucket.name", "", "kv.donors", "kv>", "kv*"] {
        match NatsDirectory::connect("nats://127.0.0.1:1", bucket, Duration::from_secs(30)).await {
            Err(crate::PlaneError::InvalidBucket { bucket: b, reason }) => {
                assert_eq!(b, bucket);
                assert_eq!(Some(reason), bucket_name_problem(bucket));
            }
            other => panic!("{bucket:?}: expected InvalidBucket, got {other:?}"),
        }
    }
    for ok in ["kv_donors", "KV-donors-2", "_"] {
        assert_eq!(bucket_name_problem(ok), None, "{ok}");
    }
}

#[tokio::test]
async fn a_ttl_below_the_servers_max_age_floor_is_refused_before_connecting() {
    // nats-server refuses a key-value `max_age` under 100 ms; the refusal
    // names the argument and the floor instead of a failed connection.
    for ms in [0, 1, 50, 99] {
        let ttl = Duration::from_millis(ms);
        match NatsDirectory::connect("nats://127.0.0.1:1", "kv_donors", ttl).await {
            Err(e @ crate::PlaneError::TtlBelowFloor { .. }) => {
                assert_eq!(
                    e,
                    crate::PlaneError::TtlBelowFloor {
                        field: "lease_ttl",
                        ttl,
                        floor: Duration::from_millis(100),
                    }
                );
                assert_eq!(
                    e.to_string(),
                    format!(
                        "`lease_ttl` {ttl:?} is below nats-server's 100ms floor for a \
                         key-value bucket's max_age"
                    )
                );
            }
            other => panic!("{ms} ms: expected TtlBelowFloor, got {other:?}"),
        }
    }
    // At the floor the TTL passes: whatever fails next is the connection.
    let at_floor = tokio::time::timeout(
        Duration::from_secs(10),
        NatsDirectory::connect("nats://127.0.0.1:1", "kv_donors", NATS_MIN_MAX_AGE),
    )
    .await;
    assert!(
        !matches!(at_floor, Ok(Err(crate::PlaneError::TtlBelowFloor { .. }))),
        "{at_floor:?}"
    );
}

#[tokio::test]
async fn nats_directory_put_watch_delete_across_two_clients() {
    const TEST: &str = "nats_directory_put_watch_delete_across_two_clients";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let ttl = Duration::from_secs(30);
    let donor = NatsDirectory::connect(&server.url(), "kv_donors", ttl)
        .await
        .unwrap();
    let reader = NatsDirectory::connect(&server.url(), "kv_donors", ttl)
        .await
        .unwrap();
    let g1 = OwnerLease::fresh(Role::Decode);
    let r1 = record(g1, u64::MAX - 1);
    donor.put(&r1).await.unwrap();
    // A watch opened after the put sees the current entry first.
    let mut w = reader.watch().await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r1.clone())));
    // A new generation, then a delete on close, reach the other client.
    let r2 = record(g1.next_generation(), u64::MAX - 1);
    donor.put(&r2).await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r2.clone())));
    donor.delete(g1.engine_id).await.unwrap();
    assert_eq!(
        next(&mut w).await,
        Some(DirectoryChange::Delete(g1.engine_id))
    );
    // Through the cache the reader never goes back to generation 1.
    let mut cache = DonorCache::new();
    cache.apply(DirectoryChange::Put(r2));
    assert!(matches!(
        cache.apply(DirectoryChange::Put(r1)),
        CacheUpdate::Ignored(crate::ResolveError::StaleGeneration { .. })
    ));
}

#[tokio::test]
async fn open_existing_refuses_a_missing_bucket_without_creating_it() {
    // A reader's mistyped bucket used to be created empty, so every lookup
    // found nothing with no error (helper-22 finding 10).
    const TEST: &str = "open_existing_refuses_a_missing_bucket_without_creating_it";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let client = async_nats::connect(server.url()).await.unwrap();
    match NatsDirectory::open_existing(client.clone(), &server.url(), "kv_donrs").await {
        Err(e @ crate::PlaneError::NoSuchBucket { .. }) => {
            assert_eq!(
                e,
                crate::PlaneError::NoSuchBucket {
                    bucket: "kv_donrs".into()
                }
            );
        }
        other => panic!("expected NoSuchBucket, got {other:?}"),
    }
    // Nothing was created: the stream behind the bucket is still absent.
    let js = async_nats::jetstream::new(client.clone());
    assert!(js.get_key_value("kv_donrs").await.is_err());
    assert!(matches!(
        NatsDirectory::open_existing(client.clone(), &server.url(), "bad.name").await,
        Err(crate::PlaneError::InvalidBucket { .. })
    ));
    // Once a writer created it, the reader opens it and sees its records.
    let donor = NatsDirectory::connect(&server.url(), "kv_donors", Duration::from_secs(30))
        .await
        .unwrap();
    let r = record(OwnerLease::fresh(Role::Decode), u64::MAX - 1);
    donor.put(&r).await.unwrap();
    let reader = NatsDirectory::open_existing(client, &server.url(), "kv_donors")
        .await
        .unwrap();
    let mut w = reader.watch().await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r)));
}

#[tokio::test]
async fn a_deleted_bucket_ends_the_watch_and_a_recreated_one_is_watched_again() {
    // What the router's directory follower relies on to open its watch
    // again (service::follow, "Re-opening"): the watch ends instead of
    // hanging, and the same handle watches the bucket once it exists again.
    const TEST: &str = "a_deleted_bucket_ends_the_watch_and_a_recreated_one_is_watched_again";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let ttl = Duration::from_secs(30);
    let reader = NatsDirectory::connect(&server.url(), "kv_donors", ttl)
        .await
        .unwrap();
    let r1 = record(OwnerLease::fresh(Role::Decode), u64::MAX - 1);
    reader.put(&r1).await.unwrap();
    let mut w = reader.watch().await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r1)));
    let client = async_nats::connect(server.url()).await.unwrap();
    async_nats::jetstream::new(client.clone())
        .delete_key_value("kv_donors")
        .await
        .unwrap();
    // The watch's consumer notices by its missed heartbeats: 10.0 s here.
    let t0 = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(40), w.next()).await;
    assert!(
        matches!(ended, Ok(None)),
        "watch after the bucket was deleted: {ended:?}"
    );
    eprintln!(
        "{TEST}: the watch ended {:?} after the delete",
        t0.elapsed()
    );
    // Recreated (a donor's directory opens it again), then watched again
    // through the reader's handle.
    let donor = NatsDirectory::connect(&server.url(), "kv_donors", ttl)
        .await
        .unwrap();
    let r2 = record(OwnerLease::fresh(Role::Decode), u64::MAX - 1);
    donor.put(&r2).await.unwrap();
    let mut again = reader.watch().await.unwrap();
    assert_eq!(next(&mut again).await, Some(DirectoryChange::Put(r2)));
}

/// A directory that creates its bucket when absent creates it again, with
/// the same configuration, when a watch finds it deleted (a router's
/// follower re-opening its watch); a reader that never creates it gets an
/// error and leaves it absent.
#[tokio::test]
async fn a_watch_creates_a_deleted_bucket_again_unless_the_directory_never_creates() {
    const TEST: &str = "a_watch_creates_a_deleted_bucket_again_unless_the_directory_never_creates";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let ttl = Duration::from_secs(45);
    let router = NatsDirectory::connect(&server.url(), "kv_donors", ttl)
        .await
        .unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let reader = NatsDirectory::open_existing(client.clone(), &server.url(), "kv_donors")
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    js.delete_key_value("kv_donors").await.unwrap();

    // The reader's watch fails, and creates nothing.
    match reader.watch().await {
        Err(crate::PlaneError::Subscribe { subject, reason }) => {
            assert_eq!(subject, "kv_donors");
            assert!(reason.contains("stream not found"), "{reason}");
        }
        other => panic!("a reader watched a deleted bucket: {other:?}"),
    }
    assert!(js.get_key_value("kv_donors").await.is_err());

    // The router's creates it again, as at start, and watches it.
    let mut w = router.watch().await.unwrap();
    let store = js.get_key_value("kv_donors").await.unwrap();
    let status = store.status().await.unwrap();
    assert_eq!((status.max_age(), status.history()), (ttl, 1));
    let r = record(OwnerLease::fresh(Role::Decode), u64::MAX - 1);
    router.put(&r).await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r.clone())));
    // The reader's handle watches the bucket created again.
    let mut again = reader.watch().await.unwrap();
    assert_eq!(next(&mut again).await, Some(DirectoryChange::Put(r)));
    // Nothing re-created it while it existed: the same stream still holds
    // the one put.
    // (`status` reads the info cached when the handle was opened.)
    let fresh = js.get_key_value("kv_donors").await.unwrap();
    assert_eq!(fresh.status().await.unwrap().values(), 1);
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused_saying_so() {
    const TEST: &str = "a_server_without_jetstream_is_refused_saying_so";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    // A configuration file without a `jetstream` block: the harness then
    // passes no -js.
    let dir = std::env::temp_dir().join(format!("kv-nojs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nojs.conf");
    std::fs::write(&conf, "# core NATS only\n").unwrap();
    let server = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    let url = server.url();
    let refused = NatsDirectory::connect(&url, "kv_donors", Duration::from_secs(30)).await;
    match &refused {
        Err(crate::PlaneError::BucketUnavailable {
            url: u,
            bucket,
            reason,
        }) => {
            assert_eq!(u, &url);
            assert_eq!(bucket, "kv_donors");
            assert!(
                reason.starts_with("the server has no JetStream (start nats-server with -js"),
                "{reason}"
            );
        }
        other => panic!("expected BucketUnavailable saying JetStream is off, got {other:?}"),
    }
    // It did connect: the message must not say it could not.
    let shown = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(shown.contains("is reachable"), "{shown}");
    assert!(!shown.contains("cannot connect"), "{shown}");
    // A reader that may not create the bucket is told the same, not that
    // the bucket is missing (which would send the operator to its name).
    let client = async_nats::connect(&url).await.unwrap();
    match NatsDirectory::open_existing(client, &url, "kv_donors").await {
        Err(crate::PlaneError::BucketUnavailable { reason, .. }) => assert!(
            reason.starts_with("the server has no JetStream (start nats-server with -js"),
            "{reason}"
        ),
        other => panic!(
            "open_existing: expected BucketUnavailable saying JetStream is off, got {other:?}"
        ),
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn nats_directory_entry_expires_with_the_bucket_max_age() {
    const TEST: &str = "nats_directory_entry_expires_with_the_bucket_max_age";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    // The lease TTL is the bucket's max_age: a donor that stops re-putting
    // disappears from the directory without a delete.
    let ttl = Duration::from_millis(500);
    let donor = NatsDirectory::connect(&server.url(), "kv_donors_ttl", ttl)
        .await
        .unwrap();
    let reader = NatsDirectory::connect(&server.url(), "kv_donors_ttl", ttl)
        .await
        .unwrap();
    let g1 = OwnerLease::fresh(Role::Decode);
    let r = record(g1, u64::MAX - 1);
    donor.put(&r).await.unwrap();
    let mut w = reader.watch().await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r)));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut fresh = reader.watch().await.unwrap();
        let seen = tokio::time::timeout(Duration::from_millis(300), fresh.next()).await;
        if seen.is_err() {
            break; // no current entry any more
        }
        assert!(
            std::time::Instant::now() < deadline,
            "entry still served 10 s after a 500 ms max_age"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn nats_directory_uses_the_connect_options_credentials() {
    const TEST: &str = "nats_directory_uses_the_connect_options_credentials";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    // A server that requires a user and password (docs/nats-permissions.conf
    // authenticates every role this way); JetStream as the harness starts it.
    let server = NatsServer::start_with_args(&["--user", "donor", "--pass", "donor-pw"]).unwrap();
    let ttl = Duration::from_secs(30);
    let options = |password: Option<&str>| crate::NatsOptions {
        name: "directory-auth-test".into(),
        connect_timeout: Duration::from_secs(2),
        auth: match password {
            Some(p) => crate::NatsAuth::UserPassword {
                user: "donor".into(),
                password: p.into(),
            },
            None => crate::NatsAuth::None,
        },
        ..crate::NatsOptions::default()
    };
    // Without credentials, or with a wrong password: a typed connect refusal
    // naming the URL, with the server's reason.
    for (label, opts) in [("none", options(None)), ("wrong", options(Some("nope")))] {
        match NatsDirectory::connect_with(&server.url(), opts, "kv_donors", ttl).await {
            Err(crate::PlaneError::Connect { url, reason }) => {
                assert_eq!(url, server.url(), "{label}");
                assert!(
                    reason.contains("authorization violation"),
                    "{label}: {reason}"
                );
            }
            other => panic!("{label}: expected a connect refusal, got {other:?}"),
        }
    }
    // With them: the donor puts, a second authenticated client reads it back.
    let donor =
        NatsDirectory::connect_with(&server.url(), options(Some("donor-pw")), "kv_donors", ttl)
            .await
            .unwrap();
    let reader =
        NatsDirectory::connect_with(&server.url(), options(Some("donor-pw")), "kv_donors", ttl)
            .await
            .unwrap();
    let r = record(OwnerLease::fresh(Role::Decode), u64::MAX - 1);
    donor.put(&r).await.unwrap();
    let mut w = reader.watch().await.unwrap();
    assert_eq!(next(&mut w).await, Some(DirectoryChange::Put(r)));
}
