//! `serve_advise` against a real nats-server: replies, typed refusals,
//! requests without a reply subject, metrics, and the drain at shutdown.

use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::{EngineId, Wire};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::metrics::ReuseMetrics;
use crate::qualify::nats_server::NatsServer;
use crate::qualify::{Scenario, DONOR_BLOCKS, TARGET_BASELINE};

fn service(s: &Scenario) -> Arc<RouterService> {
    let advisor = s.advisor(crate::qualify::admitting_settings()).unwrap();
    let svc = RouterService::new(Arc::new(advisor));
    svc.add_target(s.target);
    Arc::new(svc)
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

/// The value of the sample line `series value`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_decisions_and_typed_refusals_then_unsubscribes() {
    let Some(nats) = NatsServer::start_or_skip("serves_decisions_and_typed_refusals") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let svc = service(&s);
    let metrics = Arc::new(ReuseMetrics::new());
    let server_client = async_nats::connect(nats.url()).await.unwrap();
    let caller = async_nats::connect(nats.url()).await.unwrap();
    let server = AdviseServer::bind(server_client, svc.clone())
        .await
        .unwrap()
        .with_metrics(metrics.clone());
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(server.run(shutdown.clone()));

    let req = AdviseRequest {
        request_id: "r1".into(),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    };
    let reply = ask(&caller, req.to_wire().unwrap()).await;
    assert_eq!(reply.request_id, "r1");
    let AdviseResult::Decided { decision, hint } = reply.result else {
        panic!("refused: {reply:?}");
    };
    assert!(decision.admitted(), "{decision}");
    assert_eq!(
        decision.terms.unwrap().transfer_blocks,
        (DONOR_BLOCKS - TARGET_BASELINE) as u64
    );
    assert_eq!(hint.expect("hint when admitted").message_id, "r1");

    let stranger = EngineId(uuid::Uuid::from_u128(7));
    let unknown = AdviseRequest {
        request_id: "r2".into(),
        target: stranger,
        ..req.clone()
    };
    let reply = ask(&caller, unknown.to_wire().unwrap()).await;
    assert_eq!(reply.request_id, "r2");
    assert_eq!(
        reply.result,
        AdviseResult::Refused(AdviseRefusal::UnknownTarget(stranger))
    );

    let reply = ask(&caller, vec![0xc1, 0x00]).await;
    assert_eq!(reply.request_id, "");
    assert!(
        matches!(
            reply.result,
            AdviseResult::Refused(AdviseRefusal::Malformed(_))
        ),
        "{reply:?}"
    );

    // Over the advise bound but under nats-server's 1 MiB payload limit, so
    // it reaches the service and must be refused before decoding.
    let reply = ask(&caller, vec![0u8; MAX_ADVISE_REQUEST_BYTES + 1]).await;
    assert_eq!(
        reply.result,
        AdviseResult::Refused(AdviseRefusal::Oversized {
            field: "payload".into(),
            len: MAX_ADVISE_REQUEST_BYTES as u64 + 1,
            max: MAX_ADVISE_REQUEST_BYTES as u64,
        })
    );

    // No reply subject: nothing to answer, only counted. The request after
    // it (same connection, so delivered after it) proves it was received.
    caller
        .publish(ADVISE_SUBJECT, req.to_wire().unwrap().into())
        .await
        .unwrap();
    let reply = ask(&caller, req.to_wire().unwrap()).await;
    assert!(matches!(reply.result, AdviseResult::Decided { .. }));

    shutdown.cancel();
    let report = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("run ends after cancel")
        .unwrap()
        .unwrap();
    assert_eq!(
        report,
        ServeReport {
            received: 6,
            decided: 2,
            refused: 3,
            no_reply: 1,
            reply_errors: 0,
            after_shutdown: 0,
            drain_confirmed: true,
        }
    );
    let text = metrics.encode();
    for (outcome, n) in [
        ("decided", 2.0),
        ("unknown_target", 1.0),
        ("malformed", 1.0),
        ("oversized", 1.0),
    ] {
        let series = format!("kv_reuse_advise_requests_total{{outcome=\"{outcome}\"}}");
        assert_eq!(sample(&text, &series), n, "{series}");
    }
    assert_eq!(sample(&text, "kv_reuse_advise_latency_seconds_count"), 5.0);
    assert_eq!(
        sample(&text, "kv_reuse_decisions_total{verdict=\"admit\"}"),
        2.0
    );

    // Unsubscribed: the server now has no responder for the subject.
    let err = caller
        .request(ADVISE_SUBJECT, req.to_wire().unwrap().into())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), async_nats::RequestErrorKind::NoResponders);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_every_request_routed_before_the_unsubscribe() {
    let Some(nats) = NatsServer::start_or_skip("shutdown_answers_in_flight") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let svc = service(&s);
    let server_client = async_nats::connect(nats.url()).await.unwrap();
    let server_conn = server_client.clone();
    let caller = async_nats::connect(nats.url()).await.unwrap();
    let server = AdviseServer::bind(server_client, svc).await.unwrap();

    const N: usize = 200;
    let inbox = caller.new_inbox();
    let mut replies = caller.subscribe(inbox.clone()).await.unwrap();
    for i in 0..N {
        let req = AdviseRequest {
            request_id: format!("q{i}"),
            target: s.target,
            keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
        };
        caller
            .publish_with_reply(ADVISE_SUBJECT, inbox.clone(), req.to_wire().unwrap().into())
            .await
            .unwrap();
    }
    // The server has routed all N to the (not yet running) subscription
    // once it answered this round trip.
    crate::event_plane::server_round_trip(&caller, Duration::from_secs(5))
        .await
        .unwrap();
    // ... and has delivered them to the server's connection once that
    // connection answered a round trip too (the server writes to it in
    // order; 114 of 200 had arrived without this on a loaded 2-core host).
    crate::event_plane::server_round_trip(&server_conn, Duration::from_secs(5))
        .await
        .unwrap();

    // Cancelled before the first request is read: every one of the N is
    // taken during the drain and must still be answered.
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let report = server.run(shutdown).await.unwrap();
    assert_eq!(report.received, N as u64);
    assert_eq!(report.after_shutdown, N as u64);
    assert_eq!(report.decided, N as u64);
    assert!(report.drain_confirmed, "{report:?}");

    let mut ids = std::collections::HashSet::new();
    for _ in 0..N {
        let m = tokio::time::timeout(
            Duration::from_secs(5),
            futures::StreamExt::next(&mut replies),
        )
        .await
        .expect("every drained request answered")
        .unwrap();
        let reply = AdviseReply::from_wire(&m.payload).unwrap();
        assert!(matches!(reply.result, AdviseResult::Decided { .. }));
        ids.insert(reply.request_id);
    }
    assert_eq!(ids.len(), N, "one reply per request");
}

