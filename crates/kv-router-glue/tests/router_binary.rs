//! The `kv-reuse-router` binary as a process, against a real nats-server:
//! ready line, typed refusals over NATS, a prefill worker's announcement
//! making it an advise target, `/healthz`, `/metrics`, SIGTERM drain.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
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
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
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
    let pid = router.child.id().to_string();
    let flag = format!("-{signal}");
    let sent = Command::new("kill")
        .args([flag.as_str(), &pid])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {flag} {pid}");
    let start = Instant::now();
    loop {
        if let Some(status) = router.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "router still running 5 s after SIG{signal}"
        );
        std::thread::sleep(Duration::from_millis(20));
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

    let status = signal_and_wait(&mut router, "TERM");
    assert_eq!(status.code(), Some(0), "drain exits 0: {status}");
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

    let help = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--nats-url",
        "--namespace",
        "--settings",
        "--vllm-events",
        "--metrics-addr",
        "--enable-decode-to-prefill-reuse",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn sigint_drains_and_exits_0_too() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_sigint") else {
        return;
    };
    let mut router = spawn_router(&nats.url(), "rbt-int");
    let status = signal_and_wait(&mut router, "INT");
    assert_eq!(status.code(), Some(0), "{status}");
}
