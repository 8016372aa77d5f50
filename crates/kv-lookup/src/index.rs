//! [`InventoryIndex`]: who holds which sequence hash in which tier, fed by KV events.

use std::collections::{HashMap, HashSet};

use kv_descriptor::{EngineId, KvEvent, LayoutFingerprint, Role, SequenceHash, StorageTier};

use crate::chain::UnchainedStore;
use crate::holder_table::{
    tier_index, HolderTable, Loc, LocIndex, Locator, TierBits, ALL_TIERS, TIERS,
};
use crate::mutation::{Change, CheckedEvent, Effect, Mutation};
pub use crate::report::{EventBatchReport, EventOutcome, IndexStats, Registration};
use crate::twin::Twin;
use crate::worker::{WorkerInfo, WorkerKey, WorkerRecord};
use crate::LookupError;

mod compaction;
mod membership;
mod state;
#[cfg(test)]
mod stress_tests;

use compaction::compact_log;

/// Most workers (live incarnations) one index tracks: 64 groups of 64.
pub const MAX_WORKERS: usize = 4096;

/// How long [`InventoryIndex::holds`] waits for the writer lock before it
/// scans the published copy instead: writes hold the lock for microseconds
/// (a large batch for milliseconds).
pub const HOLDS_LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(5);

/// Workers per holder-table group (bits of a `u64`).
pub(crate) const GROUP_WIDTH: usize = 64;

/// Donor candidates for one (layout fingerprint, TP size): per group, the
/// bitset of decode workers that are not waiting for a resync.
pub(crate) struct DonorMask {
    pub(crate) fingerprint: LayoutFingerprint,
    pub(crate) tp_size: u32,
    pub(crate) groups: Vec<u64>,
}

/// The writer's side of the index, kept once for both copies (the
/// [`Twin`]'s shared state): per worker group, the full map from each held
/// sequence hash to its entry. Both copies keep their runs in the same
/// layout, so one map serves both (see `holder_table`'s module docs).
pub(crate) struct WriterMaps {
    pub(crate) groups: Vec<LocIndex>,
    /// Capacity hint for the first group's map (entries).
    first_capacity: usize,
}

impl WriterMaps {
    pub(crate) fn new(first_capacity: usize) -> Self {
        Self {
            groups: Vec::new(),
            first_capacity,
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.groups.iter().map(LocIndex::memory_bytes).sum()
    }
}

/// What a mutation's first application leaves for its replay.
#[derive(Default)]
pub(crate) struct MutationMemo {
    /// The full map's answers, in the order the application asked.
    pub(crate) locs: Vec<Option<Loc>>,
    /// [`WriterMaps`]' bytes after the mutation (for [`IndexStats`]).
    pub(crate) map_bytes: usize,
    /// The worker log a store compacted, if any (`compaction::compact_log`).
    pub(crate) compacted: Option<Vec<SequenceHash>>,
}

/// How one application of a mutation reaches the full maps: the writer's
/// maps themselves (first application, answers logged) or the log
/// (replay).
pub(crate) enum Locs<'a> {
    First {
        maps: &'a mut WriterMaps,
        log: &'a mut Vec<Option<Loc>>,
        compacted: &'a mut Option<Vec<SequenceHash>>,
    },
    Replay {
        log: &'a [Option<Loc>],
        pos: usize,
        compacted: &'a mut Option<Vec<SequenceHash>>,
    },
}

impl<'a> Locs<'a> {
    /// This application's view of `memo`: the first (with the writer's
    /// maps) or the replay.
    pub(crate) fn of(maps: Option<&'a mut WriterMaps>, memo: &'a mut MutationMemo) -> Self {
        match maps {
            Some(maps) => Locs::First {
                maps,
                log: &mut memo.locs,
                compacted: &mut memo.compacted,
            },
            None => Locs::Replay {
                log: &memo.locs,
                pos: 0,
                compacted: &mut memo.compacted,
            },
        }
    }

