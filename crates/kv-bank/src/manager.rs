//! The bank manager of one role: one retained bank (TP1) or one rank-local
//! bank per TP rank sharing logical slot ids, with stores that become ready
//! only after every rank wrote and acknowledged, pins, LRU eviction,
//! inventory events and close.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{
    chain_sequence_hash, chain_stored_blocks, token_block_hashes, BankDescriptor, BankManifest,
    BankParts, FetchGpuHint, KvEvent, KvEventData, KvLayout, MemoryLocation, OwnerLease,
    SequenceHash, StorageTier, StoredBlock,
};
use parking_lot::{Condvar, Mutex};

use crate::lease::{LeaseConfig, LeaseRenewal, OwnerLeases, Renewer};
use crate::slots::{SlotState, SlotTable};
use crate::{BankError, CreatorProcess, ExclusionLineage, HostShmMemory, RankBank, RankMemory};

mod lease_ops;
mod pins;
mod store;

pub use lease_ops::LeaseStatus;
pub use pins::ManagerPin;

/// Settings of a [`BankManager`].
#[derive(Debug, Clone)]
pub struct BankConfig {
    /// Geometry of the TP group; one rank's slot holds `layout.rank_block_bytes()`.
    pub layout: KvLayout,
    /// Engine incarnation, role and bank generation published in every descriptor.
    pub owner: OwnerLease,
    /// Byte budget of the whole role, all ranks together. Each rank gets
    /// `budget_bytes / tp_size`, so `slot_count = budget_bytes / tp_size / rank_block_bytes`.
    pub budget_bytes: u64,
    /// How long a store may wait for every rank's acknowledgement before it is rolled back.
    pub store_timeout: Duration,
    /// The engine's exclusion lineage (shared, survives native clears and bank generations).
    pub lineage: Arc<ExclusionLineage>,
    /// Owner lease of every rank: duration and who renews (see [`crate::lease`]).
    pub lease: LeaseConfig,
    /// Name prefix of host shm segments made by [`BankManager::new_host_shm`]
    /// (`/<prefix>-<pid>-<n>-<hex>`); [`crate::reclaim_stale`] scans by prefix.
    pub shm_prefix: String,
}

impl BankConfig {
    /// Config with a 5 s store timeout, a fresh lineage, the default lease
    /// ([`LeaseConfig::default`]: 15 s, renewed every 3 s in the background)
    /// and shm prefix [`DEFAULT_SHM_PREFIX`].
    pub fn new(layout: KvLayout, owner: OwnerLease, budget_bytes: u64) -> Self {
        Self {
            layout,
            owner,
            budget_bytes,
            store_timeout: Duration::from_secs(5),
            lineage: Arc::new(ExclusionLineage::default()),
            lease: LeaseConfig::default(),
            shm_prefix: DEFAULT_SHM_PREFIX.to_string(),
        }
    }
    /// Slots per rank this config yields: `budget_bytes / tp_size / rank_block_bytes`.
    pub fn slot_count(&self) -> u64 {
        self.budget_bytes / u64::from(self.layout.tp_size()) / self.layout.rank_block_bytes() as u64
    }
}

/// Default name prefix of host bank segments (and of every lease name this
/// crate makes), so `reclaim_stale("kvbank", now)` covers all banks.
pub const DEFAULT_SHM_PREFIX: &str = "kvbank";

/// The sealed (full) blocks of `tokens`, chained from `parent`: the trailing
/// partial block, if any, is not included (only sealed blocks are retained).
///
/// ```
/// use kv_bank::sealed_blocks;
/// let b = sealed_blocks(None, &(0..35).collect::<Vec<u32>>(), 16);
/// assert_eq!(b.len(), 2); // 3 tokens stay unsealed
/// assert_eq!(b[0].sequence_hash, kv_descriptor::sequence_hashes(&(0..32).collect::<Vec<_>>(), 16)[0]);
/// ```
pub fn sealed_blocks(
    parent: Option<SequenceHash>,
    tokens: &[u32],
    tokens_per_block: usize,
) -> Vec<StoredBlock> {
    chain_stored_blocks(parent, token_block_hashes(tokens, tokens_per_block))
}

