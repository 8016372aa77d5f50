//! Worker agents in one process over the in-process planes: a donor agent
//! stores blocks, a router (kv-lookup index + advisor over a
//! `RemoteDonorDirectory` fed only by the planes) advises, a target agent
//! fetches exact bytes; after the donor closes its record is gone and the
//! next advise and fetch fall back; a new incarnation under the same worker
//! key replaces the old one.
//!
//! Tests share one lock: host shm names, leases and the leak counters
//! (open fds included) are process-wide.

use std::sync::Arc;
use std::time::Duration;

use kv_bank::{sealed_blocks, BankConfig, BankMemory, DestinationPool, StoreStatus};
use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::*;
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend};

const TP: u32 = 2;
const TOKENS: usize = 16;
// 30 blocks save 30 x 80 µs = 2.4 ms, above the default 2 ms minimum.
const BLOCKS: usize = 30;
const ROWS: u32 = 64;
const NS: &str = "agt";

/// Runs one test body under the shared lock on a runtime built after the
/// lock is taken: a runtime's own fds (epoll, eventfd) made by a test still
/// waiting would otherwise count as the running test's leak.
fn serial<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = L.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body());
}

fn layout() -> KvLayout {
    // 16-token blocks: the default costs admit them (16 x 30 µs > 400 µs).
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

fn rbb() -> usize {
    layout().rank_block_bytes()
}

/// Byte `i` of rank `rank`'s part of block `h`: distinct per rank and block.
fn pattern(h: SequenceHash, rank: u32, i: usize) -> u8 {
    (h.0 as usize).wrapping_add(rank as usize * 97 + i) as u8
}

fn events_subject() -> Subject {
    Subject::new(NS, "decode", "kv_events").unwrap()
}

fn gpus() -> Vec<GpuIdentity> {
    (0..TP)
        .map(|r| GpuIdentity::new(uuid::Uuid::from_u128(u128::from(r) + 1), r, "agents").unwrap())
        .collect()
}

fn donor_config(worker_key: &str, endpoint: &str) -> DonorAgentConfig {
    DonorAgentConfig {
        worker_key: worker_key.into(),
        bank: BankConfig::new(
            layout(),
            OwnerLease::fresh(Role::Decode),
            64 * u64::from(TP) * rbb() as u64,
        ),
        host_id: "agents".into(),
        cuda_ordinals: None,
        gpus: gpus(),
        pin_endpoint: endpoint.into(),
        pin_config: PinServiceConfig::default(),
        namespace: NS.into(),
        event_subject: events_subject(),
        event_ring: 64,
        record_ttl: Duration::from_secs(10),
    }
}

/// The prompt's sealed blocks (`first_token` varies the prompt).
fn prompt(first_token: u32) -> Vec<StoredBlock> {
    let tokens: Vec<u32> = (first_token..first_token + (BLOCKS * TOKENS) as u32).collect();
    sealed_blocks(None, &tokens, TOKENS)
}

/// What an engine does after a prefill: store, write every rank, ack every rank.
async fn store(donor: &DonorAgent, blocks: &[StoredBlock]) {
    let st = donor.store(None, blocks).unwrap();
    for rank in 0..TP {
        for (index, (h, _)) in st.entries.iter().enumerate() {
            let bytes: Vec<u8> = (0..rbb()).map(|i| pattern(*h, rank, i)).collect();
            donor
                .bank()
                .write_pending(st.store_id, rank, index, &bytes)
                .unwrap();
        }
    }
    let mut status = StoreStatus::Waiting { missing: vec![] };
    for rank in 0..TP {
        status = donor.ack(st.store_id, rank).await.unwrap();
    }
    assert_eq!(status, StoreStatus::Ready);
}

/// A router built only from what the planes carry.
struct Router {
    index: Arc<InventoryIndex>,
    remote: Arc<RemoteDonorDirectory>,
    registry: WorkerRegistry,
    events: KvEventReceiver,
    directory: DirectoryWatch,
    announcements: Subscription,
    advisor: Advisor,
    late_events_ignored: usize,
}

impl Router {
    async fn new(plane: Arc<dyn EventPlane>, dir: &dyn DirectoryPlane, target: EngineId) -> Self {
        let index = Arc::new(InventoryIndex::new());
        index
            .register_worker(
                WorkerKey(1_000),
                WorkerInfo {
                    engine: target,
                    role: Role::Prefill,
                    layout_fingerprint: layout().fingerprint(),
                    tp_size: TP,
                },
            )
            .unwrap();
        let remote = Arc::new(RemoteDonorDirectory::new());
        let settings = ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            ..ReuseSettings::default()
        };
        let model = CostModel::new(settings, TOKENS as u32).unwrap();
        let advisor = Advisor::new(
            index.clone(),
            remote.clone(),
            LiveCostModel::new(model),
            Arc::new(DecisionLog::new(64)),
            16_384,
        );
        Self {
            events: KvEventReceiver::subscribe(
                plane.clone(),
                &events_subject(),
                Duration::from_secs(1),
            )
            .await
            .unwrap(),
            directory: dir.watch().await.unwrap(),
            announcements: plane
                .subscribe(&announce_subject(NS).unwrap())
                .await
                .unwrap(),
            registry: WorkerRegistry::new(1_000, 3),
            index,
            remote,
            advisor,
            late_events_ignored: 0,
        }
    }

    /// Takes in everything the planes delivered so far.
    async fn pump(&mut self) {
        while let Some(m) = self
            .announcements
            .next_timeout(Duration::from_millis(20))
            .await
        {
            let a = WorkerAnnouncement::decode(&m.payload).unwrap();
            match self.registry.announce(a.clone(), 0) {
                Registration::Replaced { dropped } => {
                    self.index.remove_worker(dropped);
                    self.remote.forget(dropped);
                }
                Registration::Retired => continue,
                Registration::New | Registration::Refreshed => {}
            }
            self.index
                .register_worker(
                    WorkerKey(xxhash_rust::xxh3::xxh3_64(a.worker_key.as_bytes())),
                    WorkerInfo {
                        engine: a.engine_id,
                        role: a.role,
                        layout_fingerprint: a.layout_fingerprint,
                        tp_size: a.tp_size,
                    },
                )
                .unwrap();
        }
        while let Some(c) = self.directory.try_next() {
            // A retired incarnation's renewals must not bring it back.
            if let DirectoryChange::Put(r) = &c {
                if self.registry.is_retired(r.engine_id()) {
                    continue;
                }
            }
            self.remote.apply_directory(c);
        }
        while let Some(item) = self.events.next_timeout(Duration::from_millis(20)).await {
            let KvStreamItem::Event(e) = item else {
                panic!("no gap expected in one process: {item:?}")
            };
            if self.registry.is_retired(e.publisher) {
                self.late_events_ignored += 1;
                continue;
            }
            self.index.apply_event(&e).unwrap();
            self.remote.ingest_event(&e);
        }
    }
}

