//! A naive reference model of the index and a randomized cross-check.
//!
//! [`NaiveIndex`] implements the same rules as [`crate::InventoryIndex`]
//! with plain hash sets and a linear walk, no budget and no bitsets, so that
//! it is obviously right. The property tests compare both, and
//! [`cross_check`] does the same from a seed so that `cargo xtask qualify`
//! can run it and record the result.

use std::collections::{HashMap, HashSet};

use kv_descriptor::{
    chain_sequence_hash, chain_stored_blocks, EngineId, KvEvent, KvEventData, LayoutFingerprint,
    Role, SequenceHash, StorageTier, StoredBlock, TokenBlockHash,
};

use crate::holder_table::{tier_index, ALL_TIERS, TIERS};
use crate::{
    EventOutcome, InventoryIndex, LookupBudget, LookupOutcome, NoDonorReason, UnchainedStore,
    WorkerInfo, WorkerKey,
};

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

/// Summary of a passing [`cross_check`].
///
/// ```
/// use kv_lookup::reference::{cross_check, CrossCheckReport};
/// let r: CrossCheckReport = cross_check(11, 1_000)?;
/// assert!(r.events + r.lookups <= 1_000); // at most one of them per step
/// assert!(0 < r.donors_found && r.donors_found <= r.lookups);
/// assert_eq!(cross_check(11, 1_000)?, r); // reproduces from its seed
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrossCheckReport {
    /// Events applied to both.
    pub events: u64,
    /// Lookups compared.
    pub lookups: u64,
    /// Lookups that found a donor.
    pub donors_found: u64,
}

/// SplitMix64: a tiny deterministic generator so that the cross-check needs
/// no dependency and reproduces from its seed.
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A worker incarnation of a random workload and its next event id.
pub(crate) struct Live {
    pub(crate) info: WorkerInfo,
    pub(crate) next_id: u64,
}

impl Live {
    /// The id of this worker's next event: in order, except one in
    /// `odds` a duplicate of the last and one in `odds` a gap of one.
    pub(crate) fn event_id(&mut self, rng: &mut SplitMix, odds: u64) -> u64 {
        let id = match rng.below(odds) {
            0 => self.next_id.saturating_sub(1).max(1),
            1 => self.next_id + 1,
            _ => self.next_id,
        };
        self.next_id = self.next_id.max(id + 1);
        id
    }

    /// Event `event_id` of this worker, with its identity as registered.
    pub(crate) fn event(&self, event_id: u64, tier: StorageTier, data: KvEventData) -> KvEvent {
        KvEvent {
            publisher: self.info.engine,
            event_id,
            role: self.info.role,
            layout_fingerprint: self.info.layout_fingerprint,
            tp_size: self.info.tp_size,
            tier,
            data,
        }
    }
}

/// `count` conversations of `blocks` blocks each, as the index's tests
/// store them: true chains (sequence hashes chained from random token
/// hashes by the Dynamo rule), conversation `c` sharing its first
/// `shared(c)` blocks with conversation `c - 1`. Returns the blocks and
/// their sequence hashes, per conversation.
pub(crate) fn conversations(
    rng: &mut SplitMix,
    count: usize,
    blocks: usize,
    shared: impl Fn(usize) -> usize,
) -> (Vec<Vec<StoredBlock>>, Vec<Vec<SequenceHash>>) {
    let mut chains: Vec<Vec<StoredBlock>> = Vec::new();
    for c in 0..count {
        let token_hashes: Vec<TokenBlockHash> = (0..blocks)
            .map(|i| match chains.last() {
                Some(prev) if i < shared(c) => prev[i].token_hash,
                _ => TokenBlockHash(rng.next()),
            })
            .collect();
        chains.push(chain_stored_blocks(None, token_hashes));
    }
    let hashes = chains
        .iter()
        .map(|c| c.iter().map(|b| b.sequence_hash).collect())
        .collect();
    (chains, hashes)
}