/// A shutdown while the connection is down cannot drain through the server:
/// the report says so (`drain_confirmed: false`) after the short grace a
/// reconnect would get (1 s for the round trip after the `UNSUB`, 1 s for
/// the flush), not the 5 s + 5 s a live connection gets, and does not look
/// like a clean drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_without_the_server_is_reported_unconfirmed_and_prompt() {
    let Some(mut nats) = NatsServer::start_or_skip("a_drain_without_the_server") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let server_client = async_nats::connect(nats.url()).await.unwrap();
    let watch = server_client.clone();
    let server = AdviseServer::bind(server_client, service(&s))
        .await
        .unwrap();
    nats.stop();
    // The client notices the closed socket on its next read; the shutdown
    // below must find it down, which is the case this test is about.
    let noticed = tokio::time::timeout(Duration::from_secs(10), async {
        while watch.connection_state() == async_nats::connection::State::Connected {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(noticed.is_ok(), "the client never saw the server go");
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let t0 = std::time::Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(30), server.run(shutdown))
        .await
        .expect("the drain's waits are bounded")
        .unwrap();
    let took = t0.elapsed();
    assert!(!report.drain_confirmed, "{report:?}");
    // Two 1 s waits at most, with room for a loaded CI machine; a live
    // connection's 5 s waits would take 10 s here.
    assert!(took <= Duration::from_millis(3500), "{took:?}");
}

/// A server bound on another subject (one namespace's, `bind_on`) answers
/// there only: the default subject has no responder, and a subject it
/// cannot serve is refused naming it; the subject is carried in the errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_its_own_subject_answers_there_only() {
    let Some(nats) = NatsServer::start_or_skip("advise_server_own_subject") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    for bad in ["kv_reuse.*", "kv_reuse..advise", "", "a b"] {
        let e = AdviseServer::bind_on(client.clone(), service(&s), bad)
            .await
            .unwrap_err();
        let ServiceError::Subscribe { subject, .. } = &e else {
            panic!("{bad:?}: {e}");
        };
        assert_eq!(subject, bad);
        assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
    }
    let server = AdviseServer::bind_on(client.clone(), service(&s), "kv_reuse.ns-a.advise")
        .await
        .unwrap();
    assert_eq!(server.subject(), "kv_reuse.ns-a.advise");
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(server.run(shutdown.clone()));
    let caller = async_nats::connect(nats.url()).await.unwrap();
    let req = AdviseRequest {
        request_id: "own".into(),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    }
    .to_wire()
    .unwrap();
    let m = tokio::time::timeout(
        Duration::from_secs(5),
        caller.request("kv_reuse.ns-a.advise", req.clone().into()),
    )
    .await
    .unwrap()
    .unwrap();
    let reply = AdviseReply::from_wire(&m.payload).unwrap();
    assert_eq!(reply.request_id, "own");
    assert!(
        matches!(reply.result, AdviseResult::Decided { .. }),
        "{reply:?}"
    );
    let e = tokio::time::timeout(
        Duration::from_secs(5),
        caller.request(ADVISE_SUBJECT, req.into()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert_eq!(
        e.kind(),
        async_nats::client::RequestErrorKind::NoResponders,
        "{e}"
    );
    shutdown.cancel();
    let report = run.await.unwrap().unwrap();
    assert_eq!((report.received, report.decided), (1, 1));

    // An ended subscription names the subject it was on.
    let closing = async_nats::connect(nats.url()).await.unwrap();
    let server = AdviseServer::bind_on(closing.clone(), service(&s), "kv_reuse.ns-b.advise")
        .await
        .unwrap();
    let run = tokio::spawn(server.run(CancellationToken::new()));
    closing.drain().await.unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(
        e,
        ServiceError::SubscriptionClosed {
            subject: "kv_reuse.ns-b.advise".into()
        }
    );
}
