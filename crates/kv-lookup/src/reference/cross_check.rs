//! The randomized cross-check of [`crate::InventoryIndex`] against
//! [`NaiveIndex`] (and the workload pieces the index's own stress tests
//! share): one seeded workload driven into both, every outcome compared.

use kv_descriptor::{
    chain_stored_blocks, EngineId, KvEvent, KvEventData, LayoutFingerprint, Role, SequenceHash,
    StorageTier, StoredBlock, TokenBlockHash,
};

use super::NaiveIndex;
use super::NaiveLookup;
use crate::holder_table::{ALL_TIERS, TIERS};
use crate::{InventoryIndex, LookupBudget, LookupOutcome, NoDonorReason, WorkerInfo, WorkerKey};

/// Summary of a passing [`cross_check`].
///
/// ```
/// use kv_lookup::reference::{cross_check, CrossCheckReport};
/// let r: CrossCheckReport = cross_check(11, 1_000)?;
/// assert!(r.events + r.lookups <= 1_000); // at most one of them per step
/// assert!(0 < r.donors_found && r.donors_found <= r.lookups);
/// assert!(r.comebacks > 0);
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
    /// Retired incarnations both forgot that then registered again.
    pub comebacks: u64,
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
/// duplicates, gaps, restarts, retired incarnations forgotten and back,
/// resyncs, lookups over 12 workers and 8 conversations sharing prefixes)
/// and compares every outcome.
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
    // Incarnations retired by a restart, with their worker key index.
    let mut gone: Vec<(usize, Live)> = Vec::new();
    let mut report = CrossCheckReport {
        events: 0,
        lookups: 0,
        donors_found: 0,
        comebacks: 0,
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
            let old = std::mem::replace(&mut live[k], Live { info, next_id: 1 });
            gone.push((k, old));
            continue;
        }
        if op == 3 && !gone.is_empty() {
            let back = gone.swap_remove(rng.below(gone.len() as u64) as usize);
            forget_and_come_back(
                &fast, &mut naive, &mut rng, &chains, &mut live, &mut gone, back,
            )
            .map_err(|what| format!("seed {seed} step {step}: {what}"))?;
            report.comebacks += 1;
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

/// A retired incarnation `back` (worker key index, last state) forgotten by
/// both indexes and back under its old key, as a router does once its
/// registry forgot it: its late event is ignored first (still
/// remembered), both forget it (and neither forgets a live one); half the
/// time a stray event of it comes before its registration (an unknown
/// publisher's, registering it under `WorkerKey::of_engine`); then it
/// registers under its key again, replacing the key's live incarnation
/// (which joins `gone`). Its event ids go on from where they were, after
/// some it published while away, so its first event back is a gap.
fn forget_and_come_back(
    fast: &InventoryIndex,
    naive: &mut NaiveIndex,
    rng: &mut SplitMix,
    chains: &[Vec<StoredBlock>],
    live: &mut [Live],
    gone: &mut Vec<(usize, Live)>,
    (k, mut back): (usize, Live),
) -> Result<(), String> {
    fn both(fast: &InventoryIndex, naive: &mut NaiveIndex, e: &KvEvent) -> Result<(), String> {
        let (got, want) = (fast.apply_event(e).ok(), naive.apply(e));
        match got == want {
            true => Ok(()),
            false => Err(format!("event {e:?}: fast {got:?} naive {want:?}")),
        }
    }
    let engine = back.info.engine;
    let late = back.event(back.next_id, StorageTier::Device, KvEventData::Cleared);
    both(fast, naive, &late)?;
    back.next_id += 2 + rng.below(3);
    let forgot = (fast.forget_retired(engine), naive.forget_retired(engine));
    let other = live[rng.below(live.len() as u64) as usize].info.engine;
    let live_forgot = (fast.forget_retired(other), naive.forget_retired(other));
    if forgot != (true, true) || live_forgot != (false, false) {
        return Err(format!(
            "forget_retired: fast/naive {forgot:?} for {engine}, {live_forgot:?} for live {other}"
        ));
    }
    let retired = (
        fast.stats().retired_incarnations,
        naive.retired_incarnations(),
    );
    if retired.0 != retired.1 {
        return Err(format!("retired incarnations: fast/naive {retired:?}"));
    }
    if rng.below(2) == 0 {
        let c = &chains[rng.below(chains.len() as u64) as usize];
        let blocks = c[..1 + rng.below(c.len() as u64) as usize].to_vec();
        let tier = match back.info.role {
            Role::Decode => StorageTier::RetainedGpuDirect,
            _ => StorageTier::Device,
        };
        let stray = KvEventData::Stored {
            parent: None,
            blocks,
        };
        back.next_id += 1;
        both(fast, naive, &back.event(back.next_id - 1, tier, stray))?;
    }
    fast.register_worker(WorkerKey(k as u64), back.info)
        .map_err(|e| format!("registration of a forgotten incarnation: {e}"))?;
    if !naive.register(WorkerKey(k as u64), back.info) {
        return Err("the model refused a forgotten incarnation".into());
    }
    gone.push((k, std::mem::replace(&mut live[k], back)));
    Ok(())
}

pub(crate) fn uuid_from(a: u64, b: u64) -> uuid::Uuid {
    // `| 1` keeps the id non-nil.
    uuid::Uuid::from_u64_pair(a | 1, b)
}
