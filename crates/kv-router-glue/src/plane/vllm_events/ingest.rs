//! Mapping vLLM events onto our [`KvEvent`]s and into the inventory index.
//!
//! vLLM names blocks with its own hashes (SHA-256 based, optionally salted by
//! LoRA and multimodal keys), which are not the Dynamo-compatible sequence
//! hashes the router computes for requests. So every stored block is renamed
//! here: its sequence hash is recomputed from its token ids
//! ([`kv_descriptor::token_block_hash`], chained onto the parent's sequence
//! hash), and a vLLM-hash → sequence-hash map lets later removals and children
//! name the same block.
//!
//! Extra keys: a block stored under a LoRA adapter, a cache salt or with
//! multimodal inputs is named in its [`HashNamespace`] (LoRA name, salt) with
//! its multimodal hashes ([`mm_hash_of_identifier`]), exactly as the router
//! hashes a request with the same keys ([`kv_descriptor::sequence_hashes_keyed`]).
//! vLLM publishes the salt on a request's first block only; its children
//! inherit it through `parent_block_hash`. Keys that cannot be mapped (prompt
//! embeddings, a `lora_id` without `lora_name`, unknown shapes) skip the
//! event: a token-only name would tell the router a different prefix is cached.
//!
//! Groups: hybrid models (vLLM 0.33 `group_idx`) store and free the same
//! block per KV cache group. A block stays indexed in a tier while any group
//! holds it there (a sliding-window group freeing a block does not drop what
//! the full-attention group still holds).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kv_descriptor::{
    chain_sequence_hash, token_block_hash_keyed, EngineId, HashNamespace, KvEvent, KvEventData,
    LayoutFingerprint, Role, SequenceHash, StorageTier, StoredBlock,
};
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};

use super::{VllmEvent, VllmEventBatch, VllmEventError, VllmExtraKey};

/// Names of blocks that left every tier kept for parent lookups (bounded,
/// oldest dropped first): about 80 MiB at the limit.
pub const MAX_RETIRED_NAMES: usize = 1 << 20;

/// The vLLM engine whose events one [`VllmIngest`] maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmWorker {
    /// Stable worker identity across restarts.
    pub key: WorkerKey,
    /// This incarnation (a restarted engine gets a new one).
    pub engine: EngineId,
    /// Serving role.
    pub role: Role,
    /// Fingerprint of the engine's KV layout.
    pub layout_fingerprint: LayoutFingerprint,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Tokens per block of the engine; a stored event with another
    /// `block_size` is skipped, as its hashes would not match requests'.
    pub tokens_per_block: u32,
}

/// Maps a vLLM `medium` string to a storage tier; `None` for an unknown medium.
///
/// Absent or empty means the GPU prefix cache (vLLM omits it there). The table
/// is Dynamo's (`dynamo-kv-router` 1.6.1 `StorageTier::from_kv_medium`) plus
/// `RETAINED_GPU_DIRECT` for engines that publish a retained bank this way.
///
/// ```
/// use kv_descriptor::StorageTier;
/// use kv_router_glue::vllm_events::tier_of_medium;
/// assert_eq!(tier_of_medium(None), Some(StorageTier::Device));
/// assert_eq!(tier_of_medium(Some("CPU")), Some(StorageTier::HostPinned));
/// assert_eq!(tier_of_medium(Some("TAPE")), None);
/// ```
pub fn tier_of_medium(medium: Option<&str>) -> Option<StorageTier> {
    match medium.unwrap_or("") {
        "" | "GPU" | "DEVICE" => Some(StorageTier::Device),
        "CPU" | "CPU_PINNED" | "CPU_TIER1" => Some(StorageTier::HostPinned),
        "CPU_TIER2" | "DISK" | "NVME" | "STORAGE" => Some(StorageTier::Disk),
        "EXTERNAL" | "NETWORK" | "REMOTE" | "SHARED" => Some(StorageTier::External),
        "RETAINED_GPU_DIRECT" => Some(StorageTier::RetainedGpuDirect),
        _ => None,
    }
}

/// Groups a block can be tracked in per tier (`group_idx` below this).
pub const MAX_KV_GROUPS: u32 = 32;

