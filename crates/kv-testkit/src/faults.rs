//! Fault matrix of the serving path (issue #11): every fault is injected for
//! real into a fetch between a decode donor's retained bank and a prefill
//! target, and each run is checked, not assumed:
//!
//! - **fell back**: the fetch was refused or abandoned and the request
//!   recomputed its prompt;
//! - **correct outputs**: output tokens and first logits (bit for bit) equal
//!   the OFF run's (the same prompt computed from scratch);
//! - **no false completion**: the executor never reported a completed fetch;
//! - **destination untouched**: no fetched row reached the request's cache,
//!   every destination row is free again (none reserved or orphaned) and,
//!   for faults that strike before the first byte, the staging rows still
//!   hold their poison pattern byte for byte;
//! - **no leaks**: a [`kv_bank::leaks`] snapshot (file descriptors, this
//!   process's `/dev/shm/kv*` entries, shm and IPC mappings, device
//!   allocations, pins, reserved rows, leases, background threads) taken
//!   before the run's setup equals one taken after its teardown, and no
//!   `/dev/shm` entry of the run's unique name prefix survives (that also
//!   covers a child donor's segments).
//!
//! | fault | injected by | expected |
//! | --- | --- | --- |
//! | `donor_killed_mid_transfer` | SIGKILL of a child process owning the TP2 host-shm bank (the target pinned its slots through the child's pin service), from inside the rank-1 copy | liveness probe fails after the last byte; lease lapses; [`kv_bank::reclaim_stale`] removes its segments |
//! | `sigterm_during_transfer` | SIGTERM to that child from inside the rank-1 copy; it stops its pin service (the target's pin is dropped after a 100 ms drain), closes its bank (lease revoked, segments unlinked) and exits 0 | delivery refused (lease gone), nothing left in `/dev/shm` |
//! | `cancel_at_lookup` | the request's token fires the first time the donor lookup asks, inside its walk of the index | lookup stops (`NoDonorReason::Cancelled`), refused as `Cancelled`, no hint, nothing reserved |
//! | `cancel_at_reserve` | cancelled right after destination rows were reserved (when the donor is asked to pin) | refused before the first byte |
//! | `cancel_at_transfer` | cancelled from inside the rank-1 copy | refused after the parts |
//! | `cancel_at_verify` | cancelled after the last byte of the last part landed | refused by the final check |
//! | `deadline_passed` | 30 ms deadline, rank 1 stalls 60 ms | `DeadlineExceeded` |
//! | `rank_part_fails` | rank 1's part errors | whole delivery fails |
//! | `missing_keys` | the donor evicted the hinted blocks between advice and fetch | pin refused (slot holds another block) |
//! | `fetch_stale_generation` | the donor closed its bank and opened the next generation between advice and fetch | hint refused before memory (`StaleGeneration`) |
//! | `allocation_failure` | the target's destination pool cannot supply the rows | refused at `reserve` |
//! | `duplicated_events` | a `Stored` event delivered again after the blocks were removed | the duplicate is ignored: no hint for removed blocks |
//! | `reordered_events` | `Removed` delivered before the `Stored` it follows | gap: donor excluded until resync; the late `Stored` is ignored |
//! | `gapped_events` | one `Stored` event lost | gap: donor excluded (no hint) until resync, then the fetch completes |
//! | `nats_server_restart` | a real `nats-server` killed and restarted on the same port while the donor publishes | clients reconnect, the receiver's gap resync (or a full resync on `Lost`) restores the whole inventory, then the fetch completes |
//! | `link_cut_mid_transfer` | donor child in its own network namespace ([`crate::netns`]), read through NIXL with UCX over TCP on a veth pair; the link goes down when rank 1's part starts | after a control fetch over the link completes: `DeadlineExceeded`; the stalled reads stay in flight, so their rows stay orphaned until the link is back and the reads end, then return to the pool (see [`link_cut`]) |
//! | `none` (control) | nothing | the fetch completes: proves the checks can see a completion |
//!
//! For the event-plane rows (`*_events`, `nats_server_restart`) "fell back"
//! means the router did not trust the damaged inventory: while it was
//! damaged the request got no hint for blocks the donor does not hold and
//! recomputed; each run also requires the repair to work (the index equals
//! the bank's inventory afterwards and a fetch then completes correctly).
//!
//! GPU memory: the rows above move host shared memory on every profile; on
//! the GPU profile kvq adds the device rows of [`gpu`] (donor killed
//! mid-transfer over CUDA IPC, cancel, deadline, control), which move CUDA
//! device memory and also check device free bytes and IPC mappings.
//!
//! Runs are serialized by a process-wide lock, because leak snapshots are
//! process-wide.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use kv_bank::{
    check_descriptor_lease, sealed_blocks, BankConfig, BankManager, BankMemory, DestinationPool,
    LeaseConfig, StoreStatus,
};
use kv_descriptor::{
    BankManifest, EngineId, FetchGpuHint, FetchPart, HintEnvelope, KvEvent, KvLayout, OwnerLease,
    Role, SequenceHash, StorageTier, Wire,
};
use kv_lookup::{EventOutcome, InventoryIndex, WorkerKey};
use kv_router_glue::nats_server::{find_nats_server, NatsServer};
use kv_router_glue::{
    Advice, DonorPin, DonorSource, EventPlane, FetchExecutor, KvEventPublisher, KvEventReceiver,
    KvStreamItem, NatsOptions, NatsPlane, PublisherHeader, ReuseSettings, Subject,
};
use kv_transfer::plan::PartPlan;
use kv_transfer::{
    CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, PartOutcome, RankIo, TransferError,
};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::engines::{prompt_hashes, EngineError, Router};
use crate::model::{KvCache, ModelConfig, ModelError, ReferenceModel};
use crate::trace::splitmix64;

pub use kv_bank::FaultRow;

pub mod gpu;
pub use link_cut::{net_child_main, CUT_DEADLINE, NET_CHILD_ROLE, QUIESCE_WINDOW};

pub mod link_cut;

/// The `kvq child` role of the donor child process ([`child_main`]).
pub const CHILD_ROLE: &str = "fault-donor";

/// TP size of every scenario (two parts, so one can fail alone).
const TP: u32 = 2;
/// Output tokens per turn.
const OUTPUT_TOKENS: usize = 12;
/// Byte every staging row holds before a fetch (to prove rows untouched).
const POISON: u8 = 0xA5;
/// Lease of the child donor's bank: short, so a killed owner lapses fast.
const CHILD_LEASE_MS: u64 = 300;
/// A child never outlives this, even if the parent dies without killing it.
const CHILD_MAX_LIFE: Duration = Duration::from_secs(60);

/// Why a fault run could not be set up (a fallback is not an error).
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// Setting up the engines failed (model, bank or router): the same
    /// failures the engines report.
    #[error(transparent)]
    Setup(#[from] EngineError),
    /// The donor child process failed to start or to report.
    #[error("donor child: {0}")]
    Child(String),
    /// NATS setup failed (including a missing `nats-server` under `CI=true`).
    #[error("nats: {0}")]
    Nats(String),
    /// The fault cannot run here (e.g. no `nats-server` outside CI), with the reason.
    #[error("skipped: {0}")]
    Skipped(String),
}

impl From<ModelError> for FaultError {
    fn from(e: ModelError) -> Self {
        Self::Setup(EngineError::Model(e))
    }
}

fn bank_err(op: &'static str) -> impl Fn(kv_bank::BankError) -> FaultError {
    move |e| {
        FaultError::Setup(EngineError::Bank {
            op,
            reason: e.to_string(),
        })
    }
}

fn router_err(op: &'static str) -> impl Fn(String) -> FaultError {
    move |reason| FaultError::Setup(EngineError::Router { op, reason })
}

/// One injectable fault (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Control run: no fault; the fetch must complete.
    None,
    /// SIGKILL of the donor child process while rank 1 copies.
    DonorKilledMidTransfer,
    /// SIGTERM of the donor child process while rank 1 copies.
    SigtermDuringTransfer,
    /// Cancelled during donor lookup.
    CancelAtLookup,
    /// Cancelled once destination rows are reserved.
    CancelAtReserve,
    /// Cancelled while rank 1 copies.
    CancelAtTransfer,
    /// Cancelled after the last byte landed.
    CancelAtVerify,
    /// The delivery's deadline passes while rank 1 stalls.
    DeadlinePassed,
    /// Rank 1's part fails.
    RankPartFails,
    /// The donor evicted the hinted blocks.
    MissingKeys,
    /// The donor moved to its next bank generation.
    StaleBankGeneration,
    /// The destination pool is exhausted.
    AllocationFailure,
    /// A stale `Stored` event delivered twice.
    DuplicatedEvents,
    /// `Removed` delivered before the `Stored` it follows.
    ReorderedEvents,
    /// A `Stored` event lost.
    GappedEvents,
    /// The NATS server restarted mid-run.
    NatsServerRestart,
    /// The donor is another host (network namespace, NIXL over UCX/TCP) and
    /// the link is cut between the rank parts of a fetch.
    LinkCutMidTransfer,
}

impl Fault {
    /// Every fault of the matrix, control run last.
    pub const ALL: [Fault; 17] = [
        Fault::DonorKilledMidTransfer,
        Fault::SigtermDuringTransfer,
        Fault::CancelAtLookup,
        Fault::CancelAtReserve,
        Fault::CancelAtTransfer,
        Fault::CancelAtVerify,
        Fault::DeadlinePassed,
        Fault::RankPartFails,
        Fault::MissingKeys,
        Fault::StaleBankGeneration,
        Fault::AllocationFailure,
        Fault::DuplicatedEvents,
        Fault::ReorderedEvents,
        Fault::GappedEvents,
        Fault::NatsServerRestart,
        Fault::LinkCutMidTransfer,
        Fault::None,
    ];

