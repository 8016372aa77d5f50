//! `--advise-subject`: routers of two namespaces on one nats-server, each on
//! its own subject, answer only their own namespace's advise requests
//! (trial h42, 10: on the one fixed subject they shared a queue group and
//! answered about half of each other's, as `unknown target engine`); the
//! warning for a namespace left on the default subject; a bad subject is a
//! flag error (exit 2).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, Wire};
use kv_router_glue::announce_subject;
use kv_router_glue::nats_server::NatsServer;
use kv_router_glue::service::{AdviseRefusal, AdviseReply, AdviseResult, ADVISE_SUBJECT};

use crate::process::*;

const SUBJECT_A: &str = "kv_reuse.rbt-ns-a.advise";
const SUBJECT_B: &str = "kv_reuse.rbt-ns-b.advise";
/// The warning's words (advise_subject.rs in the binary).
const SHARED: &str = "the routers of every namespace on this NATS server answer `kv_reuse.advise`";

async fn ask_on(
    client: &async_nats::Client,
    subject: &str,
    id: &str,
    target: EngineId,
) -> AdviseReply {
    let payload = request(id, target).to_wire().unwrap();
    let m = tokio::time::timeout(
        Duration::from_secs(5),
        client.request(subject.to_string(), payload.into()),
    )
    .await
    .expect("reply within 5 s")
    .unwrap_or_else(|e| panic!("request on {subject} answered: {e}"));
    AdviseReply::from_wire(&m.payload).unwrap()
}

/// The sum of `kv_reuse_advise_requests_total` over its outcomes.
fn advise_requests(metrics_addr: &str) -> f64 {
    let (status, text) = get(metrics_addr, "/metrics");
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| l.starts_with("kv_reuse_advise_requests_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[test]
fn routers_of_two_namespaces_on_their_own_subjects_answer_only_their_own_requests() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_advise_subjects") else {
        return;
    };
    let (mut a, log_a) =
        spawn_router_logged(&nats.url(), "rbt-ns-a", &["--advise-subject", SUBJECT_A]);
    let mut b = spawn_router_with(&nats.url(), "rbt-ns-b", &["--advise-subject", SUBJECT_B]);
    assert_eq!(a.ready["subject"], SUBJECT_A);
    assert_eq!(b.ready["subject"], SUBJECT_B);
    let metrics_a = a.ready["metrics_addr"].as_str().unwrap().to_string();
    let metrics_b = b.ready["metrics_addr"].as_str().unwrap().to_string();

    let engine_a = EngineId(uuid::Uuid::from_u128(0xa1));
    let engine_b = EngineId(uuid::Uuid::from_u128(0xb1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Requests sent on each subject, to compare with each router's count.
    let (sent_a, sent_b) = rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let (mut sent_a, mut sent_b) = (0u32, 0u32);
        // Each namespace's prefill announces itself to its own router.
        let announce_a = prefill_announcement(engine_a).to_wire().unwrap();
        let announce_b = prefill_announcement(engine_b).to_wire().unwrap();
        let subject_a = announce_subject("rbt-ns-a").unwrap().as_str().to_string();
        let subject_b = announce_subject("rbt-ns-b").unwrap().as_str().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            client
                .publish(subject_a.clone(), announce_a.clone().into())
                .await
                .unwrap();
            client
                .publish(subject_b.clone(), announce_b.clone().into())
                .await
                .unwrap();
            let ra = ask_on(&client, SUBJECT_A, "wait-a", engine_a).await;
            let rb = ask_on(&client, SUBJECT_B, "wait-b", engine_b).await;
            sent_a += 1;
            sent_b += 1;
            let known = |r: &AdviseReply| matches!(r.result, AdviseResult::Decided { .. });
            if known(&ra) && known(&rb) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "announced targets never known: {ra:?} {rb:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // With one shared queue group about half of these went to the
        // other namespace's router: every one must reach its own.
        for i in 0..20 {
            let r = ask_on(&client, SUBJECT_A, &format!("a{i}"), engine_a).await;
            assert_eq!(r.request_id, format!("a{i}"));
            assert!(matches!(r.result, AdviseResult::Decided { .. }), "{r:?}");
            let r = ask_on(&client, SUBJECT_B, &format!("b{i}"), engine_b).await;
            assert!(matches!(r.result, AdviseResult::Decided { .. }), "{r:?}");
            // The other namespace's target is unknown on each subject: the
            // request was answered by this namespace's router only.
            let r = ask_on(&client, SUBJECT_A, &format!("ab{i}"), engine_b).await;
            assert_eq!(
                r.result,
                AdviseResult::Refused(AdviseRefusal::UnknownTarget(engine_b))
            );
            let r = ask_on(&client, SUBJECT_B, &format!("ba{i}"), engine_a).await;
            assert_eq!(
                r.result,
                AdviseResult::Refused(AdviseRefusal::UnknownTarget(engine_a))
            );
            sent_a += 2;
            sent_b += 2;
        }
        // Nobody answers the default subject any more.
        let e = client
            .request(
                ADVISE_SUBJECT,
                request("x", engine_a).to_wire().unwrap().into(),
            )
            .await
            .unwrap_err();
        assert_eq!(
            e.kind(),
            async_nats::client::RequestErrorKind::NoResponders,
            "{e}"
        );
        (sent_a, sent_b)
    });
    // Each router counted exactly the requests sent on its subject.
    assert_eq!(advise_requests(&metrics_a), f64::from(sent_a));
    assert_eq!(advise_requests(&metrics_b), f64::from(sent_b));

    assert_eq!(signal_and_wait(&mut a, "TERM").code(), Some(0));
    assert_eq!(signal_and_wait(&mut b, "TERM").code(), Some(0));
    let text = std::fs::read_to_string(log_a.path()).unwrap();
    assert!(!text.contains(SHARED), "{text}");
    let serving = serving_line(&text);
    assert!(
        serving.contains(&format!("subject={SUBJECT_A}")),
        "{serving}"
    );
}