/// The `u64` multimodal hash under which a vLLM `mm_identifier` enters block
/// hashes (Dynamo's `BlockMmObjectInfo::mm_hash`): XXH3-64, seed 0, of the
/// identifier's UTF-8 bytes. A router hashing a request must derive its
/// multimodal hashes the same way from the same identifiers.
pub fn mm_hash_of_identifier(identifier: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(identifier.as_bytes(), 0)
}

/// Why a vLLM event was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SkipReason {
    /// `medium` is not in [`tier_of_medium`]'s table.
    UnknownMedium,
    /// `block_size` differs from the worker's tokens per block.
    BlockSizeMismatch,
    /// `token_ids` is not `block_hashes.len() * block_size` long.
    TokenCountMismatch,
    /// `parent_block_hash` names a block this stream never stored (or whose
    /// name was dropped): the chained sequence hash cannot be computed.
    UnknownParent,
    /// A `lora_id` without a `lora_name`: the adapter's namespace is unknown.
    Lora,
    /// Extra hash keys that cannot be mapped (prompt-embedding digests,
    /// unknown shapes, a salt on a non-root block).
    ExtraKeys,
    /// `group_idx` is not below [`MAX_KV_GROUPS`].
    GroupIndex,
    /// `parent_block_hash` names a block this stream knows but the engine no
    /// longer holds in that tier (evicted, dropped by a reset, or only in
    /// another tier): the index stores only blocks that chain from what the
    /// worker holds, so these stay out until their parent is stored again.
    ParentNotHeld,
}

impl SkipReason {
    /// Every reason, in declaration order.
    pub const ALL: [SkipReason; 8] = [
        Self::UnknownMedium,
        Self::BlockSizeMismatch,
        Self::TokenCountMismatch,
        Self::UnknownParent,
        Self::Lora,
        Self::ExtraKeys,
        Self::GroupIndex,
        Self::ParentNotHeld,
    ];

    /// Stable snake_case name (metric label, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownMedium => "unknown_medium",
            Self::BlockSizeMismatch => "block_size_mismatch",
            Self::TokenCountMismatch => "token_count_mismatch",
            Self::UnknownParent => "unknown_parent",
            Self::Lora => "lora",
            Self::ExtraKeys => "extra_keys",
            Self::GroupIndex => "group_index",
            Self::ParentNotHeld => "parent_not_held",
        }
    }
}

/// What one [`VllmIngest::apply_batch`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Our events applied to the index (one per vLLM event and tier).
    pub applied: usize,
    /// Holder bits that flipped in the index.
    pub changed: u64,
    /// vLLM events not applied: index in the batch and reason.
    pub skipped: Vec<(usize, SkipReason)>,
    /// Removed block names this stream never stored (nothing to do).
    pub unknown_removals: u64,
    /// Events the index refused (logged; should stay 0).
    pub refused: usize,
}

/// Totals over a [`VllmIngest`]'s life.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// Batches applied.
    pub batches: u64,
    /// vLLM events seen in those batches.
    pub events: u64,
    /// Blocks stored into the index.
    pub stored_blocks: u64,
    /// Blocks removed from the index.
    pub removed_blocks: u64,
    /// `AllBlocksCleared` events applied.
    pub clears: u64,
    /// Removed block names never stored by this stream.
    pub unknown_removals: u64,
    /// Skipped events per [`SkipReason::ALL`] position.
    pub skipped: [u64; SkipReason::ALL.len()],
    /// Events the index refused.
    pub refused_by_index: u64,
    /// Inventory resets after unrecoverable loss ([`VllmIngest::reset`]).
    pub resets: u64,
    /// Inventories replaced after an engine restart ([`VllmIngest::replace_inventory`]).
    pub replacements: u64,
    /// Times the worker was marked as needing resync ([`VllmIngest::mark_needs_resync`]).
    pub marked_for_resync: u64,
}

impl IngestStats {
    /// Skipped events for one reason.
    pub fn skipped(&self, reason: SkipReason) -> u64 {
        self.skipped[reason as usize]
    }
}

/// A vLLM block name: its sequence hash, the KV cache groups holding it in
/// each tier (bit per group, indexed by tier) and the cache salt its
/// children inherit.
#[derive(Debug, Clone)]
struct Named {
    sequence_hash: SequenceHash,
    groups: [u32; TIERS],
    salt: Option<Arc<str>>,
}

