//! The holder table: sequence hash -> which of up to 64 workers hold it, per tier.
//!
//! One table serves one *worker group* (worker slots `64g .. 64g + 63`), so a
//! holder set is one `u64` bitset per tier and a donor walk is a chain of
//! `AND`s.
//!
//! Layout, chosen for the donor walk: entries (hash + tier bitsets) live in
//! *runs*, arrays filled in the order in which a Stored event announced new
//! blocks, i.e. in chain order. A small open-addressing index maps a hash to
//! its entry (`run`, `offset`). A walk that found block `i` at `(r, o)` first
//! checks `(r, o + 1)` for block `i + 1`: consecutive blocks of a stored
//! conversation are adjacent in memory, so a walk reads memory sequentially and
//! only goes through the index (a random access, prefetched) where a run
//! ends. This is what a compressed radix tree gains from its edges, without a
//! tree to keep balanced.
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
//!   index points at it. An entry whose last bit is cleared leaves the index
//!   at once (backward-shift deletion, no tombstones); its run position stays
//!   with all bits zero (*dead*) and a walk never trusts a dead position.
//! - A run whose entries are all dead is freed and its id reused; a run of
//!   at least 64 entries with under a quarter live is compacted into a fresh
//!   run (at the end of the removal that left it so:
//!   [`HolderTable::finish_clears`]), so dead entries cost at most 3x the live ones (plus short runs).
//! - The index's load factor stays at or below 3/4.
//! - A chunk summary never claims a bit that one of its entries lacks, and
//!   is zero in a run that is not ordered. A summary may lag *below* the true `AND` while a Stored event is
//!   applied (bits set on entries that already existed); [`HolderTable::close_run`]
//!   recomputes those chunks, and a low summary only costs a skip.

use kv_descriptor::{SequenceHash, StorageTier};

use crate::prefetch::prefetch_read;

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

/// How far ahead (in hashes) event application prefetches entries.
/// Entry prefetches read the hash's index slot, so slots are prefetched
/// further ahead ([`SLOT_PREFETCH_DISTANCE`]) for the slot to be cached by
/// then: with the slot only 16 hashes ahead, the entry prefetch waited for
/// the slot's miss and was ~3/4 of the event thread's time in a
/// `perf record` of the churn bench (removals of cold chains).
pub(crate) const PREFETCH_DISTANCE: usize = 12;

/// How far ahead (in hashes) event application prefetches index slots.
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

/// Entries in the order a Stored event announced them, as parallel arrays:
/// `hot` is all a walk touches, `cold` holds the tiers lookups never read.
#[derive(Default)]
struct Run {
    hot: Vec<HotEntry>,
    /// `[host_pinned, disk, external]` bitsets; empty until the run's first
    /// cold bit (most runs never get one), then as long as `hot`.
    cold: Vec<[u64; 3]>,
    /// Filled by one Stored event that passed its chain check: each entry
    /// is an ancestor of every later one (see the module docs).
    ordered: bool,
    /// Per chunk (entries `c * CHUNK ..`, the last one possibly partial):
    /// the `AND` of the hot bits if the run is ordered, else zero. Never
    /// above the true value (see the module docs).
    sums: Vec<[u64; 2]>,
    /// Entries with a non-zero bit.
    live: u32,
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

impl Run {
    /// The bitset word of `tier` at `off`, materializing `cold` if needed.
    #[inline]
    fn word(&mut self, off: usize, tier: usize) -> &mut u64 {
        match place(tier) {
            (true, i) => &mut self.hot[off].bits[i],
            (false, i) => {
                if self.cold.is_empty() {
                    self.cold.resize(self.hot.len(), [0; 3]);
                }
                &mut self.cold[off][i]
            }
        }
    }

    #[inline]
    fn cold_at(&self, off: usize) -> [u64; 3] {
        self.cold.get(off).copied().unwrap_or([0; 3])
    }

    #[inline]
    fn test(&self, off: usize, tier: usize, flag: u64) -> bool {
        match place(tier) {
            (true, i) => self.hot[off].bits[i] & flag != 0,
            (false, i) => self.cold_at(off)[i] & flag != 0,
        }
    }

    /// Reads `cold` only when the hot bits are zero and the run has cold
    /// bits at all: removing a block usually touches one cache line.
    #[inline]
    fn is_live(&self, off: usize) -> bool {
        self.hot[off].bits != [0; 2] || self.cold_at(off) != [0; 3]
    }

    fn bits(&self, off: usize) -> TierBits {
        let (h, c) = (self.hot[off].bits, self.cold_at(off));
        [h[HOT_DEVICE], c[0], c[1], c[2], h[HOT_RETAINED]]
    }

