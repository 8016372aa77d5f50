//! The `kv-reuse-router` binary as a process, against a real nats-server:
//! ready line, typed refusals over NATS, a prefill worker's announcement
//! making it an advise target, `/healthz`, `/metrics`, SIGTERM drain, and
//! the inventory rebuild of a router started (or SIGKILLed and restarted)
//! after a donor went idle (issue 18).

mod agents_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, GpuIdentity, LayoutFingerprint, Role, SequenceHash, Wire};
use kv_router_glue::nats_server::NatsServer;
use kv_router_glue::service::{
    AdviseKeys, AdviseRefusal, AdviseReply, AdviseRequest, AdviseResult, ADVISE_SUBJECT,
};
use kv_router_glue::{announce_subject, WorkerAnnouncement};

/// The router child; killed and reaped on drop (a failed test leaks nothing).
struct Router {
    child: Child,
    ready: serde_json::Value,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_router(nats_url: &str, namespace: &str) -> Router {
    spawn_router_with(nats_url, namespace, &[])
}

/// [`spawn_router`] with `extra` flags appended.
fn spawn_router_with(nats_url: &str, namespace: &str, extra: &[&str]) -> Router {
    spawn_router_logging(nats_url, namespace, extra, Stdio::inherit())
}

/// [`spawn_router_with`], its log (stderr) going to `stderr`.
fn spawn_router_logging(nats_url: &str, namespace: &str, extra: &[&str], stderr: Stdio) -> Router {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args([
            "--nats-url",
            nats_url,
            "--namespace",
            namespace,
            "--metrics-addr",
            "127.0.0.1:0",
            "--enable-decode-to-prefill-reuse",
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn kv-reuse-router");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep reading so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let line = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Some(Ok(line))) => line,
        other => {
            let _ = child.kill();
            panic!("no ready line within 30 s: {other:?}");
        }
    };
    let ready: serde_json::Value = serde_json::from_str(&line).expect("ready line is JSON");
    Router { child, ready }
}

/// One HTTP/1.1 GET; (status code, body).
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {out:?}"));
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

async fn ask(client: &async_nats::Client, payload: Vec<u8>) -> AdviseReply {
    let m = tokio::time::timeout(
        Duration::from_secs(5),
        client.request(ADVISE_SUBJECT, payload.into()),
    )
    .await
    .expect("reply within 5 s")
    .expect("request answered");
    AdviseReply::from_wire(&m.payload).unwrap()
}

fn request(id: &str, target: EngineId) -> AdviseRequest {
    AdviseRequest {
        request_id: id.into(),
        target,
        keys: AdviseKeys::SequenceHashes(vec![SequenceHash(1), SequenceHash(2)]),
    }
}

fn prefill_announcement(engine: EngineId) -> WorkerAnnouncement {
    WorkerAnnouncement {
        worker_key: "prefill-0".into(),
        engine_id: engine,
        role: Role::Prefill,
        layout_fingerprint: LayoutFingerprint(42),
        tp_size: 1,
        gpus: vec![GpuIdentity::new(uuid::Uuid::from_u128(1), 0, "router-binary-test").unwrap()],
        pin_endpoint: "unix:/tmp/none".into(),
        event_subject: "kv.rbt.prefill.kv_events".into(),
    }
}

/// Sends `SIG<signal>` to the router and waits at most 5 s for its exit.
fn signal_and_wait(router: &mut Router, signal: &str) -> std::process::ExitStatus {
    send_signal(&router.child, signal);
    wait_exit(&mut router.child, Duration::from_secs(5), signal)
}

/// Sends `SIG<signal>` to `child` with `kill`.
fn send_signal(child: &std::process::Child, signal: &str) {
    let pid = child.id().to_string();
    let flag = format!("-{signal}");
    let sent = Command::new("kill")
        .args([flag.as_str(), &pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {flag} {pid}");
}

/// Waits at most `limit` for `child` to exit (after `SIG<signal>`).
fn wait_exit(
    child: &mut std::process::Child,
    limit: Duration,
    signal: &str,
) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < limit,
            "router still running {limit:?} after SIG{signal}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The sample `series value` of an OpenMetrics text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[test]
fn router_binary_serves_refuses_reports_and_drains_on_sigterm() {
    let Some(nats) = NatsServer::start_or_skip("router_binary") else {
        return;
    };
    let mut router = spawn_router(&nats.url(), "rbt");
    assert_eq!(router.ready["event"], "ready");
    assert_eq!(router.ready["subject"], ADVISE_SUBJECT);
    let metrics_addr = router.ready["metrics_addr"].as_str().unwrap().to_string();
    assert!(metrics_addr.starts_with("127.0.0.1:"), "{metrics_addr}");

    let (status, body) = get(&metrics_addr, "/healthz");
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let prefill = EngineId(uuid::Uuid::from_u128(0xbeef));
    rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let reply = ask(&client, request("u1", prefill).to_wire().unwrap()).await;
        assert_eq!(reply.request_id, "u1");
        assert_eq!(
            reply.result,
            AdviseResult::Refused(AdviseRefusal::UnknownTarget(prefill))
        );
        let reply = ask(&client, b"not msgpack".to_vec()).await;
        assert!(
            matches!(
                reply.result,
                AdviseResult::Refused(AdviseRefusal::Malformed(_))
            ),
            "{reply:?}"
        );

        // A prefill worker announces itself: the same request is now decided
        // (no donor holds its blocks, so the advisor refuses with a reason,
        // but it ran: the target is known).
        let announce = prefill_announcement(prefill).to_wire().unwrap();
        let subject = announce_subject("rbt").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let decided = loop {
            client
                .publish(subject.as_str().to_string(), announce.clone().into())
                .await
                .unwrap();
            let reply = ask(&client, request("u2", prefill).to_wire().unwrap()).await;
            if let AdviseResult::Decided { decision, hint } = reply.result {
                assert!(hint.is_none(), "no donor, no hint");
                break decision;
            }
            assert!(
                Instant::now() < deadline,
                "announced prefill target never known: {reply:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(!decided.admitted(), "{decided}");
    });

    let (status, text) = get(&metrics_addr, "/metrics");
    assert_eq!(status, 200);
    assert_eq!(
        sample(
            &text,
            "kv_reuse_advise_requests_total{outcome=\"malformed\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        sample(
            &text,
            "kv_reuse_advise_requests_total{outcome=\"unknown_target\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kv_reuse_advise_requests_total{outcome=\"decided\"}"),
        Some(1.0),
        "{text}"
    );
    // The followers' state, copied into /metrics once a second: the one
    // announced worker, both streams open, its announcements counted.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, text) = get(&metrics_addr, "/metrics");
        let seen = (
            sample(&text, "kv_reuse_router_workers"),
            sample(&text, "kv_reuse_router_follower_up{stream=\"directory\"}"),
            sample(
                &text,
                "kv_reuse_router_follower_up{stream=\"announcements\"}",
            ),
            sample(
                &text,
                "kv_reuse_router_follow_total{item=\"announcements\"}",
            )
            .is_some_and(|n| n >= 1.0),
        );
        if seen == (Some(1.0), Some(1.0), Some(1.0), true) {
            break;
        }
        assert!(Instant::now() < deadline, "{seen:?}\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    }

    let status = signal_and_wait(&mut router, "TERM");
    assert_eq!(status.code(), Some(0), "drain exits 0: {status}");
}

/// The `stopped` log line accounts for every request taken: one published
/// without a reply subject was counted (`ServeReport::no_reply`) but the
/// line printed only `received`, `decided`, `refused` and
/// `after_shutdown`, so `received=12 decided=0 refused=11` did not add up
/// and the dropped request was nowhere to be seen.
#[test]
fn the_stop_line_counts_requests_without_a_reply_subject() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_stop_line") else {
        return;
    };
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut router = spawn_router_logging(
        &nats.url(),
        "rbt-stop",
        &[],
        Stdio::from(log.reopen().unwrap()),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        client
            .publish(ADVISE_SUBJECT, b"no reply subject".to_vec().into())
            .await
            .unwrap();
        // Answered after the publish above (one subscription, in order).
        let reply = ask(&client, b"not msgpack".to_vec()).await;
        assert!(
            matches!(
                reply.result,
                AdviseResult::Refused(AdviseRefusal::Malformed(_))
            ),
            "{reply:?}"
        );
    });
    let status = signal_and_wait(&mut router, "TERM");
    assert_eq!(status.code(), Some(0), "{status}");
    let text = std::fs::read_to_string(log.path()).unwrap();
    let stopped = text
        .lines()
        .find(|l| l.contains(" stopped "))
        .unwrap_or_else(|| panic!("no stop line in {text}"));
    for field in [
        "received=2",
        "decided=0",
        "refused=1",
        "no_reply=1",
        "reply_errors=0",
    ] {
        assert!(stopped.contains(field), "{field} missing: {stopped}");
    }
}

/// Once serving, the log says what the router is connected to and
/// listening on (NATS server, namespace, bucket, metrics address, advise
/// subject); it used to log only the settings and async-nats' "connected
/// successfully server=4222", so a journal did not tell which server,
/// namespace or port the process used.
#[test]
fn the_log_says_what_the_router_serves_on_and_sighup_changes_nothing() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_serving_line") else {
        return;
    };
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut router = spawn_router_logging(
        &nats.url(),
        "rbt-serving",
        &["--directory-bucket", "kv_rbt_serving"],
        Stdio::from(log.reopen().unwrap()),
    );
    let metrics_addr = router.ready["metrics_addr"].as_str().unwrap().to_string();
    // SIGHUP (a habitual "reload") is logged and changes nothing; its
    // default action used to kill the router.
    send_signal(&router.child, "HUP");
    let start = Instant::now();
    while !std::fs::read_to_string(log.path())
        .unwrap()
        .contains("SIGHUP")
    {
        assert!(start.elapsed() < Duration::from_secs(5), "no SIGHUP line");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        router.child.try_wait().unwrap().is_none(),
        "SIGHUP stopped the router"
    );
    assert_eq!(get(&metrics_addr, "/healthz").0, 200);
    let status = signal_and_wait(&mut router, "TERM");
    assert_eq!(status.code(), Some(0), "{status}");
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        text.contains("ignored: settings are read once at start"),
        "{text}"
    );
    // A clean stop warns about nothing: the NATS client's `closed` event
    // used to be logged as a WARN ("NATS client event event=closed").
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
    let serving = text
        .lines()
        .find(|l| l.contains(" serving "))
        .unwrap_or_else(|| panic!("no serving line in {text}"));
    for field in [
        format!("nats_url={}", nats.url()),
        "namespace=rbt-serving".into(),
        "directory_bucket=kv_rbt_serving".into(),
        format!("metrics_addr={metrics_addr}"),
        format!("subject={ADVISE_SUBJECT}"),
    ] {
        assert!(serving.contains(&field), "{field} missing: {serving}");
    }
}

