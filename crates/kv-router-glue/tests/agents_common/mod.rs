//! What the agent tests share: a TP-2 host-shm donor agent config, ready
//! stores with rank-distinct bytes, a router built only from what the planes
//! carry, and a target agent on host buffers.
//!
//! Each test binary uses a different subset, hence `dead_code` allowed.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use kv_bank::{sealed_blocks, BankConfig, BankMemory, DestinationPool, StoreStatus};
use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::*;
use kv_transfer::{HostBuffer, HostCopyBackend};

pub const TP: u32 = 2;
pub const TOKENS: usize = 16;
// 30 blocks save 30 x 80 µs = 2.4 ms, above the default 2 ms minimum.
pub const BLOCKS: usize = 30;
pub const ROWS: u32 = 64;
pub const NS: &str = "agt";

/// Runs one test body under the shared lock on a runtime built after the
/// lock is taken: a runtime's own fds (epoll, eventfd) made by a test still
/// waiting would otherwise count as the running test's leak.
pub fn serial<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = L.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body());
}

pub fn layout() -> KvLayout {
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

pub fn rbb() -> usize {
    layout().rank_block_bytes()
}

/// Byte `i` of rank `rank`'s part of block `h`: distinct per rank and block.
pub fn pattern(h: SequenceHash, rank: u32, i: usize) -> u8 {
    (h.0 as usize).wrapping_add(rank as usize * 97 + i) as u8
}

pub fn events_subject() -> Subject {
    Subject::new(NS, "decode", "kv_events").unwrap()
}

pub fn gpus() -> Vec<GpuIdentity> {
    (0..TP)
        .map(|r| GpuIdentity::new(uuid::Uuid::from_u128(u128::from(r) + 1), r, "agents").unwrap())
        .collect()
}

pub fn donor_config(worker_key: &str, endpoint: &str) -> DonorAgentConfig {
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
        pin_auth_key: None,
        pin_config: PinServiceConfig::default(),
        namespace: NS.into(),
        event_subject: events_subject(),
        event_ring: 64,
        record_ttl: Duration::from_secs(10),
    }
}

/// The prompt's sealed blocks (`first_token` varies the prompt).
pub fn prompt(first_token: u32) -> Vec<StoredBlock> {
    let tokens: Vec<u32> = (first_token..first_token + (BLOCKS * TOKENS) as u32).collect();
    sealed_blocks(None, &tokens, TOKENS)
}

/// What an engine does after a prefill: store, write every rank, ack every rank.
pub async fn store(donor: &DonorAgent, blocks: &[StoredBlock]) {
    store_after(donor, None, blocks).await
}

