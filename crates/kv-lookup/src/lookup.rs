//! Bounded donor lookup: the best decode donor for a request on a chosen
//! prefill target, and the target's own baseline.

use std::time::{Duration, Instant};

use kv_descriptor::{EngineId, Role, SequenceHash};

use crate::holder_table::{
    HolderTable, Loc, CHUNK, HOT_DEVICE as DEVICE, HOT_RETAINED as RETAINED,
};
use crate::index::{split, State};
use crate::prefetch::prefetch_read;
use crate::InventoryIndex;

/// Work units between two clock reads. A probe that continues the previous
/// block's run costs 1 unit (a few ns, sequential memory), an index probe
/// [`INDEX_PROBE_UNITS`] (a likely cache miss, ~100 ns). Reading the clock
/// costs 20-70 ns, more than a sequential probe, so it is read only this
/// often: the time budget can be overrun by at most this much work (128
/// sequential probes or 16 index probes, about 2 µs in the worst case). A
/// walk that takes a whole chunk of a run at once pays as much as an index
/// probe per attempt, however many blocks it takes.
pub const CLOCK_CHECK_INTERVAL: u32 = 128;

/// Entries (24 bytes each) prefetched ahead of a walk inside a run: about
/// six cache lines, enough to hide DRAM latency at a few ns per entry.
const RUN_PREFETCH_ENTRIES: usize = 16;

/// Work units charged for one index probe; see [`CLOCK_CHECK_INTERVAL`].
pub const INDEX_PROBE_UNITS: u32 = 8;

/// Work units charged for one chunk skip attempt (see `walk_group`): it
/// reads a chunk summary and the chunk's last entry, two cache lines that
/// may both miss, so it is charged like an index probe.
const SKIP_UNITS: u32 = INDEX_PROBE_UNITS;

/// Chunks ahead whose last entry and summary a skipping walk prefetches.
const SKIP_PREFETCH: usize = 4;

mod outcome;
pub use outcome::{DonorMatch, LookupBudget, LookupOutcome, NoDonorReason, TargetBaseline};

/// Probe, clock and cancellation accounting of one lookup.
struct Meter<'c> {
    probes: u32,
    max_probes: u32,
    deadline: Instant,
    /// Work units done, and the count at which the clock is read next.
    units: u32,
    next_check: u32,
    exhausted: bool,
    /// Asked at every clock check; true stops the walk.
    cancelled: &'c dyn Fn() -> bool,
    was_cancelled: bool,
}

impl Meter<'_> {
    /// Probes and work units allowed before the next budget check (both
    /// non-zero); `None` (and `exhausted`) when the budget is spent.
    #[inline]
    fn quota(&mut self) -> Option<(u32, u32)> {
        if self.probes >= self.max_probes {
            self.exhausted = true;
            return None;
        }
        if self.units >= self.next_check {
            if (self.cancelled)() {
                self.exhausted = true;
                self.was_cancelled = true;
                return None;
            }
            if Instant::now() >= self.deadline {
                self.exhausted = true;
                return None;
            }
            self.next_check = self.units + CLOCK_CHECK_INTERVAL;
        }
        Some((self.max_probes - self.probes, self.next_check - self.units))
    }

    /// Charges `probes` blocks that continued a run, worth `units` work
    /// units (one per block walked one by one, [`SKIP_UNITS`] per chunk
    /// skip attempt).
    #[inline]
    fn sequential(&mut self, probes: u32, units: u32) {
        self.probes += probes;
        self.units += units;
    }

    /// Charges one index probe.
    #[inline]
    fn indexed(&mut self) {
        self.probes += 1;
        self.units += INDEX_PROBE_UNITS;
    }
}

/// Walk result over one worker group.
#[derive(Default, Debug, PartialEq, Eq)]
struct GroupWalk {
    /// Donors with the longest coverage, and that coverage.
    best: u64,
    best_blocks: u32,
    native_blocks: u32,
    retained_blocks: u32,
}

/// Walk state over one group: who is still covering, and the result so far.
struct Walk {
    active: u64,
    native: u64,
    retained: u64,
    out: GroupWalk,
}

impl Walk {
    /// True when block bitsets `hot` drop anyone still followed.
    #[inline(always)]
    fn loses_any(&self, hot: [u64; 2]) -> bool {
        ((self.active | self.retained) & !hot[RETAINED]) | (self.native & !hot[DEVICE]) != 0
    }

