//! The bank manager of one role: one retained bank (TP1) or one rank-local
//! bank per TP rank sharing logical slot ids, with stores that become ready
//! only after every rank acknowledged, pins, LRU eviction, inventory events
//! and close.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{
    chain_sequence_hash, token_block_hashes, BankDescriptor, BankManifest, BankParts, FetchGpuHint,
    KvEvent, KvEventData, KvLayout, MemoryLocation, OwnerLease, SequenceHash, StorageTier,
    StoredBlock,
};
use parking_lot::{Condvar, Mutex};

use crate::lease::{LeaseConfig, LeaseRenewal, OwnerLeases, Renewer};
use crate::slots::{SlotState, SlotTable};
use crate::{BankError, ExclusionLineage, HostShmMemory, RankBank, RankMemory};

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

/// A bank's lease as its owner sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LeaseStatus {
    /// One lease name per rank.
    pub names: Vec<String>,
    /// Earliest expiry over the ranks, lease-clock µs
    /// ([`crate::LeaseInstant::as_micros`]; 0 once revoked).
    pub expires_at_us: u64,
    /// Renewals so far (fewest over the ranks).
    pub renewals: u64,
    /// False once the lease lapsed, was revoked or lost: the generation is dead.
    pub live: bool,
}

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
    let mut prev = parent;
    token_block_hashes(tokens, tokens_per_block)
        .into_iter()
        .map(|token_hash| {
            let sequence_hash = chain_sequence_hash(prev, token_hash);
            prev = Some(sequence_hash);
            StoredBlock {
                sequence_hash,
                token_hash,
            }
        })
        .collect()
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
}

/// Why a pending store is rolled back (decides whether its slots are quarantined).
#[derive(Debug, Clone, Copy)]
enum Rollback {
    Failed(u32),
    TimedOut,
    Closing,
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
    acked: Vec<bool>,
    started: Instant,
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
    leases: Arc<OwnerLeases>,
    /// Taken (stopped) when the generation dies.
    renewer: Mutex<Option<Renewer>>,
}

