//! A naive reference model of the index and a randomized cross-check.
//!
//! [`NaiveIndex`] implements the same rules as [`crate::InventoryIndex`]
//! with plain hash sets and a linear walk, no budget and no bitsets, so that
//! it is obviously right. The property tests compare both, and
//! [`cross_check`] does the same from a seed so that `cargo xtask qualify`
//! can run it and record the result.

use std::collections::{HashMap, HashSet};

use kv_descriptor::{
    chain_sequence_hash, EngineId, KvEvent, KvEventData, Role, SequenceHash, StorageTier,
    StoredBlock,
};

use crate::holder_table::{tier_index, ALL_TIERS, TIERS};
use crate::{EventOutcome, UnchainedStore, WorkerInfo, WorkerKey};

#[derive(Debug, Clone)]
struct NaiveWorker {
    info: WorkerInfo,
    last_event_id: u64,
    needs_resync: bool,
    tiers: [HashSet<SequenceHash>; TIERS],
}

/// Reference model: the rules of [`crate::InventoryIndex`], written plainly.
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
/// use kv_lookup::reference::NaiveIndex;
/// const RET: StorageTier = StorageTier::RetainedGpuDirect;
/// let mut naive = NaiveIndex::default();
/// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
/// for (key, w) in [(1, d), (2, p)] {
///     index.register_worker(WorkerKey(key), w)?;
///     naive.register(WorkerKey(key), w);
/// }
/// // Same event, same outcome; same lookup, same donor and coverage.
/// let e = event(&d, 1, RET, stored(3));
/// assert_eq!(naive.apply(&e), Some(index.apply_event(&e)?));
/// let fast = index.lookup(&hashes, p.engine, LookupBudget::default()).donor.unwrap();
/// let slow = naive.lookup(&hashes, p.engine).unwrap();
/// assert_eq!((slow.best_donors, slow.donor_blocks), (vec![fast.engine], fast.blocks));
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct NaiveIndex {
    workers: HashMap<EngineId, NaiveWorker>,
    keys: HashMap<WorkerKey, EngineId>,
    retired: HashSet<EngineId>,
}

/// What the reference lookup found (no budget, so never flagged).
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
/// use kv_lookup::reference::{NaiveIndex, NaiveLookup};
/// let mut naive = NaiveIndex::default();
/// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
/// naive.register(WorkerKey(1), d);
/// naive.register(WorkerKey(2), p);
/// naive.apply(&event(&d, 1, StorageTier::RetainedGpuDirect, stored(4)));
/// naive.apply(&event(&p, 1, StorageTier::Device, stored(1)));
/// assert_eq!(
///     naive.lookup(&hashes, p.engine),
///     Some(NaiveLookup { best_donors: vec![d.engine], donor_blocks: 4, native_blocks: 1, retained_blocks: 0 }),
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NaiveLookup {
    /// Every donor with the longest root coverage, and that coverage in
    /// blocks; empty when no compatible donor covers block 0.
    pub best_donors: Vec<EngineId>,
    /// Coverage of `best_donors`.
    pub donor_blocks: u32,
    /// Target's native (device tier) root coverage.
    pub native_blocks: u32,
    /// Target's retained-tier root coverage.
    pub retained_blocks: u32,
}

impl NaiveIndex {
    /// Registers `info` under `key`, retiring the key's previous incarnation.
    /// Returns false (and changes nothing) for a retired engine.
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
    /// use kv_lookup::reference::NaiveIndex;
    /// let mut naive = NaiveIndex::default();
    /// let w = worker(Role::Decode);
    /// assert!(naive.register(WorkerKey(1), w));
    /// let restarted = WorkerInfo { engine: EngineId::fresh(), ..w };
    /// assert!(naive.register(WorkerKey(1), restarted)); // retires `w`
    /// assert!(!naive.register(WorkerKey(2), w));
    /// ```
    pub fn register(&mut self, key: WorkerKey, info: WorkerInfo) -> bool {
        if self.retired.contains(&info.engine) {
            return false;
        }
        if let Some(old) = self.keys.get(&key).copied() {
            if old != info.engine {
                self.remove(old);
            }
        }
        self.keys.retain(|_, e| *e != info.engine);
        self.keys.insert(key, info.engine);
        self.workers
            .entry(info.engine)
            .or_insert_with(|| NaiveWorker {
                info,
                last_event_id: 0,
                needs_resync: false,
                tiers: Default::default(),
            });
        true
    }

