//! What [`crate::InventoryIndex`] reports: the outcome of one event, the
//! totals of a batch, a registration's result and the index's counters.
//! Plain data; nothing here changes the index.

use kv_descriptor::EngineId;

use crate::chain::UnchainedStore;
use crate::holder_table::TIERS;
use crate::LookupError;

/// What applying one event did.
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

/// Counters and sizes of an index, for metrics and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Live worker incarnations.
    pub workers: usize,
    /// Workers excluded as donors until resynced.
    pub workers_needing_resync: usize,
    /// Distinct (sequence hash, worker group) entries.
    pub entries: usize,
    /// Held (worker, block) pairs per tier, in the order Device, HostPinned,
    /// Disk, External, RetainedGpuDirect.
    pub held_blocks: [u64; TIERS],
    /// Bytes of the holder tables.
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
