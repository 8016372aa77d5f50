//! [`AdviseClient`] against a real nats-server and the router's
//! [`DedicatedAdviseServer`]: decisions and typed refusals, bad arguments,
//! no responders, and the keep-alive of an idle client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, Wire};

use super::*;
use crate::qualify::nats_server::NatsServer;
use crate::qualify::{Scenario, DONOR_BLOCKS, TARGET_BASELINE};
use crate::NatsOptions;

fn service(s: &Scenario) -> Arc<RouterService> {
    let advisor = s.advisor(crate::qualify::admitting_settings()).unwrap();
    let svc = RouterService::new(Arc::new(advisor));
    svc.add_target(s.target);
    Arc::new(svc)
}

/// A runtime for the server side only; the client under test is driven
/// from the test's own (non-async) thread.
fn server_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn start_server(rt: &tokio::runtime::Runtime, url: &str, s: &Scenario) -> DedicatedAdviseServer {
    rt.block_on(DedicatedAdviseServer::start(
        url,
        NatsOptions::default(),
        service(s),
        DedicatedOptions::default(),
    ))
    .unwrap()
}

fn connect(url: &str, subject: &str) -> AdviseClient {
    AdviseClient::connect(
        url,
        async_nats::ConnectOptions::new(),
        subject,
        Duration::from_secs(5),
    )
    .unwrap()
}