/// A `KV_ROUTER_LOG` that is not a valid filter is a configuration error
/// naming the variable (exit 2), as a bad `KV_REUSE_*` value is; it used
/// to be ignored silently (logging at `info`).
#[test]
fn a_malformed_log_filter_exits_2_naming_kv_router_log() {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", NO_NATS, "--metrics-addr", "127.0.0.1:0"])
        .env("KV_ROUTER_LOG", "kv_reuse=loud")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("KV_ROUTER_LOG"), "{err}");
    assert!(!err.contains("cannot connect"), "{err}");
}

#[test]
fn bad_flags_are_refused_with_exit_code_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--vllm-events", "tcp://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`fingerprint` is required"), "{err}");

    // A password in KV_ROUTER_NATS_URL (or the other secrets' variables)
    // must not be echoed by `--help`, which prints set env values by default.
    let help = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .arg("--help")
        .env(
            "KV_ROUTER_NATS_URL",
            "nats://router:pw-in-url@127.0.0.1:4222",
        )
        .env("KV_ROUTER_NATS_PASSWORD", "pw-in-var")
        .env("KV_ROUTER_NATS_TOKEN", "tok-in-var")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for secret in ["pw-in-url", "pw-in-var", "tok-in-var"] {
        assert!(!text.contains(secret), "--help shows {secret}:\n{text}");
    }
    for flag in [
        "--nats-url",
        "--namespace",
        "--settings",
        "--vllm-events",
        "--metrics-addr",
        "--enable-decode-to-prefill-reuse",
        "--advise-busy-poll-us",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

/// A URL where no NATS server listens (port 1): a router that got as far
/// as connecting would exit 1, so an exit 2 proves the refusal came first.
const NO_NATS: &str = "nats://127.0.0.1:1";

/// Runs the binary with `args` against [`NO_NATS`]; (exit code, stderr).
fn run_without_nats(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", NO_NATS, "--metrics-addr", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "{args:?}: no ready line");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every configuration mistake exits 2 naming its flag, before any
/// connection (no nats-server needed): values out of range, tokens NATS
/// would refuse, files that cannot be read.
#[test]
fn configuration_errors_exit_2_naming_the_flag_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage");
    std::fs::write(&garbage, "not a creds file").unwrap();
    let garbage = garbage.to_str().unwrap();
    for (args, flag) in [
        (&["--max-probes", "0"][..], "--max-probes"),
        (&["--missed-periods", "0"][..], "--missed-periods"),
        (&["--announce-period-ms", "0"][..], "--announce-period-ms"),
        (&["--directory-ttl-ms", "0"][..], "--directory-ttl-ms"),
        (&["--decision-log", "0"][..], "--decision-log"),
        (
            &["--advise-busy-poll-us", "99999999999"][..],
            "--advise-busy-poll-us",
        ),
        (&["--tokens-per-block", "0"][..], "--tokens-per-block"),
        (&["--namespace", "a.b"][..], "--namespace"),
        (
            &["--directory-bucket", "bad bucket.name"][..],
            "--directory-bucket",
        ),
        (&["--nats-tls-ca", "/nonexistent.pem"][..], "--nats-tls-ca"),
        (
            &[
                "--nats-tls-cert",
                "/nonexistent-c.pem",
                "--nats-tls-key",
                garbage,
            ][..],
            "--nats-tls-cert",
        ),
        (&["--nats-creds", "/nonexistent.creds"][..], "--nats-creds"),
        (&["--nats-creds", garbage][..], "--nats-creds"),
    ] {
        let (code, err) = run_without_nats(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} names {flag}: {err}");
        assert!(!err.contains("cannot connect"), "{args:?}: {err}");
    }
}

/// `--tokens-per-block` checks the settings at start only when given
/// (trial h33, BUG 2: its default of 16 refused 1000 µs a block, which
/// 64-token engines make worth it, although decisions price the donor
/// layout's own block size). Without it, the router goes on to connect
/// (exit 1 here, no NATS); with 16 it refuses naming the setting and the
/// block size (exit 2); with 64 it goes on.
#[test]
fn tokens_per_block_checks_the_settings_at_start_only_when_given() {
    let slow = [
        "--enable-decode-to-prefill-reuse",
        "--transfer-source-estimated-block-us",
        "1000",
    ];
    let (code, err) = run_without_nats(&slow);
    assert_eq!(code, Some(1), "not refused without the flag: {err}");
    assert!(!err.contains("no fetch could save time"), "{err}");
    let (code, err) = run_without_nats(&[&slow[..], &["--tokens-per-block", "16"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("transfer_source_estimated_block_us") && err.contains("16 tokens x 30"),
        "{err}"
    );
    let (code, err) = run_without_nats(&[&slow[..], &["--tokens-per-block", "64"]].concat());
    assert_eq!(code, Some(1), "{err}");
}

/// A `--metrics-addr` that cannot be bound is a flag error too: exit 2
/// naming the flag and the address, before any connection (it used to be
/// bound after NATS was reached, so with NATS down the same mistake exited
/// 1 as an unreachable server).
#[test]
fn a_metrics_addr_in_use_or_not_of_this_host_exits_2_naming_the_flag_before_connecting() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    // TEST-NET-1 (RFC 5737): never an address of this host.
    for addr in [taken.as_str(), "192.0.2.1:9464"] {
        let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
            .args(["--nats-url", NO_NATS, "--metrics-addr", addr])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{addr}: {err}");
        assert!(
            err.contains(&format!("`--metrics-addr` {addr}: ")),
            "{addr}: {err}"
        );
        assert!(!err.contains("cannot connect"), "{addr}: {err}");
        assert!(out.stdout.is_empty(), "{addr}: no ready line");
    }
}

/// A valid configuration gets as far as connecting: with no server there,
/// that is exit 1 naming the URL (a run-time failure, not a flag error),
/// and the log lines on a non-terminal stderr carry no colour codes.
#[test]
fn an_unreachable_server_exits_1_and_logs_without_colour_codes() {
    let (code, err) = run_without_nats(&["--namespace", "rbt-none"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot connect to NATS") && err.contains(NO_NATS),
        "{err}"
    );
    assert!(
        err.contains("setting in force"),
        "the log reached stderr: {err}"
    );
    // One log line per setting (a multi-line message arrived split in log
    // collectors), each with its key as a field.
    for s in kv_router_glue::SETTINGS {
        let key = format!("key=\"{}\"", s.key);
        let lines = err
            .lines()
            .filter(|l| l.contains("setting in force") && l.contains(&key))
            .count();
        assert_eq!(lines, 1, "{key}: {err}");
    }
    assert!(!err.contains('\x1b'), "ANSI escape in piped logs: {err:?}");
}

#[test]
fn sigint_drains_and_exits_0_too() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_sigint") else {
        return;
    };
    // Every bounded flag at a bound still starts, and a server list whose
    // first server does not answer reaches the second.
    let servers = format!("nats://127.0.0.1:1,{}", nats.url());
    let mut router = spawn_router_with(
        &servers,
        "rbt-int",
        &[
            "--max-probes",
            "1",
            "--missed-periods",
            "1000",
            "--announce-period-ms",
            "10",
            "--directory-ttl-ms",
            "100",
            "--decision-log",
            "1",
            "--advise-busy-poll-us",
            "1000000",
            "--directory-bucket",
            "kv_rbt-int",
        ],
    );
    let status = signal_and_wait(&mut router, "INT");
    assert_eq!(status.code(), Some(0), "{status}");
}

/// The donor directory bucket of the rebuild test (donor and router).
const REBUILD_BUCKET: &str = "kv_rbt_donors";

/// Asks `target` about `h` until the router admits a fetch from `donor`
/// (at most 20 s); returns how many requests it took, or why not (the
/// caller cleans up before it fails: a panic here would leave the donor's
/// tasks running in the runtime's drop).
async fn wait_admitted(
    client: &async_nats::Client,
    target: EngineId,
    donor: EngineId,
    h: &[SequenceHash],
    what: &str,
) -> Result<usize, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut asked = 0;
    loop {
        asked += 1;
        let req = AdviseRequest {
            request_id: format!("{what}-{asked}"),
            target,
            keys: AdviseKeys::SequenceHashes(h.to_vec()),
        };
        let reply = ask(client, req.to_wire().unwrap()).await;
        if let AdviseResult::Decided {
            decision,
            hint: Some(env),
        } = &reply.result
        {
            assert!(decision.admitted(), "{decision}");
            let hint = env.fetch_gpu_actions().unwrap().remove(0);
            assert_eq!(hint.donor_engine_id, donor, "{what}");
            assert_eq!(hint.sequence_hashes, h, "{what}");
            assert_eq!(hint.fetch_from, 0, "{what}: the whole prompt is held");
            return Ok(asked);
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{what}: the idle donor's prefix is never admitted after {asked} requests: {reply:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A donor agent on `url` with its record in `bucket`, answering
/// inventory snapshots (what a decode worker process runs): its events,
/// directory record and inventory answers on one connection made with
/// `options` (credentials, TLS), as `DonorAgent`'s own deployments do.
async fn open_donor(
    url: &str,
    bucket: &str,
    cfg: kv_router_glue::DonorAgentConfig,
    options: kv_router_glue::NatsOptions,
) -> kv_router_glue::DonorAgent {
    use kv_router_glue::{DonorAgent, InventoryPlane, NatsDirectory, NatsInventory, NatsPlane};
    let plane = NatsPlane::connect(url, options).await.unwrap();
    let dir =
        NatsDirectory::from_client(plane.client().clone(), url, bucket, Duration::from_secs(30))
            .await
            .unwrap();
    let inventory = NatsInventory::from_client(plane.client().clone());
    let donor = DonorAgent::open(cfg, Arc::new(dir), Arc::new(plane))
        .await
        .unwrap();
    donor
        .serve_inventory(Arc::new(inventory) as Arc<dyn InventoryPlane>)
        .await
        .unwrap();
    donor
}

/// What the donor tests share: a runtime, the donor's pin socket
/// endpoint, and the prompt's 30 blocks (`agents_common::prompt(0)`) with
/// their sequence hashes.
struct DonorSetup {
    rt: tokio::runtime::Runtime,
    _sock: tempfile::TempDir,
    ep: String,
    blocks: Vec<kv_descriptor::StoredBlock>,
    h: Vec<SequenceHash>,
}

impl DonorSetup {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let blocks = agents_common::prompt(0);
        let h = blocks.iter().map(|b| b.sequence_hash).collect();
        Self {
            rt,
            _sock: sock,
            ep,
            blocks,
            h,
        }
    }
}

/// The announcement of prefill `target` with the agents' layout, TP and GPUs.
fn agents_target_announcement(target: EngineId) -> Vec<u8> {
    use agents_common::{gpus, layout, TP};
    WorkerAnnouncement {
        layout_fingerprint: layout().fingerprint(),
        tp_size: TP,
        gpus: gpus(),
        event_subject: "kv.agt.prefill.kv_events".into(),
        ..prefill_announcement(target)
    }
    .to_wire()
    .unwrap()
}

/// A donor (`cfg`, directory `bucket`) that stores `blocks` in chains of
/// 5 (each chained to the last) and is then idle: it and the prefill
/// `target` only announce, every 100 ms, as workers do every period.
/// Returns the donor, this test's own client and the announcing task.
async fn stored_then_announcing(
    url: &str,
    bucket: &str,
    cfg: kv_router_glue::DonorAgentConfig,
    blocks: &[kv_descriptor::StoredBlock],
    target: EngineId,
) -> (
    Arc<kv_router_glue::DonorAgent>,
    async_nats::Client,
    tokio::task::JoinHandle<()>,
) {
    let donor = open_donor(url, bucket, cfg, kv_router_glue::NatsOptions::default()).await;
    for (k, chunk) in blocks.chunks(5).enumerate() {
        let parent = (k > 0).then(|| blocks[k * 5 - 1].sequence_hash);
        agents_common::store_after(&donor, parent, chunk).await;
    }
    let donor = Arc::new(donor);
    let client = async_nats::connect(url).await.unwrap();
    let ticker = announce_every_100ms(
        donor.clone(),
        client.clone(),
        agents_target_announcement(target),
    );
    (donor, client, ticker)
}

/// Stops [`stored_then_announcing`]'s task, then closes its donor.
async fn stop_announcing_and_close(
    donor: Arc<kv_router_glue::DonorAgent>,
    ticker: tokio::task::JoinHandle<()>,
) -> Result<kv_router_glue::DonorCloseReport, kv_router_glue::AgentError> {
    ticker.abort();
    let _ = ticker.await;
    let donor = Arc::try_unwrap(donor).unwrap_or_else(|_| panic!("donor still shared"));
    donor.close(Duration::from_secs(1)).await
}

/// Every 100 ms: the donor's tick (announcement, record renewal) and, on
/// `client`, the prefill target's `announcement`, as both workers do every
/// period, until the task is aborted.
fn announce_every_100ms(
    donor: Arc<kv_router_glue::DonorAgent>,
    client: async_nats::Client,
    announcement: Vec<u8>,
) -> tokio::task::JoinHandle<()> {
    let subject = announce_subject(agents_common::NS)
        .unwrap()
        .as_str()
        .to_string();
    tokio::spawn(async move {
        loop {
            let _ = donor.tick().await;
            let _ = client
                .publish(subject.clone(), announcement.clone().into())
                .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

#[test]
fn a_router_started_after_a_donor_went_idle_or_restarted_after_sigkill_finds_its_blocks() {
    use agents_common::*;

    let Some(nats) = NatsServer::start_or_skip("router_binary_rebuild") else {
        return;
    };
    let url = nats.url();
    let DonorSetup {
        rt,
        _sock,
        ep,
        blocks,
        h,
    } = DonorSetup::new();
    let target = EngineId(uuid::Uuid::from_u128(0x7a46e7));
    let mut cfg = donor_config("decode-0", &ep);
    // Shorter than its 6 events: a later router cannot replay them.
    cfg.event_ring = 2;
    let (donor, client, ticker) = rt.block_on(stored_then_announcing(
        &url,
        REBUILD_BUCKET,
        cfg,
        &blocks,
        target,
    ));
    let donor_id = donor.bank().owner().engine_id;
    let flags = [
        "--directory-bucket",
        REBUILD_BUCKET,
        "--announce-period-ms",
        "100",
        "--missed-periods",
        "50",
    ];

    // Started after the donor's last event: only a snapshot can tell it.
    let mut first = spawn_router_with(&url, NS, &flags);
    let started_later = rt.block_on(wait_admitted(&client, target, donor_id, &h, "first router"));
    // SIGKILL (no drain) and a new process: the same again.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let mut second = spawn_router_with(&url, NS, &flags);
    let restarted = rt.block_on(wait_admitted(
        &client,
        target,
        donor_id,
        &h,
        "restarted router",
    ));
    let status = signal_and_wait(&mut second, "TERM");

    rt.block_on(stop_announcing_and_close(donor, ticker))
        .unwrap();
    started_later.unwrap();
    restarted.unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
}

/// The donor directory bucket of the NATS outage test.
const OUTAGE_BUCKET: &str = "kv_rbt_outage";

/// A NATS outage longer than the silence window (`--missed-periods` x
/// `--announce-period-ms`: 3 x 100 ms here, the outage 1.5 s) does not
/// make the router drop its live workers (trial h33, BUG 1: it dropped
/// them as silent and ignored their announcements for good, so every
/// advise after it was refused). After it the same donor is admitted
/// again, once its inventory snapshot is applied (its events while the
/// router was away could have been lost).
#[test]
fn a_nats_outage_longer_than_the_silence_window_keeps_the_workers() {
    use agents_common::*;

    let Some(mut nats) = NatsServer::start_or_skip("router_binary_outage") else {
        return;
    };
    let url = nats.url();
    let DonorSetup {
        rt,
        _sock,
        ep,
        blocks,
        h,
    } = DonorSetup::new();
    let target = EngineId(uuid::Uuid::from_u128(0x0a7a6e));
    let (donor, client, ticker) = rt.block_on(stored_then_announcing(
        &url,
        OUTAGE_BUCKET,
        donor_config("decode-0", &ep),
        &blocks,
        target,
    ));
    let donor_id = donor.bank().owner().engine_id;
    let log = tempfile::NamedTempFile::new().unwrap();
    let router = spawn_router_logging(
        &url,
        NS,
        &[
            "--directory-bucket",
            OUTAGE_BUCKET,
            "--announce-period-ms",
            "100",
            "--missed-periods",
            "3",
        ],
        Stdio::from(log.reopen().unwrap()),
    );
    let metrics_addr = router.ready["metrics_addr"].as_str().unwrap().to_string();
    let before = rt.block_on(wait_admitted(&client, target, donor_id, &h, "before"));

    nats.stop();
    std::thread::sleep(Duration::from_millis(1_500));
    nats.restart().unwrap();
    // The router serves again (both its connections back), and so does
    // this test's client.
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(&metrics_addr, "/healthz").0 != 200
        || client.connection_state() != async_nats::connection::State::Connected
    {
        assert!(
            Instant::now() < deadline,
            "router not serving after the restart"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = rt.block_on(wait_admitted(
        &client,
        target,
        donor_id,
        &h,
        "after the outage",
    ));
    // /metrics copies the counters in once a second: read until the
    // snapshot after the outage shows (or 5 s).
    let snapshots = |text: &str| {
        sample(
            text,
            "kv_reuse_router_follow_total{item=\"snapshots_applied\"}",
        )
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let (_, text) = get(&metrics_addr, "/metrics");
        if snapshots(&text) >= Some(2.0) || Instant::now() >= deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };

    // The donor's record may be gone with the outage: its close may fail.
    let _ = rt.block_on(stop_announcing_and_close(donor, ticker));
    drop(router);
    let logged = std::fs::read_to_string(log.path()).unwrap();
    before.unwrap();
    after.unwrap_or_else(|e| panic!("{e}\nrouter log:\n{logged}"));
    let follow = |item: &str| {
        sample(
            &text,
            &format!("kv_reuse_router_follow_total{{item=\"{item}\"}}"),
        )
    };
    assert_eq!(
        sample(&text, "kv_reuse_router_workers"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(follow("workers_dropped"), Some(0.0), "{text}");
    assert_eq!(follow("announcements_ignored"), Some(0.0), "{text}");
    assert!(follow("connection_losses") >= Some(1.0), "{text}");
    // The first snapshot, then the one after the outage.
    assert!(follow("snapshots_applied") >= Some(2.0), "{text}");
    assert!(logged.contains("router's NATS connection back"), "{logged}");
    // Each failed reconnect attempt was logged twice, a few a second
    // (trial h33, nit 7): now once per 10 s per process, with the servers.
    let client_errors: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("client error"))
        .collect();
    assert!(client_errors.len() <= 2, "{client_errors:#?}");
    assert!(
        client_errors
            .iter()
            .all(|l| l.contains("NATS client error") && l.contains("servers=")),
        "{client_errors:#?}"
    );
}

/// `--vllm-events`: the binary subscribes to a vLLM prefill engine's ZMQ
/// KV event stream (PUB + ROUTER replay, vLLM 0.33's wire format), makes
/// that engine an advise target, and counts what its native prefix cache
/// holds: a donor agent retains all 30 blocks of the prompt; before the
/// engine reports anything the hint fetches from block 0, after it reported
/// storing the first 2 blocks the hint starts at block 2.
#[test]
fn vllm_events_flag_makes_a_vllm_prefill_a_target_whose_own_blocks_are_not_fetched() {
    use agents_common::*;
    use kv_router_glue::service::VllmEndpointSpec;
    use kv_router_glue::vllm_events::{VllmEncoding, VllmEvent, VllmEventBatch, VllmZmqPublisher};

    const BUCKET: &str = "kv_rbv_donors";
    let Some(nats) = NatsServer::start_or_skip("router_binary vllm") else {
        return;
    };
    let url = nats.url();
    // Tokens 0 .. 480, 16 per block.
    let DonorSetup {
        rt,
        _sock,
        ep,
        blocks,
        h,
    } = DonorSetup::new();
    let (donor, ticker, mut publisher) = rt.block_on(async {
        let donor = open_donor(
            &url,
            BUCKET,
            donor_config("decode-0", &ep),
            kv_router_glue::NatsOptions::default(),
        )
        .await;
        store(&donor, &blocks).await;
        let donor = Arc::new(donor);
        let d = donor.clone();
        let ticker = tokio::spawn(async move {
            loop {
                let _ = d.tick().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let publisher = VllmZmqPublisher::bind("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "", 64)
            .await
            .expect("bind the vLLM publisher");
        (donor, ticker, publisher)
    });
    let donor_id = donor.bank().owner().engine_id;
    // The vLLM engine's layout as the donor's: same fingerprint, TP, block size.
    let spec = format!(
        "{},replay={},fingerprint={},role=prefill,tp={TP},block={TOKENS},worker=vllm-prefill-0",
        publisher.endpoint(),
        publisher.replay_endpoint(),
        layout().fingerprint().0,
    );
    let target = spec.parse::<VllmEndpointSpec>().unwrap().worker.engine;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut router = spawn_router_logging(
        &url,
        NS,
        &[
            "--directory-bucket",
            BUCKET,
            "--announce-period-ms",
            "100",
            "--missed-periods",
            "50",
            "--vllm-events",
            &spec,
        ],
        Stdio::from(log.reopen().unwrap()),
    );
    assert_eq!(router.ready["event"], "ready");
    let result = rt.block_on(async {
        let client = async_nats::connect(&url).await.unwrap();
        // No announcement over NATS: `--vllm-events role=prefill` is what
        // makes the engine a target.
        wait_admitted(&client, target, donor_id, &h, "before any vLLM batch").await?;
        let batch = VllmEventBatch {
            ts: 1.7e9,
            data_parallel_rank: Some(0),
            events: vec![VllmEvent::BlockStored {
                block_hashes: vec![0x5EED_0001, 0x5EED_0002],
                parent_block_hash: None,
                token_ids: (0..(2 * TOKENS) as u32).collect(),
                block_size: TOKENS as u32,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: vec![],
                group_idx: None,
            }],
        };
        // PUB drops what it sends before the router's SUB joined: the batch
        // is sent again (a repeated store changes nothing) until it counts.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut n = 0;
        loop {
            publisher
                .publish(&batch, VllmEncoding::ArrayLike)
                .await
                .unwrap();
            n += 1;
            let req = AdviseRequest {
                request_id: format!("after-{n}"),
                target,
                keys: AdviseKeys::SequenceHashes(h.clone()),
            };
            let reply = ask(&client, req.to_wire().unwrap()).await;
            if let AdviseResult::Decided {
                decision,
                hint: Some(env),
            } = &reply.result
            {
                let hint = env.fetch_gpu_actions().unwrap().remove(0);
                if hint.fetch_from == 2 {
                    assert!(decision.admitted(), "{decision}");
                    assert_eq!(hint.donor_engine_id, donor_id);
                    return Ok(n);
                }
                if hint.fetch_from != 0 {
                    return Err(format!("fetch_from {} (want 0, then 2)", hint.fetch_from));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the vLLM engine's 2 blocks never counted after {n} batches: {reply:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // Drained first, so a failure's log has the router's vLLM stats line.
    let status = signal_and_wait(&mut router, "TERM");
    rt.block_on(stop_announcing_and_close(donor, ticker))
        .unwrap();
    let text = std::fs::read_to_string(log.path()).unwrap();
    eprintln!("{text}");
    result.unwrap();
    assert_eq!(status.code(), Some(0), "drain exits 0: {status}");
    // The stream's counters as fields of their own; the line was a Debug
    // dump (`stats=SubscriberStats { next_seq: 1, ... }`).
    let stopped = text
        .lines()
        .find(|l| l.contains("vLLM KV events stopped"))
        .unwrap_or_else(|| panic!("no vLLM stop line in {text}"));
    for field in [
        "worker=vllm-prefill-0",
        &format!("engine={target}"),
        "lost_batches=0",
        "live_batches=",
        "stored_blocks=",
        "refused_by_index=0",
        "skipped=0 skipped_by_reason=none",
    ] {
        assert!(stopped.contains(field), "{field} missing: {stopped}");
    }
    assert!(!stopped.contains("Stats {"), "{stopped}");
}

/// A `--vllm-events` endpoint that does not answer fails the start (exit
/// 1, naming the flag and the endpoint, after its 5 s connect timeout)
/// before the router touches NATS. The router used to connect, subscribe,
/// watch the directory and apply inventory snapshots first, and the error
/// came after their log lines. No nats-server here: a router that got as
/// far as NATS would fail with `cannot connect to NATS` instead.
#[test]
fn a_vllm_endpoint_that_does_not_answer_fails_the_start_before_nats() {
    let (code, err) = run_without_nats(&["--vllm-events", "tcp://127.0.0.1:1,fingerprint=1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("`--vllm-events` tcp://127.0.0.1:1: "), "{err}");
    assert!(!err.contains("cannot connect to NATS"), "{err}");
}

/// Mutual TLS end to end (issue 18, "who may read KV"): a nats-server that
/// verifies client certificates; the router binary, a donor agent (events,
/// directory record, inventory) and a prefill target each connect with a
/// certificate of the deployment's CA, and the router admits a fetch from
/// the donor over it. A router without a client certificate does not start
/// (exit 1, the TLS refusal on stderr) and a client without one is refused.
#[test]
fn over_mutual_tls_the_router_admits_a_donor_and_refuses_to_start_without_a_certificate() {
    use agents_common::*;
    use kv_router_glue::test_pki::TestPki;
    use kv_router_glue::{NatsAuth, NatsOptions, NatsPlane};

    const TEST: &str = "router_binary_mutual_tls";
    const BUCKET: &str = "kv_rbtls_donors";
    // Both probes first: each skips (or fails under CI) with its reason.
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let Some(pki) = TestPki::new_or_skip(TEST) else {
        return;
    };
    let (router_cert, router_key) = pki.issue_client("ca", "router");
    let decode_cert = pki.issue_client("ca", "decode");
    let prefill_cert = pki.issue_client("ca", "prefill");
    let nats = pki.start_server(&["--tlsverify", "--tlscacert", &pki.arg("ca.pem")]);
    let url = nats.url();
    let options = |who: &str, cert| NatsOptions {
        name: who.into(),
        auth: NatsAuth::None,
        tls: pki.client_tls(Some(cert)),
        ..NatsOptions::default()
    };

    // No client certificate: the server refuses the router's handshake and
    // the binary exits 1 naming the connection, instead of serving nothing.
    let mut refused = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", &url, "--namespace", NS])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--nats-tls-ca", &pki.arg("ca.pem")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A router that got in would serve until killed: bound the wait, so
    // the test fails instead of hanging.
    let deadline = Instant::now() + Duration::from_secs(20);
    while refused.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = refused.kill();
            let out = refused.wait_with_output().unwrap();
            panic!(
                "a router without a client certificate kept running: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = refused.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains(&url), "the refusal names the server: {err}");
    assert!(out.stdout.is_empty(), "no ready line without a connection");

    let mut router = spawn_router_with(
        &url,
        NS,
        &[
            "--nats-tls-ca",
            &pki.arg("ca.pem"),
            "--nats-tls-cert",
            &router_cert.to_string_lossy(),
            "--nats-tls-key",
            &router_key.to_string_lossy(),
            "--directory-bucket",
            BUCKET,
            "--announce-period-ms",
            "100",
            "--missed-periods",
            "50",
        ],
    );
    assert_eq!(router.ready["event"], "ready");

    let DonorSetup {
        rt,
        _sock,
        ep,
        blocks,
        h,
    } = DonorSetup::new();
    let target = EngineId(uuid::Uuid::from_u128(0x7a15));
    let result = rt.block_on(async {
        // The donor's one connection (events, directory, inventory) and the
        // prefill target's, each under its own certificate.
        let donor = open_donor(
            &url,
            BUCKET,
            donor_config("decode-0", &ep),
            options("decode-0", decode_cert),
        )
        .await;
        store(&donor, &blocks).await;
        let client = NatsPlane::connect(&url, options("prefill-0", prefill_cert))
            .await
            .unwrap()
            .client()
            .clone();
        let donor = Arc::new(donor);
        let ticker = announce_every_100ms(
            donor.clone(),
            client.clone(),
            agents_target_announcement(target),
        );
        let admitted =
            wait_admitted(&client, target, donor.bank().owner().engine_id, &h, "mtls").await;
        // A client without a certificate of the CA gets no connection at all.
        let anonymous = NatsOptions {
            tls: pki.client_tls(None),
            ..NatsOptions::default()
        };
        let refused = NatsPlane::connect(&url, anonymous).await.err();
        ticker.abort();
        let _ = ticker.await;
        let donor = Arc::try_unwrap(donor).unwrap_or_else(|_| panic!("donor still shared"));
        donor.close(Duration::from_secs(1)).await.unwrap();
        (admitted, refused)
    });
    let status = signal_and_wait(&mut router, "TERM");
    let (admitted, refused) = result;
    admitted.unwrap();
    assert!(
        matches!(refused, Some(kv_router_glue::PlaneError::Connect { .. })),
        "a client without a certificate must be refused: {refused:?}"
    );
    assert_eq!(status.code(), Some(0), "{status}");
}

/// SIGTERM or SIGINT while the router is still connecting (here to a
/// listener that accepts and never speaks NATS, so the connect waits its
/// 5 s) stops it with a log line and exit 0: before, the process died of
/// the signal (status 143) with nothing in the log (helper-20 finding 16).
#[test]
fn a_signal_during_startup_stops_it_with_a_log_line_and_exit_0() {
    for sig in ["TERM", "INT"] {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("nats://{}", silent.local_addr().unwrap());
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
            .args(["--nats-url", &url, "--namespace", "rbt-start"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("spawn kv-reuse-router");
        // Connecting: past the settings line, before any ready line.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(log.path())
            .unwrap()
            .contains("setting in force")
        {
            assert!(Instant::now() < deadline, "no settings line");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        send_signal(&child, sig);
        let status = wait_exit(&mut child, Duration::from_secs(3), sig);
        let text = std::fs::read_to_string(log.path()).unwrap();
        assert_eq!(status.code(), Some(0), "SIG{sig}: {status}\n{text}");
        assert!(
            text.contains("stopped during startup")
                && text.contains(&format!("signal=\"SIG{sig}\"")),
            "{text}"
        );
        drop(silent);
    }
}

/// A bad `KV_REUSE_*` value exits 2 naming the variable (clap, which reads
/// them for the flags' defaults, named only the flag: `invalid value '0'
/// for '--minimum-transfer-prefix-blocks <N>'`; helper-20 finding 17).
#[test]
fn a_bad_reuse_environment_variable_exits_2_naming_it() {
    for (var, value, says) in [
        (
            "KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS",
            "0",
            "is out of range",
        ),
        (
            "KV_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE",
            "maybe",
            "expected true / false",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
            .args(["--nats-url", NO_NATS, "--metrics-addr", "127.0.0.1:0"])
            .env(var, value)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(
            err.starts_with(&format!("kv-reuse-router: `{var}`: ")) && err.contains(says),
            "{var}={value}: {err}"
        );
        assert!(out.stdout.is_empty());
    }
}

/// A bad `KV_ROUTER_*` value (read by clap for a flag the command line
/// lacks) is refused naming the variable, not only the flag (trial h33,
/// nit 6); the same value given as the flag names the flag alone.
#[test]
fn a_bad_router_environment_variable_exits_2_naming_it() {
    for (var, value) in [
        ("KV_ROUTER_NATS_URL", "foo://x"),
        ("KV_ROUTER_NATS_INBOX_PREFIX", "_INBOX.>"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
            .args(["--metrics-addr", "127.0.0.1:0"])
            .env(var, value)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(
            err.starts_with(&format!(
                "kv-reuse-router: `{var}` (environment variable): "
            )),
            "{var}={value}: {err}"
        );
        assert!(err.contains(value), "{var}={value}: {err}");
    }
    // On the command line: clap's own message, naming the flag.
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", "foo://x"])
        .env("KV_ROUTER_NATS_URL", "nats://127.0.0.1:1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nats-url") && !err.contains("KV_ROUTER_NATS_URL"),
        "{err}"
    );
}

/// A router that came up on a throwaway nats-server, after that server
/// stopped and `settle` passed (its client reads the closed socket within
/// it), with the file its stderr log goes to; `None` (the test skips) where
/// no nats-server can be started.
fn router_after_nats_stops(
    test: &str,
    namespace: &str,
    settle: Duration,
) -> Option<(Router, tempfile::NamedTempFile)> {
    let mut nats = NatsServer::start_or_skip(test)?;
    let log = tempfile::NamedTempFile::new().unwrap();
    let router = spawn_router_logging(
        &nats.url(),
        namespace,
        &[],
        Stdio::from(log.reopen().unwrap()),
    );
    nats.stop();
    std::thread::sleep(settle);
    Some((router, log))
}

/// With NATS gone one SIGTERM still stops the router, within the drain's
/// grace for a reconnect (1 s + 1 s; it was 5 s + 5 s), exit 0, warning
/// that the drain did not reach NATS (helper-20 finding 15).
#[test]
fn a_signal_with_nats_gone_stops_within_the_grace_saying_the_drain_did_not_reach_nats() {
    let Some((mut router, log)) = router_after_nats_stops(
        "router_binary_drain_gone",
        "rbt-gone",
        Duration::from_millis(500),
    ) else {
        return;
    };
    let t0 = std::time::Instant::now();
    send_signal(&router.child, "TERM");
    let status = wait_exit(&mut router.child, Duration::from_secs(6), "TERM");
    let took = t0.elapsed();
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert_eq!(status.code(), Some(0), "{status}\n{text}");
    assert!(took < Duration::from_secs(6), "{took:?}\n{text}");
    assert!(
        text.contains("the drain did not reach NATS") && text.contains("drain_confirmed=false"),
        "{text}"
    );
}

/// With NATS gone the drain gives a reconnect its grace (1 s + 1 s); a
/// second SIGINT inside it stops the router at once, exit 1, saying the drain was cut
/// (it used to be ignored; helper-20 finding 15).
#[test]
fn a_second_signal_cuts_a_drain_that_cannot_reach_nats() {
    let Some((mut router, log)) = router_after_nats_stops(
        "router_binary_drain_cut",
        "rbt-cut",
        Duration::from_millis(300),
    ) else {
        return;
    };
    send_signal(&router.child, "INT");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        router.child.try_wait().unwrap().is_none(),
        "still draining after the first signal"
    );
    send_signal(&router.child, "INT");
    let status = wait_exit(&mut router.child, Duration::from_secs(2), "INT");
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert_eq!(status.code(), Some(1), "{status}\n{text}");
    assert!(
        text.contains("second signal: stopping without finishing the drain")
            && text.contains("SIGINT during the drain"),
        "{text}"
    );
}