    /// Faults that run in this process alone (no child, no server): the soak's pool.
    pub const IN_PROCESS: [Fault; 13] = [
        Fault::None,
        Fault::CancelAtLookup,
        Fault::CancelAtReserve,
        Fault::CancelAtTransfer,
        Fault::CancelAtVerify,
        Fault::DeadlinePassed,
        Fault::RankPartFails,
        Fault::MissingKeys,
        Fault::StaleBankGeneration,
        Fault::AllocationFailure,
        Fault::DuplicatedEvents,
        Fault::ReorderedEvents,
        Fault::GappedEvents,
    ];

    /// Row name in the fault table (`record.json` `faults[].fault`).
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::DonorKilledMidTransfer => "donor_killed_mid_transfer",
            Fault::SigtermDuringTransfer => "sigterm_during_transfer",
            Fault::CancelAtLookup => "cancel_at_lookup",
            Fault::CancelAtReserve => "cancel_at_reserve",
            Fault::CancelAtTransfer => "cancel_at_transfer",
            Fault::CancelAtVerify => "cancel_at_verify",
            Fault::DeadlinePassed => "deadline_passed",
            Fault::RankPartFails => "rank_part_fails",
            Fault::MissingKeys => "missing_keys",
            Fault::StaleBankGeneration => "fetch_stale_generation",
            Fault::AllocationFailure => "allocation_failure",
            Fault::DuplicatedEvents => "duplicated_events",
            Fault::ReorderedEvents => "reordered_events",
            Fault::GappedEvents => "gapped_events",
            Fault::NatsServerRestart => "nats_server_restart",
            Fault::LinkCutMidTransfer => "link_cut_mid_transfer",
        }
    }

    /// True when the fault needs a donor child process ([`ChildCommand`]).
    pub fn needs_child(self) -> bool {
        matches!(
            self,
            Fault::DonorKilledMidTransfer
                | Fault::SigtermDuringTransfer
                | Fault::LinkCutMidTransfer
        )
    }

    /// True when no payload byte may have been written to the staging rows.
    fn strikes_before_first_byte(self) -> bool {
        matches!(
            self,
            Fault::CancelAtLookup
                | Fault::CancelAtReserve
                | Fault::MissingKeys
                | Fault::StaleBankGeneration
                | Fault::AllocationFailure
        )
    }
}

/// How to start the donor child: `exe args... <role args>` must reach
/// [`child_main`] (kvq: `kvq child fault-donor ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildCommand {
    /// Executable.
    pub exe: PathBuf,
    /// Arguments placed before the role's own arguments.
    pub args: Vec<String>,
}

impl ChildCommand {
    /// `exe child fault-donor` (the kvq convention).
    pub fn kvq(exe: impl Into<PathBuf>) -> Self {
        Self {
            exe: exe.into(),
            args: vec!["child".into(), CHILD_ROLE.into()],
        }
    }
    /// [`ChildCommand::kvq`] of the running executable (call it from kvq).
    pub fn current_kvq() -> Self {
        Self::kvq(std::env::current_exe().unwrap_or_else(|_| PathBuf::from("kvq")))
    }

    /// [`ChildCommand::args`] with the donor role ([`CHILD_ROLE`]) replaced
    /// by `role` (e.g. [`NET_CHILD_ROLE`]); appended when absent.
    pub fn args_for_role(&self, role: &str) -> Vec<String> {
        let mut args = self.args.clone();
        match args.iter_mut().find(|a| *a == CHILD_ROLE) {
            Some(a) => *a = role.to_string(),
            None => args.push(role.to_string()),
        }
        args
    }
}

/// What one injected run observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunOutcome {
    /// The fault.
    pub fault: Fault,
    /// The request recomputed instead of using fetched blocks (for event
    /// faults: got no hint while the inventory was damaged, and the repair worked).
    pub fell_back: bool,
    /// The executor reported a completed fetch.
    pub completed: bool,
    /// Output tokens and first logits equal the OFF run's.
    pub outputs_match: bool,
    /// Destination rows free, nothing imported, poison intact where required.
    pub destination_untouched: bool,
    /// Leaked resources (`resource: before -> after`).
    pub leaks: Vec<String>,
    /// Fallback reason or what went wrong.
    pub detail: String,
}

impl RunOutcome {
    /// The run ended as its fault requires: fallback (or, for
    /// [`Fault::None`], completion), correct outputs, destination
    /// untouched on fallback, nothing leaked.
    pub fn passed(&self) -> bool {
        let ended_right = if self.fault == Fault::None {
            self.completed
        } else {
            self.fell_back && !self.completed && self.destination_untouched
        };
        ended_right && self.outputs_match && self.leaks.is_empty()
    }
}

// ------------------------------------------------------------ scenario ---

static RUN_LOCK: Mutex<()> = Mutex::new(());

/// Serializes runs: leak snapshots are process-wide.
fn run_lock() -> MutexGuard<'static, ()> {
    RUN_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The default reference model, shared by every run of a process.
fn shared_model() -> Result<Arc<ReferenceModel>, FaultError> {
    static MODEL: std::sync::OnceLock<Arc<ReferenceModel>> = std::sync::OnceLock::new();
    if let Some(m) = MODEL.get() {
        return Ok(m.clone());
    }
    let m = Arc::new(ReferenceModel::new(ModelConfig::default())?);
    Ok(MODEL.get_or_init(|| m).clone())
}

/// `kvfault<pid>x<n>x<nanos>`: unique per run and process, without dashes
/// so that bank segment names (`<prefix>-<pid>-<n>-<hex>`) parse.
fn unique_prefix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "kvfault{}x{}x{nanos:08x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Token `pos` of conversation `seed`'s text `part` (0: first prompt, 1: follow-up).
fn text(seed: u64, part: u64, len: usize, vocab: u32) -> Vec<u32> {
    let key = splitmix64(seed.wrapping_mul(0x9E37) ^ (part << 56));
    (0..len as u64)
        .map(|p| (splitmix64(key ^ p) % u64::from(vocab)) as u32)
        .collect()
}

/// A two-turn conversation: turn 0 ran (its KV is retained by the donor),
/// turn 1 is the request under test.
#[derive(Debug, Clone)]
struct Conversation {
    /// Turn 0 prompt + output, as far as its K/V was computed.
    retained_tokens: Vec<u32>,
    /// Turn 1 prompt.
    prompt: Vec<u32>,
}

/// Computes turn 0 of conversation `seed` and returns it with its cache.
fn conversation(model: &ReferenceModel, seed: u64) -> Result<(Conversation, KvCache), FaultError> {
    let vocab = model.config().vocab;
    let first = 40 + (splitmix64(seed) % 40) as usize;
    let follow = 8 + (splitmix64(seed ^ 1) % 16) as usize;
    let prompt0 = text(seed, 0, first, vocab);
    let mut cache = model.new_cache(TP)?;
    let g = model.generate(&mut cache, &prompt0, OUTPUT_TOKENS)?;
    let mut history = prompt0;
    history.extend(&g.tokens);
    let retained_tokens = history[..cache.len_tokens()].to_vec();
    let mut prompt = history;
    prompt.extend(text(seed, 1, follow, vocab));
    Ok((
        Conversation {
            retained_tokens,
            prompt,
        },
        cache,
    ))
}

/// Result of serving one request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Served {
    tokens: Vec<u32>,
    logits_bits: Vec<u32>,
}

fn generate(
    model: &ReferenceModel,
    mut cache: KvCache,
    prompt: &[u32],
) -> Result<Served, FaultError> {
    let start = cache.len_tokens();
    let g = model.generate(&mut cache, &prompt[start..], OUTPUT_TOKENS)?;
    Ok(Served {
        tokens: g.tokens,
        logits_bits: g.first_logits.iter().map(|f| f.to_bits()).collect(),
    })
}

/// Stores every sealed block of `tokens` (K/V from `cache`) in `bank`,
/// every rank written and acked; returns the bank's events.
fn retain(bank: &BankManager, cache: &KvCache, tokens: &[u32]) -> Result<Vec<KvEvent>, FaultError> {
    let layout = *cache.layout();
    let blocks = sealed_blocks(None, tokens, layout.tokens_per_block() as usize);
    let store = bank.store(None, &blocks).map_err(bank_err("store"))?;
    let index: HashMap<SequenceHash, usize> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| (b.sequence_hash, i))
        .collect();
    for rank in 0..layout.tp_size() {
        for (e, (h, _slot)) in store.entries.iter().enumerate() {
            let parts = cache.export_blocks(index[h], 1)?;
            bank.write_pending(store.store_id, rank, e, &parts[rank as usize])
                .map_err(bank_err("write_pending"))?;
        }
        let status = bank.ack(store.store_id, rank).map_err(bank_err("ack"))?;
        if rank + 1 == layout.tp_size() && !store.is_empty() && status != StoreStatus::Ready {
            return Err(FaultError::Setup(EngineError::Bank {
                op: "ack",
                reason: format!("store {} not ready after every rank acked", store.store_id),
            }));
        }
    }
    Ok(bank.drain_events())
}