/// A store waiting for rank acknowledgements, as handed to the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingStore {
    /// Id to acknowledge with; unique per manager.
    pub store_id: u64,
    /// New blocks and the logical slot each rank must write, in prefix order.
    pub entries: Vec<(SequenceHash, u32)>,
    /// Blocks of the request already retained (ready or pending in another store); not rewritten.
    pub already_retained: usize,
    /// Blocks refused because they are in (or descend from) the exclusion lineage.
    pub excluded: usize,
}

impl PendingStore {
    /// True when the store had nothing new to write (it is not pending at all).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Outcome of an acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreStatus {
    /// Still waiting for these ranks.
    Waiting {
        /// Ranks that have not acknowledged.
        missing: Vec<u32>,
    },
    /// Every rank acknowledged: the blocks (less any excluded meanwhile) are
    /// in the inventory and a `Stored` event was queued.
    Ready,
}

/// What a bank retains right now: exact, and what `Stored`/`Removed` events describe.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Inventory {
    /// Ready (fetchable) blocks, in slot order.
    pub ready: Vec<SequenceHash>,
    /// Slots held by stores not yet acknowledged by every rank.
    pub pending_slots: usize,
    /// Slots of rolled-back stores held back until a slow rank's late writes
    /// can no longer land (see [`BankManager::fail`]).
    pub quarantined_slots: usize,
    /// Slots with at least one pin.
    pub pinned_slots: usize,
    /// Slots holding nothing.
    pub free_slots: usize,
    /// Total slots per rank.
    pub slot_count: u32,
    /// Bytes of one slot on one rank.
    pub slot_bytes: u64,
}

/// Counters of a manager's life, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BankStats {
    /// Stores that became ready.
    pub stores_ready: u64,
    /// Stores rolled back (a rank failed or timed out, or close).
    pub stores_rolled_back: u64,
    /// Blocks that became ready.
    pub blocks_stored: u64,
    /// Blocks evicted (LRU) or removed.
    pub blocks_evicted: u64,
    /// Blocks refused by the exclusion lineage.
    pub blocks_excluded: u64,
    /// Pins taken.
    pub pins: u64,
    /// Store bytes written into slots from host buffers
    /// ([`BankManager::write_pending`]): on a CUDA bank, the host payload of
    /// storing (a host-to-device copy each).
    pub store_bytes_from_host: u64,
    /// Store bytes copied into slots device to device
    /// ([`BankManager::write_pending_from_device`]): no host payload.
    pub store_bytes_from_device: u64,
}

/// Why a pending store is rolled back (decides whether its slots are quarantined).
#[derive(Debug, Clone, Copy)]
enum Rollback {
    Failed(u32),
    TimedOut,
    Closing,
    /// [`BankManager::abort`]: the caller vouches that every write went
    /// through `write_pending*`, whose running copies the bank tracks.
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    Closing,
    Closed,
}

#[derive(Debug)]
struct Pending {
    entries: Vec<(StoredBlock, Option<SequenceHash>, u32)>,
    /// One per TP rank: what that rank wrote and whether it acked.
    ranks: Vec<RankPart>,
    started: Instant,
}

impl Pending {
    fn new(entries: Vec<(StoredBlock, Option<SequenceHash>, u32)>, tp_size: u32) -> Self {
        let part = RankPart {
            written: vec![false; entries.len()],
            acked: false,
            in_flight: 0,
        };
        Self {
            ranks: vec![part; tp_size as usize],
            entries,
            started: Instant::now(),
        }
    }
    fn acked(&self) -> impl Iterator<Item = bool> + '_ {
        self.ranks.iter().map(|r| r.acked)
    }
    /// Ranks that have not acked.
    fn missing_ranks(&self) -> Vec<u32> {
        (0u32..)
            .zip(&self.ranks)
            .filter(|(_, r)| !r.acked)
            .map(|(rank, _)| rank)
            .collect()
    }
    /// Copies into this store running now, all ranks.
    fn in_flight(&self) -> u32 {
        self.ranks.iter().map(|r| r.in_flight).sum()
    }
}