/// Where the index's lookup `got` disagrees with the reference model's
/// answer `want` for the same request and target (`None`: an unknown or
/// non-prefill target), named for a report; `None` when they agree. A
/// donor must cover exactly the model's best coverage, beyond the
/// baseline, be one of the model's best donors and count its ties; a
/// refusal must be the model's.
pub(crate) fn lookup_disagreement(
    got: &LookupOutcome,
    want: Option<&NaiveLookup>,
) -> Option<&'static str> {
    let Some(w) = want else {
        return got
            .donor
            .is_ok()
            .then_some("donor for an unknown or non-prefill target");
    };
    if (got.baseline.native_blocks, got.baseline.retained_blocks)
        != (w.native_blocks, w.retained_blocks)
    {
        return Some("baseline");
    }
    let base = w.native_blocks.max(w.retained_blocks);
    match got.donor {
        Ok(d) => {
            if d.blocks != w.donor_blocks || d.blocks <= base || !w.best_donors.contains(&d.engine)
            {
                return Some("donor");
            }
            if d.tied as usize != w.best_donors.len() {
                return Some("tie count");
            }
        }
        Err(NoDonorReason::NotBeyondBaseline {
            donor_blocks,
            baseline_blocks,
        }) => {
            if (donor_blocks, baseline_blocks) != (w.donor_blocks, base) || donor_blocks > base {
                return Some("coverage not beyond the baseline");
            }
        }
        Err(NoDonorReason::NoRootCoverage) => {
            if w.donor_blocks != 0 {
                return Some("root coverage");
            }
        }
        Err(_) => {
            if w.donor_blocks > base {
                return Some("missed donor");
            }
        }
    }
    None
}

/// Drives [`crate::InventoryIndex`] and [`NaiveIndex`] with the same random
/// workload (`steps` operations from `seed`: stores from the root and from a
/// parent that may not be held, stores with a broken chain, removals, clears,
/// duplicates, gaps, restarts, resyncs, lookups over 12 workers and 8
/// conversations sharing prefixes) and compares every outcome.
///
/// # Errors
/// A description of the first disagreement, with the step number and seed.
///
/// # Examples
/// ```
/// let r = kv_lookup::reference::cross_check(7, 2_000).unwrap();
/// assert!(r.lookups > 0 && r.donors_found > 0);
/// ```
pub fn cross_check(seed: u64, steps: u64) -> Result<CrossCheckReport, String> {
    cross_check_shaped(seed, steps, 24, false)
}