fn host_bank(
    layout: KvLayout,
    owner: OwnerLease,
    slots: u64,
    prefix: &str,
    lease: LeaseConfig,
) -> Result<BankManager, FaultError> {
    let budget = slots * u64::from(layout.tp_size()) * layout.rank_block_bytes() as u64;
    let mut cfg = BankConfig::new(layout, owner, budget);
    cfg.shm_prefix = prefix.to_string();
    cfg.lease = lease;
    BankManager::new_host_shm(cfg, "fault-host").map_err(bank_err("new"))
}

/// The prefill target: destination pool, staging rows (host buffers or
/// device allocations, one per rank), fetch executor.
struct Target {
    layout: KvLayout,
    pool: DestinationPool,
    staging: Vec<Arc<dyn BankMemory>>,
    executor: FetchExecutor,
    rows: u32,
}

impl Target {
    /// Host staging rows (the CPU profile).
    fn new(layout: KvLayout, rows: u32, backend: Arc<dyn CopyBackend>) -> Result<Self, FaultError> {
        let rbb = layout.rank_block_bytes();
        let mut staging: Vec<Arc<dyn BankMemory>> = Vec::new();
        for _ in 0..layout.tp_size() {
            let b = HostBuffer::zeroed(rows as usize * rbb)
                .map_err(|e| router_err("staging")(e.to_string()))?;
            staging.push(Arc::new(b));
        }
        Self::with_staging(layout, rows, staging, backend)
    }

    /// Staging rows in `staging` (rank `r` in `staging[r]`, `rows` blocks
    /// each), filled with [`POISON`] first.
    fn with_staging(
        layout: KvLayout,
        rows: u32,
        staging: Vec<Arc<dyn BankMemory>>,
        backend: Arc<dyn CopyBackend>,
    ) -> Result<Self, FaultError> {
        let poison = vec![POISON; rows as usize * layout.rank_block_bytes()];
        for m in &staging {
            m.write_bytes(0, &poison)
                .map_err(bank_err("poison staging"))?;
        }
        let pool = DestinationPool::new(rows);
        let executor = FetchExecutor::new(layout, pool.clone(), staging.clone(), rows, backend)
            .map_err(|e| router_err("executor")(e.to_string()))?;
        Ok(Self {
            layout,
            pool,
            staging,
            executor,
            rows,
        })
    }

    /// True when every staging byte still holds [`POISON`] (a row that
    /// cannot be read back counts as touched).
    fn poison_intact(&self) -> bool {
        self.staging.iter().all(|m| {
            let mut back = vec![0u8; m.len()];
            m.read_bytes(0, &mut back).is_ok() && back.iter().all(|&x| x == POISON)
        })
    }

    fn rows_free(&self) -> bool {
        self.pool.free_blocks() == self.rows as usize && self.pool.orphaned_blocks() == 0
    }

    /// Runs the hint (if any) and serves the request: fetched prefix (read
    /// back from the staging rows; the reference model runs on the CPU) +
    /// the rest computed. Returns (served, completed, fallback reason). On
    /// device staging, a completed fetch that moved payload through the host
    /// is reported as a fallback reason too.
    fn serve(
        &self,
        model: &ReferenceModel,
        prompt: &[u32],
        hint: Option<&HintEnvelope>,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<(Served, bool, Option<String>), FaultError> {
        let mut cache = KvCache::new(self.layout);
        let mut completed = false;
        let mut fallback = None;
        if let Some(env) = hint {
            match self.executor.execute(env, donor, control) {
                Ok(outcome) => {
                    completed = true;
                    let rbb = self.layout.rank_block_bytes();
                    for (j, row) in outcome.target_blocks.iter().enumerate() {
                        let mut parts = Vec::with_capacity(self.staging.len());
                        for m in &self.staging {
                            let mut b = vec![0u8; rbb];
                            m.read_bytes(*row as usize * rbb, &mut b)
                                .map_err(bank_err("staging read"))?;
                            parts.push(b);
                        }
                        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                        cache.import_blocks(outcome.fetch_from as usize + j, &refs)?;
                    }
                    let device = self
                        .staging
                        .iter()
                        .any(|m| matches!(m.kind(), kv_bank::MemoryKind::Cuda { .. }));
                    let host = outcome.report.counters.host_payload_bytes;
                    if device && host != 0 {
                        fallback = Some(format!("host payload {host} bytes on the device path"));
                    }
                }
                Err(e) => fallback = Some(e.to_string()),
            }
        }
        Ok((generate(model, cache, prompt)?, completed, fallback))
    }
}

/// The router side: an [`engines::Router`](crate::engines::Router) (real
/// index, advisor and donor directory) with the fault runs' settings.
struct FaultRouter {
    router: Router,
}

impl FaultRouter {
    fn new(tokens_per_block: u32) -> Result<Self, FaultError> {
        Self::with_settings(Self::settings(), tokens_per_block)
    }

    /// Reuse on, every prefix worth fetching, admission that a loaded
    /// machine cannot tip: the settings of every fault run, host and GPU.
    fn settings() -> ReuseSettings {
        ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            minimum_estimated_ttft_saving_ms: 0.0,
            minimum_transfer_prefix_blocks: 1,
            // Generous: a lookup descheduled on a loaded machine must not
            // turn a fault run into a "no donor" run.
            transfer_source_lookup_budget_ms: 50.0,
            // The measured lookup time counts against the saving; a 20-minute
            // soak on a loaded 2-core machine saw 9 of 14,744 lookups
            // descheduled long enough to refuse a 3-block prefix at the
            // default token cost. Fault runs exercise the fetch, not
            // admission (kv-router-glue's cost tests do), so recompute is
            // priced high enough that no scheduling delay refuses it.
            transfer_source_prefill_token_us: 10_000.0,
            ..ReuseSettings::default()
        }
    }

    fn with_settings(settings: ReuseSettings, tokens_per_block: u32) -> Result<Self, FaultError> {
        let router = Router::new(settings, tokens_per_block).map_err(FaultError::Setup)?;
        Ok(Self { router })
    }

    fn index(&self) -> &Arc<InventoryIndex> {
        self.router.index()
    }

    /// Makes `bank` resolvable as a donor.
    fn add_donor(&self, bank: Arc<BankManager>) {
        self.router.add_donor(bank);
    }

    /// The fault runs' two workers: a fresh prefill target (key 1) and
    /// `bank`'s decode engine (key 2), which becomes a donor; returns the
    /// target's engine id.
    fn connect(&self, bank: &Arc<BankManager>, layout: &KvLayout) -> Result<EngineId, FaultError> {
        let target_engine = EngineId::fresh();
        for (key, engine, role) in [
            (1, target_engine, Role::Prefill),
            (2, bank.owner().engine_id, Role::Decode),
        ] {
            self.router
                .register_key(WorkerKey(key), engine, role, layout)
                .map_err(FaultError::Setup)?;
        }
        self.add_donor(bank.clone());
        Ok(target_engine)
    }

    fn apply(&self, events: &[KvEvent]) -> Vec<EventOutcome> {
        self.router.apply_with_outcomes(events)
    }

    fn advise(&self, request_id: &str, hashes: &[SequenceHash], target: EngineId) -> Advice {
        self.router.advise_hashes(request_id, hashes, target)
    }

    fn advise_cancellable(
        &self,
        request_id: &str,
        hashes: &[SequenceHash],
        target: EngineId,
        cancelled: &dyn Fn() -> bool,
    ) -> Advice {
        self.router
            .advise_hashes_cancellable(request_id, hashes, target, cancelled)
    }

    /// Replaces the donor's inventory with the bank's (gap repair).
    fn resync(&self, bank: &BankManager, last_event_id: u64) -> Result<(), FaultError> {
        self.index()
            .resync_worker(
                bank.owner().engine_id,
                last_event_id,
                &[(StorageTier::RetainedGpuDirect, bank.inventory().ready)],
            )
            .map_err(|e| router_err("resync_worker")(e.to_string()))
    }

    /// True when the index lists every ready block of `bank` as retained by it.
    fn holds_all(&self, bank: &BankManager) -> bool {
        let engine = bank.owner().engine_id;
        bank.inventory().ready.iter().all(|h| {
            self.index()
                .holds(engine, *h)
                .contains(&StorageTier::RetainedGpuDirect)
        })
    }

    fn holds_any(&self, engine: EngineId, hashes: &[SequenceHash]) -> bool {
        hashes
            .iter()
            .any(|h| !self.index().holds(engine, *h).is_empty())
    }
}

// ------------------------------------------------------------- injection ---

type Action = Arc<dyn Fn() + Send + Sync>;

/// The deadline-passed rows' stall inside a rank's part: twice the
/// [`deadline_from_now`] budget.
fn stall() -> Action {
    Arc::new(|| std::thread::sleep(Duration::from_millis(60)))
}

/// `control` with a 30 ms deadline starting now, so only the stalled rank
/// ([`stall`]) can miss it.
fn deadline_from_now(control: DeliveryControl) -> DeliveryControl {
    let now = Instant::now();
    DeliveryControl {
        started: now,
        deadline: Some(now + Duration::from_millis(30)),
        ..control
    }
}

/// Where a [`FaultBackend`] strikes.
#[derive(Clone)]
enum Strike {
    /// Nothing: a plain host copy.
    Never,
    /// Run the action, then copy, when rank `r`'s part starts.
    BeforeRank(u32, Action),
    /// Copy, then run the action once every part has copied.
    AfterAll(Action),
    /// Rank `r`'s part fails without copying.
    FailRank(u32),
}

