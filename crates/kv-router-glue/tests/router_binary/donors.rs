//! The router with worker and donor processes on NATS: the inventory
//! rebuild of a router started (or SIGKILLed and restarted) after a donor
//! went idle (issue 18), a NATS outage longer than the silence window, vLLM
//! KV event streams, and mutual TLS.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, SequenceHash, Wire};
use kv_router_glue::nats_server::NatsServer;
use kv_router_glue::service::{AdviseKeys, AdviseRequest, AdviseResult};
use kv_router_glue::{announce_subject, WorkerAnnouncement};

use crate::agents_common;
use crate::process::*;

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
    let (router, log) = spawn_router_logged(
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
    let (mut router, log) = spawn_router_logged(
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