/// [`cross_check`] over conversations of `blocks` blocks (conversation `c`
/// shares its first `c * blocks / 48` with `c - 1`); with `truncate`, half
/// the lookups end at a random block and half the events' block ranges are
/// at most one block long. `(24, false)` is [`cross_check`].
pub(crate) fn cross_check_shaped(
    seed: u64,
    steps: u64,
    blocks: u64,
    truncate: bool,
) -> Result<CrossCheckReport, String> {
    let mut rng = SplitMix(seed);
    let fast = InventoryIndex::new();
    let mut naive = NaiveIndex::default();
    let fps = [LayoutFingerprint(1), LayoutFingerprint(2)];
    // Conversations: true chains of `blocks` blocks (token hashes chained by
    // the Dynamo rule); conversation c shares its first c * blocks / 48
    // blocks with c-1 (c/2 for 24 blocks).
    let n = blocks as usize;
    let (chains, convs) = conversations(&mut rng, 8, n, |c| c * n / 48);
    let mut live: Vec<Live> = Vec::new();
    for k in 0..12u64 {
        let info = WorkerInfo {
            engine: EngineId(uuid_from(rng.next(), k)),
            role: if k % 3 == 0 {
                Role::Prefill
            } else {
                Role::Decode
            },
            layout_fingerprint: fps[(k % 5 == 4) as usize],
            tp_size: 1 + (k % 7 == 6) as u32,
        };
        fast.register_worker(WorkerKey(k), info)
            .map_err(|e| e.to_string())?;
        naive.register(WorkerKey(k), info);
        live.push(Live { info, next_id: 1 });
    }
    let mut report = CrossCheckReport {
        events: 0,
        lookups: 0,
        donors_found: 0,
    };
    for step in 0..steps {
        let k = rng.below(live.len() as u64) as usize;
        let op = rng.below(100);
        if op < 3 {
            // Restart: new incarnation under the same key.
            let info = WorkerInfo {
                engine: EngineId(uuid_from(rng.next(), step)),
                ..live[k].info
            };
            fast.register_worker(WorkerKey(k as u64), info)
                .map_err(|e| e.to_string())?;
            naive.register(WorkerKey(k as u64), info);
            live[k] = Live { info, next_id: 1 };
            continue;
        }
        if op < 5 {
            let engine = live[k].info.engine;
            let snapshot: Vec<(StorageTier, Vec<SequenceHash>)> = ALL_TIERS
                .iter()
                .map(|&t| {
                    let c = &convs[rng.below(convs.len() as u64) as usize];
                    (t, c[..rng.below(c.len() as u64) as usize].to_vec())
                })
                .collect();
            let last = live[k].next_id - 1;
            fast.resync_worker(engine, last, &snapshot)
                .map_err(|e| e.to_string())?;
            naive.resync(engine, last, &snapshot);
            continue;
        }
        if op < 40 {
            let mut c = &convs[rng.below(convs.len() as u64) as usize][..];
            if truncate && rng.below(2) == 0 {
                c = &c[..1 + rng.below(c.len() as u64) as usize];
            }
            let target = live[rng.below(live.len() as u64) as usize].info.engine;
            let want = naive.lookup(c, target);
            let got = fast.lookup(c, target, LookupBudget::new(1_000_000, u32::MAX));
            report.lookups += 1;
            if got.donor.is_ok() {
                report.donors_found += 1;
            }
            if let Some(what) = lookup_disagreement(&got, want.as_ref()) {
                return Err(format!(
                    "seed {seed} step {step}: {what}: fast {got:?} naive {want:?}"
                ));
            }
            continue;
        }
        // An event: mostly in order, sometimes duplicated or with a gap.
        let l = &mut live[k];
        let id = l.event_id(&mut rng, 20);
        let tier = if rng.below(3) == 0 {
            ALL_TIERS[rng.below(TIERS as u64) as usize]
        } else if l.info.role == Role::Decode {
            StorageTier::RetainedGpuDirect
        } else {
            StorageTier::Device
        };
        let ci = rng.below(convs.len() as u64) as usize;
        let (c, blocks) = (&convs[ci], &chains[ci]);
        let lo = rng.below(c.len() as u64) as usize;
        let mut hi = lo + rng.below((c.len() - lo) as u64 + 1) as usize;
        if truncate && rng.below(2) == 0 {
            // Short ranges: one block removed from inside a run.
            hi = hi.min(lo + 1);
        }
        let data = match rng.below(14) {
            0 => KvEventData::Cleared,
            1..=3 => KvEventData::Removed {
                sequence_hashes: c[lo..hi].to_vec(),
            },
            // A continuation: its parent may or may not be held.
            4..=6 => KvEventData::Stored {
                parent: lo.checked_sub(1).map(|p| c[p]),
                blocks: blocks[lo..hi].to_vec(),
            },
            // A chain broken at one block.
            7 => {
                let mut bad = blocks[..hi].to_vec();
                if let Some(b) = bad.get_mut(lo) {
                    b.token_hash = TokenBlockHash(b.token_hash.0 ^ 1);
                }
                KvEventData::Stored {
                    parent: None,
                    blocks: bad,
                }
            }
            _ => KvEventData::Stored {
                parent: None,
                blocks: blocks[..hi].to_vec(),
            },
        };
        let e = l.event(id, tier, data);
        let got = fast.apply_event(&e).ok();
        let want = naive.apply(&e);
        if got != want {
            return Err(format!(
                "seed {seed} step {step}: event {e:?}: fast {got:?} naive {want:?}"
            ));
        }
        report.events += 1;
    }
    Ok(report)
}

fn uuid_from(a: u64, b: u64) -> uuid::Uuid {
    // `| 1` keeps the id non-nil.
    uuid::Uuid::from_u64_pair(a | 1, b)
}

#[cfg(test)]
mod tests;