/// A copy backend with one injected fault around its parts.
struct FaultBackend {
    inner: Arc<dyn CopyBackend>,
    strike: Strike,
    parts_done: AtomicU32,
    tp: u32,
}

impl FaultBackend {
    fn new(inner: Arc<dyn CopyBackend>, strike: Strike, tp: u32) -> Self {
        Self {
            inner,
            strike,
            parts_done: AtomicU32::new(0),
            tp,
        }
    }

    /// Host memcpy with `strike` (the CPU profile's rows).
    fn host(strike: Strike) -> Self {
        Self::new(Arc::new(HostCopyBackend), strike, TP)
    }
}

impl CopyBackend for FaultBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        match &self.strike {
            Strike::FailRank(r) if *r == part.tp_rank => {
                return Err(TransferError::Host(format!("injected failure of rank {r}")))
            }
            Strike::BeforeRank(r, act) if *r == part.tp_rank => act(),
            _ => {}
        }
        let out = self.inner.copy_part(part, io, control)?;
        if let Strike::AfterAll(act) = &self.strike {
            if self.parts_done.fetch_add(1, Ordering::AcqRel) + 1 == self.tp {
                act();
            }
        }
        Ok(out)
    }
}

/// A donor whose `pin` first runs a hook (to inject between reserve and pin).
struct HookedDonor<'a> {
    inner: &'a dyn DonorSource,
    on_pin: Action,
}

impl DonorSource for HookedDonor<'_> {
    fn manifest(&self) -> &BankManifest {
        self.inner.manifest()
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, String> {
        (self.on_pin)();
        self.inner.pin(hint)
    }
}

/// Leak snapshot plus the run's `/dev/shm` prefix.
struct LeakProbe {
    before: kv_bank::LeakSnapshot,
    prefix: String,
}

impl LeakProbe {
    fn start(prefix: &str) -> Self {
        Self {
            before: kv_bank::leaks::snapshot(),
            prefix: prefix.to_string(),
        }
    }

    /// Leaks now; retries for up to 1 s so that a resource released by a
    /// thread that is exiting is not counted, while one that stays is.
    fn finish(self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let mut leaks: Vec<String> = kv_bank::leaks::snapshot()
                .leaks_since(&self.before)
                .iter()
                .map(|l| l.to_string())
                .collect();
            let left = shm_entries(&self.prefix);
            if !left.is_empty() {
                leaks.push(format!("shm entries of the run: {left:?}"));
            }
            if leaks.is_empty() || Instant::now() >= deadline {
                return leaks;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn shm_entries(prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(kv_bank::SHM_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

// ------------------------------------------------------------- runners ---

/// Runs `fault` once with conversation `seed`. `child` is required for
/// [`Fault::needs_child`] faults.
///
/// # Errors
/// [`FaultError`] when the run could not be set up (including
/// [`FaultError::Skipped`] for a missing `nats-server` outside CI); a
/// fallback or a failed check is a [`RunOutcome`], not an error.
///
/// ```no_run
/// use kv_testkit::faults::{run_fault, Fault};
/// let o = run_fault(Fault::RankPartFails, 7, None).unwrap();
/// assert!(o.passed(), "{o:?}");
/// ```
pub fn run_fault(
    fault: Fault,
    seed: u64,
    child: Option<&ChildCommand>,
) -> Result<RunOutcome, FaultError> {
    let _guard = run_lock();
    if fault == Fault::NatsServerRestart {
        warm_tokio_globals();
    }
    if fault == Fault::LinkCutMidTransfer {
        link_cut::warm_nixl_globals();
    }
    let prefix = unique_prefix();
    let probe = LeakProbe::start(&prefix);
    let result = match fault {
        Fault::DonorKilledMidTransfer | Fault::SigtermDuringTransfer => {
            let child = child.ok_or_else(|| {
                FaultError::Child(format!("{} needs a child command", fault.name()))
            })?;
            child_fault(fault, seed, child, &prefix)
        }
        Fault::DuplicatedEvents | Fault::ReorderedEvents | Fault::GappedEvents => {
            event_fault(fault, seed, &prefix)
        }
        Fault::NatsServerRestart => nats_restart(seed, &prefix),
        Fault::LinkCutMidTransfer => {
            let child = child.ok_or_else(|| {
                FaultError::Child(format!("{} needs a child command", fault.name()))
            })?;
            link_cut::link_cut(seed, child, &prefix)
        }
        _ => fetch_fault(fault, seed, &prefix),
    };
    // Everything of the run was dropped inside the runner: compare now.
    let leaks = probe.finish();
    result.map(|mut o| {
        o.leaks = leaks;
        o
    })
}

/// Tokio's signal driver opens a process-wide self-pipe (two fds) the first
/// time a runtime with signals is built, and keeps it for the life of the
/// process. Building one runtime before the first snapshot keeps that
/// one-time allocation out of the leak count.
fn warm_tokio_globals() {
    static WARM: std::sync::Once = std::sync::Once::new();
    WARM.call_once(|| {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(async {});
        }
    });
}

fn outcome(fault: Fault) -> RunOutcome {
    RunOutcome {
        fault,
        fell_back: false,
        completed: false,
        outputs_match: false,
        destination_untouched: false,
        leaks: Vec::new(),
        detail: String::new(),
    }
}

/// In-process donor bank + router + target; the fault strikes the fetch.
fn fetch_fault(fault: Fault, seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let (conv, cache) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let donor_blocks = (conv.retained_tokens.len() / bs as usize) as u64;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        donor_blocks,
        prefix,
        LeaseConfig::default(),
    )?);
    let events = retain(&bank, &cache, &conv.retained_tokens)?;
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    router.apply(&events);

    let control = DeliveryControl::new();
    let cancel = control.cancel.clone();
    let fire: Action = Arc::new(move || cancel.cancel());
    let strike = match fault {
        Fault::CancelAtTransfer => Strike::BeforeRank(1, fire.clone()),
        Fault::CancelAtVerify => Strike::AfterAll(fire.clone()),
        Fault::DeadlinePassed => Strike::BeforeRank(1, stall()),
        Fault::RankPartFails => Strike::FailRank(1),
        _ => Strike::Never,
    };
    let rows = (conv.prompt.len() / bs as usize) as u32 + 2;
    let target = Target::new(layout, rows, Arc::new(FaultBackend::host(strike)))?;

    let hashes = prompt_hashes(&conv.prompt, bs as usize);
    let request_id = format!("fault-{seed}");
    let advice = if fault == Fault::CancelAtLookup {
        // The cancellation arrives while the lookup walks the index: the
        // first time the lookup asks, the token fires.
        router.advise_cancellable(&request_id, &hashes, target_engine, &|| {
            fire();
            control.cancel.is_cancelled()
        })
    } else {
        router.advise(&request_id, &hashes, target_engine)
    };
    let mut o = outcome(fault);
    if fault == Fault::CancelAtLookup {
        let cancelled_inside = matches!(
            advice.lookup.map(|l| l.donor),
            Some(Err(kv_lookup::NoDonorReason::Cancelled { .. }))
        );
        let refused = advice.decision.verdict
            == kv_router_glue::Verdict::Refuse(kv_router_glue::RefuseReason::Cancelled);
        let (served, completed, _) = target.serve(
            &model,
            &conv.prompt,
            advice.hint.as_ref(),
            bank.as_ref(),
            &control,
        )?;
        o.completed = completed;
        o.fell_back = cancelled_inside && refused && advice.hint.is_none() && !completed;
        o.outputs_match = served == off;
        o.destination_untouched = target.rows_free() && target.poison_intact();
        o.detail = format!(
            "lookup cancelled inside the walk: {cancelled_inside}; verdict {:?}",
            advice.decision.verdict
        );
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    }
    let Some(env) = advice.hint.clone() else {
        // The fault was never injected; the request still recomputes, and
        // its outputs are checked like any other.
        let (served, _, _) = target.serve(&model, &conv.prompt, None, bank.as_ref(), &control)?;
        o.outputs_match = served == off;
        o.detail = format!("no hint: {:?}", advice.decision.verdict);
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    };
    // Faults that strike between advice and fetch.
    let mut bank_now = bank.clone();
    let mut blocker = None;
    match fault {
        Fault::MissingKeys => {
            // The donor stores another conversation of the same size: every
            // hinted slot is evicted and reused.
            let other = text(
                seed ^ 0xDEAD,
                2,
                conv.retained_tokens.len(),
                model.config().vocab,
            );
            let mut other_cache = model.new_cache(TP)?;
            model.prefill(&mut other_cache, &other)?;
            let ev = retain(&bank, &other_cache, &other[..other_cache.len_tokens()])?;
            router.apply(&ev);
        }
        Fault::StaleBankGeneration => {
            bank.close(Duration::from_secs(1))
                .map_err(bank_err("close"))?;
            let next = Arc::new(host_bank(
                layout,
                bank.owner().next_generation(),
                donor_blocks,
                prefix,
                LeaseConfig::default(),
            )?);
            router.add_donor(next.clone());
            bank_now = next;
        }
        Fault::AllocationFailure => {
            // Other fetches hold all but one row.
            blocker = Some(
                target
                    .pool
                    .reserve(rows as usize - 1)
                    .map_err(bank_err("reserve"))?,
            );
        }
        _ => {}
    }
    let hook_fire = fire.clone();
    let hooked = HookedDonor {
        inner: bank_now.as_ref(),
        on_pin: if fault == Fault::CancelAtReserve {
            hook_fire
        } else {
            Arc::new(|| {})
        },
    };
    let control = if fault == Fault::DeadlinePassed {
        deadline_from_now(control)
    } else {
        control
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &hooked, &control)?;
    if let Some(b) = blocker.take() {
        b.cancel().quiesced();
    }
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    o.destination_untouched = target.rows_free()
        && (completed || !fault.strikes_before_first_byte() || target.poison_intact());
    o.detail = fallback.unwrap_or_else(|| "fetch completed".into());
    drop(hooked);
    drop(target);
    drop(router);
    if !bank_now.is_closed() {
        bank_now
            .close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
    }
    Ok(o)
}

/// Damaged KV event streams into the real index.
fn event_fault(fault: Fault, seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let (a, cache_a) = conversation(&model, seed)?;
    let (b, cache_b) = conversation(&model, seed.wrapping_add(0x5EED))?;
    let slots = ((a.retained_tokens.len() + b.retained_tokens.len()) / bs as usize) as u64 + 2;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::default(),
    )?);
    let ev_a = retain(&bank, &cache_a, &a.retained_tokens)?;
    let ev_b = retain(&bank, &cache_b, &b.retained_tokens)?;
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    let donor = bank.owner().engine_id;
    let b_hashes = prompt_hashes(&b.prompt, bs as usize);
    let b_retained: Vec<SequenceHash> = sealed_blocks(None, &b.retained_tokens, bs as usize)
        .iter()
        .map(|x| x.sequence_hash)
        .collect();

