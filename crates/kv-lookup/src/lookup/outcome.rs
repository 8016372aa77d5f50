//! What a lookup is given and what it returns: [`LookupBudget`],
//! [`LookupOutcome`] with its [`DonorMatch`] or [`NoDonorReason`], and the
//! target's [`TargetBaseline`]. The walk itself is in `lookup.rs`.

use std::time::Duration;

use kv_descriptor::{EngineId, Role};

use crate::worker::WorkerKey;

/// Work and time a lookup may spend.
///
/// ```
/// use kv_lookup::LookupBudget;
/// let b = LookupBudget::new(500, 4096);
/// assert_eq!(b.time.as_micros(), 500);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupBudget {
    /// Wall time of the walk (a lookup takes no lock, so it never waits for
    /// event application).
    pub time: Duration,
    /// Most holder-table probes (one probe = one sequence hash in one worker group).
    pub max_probes: u32,
}

impl LookupBudget {
    /// `time_us` microseconds and `max_probes` probes.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_lookup::LookupBudget;
    /// let b = LookupBudget::new(250, 1_024);
    /// assert_eq!((b.time, b.max_probes), (Duration::from_micros(250), 1_024));
    /// assert_eq!(LookupBudget::default(), LookupBudget::new(1_000, 16_384));
    /// ```
    pub const fn new(time_us: u64, max_probes: u32) -> Self {
        Self {
            time: Duration::from_micros(time_us),
            max_probes,
        }
    }
}

impl Default for LookupBudget {
    /// 1 ms and 16,384 probes (a 256k-token prompt at 16 tokens per block).
    fn default() -> Self {
        Self::new(1_000, 16_384)
    }
}

/// A donor that holds the request's prefix from the root in its retained bank.
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
/// use kv_lookup::DonorMatch;
/// const RET: StorageTier = StorageTier::RetainedGpuDirect;
/// let (d1, d2, p) = (worker(Role::Decode), worker(Role::Decode), worker(Role::Prefill));
/// for (key, w) in [(1, d1), (2, d2), (3, p)] {
///     index.register_worker(WorkerKey(key), w)?;
/// }
/// index.apply_event(&event(&d1, 1, RET, stored(3)))?;
/// index.apply_event(&event(&d2, 1, RET, stored(3)))?;
/// // Both decode workers hold blocks 0..3: one is chosen, the tie is reported.
/// let donor: DonorMatch = index.lookup(&hashes, p.engine, LookupBudget::default()).donor.unwrap();
/// assert_eq!((donor.blocks, donor.tied), (3, 2));
/// assert!([d1.engine, d2.engine].contains(&donor.engine));
/// assert_eq!(index.worker(donor.engine).unwrap().0, donor.worker);
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DonorMatch {
    /// Donor incarnation (decode role, same layout and TP as the target).
    pub engine: EngineId,
    /// Donor's stable worker key.
    pub worker: WorkerKey,
    /// Blocks `0..blocks` of the request are in the donor's retained tier.
    pub blocks: u32,
    /// Donors with the same coverage (the chosen one included); the choice
    /// among them is spread by the request's first hash.
    pub tied: u32,
}

/// What the target already has: the donor must beat this to be worth a fetch.
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
/// use kv_lookup::{NoDonorReason, TargetBaseline};
/// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
/// index.register_worker(WorkerKey(1), d)?;
/// index.register_worker(WorkerKey(2), p)?;
/// index.apply_event(&event(&d, 1, StorageTier::RetainedGpuDirect, stored(2)))?;
/// index.apply_event(&event(&p, 1, StorageTier::Device, stored(3)))?;
/// // The target already computed 3 blocks; a donor of 2 is not worth a fetch.
/// let out = index.lookup(&hashes, p.engine, LookupBudget::default());
/// assert_eq!(out.baseline, TargetBaseline { native_blocks: 3, retained_blocks: 0 });
/// assert_eq!(out.donor, Err(NoDonorReason::NotBeyondBaseline { donor_blocks: 2, baseline_blocks: 3 }));
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetBaseline {
    /// Root-prefix blocks in the target's native device cache.
    pub native_blocks: u32,
    /// Root-prefix blocks in the target's own retained bank. Baseline only:
    /// it raises the bar for donors but earns the target no execution credit.
    pub retained_blocks: u32,
}

