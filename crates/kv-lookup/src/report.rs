//! What [`crate::InventoryIndex`] reports: the outcome of one event, the
//! totals of a batch, a registration's result and the index's counters.
//! Plain data; nothing here changes the index.

use kv_descriptor::{EngineId, StorageTier};

use crate::chain::UnchainedStore;
use crate::holder_table::{tier_index, TIERS};
use crate::LookupError;

/// What applying one event did.
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
/// use kv_lookup::EventOutcome;
/// const RET: StorageTier = StorageTier::RetainedGpuDirect;
/// let d = worker(Role::Decode);
/// assert_eq!(index.apply_event(&event(&d, 1, RET, stored(4)))?, EventOutcome::Applied { changed: 4 });
/// // A replayed id changes nothing.
/// assert_eq!(index.apply_event(&event(&d, 1, RET, stored(4)))?, EventOutcome::Duplicate { last_event_id: 1 });
/// // Event 2 was lost: event 3 still applies, but `d` is no donor until resynced.
/// let gone = KvEventData::Removed { sequence_hashes: vec![hashes[3]] };
/// assert_eq!(index.apply_event(&event(&d, 3, RET, gone))?, EventOutcome::Gap { expected: 2, got: 3, changed: 1 });
/// assert_eq!(index.workers_needing_resync(), vec![d.engine]);
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// Applied in order; `changed` block entries were added or dropped.
    Applied {
        /// Holder bits that actually flipped (re-storing a held block or
        /// removing an absent one changes nothing).
        changed: u64,
    },
    /// `event_id` at or below the last applied id of this publisher: ignored.
    Duplicate {
        /// Last applied event id of the publisher.
        last_event_id: u64,
    },
    /// Applied, but `event_id` skipped ids: events `expected..got` were lost.
    /// The worker is excluded as a donor until
    /// [`crate::InventoryIndex::resync_worker`] replaces its inventory.
    Gap {
        /// The id that should have come next.
        expected: u64,
        /// The id that came.
        got: u64,
        /// Holder bits that flipped.
        changed: u64,
    },
    /// The publisher is an incarnation that was replaced or removed: ignored.
    FromRetiredIncarnation,
    /// A Stored event, in order, whose blocks do not chain from what the
    /// index knows of the publisher (see [`UnchainedStore`]): nothing of it
    /// was stored, its id was consumed, and the worker is excluded as a donor
    /// until [`crate::InventoryIndex::resync_worker`] replaces its inventory. (After
    /// a skipped id the event is reported as [`EventOutcome::Gap`] with
    /// `changed: 0` instead: the lost events explain a missing parent.)
    Unchained {
        /// What did not chain.
        cause: UnchainedStore,
    },
}

/// What [`crate::InventoryIndex::apply_events`] did: per-event outcomes
/// ([`EventBatchReport::outcomes`]) and their totals.
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
/// use kv_lookup::{EventBatchReport, LookupError};
/// const DEV: StorageTier = StorageTier::Device;
/// let d = worker(Role::Decode);
/// let report: EventBatchReport = index.apply_events(&[
///     event(&d, 1, DEV, stored(4)),                // applied: 4 bits set
///     event(&d, 1, DEV, stored(4)),                // duplicate
///     event(&d, 0, DEV, KvEventData::Cleared),     // refused: ids start at 1
///     event(&d, 3, DEV, KvEventData::Cleared),     // applied after a gap: 4 bits cleared
/// ]);
/// assert_eq!((report.applied, report.changed, report.duplicates), (2, 8, 1));
/// assert_eq!(report.gaps, vec![(d.engine, 2, 3)]);
/// assert_eq!(report.refused, vec![(2, LookupError::ZeroEventId { engine: d.engine })]);
/// assert_eq!(report.outcomes.len(), 4);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventBatchReport {
    /// Events applied (in order or after a gap).
    pub applied: u64,
    /// Holder bits that flipped over the whole batch.
    pub changed: u64,
    /// Duplicates ignored.
    pub duplicates: u64,
    /// Events of retired incarnations ignored.
    pub from_retired: u64,
    /// Gaps seen: `(publisher, expected id, received id)`; each one is a resync need.
    pub gaps: Vec<(EngineId, u64, u64)>,
    /// Stored events not stored because they did not chain
    /// ([`EventOutcome::Unchained`]): `(publisher, event id, cause)`; each
    /// one is a resync need.
    pub unchained: Vec<(EngineId, u64, UnchainedStore)>,
    /// Refused events: index in the batch and why. Nothing of them was applied.
    pub refused: Vec<(usize, LookupError)>,
    /// Every event's own result, in batch order (one per event): what
    /// [`crate::InventoryIndex::apply_event`] would have returned for it.
    /// The fields above are totals of these.
    pub outcomes: Vec<Result<EventOutcome, LookupError>>,
}