impl Named {
    fn held(&self) -> bool {
        self.groups.iter().any(|&g| g != 0)
    }
}

const TIERS: usize = 5;

fn tier_bit(t: StorageTier) -> u8 {
    1 << (t as u8)
}

/// Feeds one vLLM engine's events into an [`InventoryIndex`].
///
/// Owns the vLLM-hash → [`SequenceHash`] map and the engine's event ids
/// (from 1, +1 per applied event), so there is one per engine incarnation;
/// a reconnecting subscriber keeps using the same one
/// ([`super::VllmSubscriber::stop`] hands it back).
///
/// ```
/// use std::sync::Arc;
/// use kv_descriptor::*;
/// use kv_lookup::{InventoryIndex, WorkerKey};
/// use kv_router_glue::vllm_events::*;
///
/// let index = Arc::new(InventoryIndex::new());
/// let worker = VllmWorker { key: WorkerKey(1), engine: EngineId::fresh(), role: Role::Prefill,
///     layout_fingerprint: LayoutFingerprint(7), tp_size: 1, tokens_per_block: 4 };
/// let mut ingest = VllmIngest::new(index.clone(), worker).unwrap();
/// let tokens: Vec<u32> = (0..8).collect();
/// let out = ingest.apply_batch(&VllmEventBatch { ts: 0.0, data_parallel_rank: None, events: vec![
///     VllmEvent::BlockStored { block_hashes: vec![111, 222], parent_block_hash: None,
///         token_ids: tokens.clone(), block_size: 4, lora_id: None, medium: Some("GPU".into()),
///         lora_name: None, extra_keys: vec![], group_idx: None },
/// ]});
/// assert_eq!(out.changed, 2);
/// let ours = sequence_hashes(&tokens, 4);
/// assert_eq!(ingest.sequence_hash(222), Some(ours[1]));
/// assert_eq!(index.holds(worker.engine, ours[1]), vec![StorageTier::Device]);
/// ```
pub struct VllmIngest {
    index: Arc<InventoryIndex>,
    worker: VllmWorker,
    next_event_id: u64,
    names: HashMap<u64, Named>,
    /// Names whose tiers became empty, oldest first (may hold stale entries
    /// for names stored again since; checked when popped).
    retired: VecDeque<u64>,
    tiers_seen: u8,
    needs_resync: bool,
    stats: IngestStats,
}

impl std::fmt::Debug for VllmIngest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmIngest")
            .field("worker", &self.worker)
            .field("next_event_id", &self.next_event_id)
            .field("names", &self.names.len())
            .finish()
    }
}

impl VllmIngest {
    /// Registers `worker` with `index` and returns its ingest.
    ///
    /// # Errors
    /// [`VllmEventError::Config`] for `tokens_per_block` or `tp_size` 0;
    /// [`VllmEventError::Index`] when the index refuses the registration.
    pub fn new(index: Arc<InventoryIndex>, worker: VllmWorker) -> Result<Self, VllmEventError> {
        if worker.tokens_per_block == 0 {
            return Err(VllmEventError::Config {
                field: "tokens_per_block",
                reason: "must be at least 1".into(),
            });
        }
        if worker.tp_size == 0 {
            return Err(VllmEventError::Config {
                field: "tp_size",
                reason: "must be at least 1".into(),
            });
        }
        index.register_worker(
            worker.key,
            WorkerInfo {
                engine: worker.engine,
                role: worker.role,
                layout_fingerprint: worker.layout_fingerprint,
                tp_size: worker.tp_size,
            },
        )?;
        Ok(Self {
            index,
            worker,
            next_event_id: 1,
            names: HashMap::new(),
            retired: VecDeque::new(),
            tiers_seen: 0,
            needs_resync: false,
            stats: IngestStats::default(),
        })
    }

    /// The engine this ingest maps.
    pub fn worker(&self) -> &VllmWorker {
        &self.worker
    }

    /// The index it feeds.
    pub fn index(&self) -> &Arc<InventoryIndex> {
        &self.index
    }