    /// The locator of group `g`'s table.
    pub(crate) fn group(&mut self, g: usize) -> Locator<'_> {
        self.group_and_compaction(g).0
    }

    /// [`Self::group`], and where a worker-log compaction is kept for the
    /// replay ([`MutationMemo::compacted`]).
    pub(crate) fn group_and_compaction(
        &mut self,
        g: usize,
    ) -> (Locator<'_>, &mut Option<Vec<SequenceHash>>) {
        match self {
            Locs::First {
                maps,
                log,
                compacted,
            } => (
                Locator::Map {
                    map: &mut maps.groups[g],
                    log: Some(&mut **log),
                },
                &mut **compacted,
            ),
            Locs::Replay {
                log,
                pos,
                compacted,
            } => (Locator::Replay { log, pos }, &mut **compacted),
        }
    }

    /// A new group's map (the copies create its table themselves).
    fn add_group(&mut self) {
        if let Locs::First { maps, .. } = self {
            let cap = if maps.groups.is_empty() {
                maps.first_capacity
            } else {
                0
            };
            maps.groups.push(LocIndex::with_capacity(cap));
        }
    }
}

/// Everything the index knows; it exists twice (see [`crate::twin`]).
pub(crate) struct State {
    pub(crate) groups: Vec<HolderTable>,
    /// Bytes of the writer's full maps after the last mutation (they are
    /// not part of a copy; counted in [`IndexStats::table_bytes`]).
    pub(crate) map_bytes: usize,
    /// Worker records by slot (`slot = 64 * group + bit`).
    pub(crate) workers: Vec<Option<WorkerRecord>>,
    pub(crate) by_engine: HashMap<EngineId, u32>,
    by_key: HashMap<WorkerKey, u32>,
    retired: HashSet<EngineId>,
    free_slots: Vec<u32>,
    pub(crate) donor_masks: Vec<DonorMask>,
    /// Capacity hint for new groups' tables (entries).
    group_capacity: usize,
    events_applied: u64,
    duplicates: u64,
    gaps: u64,
    from_retired: u64,
    unchained: u64,
}

/// Inventory index: for every sequence hash, which workers hold it in which
/// tier; plus each worker's identity and event-stream position.
///
/// All methods take `&self`, so an `Arc<InventoryIndex>` can be shared by
/// event threads and request threads. The state exists twice (left-right):
/// lookups ([`InventoryIndex::lookup`]) read the published copy without a
/// lock and never wait for event application; mutations are serialized,
/// applied to the other copy and published with one pointer swap when the
/// call returns (read-your-writes), then replayed on the copy readers left.
/// Costs: twice the memory of one copy's runs and entry points, plus one
/// full hash map that only the writer uses ([`IndexStats::table_bytes`]
/// counts one copy and that map); each mutation applied twice, the replay
/// without probing any map.
///
/// ```
/// use kv_descriptor::*;
/// use kv_lookup::{InventoryIndex, EventOutcome};
///
/// let index = InventoryIndex::new();
/// let decode = EngineId::fresh();
/// let tokens: Vec<u32> = (0..64).collect();
/// let hashes = sequence_hashes(&tokens, 16);
/// let token_hashes = token_block_hashes(&tokens, 16);
/// let stored = KvEvent {
///     publisher: decode,
///     event_id: 1,
///     role: Role::Decode,
///     layout_fingerprint: LayoutFingerprint(9),
///     tp_size: 1,
///     tier: StorageTier::RetainedGpuDirect,
///     data: KvEventData::Stored {
///         parent: None,
///         blocks: hashes.iter().zip(&token_hashes)
///             .map(|(&sequence_hash, &token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect(),
///     },
/// };
/// assert_eq!(index.apply_event(&stored).unwrap(), EventOutcome::Applied { changed: 4 });
/// // Replaying the same event is a duplicate and changes nothing.
/// assert!(matches!(index.apply_event(&stored).unwrap(), EventOutcome::Duplicate { .. }));
/// assert_eq!(index.stats().held_blocks_in(StorageTier::RetainedGpuDirect), 4);
/// ```
pub struct InventoryIndex {
    pub(crate) state: Twin<State>,
}

