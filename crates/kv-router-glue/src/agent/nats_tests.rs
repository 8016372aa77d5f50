//! The donor agent in a child process; the router and the target agent in
//! this one; a real `nats-server -js` between them (NATS event plane,
//! JetStream directory, inventory over NATS request/reply) and pins over
//! loopback TCP with the key. Skipped with a printed `SKIP` reason without
//! nats-server; fails under `CI=true` (`NatsServer::start_or_skip`).
//!
//! The child is this test binary run again with [`CHILD_ENV`] set, on the
//! single test [`donor_child`], started through the workspace's child
//! harness (`kv_bank::child_process`: stdout JSON lines, stdin as a
//! lifeline, SIGKILLed if this process dies). Without the variable that
//! test returns at once: it is an entry point, not a check.

use std::sync::Arc;
use std::time::Duration;

use kv_bank::child_process::{ChildProcess, ChildStderr, ChildStdin};
use kv_bank::{sealed_blocks, BankConfig, BankMemory, DestinationPool, StoreStatus};
use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend};
use serde::{Deserialize, Serialize};

use crate::qualify::nats_server::NatsServer;
use crate::*;

const CHILD_ENV: &str = "KV_AGENT_TEST_CHILD_NATS_URL";
const TP: u32 = 2;
const TOKENS: usize = 16;
// 30 blocks: the default costs admit them (see tests/agents.rs).
const BLOCKS: usize = 30;
const ROWS: usize = 64;
const NS: &str = "agtnats";
const BUCKET: &str = "kv_agent_donors";
const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

fn layout() -> KvLayout {
    KvLayout::new(
        2,
        4,
        8,
        DType::F32,
        TOKENS as u32,
        TensorOrder::BlockMajor,
        TP,
    )
    .unwrap()
}

fn pattern(h: SequenceHash, rank: u32, i: usize) -> u8 {
    (h.0 as usize).wrapping_add(rank as usize * 97 + i) as u8
}

fn events() -> Subject {
    Subject::new(NS, "decode", "kv_events").unwrap()
}

fn blocks() -> Vec<StoredBlock> {
    let tokens: Vec<u32> = (0..(BLOCKS * TOKENS) as u32).collect();
    sealed_blocks(None, &tokens, TOKENS)
}

async fn planes(url: &str) -> (Arc<dyn EventPlane>, Arc<NatsDirectory>, Arc<NatsInventory>) {
    let plane = NatsPlane::connect(url, NatsOptions::default())
        .await
        .unwrap();
    let dir = NatsDirectory::connect(url, BUCKET, Duration::from_secs(30))
        .await
        .unwrap();
    let inventory = NatsInventory::connect(url).await.unwrap();
    (Arc::new(plane), Arc::new(dir), Arc::new(inventory))
}

/// The child's first line.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    engine_id: EngineId,
    pin_endpoint: String,
}

/// The child's last line.
#[derive(Debug, Serialize, Deserialize)]
struct Closed {
    granted: u64,
    released: u64,
}