/// One rank's part of a pending store.
#[derive(Debug, Clone)]
struct RankPart {
    /// `written[i]`: a `write_pending*` copy of this rank into entry `i`
    /// succeeded (and no later one into it failed). The ack refuses while
    /// one is false ([`BankError::Unwritten`]).
    written: Vec<bool>,
    /// The rank acked: its part is sealed, writes are refused
    /// ([`BankError::RankAcked`]).
    acked: bool,
    /// This rank's `write_pending*` copies into the store running now
    /// (outside the state lock); its ack waits for 0 before it checks
    /// `written`.
    in_flight: u32,
}

impl RankPart {
    /// How many entries are unwritten, and the first of them.
    fn unwritten(&self) -> Option<(usize, usize)> {
        let first = self.written.iter().position(|w| !w)?;
        Some((self.written.iter().filter(|w| !**w).count(), first))
    }
}

#[derive(Debug)]
struct State {
    phase: Phase,
    table: SlotTable,
    pending: HashMap<u64, Pending>,
    /// Slots of rolled-back stores that some rank may still be writing
    /// (it neither acked nor failed): kept pending, so never reused, until
    /// the release time (one more store timeout) passes.
    quarantine: Vec<(Instant, Vec<u32>)>,
    /// Slots with `write_pending` copies running now, and how many. Such a
    /// slot is never freed: a rollback that would free it leaves it in
    /// `orphaned_writes` instead.
    writing: HashMap<u32, u32>,
    /// Slots of rolled-back stores whose last running copy frees them.
    orphaned_writes: HashSet<u32>,
    next_store: u64,
    events: VecDeque<KvEvent>,
    next_event_id: u64,
    /// `None` once closed and drained: the memory is freed.
    banks: Option<Vec<RankBank>>,
    stats: BankStats,
}

#[derive(Debug)]
struct Shared {
    config: BankConfig,
    manifest: BankManifest,
    state: Mutex<State>,
    drained: Condvar,
    /// Notified when a `write_pending` copy ends (with `state`).
    writes_done: Condvar,
    leases: Arc<OwnerLeases>,
    /// The shm names of the ranks' memory that this bank created (host
    /// segments), for [`BankManager::unlink_names`]: kept apart from
    /// `state` so that call never waits for the state lock (at interpreter
    /// exit a thread may hold it and never run again).
    owned_names: Vec<String>,
    /// Taken (stopped) when the generation dies.
    renewer: Mutex<Option<Renewer>>,
    /// The process that created the bank: the only one that may write its
    /// slots or renew its leases (a forked child's copy of the slot table
    /// is stale at once).
    creator: CreatorProcess,
}

/// The bank manager of one role (TP1 or TP-N). Cheap to clone (shared).
///
/// Lifecycle of a block: [`BankManager::store`] takes logical slots (free
/// ones first, then LRU eviction of unpinned ready ones) and marks them
/// pending; every rank writes its part of each slot
/// ([`BankManager::write_pending`] or
/// [`BankManager::write_pending_from_device`], the only writers an ack
/// counts) and calls [`BankManager::ack`], refused until the rank wrote every
/// entry; when the last rank acks the blocks become ready,
/// appear in [`BankManager::inventory`] and a `Stored` event is queued. A
/// failed rank ([`BankManager::fail`]) or a missed deadline rolls the store
/// back on all ranks, with no event. Ready blocks are pinned by
/// [`BankManager::pin_prefix`] or [`BankManager::pin_hint`]; eviction never
/// touches a pinned slot. [`BankManager::close`] kills the generation.
///
/// ```
/// use kv_bank::{BankConfig, BankError, BankManager, sealed_blocks, StoreStatus};
/// use kv_descriptor::*;
/// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
/// let cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 8 * layout.block_bytes() as u64);
/// let bank = BankManager::new_host_shm(cfg, "host-a").unwrap();
/// assert_eq!(bank.manifest().tp_size(), 2);
/// let blocks = sealed_blocks(None, &(0..12).collect::<Vec<u32>>(), 4);
/// let p = bank.store(None, &blocks).unwrap();
/// let write = |rank: u32| {
///     for i in 0..p.entries.len() {
///         let part = vec![rank as u8 + 1; layout.rank_block_bytes()];
///         bank.write_pending(p.store_id, rank, i, &part).unwrap();
///     }
/// };
/// // A rank acks only after writing its part of every entry.
/// assert!(matches!(bank.ack(p.store_id, 0), Err(BankError::Unwritten { rank: 0, .. })));
/// write(0);
/// assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Waiting { missing: vec![1] });
/// assert!(bank.inventory().ready.is_empty()); // not before every rank acked
/// write(1);
/// assert_eq!(bank.ack(p.store_id, 1).unwrap(), StoreStatus::Ready);
/// assert_eq!(bank.inventory().ready.len(), 3);
/// let hashes: Vec<_> = blocks.iter().map(|b| b.sequence_hash).collect();
/// let pin = bank.pin_prefix(&hashes).unwrap();
/// assert_eq!(pin.slots().len(), 3);
/// drop(pin);
/// bank.close(std::time::Duration::from_secs(1)).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct BankManager {
    shared: Arc<Shared>,
}