    let mut all_events = [&ev_a[..], &ev_b[..]].concat();
    let mut o = outcome(fault);
    let mut notes = Vec::new();
    let damaged_ok = match fault {
        Fault::GappedEvents => {
            // A's Stored event is lost; B's arrives with a gap.
            let out = router.apply(&ev_b);
            notes.push(format!("{out:?}"));
            matches!(out.first(), Some(EventOutcome::Gap { .. }))
        }
        Fault::DuplicatedEvents | Fault::ReorderedEvents => {
            // B's blocks leave the bank (a Removed event).
            bank.exclude(&b_retained);
            let ev_rm = bank.drain_events();
            all_events.extend(ev_rm.iter().cloned());
            let out = if fault == Fault::DuplicatedEvents {
                router.apply(&[ev_a.clone(), ev_b.clone(), ev_rm, ev_b.clone()].concat())
            } else {
                router.apply(&[ev_a.clone(), ev_rm, ev_b.clone()].concat())
            };
            notes.push(format!("{out:?}"));
            // The stale Stored must not resurrect B in the index.
            !router.holds_any(donor, &b_retained)
                && matches!(out.last(), Some(EventOutcome::Duplicate { .. }))
        }
        _ => unreachable!("event_fault called with {fault:?}"),
    };
    let target = Target::new(
        layout,
        (b.prompt.len() / bs as usize) as u32 + 2,
        Arc::new(HostCopyBackend),
    )?;
    let off_b = generate(&model, KvCache::new(layout), &b.prompt)?;
    // While damaged: B's request must get no hint (and recompute).
    let advice = router.advise("damaged", &b_hashes, target_engine);
    let damaged_hint = advice.hint.is_some();
    let (served, completed, fallback) = target.serve(
        &model,
        &b.prompt,
        advice.hint.as_ref(),
        bank.as_ref(),
        &DeliveryControl::new(),
    )?;
    let damaged_match = served == off_b;
    // Repair: resync the donor from its bank, then the fetch works again
    // (B itself is gone from the bank after an exclusion; A is fetched then).
    let last_id = all_events.iter().map(|e| e.event_id).max().unwrap_or(0);
    router.resync(&bank, last_id)?;
    let repaired = router.holds_all(&bank) && router.index().workers_needing_resync().is_empty();
    let probe_conv = if fault == Fault::GappedEvents { &b } else { &a };
    let off_probe = generate(&model, KvCache::new(layout), &probe_conv.prompt)?;
    let advice = router.advise(
        "repaired",
        &prompt_hashes(&probe_conv.prompt, bs as usize),
        target_engine,
    );
    let no_hint2 = advice
        .hint
        .is_none()
        .then(|| format!("no hint: {:?}", advice.decision.verdict));
    let (served2, completed2, fallback2) = target.serve(
        &model,
        &probe_conv.prompt,
        advice.hint.as_ref(),
        bank.as_ref(),
        &DeliveryControl::new(),
    )?;
    o.fell_back = damaged_ok && !damaged_hint && repaired && completed2;
    o.completed = completed;
    o.outputs_match = damaged_match && served2 == off_probe;
    o.destination_untouched = target.rows_free() && !completed;
    o.detail = format!(
        "damaged: {}; hint while damaged: {damaged_hint}; repaired: {repaired}; \
         fetch after repair: {completed2} {}; {}",
        notes.join(" "),
        fallback2.or(no_hint2).unwrap_or_default(),
        fallback.unwrap_or_default()
    );
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    Ok(o)
}

/// A real `nats-server` restarted while the donor publishes KV events.
fn nats_restart(seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    if find_nats_server().is_none() {
        let reason = "nats-server not found (set KV_NATS_SERVER or add it to PATH)";
        if std::env::var("CI").as_deref() == Ok("true") {
            return Err(FaultError::Nats(format!("{reason} and CI=true")));
        }
        return Err(FaultError::Skipped(reason.into()));
    }
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let convs: Vec<(Conversation, KvCache)> = (0..3u64)
        .map(|i| conversation(&model, seed.wrapping_add(i * 0x101)))
        .collect::<Result<_, _>>()?;
    let slots: u64 = convs
        .iter()
        .map(|(c, _)| (c.retained_tokens.len() / bs as usize) as u64)
        .sum::<u64>()
        + 2;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::default(),
    )?);
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    let target = Target::new(
        layout,
        (convs[1].0.prompt.len() / bs as usize) as u32 + 2,
        Arc::new(HostCopyBackend),
    )?;
    let mut server = NatsServer::start().map_err(FaultError::Nats)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| FaultError::Nats(format!("runtime: {e}")))?;
    let mut o = outcome(Fault::NatsServerRestart);
    let result = rt.block_on(nats_scenario(
        &mut server,
        &bank,
        &router,
        &target,
        &model,
        &convs,
        target_engine,
    ));
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(server);
    let r = result?;
    o.fell_back = r.window_safe && r.inventory_complete && r.completed_after;
    o.completed = r.window_completed;
    o.outputs_match = r.outputs_match;
    o.destination_untouched = target.rows_free();
    o.detail = r.detail;
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    Ok(o)
}

struct NatsResult {
    window_safe: bool,
    window_completed: bool,
    inventory_complete: bool,
    completed_after: bool,
    outputs_match: bool,
    detail: String,
}

async fn nats_connect(url: &str, name: &str) -> Result<NatsPlane, FaultError> {
    NatsPlane::connect(
        url,
        NatsOptions {
            name: name.into(),
            max_reconnect_delay: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(2),
            ..NatsOptions::default()
        },
    )
    .await
    .map_err(|e| FaultError::Nats(e.to_string()))
}