#[test]
fn bad_arguments_and_an_unreachable_server_are_typed_errors() {
    let opts = async_nats::ConnectOptions::new;
    let e = AdviseClient::connect("nats://127.0.0.1:1", opts(), "a b", Duration::from_secs(1));
    assert_eq!(
        e.unwrap_err(),
        AdviseClientError::Subject {
            subject: "a b".into(),
            reason: "it contains whitespace",
        }
    );
    // A wildcard or an empty token is refused before anything connects,
    // not left to fail every advise with "no responders".
    for (subject, why) in [
        ("kv_reuse.>", "wildcard"),
        ("kv_reuse.*.advise", "wildcard"),
        ("kv_reuse..advise", "empty token"),
        (".kv_reuse", "empty token"),
        ("", "empty"),
    ] {
        let e = AdviseClient::connect(
            "nats://127.0.0.1:1",
            opts(),
            subject,
            Duration::from_secs(1),
        )
        .unwrap_err();
        match &e {
            AdviseClientError::Subject { subject: s, reason } => {
                assert_eq!(s, subject);
                assert!(reason.contains(why), "{subject:?}: {e}");
            }
            other => panic!("{subject:?}: {other:?}"),
        }
    }
    let e = AdviseClient::connect("nats://127.0.0.1:1", opts(), ADVISE_SUBJECT, Duration::ZERO);
    assert_eq!(e.unwrap_err(), AdviseClientError::Timeout);
    let t0 = Instant::now();
    let e = AdviseClient::connect(
        "nats://127.0.0.1:1",
        opts(),
        ADVISE_SUBJECT,
        Duration::from_millis(500),
    )
    .unwrap_err();
    assert!(
        matches!(
            &e,
            AdviseClientError::Connect { url, .. } | AdviseClientError::ConnectTimeout { url, .. }
                if url == "nats://127.0.0.1:1"
        ),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[test]
fn decides_refuses_and_reports_no_responders() {
    let Some(nats) = NatsServer::start_or_skip("advise_client_decides") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let rt = server_runtime();
    let server = start_server(&rt, &nats.url(), &s);
    let mut client = connect(&nats.url(), ADVISE_SUBJECT);
    assert_eq!(client.connection_count(), 1);

    let req = AdviseRequest {
        request_id: "c1".into(),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    };
    let reply = client.advise(&req).unwrap();
    assert_eq!(reply.request_id, "c1");
    let AdviseResult::Decided { decision, hint } = reply.result else {
        panic!("refused: {reply:?}");
    };
    assert!(decision.admitted(), "{decision}");
    assert_eq!(
        decision.terms.unwrap().transfer_blocks,
        (DONOR_BLOCKS - TARGET_BASELINE) as u64
    );
    assert_eq!(hint.expect("hint when admitted").message_id, "c1");

    let stranger = EngineId(uuid::Uuid::from_u128(7));
    let reply = client
        .advise(&AdviseRequest {
            request_id: "c2".into(),
            target: stranger,
            ..req.clone()
        })
        .unwrap();
    assert_eq!(
        reply.result,
        AdviseResult::Refused(AdviseRefusal::UnknownTarget(stranger))
    );

    // Raw bytes: the server's typed refusal comes back as a reply.
    let raw = client.request(vec![0xc1, 0x00]).unwrap();
    let reply = AdviseReply::from_wire(&raw).unwrap();
    assert!(
        matches!(
            reply.result,
            AdviseResult::Refused(AdviseRefusal::Malformed(_))
        ),
        "{reply:?}"
    );

    // Nothing subscribes here: NATS says "no responders" at once.
    let lonely = connect(&nats.url(), "kv_reuse.nobody");
    let t0 = Instant::now();
    let e = lonely.advise(&req).unwrap_err();
    assert!(
        matches!(&e, AdviseClientError::Request { subject, .. } if subject == "kv_reuse.nobody"),
        "{e:?}"
    );
    // Said once: async-nats' kind and source are both "no responders".
    assert_eq!(e.to_string(), "advise on kv_reuse.nobody: no responders");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());

    client.close();
    client.close();
    assert!(!client.is_open());
    assert_eq!(client.connection_count(), 0);
    assert_eq!(client.advise(&req).unwrap_err(), AdviseClientError::Closed);
    let report = rt.block_on(server.stop()).unwrap();
    assert_eq!((report.decided, report.refused), (1, 2));
}

#[test]
fn an_idle_client_answers_server_pings_and_keeps_its_connection() {
    // The server pings every 250 ms and drops a client with one ping
    // unanswered at the next: an idle client nobody drives is gone after
    // ~500 ms and reconnects on its next call.
    let dir = std::env::temp_dir().join(format!("kv-advise-client-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("ping.conf");
    std::fs::write(&conf, "ping_interval: \"250ms\"\nping_max: 1\n").unwrap();
    if let Err(e) = crate::qualify::nats_server::find_nats_server() {
        if kv_transfer::ci_requires() {
            panic!("advise client keep-alive: {e}, under CI");
        }
        println!("SKIP an_idle_client_answers_server_pings: {e}");
        return;
    }
    let nats = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    let s = Scenario::new().unwrap();
    let rt = server_runtime();
    let server = start_server(&rt, &nats.url(), &s);
    let client = connect(&nats.url(), ADVISE_SUBJECT);
    let req = AdviseRequest {
        request_id: "idle".into(),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    };
    client.advise(&req).unwrap();
    std::thread::sleep(Duration::from_millis(2_000));
    let reply = client.advise(&req).unwrap();
    assert!(
        matches!(reply.result, AdviseResult::Decided { .. }),
        "{reply:?}"
    );
    assert_eq!(
        client.connection_count(),
        1,
        "the idle client was dropped as stale and reconnected"
    );
    drop(client);
    rt.block_on(server.stop()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn busy_polling_ends_answer_and_still_time_out_and_shut_down() {
    let Some(nats) = NatsServer::start_or_skip("advise_client_busy_poll") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let rt = server_runtime();
    let server = rt
        .block_on(DedicatedAdviseServer::start(
            &nats.url(),
            NatsOptions::default(),
            service(&s),
            DedicatedOptions {
                busy_poll: Duration::from_millis(200),
                ..DedicatedOptions::default()
            },
        ))
        .unwrap();
    let mut client = connect(&nats.url(), ADVISE_SUBJECT);
    client.set_busy_poll(Duration::from_millis(50));
    for i in 0..20 {
        let req = AdviseRequest {
            request_id: format!("spin-{i}"),
            target: s.target,
            keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
        };
        let reply = client.advise(&req).unwrap();
        assert!(
            matches!(reply.result, AdviseResult::Decided { hint: Some(_), .. }),
            "{reply:?}"
        );
    }

    // A responder that never answers: the spin (50 ms) ends, the timeout
    // (300 ms) still fires.
    let silent = rt.block_on(async {
        let c = async_nats::connect(nats.url()).await.unwrap();
        let sub = c.subscribe("kv_reuse.silent").await.unwrap();
        c.flush().await.unwrap();
        (c, sub)
    });
    let mut waiting = AdviseClient::connect(
        &nats.url(),
        async_nats::ConnectOptions::new(),
        "kv_reuse.silent",
        Duration::from_millis(300),
    )
    .unwrap();
    waiting.set_busy_poll(Duration::from_millis(50));
    let t0 = Instant::now();
    let e = waiting.request(vec![1, 2, 3]).unwrap_err();
    let took = t0.elapsed();
    assert_eq!(
        e,
        AdviseClientError::NoReply {
            subject: "kv_reuse.silent".into(),
            timeout: Duration::from_millis(300)
        }
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    drop(silent);

    // Stopped inside the spin window: the loop still sees the shutdown.
    let t0 = Instant::now();
    let report = rt.block_on(server.stop()).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(
        (report.received, report.decided, report.refused),
        (20, 20, 0)
    );
}

/// A server list reaches its live server even when another one hangs (a
/// dead host whose packets are dropped; here a listener that never says
/// `INFO`). async-nats tries the servers in random order, each for the
/// options' connection timeout; that was `timeout` itself, the bound of the
/// whole connect, so whenever the hung server came first the connect timed
/// out before the live one was tried (about one call in two).
#[test]
fn a_server_list_with_a_hung_server_connects_to_the_live_one() {
    let Some(nats) = NatsServer::start_or_skip("advise_client_server_list") else {
        return;
    };
    // Accepted by the kernel's backlog, never answered.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("nats://{},{}", hung.local_addr().unwrap(), nats.url());
    for attempt in 0..6 {
        let options = NatsOptions::default().connect_options(&url).unwrap();
        let c = AdviseClient::connect(&url, options, ADVISE_SUBJECT, Duration::from_secs(2));
        assert!(c.is_ok(), "attempt {attempt}: {:?}", c.err());
    }
}

/// One client shared by 8 threads (the wheel's `RouterClient` in an
/// executor): every request gets its own reply, all decided, none lost or
/// crossed, each thread driving the current-thread runtime in turn.
#[test]
fn one_client_serves_several_threads_at_once() {
    let Some(nats) = NatsServer::start_or_skip("advise_client_threads") else {
        return;
    };
    let s = Scenario::new().unwrap();
    let rt = server_runtime();
    let server = start_server(&rt, &nats.url(), &s);
    let client = Arc::new(connect(&nats.url(), ADVISE_SUBJECT));
    const THREADS: usize = 8;
    const EACH: usize = 50;
    let t0 = Instant::now();
    let answered: Vec<usize> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (client, s) = (&client, &s);
                scope.spawn(move || {
                    let mut ok = 0;
                    for i in 0..EACH {
                        let req = AdviseRequest {
                            request_id: format!("t{t}-{i}"),
                            target: s.target,
                            keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
                        };
                        let reply = client.advise(&req).unwrap();
                        assert_eq!(reply.request_id, req.request_id);
                        ok += usize::from(matches!(
                            reply.result,
                            AdviseResult::Decided { hint: Some(_), .. }
                        ));
                    }
                    ok
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert_eq!(answered, vec![EACH; THREADS]);
    // 400 round trips of well under 1 ms each; the 5 s request timeout
    // would show as minutes if any thread waited for another's reply.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let report = rt.block_on(server.stop()).unwrap();
    assert_eq!(report.decided, (THREADS * EACH) as u64);
}