/// A target agent on host buffers, and those buffers to check bytes.
async fn target(dir: &dyn DirectoryPlane) -> (TargetAgent, Vec<Arc<HostBuffer>>) {
    let rows: Vec<Arc<HostBuffer>> = (0..TP)
        .map(|_| Arc::new(HostBuffer::zeroed(ROWS as usize * rbb()).unwrap()))
        .collect();
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(ROWS),
        rows.iter()
            .map(|b| b.clone() as Arc<dyn BankMemory>)
            .collect(),
        ROWS,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    (TargetAgent::connect(exec, dir, None).await.unwrap(), rows)
}

fn assert_rows_hold(rows: &[Arc<HostBuffer>], out: &FetchOutcome) {
    assert_eq!(out.target_blocks.len(), out.fetched.len());
    for (k, &row) in out.target_blocks.iter().enumerate() {
        for rank in 0..TP {
            let mut buf = vec![0u8; rbb()];
            rows[rank as usize]
                .read_bytes(row as usize * rbb(), &mut buf)
                .unwrap();
            let want: Vec<u8> = (0..rbb())
                .map(|i| pattern(out.fetched[k], rank, i))
                .collect();
            assert_eq!(buf, want, "rank {rank} row {row} holds block {k}'s bytes");
        }
    }
}

fn hashes(blocks: &[StoredBlock]) -> Vec<SequenceHash> {
    blocks.iter().map(|b| b.sequence_hash).collect()
}