/// Applies every event the receiver yields within `wait`; on `Lost`,
/// resyncs the donor from its bank. Returns (events applied, full resyncs).
async fn pump(
    rx: &mut KvEventReceiver,
    router: &FaultRouter,
    bank: &BankManager,
    wait: Duration,
    until_complete: bool,
) -> Result<(u64, u64), FaultError> {
    let (mut applied, mut resyncs) = (0u64, 0u64);
    let end = tokio::time::Instant::now() + wait;
    loop {
        if until_complete && router.holds_all(bank) {
            return Ok((applied, resyncs));
        }
        let left = end.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok((applied, resyncs));
        }
        match rx.next_timeout(left.min(Duration::from_millis(200))).await {
            Some(KvStreamItem::Event(e)) => {
                router.apply(&[e]);
                applied += 1;
            }
            Some(KvStreamItem::Lost { to_event_id, .. }) => {
                router.resync(bank, to_event_id)?;
                resyncs += 1;
            }
            None if !until_complete => return Ok((applied, resyncs)),
            None => {}
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn nats_scenario(
    server: &mut NatsServer,
    bank: &BankManager,
    router: &FaultRouter,
    target: &Target,
    model: &ReferenceModel,
    convs: &[(Conversation, KvCache)],
    target_engine: EngineId,
) -> Result<NatsResult, FaultError> {
    let bs = target.layout.tokens_per_block() as usize;
    let url = server.url();
    let pub_plane: Arc<dyn EventPlane> = Arc::new(nats_connect(&url, "fault-decode").await?);
    let sub_plane: Arc<dyn EventPlane> = Arc::new(nats_connect(&url, "fault-router").await?);
    let subject = Subject::new("faults", "decode", "kv_events")
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let header = PublisherHeader {
        publisher: bank.owner().engine_id,
        role: Role::Decode,
        layout_fingerprint: target.layout.fingerprint(),
        tp_size: target.layout.tp_size(),
    };
    let publisher = Arc::new(KvEventPublisher::new(
        pub_plane.clone(),
        subject.clone(),
        header,
        256,
    ));
    let resync_task = publisher
        .serve_resync()
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let mut rx = KvEventReceiver::subscribe(sub_plane.clone(), &subject, Duration::from_secs(2))
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    pub_plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let mut publish_errors = 0u32;
    let publish = |events: Vec<KvEvent>| {
        let p = publisher.clone();
        async move {
            let mut errs = 0;
            for e in events {
                if p.publish(e.tier, e.data).await.is_err() {
                    errs += 1;
                }
            }
            errs
        }
    };
    // Conversation 0 before the restart.
    let ev = retain(bank, &convs[0].1, &convs[0].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    pump(&mut rx, router, bank, Duration::from_secs(5), true).await?;
    let before_ok = router.holds_all(bank);

    // Restart; conversation 1 is published while the clients reconnect.
    server.restart().map_err(FaultError::Nats)?;
    let ev = retain(bank, &convs[1].1, &convs[1].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    pub_plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(10))
        .await
        .map_err(|e| FaultError::Nats(format!("after restart: {e}")))?;
    pump(&mut rx, router, bank, Duration::from_millis(300), false).await?;

    // A request for conversation 1 inside the window: whatever the index
    // knows, the output must be right and nothing false may complete.
    let c1 = &convs[1].0;
    let off1 = generate(model, KvCache::new(target.layout), &c1.prompt)?;
    let advice = router.advise("nats-window", &prompt_hashes(&c1.prompt, bs), target_engine);
    let (w, window_completed, window_fallback) = target.serve(
        model,
        &c1.prompt,
        advice.hint.as_ref(),
        bank,
        &DeliveryControl::new(),
    )?;
    let window_safe =
        w == off1 && (window_completed || advice.hint.is_none() || window_fallback.is_some());

    // Conversation 2 after reconnect reveals any gap; resync repairs it.
    let ev = retain(bank, &convs[2].1, &convs[2].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    let (applied, resyncs) = pump(&mut rx, router, bank, Duration::from_secs(10), true).await?;
    let stats = rx.stats();
    let inventory_complete = router.holds_all(bank);
    let advice = router.advise("nats-after", &prompt_hashes(&c1.prompt, bs), target_engine);
    let (after, completed_after, after_fallback) = target.serve(
        model,
        &c1.prompt,
        advice.hint.as_ref(),
        bank,
        &DeliveryControl::new(),
    )?;
    resync_task.abort();
    Ok(NatsResult {
        window_safe: window_safe && before_ok,
        window_completed: window_completed && w != off1,
        inventory_complete,
        completed_after,
        outputs_match: w == off1 && after == off1,
        detail: format!(
            "before restart complete: {before_ok}; window: hint {} completed {window_completed}; \
             publish errors {publish_errors}; receiver gaps {} lost {} duplicates {}; \
             applied after restart {applied}; full resyncs {resyncs}; inventory complete: \
             {inventory_complete}; fetch after: {completed_after} {}",
            advice.hint.is_some(),
            stats.gaps,
            stats.lost,
            stats.duplicates,
            after_fallback.unwrap_or_default()
        ),
    })
}

// ---------------------------------------------------------------- child ---

#[derive(Serialize, Deserialize)]
struct ChildHello {
    pid: u32,
    manifest: Vec<u8>,
    entries: Vec<(u64, u32)>,
}

impl ChildHello {
    /// This process's hello for `bank`, which retained `tokens`: its
    /// manifest and the (sequence hash, slot) of every retained block.
    fn for_bank(bank: &BankManager, tokens: &[u32]) -> Result<Self, FaultError> {
        let bs = bank.manifest().layout().tokens_per_block() as usize;
        Ok(Self {
            pid: std::process::id(),
            manifest: bank
                .manifest()
                .to_wire()
                .map_err(|e| FaultError::Child(e.to_string()))?,
            entries: sealed_blocks(None, tokens, bs)
                .iter()
                .filter_map(|b| {
                    bank.lookup(&b.sequence_hash)
                        .map(|s| (b.sequence_hash.0, s))
                })
                .collect(),
        })
    }
}

/// A child role's exit code: 0, or 2 with the error on stderr.
fn child_exit(role: &str, result: Result<(), FaultError>) -> i32 {
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{role}: {e}");
            2
        }
    }
}

/// The host-shm donor child's hello: the common fields plus its pin
/// service (`unix:<path>`), which the parent's hints name as the control
/// endpoint.
#[derive(Serialize, Deserialize)]
struct PinningChildHello {
    #[serde(flatten)]
    hello: ChildHello,
    endpoint: String,
}

/// Directory of the child donor's pin socket. The run's unique prefix names
/// it, so runs never share a socket, and the parent can remove what a
/// killed child left.
fn pin_socket_dir(prefix: &str) -> PathBuf {
    std::env::temp_dir().join(prefix)
}

/// How long a SIGTERMed child waits for targets to release their pins
/// before it cuts their connections and closes its bank.
const CHILD_PIN_DRAIN: Duration = Duration::from_millis(100);

/// Child side of the donor faults: `args` = `<shm prefix> <seed> <lease ms>`
/// (a leading [`CHILD_ROLE`] is skipped). Computes turn 0 of conversation
/// `seed`, retains it in a TP2 host-shm bank whose lease is renewed in the
/// background, serves source pins on it ([`kv_router_glue::PinService`] on a
/// Unix socket in a fresh temp directory), prints one JSON line (pid,
/// manifest, slots, pin endpoint), then waits. On SIGTERM it stops the pin
/// service (new pins refused, held ones given [`CHILD_PIN_DRAIN`], then
/// dropped; socket and directory removed) and closes its bank (lease
/// revoked, segments unlinked) and returns 0; after 60 s without a signal
/// it does the same. Returns 2 on an error (printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    child_exit(CHILD_ROLE, child(args))
}

fn child(args: &[String]) -> Result<(), FaultError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != CHILD_ROLE).collect();
    let [prefix, seed, lease_ms] = args.as_slice() else {
        return Err(FaultError::Child(format!(
            "expected <prefix> <seed> <lease ms>, got {args:?}"
        )));
    };
    let num = |field: &str, s: &str| {
        s.parse::<u64>()
            .map_err(|e| FaultError::Child(format!("`{field}` {s:?}: {e}")))
    };
    let (seed, lease_ms) = (num("seed", seed)?, num("lease_ms", lease_ms)?);
    let (rt, mut term) = child_runtime()?;
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let (conv, cache) = conversation(&model, seed)?;
    let slots = (conv.retained_tokens.len() / layout.tokens_per_block() as usize) as u64;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::background(
            Duration::from_millis(lease_ms),
            Duration::from_millis((lease_ms / 4).max(1)),
        ),
    )?);
    retain(&bank, &cache, &conv.retained_tokens)?;
    let sock_dir = pin_socket_dir(prefix);
    std::fs::create_dir_all(&sock_dir)
        .map_err(|e| FaultError::Child(format!("{}: {e}", sock_dir.display())))?;
    let pins = kv_router_glue::PinService::bind(
        bank.clone(),
        &format!("unix:{}", sock_dir.join("pin.sock").display()),
        kv_router_glue::PinServiceConfig::default(),
    )
    .map_err(|e| FaultError::Child(e.to_string()))?;
    let hello = PinningChildHello {
        hello: ChildHello::for_bank(&bank, &conv.retained_tokens)?,
        endpoint: pins.endpoint().to_owned(),
    };
    let line = serde_json::to_string(&hello).map_err(|e| FaultError::Child(e.to_string()))?;
    println!("{line}");
    wait_for_sigterm(&rt, &mut term);
    // Pins first: once the service is down no target holds a pin, so the
    // close below frees the memory at once instead of timing out.
    pins.shutdown(CHILD_PIN_DRAIN);
    let _ = std::fs::remove_dir(&sock_dir);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))
}

/// The child's bank as the target sees it: mapped by descriptor under a
/// live lease, pinned through the child's pin service
/// ([`kv_router_glue::RemoteDonor`]: the child cannot evict or reuse the
/// slots while the pin is held, and a pin that did not hold throughout fails
/// the fetch). `pin` also checks the process and leases first, and the
/// delivery's liveness probe re-checks them after the last byte: a donor
/// that dies takes its pins with it.
struct RemoteDonor {
    remote: kv_router_glue::RemoteDonor,
    alive: Arc<dyn Fn() -> bool + Send + Sync>,
    /// Pins the child granted (the run's detail reports it, so a test can
    /// tell a fetch that really pinned the child's slots).
    granted: AtomicU32,
}