    /// Appends `e` (a `cold` slot, if any, is the caller's), keeping the
    /// last chunk's summary exact: `AND` in the new bits.
    #[inline]
    fn push(&mut self, e: HotEntry) {
        let off = self.hot.len();
        self.hot.push(e);
        if off % CHUNK == 0 {
            self.sums.push(if self.ordered { e.bits } else { [0; 2] });
        } else {
            let s = self.sums.last_mut().expect("a chunk per CHUNK entries");
            *s = [s[0] & e.bits[0], s[1] & e.bits[1]];
        }
    }

    /// Recomputes the summary of chunk `c` from its entries (exact).
    fn resum(&mut self, c: usize) {
        let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(self.hot.len()));
        let mut s = [if self.ordered { u64::MAX } else { 0 }; 2];
        for e in &self.hot[lo..hi] {
            s = [s[0] & e.bits[0], s[1] & e.bits[1]];
        }
        self.sums[c] = s;
    }
}

/// Where an entry lives.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Loc {
    run: u32,
    off: u32,
}

impl Loc {
    /// The entry `k` places further in the same run.
    #[inline]
    pub(crate) fn advanced(self, k: usize) -> Loc {
        Loc {
            run: self.run,
            off: self.off + k as u32,
        }
    }
}

/// Index slot: hash -> entry location; `run == EMPTY` marks a free slot.
#[derive(Clone, Copy)]
struct Slot {
    key: u64,
    loc: Loc,
}

const EMPTY: u32 = u32::MAX;
const FREE_SLOT: Slot = Slot {
    key: 0,
    loc: Loc { run: EMPTY, off: 0 },
};

/// Runs shorter than this are never compacted (not worth the moves).
const COMPACT_MIN_LEN: usize = 64;

/// Smallest index capacity (slots); a power of two.
const MIN_CAPACITY: usize = 1024;

/// Fibonacci-hashing multiplier (2^64 / golden ratio). Sequence hashes are
/// already XXH3 outputs, but tests and callers also use small integers; the
/// multiply spreads those over the index, and taking the top bits keeps the
/// best-mixed part.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// Hash -> tier bitsets of one worker group (see the module docs).
pub(crate) struct HolderTable {
    slots: Vec<Slot>,
    /// `capacity - 1`.
    mask: usize,
    /// `64 - log2(capacity)`.
    shift: u32,
    len: usize,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// Run that new entries of the current Stored event append to.
    open_run: Option<u32>,
    /// `(run, chunk)` whose summary `set` may have left below the
    /// true `AND`; recomputed by [`Self::close_run`].
    stale: Vec<(u32, u32)>,
    /// Runs that [`Self::clear_deferring`] left under a quarter live, to be
    /// compacted by [`Self::finish_clears`] unless they died first.
    sparse: Vec<u32>,
}

impl HolderTable {
    /// A table that holds `expected` entries without rehashing its index.
    pub(crate) fn with_capacity(expected: usize) -> Self {
        let want = expected.saturating_mul(4) / 3 + 1;
        let cap = want.next_power_of_two().max(MIN_CAPACITY);
        Self {
            slots: vec![FREE_SLOT; cap],
            mask: cap - 1,
            shift: 64 - cap.trailing_zeros(),
            len: 0,
            runs: Vec::new(),
            free_runs: Vec::new(),
            open_run: None,
            stale: Vec::new(),
            sparse: Vec::new(),
        }
    }