    /// Totals so far.
    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// Our sequence hash of a block vLLM named `vllm_hash`, if this stream
    /// stored it (and the name was not dropped).
    pub fn sequence_hash(&self, vllm_hash: u64) -> Option<SequenceHash> {
        self.names.get(&vllm_hash).map(|n| n.sequence_hash)
    }

    /// Maps `batch` and applies the resulting events to the index, in order,
    /// under one index lock.
    pub fn apply_batch(&mut self, batch: &VllmEventBatch) -> BatchOutcome {
        let mut out = BatchOutcome::default();
        let mut events = Vec::new();
        for (i, e) in batch.events.iter().enumerate() {
            if let Err(reason) = self.map_event(e, &mut events, &mut out) {
                tracing::debug!(
                    engine = %self.worker.engine,
                    event = i,
                    reason = reason.as_str(),
                    "vLLM event skipped"
                );
                self.stats.skipped[reason as usize] += 1;
                out.skipped.push((i, reason));
            }
        }
        let report = self.index.apply_events(&events);
        let cleared = batch
            .events
            .iter()
            .any(|e| matches!(e, VllmEvent::AllBlocksCleared));
        if cleared && self.needs_resync {
            // A clear made the inventory exact again: everything stored
            // since is what the index now holds.
            self.resync_index();
        }
        for (i, e) in &report.refused {
            tracing::warn!(engine = %self.worker.engine, event = i, error = %e, "index refused a mapped vLLM event");
        }
        out.applied = report.applied as usize;
        out.changed = report.changed;
        out.refused = report.refused.len();
        self.stats.batches += 1;
        self.stats.events += batch.events.len() as u64;
        self.stats.unknown_removals += out.unknown_removals;
        self.stats.refused_by_index += out.refused as u64;
        out
    }

    /// Drops everything this engine holds in the index (and the tiers of
    /// every name) after events were lost for good: a lost removal would
    /// otherwise leave the index claiming blocks the engine no longer has.
    /// Names stay known, so later children still chain correctly.
    ///
    /// # Errors
    /// [`VllmEventError::Index`] when the engine is no longer registered
    /// (it was replaced by a newer incarnation).
    pub fn reset(&mut self) -> Result<(), VllmEventError> {
        self.index
            .resync_worker(self.worker.engine, self.next_event_id - 1, &[])?;
        self.retire_all();
        self.tiers_seen = 0;
        self.needs_resync = false;
        self.stats.resets += 1;
        Ok(())
    }

    /// The engine restarted on the same endpoint: its old cache is gone and
    /// its block names start afresh. Empties the engine's inventory in the
    /// index, forgets every name, and clears a pending resync mark.
    ///
    /// # Errors
    /// [`VllmEventError::Index`] when the engine is no longer registered.
    pub fn replace_inventory(&mut self) -> Result<(), VllmEventError> {
        self.index
            .resync_worker(self.worker.engine, self.next_event_id - 1, &[])?;
        self.names.clear();
        self.retired.clear();
        self.tiers_seen = 0;
        self.needs_resync = false;
        self.stats.replacements += 1;
        Ok(())
    }

    /// Marks the worker as needing resync without dropping its inventory:
    /// used when one batch could not be decoded and no replay can supply it.
    /// Its blocks stay indexed (vLLM never announces cached blocks again, so
    /// dropping them would hide them for good), but the index stops offering
    /// the worker as a donor (an event-id gap: [`kv_lookup::InventoryIndex::workers_needing_resync`])
    /// until the inventory is known exactly again, at the next
    /// `AllBlocksCleared` or [`VllmIngest::replace_inventory`].
    pub fn mark_needs_resync(&mut self) {
        if self.needs_resync {
            return;
        }
        self.needs_resync = true;
        self.stats.marked_for_resync += 1;
        // Skip one event id: the index reads the jump as a gap.
        self.next_event_id += 1;
        let ev = self.event(
            StorageTier::Device,
            KvEventData::Removed {
                sequence_hashes: Vec::new(),
            },
        );
        let report = self.index.apply_events(&[ev]);
        self.stats.refused_by_index += report.refused.len() as u64;
    }

    /// True while the worker is marked by [`VllmIngest::mark_needs_resync`].
    pub fn needs_resync(&self) -> bool {
        self.needs_resync
    }