/// The bank manager of one role (TP1 or TP-N). Cheap to clone (shared).
///
/// Lifecycle of a block: [`BankManager::store`] takes logical slots (free
/// ones first, then LRU eviction of unpinned ready ones) and marks them
/// pending; every rank writes its part of each slot and calls
/// [`BankManager::ack`]; when the last rank acks the blocks become ready,
/// appear in [`BankManager::inventory`] and a `Stored` event is queued. A
/// failed rank ([`BankManager::fail`]) or a missed deadline rolls the store
/// back on all ranks, with no event. Ready blocks are pinned by
/// [`BankManager::pin_prefix`] or [`BankManager::pin_hint`]; eviction never
/// touches a pinned slot. [`BankManager::close`] kills the generation.
///
/// ```
/// use kv_bank::{BankConfig, BankManager, sealed_blocks, StoreStatus};
/// use kv_descriptor::*;
/// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
/// let cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 8 * layout.block_bytes() as u64);
/// let bank = BankManager::new_host_shm(cfg, "host-a").unwrap();
/// assert_eq!(bank.manifest().tp_size(), 2);
/// let blocks = sealed_blocks(None, &(0..12).collect::<Vec<u32>>(), 4);
/// let p = bank.store(None, &blocks).unwrap();
/// assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Waiting { missing: vec![1] });
/// assert!(bank.inventory().ready.is_empty()); // not before every rank acked
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
                    next_store: 1,
                    events: VecDeque::new(),
                    next_event_id: 1,
                    banks: Some(banks),
                    stats: BankStats::default(),
                }),
                config,
                manifest,
                drained: Condvar::new(),
                leases,
                renewer: Mutex::new(renewer),
            }),
        })
    }

    /// A manager whose ranks live in fresh POSIX shared-memory objects on `host_id` (CPU profile).
    ///
    /// Segments are named `/<config.shm_prefix>-<pid>-<n>-<hex>`, each with
    /// its lease next to it (`….lease`).
    ///
    /// # Errors
    /// As [`BankManager::new`] and [`HostShmMemory::create`].
    pub fn new_host_shm(config: BankConfig, host_id: &str) -> Result<Self, BankError> {
        let host = host_id.to_string();
        let prefix = config.shm_prefix.clone();
        Self::new(config, |_, bytes| {
            Ok(RankMemory {
                memory: Arc::new(HostShmMemory::create_unique(&prefix, bytes)?),
                location: MemoryLocation::Host {
                    host_id: host.clone(),
                },
            })
        })
    }

    /// A manager whose rank `r` lives in device memory on CUDA ordinal `ordinals[r]` (GPU profile).
    ///
    /// # Errors
    /// `ordinals` not one per rank; [`BankError::CudaUnavailable`] without a
    /// GPU; a `cuMemAlloc` failure on any rank (earlier ranks are freed).
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
        Self::new(config, |rank, bytes| {
            let ordinal = ordinals[rank as usize];
            Ok(RankMemory {
                memory: Arc::new(crate::CudaDeviceMemory::new(ordinal, bytes)?),
                location: crate::cuda::gpu_location(ordinal, host_id)?,
            })
        })
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

    /// Rolls back every pending store older than the store timeout (returns
    /// their ids) and frees quarantined slots whose time passed. Every
    /// `store` runs it too.
    pub fn expire_overdue(&self) -> Vec<u64> {
        let mut st = self.shared.state.lock();
        self.expire_locked(&mut st, Instant::now())
    }

    fn expire_locked(&self, st: &mut State, now: Instant) -> Vec<u64> {
        let timeout = self.shared.config.store_timeout;
        let overdue: Vec<u64> = st
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.started) >= timeout)
            .map(|(&id, _)| id)
            .collect();
        for id in &overdue {
            self.rollback_locked(st, *id, Rollback::TimedOut);
        }
        let (release, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.quarantine)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        st.quarantine = keep;
        for (_, slots) in release {
            st.table.rollback(&slots);
        }
        overdue
    }

    /// Removes pending store `id`. Its slots are freed at once only when no
    /// rank can still be writing them (every rank acked or is the one that
    /// failed, or the bank is closing); otherwise they are quarantined for one
    /// more store timeout, so a late copy of a slow rank can never land in a
    /// slot that was handed to another store meanwhile.
    fn rollback_locked(&self, st: &mut State, id: u64, why: Rollback) {
        let Some(p) = st.pending.remove(&id) else {
            return;
        };
        let slots: Vec<u32> = p.entries.iter().map(|e| e.2).collect();
        st.stats.stores_rolled_back += 1;
        let quiet = match why {
            Rollback::Closing => true,
            Rollback::Failed(rank) => p
                .acked
                .iter()
                .enumerate()
                .all(|(r, &a)| a || r as u32 == rank),
            Rollback::TimedOut => p.acked.iter().all(|&a| a),
        };
        if quiet {
            st.table.rollback(&slots);
        } else {
            st.quarantine
                .push((Instant::now() + self.shared.config.store_timeout, slots));
        }
    }

    /// Starts storing `blocks` (sealed blocks in prefix order, the first a
    /// child of `parent`, `None` for a root block).
    ///
    /// Blocks already retained are skipped. The first block in the exclusion
    /// lineage, or whose parent is, ends the store: it and every later block
    /// are marked in the lineage and not stored. Slots come from the free
    /// list, then from LRU eviction of unpinned ready blocks (queued as a
    /// `Removed` event). The returned store must be acked by every rank.
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::BrokenChain`] when a sequence hash
    /// does not chain from its parent and token hash; [`BankError::BankFull`]
    /// when not enough slots are free or evictable; [`BankError::LeaseExpired`]
    /// or [`BankError::LeaseLost`] when the bank's lease lapsed (the generation
    /// ends). On error nothing changed.
    pub fn store(
        &self,
        parent: Option<SequenceHash>,
        blocks: &[StoredBlock],
    ) -> Result<PendingStore, BankError> {
        let mut prev = parent;
        for (index, b) in blocks.iter().enumerate() {
            let expected = chain_sequence_hash(prev, b.token_hash);
            if expected != b.sequence_hash {
                return Err(BankError::BrokenChain {
                    index,
                    got: b.sequence_hash.0,
                    expected: expected.0,
                });
            }
            prev = Some(b.sequence_hash);
        }
        let lineage = &self.shared.config.lineage;
        let parents = std::iter::once(parent).chain(blocks.iter().map(|b| Some(b.sequence_hash)));
        let cut = lineage
            .first_tainted(blocks.iter().map(|b| b.sequence_hash).zip(parents))
            .unwrap_or(blocks.len());
        let excluded: Vec<SequenceHash> = blocks[cut..].iter().map(|b| b.sequence_hash).collect();

        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        self.expire_locked(&mut st, Instant::now());
        let pending_hashes: std::collections::HashSet<SequenceHash> = st
            .pending
            .values()
            .flat_map(|p| p.entries.iter().map(|e| e.0.sequence_hash))
            .collect();
        let mut new = Vec::new();
        let mut already = 0;
        for (i, b) in blocks[..cut].iter().enumerate() {
            if st.table.lookup(&b.sequence_hash).is_some()
                || pending_hashes.contains(&b.sequence_hash)
            {
                already += 1;
                continue;
            }
            if new
                .iter()
                .any(|(n, _): &(StoredBlock, _)| n.sequence_hash == b.sequence_hash)
            {
                already += 1;
                continue;
            }
            let parent_of = if i == 0 {
                parent
            } else {
                Some(blocks[i - 1].sequence_hash)
            };
            new.push((*b, parent_of));
        }
        // Consumed even by an empty store: its id must never name a later
        // store (acking it would commit that store before its ranks wrote).
        let store_id = st.next_store;
        let hashes: Vec<SequenceHash> = new.iter().map(|(b, _)| b.sequence_hash).collect();
        let (slots, evicted) =
            st.table
                .allocate(store_id, &hashes)
                .map_err(|available| BankError::BankFull {
                    needed: hashes.len(),
                    available,
                    slot_count: st.table.slot_count(),
                })?;
        // Only now is the store certain: record the lineage and effects.
        lineage.mark(&excluded);
        st.stats.blocks_excluded += excluded.len() as u64;
        if !evicted.is_empty() {
            st.stats.blocks_evicted += evicted.len() as u64;
            self.push_event(
                &mut st,
                KvEventData::Removed {
                    sequence_hashes: evicted,
                },
            );
        }
        let entries: Vec<(SequenceHash, u32)> =
            hashes.iter().copied().zip(slots.iter().copied()).collect();
        st.next_store += 1;
        if !slots.is_empty() {
            st.pending.insert(
                store_id,
                Pending {
                    entries: new
                        .into_iter()
                        .zip(slots)
                        .map(|((b, p), s)| (b, p, s))
                        .collect(),
                    acked: vec![false; self.shared.config.layout.tp_size() as usize],
                    started: Instant::now(),
                },
            );
        }
        Ok(PendingStore {
            store_id,
            entries,
            already_retained: already,
            excluded: excluded.len(),
        })
    }

    /// Writes rank `rank`'s part of entry `index` of pending store `store_id`
    /// (host-copy path). Unlike [`RankBank::write_slot`], this refuses any
    /// slot that is not pending for that store, so it can never overwrite a
    /// ready or pinned block. Device-copy paths write to
    /// [`RankBank::slot_addr`] of the store's slots under the same rule.
    ///
    /// # Errors
    /// [`BankError::UnknownStore`]; [`BankError::BadRank`];
    /// [`BankError::InvalidArgument`] for `index` out of range or a wrong
    /// byte count; the memory's copy error.
    pub fn write_pending(
        &self,
        store_id: u64,
        rank: u32,
        index: usize,
        bytes: &[u8],
    ) -> Result<(), BankError> {
        let st = self.shared.state.lock();
        let p = st
            .pending
            .get(&store_id)
            .ok_or(BankError::UnknownStore(store_id))?;
        let Some(&(_, _, slot)) = p.entries.get(index) else {
            return Err(BankError::arg(
                "index",
                format!(
                    "{index} is not below the store's {} entries",
                    p.entries.len()
                ),
            ));
        };
        // Copy under the lock: a concurrent rollback cannot hand the slot to
        // another store before this copy finished.
        self.rank_locked(&st, rank)?.write_slot(slot, bytes)
    }

    /// Rank `rank` wrote its part of every slot of store `store_id`.
    ///
    /// When the last rank acks, the blocks become ready and one `Stored`
    /// event per contiguous run of new blocks is queued. A block excluded
    /// while the store was pending ([`BankManager::exclude`]), or whose parent
    /// was, and every later block of the store join the lineage and are freed
    /// instead, as [`BankManager::store`] would have refused them.
    ///
    /// # Errors
    /// [`BankError::BadRank`]; [`BankError::UnknownStore`] (already ready,
    /// rolled back, or never made); [`BankError::StoreTimedOut`] when the
    /// deadline passed: the store is rolled back on all ranks;
    /// [`BankError::LeaseExpired`] / [`BankError::LeaseLost`] when the lease
    /// lapsed (every pending store is rolled back with the generation).
    pub fn ack(&self, store_id: u64, rank: u32) -> Result<StoreStatus, BankError> {
        let tp = self.shared.config.layout.tp_size();
        if rank >= tp {
            return Err(BankError::BadRank { rank, tp_size: tp });
        }
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        let timeout = self.shared.config.store_timeout;
        let Some(p) = st.pending.get_mut(&store_id) else {
            return Err(BankError::UnknownStore(store_id));
        };
        let waited = p.started.elapsed();
        if waited >= timeout {
            let missing = missing_ranks(&p.acked);
            self.rollback_locked(&mut st, store_id, Rollback::TimedOut);
            return Err(BankError::StoreTimedOut {
                store_id,
                waited_ms: waited.as_millis() as u64,
                missing,
            });
        }
        p.acked[rank as usize] = true;
        let missing = missing_ranks(&p.acked);
        if !missing.is_empty() {
            return Ok(StoreStatus::Waiting { missing });
        }
        let mut p = st.pending.remove(&store_id).expect("present above");
        // The rule of `store`, again at commit: a block excluded while the
        // store was pending (or whose parent was) ends it; it and every later
        // (descendant) block join the lineage and are freed, never ready.
        let lineage = &self.shared.config.lineage;
        let cut = lineage
            .first_tainted(
                p.entries
                    .iter()
                    .map(|(b, parent, _)| (b.sequence_hash, *parent)),
            )
            .unwrap_or(p.entries.len());
        let dropped = p.entries.split_off(cut);
        if !dropped.is_empty() {
            let hashes: Vec<SequenceHash> = dropped.iter().map(|e| e.0.sequence_hash).collect();
            lineage.mark(&hashes);
            st.stats.blocks_excluded += hashes.len() as u64;
            let freed: Vec<u32> = dropped.iter().map(|e| e.2).collect();
            st.table.rollback(&freed);
        }
        let slots: Vec<u32> = p.entries.iter().map(|e| e.2).collect();
        st.table.commit(&slots);
        st.stats.stores_ready += 1;
        st.stats.blocks_stored += slots.len() as u64;
        // One Stored event per run whose blocks chain one after another.
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        for (b, parent, _) in p.entries {
            if run.last().is_some_and(|l| Some(l.sequence_hash) != parent) {
                let blocks = std::mem::take(&mut run);
                self.push_event(
                    &mut st,
                    KvEventData::Stored {
                        parent: run_parent,
                        blocks,
                    },
                );
            }
            if run.is_empty() {
                run_parent = parent;
            }
            run.push(b);
        }
        if !run.is_empty() {
            self.push_event(
                &mut st,
                KvEventData::Stored {
                    parent: run_parent,
                    blocks: run,
                },
            );
        }
        Ok(StoreStatus::Ready)
    }

    /// Rank `rank` failed to write its part: the store is rolled back on all
    /// ranks at once (never visible, no event). If another rank had neither
    /// acked nor failed, it may still be copying into the slots, so they stay
    /// quarantined for one more store timeout before reuse; the same holds for
    /// a store that timed out.
    ///
    /// # Errors
    /// [`BankError::BadRank`]; [`BankError::UnknownStore`].
    pub fn fail(&self, store_id: u64, rank: u32) -> Result<(), BankError> {
        let tp = self.shared.config.layout.tp_size();
        if rank >= tp {
            return Err(BankError::BadRank { rank, tp_size: tp });
        }
        let mut st = self.shared.state.lock();
        if !st.pending.contains_key(&store_id) {
            return Err(BankError::UnknownStore(store_id));
        }
        tracing::warn!(
            store_id,
            rank,
            "rank failed its store part; rolling back on all ranks"
        );
        self.rollback_locked(&mut st, store_id, Rollback::Failed(rank));
        Ok(())
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

    /// Pins every block of `hashes` (all must be ready) on all ranks.
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::NotRetained`] naming the first
    /// block not ready; [`BankError::Excluded`] for a block in the exclusion
    /// lineage; [`BankError::LeaseExpired`] / [`BankError::LeaseLost`] when
    /// the lease lapsed. Nothing is pinned on error.
    pub fn pin_prefix(&self, hashes: &[SequenceHash]) -> Result<ManagerPin, BankError> {
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        let mut slots = Vec::with_capacity(hashes.len());
        for h in hashes {
            if self.shared.config.lineage.is_excluded(h) {
                return Err(BankError::Excluded(*h));
            }
            slots.push(st.table.lookup(h).ok_or(BankError::NotRetained(*h))?);
        }
        Ok(self.pin_locked(&mut st, hashes.to_vec(), slots))
    }

    fn pin_locked(&self, st: &mut State, hashes: Vec<SequenceHash>, slots: Vec<u32>) -> ManagerPin {
        st.table.pin(&slots);
        st.stats.pins += 1;
        let banks = st.banks.clone().expect("open bank has memory");
        ManagerPin {
            shared: self.shared.clone(),
            hashes,
            slots,
            banks,
            _live: crate::leaks::Live::new(&crate::leaks::PINS),
        }
    }

    /// Checks a descriptor received from elsewhere against this live bank.
    ///
    /// # Errors
    /// [`BankError::StaleOwner`] for another engine or generation;
    /// [`BankError::Closed`] when this generation is closed;
    /// [`BankError::LeaseExpired`] / [`BankError::LeaseLost`] when its lease lapsed.
    pub fn check_descriptor(&self, d: &BankDescriptor) -> Result<(), BankError> {
        self.check_owner(d.owner().engine_id, d.owner().generation)?;
        {
            let mut st = self.shared.state.lock();
            self.enforce_lease_locked(&mut st)?;
            if st.phase != Phase::Open {
                return Err(self.closed());
            }
        }
        if self.shared.manifest.parts().get(d.tp_rank() as usize) != Some(d) {
            return Err(BankError::StaleOwner {
                field: "descriptor",
                requested: format!("rank {} checksum {:#x}", d.tp_rank(), d.checksum()),
                actual: "a different descriptor for that rank".into(),
            });
        }
        Ok(())
    }

    fn check_owner(
        &self,
        engine: kv_descriptor::EngineId,
        generation: u64,
    ) -> Result<(), BankError> {
        let o = &self.shared.config.owner;
        if engine != o.engine_id {
            return Err(BankError::StaleOwner {
                field: "engine_id",
                requested: engine.to_string(),
                actual: o.engine_id.to_string(),
            });
        }
        if generation != o.generation {
            return Err(BankError::StaleOwner {
                field: "bank_generation",
                requested: generation.to_string(),
                actual: o.generation.to_string(),
            });
        }
        Ok(())
    }

    /// Donor side of a fetch: validates a `kv.fetch_gpu@1.0` hint against
    /// this bank and pins the slots it names.
    ///
    /// Checked before anything is pinned, from the slot table alone (bank
    /// memory is never read): engine id, generation (a closed generation is
    /// refused), the bank's own lease (a lapsed lease kills the generation),
    /// layout fingerprint, TP size, as many parts as ranks with identical slot
    /// lists, every slot id below the slot count, and that slot
    /// `parts[r].slot_ids[i]` holds the ready block `sequence_hashes[fetch_from + i]`.
    /// The hint's own shape (parts in `tp_rank` order without duplicates,
    /// `expected_bytes`, a non-empty fetch) is not checked here: that is
    /// [`kv_descriptor::FetchGpuHint::validate`], which the fetching side runs first. The slots
    /// pinned are the same either way.
    ///
    /// # Errors
    /// [`BankError::StaleOwner`], [`BankError::Closed`],
    /// [`BankError::LeaseExpired`], [`BankError::LeaseLost`],
    /// [`BankError::SlotOutOfRange`], [`BankError::SlotMismatch`],
    /// [`BankError::Excluded`], [`BankError::InvalidArgument`] for a malformed hint.
    pub fn pin_hint(&self, hint: &FetchGpuHint) -> Result<ManagerPin, BankError> {
        self.check_owner(hint.donor_engine_id, hint.bank_generation)?;
        let c = &self.shared.config;
        if hint.layout_fingerprint != c.layout.fingerprint() {
            return Err(BankError::StaleOwner {
                field: "layout_fingerprint",
                requested: hint.layout_fingerprint.to_string(),
                actual: c.layout.fingerprint().to_string(),
            });
        }
        if hint.tp_size != c.layout.tp_size() || hint.parts.len() != c.layout.tp_size() as usize {
            return Err(BankError::StaleOwner {
                field: "tp_size",
                requested: format!("{} with {} parts", hint.tp_size, hint.parts.len()),
                actual: c.layout.tp_size().to_string(),
            });
        }
        let from = hint.fetch_from as usize;
        let Some(fetched) = hint.sequence_hashes.get(from..) else {
            return Err(BankError::arg(
                "fetch_from",
                format!("{from} beyond {} hashes", hint.sequence_hashes.len()),
            ));
        };
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        let slot_count = st.table.slot_count();
        for part in &hint.parts {
            if part.slot_ids.len() != fetched.len() {
                return Err(BankError::arg(
                    "parts.slot_ids",
                    format!(
                        "rank {} lists {} slots for {} blocks",
                        part.tp_rank,
                        part.slot_ids.len(),
                        fetched.len()
                    ),
                ));
            }
            for (index, (&slot, h)) in part.slot_ids.iter().zip(fetched).enumerate() {
                if slot >= slot_count {
                    return Err(BankError::SlotOutOfRange {
                        rank: part.tp_rank,
                        index,
                        slot,
                        slot_count,
                    });
                }
                if c.lineage.is_excluded(h) {
                    return Err(BankError::Excluded(*h));
                }
                let holds = matches!(st.table.state(slot), Some(SlotState::Ready { hash, .. }) if hash == *h);
                if !holds {
                    return Err(BankError::SlotMismatch {
                        rank: part.tp_rank,
                        index,
                        slot,
                        expected: *h,
                    });
                }
            }
        }
        let slots = hint.parts[0].slot_ids.clone();
        Ok(self.pin_locked(&mut st, fetched.to_vec(), slots))
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

impl BankManager {
    /// Ends an open generation (close, or a lapsed lease): no new pins or
    /// stores, pending stores rolled back, `Cleared` queued, renewal stopped,
    /// leases revoked and removed; memory freed now if nothing is pinned,
    /// else when the last pin drops.
    fn kill_generation_locked(&self, st: &mut State) {
        if st.phase != Phase::Open {
            return;
        }
        st.phase = Phase::Closing;
        let ids: Vec<u64> = st.pending.keys().copied().collect();
        for id in ids {
            self.rollback_locked(st, id, Rollback::Closing);
        }
        self.push_event(st, KvEventData::Cleared);
        drop(self.shared.renewer.lock().take());
        self.shared.leases.revoke_all();
        if st.table.total_pins() == 0 {
            st.phase = Phase::Closed;
            st.banks = None;
        }
    }

    /// The owner's own view of its lease: once it lapsed (the owner stalled
    /// past it, or a reclaimer revoked it) the generation is dead, because
    /// importers already refuse it and a reclaimer may have removed it.
    fn enforce_lease_locked(&self, st: &mut State) -> Result<(), BankError> {
        if st.phase != Phase::Open {
            return Ok(());
        }
        if let Err(e) = self.shared.leases.check_live(crate::LeaseInstant::now()) {
            tracing::warn!(
                "bank generation {} ends: {e}",
                self.shared.config.owner.generation
            );
            self.kill_generation_locked(st);
            return Err(e);
        }
        Ok(())
    }

    /// Renews every rank's lease now (the engine's call under
    /// [`LeaseRenewal::Manual`]; allowed under background renewal too).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_bank::{BankConfig, BankManager, HostShmMemory, LeaseConfig};
    /// use kv_descriptor::*;
    /// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    /// let mut cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 4 * layout.block_bytes() as u64);
    /// cfg.lease = LeaseConfig::manual(Duration::from_secs(10));
    /// let bank = BankManager::new_host_shm(cfg, "host-a").unwrap();
    /// let s = bank.renew_lease().unwrap();
    /// assert!(s.live && s.renewals == 1);
    /// let d = bank.manifest().parts()[0].clone();
    /// assert!(HostShmMemory::open_descriptor(&d).is_ok()); // live lease, same incarnation
    /// bank.close(Duration::from_secs(1)).unwrap();
    /// assert!(HostShmMemory::open_descriptor(&d).is_err()); // lease gone with the generation
    /// ```
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::LeaseLost`] or
    /// [`BankError::LeaseExpired`] when the lease already lapsed or was
    /// revoked: a lapsed lease is never renewed, and the generation dies
    /// (as by [`BankManager::close`] without waiting).
    pub fn renew_lease(&self) -> Result<LeaseStatus, BankError> {
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        if let Err(e) = self.shared.leases.renew(crate::LeaseInstant::now()) {
            self.kill_generation_locked(&mut st);
            return Err(e);
        }
        drop(st);
        Ok(self.lease_status())
    }

    /// Lease names, expiry and renewals of this bank.
    pub fn lease_status(&self) -> LeaseStatus {
        let l = &self.shared.leases;
        let expires_at_us = l.expires_at_us();
        LeaseStatus {
            names: l.names(),
            expires_at_us,
            renewals: l.renewals(),
            live: !l.is_lost()
                && expires_at_us != 0
                && crate::LeaseInstant::now().as_micros() < expires_at_us,
        }
    }

    /// The lease settings this bank runs with.
    pub fn lease_config(&self) -> LeaseConfig {
        self.shared.leases.config()
    }
}

fn missing_ranks(acked: &[bool]) -> Vec<u32> {
    acked
        .iter()
        .enumerate()
        .filter(|(_, &a)| !a)
        .map(|(r, _)| r as u32)
        .collect()
}

/// Pins on one fetch's slots, on every rank; released on drop.
///
/// While it lives the slots are never evicted and their memory is never
/// freed (it holds the ranks' memory), even if the bank is closed meanwhile.
#[derive(Debug)]
pub struct ManagerPin {
    shared: Arc<Shared>,
    hashes: Vec<SequenceHash>,
    slots: Vec<u32>,
    banks: Vec<RankBank>,
    _live: crate::leaks::Live,
}

impl ManagerPin {
    /// Logical slot ids, one per pinned block, in the order asked.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }
    /// Pinned blocks.
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }
    /// Rank `rank`'s bank (memory and descriptor), valid while the pin lives.
    ///
    /// # Errors
    /// [`BankError::BadRank`].
    pub fn rank(&self, rank: u32) -> Result<&RankBank, BankError> {
        self.banks.get(rank as usize).ok_or(BankError::BadRank {
            rank,
            tp_size: self.banks.len() as u32,
        })
    }
}

impl Drop for ManagerPin {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        st.table.unpin(&self.slots);
        if st.table.total_pins() == 0 {
            if st.phase != Phase::Open {
                // A close that timed out left the memory for the last pin to free.
                st.phase = Phase::Closed;
                st.banks = None;
            }
            self.shared.drained.notify_all();
        }
    }
}
