//! The router binary as a child process: spawning it (ready line, flags,
//! log), HTTP GETs of its `/healthz` and `/metrics`, advise requests over
//! NATS, signals and the wait for its exit.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, GpuIdentity, LayoutFingerprint, Role, SequenceHash, Wire};
use kv_router_glue::service::{AdviseKeys, AdviseReply, AdviseRequest, ADVISE_SUBJECT};
use kv_router_glue::WorkerAnnouncement;

/// The router child; killed and reaped on drop (a failed test leaks nothing).
pub(crate) struct Router {
    pub(crate) child: Child,
    pub(crate) ready: serde_json::Value,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn spawn_router(nats_url: &str, namespace: &str) -> Router {
    spawn_router_with(nats_url, namespace, &[])
}

/// [`spawn_router`] with `extra` flags appended.
pub(crate) fn spawn_router_with(nats_url: &str, namespace: &str, extra: &[&str]) -> Router {
    spawn_router_logging(nats_url, namespace, extra, Stdio::inherit())
}

/// [`spawn_router_with`], its log (stderr) going to a fresh temporary
/// file, returned with it (read it with `std::fs::read_to_string(log.path())`).
pub(crate) fn spawn_router_logged(
    nats_url: &str,
    namespace: &str,
    extra: &[&str],
) -> (Router, tempfile::NamedTempFile) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let router = spawn_router_logging(
        nats_url,
        namespace,
        extra,
        Stdio::from(log.reopen().unwrap()),
    );
    (router, log)
}

/// The router's `serving` log line in `text`.
pub(crate) fn serving_line(text: &str) -> &str {
    text.lines()
        .find(|l| l.contains(" serving "))
        .unwrap_or_else(|| panic!("no serving line in {text}"))
}

/// [`spawn_router_with`], its log (stderr) going to `stderr`.
pub(crate) fn spawn_router_logging(
    nats_url: &str,
    namespace: &str,
    extra: &[&str],
    stderr: Stdio,
) -> Router {
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
pub(crate) fn get(addr: &str, path: &str) -> (u16, String) {
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

pub(crate) async fn ask(client: &async_nats::Client, payload: Vec<u8>) -> AdviseReply {
    let m = tokio::time::timeout(
        Duration::from_secs(5),
        client.request(ADVISE_SUBJECT, payload.into()),
    )
    .await
    .expect("reply within 5 s")
    .expect("request answered");
    AdviseReply::from_wire(&m.payload).unwrap()
}

pub(crate) fn request(id: &str, target: EngineId) -> AdviseRequest {
    AdviseRequest {
        request_id: id.into(),
        target,
        keys: AdviseKeys::SequenceHashes(vec![SequenceHash(1), SequenceHash(2)]),
    }
}

pub(crate) fn prefill_announcement(engine: EngineId) -> WorkerAnnouncement {
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
pub(crate) fn signal_and_wait(router: &mut Router, signal: &str) -> std::process::ExitStatus {
    send_signal(&router.child, signal);
    wait_exit(&mut router.child, Duration::from_secs(5), signal)
}

/// Sends `SIG<signal>` to `child` with `kill`.
pub(crate) fn send_signal(child: &std::process::Child, signal: &str) {
    let pid = child.id().to_string();
    let flag = format!("-{signal}");
    let sent = Command::new("kill")
        .args([flag.as_str(), &pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {flag} {pid}");
}

/// Waits at most `limit` for `child` to exit (after `SIG<signal>`).
pub(crate) fn wait_exit(
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
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// A URL where no NATS server listens (port 1): a router that got as far
/// as connecting would exit 1, so an exit 2 proves the refusal came first.
pub(crate) const NO_NATS: &str = "nats://127.0.0.1:1";

/// Runs the binary with `args` against [`NO_NATS`]; (exit code, stderr).
pub(crate) fn run_without_nats(args: &[&str]) -> (Option<i32>, String) {
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