/// Result of [`crate::InventoryIndex::register_worker`].
///
/// ```
/// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
/// use kv_lookup::{InventoryIndex, Registration, WorkerInfo, WorkerKey};
/// let index = InventoryIndex::new();
/// let first = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
/// assert_eq!(index.register_worker(WorkerKey(1), first)?, Registration::Registered);
/// assert_eq!(index.register_worker(WorkerKey(1), first)?, Registration::AlreadyRegistered);
/// // The worker restarted: same key, new engine id.
/// let restarted = WorkerInfo { engine: EngineId::fresh(), ..first };
/// assert_eq!(index.register_worker(WorkerKey(1), restarted)?, Registration::Replaced { old: first.engine });
/// # Ok::<(), kv_lookup::LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// A new worker.
    Registered,
    /// The incarnation was already known with the same identity (idempotent).
    AlreadyRegistered,
    /// The key belonged to an older incarnation, which was retired and whose
    /// entries were all dropped.
    Replaced {
        /// The retired incarnation.
        old: EngineId,
    },
}

/// Counters and sizes of an index, for metrics and benchmarks
/// ([`crate::InventoryIndex::stats`]).
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
/// use kv_lookup::IndexStats;
/// let (d1, d2) = (worker(Role::Decode), worker(Role::Decode));
/// index.apply_event(&event(&d1, 1, StorageTier::RetainedGpuDirect, stored(4)))?;
/// index.apply_event(&event(&d2, 1, StorageTier::RetainedGpuDirect, stored(2)))?;
/// index.apply_event(&event(&d2, 1, StorageTier::RetainedGpuDirect, stored(2)))?; // duplicate
/// let stats: IndexStats = index.stats();
/// assert_eq!(stats.workers, 2);
/// // Both workers share one group: 4 distinct hashes, 6 held (worker, block) pairs.
/// assert_eq!(stats.entries, 4);
/// assert_eq!(stats.held_blocks_in(StorageTier::RetainedGpuDirect), 6);
/// assert_eq!((stats.events_applied, stats.duplicates, stats.gaps), (2, 1, 0));
/// assert!(stats.table_bytes > 0);
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Live worker incarnations.
    pub workers: usize,
    /// Workers excluded as donors until resynced.
    pub workers_needing_resync: usize,
    /// Retired incarnations (replaced or removed) the index remembers, so
    /// that their late events are ignored and their registration refused,
    /// until [`crate::InventoryIndex::forget_retired`] forgets them
    /// (without it, one more per worker restart or removal for the
    /// index's whole life).
    pub retired_incarnations: usize,
    /// Distinct (sequence hash, worker group) entries.
    pub entries: usize,
    /// Held (worker, block) pairs per tier, in the order Device, HostPinned,
    /// Disk, External, RetainedGpuDirect ([`IndexStats::held_blocks_in`]
    /// reads one tier by name).
    pub held_blocks: [u64; TIERS],
    /// Bytes of one copy's holder tables (runs and entry-point indexes)
    /// plus the writer's full hash maps (one for both copies).
    pub table_bytes: usize,
    /// Events applied since creation.
    pub events_applied: u64,
    /// Duplicate events ignored since creation.
    pub duplicates: u64,
    /// Gaps detected since creation.
    pub gaps: u64,
    /// Events of retired incarnations ignored since creation.
    pub from_retired: u64,
    /// Stored events not stored because they did not chain, since creation
    /// (also those reported as a gap).
    pub unchained: u64,
}

impl IndexStats {
    /// Held (worker, block) pairs in `tier`: the entry of
    /// [`IndexStats::held_blocks`] for that tier, a count of blocks summed
    /// over workers (a block two workers hold counts twice).
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
    /// index.apply_event(&event(&d, 2, StorageTier::HostPinned, stored(1)))?;
    /// let stats = index.stats();
    /// assert_eq!(stats.held_blocks_in(StorageTier::Device), 4);
    /// assert_eq!(stats.held_blocks_in(StorageTier::HostPinned), 1);
    /// assert_eq!(stats.held_blocks_in(StorageTier::RetainedGpuDirect), 0);
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn held_blocks_in(&self, tier: StorageTier) -> u64 {
        self.held_blocks[tier_index(tier)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holder_table::ALL_TIERS;

    #[test]
    fn held_blocks_in_reads_the_documented_position_of_each_tier() {
        let stats = IndexStats {
            held_blocks: [10, 11, 12, 13, 14],
            ..IndexStats::default()
        };
        let named = [
            StorageTier::Device,
            StorageTier::HostPinned,
            StorageTier::Disk,
            StorageTier::External,
            StorageTier::RetainedGpuDirect,
        ];
        assert_eq!(named, ALL_TIERS);
        for (i, tier) in named.into_iter().enumerate() {
            assert_eq!(stats.held_blocks_in(tier), 10 + i as u64, "{tier:?}");
        }
    }
}
