//! Workers known to the index: identity, event-stream position, and the
//! per-tier log of what each one stored (so that a clear or a restart can
//! drop exactly its entries without scanning the table).

use kv_descriptor::{EngineId, LayoutFingerprint, Role, SequenceHash};

use crate::holder_table::TIERS;

/// Stable identity of a serving worker across restarts (Dynamo's
/// `worker_id`, an instance id, or any id the deployment assigns).
///
/// An [`EngineId`] names one incarnation; a `WorkerKey` names the worker.
/// Registering a new incarnation under a known key retires the old one and
/// drops all its entries.
///
/// ```
/// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
/// use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
/// let index = InventoryIndex::new();
/// let old = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
/// let new = WorkerInfo { engine: EngineId::fresh(), ..old };
/// index.register_worker(WorkerKey(7), old)?;
/// index.register_worker(WorkerKey(7), new)?; // a restart: same key, new incarnation
/// assert_eq!(index.worker(new.engine), Some((WorkerKey(7), new)));
/// assert_eq!(index.worker(old.engine), None);
/// # Ok::<(), kv_lookup::LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey(pub u64);

impl WorkerKey {
    /// Key used for an engine first seen through an event, without a
    /// [`crate::InventoryIndex::register_worker`] call: the engine id folded to
    /// 64 bits. Such a worker is its own incarnation; its restart cannot be
    /// linked to it, so the old incarnation stays until removed.
    ///
    /// ```
    /// use kv_descriptor::*;
    /// use kv_lookup::{InventoryIndex, WorkerKey};
    /// let index = InventoryIndex::new();
    /// let engine = EngineId(uuid::Uuid::from_u128(5 << 64 | 3));
    /// assert_eq!(WorkerKey::of_engine(engine), WorkerKey(5 ^ 3));
    /// // An event of an unregistered engine registers it under this key.
    /// index.apply_event(&KvEvent {
    ///     publisher: engine, event_id: 1, role: Role::Decode, layout_fingerprint: LayoutFingerprint(7),
    ///     tp_size: 1, tier: StorageTier::Device, data: KvEventData::Cleared,
    /// })?;
    /// assert_eq!(index.worker(engine).unwrap().0, WorkerKey::of_engine(engine));
    /// # Ok::<(), kv_lookup::LookupError>(())
    /// ```
    pub fn of_engine(engine: EngineId) -> Self {
        let v = engine.0.as_u128();
        Self((v as u64) ^ ((v >> 64) as u64))
    }
}

/// What the index must know about a worker incarnation to judge donors.
///
/// ```
/// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
/// use kv_lookup::WorkerInfo;
/// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 2 };
/// assert!(w.compatible_with(&WorkerInfo { role: Role::Prefill, engine: EngineId::fresh(), ..w }));
/// assert!(!w.compatible_with(&WorkerInfo { tp_size: 1, ..w }));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerInfo {
    /// Engine incarnation.
    pub engine: EngineId,
    /// Serving role.
    pub role: Role,
    /// Fingerprint of the KV layout ([`kv_descriptor::KvLayout::fingerprint`]).
    pub layout_fingerprint: LayoutFingerprint,
    /// Tensor-parallel size (ranks).
    pub tp_size: u32,
}

impl WorkerInfo {
    /// True when blocks can move between the two as they are: equal layout
    /// fingerprint and equal TP size (no resharding; the fingerprint already
    /// includes TP, the explicit check guards against a mis-set fingerprint).
    /// Role and engine do not matter.
    ///
    /// ```
    /// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
    /// use kv_lookup::WorkerInfo;
    /// let decode = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 2 };
    /// let prefill = WorkerInfo { engine: EngineId::fresh(), role: Role::Prefill, ..decode };
    /// assert!(decode.compatible_with(&prefill));
    /// // Another model or KV dtype: another fingerprint, no transfer.
    /// assert!(!decode.compatible_with(&WorkerInfo { layout_fingerprint: LayoutFingerprint(8), ..prefill }));
    /// ```
    pub fn compatible_with(&self, other: &WorkerInfo) -> bool {
        self.layout_fingerprint == other.layout_fingerprint && self.tp_size == other.tp_size
    }
}

/// Log compaction triggers when a tier's log exceeds twice its live count
/// plus this slack, so compaction costs O(1) amortized per event.
const LOG_SLACK: usize = 1024;

/// One live incarnation, owned by the index's state.
pub(crate) struct WorkerRecord {
    pub(crate) key: WorkerKey,
    pub(crate) info: WorkerInfo,
    /// Last applied event id (0: none yet).
    pub(crate) last_event_id: u64,
    /// Set when a gap was seen; cleared by a resync. A worker that needs a
    /// resync is never offered as a donor: the index may have missed a
    /// removal and would send a fetch to blocks that are gone.
    pub(crate) needs_resync: bool,
    /// Per tier: every hash stored since the last compaction (may contain
    /// hashes removed since, and duplicates); a superset of the live set.
    pub(crate) logs: [Vec<SequenceHash>; TIERS],
    /// Per tier: every hash a removal cleared since the last compaction,
    /// once per clearing. As multisets, `logs[t]` minus `removed[t]` is the
    /// live set (a hash is logged each time its bit is set and listed here
    /// each time a removal clears it), so a compaction needs no table probe.
    pub(crate) removed: [Vec<SequenceHash>; TIERS],
    /// Per tier: number of hashes this worker holds right now.
    pub(crate) live: [u64; TIERS],
}

impl WorkerRecord {
    pub(crate) fn new(key: WorkerKey, info: WorkerInfo) -> Self {
        Self {
            key,
            info,
            last_event_id: 0,
            needs_resync: false,
            logs: Default::default(),
            removed: Default::default(),
            live: [0; TIERS],
        }
    }

    /// True when the tier's log has grown enough stale entries to compact.
    pub(crate) fn log_needs_compaction(&self, tier: usize) -> bool {
        self.logs[tier].len() > 2 * self.live[tier] as usize + LOG_SLACK
    }
}
