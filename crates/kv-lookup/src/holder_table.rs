//! The holder table: sequence hash -> which of up to 64 workers hold it, per tier.
//!
//! One table serves one *worker group* (worker slots `64g .. 64g + 63`), so a
//! holder set is one `u64` bitset per tier and a donor walk is a chain of
//! `AND`s.
//!
//! Layout, chosen for the donor walk: entries (hash + tier bitsets) live in
//! *runs*, arrays filled in the order in which a Stored event announced new
//! blocks, i.e. in chain order. A walk that found block `i` at `(r, o)`
//! first checks `(r, o + 1)` for block `i + 1`: consecutive blocks of a
//! stored conversation are adjacent in memory, so a walk reads memory
//! sequentially and only goes through an index (a random access,
//! prefetched) where a run ends. This is what a compressed radix tree
//! gains from its edges, without a tree to keep balanced.
//!
//! Entry points: the table's own index (what lookups probe) maps only the
//! hashes a walk cannot reach by reading on. An entry *follows* when the
//! entry right before it in its run is its parent's and is live; every
//! other live entry is an *entry point* and is indexed. A walk at block
//! `i - 1` (a live entry `E`) that looks for block `i`: if block `i`'s
//! entry follows, the entry before it is its parent's, and a hash has one
//! entry, so that is `E` and block `i` is at `E + 1`; otherwise it is
//! indexed. So "next entry, else the entry-point index" finds every live
//! entry a per-hash index would, with an index of about one key per stored
//! turn instead of one per block (it stays in cache). A new entry follows
//! only when the Stored event appended its parent right before it; when an
//! entry dies, its live successor becomes an entry point
//! ([`HolderTable::finish_clears`]); compaction keeps each follower right
//! after its (live) parent.
//!
//! The full map, hash -> entry for every live entry, is what event
//! application needs (is this hash new, where is the entry a removal
//! clears). It is not part of the table: both copies of the index keep
//! their runs in the same layout, so one map on the writer's side serves
//! both ([`Locator`]; `crate::index::WriterMaps`).
//!
//! Chunks: each run is cut into [`CHUNK`]-entry chunks at offsets that are
//! multiples of [`CHUNK`], and each chunk keeps a summary: the `AND` of its
//! entries' hot bitsets if the run is *ordered*, zero otherwise. A run is
//! ordered when the Stored event that filled it passed its chain check:
//! its blocks are one chain, so every entry is an ancestor of every later
//! entry. Consecutive entries are not always parent and child (the event
//! appends only hashes new to the table, so a block another worker already
//! holds leaves a hole, and compaction drops dead entries from between
//! live ones), and the skip does not need them to be; compaction keeps the
//! order, so an ordered run stays ordered. A resync's unchecked list makes
//! a run that is not ordered. A walk that finds nobody it follows missing
//! from a summary and the chunk's last key equal to the request's hash at
//! that position takes the whole chunk with one compare (see `walk_group`
//! in `lookup.rs` for why that suffices).
//!
//! Invariants:
//! - Every hash with at least one holder bit has exactly one entry, and the
//!   writer's full map points at it; the entry-point index holds exactly
//!   the live entries that do not follow (see above). An entry whose last
//!   bit is cleared leaves both at once (backward-shift deletion, no
//!   tombstones); its run position stays with all bits zero (*dead*) and a
//!   walk never trusts a dead position.
//! - A run whose entries are all dead is freed and its id reused; a run of
//!   at least 64 entries with under a quarter live is compacted into a fresh
//!   run (at the end of the removal that left it so:
//!   [`HolderTable::finish_clears`]), so dead entries cost at most 3x the live ones (plus short runs).
//! - Each index's load factor stays at or below 3/4.
//! - A chunk summary never claims a bit that one of its entries lacks, and
//!   is zero in a run that is not ordered. A summary may lag *below* the true `AND` while a Stored event is
//!   applied (bits set on entries that already existed); [`HolderTable::close_run`]
//!   recomputes those chunks, and a low summary only costs a skip.

use kv_descriptor::{SequenceHash, StorageTier};

use crate::prefetch::prefetch_read;