impl Default for InventoryIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl InventoryIndex {
    /// An empty index with small tables (they grow by doubling).
    ///
    /// ```
    /// use kv_descriptor::{EngineId, SequenceHash};
    /// use kv_lookup::{InventoryIndex, LookupBudget, NoDonorReason};
    /// let index = InventoryIndex::new();
    /// let stats = index.stats();
    /// assert_eq!((stats.workers, stats.entries, stats.table_bytes), (0, 0, 0));
    /// let target = EngineId::fresh();
    /// let out = index.lookup(&[SequenceHash(1)], target, LookupBudget::default());
    /// assert_eq!(out.donor, Err(NoDonorReason::UnknownTarget(target)));
    /// ```
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty index whose first worker group holds `blocks` distinct
    /// sequence hashes without rehashing (a rehash holds the write lock for
    /// time linear in the table size, ~tens of ms at a million blocks).
    ///
    /// ```
    /// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
    /// use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
    /// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
    /// let (small, sized) = (InventoryIndex::new(), InventoryIndex::with_capacity(100_000));
    /// for index in [&small, &sized] {
    ///     index.register_worker(WorkerKey(1), w)?; // creates the first group's table
    /// }
    /// assert!(sized.stats().table_bytes > 100 * small.stats().table_bytes);
    /// # Ok::<(), kv_lookup::LookupError>(())
    /// ```
    pub fn with_capacity(blocks: usize) -> Self {
        Self {
            state: Twin::new(
                State::new(blocks),
                State::new(blocks),
                WriterMaps::new(blocks),
            ),
        }
    }

    /// Applies one event (see [`InventoryIndex::apply_events`] for batches).
    ///
    /// Calls from several threads at once are combined: the first to take
    /// the writer lock applies every event queued by then, in queue order,
    /// and publishes them together; each call still returns its own
    /// outcome, after its event is visible to lookups.
    ///
    /// An event of an unknown publisher registers it (keyed by
    /// [`WorkerKey::of_engine`]). Stored blocks are indexed by their sequence
    /// hash alone (a chained hash names its whole prefix; coverage from the
    /// root is checked by lookups), so a Stored event must chain: its
    /// `parent`, when set, must be held by the publisher in the event's tier,
    /// and every block's sequence hash must chain from its parent's and its
    /// own token hash (a root block is not checked). One that does not is
    /// stored not at all and marks the worker for a resync
    /// ([`EventOutcome::Unchained`]); a Stored event without blocks is
    /// applied as a no-op.
    ///
    /// # Errors
    /// [`LookupError::ZeroEventId`], [`LookupError::ZeroTpSize`],
    /// [`LookupError::IdentityMismatch`], [`LookupError::TooManyWorkers`];
    /// nothing is applied then.
    ///
    /// # Examples
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const DEV: StorageTier = StorageTier::Device;
    /// // Never registered: its first event registers it.
    /// let d = worker(Role::Decode);
    /// assert_eq!(index.apply_event(&event(&d, 1, DEV, stored(4)))?, EventOutcome::Applied { changed: 4 });
    /// assert_eq!(index.holds(d.engine, hashes[3]), vec![DEV]);
    /// assert_eq!(index.apply_event(&event(&d, 2, DEV, KvEventData::Cleared))?, EventOutcome::Applied { changed: 4 });
    /// assert!(index.holds(d.engine, hashes[3]).is_empty());
    /// // Refused, nothing applied: the same engine claiming another role.
    /// let liar = WorkerInfo { role: Role::Prefill, ..d };
    /// let err = index.apply_event(&event(&liar, 3, DEV, stored(4))).unwrap_err();
    /// assert!(matches!(err, LookupError::IdentityMismatch { field: "role", .. }));
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn apply_event(&self, event: &KvEvent) -> Result<EventOutcome, LookupError> {
        // Clone and hash-chain check outside the writer lock: writer
        // threads do that part in parallel, and the replay skips it.
        // Concurrent callers are combined: one applies all their events and
        // publishes once (see `crate::twin`).
        let checked = CheckedEvent::new(event);
        let out = match self.state.submit(Mutation::Event(checked)) {
            Effect::Event(r) => r,
            _ => unreachable!("an event reports an event outcome"),
        };
        log_needs_resync(event.publisher, event.event_id, &out);
        out
    }