    /// Retires an incarnation.
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
    /// use kv_lookup::reference::NaiveIndex;
    /// let mut naive = NaiveIndex::default();
    /// let d = worker(Role::Decode);
    /// naive.apply(&event(&d, 1, StorageTier::Device, stored(2)));
    /// naive.remove(d.engine);
    /// assert!(naive.holds(d.engine, hashes[0]).is_empty());
    /// let late = naive.apply(&event(&d, 2, StorageTier::Device, KvEventData::Cleared));
    /// assert_eq!(late, Some(EventOutcome::FromRetiredIncarnation));
    /// ```
    pub fn remove(&mut self, engine: EngineId) {
        if self.workers.remove(&engine).is_some() {
            self.retired.insert(engine);
            self.keys.retain(|_, e| *e != engine);
        }
    }

    /// Forgets that `engine` was retired (see
    /// [`crate::InventoryIndex::forget_retired`]); false when it was not
    /// remembered as retired.
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// use kv_lookup::reference::NaiveIndex;
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let mut naive = NaiveIndex::default();
    /// let d = worker(Role::Decode);
    /// naive.apply(&event(&d, 1, RET, stored(2)));
    /// naive.remove(d.engine);
    /// assert!(!naive.register(WorkerKey(1), d)); // retired
    /// assert!(naive.forget_retired(d.engine));
    /// assert!(!naive.forget_retired(d.engine));
    /// // Unknown now: its next event registers it, after a gap.
    /// let next = naive.apply(&event(&d, 3, RET, stored(2)));
    /// assert_eq!(next, Some(EventOutcome::Gap { expected: 1, got: 3, changed: 2 }));
    /// ```
    pub fn forget_retired(&mut self, engine: EngineId) -> bool {
        self.retired.remove(&engine)
    }

    /// Retired incarnations remembered (what
    /// [`crate::IndexStats::retired_incarnations`] counts).
    ///
    /// ```
    /// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
    /// use kv_lookup::{reference::NaiveIndex, WorkerInfo, WorkerKey};
    /// let mut naive = NaiveIndex::default();
    /// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
    /// naive.register(WorkerKey(1), w);
    /// naive.register(WorkerKey(1), WorkerInfo { engine: EngineId::fresh(), ..w }); // a restart retires `w`
    /// assert_eq!(naive.retired_incarnations(), 1);
    /// naive.forget_retired(w.engine);
    /// assert_eq!(naive.retired_incarnations(), 0);
    /// ```
    pub fn retired_incarnations(&self) -> usize {
        self.retired.len()
    }

