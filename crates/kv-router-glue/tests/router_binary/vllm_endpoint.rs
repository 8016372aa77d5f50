//! A `--vllm-events` endpoint that dies after the start, as the router's log
//! shows it with the default filter (trial h39, 7): ZeroMQ's own line per
//! reconnect attempt (and its raw peer identities) are left out, the router
//! warns once naming the endpoint, and the stop line counts the loss.

use std::time::{Duration, Instant};

use kv_router_glue::nats_server::NatsServer;
use kv_router_glue::vllm_events::VllmZmqPublisher;

use crate::process::*;

#[test]
fn a_vllm_endpoint_lost_after_the_start_is_one_warning_naming_it_not_zeromq_lines() {
    let Some(nats) = NatsServer::start_or_skip("router_binary vllm endpoint lost") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let any = "tcp://127.0.0.1:0";
    let publisher = rt
        .block_on(VllmZmqPublisher::bind(any, any, "", 64))
        .unwrap();
    let endpoint = publisher.endpoint().to_owned();
    let spec = format!(
        "{endpoint},replay={},fingerprint=7,role=prefill,worker=vllm-lost-0",
        publisher.replay_endpoint()
    );
    let (mut router, log) =
        spawn_router_logged(&nats.url(), "rbt-vllm-lost", &["--vllm-events", &spec]);
    assert_eq!(router.ready["event"], "ready");

    // The engine dies.
    rt.block_on(async move { drop(publisher) });
    let warning = "vLLM event endpoint disconnected: reconnecting";
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(log.path())
        .unwrap()
        .contains(warning)
    {
        assert!(Instant::now() < deadline, "no {warning:?} within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // ZeroMQ tries again after 0.1, 0.3, 0.7, 1.5 s: several failed attempts.
    std::thread::sleep(Duration::from_millis(2_000));
    let status = signal_and_wait(&mut router, "TERM");
    assert_eq!(status.code(), Some(0), "{status}");

    let text = std::fs::read_to_string(log.path()).unwrap();
    let warned: Vec<&str> = text.lines().filter(|l| l.contains(warning)).collect();
    assert_eq!(warned.len(), 1, "{text}");
    assert!(
        warned[0].contains(&format!("endpoint={endpoint}")),
        "{text}"
    );
    assert!(!text.contains("zeromq"), "ZeroMQ's own lines: {text}");
    assert!(!text.contains("PeerIdentity"), "{text}");
    let stopped = text
        .lines()
        .find(|l| l.contains("vLLM KV events stopped"))
        .unwrap_or_else(|| panic!("no vLLM stop line in {text}"));
    for field in ["worker=vllm-lost-0", "disconnects=1", "reconnects=0"] {
        assert!(stopped.contains(field), "{field} missing: {stopped}");
    }
}