impl DonorSource for RemoteDonor {
    fn manifest(&self) -> &BankManifest {
        self.remote.manifest()
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, String> {
        if !(self.alive)() {
            return Err("donor process or lease gone".into());
        }
        let pin = self.remote.pin(hint)?;
        self.granted.fetch_add(1, Ordering::SeqCst);
        Ok(pin)
    }
}

/// True while process `pid` exists and is not a zombie.
fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// The hint a router would send for `entries` (sequence hash, donor slot;
/// the retained prefix, in order) of `manifest`'s bank: every rank reads
/// the same slots.
fn retained_hint_envelope(
    manifest: &BankManifest,
    layout: &KvLayout,
    entries: &[(u64, u32)],
    request_id: &str,
    endpoint: &str,
) -> Result<HintEnvelope, FaultError> {
    let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
    let hint = FetchGpuHint {
        donor_engine_id: manifest.owner().engine_id,
        bank_generation: manifest.owner().generation,
        layout_fingerprint: layout.fingerprint(),
        tp_size: layout.tp_size(),
        sequence_hashes: entries.iter().map(|e| SequenceHash(e.0)).collect(),
        fetch_from: 0,
        parts: (0..layout.tp_size())
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: slots.len() as u64 * layout.rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: endpoint.to_string(),
    };
    HintEnvelope::fetch_gpu(request_id, "a0", &hint).map_err(|e| FaultError::Child(e.to_string()))
}

/// A started donor child whose first stdout line (its hello) was read.
struct HelloChild {
    /// The process (killed and reaped through `guard` at the latest).
    child: Arc<Mutex<Child>>,
    guard: ChildGuard,
    /// Its pid as the parent sees it.
    pid: u32,
}

/// Starts `cmd` (stdin closed, stdout piped, stderr inherited) and parses
/// the first line it prints within `wait` as its hello `T`.
fn spawn_with_hello<T: serde::de::DeserializeOwned>(
    mut cmd: Command,
    wait: Duration,
) -> Result<(HelloChild, T), FaultError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the forked child before exec and only
        // calls prctl(2), which is async-signal-safe and touches no memory
        // shared with the parent. It makes the kernel SIGKILL the donor when
        // the spawning thread's process dies (a SIGTERMed kvq or test run),
        // instead of leaving it running for CHILD_MAX_LIFE; the setting
        // survives the exec of `ip netns exec` into the donor.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut proc = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| FaultError::Child(format!("cannot start {program}: {e}")))?;
    let stdout = proc.stdout.take();
    let pid = proc.id();
    let child = Arc::new(Mutex::new(proc));
    let guard = ChildGuard(child.clone());
    let (tx, rx) = mpsc::channel();
    if let Some(out) = stdout {
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
    }
    let line = rx
        .recv_timeout(wait)
        .map_err(|_| FaultError::Child(format!("no hello within {} s", wait.as_secs())))?;
    let hello = serde_json::from_str(line.trim())
        .map_err(|e| FaultError::Child(format!("bad hello {line:?}: {e}")))?;
    Ok((HelloChild { child, guard, pid }, hello))
}

/// A child's current-thread runtime with its SIGTERM handler installed.
/// Install it before printing the hello, so that a SIGTERM sent as soon as
/// the parent read it is never the default (killing) action.
fn child_runtime() -> Result<(tokio::runtime::Runtime, tokio::signal::unix::Signal), FaultError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| FaultError::Child(format!("runtime: {e}")))?;
    let term = rt
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .map_err(|e| FaultError::Child(format!("SIGTERM handler: {e}")))?;
    Ok((rt, term))
}

/// Blocks until SIGTERM, or [`CHILD_MAX_LIFE`] if none comes.
fn wait_for_sigterm(rt: &tokio::runtime::Runtime, term: &mut tokio::signal::unix::Signal) {
    rt.block_on(async {
        let _ = tokio::time::timeout(CHILD_MAX_LIFE, term.recv()).await;
    });
}

/// Kills and reaps the child when dropped (a failed setup leaves no process).
struct ChildGuard(Arc<Mutex<Child>>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// Waits up to `timeout` for the child to exit; kills it after that.
fn wait_exit(child: &Mutex<Child>, timeout: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + timeout;
    let mut c = child.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Ok(Some(s)) = c.try_wait() {
            return Some(s);
        }
        if Instant::now() >= end {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn child_fault(
    fault: Fault,
    seed: u64,
    cmd: &ChildCommand,
    prefix: &str,
) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let (conv, _) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let mut start = Command::new(&cmd.exe);
    start.args(&cmd.args).args([
        prefix.to_string(),
        seed.to_string(),
        CHILD_LEASE_MS.to_string(),
    ]);
    let (HelloChild { child, guard, pid }, PinningChildHello { hello, endpoint }) =
        spawn_with_hello(start, Duration::from_secs(30))?;
    let manifest =
        BankManifest::from_wire(&hello.manifest).map_err(|e| FaultError::Child(e.to_string()))?;
    let remote = kv_router_glue::RemoteDonor::open_host_shm(manifest.clone(), &endpoint)
        .map_err(|e| FaultError::Child(format!("open_host_shm: {e}")))?;
    let parts = manifest.parts().to_vec();
    let alive: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || {
        pid_alive(pid)
            && parts
                .iter()
                .all(|d| check_descriptor_lease(d, kv_bank::LeaseInstant::now()).is_ok())
    });
    let donor = RemoteDonor {
        remote,
        alive: alive.clone(),
        granted: AtomicU32::new(0),
    };
    // The honest hint for the retained prefix the prompt can use.
    let bs = layout.tokens_per_block() as usize;
    let usable = (conv.prompt.len() - 1) / bs;
    let entries: Vec<(u64, u32)> = hello.entries.iter().take(usable).copied().collect();
    let env = retained_hint_envelope(
        &manifest,
        &layout,
        &entries,
        &format!("fault-{seed}"),
        &endpoint,
    )?;
    let strike_child = child.clone();
    let act: Action = if fault == Fault::DonorKilledMidTransfer {
        Arc::new(move || {
            let mut c = strike_child.lock().unwrap_or_else(|e| e.into_inner());
            let _ = c.kill();
            let _ = c.wait();
        })
    } else {
        Arc::new(move || {
            // SAFETY: kill(2) with a pid we spawned and have not reaped (so
            // it cannot have been reused) and a valid signal number has no
            // memory effects in this process.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGTERM);
            }
            wait_exit(&strike_child, Duration::from_secs(5));
        })
    };
    let target = Target::new(
        layout,
        (conv.prompt.len() / bs) as u32 + 2,
        Arc::new(FaultBackend::host(Strike::BeforeRank(1, act))),
    )?;
    let control = DeliveryControl {
        donor_alive: Some(alive),
        ..DeliveryControl::new()
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &donor, &control)?;
    let status = wait_exit(&child, Duration::from_secs(5));
    drop(guard);
    let mut o = outcome(fault);
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    o.destination_untouched = target.rows_free();
    let granted = donor.granted.load(Ordering::SeqCst);
    drop(target);
    drop(donor);
    // A killed owner leaves its segments: they go once its lease lapsed.
    let mut reclaimed = 0;
    let end = Instant::now() + Duration::from_millis(CHILD_LEASE_MS * 4);
    while !shm_entries(prefix).is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(CHILD_LEASE_MS / 4));
        if let Ok(r) = kv_bank::reclaim_stale(prefix, kv_bank::reclaim::ScanTime::now()) {
            reclaimed += r.removed_names().len();
        }
    }
    // A killed child never removed its socket file.
    let _ = std::fs::remove_dir_all(pin_socket_dir(prefix));
    o.detail = format!(
        "{}; remote pins granted by the child {granted}; child exit {:?}; names reclaimed {reclaimed}",
        fallback.unwrap_or_else(|| "fetch completed".into()),
        status.map(|s| s.to_string())
    );
    Ok(o)
}

// --------------------------------------------------------------- tables ---

/// A fault that could not run here, and why (`record.json` `faults_skipped`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedFault {
    /// Row name ([`Fault::name`]).
    pub fault: String,
    /// What was missing (e.g. no `nats-server`, no network namespaces).
    pub reason: String,
}

/// Rows of the faults that ran and the faults that could not run here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultTable {
    /// One row per fault that ran.
    pub rows: Vec<FaultRow>,
    /// Faults left out ([`FaultError::Skipped`]).
    pub skipped: Vec<SkippedFault>,
}

/// Runs each fault `runs` times (seeds `seed..seed+runs`) and folds the
/// outcomes into rows. A fault that cannot run here ([`FaultError::Skipped`])
/// is left out (see [`fault_table_rows`] to keep the reason); a setup error
/// is a row with no fallback and the error as detail.
pub fn fault_rows(
    faults: &[Fault],
    runs: u32,
    seed: u64,
    child: Option<&ChildCommand>,
) -> Vec<FaultRow> {
    fault_table_rows(faults, runs, seed, child).rows
}

/// A row named `fault` with nothing run yet.
fn empty_row(fault: &str) -> FaultRow {
    FaultRow {
        fault: fault.into(),
        runs: 0,
        fallbacks: 0,
        false_completions: 0,
        leaks: 0,
        detail: String::new(),
    }
}

/// [`fault_rows`], also returning the faults that were skipped and why.
pub fn fault_table_rows(
    faults: &[Fault],
    runs: u32,
    seed: u64,
    child: Option<&ChildCommand>,
) -> FaultTable {
    let mut table = FaultTable::default();
    let rows = &mut table.rows;
    for &f in faults {
        let mut row = empty_row(f.name());
        let mut skipped = None;
        for i in 0..runs {
            match run_fault(f, seed.wrapping_add(u64::from(i)), child) {
                Ok(o) => {
                    row.runs += 1;
                    // For the control row a completion is the expected end.
                    if o.passed() {
                        row.fallbacks += 1;
                    }
                    if o.completed && f != Fault::None {
                        row.false_completions += 1;
                    }
                    row.leaks += o.leaks.len() as u32;
                    if row.detail.is_empty() || !o.passed() {
                        row.detail = format!("{}{}", o.detail, leak_note(&o.leaks));
                    }
                }
                Err(FaultError::Skipped(r)) => {
                    skipped = Some(r);
                    break;
                }
                Err(e) => {
                    row.runs += 1;
                    row.detail = format!("setup failed: {e}");
                }
            }
        }
        match skipped {
            None => rows.push(row),
            Some(reason) => {
                eprintln!("fault {}: skipped: {reason}", f.name());
                table.skipped.push(SkippedFault {
                    fault: f.name().into(),
                    reason,
                });
            }
        }
    }
    table
}

fn leak_note(leaks: &[String]) -> String {
    if leaks.is_empty() {
        String::new()
    } else {
        format!("; leaks: {}", leaks.join(", "))
    }
}