    /// Applies block `i`'s `[device, retained]` bitsets; false when nobody
    /// is left to follow.
    #[inline(always)]
    fn block(&mut self, i: usize, hot: [u64; 2]) -> bool {
        let next = self.active & hot[RETAINED];
        if next == 0 && self.active != 0 {
            self.out.best = self.active;
            self.out.best_blocks = i as u32;
        }
        self.active = next;
        if self.native & hot[DEVICE] == 0 && self.native != 0 {
            self.native = 0;
            self.out.native_blocks = i as u32;
        }
        if self.retained & hot[RETAINED] == 0 && self.retained != 0 {
            self.retained = 0;
            self.out.retained_blocks = i as u32;
        }
        (self.active | self.native | self.retained) != 0
    }

    /// The result of a walk that stopped before block `i`: whoever is
    /// still followed covers `0..i`.
    fn finish(self, i: usize) -> GroupWalk {
        let mut out = self.out;
        if self.active != 0 {
            out.best = self.active;
            out.best_blocks = i as u32;
        }
        if self.native != 0 {
            out.native_blocks = i as u32;
        }
        if self.retained != 0 {
            out.retained_blocks = i as u32;
        }
        out
    }
}

/// Walks `hashes` from the root in one group: `donors` lose their bit at the
/// first block missing from their retained tier; the target's native and
/// retained runs are tracked the same way. Stops when nobody is left.
///
/// Consecutive blocks are first looked for right after the previous block's
/// entry (a tight loop over two arrays); the index is asked only where that
/// fails. Every block examined, either way, is one probe.
///
/// Inside a run, at a chunk start (see [`CHUNK`]) with a whole chunk left in
/// the run, the request and the probe quota, the walk takes the chunk's
/// `CHUNK` blocks at once when its summary drops nobody still followed
/// (`!loses_any`) and its last entry's key is the request's hash at that
/// position. That is the per-block walk's result exactly:
/// - The summary is at most the `AND` of the chunk's hot bits and covers
///   everyone still followed (never nobody while the walk goes on), so
///   every entry of the chunk is live and drops nobody.
/// - The keys are the request's: a summary is non-zero only in an *ordered*
///   run (filled by one Stored event that passed its chain check, so each
///   entry is an ancestor of every later one; see `holder_table`). The
///   cursor entry before the chunk is the request's block `i - 1` (the
///   walk matched it) and the chunk's last entry is block `i + CHUNK - 1`;
///   a sequence hash names its whole prefix (it hashes its parent's hash
///   and its own tokens; equal hashes are trusted to be equal prefixes, as
///   everywhere in the index, up to a 64-bit collision), so the `CHUNK - 1`
///   entries between, distinct descendants of block `i - 1` and ancestors
///   of block `i + CHUNK - 1`, are exactly blocks `i .. i + CHUNK - 1`.
///   Holes in the chain (blocks another worker had stored first) would
///   shift the last key off that position, so they fail the compare.
///
/// This needs the request's hashes to be a chain, as
/// [`kv_descriptor::sequence_hashes`] makes them. Any other chunk, or a
/// failed check, is walked one block at a time, which finds exactly where
/// someone drops out.
///
/// A skip is charged `CHUNK` probes, like the blocks it stands for, so
/// probe counts, the probe budget and where it runs out are the per-block
/// walk's. Its work, two cache lines that may miss like an index probe, is
/// charged [`SKIP_UNITS`] units per attempt (successful or not), which keeps
/// the clock-check overrun bound of [`CLOCK_CHECK_INTERVAL`] in real work.
fn walk_group(
    table: &HolderTable,
    hashes: &[SequenceHash],
    donors: u64,
    target: u64,
    meter: &mut Meter<'_>,
) -> GroupWalk {
    let n = hashes.len();
    let mut w = Walk {
        active: donors,
        native: target,
        retained: target,
        out: GroupWalk::default(),
    };
    let mut cursor: Option<Loc> = None;
    let mut i = 0;
    let mut alive = (donors | target) != 0;
    while i < n && alive {
        let Some((probes, units)) = meter.quota() else {
            break;
        };
        let (probes, units) = (probes as usize, units as usize);
        if let Some(loc) = cursor {
            let next = table.after(loc);
            let limit = next.len().min(n - i).min(probes);
            let (next, ahead) = (&next[..limit], &hashes[i..i + limit]);
            let (skew, sums) = table.chunks_after(loc);
            // The first chunks' last entries and summaries: the per-block
            // prefetch does not reach that far, and the skip loop prefetches
            // from `SKIP_PREFETCH` chunks on.
            let ends = (skew + CHUNK - 1..limit).step_by(CHUNK);
            for (c, last) in ends.take(SKIP_PREFETCH).enumerate() {
                prefetch_read(next.as_ptr().wrapping_add(last));
                prefetch_read(sums.as_ptr().wrapping_add(c));
            }
            // Blocks walked, units spent, and whether the units ran out.
            let (mut used, mut spent, mut out_of_units) = (0, 0, false);
            // Where the next chunk starts in `next`.
            let mut boundary = skew;
            'run: loop {
                // One block at a time up to the chunk start.
                let end = boundary.min(limit);
                let stop = end.min(used + units.saturating_sub(spent));
                let start = used;
                while used < stop && next[used].key == ahead[used].0 && next[used].bits != [0; 2] {
                    // The run is contiguous but may be cold: keep a few cache
                    // lines in flight ahead of the compare.
                    prefetch_read(next.as_ptr().wrapping_add(used + RUN_PREFETCH_ENTRIES));
                    let bits = next[used].bits;
                    // Most blocks change nothing: one test instead of three.
                    if w.loses_any(bits) {
                        alive = w.block(i + used, bits);
                        if !alive {
                            used += 1;
                            break;
                        }
                    }
                    used += 1;
                }
                spent += used - start;
                if !alive || used < stop || used == limit {
                    break;
                }
                if used < end {
                    out_of_units = true;
                    break;
                }
                // At a chunk start: take whole chunks while they qualify.
                while used + CHUNK <= limit {
                    // Like an index probe, an attempt needs one unit left
                    // and may overrun the quota by the rest of its cost.
                    if spent >= units {
                        out_of_units = true;
                        break 'run;
                    }
                    spent += SKIP_UNITS as usize;
                    let c = (used - skew) / CHUNK;
                    let last = used + CHUNK - 1;
                    if w.loses_any(sums[c]) || next[last].key != ahead[last].0 {
                        break;
                    }
                    // Chunk ends and summaries a few chunks on: a long
                    // match reads one line per chunk, far apart.
                    prefetch_read(next.as_ptr().wrapping_add(last + SKIP_PREFETCH * CHUNK));
                    prefetch_read(sums.as_ptr().wrapping_add(c + SKIP_PREFETCH));
                    used += CHUNK;
                }
                boundary = used + CHUNK;
            }
            if used > 0 {
                cursor = Some(loc.advanced(used));
            }
            i += used;
            meter.sequential(used as u32, spent as u32);
            if !alive || i == n || used == probes || out_of_units {
                continue;
            }
        }
        // The run did not continue with block `i`: one index probe.
        meter.indexed();
        let hot = match table.locate(hashes[i]) {
            Some((loc, hot)) => {
                cursor = Some(loc);
                // If the request follows this run to its end, block
                // `i + 1 + left` is the next index probe: start its slot's
                // DRAM miss now, while the walk streams the run (long
                // requests cross a run end per stored turn).
                let left = table.after(loc).len();
                if let Some(&h) = hashes.get(i + 1 + left) {
                    table.prefetch(h);
                }
                hot
            }
            None => {
                cursor = None;
                [0; 2]
            }
        };
        alive = w.block(i, hot);
        i += 1;
    }
    w.finish(i)
}