    /// The inventory is known exactly again (after a clear): hand it to the
    /// index as the worker's snapshot, which ends the resync mark there.
    fn resync_index(&mut self) {
        let mut inventory: Vec<(StorageTier, Vec<SequenceHash>)> = Vec::new();
        for t in kv_lookup_tiers() {
            let hashes: Vec<SequenceHash> = self
                .names
                .values()
                .filter(|n| n.groups[t as usize] != 0)
                .map(|n| n.sequence_hash)
                .collect();
            if !hashes.is_empty() {
                inventory.push((t, hashes));
            }
        }
        match self
            .index
            .resync_worker(self.worker.engine, self.next_event_id - 1, &inventory)
        {
            Ok(()) => self.needs_resync = false,
            Err(e) => {
                tracing::warn!(engine = %self.worker.engine, error = %e, "vLLM resync refused")
            }
        }
    }

    fn event(&mut self, tier: StorageTier, data: KvEventData) -> KvEvent {
        let event_id = self.next_event_id;
        self.next_event_id += 1;
        KvEvent {
            publisher: self.worker.engine,
            event_id,
            role: self.worker.role,
            layout_fingerprint: self.worker.layout_fingerprint,
            tp_size: self.worker.tp_size,
            tier,
            data,
        }
    }

    /// The namespace, salt and multimodal hashes of each block of a stored
    /// event (see the module documentation).
    #[allow(clippy::type_complexity)]
    fn block_keys(
        &self,
        lora_name: Option<&str>,
        parent_salt: Option<Arc<str>>,
        has_parent: bool,
        blocks: usize,
        extra_keys: &[Option<Vec<VllmExtraKey>>],
    ) -> Result<(Option<Arc<str>>, Vec<Vec<u64>>), SkipReason> {
        let mut salt = parent_salt;
        let mut mm = vec![Vec::new(); blocks];
        for (i, keys) in extra_keys.iter().enumerate() {
            let Some(keys) = keys else { continue };
            let mut keys = keys.as_slice();
            // vLLM puts the LoRA name first when `lora_name` is set.
            if let (Some(l), Some(VllmExtraKey::Text(first))) = (lora_name, keys.first()) {
                if first == l {
                    keys = &keys[1..];
                }
            }
            for k in keys {
                match k {
                    VllmExtraKey::Multimodal { identifier, .. } => {
                        mm[i].push(mm_hash_of_identifier(identifier));
                    }
                    // A salt starts a request's chain: only a root block has one.
                    VllmExtraKey::Text(t) if i == 0 && !has_parent && salt.is_none() => {
                        salt = Some(Arc::from(t.as_str()));
                    }
                    _ => return Err(SkipReason::ExtraKeys),
                }
            }
        }
        Ok((salt, mm))
    }