    /// Number of sequence hashes with at least one holder.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the index and the runs' entries (capacity, not just use).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
            + self
                .runs
                .iter()
                .map(|r| r.hot.capacity() * 24 + r.cold.capacity() * 24 + r.sums.capacity() * 16)
                .sum::<usize>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(SPREAD) >> self.shift) as usize
    }

    /// Asks the CPU to load the index slot of `hash` (see [`prefetch_read`]).
    #[inline]
    pub(crate) fn prefetch(&self, hash: SequenceHash) {
        let i = self.home(hash.0);
        prefetch_read(self.slots.as_ptr().wrapping_add(i));
    }

    /// Asks the CPU to load the entry of `hash`, if it exists. Reads the
    /// index slot (call [`Self::prefetch`] for it some time before), so it
    /// is the second stage of a two-stage prefetch.
    #[inline]
    pub(crate) fn prefetch_entry(&self, hash: SequenceHash) {
        if let Some(i) = self.find(hash.0) {
            let loc = self.slots[i].loc;
            prefetch_read(
                self.runs[loc.run as usize]
                    .hot
                    .as_ptr()
                    .wrapping_add(loc.off as usize),
            );
        }
    }

    /// Prefetches for a pass that handles `hashes` in order, called before
    /// it handles `hashes[i]`: the slot of `hashes[i + SLOT_PREFETCH_DISTANCE]`
    /// and the entry of `hashes[i + PREFETCH_DISTANCE]` (at `i == 0` also
    /// everything nearer, so the first hashes do not start cold).
    #[inline]
    pub(crate) fn prefetch_pass(&self, hashes: &[SequenceHash], i: usize) {
        if i == 0 {
            for &h in hashes.iter().take(SLOT_PREFETCH_DISTANCE) {
                self.prefetch(h);
            }
            for &h in hashes.iter().take(PREFETCH_DISTANCE) {
                self.prefetch_entry(h);
            }
        }
        if let Some(&h) = hashes.get(i + SLOT_PREFETCH_DISTANCE) {
            self.prefetch(h);
        }
        if let Some(&h) = hashes.get(i + PREFETCH_DISTANCE) {
            self.prefetch_entry(h);
        }
    }

    /// Index slot holding `key`, if any.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.loc.run == EMPTY {
                return None;
            }
            if s.key == key {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Tier bitsets of `hash`, or all zero when no worker of the group holds it.
    pub(crate) fn get(&self, hash: SequenceHash) -> TierBits {
        match self.find(hash.0) {
            Some(i) => {
                let loc = self.slots[i].loc;
                self.runs[loc.run as usize].bits(loc.off as usize)
            }
            None => NO_BITS,
        }
    }

    /// Entry of `hash` through the index, with its `[device, retained]`
    /// bitsets; `None` when no worker of the group holds it.
    #[inline]
    pub(crate) fn locate(&self, hash: SequenceHash) -> Option<(Loc, [u64; 2])> {
        let loc = self.slots[self.find(hash.0)?].loc;
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

    /// [`Self::set_with_room`] without room: a run it opens grows as needed.
    #[cfg(test)]
    pub(crate) fn set(&mut self, hash: SequenceHash, tier: usize, bit: u32, chained: bool) -> bool {
        self.set_with_room(hash, tier, bit, chained, 0)
    }

    /// Sets bit `bit` of tier `tier` for `hash`; returns true if it was clear.
    /// A new hash is appended to the open run (one run per Stored event).
    /// `chained`: the caller proved that the hashes it sets between two
    /// [`Self::close_run`] calls are one chain, in chain order (a Stored
    /// event that passed its chain check), so the run is ordered.
    /// `room`: hashes the event has left, this one included; a run this
    /// call opens reserves room for all of them at once instead of growing
    /// by doubling (five reallocations and copies for a 64-block event, in
    /// each copy of the state); [`Self::close_run`] trims it.
    pub(crate) fn set_with_room(
        &mut self,
        hash: SequenceHash,
        tier: usize,
        bit: u32,
        chained: bool,
        room: usize,
    ) -> bool {
        let flag = 1u64 << bit;
        if let Some(i) = self.find(hash.0) {
            let loc = self.slots[i].loc;
            let r = &mut self.runs[loc.run as usize];
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
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let run = match self.open_run {
            Some(r) => r,
            None => {
                let r = match self.free_runs.pop() {
                    Some(r) => r,
                    None => {
                        self.runs.push(Run::default());
                        (self.runs.len() - 1) as u32
                    }
                };
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
        let mut i = self.home(hash.0);
        while self.slots[i].loc.run != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = Slot { key: hash.0, loc };
        self.len += 1;
        true
    }

    /// Clears bit `bit` of tier `tier` for `hash`; returns true if it was set.
    /// The entry dies when its last bit goes.
    #[cfg(test)]
    pub(crate) fn clear(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        let was_set = self.clear_deferring(hash, tier, bit);
        self.finish_clears();
        was_set
    }

    /// `clear`, but a run it leaves under a quarter live is only
    /// noted, for [`Self::finish_clears`] (call it before the table is
    /// published). A removal of a whole chain clears its run in order, so
    /// compacting at the crossing moved the last quarter of the run into a
    /// fresh one (an allocation and an index update per entry) just before
    /// the same event killed it; deferred, the run dies first and is freed.
    pub(crate) fn clear_deferring(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        let flag = 1u64 << bit;
        let Some(i) = self.find(hash.0) else {
            return false;
        };
        let loc = self.slots[i].loc;
        let (run_id, off) = (loc.run as usize, loc.off as usize);
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
            self.backward_shift(i);
            let r = &mut self.runs[run_id];
            r.live -= 1;
            if r.live == 0 {
                *r = Run::default();
                self.free_runs.push(loc.run);
                if self.open_run == Some(loc.run) {
                    self.open_run = None;
                }
            } else if Self::is_sparse(r) && self.sparse.last() != Some(&loc.run) {
                self.sparse.push(loc.run);
            }
        }
        true
    }

    /// Whether `r` is long enough and under a quarter live, so compacted.
    fn is_sparse(r: &Run) -> bool {
        r.hot.len() >= COMPACT_MIN_LEN && (r.live as usize) * 4 < r.hot.len()
    }

    /// Compacts the runs [`Self::clear_deferring`] noted that are still
    /// sparse (alive, under a quarter live). A noted id may since have been
    /// freed or reused; the check on the run now covers both.
    pub(crate) fn finish_clears(&mut self) {
        let mut sparse = std::mem::take(&mut self.sparse);
        for &r in &sparse {
            let run = &self.runs[r as usize];
            if run.live > 0 && Self::is_sparse(run) {
                self.compact_run(r);
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
    fn compact_run(&mut self, old: u32) {
        let taken = std::mem::take(&mut self.runs[old as usize]);
        if self.open_run == Some(old) {
            self.open_run = None;
        }
        let new = match self.free_runs.pop() {
            Some(r) => r,
            None => {
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        };
        let mut fresh = Run {
            hot: Vec::with_capacity(taken.live as usize),
            cold: Vec::new(),
            // A subsequence of an ordered run is ordered.
            ordered: taken.ordered,
            sums: Vec::new(),
            live: taken.live,
        };
        for (off, h) in taken.hot.iter().enumerate() {
            if !taken.is_live(off) {
                continue;
            }
            let slot = self.find(h.key).expect("a live entry is indexed");
            debug_assert_eq!(
                self.slots[slot].loc,
                Loc {
                    run: old,
                    off: off as u32
                }
            );
            self.slots[slot].loc = Loc {
                run: new,
                off: fresh.hot.len() as u32,
            };
            fresh.push(*h);
            if !taken.cold.is_empty() {
                fresh.cold.push(taken.cold[off]);
            }
        }
        self.runs[new as usize] = fresh;
        self.free_runs.push(old);
    }

    /// Refills the hole at `hole` from later slots of its probe run so that
    /// every remaining key stays reachable from its home slot (Knuth's
    /// Algorithm R for linear probing).
    fn backward_shift(&mut self, mut hole: usize) {
        self.slots[hole] = FREE_SLOT;
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            if self.slots[j].loc.run == EMPTY {
                return;
            }
            let home = self.home(self.slots[j].key);
            // The slot at `j` may move to `hole` only if `hole` lies on its
            // probe path, i.e. cyclically in [home, j).
            let movable = if hole <= j {
                home <= hole || home > j
            } else {
                home <= hole && home > j
            };
            if movable {
                self.slots[hole] = self.slots[j];
                self.slots[j] = FREE_SLOT;
                hole = j;
            }
        }
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, vec![FREE_SLOT; cap]);
        self.mask = cap - 1;
        self.shift = 64 - cap.trailing_zeros();
        for s in old.into_iter().filter(|s| s.loc.run != EMPTY) {
            let mut i = self.home(s.key);
            while self.slots[i].loc.run != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.slots[i] = s;
        }
    }
}

/// Test-only checks of the chunk invariants (see the module docs).
#[cfg(test)]
impl HolderTable {
    /// Asserts that every chunk summary is exactly what its entries give:
    /// the state after every `close_run` and `clear`.
    pub(crate) fn assert_summaries_exact(&self) {
        for (r, run) in self.runs.iter().enumerate() {
            assert_eq!(run.sums.len(), run.hot.len().div_ceil(CHUNK), "run {r}");
            let mut fresh = Run {
                hot: run.hot.clone(),
                ordered: run.ordered,
                sums: run.sums.clone(),
                ..Run::default()
            };
            for c in 0..run.sums.len() {
                fresh.resum(c);
                assert_eq!(run.sums[c], fresh.sums[c], "run {r} chunk {c}");
            }
        }
    }

    /// Whether the run that holds `hash` is ordered, its length and its
    /// chunk summaries.
    pub(crate) fn run_of(&self, hash: SequenceHash) -> (bool, usize, Vec<[u64; 2]>) {
        let (loc, _) = self.locate(hash).expect("held");
        let run = &self.runs[loc.run as usize];
        (run.ordered, run.hot.len(), run.sums.clone())
    }
}

#[cfg(test)]
mod tests;