/// Position of the `n`-th set bit of `mask` (`n < mask.count_ones()`).
fn nth_set_bit(mut mask: u64, n: u32) -> u32 {
    for _ in 0..n {
        mask &= mask - 1;
    }
    mask.trailing_zeros()
}

impl InventoryIndex {
    /// Finds the best donor for a request that the router already sent to
    /// prefill worker `target`, within `budget`.
    ///
    /// `sequence_hashes` are the request's chained block hashes, root first
    /// ([`kv_descriptor::sequence_hashes`] at the engine's block size). A
    /// donor must be a live decode worker, not waiting for a resync, with the
    /// target's layout fingerprint and TP size, holding blocks `0..k` in its
    /// retained tier (announced only once every rank acknowledged the store,
    /// so it is ready inventory); the longest `k` wins, and it must exceed the
    /// target's baseline. The lookup reads only: it reserves and pins nothing,
    /// so the donor may drop the blocks before a fetch, which then falls back.
    ///
    /// Cost: one probe per block and worker group, stopping as soon as no
    /// donor and no target run is left (inside a long run, a chunk of 32
    /// blocks that nobody drops out of is taken with one compare and still
    /// counts 32 probes; this relies on `sequence_hashes` being chained); never more than `budget.max_probes`
    /// probes, and never more than `budget.time` plus
    /// [`CLOCK_CHECK_INTERVAL`] work units. On exhaustion the best donor found so
    /// far is returned with `budget_exhausted` set.
    ///
    /// ```
    /// use kv_descriptor::*;
    /// use kv_lookup::{InventoryIndex, LookupBudget, WorkerInfo, WorkerKey};
    ///
    /// let index = InventoryIndex::new();
    /// let fp = LayoutFingerprint(42);
    /// let (decode, prefill) = (EngineId::fresh(), EngineId::fresh());
    /// for (k, engine, role) in [(1, decode, Role::Decode), (2, prefill, Role::Prefill)] {
    ///     index.register_worker(WorkerKey(k), WorkerInfo { engine, role, layout_fingerprint: fp, tp_size: 1 }).unwrap();
    /// }
    /// let tokens: Vec<u32> = (0..128).collect();
    /// let hashes = sequence_hashes(&tokens, 16); // 8 blocks
    /// let token_hashes = token_block_hashes(&tokens, 16);
    /// let stored = |engine, tier, n: usize| KvEvent {
    ///     publisher: engine, event_id: 1, role: if engine == decode { Role::Decode } else { Role::Prefill },
    ///     layout_fingerprint: fp, tp_size: 1, tier,
    ///     data: KvEventData::Stored { parent: None, blocks: hashes[..n].iter().zip(&token_hashes)
    ///         .map(|(&sequence_hash, &token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect() },
    /// };
    /// index.apply_event(&stored(decode, StorageTier::RetainedGpuDirect, 6)).unwrap();
    /// index.apply_event(&stored(prefill, StorageTier::Device, 2)).unwrap();
    ///
    /// let out = index.lookup(&hashes, prefill, LookupBudget::default());
    /// let donor = out.donor.unwrap();
    /// assert_eq!((donor.engine, donor.blocks), (decode, 6));
    /// assert_eq!(out.baseline.native_blocks, 2);
    /// assert!(!out.budget_exhausted);
    /// ```
    pub fn lookup(
        &self,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
        budget: LookupBudget,
    ) -> LookupOutcome {
        self.lookup_inner(sequence_hashes, target, budget, &|| false, false)
    }