#[cfg(test)]
mod checks;
mod loc_index;
mod run;

pub(crate) use loc_index::{Loc, LocIndex, Locator};
use run::Run;

/// Number of storage tiers the index distinguishes.
pub(crate) const TIERS: usize = 5;

/// Index of a tier in a slot's bitset array.
///
/// The order is fixed and private; [`StorageTier`] has exactly these five
/// values (an unknown tier fails to decode before it reaches the index).
#[inline]
pub(crate) const fn tier_index(tier: StorageTier) -> usize {
    match tier {
        StorageTier::Device => 0,
        StorageTier::HostPinned => 1,
        StorageTier::Disk => 2,
        StorageTier::External => 3,
        StorageTier::RetainedGpuDirect => 4,
    }
}

/// All tiers, in [`tier_index`] order.
pub(crate) const ALL_TIERS: [StorageTier; TIERS] = [
    StorageTier::Device,
    StorageTier::HostPinned,
    StorageTier::Disk,
    StorageTier::External,
    StorageTier::RetainedGpuDirect,
];

/// Tier bitsets of one sequence hash: bit `w` of `bits[t]` means worker
/// `w` of the group holds the block in tier `t`.
pub(crate) type TierBits = [u64; TIERS];

const NO_BITS: TierBits = [0; TIERS];

/// How far ahead (in hashes) a replay prefetches entries (it knows where
/// they are from the first application's answers).
pub(crate) const PREFETCH_DISTANCE: usize = 12;

/// How far ahead (in hashes) a first application prefetches slots of the
/// writer's full map.
pub(crate) const SLOT_PREFETCH_DISTANCE: usize = 32;

/// Entries per chunk summary (see the module docs). 32 entries are 768
/// bytes of hot entries: a walk that enters a run at a random offset walks
/// at most 31 blocks one by one before it can skip, and one holder dropping
/// out costs at most 32 per-block steps.
pub(crate) const CHUNK: usize = 32;

/// What a donor walk reads of one entry: its key and the two tiers a
/// lookup needs, 24 bytes, so a walk streams one array.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct HotEntry {
    /// Sequence hash.
    pub(crate) key: u64,
    /// `[device, retained]` bitsets (see [`HOT_DEVICE`], [`HOT_RETAINED`]).
    pub(crate) bits: [u64; 2],
}

/// Position of `tier` in a run: `(is_hot, index)`.
#[inline]
const fn place(tier: usize) -> (bool, usize) {
    match tier {
        0 => (true, HOT_DEVICE),
        4 => (true, HOT_RETAINED),
        t => (false, t - 1),
    }
}

/// Index of the device tier in a walk step's result.
pub(crate) const HOT_DEVICE: usize = 0;
/// Index of the retained tier in a walk step's result.
pub(crate) const HOT_RETAINED: usize = 1;

/// Runs shorter than this are never compacted (not worth the moves).
const COMPACT_MIN_LEN: usize = 64;

/// Hash -> tier bitsets of one worker group (see the module docs).
pub(crate) struct HolderTable {
    /// Hash -> entry, for the entries a walk cannot reach by reading on
    /// from its parent's entry (see the module docs, "Entry points").
    entry_points: LocIndex,
    /// Entries with at least one holder bit.
    len: usize,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// Run that new entries of the current Stored event append to.
    open_run: Option<u32>,
    /// Whether the last [`Self::set_with_room`] of the current Stored event
    /// appended a new entry (so the next new entry sits right after it).
    appended_last: bool,
    /// `(run, chunk)` whose summary `set` may have left below the
    /// true `AND`; recomputed by [`Self::close_run`].
    stale: Vec<(u32, u32)>,
    /// Runs that [`Self::clear_deferring`] left under a quarter live, to be
    /// compacted by [`Self::finish_clears`] unless they died first.
    sparse: Vec<u32>,
    /// Entries that [`Self::clear_deferring`] killed since the last
    /// [`Self::finish_clears`], whose successors may need to become entry
    /// points.
    deaths: Vec<Loc>,
    /// The full map of a table used on its own (unit tests): what the
    /// index keeps once on the writer's side.
    #[cfg(test)]
    pub(crate) test_map: LocIndex,
}