impl TargetBaseline {
    /// Blocks the target does not need from a donor: the longer of both.
    ///
    /// ```
    /// use kv_lookup::TargetBaseline;
    /// let baseline = TargetBaseline { native_blocks: 3, retained_blocks: 5 };
    /// assert_eq!(baseline.blocks(), 5);
    /// ```
    pub fn blocks(&self) -> u32 {
        self.native_blocks.max(self.retained_blocks)
    }
}

/// Why a lookup returned no donor.
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
/// use kv_lookup::NoDonorReason;
/// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
/// let budget = LookupBudget::default();
/// index.register_worker(WorkerKey(2), p)?;
/// assert_eq!(index.lookup(&[], p.engine, budget).donor, Err(NoDonorReason::EmptyRequest));
/// assert_eq!(index.lookup(&hashes, p.engine, budget).donor, Err(NoDonorReason::NoCompatibleDonor));
/// index.register_worker(WorkerKey(1), d)?;
/// assert_eq!(index.lookup(&hashes, p.engine, budget).donor, Err(NoDonorReason::NoRootCoverage));
/// let why = index.lookup(&hashes, d.engine, budget).donor.unwrap_err();
/// assert_eq!(why, NoDonorReason::TargetNotPrefill(d.engine, Role::Decode));
/// assert!(why.to_string().ends_with("has role Decode, not Prefill"));
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoDonorReason {
    /// The request has no full block.
    #[error("`sequence_hashes` is empty")]
    EmptyRequest,
    /// The target is not a live incarnation known to the index.
    #[error("`target` {0} is not a known live worker")]
    UnknownTarget(EngineId),
    /// Only a prefill worker can be a fetch target.
    #[error("`target` {0} has role {1:?}, not Prefill")]
    TargetNotPrefill(EngineId, Role),
    /// No live decode worker with the target's layout fingerprint and TP
    /// size (workers waiting for a resync do not count).
    #[error("no decode worker matches the target's `layout_fingerprint` and `tp_size`")]
    NoCompatibleDonor,
    /// No compatible donor holds the request's first block.
    #[error("no compatible donor holds the first block of `sequence_hashes`")]
    NoRootCoverage,
    /// The best donor covers no more than the target already has.
    #[error("best donor covers {donor_blocks} blocks, not beyond the target's baseline of {baseline_blocks}")]
    NotBeyondBaseline {
        /// Best donor's coverage in blocks.
        donor_blocks: u32,
        /// [`TargetBaseline::blocks`].
        baseline_blocks: u32,
    },
    /// The budget ran out before any donor beyond the baseline was found.
    #[error("`budget` exhausted after {probes} probes before a donor was found")]
    BudgetExhausted {
        /// Probes spent.
        probes: u32,
    },
    /// The request was cancelled while the lookup walked the index
    /// ([`InventoryIndex::lookup_cancellable`](crate::InventoryIndex::lookup_cancellable)): no donor is proposed, even
    /// one already found.
    #[error("request cancelled during the lookup after {probes} probes")]
    Cancelled {
        /// Probes spent.
        probes: u32,
    },
}

/// Result of [`InventoryIndex::lookup`](crate::InventoryIndex::lookup).
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
/// use kv_lookup::LookupOutcome;
/// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
/// index.register_worker(WorkerKey(1), d)?;
/// index.register_worker(WorkerKey(2), p)?;
/// index.apply_event(&event(&d, 1, StorageTier::RetainedGpuDirect, stored(4)))?;
/// // 2 probes for a 4-block request: the walk stops early, with the best so far.
/// let out: LookupOutcome = index.lookup(&hashes, p.engine, LookupBudget::new(1_000_000, 2));
/// assert!(out.budget_exhausted);
/// assert_eq!((out.donor.unwrap().blocks, out.probes), (2, 2));
/// let out = index.lookup(&hashes, p.engine, LookupBudget::default());
/// assert!(!out.budget_exhausted);
/// assert_eq!((out.donor.unwrap().blocks, out.probes), (4, 4)); // a probe per block and group
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupOutcome {
    /// Best donor, or why there is none.
    pub donor: Result<DonorMatch, NoDonorReason>,
    /// Target's own coverage. Lower bounds when `budget_exhausted`.
    pub baseline: TargetBaseline,
    /// True when the walk stopped on its budget: `donor` is the best found
    /// so far (its true coverage may be longer).
    pub budget_exhausted: bool,
    /// Holder-table probes spent.
    pub probes: u32,
    /// Wall time spent.
    pub elapsed: Duration,
}