    /// Applies an event; `None` when the event would be refused (identity
    /// mismatch or zero ids), otherwise what happened.
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
    /// use kv_lookup::reference::NaiveIndex;
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let mut naive = NaiveIndex::default();
    /// let d = worker(Role::Decode); // registered by its first event
    /// assert_eq!(naive.apply(&event(&d, 1, RET, stored(4))), Some(EventOutcome::Applied { changed: 4 }));
    /// assert_eq!(naive.apply(&event(&d, 1, RET, stored(4))), Some(EventOutcome::Duplicate { last_event_id: 1 }));
    /// assert_eq!(naive.apply(&event(&d, 0, RET, KvEventData::Cleared)), None); // refused: ids start at 1
    /// ```
    pub fn apply(&mut self, e: &KvEvent) -> Option<EventOutcome> {
        if e.event_id == 0 || e.tp_size == 0 {
            return None;
        }
        if self.retired.contains(&e.publisher) {
            return Some(EventOutcome::FromRetiredIncarnation);
        }
        if !self.workers.contains_key(&e.publisher) {
            let info = WorkerInfo {
                engine: e.publisher,
                role: e.role,
                layout_fingerprint: e.layout_fingerprint,
                tp_size: e.tp_size,
            };
            self.register(WorkerKey::of_engine(e.publisher), info);
        }
        let w = self
            .workers
            .get_mut(&e.publisher)
            .expect("registered above");
        if w.info.role != e.role
            || w.info.layout_fingerprint != e.layout_fingerprint
            || w.info.tp_size != e.tp_size
        {
            return None;
        }
        if e.event_id <= w.last_event_id {
            return Some(EventOutcome::Duplicate {
                last_event_id: w.last_event_id,
            });
        }
        let expected = w.last_event_id + 1;
        w.last_event_id = e.event_id;
        let set = &mut w.tiers[tier_index(e.tier)];
        let unchained = match &e.data {
            KvEventData::Stored { parent, blocks } => naive_unchained(set, *parent, blocks),
            _ => None,
        };
        let changed = match (&e.data, unchained) {
            (_, Some(_)) => 0,
            (KvEventData::Stored { blocks, .. }, None) => blocks
                .iter()
                .filter(|b| set.insert(b.sequence_hash))
                .count(),
            (KvEventData::Removed { sequence_hashes }, None) => {
                sequence_hashes.iter().filter(|h| set.remove(h)).count()
            }
            (KvEventData::Cleared, None) => std::mem::take(set).len(),
        } as u64;
        if e.event_id != expected || unchained.is_some() {
            w.needs_resync = true;
        }
        if e.event_id != expected {
            return Some(EventOutcome::Gap {
                expected,
                got: e.event_id,
                changed,
            });
        }
        if let Some(cause) = unchained {
            return Some(EventOutcome::Unchained { cause });
        }
        Some(EventOutcome::Applied { changed })
    }

    /// Replaces a worker's inventory (see [`crate::InventoryIndex::resync_worker`]).
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
    /// use kv_lookup::reference::NaiveIndex;
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let mut naive = NaiveIndex::default();
    /// let d = worker(Role::Decode);
    /// naive.apply(&event(&d, 1, RET, stored(1)));
    /// let gap = naive.apply(&event(&d, 3, RET, stored(1)));
    /// assert_eq!(gap, Some(EventOutcome::Gap { expected: 2, got: 3, changed: 0 }));
    /// naive.resync(d.engine, 3, &[(RET, hashes.clone())]);
    /// assert_eq!(naive.holds(d.engine, hashes[3]), vec![RET]);
    /// assert_eq!(naive.apply(&event(&d, 3, RET, stored(1))), Some(EventOutcome::Duplicate { last_event_id: 3 }));
    /// ```
    pub fn resync(
        &mut self,
        engine: EngineId,
        last_event_id: u64,
        inventory: &[(StorageTier, Vec<SequenceHash>)],
    ) {
        if let Some(w) = self.workers.get_mut(&engine) {
            w.tiers = Default::default();
            for (t, hs) in inventory {
                w.tiers[tier_index(*t)].extend(hs.iter().copied());
            }
            w.last_event_id = last_event_id;
            w.needs_resync = false;
        }
    }