    /// Applies events in order and publishes them at once: a lookup sees
    /// none or all of the batch. Cheaper per event than
    /// [`InventoryIndex::apply_event`] (one publication and one wait for
    /// readers per batch); a refused event does not stop the batch.
    ///
    /// Each event's outcome is the one [`InventoryIndex::apply_event`]
    /// would have returned for it, applied one by one in the same order:
    /// [`EventBatchReport::outcomes`] holds them in batch order, refusals
    /// included (also listed in [`EventBatchReport::refused`]), and the
    /// other fields total them. An empty batch publishes nothing.
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let d = worker(Role::Decode);
    /// let before = index.publications();
    /// let report = index.apply_events(&[
    ///     event(&d, 1, RET, stored(4)),
    ///     event(&d, 2, RET, KvEventData::Removed { sequence_hashes: vec![hashes[3]] }),
    /// ]);
    /// assert_eq!(report.outcomes, vec![Ok(EventOutcome::Applied { changed: 4 }), Ok(EventOutcome::Applied { changed: 1 })]);
    /// assert_eq!(index.publications(), before + 1); // lookups saw both events at once
    /// assert_eq!(index.stats().held_blocks_in(RET), 3);
    /// ```
    pub fn apply_events(&self, events: &[KvEvent]) -> EventBatchReport {
        let mut report = EventBatchReport {
            outcomes: Vec::with_capacity(events.len()),
            ..EventBatchReport::default()
        };
        let checked: Vec<CheckedEvent> = events.iter().map(CheckedEvent::new).collect();
        self.state.write(|b| {
            for ((i, e), c) in events.iter().enumerate().zip(checked) {
                let out = apply_logged(b, c);
                report.outcomes.push(out.clone());
                match out {
                    Ok(EventOutcome::Applied { changed }) => {
                        report.applied += 1;
                        report.changed += changed;
                    }
                    Ok(EventOutcome::Gap {
                        expected,
                        got,
                        changed,
                    }) => {
                        report.applied += 1;
                        report.changed += changed;
                        report.gaps.push((e.publisher, expected, got));
                    }
                    Ok(EventOutcome::Duplicate { .. }) => report.duplicates += 1,
                    Ok(EventOutcome::FromRetiredIncarnation) => report.from_retired += 1,
                    Ok(EventOutcome::Unchained { cause }) => {
                        report.unchained.push((e.publisher, e.event_id, cause));
                    }
                    Err(err) => report.refused.push((i, err)),
                }
            }
        });
        report
    }

