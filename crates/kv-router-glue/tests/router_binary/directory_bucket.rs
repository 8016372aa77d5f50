//! The donor directory bucket deleted under a serving router: created
//! again by a router that may (its `/healthz` back to 200 once its watch
//! is open again), waited for, with a warning naming the cause, by one
//! that may not (docs/nats-permissions.conf's router role).

use std::time::{Duration, Instant};

use async_nats::jetstream;
use kv_router_glue::nats_server::NatsServer;

use crate::process::*;

/// Longest wait for a router to notice a deleted bucket and answer 200
/// again: its watch's consumer misses heartbeats for ~10 s first.
const BACK_WITHIN: Duration = Duration::from_secs(40);

/// Waits up to `limit` for the router's log at `log` to contain `text`;
/// returns the log.
fn wait_log(log: &tempfile::NamedTempFile, text: &str, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let log = std::fs::read_to_string(log.path()).unwrap();
        if log.contains(text) {
            return log;
        }
        assert!(
            start.elapsed() < limit,
            "no {text:?} within {limit:?}: {log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits up to `limit` for `/healthz` to answer `want`.
fn wait_health(metrics_addr: &str, want: (u16, &str), limit: Duration) {
    let start = Instant::now();
    loop {
        let (status, body) = get(metrics_addr, "/healthz");
        if (status, body.trim()) == want {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "/healthz still {status} {body:?} after {limit:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A bucket deleted under a router that may create it: the router creates
/// it again with its own `--directory-ttl-ms` (one warning line saying so),
/// watches it again, and `/healthz` is back to 200 (it used to stay at
/// `503 donor directory watch down` until a restart, retrying `stream not
/// found` every 5 s).
#[test]
fn a_deleted_directory_bucket_is_created_again_and_healthz_returns_to_200() {
    const BUCKET: &str = "kv_rbt_deleted";
    let Some(nats) = NatsServer::start_or_skip("router_binary_bucket_deleted") else {
        return;
    };
    let (mut router, log) = spawn_router_logged(
        &nats.url(),
        "rbt-deleted",
        &[
            "--directory-bucket",
            BUCKET,
            "--directory-ttl-ms",
            "45000",
            "--advise-subject",
            "kv_reuse.rbt-deleted.advise",
        ],
    );
    let metrics_addr = router.ready["metrics_addr"].as_str().unwrap().to_string();
    assert_eq!(get(&metrics_addr, "/healthz").0, 200);
    let rt = runtime();
    let js = rt.block_on(async {
        let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        js.delete_key_value(BUCKET).await.unwrap();
        js
    });
    let deleted = Instant::now();

    let text = wait_log(&log, "created it again", BACK_WITHIN);
    wait_health(&metrics_addr, (200, "ok"), Duration::from_secs(5));
    eprintln!("healthz 200 again {:?} after the delete", deleted.elapsed());
    let recreated: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("created it again"))
        .collect();
    assert_eq!(recreated.len(), 1, "{text}");
    assert!(recreated[0].contains(" WARN "), "{}", recreated[0]);
    assert!(
        recreated[0].contains(&format!("bucket={BUCKET}")),
        "{}",
        recreated[0]
    );
    assert!(
        recreated[0].contains("max_age_ms=45000"),
        "{}",
        recreated[0]
    );
    // As at start: the router's TTL, one value per key.
    let status = rt.block_on(async {
        let store = js.get_key_value(BUCKET).await.unwrap();
        // Watched again: anything put under a key reaches the follower
        // (not a record: counted as a directory change and refused).
        store.put("not-an-engine", "x".into()).await.unwrap();
        store.status().await.unwrap()
    });
    assert_eq!(
        (status.max_age(), status.history()),
        (Duration::from_secs(45), 1)
    );
    let start = Instant::now();
    loop {
        let (_, text) = get(&metrics_addr, "/metrics");
        let seen = (
            sample(
                &text,
                "kv_reuse_router_follow_total{item=\"directory_watch_reopened\"}",
            ),
            sample(
                &text,
                "kv_reuse_router_follow_total{item=\"directory_changes\"}",
            ),
            sample(&text, "kv_reuse_router_follower_up{stream=\"directory\"}"),
        );
        if seen == (Some(1.0), Some(1.0), Some(1.0)) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{seen:?}\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(signal_and_wait(&mut router, "TERM").code(), Some(0));
}

/// docs/nats-permissions.conf with its variables filled in and an
/// `admin` user (password `admin-pw`) allowed everything, to create and
/// delete the bucket the router role may only read.
fn permissions_config(dir: &std::path::Path) -> std::path::PathBuf {
    let doc = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/nats-permissions.conf"
    );
    let text = std::fs::read_to_string(doc)
        .unwrap()
        .replace("$NATS_STORE_DIR", &dir.join("js").display().to_string())
        .replace("$NATS_ROUTER_PASSWORD", "router-pw")
        .replace("$NATS_DONOR_PASSWORD", "donor-pw")
        .replace("$NATS_TARGET_PASSWORD", "target-pw")
        .replace(
            "users = [",
            "users = [\n    { user: admin, password: admin-pw }",
        );
    assert!(!text.contains("$NATS_"), "an unfilled variable is left");
    let path = dir.join("nats.conf");
    std::fs::write(&path, text).unwrap();
    path
}

/// The router role's flags (docs/nats-permissions.conf).
const ROUTER_ROLE: [&str; 6] = [
    "--nats-user",
    "router",
    "--nats-password",
    "router-pw",
    "--nats-inbox-prefix",
    "_INBOX_router",
];

async fn admin(nats: &NatsServer) -> jetstream::Context {
    let client =
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin-pw".into())
            .connect(nats.url())
            .await
            .unwrap();
    jetstream::new(client)
}

/// The same under the documented router role, which may not create the
/// bucket: it keeps retrying, each failure a warning naming the permission
/// the server refused, `/healthz` at 503 meanwhile;
/// once an operator creates the bucket, it is watched again and `/healthz`
/// is back to 200.
#[test]
fn a_router_that_may_not_create_the_bucket_waits_for_it_with_a_clear_warning() {
    const TEST: &str = "router_binary_bucket_deleted_without_permission";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let conf = permissions_config(dir.path());
    let nats = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    let rt = runtime();
    let js = rt.block_on(admin(&nats));
    let config = || async_nats::jetstream::kv::Config {
        bucket: "kv_donors".into(),
        history: 1,
        max_age: Duration::from_secs(30),
        ..Default::default()
    };
    rt.block_on(js.create_key_value(config())).unwrap();
    let (mut router, log) = spawn_router_logged(&nats.url(), "default", &ROUTER_ROLE);
    let metrics_addr = router.ready["metrics_addr"].as_str().unwrap().to_string();
    assert_eq!(get(&metrics_addr, "/healthz").0, 200);

    rt.block_on(js.delete_key_value("kv_donors")).unwrap();
    let text = wait_log(&log, "cannot open follower stream", BACK_WITHIN);
    let (status, body) = get(&metrics_addr, "/healthz");
    assert_eq!((status, body.trim()), (503, "donor directory watch down"));
    let warning = text
        .lines()
        .find(|l| l.contains("cannot open follower stream"))
        .unwrap();
    assert!(warning.contains(" WARN "), "{warning}");
    // The server's refusal, named (not the request's timeout).
    assert!(
        warning.contains(
            "refused to create key-value bucket `kv_donors`, which is absent: \
             this connection's user may not publish to `$JS.API.STREAM.CREATE.KV_kv_donors`"
        ),
        "{warning}"
    );
    assert!(
        warning.contains("Permissions Violation for Publish to"),
        "{warning}"
    );
    assert!(!text.contains("created it again"), "{text}");

    // An operator creates it: watched again, 200.
    rt.block_on(js.create_key_value(config())).unwrap();
    wait_health(&metrics_addr, (200, "ok"), Duration::from_secs(20));
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(text.contains("follower stream open again"), "{text}");
    assert_eq!(signal_and_wait(&mut router, "TERM").code(), Some(0));
}

/// Under the router role with no bucket yet, the router cannot start: it
/// exits 1 as soon as the server refuses the creation, its last line
/// naming the permission and the subject (it used to say `timed out`, 10 s
/// later).
#[test]
fn a_router_that_may_not_create_the_absent_bucket_exits_naming_the_permission() {
    const TEST: &str = "router_binary_bucket_create_refused";
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let conf = permissions_config(dir.path());
    let nats = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    let started = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", &nats.url(), "--metrics-addr", "127.0.0.1:0"])
        .args(ROUTER_ROLE)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "no ready line: {err}");
    let last = err.lines().last().unwrap();
    assert_eq!(
        last,
        format!(
            "kv-reuse-router: NATS: NATS at {} refused to create key-value bucket `kv_donors`, \
             which is absent: this connection's user may not publish to \
             `$JS.API.STREAM.CREATE.KV_kv_donors` (server: Permissions Violation for Publish to \
             \"$JS.API.STREAM.CREATE.KV_kv_donors\"); allow it that subject, or create the \
             bucket as an operator (`nats kv add kv_donors`)",
            nats.url()
        )
    );
    assert!(
        took < Duration::from_secs(8),
        "{took:?}: the timeout, not the refusal"
    );
}