/// The fault table of `qualify` with the donor child started as
/// `kvq child ...` from the running executable (call it from kvq): every
/// [`Fault`] (1 run each when `quick`, else 3; donor-process faults 1 / 2)
/// followed by kv-bank's bank-level rows ([`kv_bank::qualify_faults`]).
/// In `record.json` as `faults[{fault, runs, fallbacks, false_completions, leaks}]`.
/// For the control row `none` and the event-stream rows, `fallbacks` counts
/// runs that ended as required (completed correctly; repaired).
pub fn fault_table(quick: bool) -> Vec<FaultRow> {
    fault_table_with(quick, &ChildCommand::current_kvq()).rows
}

/// [`fault_table`] with an explicit child command (its `exe` followed by
/// `child bank-lease-owner` must reach kv-bank's child too), keeping the
/// faults that could not run here.
pub fn fault_table_with(quick: bool, child: &ChildCommand) -> FaultTable {
    let (runs, child_runs) = if quick { (1, 1) } else { (3, 2) };
    let (with_child, alone): (Vec<Fault>, Vec<Fault>) =
        Fault::ALL.iter().partition(|f| f.needs_child());
    let mut table = fault_table_rows(&with_child, child_runs, 1, Some(child));
    let rest = fault_table_rows(&alone, runs, 1, Some(child));
    table.rows.extend(rest.rows);
    table.skipped.extend(rest.skipped);
    let _guard = run_lock();
    table
        .rows
        .extend(kv_bank::qualify_faults(&child.exe, &["child".to_string()]));
    table
}

// ----------------------------------------------------------------- soak ---

/// What a soak did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SoakReport {
    /// Seed of the fault sequence.
    pub seed: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Requests served (one per injected run).
    pub requests: u64,
    /// Fetches that completed (control runs and repaired event runs).
    pub fetches: u64,
    /// Runs that fell back as their fault requires.
    pub fallbacks: u64,
    /// Runs whose fetch completed under a fault that forbids it.
    pub false_completions: u64,
    /// Runs whose outputs differed from OFF.
    pub wrong_outputs: u64,
    /// Leaked resources, summed over runs, plus any growth over the whole soak.
    pub leaks: u64,
    /// Runs that failed any check, with their detail (first 20).
    pub failures: Vec<String>,
    /// Per-fault rows (as in the fault table).
    pub per_fault: Vec<FaultRow>,
}

impl SoakReport {
    /// No false completion, no wrong output, no leak, no failed run, at least one request.
    pub fn passed(&self) -> bool {
        self.requests > 0
            && self.false_completions == 0
            && self.wrong_outputs == 0
            && self.leaks == 0
            && self.failures.is_empty()
    }
}

/// Random faults from [`Fault::IN_PROCESS`] (and the donor-process faults
/// when `child` is given, one run in ten) over fresh conversations until
/// `minutes` passed; counts fetches, fallbacks, false completions, wrong
/// outputs and leaks. Deterministic sequence for a seed; never panics.
///
/// ```no_run
/// let r = kv_testkit::faults::soak(0.05, 42);
/// assert!(r.passed(), "{r:?}");
/// ```
pub fn soak(minutes: f64, seed: u64) -> SoakReport {
    soak_with(minutes, seed, None)
}

/// [`soak`], with the donor-process faults when `child` is given (kvq:
/// `Some(&ChildCommand::current_kvq())`).
pub fn soak_with(minutes: f64, seed: u64, child: Option<&ChildCommand>) -> SoakReport {
    let t0 = Instant::now();
    // Non-finite or negative minutes mean "one request" (kvq refuses them
    // before calling); `from_secs_f64` would panic on infinity.
    let secs = minutes * 60.0;
    let budget = if secs.is_finite() && secs > 0.0 {
        Duration::from_secs_f64(secs.min(1e9))
    } else {
        Duration::ZERO
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let whole = {
        let _g = run_lock();
        kv_bank::leaks::snapshot()
    };
    let mut r = SoakReport {
        seed,
        seconds: 0.0,
        requests: 0,
        fetches: 0,
        fallbacks: 0,
        false_completions: 0,
        wrong_outputs: 0,
        leaks: 0,
        failures: Vec::new(),
        per_fault: Vec::new(),
    };
    let mut rows: HashMap<Fault, FaultRow> = HashMap::new();
    // The link-cut fault joins the donor-process faults where it can run
    // (NIXL runtime, network namespaces); otherwise it would only skip.
    let net_ok = child.is_some() && link_cut::available();
    let mut n = 0u64;
    while t0.elapsed() < budget || n == 0 {
        n += 1;
        let fault = match child {
            Some(_) if rng.gen_range(0..10) == 0 => {
                let pool: &[Fault] = if net_ok {
                    &[
                        Fault::DonorKilledMidTransfer,
                        Fault::SigtermDuringTransfer,
                        Fault::LinkCutMidTransfer,
                    ]
                } else {
                    &[Fault::DonorKilledMidTransfer, Fault::SigtermDuringTransfer]
                };
                pool[rng.gen_range(0..pool.len())]
            }
            _ => Fault::IN_PROCESS[rng.gen_range(0..Fault::IN_PROCESS.len())],
        };
        let run_seed = rng.gen::<u64>();
        let row = rows.entry(fault).or_insert_with(|| empty_row(fault.name()));
        row.runs += 1;
        r.requests += 1;
        match run_fault(fault, run_seed, child) {
            Ok(o) => {
                let event_fault = matches!(
                    fault,
                    Fault::DuplicatedEvents | Fault::ReorderedEvents | Fault::GappedEvents
                );
                if o.completed || (event_fault && o.fell_back) {
                    r.fetches += 1;
                }
                if fault != Fault::None && o.fell_back {
                    r.fallbacks += 1;
                    row.fallbacks += u32::from(o.passed());
                } else if fault == Fault::None && o.passed() {
                    row.fallbacks += 1;
                }
                if o.completed && fault != Fault::None {
                    r.false_completions += 1;
                    row.false_completions += 1;
                }
                r.wrong_outputs += u64::from(!o.outputs_match);
                r.leaks += o.leaks.len() as u64;
                row.leaks += o.leaks.len() as u32;
                if !o.passed() {
                    row.detail = format!("{}{}", o.detail, leak_note(&o.leaks));
                    if r.failures.len() < 20 {
                        r.failures.push(format!(
                            "{} seed {run_seed}: {}{}",
                            fault.name(),
                            o.detail,
                            leak_note(&o.leaks)
                        ));
                    }
                }
            }
            Err(e) => {
                row.detail = format!("setup failed: {e}");
                if r.failures.len() < 20 {
                    r.failures.push(format!(
                        "{} seed {run_seed}: setup failed: {e}",
                        fault.name()
                    ));
                }
            }
        }
    }
    let end = {
        let _g = run_lock();
        kv_bank::leaks::snapshot()
    };
    let growth = end.leaks_since(&whole);
    r.leaks += growth.len() as u64;
    for l in growth {
        if r.failures.len() < 20 {
            r.failures.push(format!("soak-wide leak: {l}"));
        }
    }
    let mut per_fault: Vec<FaultRow> = rows.into_values().collect();
    per_fault.sort_by(|a, b| a.fault.cmp(&b.fault));
    r.per_fault = per_fault;
    r.seconds = t0.elapsed().as_secs_f64();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_names_are_unique_and_the_soak_pool_needs_no_child() {
        let mut names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Fault::ALL.len());
        assert!(Fault::IN_PROCESS.iter().all(|f| Fault::ALL.contains(f)));
        assert!(!Fault::IN_PROCESS.iter().any(|f| f.needs_child()));
        assert!(!Fault::IN_PROCESS.contains(&Fault::NatsServerRestart));
        let with_child: Vec<Fault> = Fault::ALL
            .iter()
            .copied()
            .filter(|f| f.needs_child())
            .collect();
        assert_eq!(
            with_child,
            [
                Fault::DonorKilledMidTransfer,
                Fault::SigtermDuringTransfer,
                Fault::LinkCutMidTransfer
            ],
            "killed, SIGTERMed and network-cut donor"
        );
    }

    #[test]
    fn passed_requires_the_expected_end_and_no_leak() {
        let fallback = RunOutcome {
            fault: Fault::RankPartFails,
            fell_back: true,
            completed: false,
            outputs_match: true,
            destination_untouched: true,
            leaks: Vec::new(),
            detail: String::new(),
        };
        assert!(fallback.passed());
        let completed = RunOutcome {
            fell_back: false,
            completed: true,
            ..fallback.clone()
        };
        assert!(!completed.passed(), "a completion under a fault is false");
        assert!(RunOutcome {
            fault: Fault::None,
            ..completed.clone()
        }
        .passed());
        assert!(!RunOutcome {
            leaks: vec!["pins: 0 -> 1".into()],
            ..fallback.clone()
        }
        .passed());
        assert!(!RunOutcome {
            outputs_match: false,
            ..fallback.clone()
        }
        .passed());
        assert!(!RunOutcome {
            destination_untouched: false,
            ..fallback
        }
        .passed());
    }

    #[test]
    fn pid_alive_tells_a_running_process_from_a_reaped_one() {
        assert!(pid_alive(std::process::id()));
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn unique_prefixes_differ_and_parse_as_bank_prefixes() {
        let (a, b) = (unique_prefix(), unique_prefix());
        assert_ne!(a, b);
        assert!(a.starts_with("kvfault") && !a.contains('-') && !a.contains('/'));
    }
}