    /// [`InventoryIndex::lookup`] for a request that can be cancelled while
    /// the lookup runs: `cancelled` is asked before the first probe and at
    /// every clock check (each [`CLOCK_CHECK_INTERVAL`] work units); once it
    /// returns true the walk stops and `donor` is
    /// [`NoDonorReason::Cancelled`], so nothing is proposed for a request
    /// nobody waits for. Costs one call per clock check. `cancelled` runs
    /// while the lookup holds its copy of the index: it must not call a
    /// mutating method of this index (a writer that waits for that copy
    /// would wait forever); [`InventoryIndex::holds`] is safe there (it
    /// falls back to the published copy when the writer lock stays taken).
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
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use kv_lookup::NoDonorReason;
    /// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
    /// index.register_worker(WorkerKey(1), d)?;
    /// index.register_worker(WorkerKey(2), p)?;
    /// index.apply_event(&event(&d, 1, StorageTier::RetainedGpuDirect, stored(4)))?;
    /// // Set by whoever learns that the client went away (another thread in practice).
    /// let gone = AtomicBool::new(false);
    /// let is_gone = || gone.load(Ordering::Relaxed);
    /// let out = index.lookup_cancellable(&hashes, p.engine, LookupBudget::default(), &is_gone);
    /// assert_eq!(out.donor.unwrap().blocks, 4);
    /// gone.store(true, Ordering::Relaxed);
    /// let out = index.lookup_cancellable(&hashes, p.engine, LookupBudget::default(), &is_gone);
    /// // Asked before the first probe: nothing walked, no donor proposed.
    /// assert_eq!(out.donor, Err(NoDonorReason::Cancelled { probes: 0 }));
    /// assert!(!out.budget_exhausted); // cancelled, not out of budget
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn lookup_cancellable(
        &self,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
        budget: LookupBudget,
        cancelled: &dyn Fn() -> bool,
    ) -> LookupOutcome {
        self.lookup_inner(sequence_hashes, target, budget, cancelled, true)
    }