/// [`store`] of `blocks` whose first block is a child of `parent`.
pub async fn store_after(donor: &DonorAgent, parent: Option<SequenceHash>, blocks: &[StoredBlock]) {
    let st = donor.store(parent, blocks).unwrap();
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

/// What most agent tests start from: a temporary folder for the donors'
/// Unix-socket pin endpoints, an in-process event plane and an in-process
/// donor directory (the folder is removed when this is dropped).
pub struct Planes {
    pub sock: tempfile::TempDir,
    pub plane: Arc<dyn EventPlane>,
    pub dir: Arc<InProcessDirectory>,
}

impl Default for Planes {
    fn default() -> Self {
        Self {
            sock: tempfile::tempdir().unwrap(),
            plane: Arc::new(InProcessPlane::new()),
            dir: Arc::new(InProcessDirectory::new()),
        }
    }
}

impl Planes {
    pub fn new() -> Self {
        Self::default()
    }

    /// `unix:<folder>/<name>.sock`, a pin endpoint no other donor uses.
    pub fn endpoint(&self, name: &str) -> String {
        format!(
            "unix:{}",
            self.sock.path().join(format!("{name}.sock")).display()
        )
    }

    /// A donor agent of [`donor_config`] on these planes.
    pub async fn donor(&self, worker_key: &str, endpoint: &str) -> DonorAgent {
        DonorAgent::open(
            donor_config(worker_key, endpoint),
            self.dir.clone(),
            self.plane.clone(),
        )
        .await
        .unwrap()
    }
}

/// Stores [`prompt`]`(0)` in `donor`, lets `router` apply the events and
/// advises `target` for it: the prompt's hashes and the attached hint
/// envelope (fails the test when the advice is not admitted).
pub async fn store_and_advise(
    router: &mut Router,
    donor: &DonorAgent,
    target: EngineId,
) -> (Vec<SequenceHash>, HintEnvelope) {
    let blocks = prompt(0);
    let h = hashes(&blocks);
    store(donor, &blocks).await;
    router.pump().await;
    let advice = router.advisor.advise("r1", &h, target);
    assert!(advice.decision.admitted(), "{}", advice.decision);
    (h, advice.hint.expect("hint attached"))
}

/// A router built only from what the planes carry.
pub struct Router {
    pub index: Arc<InventoryIndex>,
    pub remote: Arc<RemoteDonorDirectory>,
    pub registry: WorkerRegistry,
    pub events: KvEventReceiver,
    pub directory: DirectoryWatch,
    pub announcements: Subscription,
    pub advisor: Advisor,
    pub late_events_ignored: usize,
    /// Every `Lost` the receiver reported: (publisher, first id, last id).
    pub lost: Vec<(EngineId, u64, u64)>,
    /// Rebuilds from inventory snapshots.
    pub sync: InventorySync,
    /// Snapshots applied, per worker: (engine, outcome).
    pub synced: Vec<(EngineId, SyncOutcome)>,
    /// Snapshot requests that failed (no server, ...), as text.
    pub sync_failures: Vec<String>,
    /// `Lost` ranges an applied snapshot already covered.
    pub lost_covered: usize,
    /// Stream events the index took as duplicates (at or below a snapshot).
    pub duplicates: usize,
}

impl Router {
    /// A router whose inventory plane has no server (snapshots fail; the
    /// event stream alone feeds the index).
    pub async fn new(
        plane: Arc<dyn EventPlane>,
        dir: &dyn DirectoryPlane,
        target: EngineId,
    ) -> Self {
        Self::with_inventory(plane, dir, target, Arc::new(InProcessInventory::new())).await
    }

    /// A router that rebuilds each newly seen worker's inventory from its
    /// snapshot over `inventory`.
    pub async fn with_inventory(
        plane: Arc<dyn EventPlane>,
        dir: &dyn DirectoryPlane,
        target: EngineId,
        inventory: Arc<dyn InventoryPlane>,
    ) -> Self {
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
        // Pricing that admits whatever the runner's load: the advisor prices
        // the lookup's wall time, and a preempted debug-build lookup took 1 to
        // 5.4 ms (past the 1 ms default budget and the default margin). At 2 ms
        // a token, even a 4-block fetch saves 128 ms.
        let settings = ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            transfer_source_lookup_budget_ms: 1_000.0,
            minimum_estimated_ttft_saving_ms: 0.0,
            transfer_source_prefill_token_us: 2_000.0,
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
            lost: Vec::new(),
            sync: InventorySync::new(inventory, NS, Duration::from_secs(1)).unwrap(),
            synced: Vec::new(),
            sync_failures: Vec::new(),
            lost_covered: 0,
            duplicates: 0,
        }
    }

    /// Pumps until `done` holds, for at most `timeout`; returns whether it held.
    pub async fn pump_until(&mut self, timeout: Duration, done: impl Fn(&Router) -> bool) -> bool {
        let end = tokio::time::Instant::now() + timeout;
        loop {
            self.pump().await;
            if done(self) {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
        }
    }

    /// Takes in everything the planes delivered so far.
    pub async fn pump(&mut self) {
        let mut registered = Vec::new();
        while let Some(m) = self
            .announcements
            .next_timeout(Duration::from_millis(20))
            .await
        {
            let a = WorkerAnnouncement::decode(&m.payload).unwrap();
            let registration = self.registry.announce(a.clone(), 0);
            match &registration {
                Registration::Replaced { dropped } => {
                    self.index.remove_worker(*dropped);
                    self.remote.forget(*dropped);
                }
                Registration::Retired
                | Registration::OtherKey { .. }
                | Registration::IdentityChanged { .. } => continue,
                // Time is 0 here: nothing is dropped for silence.
                Registration::New | Registration::Refreshed | Registration::Readmitted => {}
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
            registered.push((a, registration));
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
        // After the directory: a donor's first record resets its slot map.
        for (a, registration) in registered {
            let outcome = self
                .sync
                .on_registration(&a, &registration, &self.index, &self.remote, &self.registry)
                .await;
            self.record(a.engine_id, outcome);
        }
        while let Some(item) = self.events.next_timeout(Duration::from_millis(20)).await {
            let e = match item {
                KvStreamItem::Event(e) => e,
                KvStreamItem::Lost {
                    publisher,
                    from_event_id,
                    to_event_id,
                } => {
                    self.lost.push((publisher, from_event_id, to_event_id));
                    let outcome = self
                        .sync
                        .on_lost(
                            publisher,
                            to_event_id,
                            &self.index,
                            &self.remote,
                            &self.registry,
                        )
                        .await;
                    self.lost_covered += usize::from(outcome.is_none());
                    self.record(publisher, outcome);
                    continue;
                }
            };
            if self.registry.is_retired(e.publisher) {
                self.late_events_ignored += 1;
                continue;
            }
            let outcome = self
                .sync
                .apply_event(&e, &self.index, &self.remote, &self.registry)
                .unwrap();
            if matches!(outcome, kv_lookup::EventOutcome::Duplicate { .. }) {
                self.duplicates += 1;
            }
        }
    }

    /// Records a rebuild's outcome (nothing when none was asked).
    fn record(&mut self, engine: EngineId, outcome: Option<Result<SyncOutcome, InventoryError>>) {
        match outcome {
            None => {}
            Some(Ok(o)) => self.synced.push((engine, o)),
            Some(Err(e)) => self.sync_failures.push(e.to_string()),
        }
    }
}

/// A target agent on host buffers, and those buffers to check bytes.
pub async fn target(dir: Arc<dyn DirectoryPlane>) -> (TargetAgent, Vec<Arc<HostBuffer>>) {
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

pub fn assert_rows_hold(rows: &[Arc<HostBuffer>], out: &FetchOutcome) {
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

pub fn hashes(blocks: &[StoredBlock]) -> Vec<SequenceHash> {
    blocks.iter().map(|b| b.sequence_hash).collect()
}