/// Child entry point: opens a donor agent (pins on `tcp:127.0.0.1:0` with
/// [`KEY`]), serves inventory, stores [`blocks`] as 6 stores (6 events),
/// prints [`Hello`], ticks every 100 ms until stdin ends, closes, prints
/// [`Closed`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn donor_child() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (plane, dir, inventory) = planes(&url).await;
    let rbb = layout().rank_block_bytes();
    let gpus = (0..TP)
        .map(|r| GpuIdentity::new(uuid::Uuid::from_u128(u128::from(r) + 1), r, "child").unwrap())
        .collect();
    let donor = DonorAgent::open(
        DonorAgentConfig {
            worker_key: "decode-child".into(),
            bank: BankConfig::new(
                layout(),
                OwnerLease::fresh(Role::Decode),
                ROWS as u64 * u64::from(TP) * rbb as u64,
            ),
            host_id: "child".into(),
            cuda_ordinals: None,
            gpus,
            pin_endpoint: "tcp:127.0.0.1:0".into(),
            pin_auth_key: Some(PinAuthKey::from_bytes(KEY.to_vec()).unwrap()),
            pin_config: PinServiceConfig::default(),
            namespace: NS.into(),
            event_subject: events(),
            // Shorter than the history: the parent cannot replay it.
            event_ring: 2,
            record_ttl: Duration::from_secs(10),
        },
        dir,
        plane,
    )
    .await
    .unwrap();
    donor.serve_inventory(inventory).await.unwrap();
    let b = blocks();
    for (k, chunk) in b.chunks(5).enumerate() {
        let parent = (k > 0).then(|| b[k * 5 - 1].sequence_hash);
        let st = donor.store(parent, chunk).unwrap();
        let mut status = StoreStatus::Waiting { missing: vec![] };
        for rank in 0..TP {
            for (i, (h, _)) in st.entries.iter().enumerate() {
                let bytes: Vec<u8> = (0..rbb).map(|j| pattern(*h, rank, j)).collect();
                donor
                    .bank()
                    .write_pending(st.store_id, rank, i, &bytes)
                    .unwrap();
            }
            status = donor.ack(st.store_id, rank).await.unwrap();
        }
        assert_eq!(status, StoreStatus::Ready);
    }
    let hello = Hello {
        engine_id: donor.bank().owner().engine_id,
        pin_endpoint: donor.pin_endpoint().to_string(),
    };
    println!("{}", serde_json::to_string(&hello).unwrap());
    // The lifeline: stdin ends when the parent wants the close (or died).
    let mut eof = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    });
    loop {
        tokio::select! {
            _ = &mut eof => break,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                // Announcements every period: a router that starts later registers it.
                let _ = donor.tick().await;
            }
        }
    }
    let report = donor.close(Duration::from_secs(2)).await.unwrap();
    let closed = Closed {
        granted: report.pin_stats.granted,
        released: report.pin_stats.released,
    };
    println!("{}", serde_json::to_string(&closed).unwrap());
}