    /// Replaces a worker's whole inventory with a snapshot taken at
    /// `last_event_id` (events up to it are then duplicates) and makes it a
    /// donor candidate again. This is how a gap is repaired.
    ///
    /// # Errors
    /// [`LookupError::UnknownEngine`] when the engine is not live.
    ///
    /// # Examples
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
    /// index.register_worker(WorkerKey(1), d)?;
    /// index.register_worker(WorkerKey(2), p)?;
    /// index.apply_event(&event(&d, 1, RET, stored(2)))?;
    /// index.apply_event(&event(&d, 4, RET, stored(4)))?; // events 2 and 3 were lost
    /// let donor = || index.lookup(&hashes, p.engine, LookupBudget::default()).donor;
    /// assert_eq!(donor(), Err(NoDonorReason::NoCompatibleDonor)); // excluded until resynced
    /// // The worker's inventory as of its event 4: 4 retained blocks.
    /// index.resync_worker(d.engine, 4, &[(RET, hashes.clone())])?;
    /// assert_eq!(donor().unwrap().blocks, 4);
    /// let unknown = EngineId::fresh();
    /// assert_eq!(index.resync_worker(unknown, 1, &[]), Err(LookupError::UnknownEngine { engine: unknown }));
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn resync_worker(
        &self,
        engine: EngineId,
        last_event_id: u64,
        inventory: &[(StorageTier, Vec<SequenceHash>)],
    ) -> Result<(), LookupError> {
        let m = Mutation::Resync {
            engine,
            last_event_id,
            inventory: inventory.to_vec(),
        };
        match self.state.write(|b| b.apply(m)) {
            Effect::Resync(r) => r,
            _ => unreachable!("a resync reports a resync"),
        }
    }

    /// How many times a new state was published to lookups since the index
    /// was created: one per mutating call that applied at least one
    /// mutation, whether or not it changed the content (a duplicate or a
    /// refused event still publishes; an empty batch does not)
    /// ([`InventoryIndex::apply_events`] once per batch, concurrent
    /// [`InventoryIndex::apply_event`] calls once per combined batch,
    /// registrations, removals, resyncs, forgotten retirements). Each
    /// publication makes lookups switch copies, so fewer is cheaper for
    /// them. One relaxed atomic load, no lock; meant for metrics and tests.
    ///
    /// ```
    /// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
    /// use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
    /// let index = InventoryIndex::new();
    /// assert_eq!(index.publications(), 0);
    /// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
    /// index.register_worker(WorkerKey(1), w)?;
    /// index.register_worker(WorkerKey(1), w)?; // no change, still published
    /// assert_eq!(index.publications(), 2);
    /// index.apply_events(&[]); // an empty batch publishes nothing
    /// assert_eq!(index.publications(), 2);
    /// # Ok::<(), kv_lookup::LookupError>(())
    /// ```
    pub fn publications(&self) -> u64 {
        self.state.publications()
    }

    /// Live incarnations that saw a gap and wait for
    /// [`InventoryIndex::resync_worker`].
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// let d = worker(Role::Decode);
    /// index.apply_event(&event(&d, 1, StorageTier::Device, stored(4)))?;
    /// assert!(index.workers_needing_resync().is_empty());
    /// index.apply_event(&event(&d, 3, StorageTier::Device, KvEventData::Cleared))?; // event 2 was lost
    /// assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    /// assert_eq!(index.stats().workers_needing_resync, 1);
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn workers_needing_resync(&self) -> Vec<EngineId> {
        let st = self.state.read();
        st.workers
            .iter()
            .flatten()
            .filter(|w| w.needs_resync)
            .map(|w| w.info.engine)
            .collect()
    }

    /// Identity of a live incarnation.
    ///
    /// ```
    /// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
    /// use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
    /// let index = InventoryIndex::new();
    /// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Prefill, layout_fingerprint: LayoutFingerprint(7), tp_size: 2 };
    /// index.register_worker(WorkerKey(3), w)?;
    /// assert_eq!(index.worker(w.engine), Some((WorkerKey(3), w)));
    /// assert_eq!(index.worker(EngineId::fresh()), None);
    /// # Ok::<(), kv_lookup::LookupError>(())
    /// ```
    pub fn worker(&self, engine: EngineId) -> Option<(WorkerKey, WorkerInfo)> {
        let st = self.state.read();
        let slot = *st.by_engine.get(&engine)?;
        st.workers[slot as usize].as_ref().map(|w| (w.key, w.info))
    }