impl BankManager {
    /// Builds a manager, allocating each rank's memory with `alloc(rank, bytes)`.
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] naming `budget_bytes` when it yields no
    /// slot (or more than `MAX_SLOTS`), `memory.len` when an allocation is
    /// smaller than asked, `memory.export` when it cannot be exported;
    /// any error of `alloc`; [`BankError::Descriptor`] for an invalid
    /// descriptor or manifest. On error every rank allocated so far is dropped
    /// (freed): nothing is half-registered.
    pub fn new(
        config: BankConfig,
        mut alloc: impl FnMut(u32, usize) -> Result<RankMemory, BankError>,
    ) -> Result<Self, BankError> {
        config.lease.validate()?;
        let slot_count = config.slot_count();
        if slot_count == 0 || slot_count > u64::from(kv_descriptor::MAX_SLOTS) {
            return Err(BankError::arg(
                "budget_bytes",
                format!(
                    "{} bytes over {} ranks of {}-byte slots gives {slot_count} slots, need 1..={}",
                    config.budget_bytes,
                    config.layout.tp_size(),
                    config.layout.rank_block_bytes(),
                    kv_descriptor::MAX_SLOTS
                ),
            ));
        }
        let slot_bytes = config.layout.rank_block_bytes();
        let region = slot_count as usize * slot_bytes;
        let mut banks = Vec::with_capacity(config.layout.tp_size() as usize);
        for rank in 0..config.layout.tp_size() {
            let RankMemory { memory, location } = alloc(rank, region)?;
            if memory.len() < region {
                return Err(BankError::arg(
                    "memory.len",
                    format!("rank {rank} got {} bytes, needs {region}", memory.len()),
                ));
            }
            let Some(export) = memory.export_handle() else {
                return Err(BankError::arg(
                    "memory.export",
                    format!("rank {rank} memory ({}) cannot be exported", memory.kind()),
                ));
            };
            let descriptor = BankDescriptor::new(BankParts {
                layout: config.layout,
                tp_rank: rank,
                location,
                owner: config.owner,
                export,
                slot_count: slot_count as u32,
                slot_bytes: slot_bytes as u64,
            })?;
            banks.push(RankBank::new(descriptor, memory));
        }
        let manifest = BankManifest::new(banks.iter().map(|b| b.descriptor().clone()).collect())?;
        let owned_names = banks
            .iter()
            .filter_map(|b| b.memory().owned_shm_name())
            .collect();
        // Leases last: until they exist no importer accepts the bank, and on
        // error the ones made are removed with the memory.
        let leases = OwnerLeases::create(manifest.parts(), config.lease)?;
        let renewer = match config.lease.renewal {
            LeaseRenewal::Background { interval } => {
                Some(Renewer::start(leases.clone(), interval)?)
            }
            LeaseRenewal::Manual => None,
        };
        Ok(Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    phase: Phase::Open,
                    table: SlotTable::new(slot_count as u32),
                    pending: HashMap::new(),
                    quarantine: Vec::new(),
                    writing: HashMap::new(),
                    orphaned_writes: HashSet::new(),
                    next_store: 1,
                    events: VecDeque::new(),
                    next_event_id: 1,
                    banks: Some(banks),
                    stats: BankStats::default(),
                }),
                config,
                manifest,
                drained: Condvar::new(),
                writes_done: Condvar::new(),
                leases,
                owned_names,
                renewer: Mutex::new(renewer),
                creator: CreatorProcess::current(),
            }),
        })
    }

    /// A manager whose ranks live in fresh POSIX shared-memory objects on `host_id` (CPU profile).
    ///
    /// Segments are named `/<config.shm_prefix>-<pid>-<n>-<hex>`, each with
    /// its lease next to it (`….lease`). Every segment's pages are reserved
    /// at creation ([`HostShmMemory::create`]), so a bank that does not fit
    /// in `/dev/shm` is refused here instead of killing the process with
    /// `SIGBUS` at a later write.
    ///
    /// # Errors
    /// As [`BankManager::new`] and [`HostShmMemory::create`], except that
    /// [`BankError::ShmNoSpace`] names `budget_bytes` and counts the bytes of
    /// every rank together (with the space free once the ranks made so far
    /// were removed again).
    pub fn new_host_shm(config: BankConfig, host_id: &str) -> Result<Self, BankError> {
        let host = host_id.to_string();
        let prefix = config.shm_prefix.clone();
        let total = config.slot_count()
            * u64::from(config.layout.tp_size())
            * config.layout.rank_block_bytes() as u64;
        Self::new(config, |_, bytes| {
            Ok(RankMemory {
                memory: Arc::new(HostShmMemory::create_unique(&prefix, bytes)?),
                location: MemoryLocation::Host {
                    host_id: host.clone(),
                },
            })
        })
        // `new` dropped (unlinked) the ranks made before the refused one,
        // so the free space read now is what a smaller bank could use.
        .map_err(|e| match e {
            BankError::ShmNoSpace { .. } => BankError::ShmNoSpace {
                field: "budget_bytes",
                bytes: total,
                free_bytes: None,
            }
            .with_free_space(),
            other => other,
        })
    }

    /// A manager whose rank `r` lives in device memory on CUDA ordinal `ordinals[r]` (GPU profile).
    ///
    /// # Errors
    /// `ordinals` not one per rank; [`BankError::CudaUnavailable`] without a
    /// GPU or in a build without the `cuda` feature; a `cuMemAlloc` failure on any rank (earlier ranks are freed).
    pub fn new_cuda(
        config: BankConfig,
        host_id: &str,
        ordinals: &[u32],
    ) -> Result<Self, BankError> {
        if ordinals.len() != config.layout.tp_size() as usize {
            return Err(BankError::arg(
                "ordinals",
                format!(
                    "{} given, tp_size is {}",
                    ordinals.len(),
                    config.layout.tp_size()
                ),
            ));
        }
        #[cfg(feature = "cuda")]
        return Self::new(config, |rank, bytes| {
            let ordinal = ordinals[rank as usize];
            Ok(RankMemory {
                memory: Arc::new(crate::CudaDeviceMemory::new(ordinal, bytes)?),
                location: crate::cuda::gpu_location(ordinal, host_id)?,
            })
        });
        // A build without the `cuda` feature (a router, a CPU-only worker)
        // refuses like a machine without a driver: callers already fall back
        // on this error, so no caller needs a cfg of its own.
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (config, host_id);
            Err(BankError::CudaUnavailable {
                reason: "kv-bank was built without its `cuda` feature".into(),
            })
        }
    }

    /// The published manifest (one descriptor per rank).
    pub fn manifest(&self) -> &BankManifest {
        &self.shared.manifest
    }
    /// The config.
    pub fn config(&self) -> &BankConfig {
        &self.shared.config
    }
    /// Owner lease (engine, role, generation) of this bank.
    pub fn owner(&self) -> &OwnerLease {
        &self.shared.config.owner
    }
    /// Rank `rank`'s bank (memory and descriptor). The value shares the
    /// memory: holding it keeps the region mapped after a close, so rank
    /// workers should take it per store rather than keep it.
    ///
    /// # Errors
    /// [`BankError::BadRank`]; [`BankError::Closed`] after close freed the memory.
    pub fn rank(&self, rank: u32) -> Result<RankBank, BankError> {
        let st = self.shared.state.lock();
        self.rank_locked(&st, rank)
    }

    fn rank_locked(&self, st: &State, rank: u32) -> Result<RankBank, BankError> {
        let tp = self.shared.config.layout.tp_size();
        if rank >= tp {
            return Err(BankError::BadRank { rank, tp_size: tp });
        }
        match &st.banks {
            Some(b) if st.phase == Phase::Open => Ok(b[rank as usize].clone()),
            _ => Err(self.closed()),
        }
    }

    /// The process that created this bank. Only there are its slots
    /// written ([`BankManager::store`], `write_pending*`) and its leases
    /// renewed or revoked; a child forked from it that drops its copy
    /// leaves the bank's segments and leases alone.
    pub fn creator(&self) -> CreatorProcess {
        self.shared.creator
    }

    /// [`BankError::NotCreator`] for `op` outside the creating process.
    fn require_creator(&self, op: &'static str) -> Result<(), BankError> {
        let creator = self.shared.creator;
        if creator.is_current() {
            return Ok(());
        }
        Err(BankError::NotCreator {
            op,
            pid: std::process::id(),
            creator_pid: creator.pid(),
        })
    }

    fn closed(&self) -> BankError {
        BankError::Closed {
            generation: self.shared.config.owner.generation,
        }
    }

    fn push_event(&self, st: &mut State, data: KvEventData) {
        let c = &self.shared.config;
        let e = KvEvent {
            publisher: c.owner.engine_id,
            event_id: st.next_event_id,
            role: c.owner.role,
            layout_fingerprint: c.layout.fingerprint(),
            tp_size: c.layout.tp_size(),
            tier: StorageTier::RetainedGpuDirect,
            data,
        };
        st.next_event_id += 1;
        st.events.push_back(e);
    }

    /// Slot of a ready block (`None` once the generation is dead).
    pub fn lookup(&self, hash: &SequenceHash) -> Option<u32> {
        let st = self.shared.state.lock();
        if st.phase != Phase::Open {
            return None;
        }
        st.table.lookup(hash)
    }

    /// Number of leading blocks of `hashes` (root first) that are ready here.
    pub fn ready_prefix_len(&self, hashes: &[SequenceHash]) -> usize {
        let st = self.shared.state.lock();
        if st.phase != Phase::Open {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| st.table.lookup(h).is_some())
            .count()
    }

    /// What is retained now, exactly: nothing is ready once the generation
    /// is dead (closed or lapsed; the `Cleared` event says the same).
    pub fn inventory(&self) -> Inventory {
        let st = self.shared.state.lock();
        Inventory {
            ready: if st.phase == Phase::Open {
                st.table.ready_hashes()
            } else {
                Vec::new()
            },
            pending_slots: st.pending.values().map(|p| p.entries.len()).sum(),
            quarantined_slots: st.quarantine.iter().map(|(_, s)| s.len()).sum(),
            pinned_slots: st.table.pinned_slots(),
            free_slots: st.table.free_count(),
            slot_count: st.table.slot_count(),
            slot_bytes: self.shared.config.layout.rank_block_bytes() as u64,
        }
    }

    /// Counters since creation.
    pub fn stats(&self) -> BankStats {
        self.shared.state.lock().stats
    }

    /// Takes the queued KV events (tier `RetainedGpuDirect`, event ids +1 each from 1).
    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.shared.state.lock().events.drain(..).collect()
    }

    /// Marks blocks as depending on excluded multimodal input: they join the
    /// lineage, and those ready and unpinned here are removed at once (a
    /// `Removed` event). Pinned ones can no longer be pinned again and are
    /// removed by a later call once unpinned.
    pub fn exclude(&self, hashes: &[SequenceHash]) {
        self.shared.config.lineage.mark(hashes);
        let mut st = self.shared.state.lock();
        let mut removed = Vec::new();
        for h in hashes {
            if let Some(slot) = st.table.lookup(h) {
                if st.table.remove(slot) {
                    removed.push(*h);
                }
            }
        }
        if !removed.is_empty() {
            st.stats.blocks_evicted += removed.len() as u64;
            self.push_event(
                &mut st,
                KvEventData::Removed {
                    sequence_hashes: removed,
                },
            );
        }
    }

    /// The engine cleared (or evicted from) its native cache. Retained blocks
    /// are copies in bank memory, not views of native blocks, so nothing here
    /// changes: this returns the inventory to let callers assert that.
    pub fn native_cleared(&self) -> Inventory {
        self.inventory()
    }

    /// Total pins held now (all slots).
    pub fn pins_outstanding(&self) -> u64 {
        self.shared.state.lock().table.total_pins()
    }

    /// Removes this bank's names from the shared-memory filesystem now:
    /// every host segment it created and every rank's lease file. Nothing
    /// else changes: the memory stays mapped, stores, writes and pins go on
    /// in this process, and the leases are not revoked (the renewal finds
    /// its file gone and stops). Other processes can no longer open the
    /// bank (no name, no lease), and those that mapped it keep their
    /// mappings. The bank's later drop or close finds the names gone and
    /// carries on. Returns the names removed (`/...`); empty on a second
    /// call and outside the creating process (a forked child's copy of the
    /// bank removes nothing of its parent's).
    ///
    /// For a process that exits while a thread may still use the bank (the
    /// Python wheel's exit hook: a bank that interpreter finalization never
    /// drops would leave its names in `/dev/shm` until a reclaim). Takes no
    /// lock of the bank.
    ///
    /// ```
    /// use kv_bank::{BankConfig, BankManager};
    /// use kv_descriptor::*;
    /// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
    /// let cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 8 * layout.block_bytes() as u64);
    /// let bank = BankManager::new_host_shm(cfg, "host-a").unwrap();
    /// let names = bank.unlink_names();
    /// assert_eq!(names.len(), 4); // a segment and a lease per rank
    /// assert!(names.iter().all(|n| !std::path::Path::new(&format!("/dev/shm{n}")).exists()));
    /// assert!(bank.unlink_names().is_empty());
    /// drop(bank); // finds the names gone
    /// ```
    pub fn unlink_names(&self) -> Vec<String> {
        if !self.shared.creator.is_current() {
            return Vec::new();
        }
        let mut removed: Vec<String> = self
            .shared
            .owned_names
            .iter()
            .filter(|n| crate::shm::unlink_name(n))
            .cloned()
            .collect();
        removed.extend(self.shared.leases.unlink_names());
        removed
    }

    /// True once [`BankManager::close`] began: the generation is dead.
    pub fn is_closed(&self) -> bool {
        self.shared.state.lock().phase != Phase::Open
    }

    /// Closes this generation: refuses new pins and stores at once, revokes
    /// and removes its leases (importers refuse it from now on), rolls back
    /// pending stores, queues a `Cleared` event, then waits up to `timeout`
    /// for pins to drain and frees the memory. Idempotent.
    ///
    /// # Errors
    /// [`BankError::CloseTimedOut`] when pins remain after `timeout`: the
    /// generation is still dead, and the memory is freed when the last pin drops.
    pub fn close(&self, timeout: Duration) -> Result<(), BankError> {
        let t0 = Instant::now();
        let mut st = self.shared.state.lock();
        self.kill_generation_locked(&mut st);
        let deadline = t0 + timeout;
        while st.table.total_pins() > 0 {
            if self
                .shared
                .drained
                .wait_until(&mut st, deadline)
                .timed_out()
                && st.table.total_pins() > 0
            {
                return Err(BankError::CloseTimedOut {
                    pins: st.table.total_pins() as usize,
                    waited_ms: t0.elapsed().as_millis() as u64,
                });
            }
        }
        st.phase = Phase::Closed;
        st.banks = None;
        Ok(())
    }
}