fn target_rows() -> (FetchExecutor, Vec<Arc<HostBuffer>>) {
    let rbb = layout().rank_block_bytes();
    let rows: Vec<Arc<HostBuffer>> = (0..TP)
        .map(|_| Arc::new(HostBuffer::zeroed(ROWS * rbb).unwrap()))
        .collect();
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(ROWS as u32),
        rows.iter()
            .map(|b| b.clone() as Arc<dyn BankMemory>)
            .collect(),
        ROWS as u32,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    (exec, rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_donor_agent_in_another_process_serves_a_router_started_later_and_a_target() {
    const TEST: &str =
        "a_donor_agent_in_another_process_serves_a_router_started_later_and_a_target";
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let url = server.url();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "agent::nats_tests::donor_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, &url);
    let mut child =
        ChildProcess::spawn_with(cmd, ChildStdin::Lifeline, ChildStderr::Capture).unwrap();
    let hello: Hello = child
        .next_json("hello", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}: {}", child.stderr_tail()));
    assert!(
        hello.pin_endpoint.starts_with("tcp:127.0.0.1:"),
        "{hello:?}"
    );

    // The router starts only now: the child's 6 events are history (its
    // ring keeps 2), and the child is idle apart from announcing.
    let (plane, dir, inventory) = planes(&url).await;
    let target_id = EngineId::fresh();
    let index = Arc::new(InventoryIndex::new());
    let info = |engine, role| WorkerInfo {
        engine,
        role,
        layout_fingerprint: layout().fingerprint(),
        tp_size: TP,
    };
    index
        .register_worker(WorkerKey(1), info(target_id, Role::Prefill))
        .unwrap();
    let remote = Arc::new(RemoteDonorDirectory::new());
    let mut receiver = KvEventReceiver::subscribe(plane.clone(), &events(), Duration::from_secs(1))
        .await
        .unwrap();
    let mut watch = dir.watch().await.unwrap();
    let mut announcements = plane
        .subscribe(&announce_subject(NS).unwrap())
        .await
        .unwrap();
    let mut registry = WorkerRegistry::new(100, 50);
    let a = loop {
        let m = announcements
            .next_timeout(Duration::from_secs(10))
            .await
            .expect("the child announces");
        let a = WorkerAnnouncement::decode(&m.payload).unwrap();
        if a.engine_id == hello.engine_id {
            break a;
        }
    };
    assert_eq!(
        a.pin_endpoint, hello.pin_endpoint,
        "the bound TCP endpoint is announced"
    );
    assert_eq!(registry.announce(a.clone(), 0), Registration::New);
    index
        .register_worker(WorkerKey(2), info(a.engine_id, a.role))
        .unwrap();
    // Its record first (a first put resets its slot map), then the snapshot.
    loop {
        let c = tokio::time::timeout(Duration::from_secs(5), watch.next())
            .await
            .expect("the child's record")
            .unwrap();
        if matches!(remote.apply_directory(c), CacheUpdate::NewGeneration { engine, .. } if engine == hello.engine_id)
        {
            break;
        }
    }
    let mut sync = InventorySync::new(inventory, NS, Duration::from_secs(5)).unwrap();
    let outcome = sync
        .rebuild_worker(hello.engine_id, &index, &remote, &registry)
        .await
        .unwrap();
    assert_eq!(
        outcome,
        SyncOutcome::Applied {
            blocks: BLOCKS,
            last_event_id: 6
        }
    );
    assert!(
        receiver
            .next_timeout(Duration::from_millis(200))
            .await
            .is_none(),
        "the child is idle"
    );

    // Pricing that admits whatever the runner's load (the lookup's wall time
    // is priced; see `admitting_settings`).
    let settings = crate::qualify::admitting_settings();
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(CostModel::new(settings, TOKENS as u32).unwrap()),
        Arc::new(DecisionLog::new(8)),
        16_384,
    );
    let h: Vec<SequenceHash> = blocks().iter().map(|b| b.sequence_hash).collect();
    let advice = advisor.advise("r1", &h, target_id);
    assert!(advice.decision.admitted(), "{}", advice.decision);
    let env = advice.hint.expect("hint");
    let hint = env.fetch_gpu_actions().unwrap().remove(0);
    assert_eq!(hint.donor_control_endpoint, hello.pin_endpoint);

    // The target, with the key, fetches exact bytes across processes.
    let (exec, rows) = target_rows();
    let target = TargetAgent::connect(exec, dir.clone(), None)
        .await
        .unwrap()
        .with_pin_auth_key(PinAuthKey::from_bytes(KEY.to_vec()).unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let fetched = loop {
        // The target's own directory watch may still be delivering the record.
        match target.fetch(&env, &h, &DeliveryControl::new()) {
            Ok(f) => break f,
            Err(AgentError::Resolve(ResolveError::UnknownDonor { .. }))
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("fetch: {e:?}"),
        }
    };
    let rbb = layout().rank_block_bytes();
    assert_eq!(fetched.fetched, h);
    for (k, &row) in fetched.target_blocks.iter().enumerate() {
        for rank in 0..TP {
            let mut buf = vec![0u8; rbb];
            rows[rank as usize]
                .read_bytes(row as usize * rbb, &mut buf)
                .unwrap();
            let want: Vec<u8> = (0..rbb).map(|i| pattern(h[k], rank, i)).collect();
            assert_eq!(buf, want, "rank {rank} block {k} crossed processes intact");
        }
    }
    drop(fetched);

    // Close: the child reports one pin granted and released, exits 0, and
    // the delete reaches the target's watch, so the retry falls back.
    child.close_lifeline();
    let closed: Closed = child
        .next_json("closed", Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e}: {}", child.stderr_tail()));
    assert_eq!((closed.granted, closed.released), (1, 1));
    let status = child
        .wait_exit(Duration::from_secs(10))
        .expect("child exits");
    assert!(status.success(), "{status:?}: {}", child.stderr_tail());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match target.fetch(&env, &h, &DeliveryControl::new()) {
            Err(AgentError::Resolve(ResolveError::UnknownDonor { donor })) => {
                assert_eq!(donor, hello.engine_id);
                break;
            }
            other => {
                assert!(std::time::Instant::now() < deadline, "still {other:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert_eq!(target.executor().pool().free_blocks(), ROWS);
    drop(server);
}

#[tokio::test]
async fn nats_inventory_answers_and_reports_no_responder_and_timeout_typed() {
    const TEST: &str = "nats_inventory_answers_and_reports_no_responder_and_timeout_typed";
    let Some(server) = NatsServer::start_or_skip(TEST) else {
        return;
    };
    let plane = NatsInventory::connect(&server.url()).await.unwrap();
    let subject = inventory_subject(NS, EngineId::fresh()).unwrap();
    let e = plane
        .request(&subject, b"x".to_vec(), Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(matches!(e, InventoryError::NoResponder { .. }), "{e:?}");
    let mut served = plane.serve(&subject).await.unwrap();
    let task = tokio::spawn(async move {
        let r = served.next().await.unwrap();
        let mut back = r.payload.clone();
        back.reverse();
        r.respond(back);
        // The second one stays unanswered.
        let _held = served.next().await.unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
    });
    let got = plane
        .request(&subject, b"abc".to_vec(), Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(got, b"cba");
    let e = plane
        .request(&subject, b"abc".to_vec(), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(e, InventoryError::Timeout { waited_ms: 200, .. }),
        "{e:?}"
    );
    task.abort();
}

/// docs/nats-permissions.conf with its environment references filled in
/// (as `tests::nats_permissions` does, without touching process env).
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
        .replace("$NATS_TARGET_PASSWORD", "target-pw");
    let path = dir.join("nats.conf");
    std::fs::write(&path, text).unwrap();
    path
}

async fn inventory_as(server: &NatsServer, user: &str, password: &str) -> NatsInventory {
    let client = async_nats::ConnectOptions::with_user_and_password(user.into(), password.into())
        .connection_timeout(Duration::from_secs(2))
        // Each role subscribes to its own inbox only (the documented config).
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .connect(server.url())
        .await
        .unwrap();
    NatsInventory::from_client(client)
}

#[tokio::test]
async fn under_the_documented_permissions_routers_ask_donors_answer_targets_may_not() {
    const TEST: &str = "under_the_documented_permissions_routers_ask_donors_answer_targets_may_not";
    // Prints SKIP (fails under CI=true) without nats-server; the probe
    // server itself is not the configured one.
    if NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let conf = permissions_config(dir.path());
    let server = NatsServer::start_with_args(&["-c", conf.to_str().unwrap()]).unwrap();
    let donor = inventory_as(&server, "donor", "donor-pw").await;
    let router = inventory_as(&server, "router", "router-pw").await;
    let target = inventory_as(&server, "target", "target-pw").await;
    let subject = inventory_subject(NS, EngineId::fresh()).unwrap();
    let mut served = donor.serve(&subject).await.unwrap();
    let task = tokio::spawn(async move {
        while let Some(r) = served.next().await {
            r.respond(b"inventory".to_vec());
        }
    });
    let got = router
        .request(&subject, b"?".to_vec(), Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(got, b"inventory", "a router asks, the donor answers");
    // The server drops a target's request (publish denied): nobody answers.
    let e = target
        .request(&subject, b"?".to_vec(), Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            InventoryError::Timeout { .. } | InventoryError::NoResponder { .. }
        ),
        "{e:?}"
    );
    task.abort();
}