/// A router of a namespace other than `default` on the default subject
/// warns once at start, naming both.
#[test]
fn a_namespace_on_the_default_subject_is_warned_about_once() {
    let Some(nats) = NatsServer::start_or_skip("router_binary_shared_subject") else {
        return;
    };
    let (mut router, log) = spawn_router_logged(&nats.url(), "rbt-ns-c", &[]);
    assert_eq!(router.ready["subject"], ADVISE_SUBJECT);
    assert_eq!(signal_and_wait(&mut router, "TERM").code(), Some(0));
    let text = std::fs::read_to_string(log.path()).unwrap();
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains(SHARED)).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    for field in [
        " WARN ",
        "namespace=rbt-ns-c",
        "subject=kv_reuse.advise",
        "--advise-subject",
        "subject=`",
    ] {
        assert!(
            warnings[0].contains(field),
            "{field} missing: {}",
            warnings[0]
        );
    }
}

/// A subject the callers could not publish to is a flag error (exit 2
/// naming the flag, or the variable it came from), before any connection.
#[test]
fn a_bad_advise_subject_exits_2_naming_the_flag_or_variable() {
    for bad in [
        "kv_reuse.>",
        "kv_reuse.*.advise",
        "kv_reuse..advise",
        "kv reuse",
        "",
    ] {
        let (code, err) = run_without_nats(&["--advise-subject", bad]);
        assert_eq!(code, Some(2), "{bad:?}: {err}");
        assert!(err.contains("--advise-subject"), "{bad:?}: {err}");
        assert!(!err.contains("cannot connect"), "{bad:?}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", NO_NATS, "--metrics-addr", "127.0.0.1:0"])
        .env("KV_ROUTER_ADVISE_SUBJECT", "kv_reuse.*")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("kv-reuse-router: `KV_ROUTER_ADVISE_SUBJECT` (environment variable): "),
        "{err}"
    );
    assert!(err.contains("wildcard"), "{err}");
    // And `--help` documents it.
    let help = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("--advise-subject <SUBJECT>") && text.contains("KV_ROUTER_ADVISE_SUBJECT"),
        "{text}"
    );
}