#[test]
fn donor_stores_router_advises_target_fetches_then_close_falls_back() {
    serial(|| async {
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let (tgt, rows) = target(dir.as_ref()).await;
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let before = kv_bank::leaks::snapshot();

        let donor = DonorAgent::open(donor_config("decode-0", &ep), dir.clone(), plane.clone())
            .await
            .unwrap();
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&donor, &blocks).await;
        router.pump().await;
        assert_eq!(router.registry.len(), 1, "the donor announced itself");
        let donor_id = donor.bank().owner().engine_id;

        let advice = router.advisor.advise("r1", &h, target_id);
        assert!(advice.decision.admitted(), "{}", advice.decision);
        let env = advice.hint.expect("hint attached");
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        assert_eq!(hint.donor_engine_id, donor_id);
        assert_eq!(hint.donor_control_endpoint, ep, "the record's pin endpoint");
        assert_eq!(hint.sequence_hashes, h);

        let out = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap();
        assert_eq!(out.fetched, h[hint.fetch_from as usize..].to_vec());
        assert_eq!(out.fetched.len(), BLOCKS, "nothing was on the target");
        assert_eq!(
            out.report.counters.bytes,
            (BLOCKS * TP as usize * rbb()) as u64
        );
        assert_rows_hold(&rows, &out);
        drop(out);

        // A hint for another prompt is refused before the donor is touched.
        let other = hashes(&prompt(7));
        let e = tgt
            .fetch(&env, &other, &DeliveryControl::new())
            .unwrap_err();
        assert!(
            matches!(e, AgentError::Fetch(FetchError::PromptMismatch { .. })),
            "{e:?}"
        );

        let report = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(report.pin_stats.granted, 1, "one fetch, one pin");
        assert_eq!(report.pin_stats.released, 1);
        assert_eq!(report.events_published, 1, "the bank's Cleared");
        router.pump().await;
        let again = router.advisor.advise("r2", &h, target_id);
        assert!(again.hint.is_none(), "closed donor: {}", again.decision);
        let e = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Resolve(ResolveError::UnknownDonor { donor }) if donor == donor_id
            ),
            "{e:?}"
        );
        assert_eq!(tgt.executor().pool().free_blocks(), ROWS as usize);
        let leaks = kv_bank::leaks::snapshot().leaks_since(&before);
        assert!(leaks.is_empty(), "leaked: {leaks:?}");
    });
}