    fn lookup_inner(
        &self,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
        budget: LookupBudget,
        cancelled: &dyn Fn() -> bool,
        cancellable: bool,
    ) -> LookupOutcome {
        let start = Instant::now();
        let mut outcome = LookupOutcome {
            donor: Err(NoDonorReason::EmptyRequest),
            baseline: TargetBaseline::default(),
            budget_exhausted: false,
            probes: 0,
            elapsed: Duration::ZERO,
        };
        if sequence_hashes.is_empty() {
            outcome.elapsed = start.elapsed();
            return outcome;
        }
        // The published copy, without a lock: no writer can delay it, so the
        // clock read at `start` is still fresh and the first clock check can
        // wait a full interval (with no time at all, check at once).
        let state = self.state.read();
        // A cancellable lookup asks before its first probe, too.
        let check_now = budget.time.is_zero() || cancellable;
        let mut meter = Meter {
            probes: 0,
            max_probes: budget.max_probes,
            deadline: start + budget.time,
            units: 0,
            next_check: if check_now { 0 } else { CLOCK_CHECK_INTERVAL },
            exhausted: false,
            cancelled,
            was_cancelled: false,
        };
        outcome.donor = lookup_locked(
            &state,
            sequence_hashes,
            target,
            &mut meter,
            &mut outcome.baseline,
        );
        drop(state);
        outcome.budget_exhausted = meter.exhausted && !meter.was_cancelled;
        outcome.probes = meter.probes;
        if meter.was_cancelled {
            outcome.donor = Err(NoDonorReason::Cancelled {
                probes: meter.probes,
            });
        }
        outcome.elapsed = start.elapsed();
        outcome
    }
}

fn lookup_locked(
    st: &State,
    hashes: &[SequenceHash],
    target: EngineId,
    meter: &mut Meter<'_>,
    baseline: &mut TargetBaseline,
) -> Result<DonorMatch, NoDonorReason> {
    // The first index probe of every group is a likely DRAM miss on the
    // slot of the root hash: start it now, so that it overlaps the target's
    // map lookup and donor-mask search instead of following them.
    for table in &st.groups {
        table.prefetch(hashes[0]);
    }
    let Some(&target_slot) = st.by_engine.get(&target) else {
        return Err(NoDonorReason::UnknownTarget(target));
    };
    let info = st.workers[target_slot as usize]
        .as_ref()
        .expect("slot of a live engine")
        .info;
    if info.role != Role::Prefill {
        return Err(NoDonorReason::TargetNotPrefill(target, info.role));
    }
    let donors = st
        .donor_masks
        .iter()
        .find(|m| m.fingerprint == info.layout_fingerprint && m.tp_size == info.tp_size);
    let (target_group, target_bit) = split(target_slot);
    let mut best: Option<(usize, u64, u32)> = None; // (group, donor bits, blocks)
    let mut tied = 0u32;
    for (g, table) in st.groups.iter().enumerate() {
        let donor_bits = donors.and_then(|m| m.groups.get(g).copied()).unwrap_or(0);
        let target_bits = if g == target_group {
            1u64 << target_bit
        } else {
            0
        };
        if donor_bits | target_bits == 0 {
            continue;
        }
        let w = walk_group(table, hashes, donor_bits, target_bits, meter);
        if g == target_group {
            baseline.native_blocks = w.native_blocks;
            baseline.retained_blocks = w.retained_blocks;
        }
        if w.best != 0 {
            match best {
                Some((_, _, b)) if b > w.best_blocks => {}
                Some((_, _, b)) if b == w.best_blocks => tied += w.best.count_ones(),
                _ => {
                    best = Some((g, w.best, w.best_blocks));
                    tied = w.best.count_ones();
                }
            }
        }
        if meter.exhausted {
            break;
        }
    }
    let Some((g, bits, blocks)) = best.filter(|b| b.2 > 0) else {
        return Err(if meter.exhausted {
            NoDonorReason::BudgetExhausted {
                probes: meter.probes,
            }
        } else if donors.is_none_or(|m| m.groups.iter().all(|&b| b == 0)) {
            NoDonorReason::NoCompatibleDonor
        } else {
            NoDonorReason::NoRootCoverage
        });
    };
    if blocks <= baseline.blocks() {
        return Err(if meter.exhausted {
            NoDonorReason::BudgetExhausted {
                probes: meter.probes,
            }
        } else {
            NoDonorReason::NotBeyondBaseline {
                donor_blocks: blocks,
                baseline_blocks: baseline.blocks(),
            }
        });
    }
    // Spread ties over donors, stably per prefix.
    let pick = nth_set_bit(bits, (hashes[0].0 % u64::from(bits.count_ones())) as u32);
    let slot = (g * crate::index::GROUP_WIDTH) as u32 + pick;
    let rec = st.workers[slot as usize]
        .as_ref()
        .expect("donor bit of a live worker");
    Ok(DonorMatch {
        engine: rec.info.engine,
        worker: rec.key,
        blocks,
        tied,
    })
}

#[cfg(test)]
mod tests;