impl HolderTable {
    /// A table that holds `expected` entries without growing much.
    pub(crate) fn with_capacity(expected: usize) -> Self {
        Self {
            // Most entries follow their parent in a run; entry points are
            // about one per stored turn.
            entry_points: LocIndex::with_capacity(expected / 8),
            len: 0,
            runs: Vec::new(),
            free_runs: Vec::new(),
            open_run: None,
            appended_last: false,
            stale: Vec::new(),
            sparse: Vec::new(),
            deaths: Vec::new(),
            #[cfg(test)]
            test_map: LocIndex::with_capacity(expected),
        }
    }

    /// Number of sequence hashes with at least one holder.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Entry points indexed (see the module docs).
    #[cfg(test)]
    pub(crate) fn entry_points(&self) -> usize {
        self.entry_points.len()
    }

    /// Bytes of the entry-point index and the runs' entries (capacity, not
    /// just use); the writer's full map is counted by its owner.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.entry_points.memory_bytes()
            + self
                .runs
                .iter()
                .map(|r| {
                    r.hot.capacity() * 24
                        + r.cold.capacity() * 24
                        + r.sums.capacity() * 16
                        + r.points.capacity() * 8
                })
                .sum::<usize>()
    }

    /// Asks the CPU to load the entry-point slot of `hash` (a walk's next
    /// index probe; see [`prefetch_read`]).
    #[inline]
    pub(crate) fn prefetch(&self, hash: SequenceHash) {
        self.entry_points.prefetch(hash.0);
    }

    #[inline]
    fn prefetch_loc(&self, loc: Loc) {
        if let Some(r) = self.runs.get(loc.run as usize) {
            prefetch_read(r.hot.as_ptr().wrapping_add(loc.off as usize));
        }
    }

    /// Prefetches for a pass that handles `hashes` in order, called before
    /// it handles `hashes[i]`, where each hash asks `locator` once: on the
    /// map, the slot of `hashes[i + SLOT_PREFETCH_DISTANCE]`; on a replay,
    /// the entry of `hashes[i + PREFETCH_DISTANCE]` from the logged answer
    /// (at `i == 0` also everything nearer, so the first hashes do not
    /// start cold).
    ///
    /// The map's pass prefetches no entries: finding one reads its map
    /// slot, a demand load that waited for the slot's miss when the slot
    /// prefetch was late (~1/5 of the event thread in `perf record` of the
    /// churn bench); a pass over a chain reads entries in run order, which
    /// the hardware prefetcher follows, and the replay prefetches its own.
    #[inline]
    pub(crate) fn prefetch_pass(&self, locator: &Locator<'_>, hashes: &[SequenceHash], i: usize) {
        let entry = |k: usize| {
            if let Some(loc) = locator.peek(k) {
                self.prefetch_loc(loc);
            }
        };
        if i == 0 {
            for &h in hashes.iter().take(SLOT_PREFETCH_DISTANCE) {
                locator.prefetch(h.0);
            }
            for k in 0..PREFETCH_DISTANCE.min(hashes.len()) {
                entry(k);
            }
        }
        if let Some(&h) = hashes.get(i + SLOT_PREFETCH_DISTANCE) {
            locator.prefetch(h.0);
        }
        entry(PREFETCH_DISTANCE);
    }

    /// Tier bitsets of `hash` (one answer of `locator`), or all zero when
    /// no worker of the group holds it.
    pub(crate) fn get(&self, locator: &mut Locator<'_>, hash: SequenceHash) -> TierBits {
        self.bits_at(locator.find(hash.0), hash)
    }

    /// [`Self::get`] through the writer's full map, read only.
    pub(crate) fn get_in(&self, map: &LocIndex, hash: SequenceHash) -> TierBits {
        self.bits_at(map.get(hash.0), hash)
    }

    fn bits_at(&self, loc: Option<Loc>, hash: SequenceHash) -> TierBits {
        match loc {
            Some(loc) => {
                let r = &self.runs[loc.run as usize];
                debug_assert_eq!(r.hot[loc.off as usize].key, hash.0, "map and runs agree");
                r.bits(loc.off as usize)
            }
            None => NO_BITS,
        }
    }

    /// Tier bitsets of `hash` found by scanning every run for its live
    /// entry, without any map: time linear in the table's entries (a 1M
    /// block table is ~24 MiB of hot entries). For readers of a copy that
    /// cannot take the writer's map ([`crate::InventoryIndex::holds`]), and
    /// tests that compare copies as they are.
    pub(crate) fn bits_by_scan(&self, hash: SequenceHash) -> TierBits {
        for r in &self.runs {
            for (off, e) in r.hot.iter().enumerate() {
                if e.key == hash.0 && r.is_live(off) {
                    return r.bits(off);
                }
            }
        }
        NO_BITS
    }

    /// Entry of `hash` through the entry-point index, with its `[device,
    /// retained]` bitsets; `None` when `hash` is not an entry point (then
    /// no worker of the group holds it, or its entry follows its parent's:
    /// see the module docs).
    #[inline]
    pub(crate) fn locate(&self, hash: SequenceHash) -> Option<(Loc, [u64; 2])> {
        let loc = self.entry_points.get(hash.0)?;
        Some((loc, self.runs[loc.run as usize].hot[loc.off as usize].bits))
    }

    /// Hot entries that follow `loc` in its run: the likely next blocks of
    /// a walk, in memory order.
    ///
    /// A key match there is the hash's unique entry only if the entry is
    /// live; an entry whose hot bits are both zero may be dead (and the hash
    /// re-stored elsewhere), so the caller must then ask [`Self::locate`].
    #[inline]
    pub(crate) fn after(&self, loc: Loc) -> &[HotEntry] {
        &self.runs[loc.run as usize].hot[loc.off as usize + 1..]
    }

    /// The whole chunks of [`Self::after`]`(loc)`: `(skew, sums)`, where
    /// `after(loc)[skew + j * CHUNK ..][..CHUNK]` is the chunk summarized by
    /// `sums[j]` (a summary is zero for a chunk that is not chained; see the
    /// module docs). The run's last, partial chunk is left out.
    #[inline]
    pub(crate) fn chunks_after(&self, loc: Loc) -> (usize, &[[u64; 2]]) {
        let r = &self.runs[loc.run as usize];
        let next = loc.off as usize + 1;
        let first = next.div_ceil(CHUNK);
        let whole = r.hot.len() / CHUNK;
        (first * CHUNK - next, &r.sums[first.min(whole)..whole])
    }

    /// Ends the current Stored event: its new entries stop sharing a run
    /// with the next event's.
    /// Trims the run's room if [`Self::set_with_room`] reserved much more
    /// than the event appended (most of its hashes existed already).
    pub(crate) fn close_run(&mut self) {
        self.appended_last = false;
        if let Some(r) = self.open_run.take() {
            let r = &mut self.runs[r as usize];
            if r.hot.capacity() > r.hot.len() + r.hot.len() / 4 + 4 {
                r.hot.shrink_to_fit();
                r.sums.shrink_to_fit();
            }
        }
        self.resum_stale();
    }

    /// Recomputes the chunk summaries that `set` left low: once per
    /// chunk and event, not once per bit (an event that re-stores a prefix
    /// another worker holds sets a bit in every entry of its chunks).
    fn resum_stale(&mut self) {
        if self.stale.is_empty() {
            return;
        }
        self.stale.sort_unstable();
        self.stale.dedup();
        for &(run, c) in &self.stale {
            // Recomputing is exact, so a chunk whose run was freed or
            // reused since it was listed is still summarized correctly.
            if let Some(r) = self.runs.get_mut(run as usize) {
                if (c as usize) < r.sums.len() {
                    r.resum(c as usize);
                }
            }
        }
        self.stale.clear();
    }

    /// Sets bit `bit` of tier `tier` for `hash`; returns true if it was clear.
    /// A new hash is appended to the open run (one run per Stored event).
    /// `chained`: the caller proved that the hashes it sets between two
    /// [`Self::close_run`] calls are one chain, in chain order (a Stored
    /// event that passed its chain check), so the run is ordered.
    /// `follows`: `hash`'s parent is the hash of the previous call of this
    /// event (chained and not the event's first block); a new entry
    /// appended right after its parent's is no entry point.
    /// `room`: hashes the event has left, this one included; a run this
    /// call opens reserves room for all of them at once instead of growing
    /// by doubling (five reallocations and copies for a 64-block event, in
    /// each copy of the state); [`Self::close_run`] trims it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn set_with_room(
        &mut self,
        locator: &mut Locator<'_>,
        hash: SequenceHash,
        tier: usize,
        bit: u32,
        chained: bool,
        follows: bool,
        room: usize,
    ) -> bool {
        let flag = 1u64 << bit;
        if let Some(loc) = locator.find(hash.0) {
            self.appended_last = false;
            let r = &mut self.runs[loc.run as usize];
            debug_assert_eq!(r.hot[loc.off as usize].key, hash.0, "map and runs agree");
            let w = r.word(loc.off as usize, tier);
            let was_clear = *w & flag == 0;
            *w |= flag;
            if was_clear && place(tier).0 && r.ordered {
                // The chunk's `AND` may now have this bit: recompute it at
                // `close_run`. Consecutive blocks share a chunk.
                let key = (loc.run, loc.off / CHUNK as u32);
                if self.stale.last() != Some(&key) {
                    self.stale.push(key);
                }
            }
            return was_clear;
        }
        let run = match self.open_run {
            Some(r) => r,
            None => {
                let r = self.new_run_id();
                self.open_run = Some(r);
                let run = &mut self.runs[r as usize];
                run.ordered = chained;
                run.hot.reserve_exact(room);
                run.sums.reserve_exact(room.div_ceil(CHUNK));
                r
            }
        };
        let r = &mut self.runs[run as usize];
        if r.ordered && !chained {
            // Not reached through `store` (one kind of hash list per run),
            // but an unproven entry must not join an ordered run's skips.
            r.ordered = false;
            r.sums.fill([0; 2]);
        }
        let loc = Loc {
            run,
            off: r.hot.len() as u32,
        };
        let mut e = HotEntry {
            key: hash.0,
            bits: [0; 2],
        };
        if let (true, i) = place(tier) {
            e.bits[i] = flag;
        }
        r.push(e);
        if !r.cold.is_empty() {
            r.cold.push([0; 3]);
        }
        *r.word(loc.off as usize, tier) = flag;
        r.live += 1;
        locator.inserted(hash.0, loc);
        // The entry before it in the run is its parent's only if this
        // event appended both, one right after the other.
        if !(follows && self.appended_last) {
            r.set_point(loc.off as usize, true);
            self.entry_points.insert_new(hash.0, loc);
        }
        self.appended_last = true;
        self.len += 1;
        true
    }

    /// Clears bit `bit` of tier `tier` for `hash`; returns true if it was set.
    /// The entry dies when its last bit goes.
    ///
    /// A run it leaves under a quarter live is only noted, and so is the
    /// entry point an entry's death may make of its successor: both for
    /// [`Self::finish_clears`] (call it before the table is published). A
    /// removal of a whole chain clears its run in order, so compacting at
    /// the crossing moved the last quarter of the run into a fresh one (an
    /// allocation and an index update per entry) just before the same
    /// event killed it; deferred, the run dies first and is freed.
    pub(crate) fn clear_deferring(
        &mut self,
        locator: &mut Locator<'_>,
        hash: SequenceHash,
        tier: usize,
        bit: u32,
    ) -> bool {
        let flag = 1u64 << bit;
        let Some(loc) = locator.find(hash.0) else {
            return false;
        };
        let (run_id, off) = (loc.run as usize, loc.off as usize);
        debug_assert_eq!(self.runs[run_id].hot[off].key, hash.0, "map and runs agree");
        if !self.runs[run_id].test(off, tier, flag) {
            return false;
        }
        let r = &mut self.runs[run_id];
        *r.word(off, tier) &= !flag;
        if let (true, i) = place(tier) {
            // Keeps the summary at or below the chunk's true `AND`.
            r.sums[off / CHUNK][i] &= !flag;
        }
        if !self.runs[run_id].is_live(off) {
            self.len -= 1;
            locator.removed(hash.0);
            let r = &mut self.runs[run_id];
            if r.is_point(off) {
                r.set_point(off, false);
                self.entry_points.remove(hash.0);
            }
            r.live -= 1;
            if r.live == 0 {
                *r = Run::default();
                self.free_runs.push(loc.run);
                if self.open_run == Some(loc.run) {
                    self.open_run = None;
                }
            } else {
                self.deaths.push(loc);
                if Self::is_sparse(r) && self.sparse.last() != Some(&loc.run) {
                    self.sparse.push(loc.run);
                }
            }
        }
        true
    }

    /// The id of an empty run: a freed one, else a new one.
    fn new_run_id(&mut self) -> u32 {
        self.free_runs.pop().unwrap_or_else(|| {
            self.runs.push(Run::default());
            (self.runs.len() - 1) as u32
        })
    }

    /// Whether `r` is long enough and under a quarter live, so compacted.
    fn is_sparse(r: &Run) -> bool {
        r.hot.len() >= COMPACT_MIN_LEN && (r.live as usize) * 4 < r.hot.len()
    }

    /// Finishes the clears since the last call: makes an entry point of
    /// each live entry whose predecessor died (a walk can no longer reach
    /// it from there), then compacts the runs [`Self::clear_deferring`]
    /// noted that are still sparse (alive, under a quarter live).
    ///
    /// Deaths are handled before any compaction, so no run was freed and
    /// reused since they were noted: a noted run is the one that was there,
    /// or was freed (empty: nothing to do).
    pub(crate) fn finish_clears(&mut self, locator: &mut Locator<'_>) {
        let mut deaths = std::mem::take(&mut self.deaths);
        for &d in &deaths {
            let next = d.off as usize + 1;
            let r = &mut self.runs[d.run as usize];
            if next < r.hot.len() && r.is_live(next) && !r.is_point(next) {
                r.set_point(next, true);
                self.entry_points.insert_new(r.hot[next].key, d.advanced(1));
            }
        }
        deaths.clear();
        self.deaths = deaths;
        let mut sparse = std::mem::take(&mut self.sparse);
        for &r in &sparse {
            let run = &self.runs[r as usize];
            if run.live > 0 && Self::is_sparse(run) {
                self.compact_run(locator, r);
            }
        }
        sparse.clear();
        // Keeps the buffer: no allocation per removal event.
        self.sparse = sparse;
    }

    /// Moves the live entries of a mostly dead run into a fresh run (order
    /// kept, so walks stay sequential) and frees the old one. Without this
    /// one long-lived block would keep its whole run's memory. Costs the
    /// run's length, paid for by the 3/4 of it that died since it was built.
    ///
    /// An entry that followed its parent still does: the parent was live,
    /// right before it, and stays right before it.
    fn compact_run(&mut self, locator: &mut Locator<'_>, old: u32) {
        let taken = std::mem::take(&mut self.runs[old as usize]);
        if self.open_run == Some(old) {
            self.open_run = None;
        }
        let new = self.new_run_id();
        let mut fresh = Run {
            hot: Vec::with_capacity(taken.live as usize),
            cold: Vec::new(),
            // A subsequence of an ordered run is ordered.
            ordered: taken.ordered,
            sums: Vec::new(),
            live: taken.live,
            points: Vec::new(),
        };
        for (off, h) in taken.hot.iter().enumerate() {
            if !taken.is_live(off) {
                continue;
            }
            let (was, now) = (
                Loc {
                    run: old,
                    off: off as u32,
                },
                Loc {
                    run: new,
                    off: fresh.hot.len() as u32,
                },
            );
            debug_assert!(locator.map().is_none_or(|m| m.get(h.key) == Some(was)));
            locator.moved(h.key, now);
            fresh.push(*h);
            if taken.is_point(off) {
                fresh.set_point(now.off as usize, true);
                self.entry_points.set_loc(h.key, now);
            }
            if !taken.cold.is_empty() {
                fresh.cold.push(taken.cold[off]);
            }
        }
        self.runs[new as usize] = fresh;
        self.free_runs.push(old);
    }
}

#[cfg(test)]
mod tests;