#[test]
fn a_new_incarnation_under_the_same_worker_key_replaces_the_old_one() {
    serial(|| async {
        let sock = tempfile::tempdir().unwrap();
        let ep_a = format!("unix:{}", sock.path().join("a.sock").display());
        let ep_b = format!("unix:{}", sock.path().join("b.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let (tgt, rows) = target(dir.as_ref()).await;
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;

        let old = DonorAgent::open(donor_config("decode-0", &ep_a), dir.clone(), plane.clone())
            .await
            .unwrap();
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&old, &blocks).await;
        router.pump().await;
        let old_id = old.bank().owner().engine_id;
        assert!(!router.index.holds(old_id, h[0]).is_empty());

        // The worker restarts under the same key (the old incarnation is not
        // closed: a crash, whose record is still in the directory).
        let new = DonorAgent::open(donor_config("decode-0", &ep_b), dir.clone(), plane.clone())
            .await
            .unwrap();
        let new_id = new.bank().owner().engine_id;
        store(&new, &blocks).await;
        router.pump().await;
        assert!(router.registry.is_retired(old_id));
        assert!(
            router.index.holds(old_id, h[0]).is_empty(),
            "old inventory dropped"
        );

        let env = router
            .advisor
            .advise("r1", &h, target_id)
            .hint
            .expect("hint");
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        assert_eq!(hint.donor_engine_id, new_id, "the new incarnation donates");
        assert_eq!(hint.donor_control_endpoint, ep_b);
        let out = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap();
        assert_rows_hold(&rows, &out);
        drop(out);

        // The old incarnation's late events and renewals change nothing.
        let late = prompt(100);
        store(&old, &late).await;
        old.tick().await.unwrap();
        router.pump().await;
        assert_eq!(router.late_events_ignored, 1);
        assert!(router.index.holds(old_id, late[0].sequence_hash).is_empty());
        let e = router
            .remote
            .resolve(old_id, &h[..1])
            .expect_err("the old incarnation is forgotten");
        assert!(matches!(e, ResolveError::UnknownDonor { .. }), "{e:?}");

        old.close(Duration::from_secs(1)).await.unwrap();
        new.close(Duration::from_secs(1)).await.unwrap();
    });
}

#[test]
fn the_record_is_re_put_before_it_lapses_and_a_lapsed_one_is_refused() {
    serial(|| async {
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = Duration::from_millis(300);
        let donor = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap();
        let mut watch = dir.watch().await.unwrap();
        let Some(DirectoryChange::Put(first)) = watch.try_next() else {
            panic!("the open put the record")
        };
        assert_eq!(
            first.lease_expires_unix_ms() - first.published_unix_ms(),
            300
        );
        // Before a third of the TTL: no re-put.
        donor.tick().await.unwrap();
        assert!(watch.try_next().is_none(), "renewed too early");
        tokio::time::sleep(Duration::from_millis(120)).await;
        donor.tick().await.unwrap();
        let Some(DirectoryChange::Put(renewed)) = watch.try_next() else {
            panic!("a third of the TTL passed: re-put")
        };
        assert!(renewed.lease_expires_unix_ms() > first.lease_expires_unix_ms());

        // A target whose clock is past the lease refuses the record.
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&donor, &blocks).await;
        let rows: Vec<Arc<dyn BankMemory>> = (0..TP)
            .map(|_| {
                Arc::new(HostBuffer::zeroed(ROWS as usize * rbb()).unwrap()) as Arc<dyn BankMemory>
            })
            .collect();
        let exec = FetchExecutor::new(
            layout(),
            DestinationPool::new(ROWS),
            rows,
            ROWS,
            Arc::new(HostCopyBackend),
        )
        .unwrap();
        let late = renewed.lease_expires_unix_ms();
        let tgt = TargetAgent::connect_with_clock(exec, dir.as_ref(), None, move || late)
            .await
            .unwrap();
        let slots: Vec<u32> = h.iter().map(|x| donor.bank().lookup(x).unwrap()).collect();
        let hint = FetchGpuHint {
            donor_engine_id: donor.bank().owner().engine_id,
            bank_generation: donor.bank().owner().generation,
            layout_fingerprint: layout().fingerprint(),
            tp_size: TP,
            sequence_hashes: h.clone(),
            fetch_from: 0,
            parts: (0..TP)
                .map(|r| FetchPart {
                    tp_rank: r,
                    slot_ids: slots.clone(),
                    expected_bytes: (slots.len() * rbb()) as u64,
                })
                .collect(),
            donor_control_endpoint: ep.clone(),
        };
        let env = HintEnvelope::fetch_gpu("r1", "a0", &hint).unwrap();
        let e = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap_err();
        assert!(
            matches!(e, AgentError::Resolve(ResolveError::LeaseLapsed { .. })),
            "{e:?}"
        );
        let stats = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(stats.pin_stats.granted, 0, "a lapsed record asks no pin");
    });
}

#[test]
fn bad_donor_configs_are_refused_naming_the_field_and_open_nothing() {
    serial(|| async {
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let before = kv_bank::leaks::snapshot();

        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = Duration::ZERO;
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::InvalidConfig {
                    field: "record_ttl",
                    ..
                }
            ),
            "{e:?}"
        );

        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = cfg.bank.lease.duration + Duration::from_millis(1);
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::InvalidConfig {
                    field: "record_ttl",
                    ..
                }
            ),
            "{e:?}"
        );

        let mut cfg = donor_config("decode-0", &ep);
        cfg.gpus.pop();
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Announcement(AnnouncementError::InvalidField { field: "gpus", .. })
            ),
            "{e:?}"
        );

        let cfg = donor_config("decode-0", "tcp:127.0.0.1:1");
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, AgentError::PinService(_)), "{e:?}");

        let mut w = dir.watch().await.unwrap();
        assert!(w.try_next().is_none(), "no record was put");
        let leaks = kv_bank::leaks::snapshot().leaks_since(&before);
        assert!(leaks.is_empty(), "a refused open leaked: {leaks:?}");
    });
}