    fn map_event(
        &mut self,
        e: &VllmEvent,
        events: &mut Vec<KvEvent>,
        out: &mut BatchOutcome,
    ) -> Result<(), SkipReason> {
        match e {
            VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
            } => {
                let tier = tier_of_medium(medium.as_deref()).ok_or(SkipReason::UnknownMedium)?;
                if *block_size != self.worker.tokens_per_block {
                    return Err(SkipReason::BlockSizeMismatch);
                }
                if token_ids.len() != block_hashes.len() * *block_size as usize {
                    return Err(SkipReason::TokenCountMismatch);
                }
                let lora_name = lora_name.as_deref().filter(|l| !l.is_empty());
                if lora_id.is_some() && lora_name.is_none() {
                    return Err(SkipReason::Lora);
                }
                let group = group_idx.unwrap_or(0);
                if group >= MAX_KV_GROUPS {
                    return Err(SkipReason::GroupIndex);
                }
                let (parent, parent_salt) = match parent_block_hash {
                    None => (None, None),
                    Some(p) => {
                        let n = self.names.get(p).ok_or(SkipReason::UnknownParent)?;
                        // An orphan store would be refused by the index and
                        // mark the worker for resync.
                        if n.groups[tier as usize] == 0 {
                            return Err(SkipReason::ParentNotHeld);
                        }
                        (Some(n.sequence_hash), n.salt.clone())
                    }
                };
                let (salt, mm) = self.block_keys(
                    lora_name,
                    parent_salt,
                    parent.is_some(),
                    block_hashes.len(),
                    extra_keys,
                )?;
                if block_hashes.is_empty() {
                    return Ok(());
                }
                let namespace = HashNamespace {
                    lora_name: lora_name.map(str::to_owned),
                    cache_salt: salt.as_deref().map(str::to_owned),
                };
                let mut chain = parent;
                let mut blocks = Vec::with_capacity(block_hashes.len());
                for ((name, tokens), mm) in block_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(*block_size as usize))
                    .zip(&mm)
                {
                    let token_hash = token_block_hash_keyed(tokens, &namespace, mm);
                    let sequence_hash = chain_sequence_hash(chain, token_hash);
                    chain = Some(sequence_hash);
                    let entry = self.names.entry(*name).or_insert_with(|| Named {
                        sequence_hash,
                        groups: [0; TIERS],
                        salt: None,
                    });
                    entry.sequence_hash = sequence_hash;
                    entry.salt = salt.clone();
                    entry.groups[tier as usize] |= 1 << group;
                    // Storing an already indexed block again is a no-op in
                    // the index; another group's store lands here.
                    blocks.push(StoredBlock {
                        sequence_hash,
                        token_hash,
                        slot: None,
                    });
                }
                self.tiers_seen |= tier_bit(tier);
                self.stats.stored_blocks += blocks.len() as u64;
                let ev = self.event(tier, KvEventData::Stored { parent, blocks });
                events.push(ev);
                Ok(())
            }
            VllmEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                let tier = tier_of_medium(medium.as_deref()).ok_or(SkipReason::UnknownMedium)?;
                let group = group_idx.unwrap_or(0);
                if group >= MAX_KV_GROUPS {
                    return Err(SkipReason::GroupIndex);
                }
                let mut removed = Vec::new();
                let mut retired = Vec::new();
                for name in block_hashes {
                    match self.names.get_mut(name) {
                        Some(n) if n.groups[tier as usize] & (1 << group) != 0 => {
                            n.groups[tier as usize] &= !(1 << group);
                            // Another group still holding it keeps it indexed.
                            if n.groups[tier as usize] == 0 {
                                removed.push(n.sequence_hash);
                            }
                            if !n.held() {
                                retired.push(*name);
                            }
                        }
                        _ => out.unknown_removals += 1,
                    }
                }
                for name in retired {
                    self.retire(name);
                }
                if !removed.is_empty() {
                    self.stats.removed_blocks += removed.len() as u64;
                    let ev = self.event(
                        tier,
                        KvEventData::Removed {
                            sequence_hashes: removed,
                        },
                    );
                    events.push(ev);
                }
                Ok(())
            }
            VllmEvent::AllBlocksCleared => {
                // Dynamo's reading: the engine's whole inventory is gone, in
                // every tier this stream stored into.
                for t in kv_lookup_tiers() {
                    if self.tiers_seen & tier_bit(t) != 0 {
                        let ev = self.event(t, KvEventData::Cleared);
                        events.push(ev);
                    }
                }
                self.tiers_seen = 0;
                self.retire_all();
                self.stats.clears += 1;
                Ok(())
            }
        }
    }

    fn retire(&mut self, name: u64) {
        self.retired.push_back(name);
        while self.retired.len() > MAX_RETIRED_NAMES {
            let old = self.retired.pop_front().expect("non-empty");
            if self.names.get(&old).is_some_and(|n| !n.held()) {
                self.names.remove(&old);
            }
        }
    }

    fn retire_all(&mut self) {
        let live: Vec<u64> = self
            .names
            .iter_mut()
            .filter(|(_, n)| n.held())
            .map(|(k, n)| {
                n.groups = [0; TIERS];
                *k
            })
            .collect();
        for name in live {
            self.retire(name);
        }
    }
}

/// Every storage tier, in wire order.
fn kv_lookup_tiers() -> [StorageTier; TIERS] {
    [
        StorageTier::Device,
        StorageTier::HostPinned,
        StorageTier::Disk,
        StorageTier::External,
        StorageTier::RetainedGpuDirect,
    ]
}