    /// Tiers in which `engine` holds `hash` (empty for unknown engines), as
    /// of every write that returned before this call. Meant for checks and
    /// tests, not the request path: a copy indexes entry points only, so
    /// this reads the writer's full map under the writer lock; when a
    /// writer keeps the lock for [`HOLDS_LOCK_WAIT`] it scans the published
    /// copy's runs instead (time linear in the entries; no deadlock when it
    /// is called while the caller holds a copy, e.g. from a
    /// [`InventoryIndex::lookup_cancellable`] check that a writer waits for).
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// use kv_descriptor::StorageTier::{Device, RetainedGpuDirect};
    /// let d = worker(Role::Decode);
    /// index.apply_event(&event(&d, 1, RetainedGpuDirect, stored(4)))?;
    /// index.apply_event(&event(&d, 2, Device, stored(2)))?;
    /// assert_eq!(index.holds(d.engine, hashes[1]), vec![Device, RetainedGpuDirect]);
    /// assert_eq!(index.holds(d.engine, hashes[3]), vec![RetainedGpuDirect]);
    /// assert!(index.holds(EngineId::fresh(), hashes[0]).is_empty());
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn holds(&self, engine: EngineId, hash: SequenceHash) -> Vec<StorageTier> {
        let tiers = |st: &State, bits: &dyn Fn(usize) -> TierBits| {
            let Some(&slot) = st.by_engine.get(&engine) else {
                return Vec::new();
            };
            let (g, bit) = split(slot);
            let bits = bits(g);
            ALL_TIERS
                .iter()
                .copied()
                .filter(|&t| bits[tier_index(t)] >> bit & 1 == 1)
                .collect()
        };
        // Only the writer's full map finds any hash quickly (a copy indexes
        // entry points only), and it is only read under the writer lock.
        let mapped = self.state.try_inspect_for(HOLDS_LOCK_WAIT, |st, maps| {
            tiers(st, &|g| st.groups[g].get_in(&maps.groups[g], hash))
        });
        mapped.unwrap_or_else(|| {
            // The lock stayed taken: perhaps by a writer waiting for a copy
            // this thread holds. The published copy has every returned
            // write; a scan of its runs finds the hash's one live entry.
            let st = self.state.read();
            tiers(&st, &|g| st.groups[g].bits_by_scan(hash))
        })
    }

    /// Counters and sizes.
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let d = worker(Role::Decode);
    /// index.apply_event(&event(&d, 1, RET, stored(4)))?;
    /// index.apply_event(&event(&d, 2, RET, KvEventData::Removed { sequence_hashes: vec![hashes[3]] }))?;
    /// let stats = index.stats();
    /// assert_eq!((stats.workers, stats.events_applied), (1, 2));
    /// assert_eq!(stats.held_blocks_in(RET), 3);
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn stats(&self) -> IndexStats {
        self.state.read().stats()
    }
}

/// [`State::apply_event`] through `batch`, logging what needs a resync
/// (here, not in `State`: the replay on the other copy must not log again).
fn apply_logged(
    batch: &mut crate::twin::Batch<'_, State>,
    checked: CheckedEvent,
) -> Result<EventOutcome, LookupError> {
    let (engine, event_id) = (checked.publisher, checked.event_id);
    let out = match batch.apply(Mutation::Event(checked)) {
        Effect::Event(r) => r,
        _ => unreachable!("an event reports an event outcome"),
    };
    log_needs_resync(engine, event_id, &out);
    out
}

/// Warns of an event outcome that leaves the worker waiting for a resync.
fn log_needs_resync(engine: EngineId, event_id: u64, out: &Result<EventOutcome, LookupError>) {
    match out {
        Ok(EventOutcome::Unchained { cause }) => {
            tracing::warn!(%engine, event_id, ?cause, "kv event does not chain: not stored, worker needs resync");
        }
        Ok(EventOutcome::Gap { expected, got, .. }) => {
            tracing::warn!(%engine, expected, got, "kv event gap: worker needs resync");
        }
        _ => {}
    }
}

/// Group index and bit of a worker slot.
#[inline]
pub(crate) fn split(slot: u32) -> (usize, u32) {
    (slot as usize / GROUP_WIDTH, slot % GROUP_WIDTH as u32)
}