    /// Tiers in which `engine` holds `hash`.
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
    /// use kv_lookup::reference::NaiveIndex;
    /// let mut naive = NaiveIndex::default();
    /// let d = worker(Role::Decode);
    /// naive.apply(&event(&d, 1, RetainedGpuDirect, stored(4)));
    /// naive.apply(&event(&d, 2, Device, stored(2)));
    /// assert_eq!(naive.holds(d.engine, hashes[1]), vec![Device, RetainedGpuDirect]);
    /// assert!(naive.holds(EngineId::fresh(), hashes[1]).is_empty());
    /// ```
    pub fn holds(&self, engine: EngineId, hash: SequenceHash) -> Vec<StorageTier> {
        let Some(w) = self.workers.get(&engine) else {
            return Vec::new();
        };
        ALL_TIERS
            .iter()
            .copied()
            .filter(|&t| w.tiers[tier_index(t)].contains(&hash))
            .collect()
    }

    /// Unbounded lookup by the same rules; `None` when the target is unknown
    /// or not a prefill worker.
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
    /// use kv_lookup::reference::NaiveIndex;
    /// let mut naive = NaiveIndex::default();
    /// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
    /// naive.register(WorkerKey(1), d);
    /// naive.register(WorkerKey(2), p);
    /// naive.apply(&event(&p, 1, StorageTier::Device, stored(2)));
    /// let out = naive.lookup(&hashes, p.engine).unwrap();
    /// assert_eq!((out.best_donors.len(), out.native_blocks), (0, 2));
    /// assert_eq!(naive.lookup(&hashes, d.engine), None); // not a prefill worker
    /// assert_eq!(naive.lookup(&hashes, EngineId::fresh()), None); // unknown
    /// ```
    pub fn lookup(&self, hashes: &[SequenceHash], target: EngineId) -> Option<NaiveLookup> {
        let t = self.workers.get(&target)?;
        if t.info.role != Role::Prefill {
            return None;
        }
        let run = |set: &HashSet<SequenceHash>| {
            hashes.iter().take_while(|h| set.contains(h)).count() as u32
        };
        let mut out = NaiveLookup {
            best_donors: Vec::new(),
            donor_blocks: 0,
            native_blocks: run(&t.tiers[tier_index(StorageTier::Device)]),
            retained_blocks: run(&t.tiers[tier_index(StorageTier::RetainedGpuDirect)]),
        };
        for (engine, w) in &self.workers {
            if w.info.role != Role::Decode || w.needs_resync || !w.info.compatible_with(&t.info) {
                continue;
            }
            let k = run(&w.tiers[tier_index(StorageTier::RetainedGpuDirect)]);
            if k == 0 || k < out.donor_blocks {
                continue;
            }
            if k > out.donor_blocks {
                out.best_donors.clear();
                out.donor_blocks = k;
            }
            out.best_donors.push(*engine);
        }
        Some(out)
    }
}

/// The chaining rule of [`crate::InventoryIndex::apply_event`], written
/// plainly: a non-empty store's `parent` must be in `held`, and every block
/// after a known parent must be `chain_sequence_hash(parent, token_hash)`.
fn naive_unchained(
    held: &HashSet<SequenceHash>,
    parent: Option<SequenceHash>,
    blocks: &[StoredBlock],
) -> Option<UnchainedStore> {
    if blocks.is_empty() {
        return None;
    }
    if let Some(p) = parent {
        if !held.contains(&p) {
            return Some(UnchainedStore::ParentNotHeld { parent: p });
        }
    }
    let parents = std::iter::once(parent).chain(blocks.iter().map(|b| Some(b.sequence_hash)));
    for (index, (b, p)) in blocks.iter().zip(parents).enumerate() {
        let Some(p) = p else { continue };
        let expected = chain_sequence_hash(Some(p), b.token_hash);
        if b.sequence_hash != expected {
            return Some(UnchainedStore::BrokenLink {
                index,
                sequence_hash: b.sequence_hash,
                expected,
            });
        }
    }
    None
}

mod cross_check;
#[cfg(test)]
pub(crate) use cross_check::{
    conversations, cross_check_shaped, lookup_disagreement, uuid_from, Live, SplitMix,
};
pub use cross_check::{cross_check, CrossCheckReport};

#[cfg(test)]
mod tests;
