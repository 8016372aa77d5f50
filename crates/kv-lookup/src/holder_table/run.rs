//! [`Run`]: a holder table's entries in the order a Stored event announced
//! them, with the per-chunk summaries and entry-point bits that go with
//! them (the invariants are the table's: see `holder_table`'s module docs).

use super::{place, HotEntry, TierBits, CHUNK, HOT_DEVICE, HOT_RETAINED};

/// Entries in the order a Stored event announced them, as parallel arrays:
/// `hot` is all a walk touches, `cold` holds the tiers lookups never read.
#[derive(Default)]
pub(super) struct Run {
    pub(super) hot: Vec<HotEntry>,
    /// `[host_pinned, disk, external]` bitsets; empty until the run's first
    /// cold bit (most runs never get one), then as long as `hot`.
    pub(super) cold: Vec<[u64; 3]>,
    /// Filled by one Stored event that passed its chain check: each entry
    /// is an ancestor of every later one (see the module docs).
    pub(super) ordered: bool,
    /// Per chunk (entries `c * CHUNK ..`, the last one possibly partial):
    /// the `AND` of the hot bits if the run is ordered, else zero. Never
    /// above the true value (see the module docs).
    pub(super) sums: Vec<[u64; 2]>,
    /// Entries with a non-zero bit.
    pub(super) live: u32,
    /// Bit `off % 64` of word `off / 64`: the entry at `off` is an entry
    /// point (indexed in [`HolderTable::entry_points`]). Read where an
    /// entry dies or its predecessor did, instead of probing that index.
    pub(super) points: Vec<u64>,
}

impl Run {
    /// The bitset word of `tier` at `off`, materializing `cold` if needed.
    #[inline]
    pub(super) fn word(&mut self, off: usize, tier: usize) -> &mut u64 {
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
    pub(super) fn cold_at(&self, off: usize) -> [u64; 3] {
        self.cold.get(off).copied().unwrap_or([0; 3])
    }

    #[inline]
    pub(super) fn test(&self, off: usize, tier: usize, flag: u64) -> bool {
        match place(tier) {
            (true, i) => self.hot[off].bits[i] & flag != 0,
            (false, i) => self.cold_at(off)[i] & flag != 0,
        }
    }

    /// Reads `cold` only when the hot bits are zero and the run has cold
    /// bits at all: removing a block usually touches one cache line.
    #[inline]
    pub(super) fn is_live(&self, off: usize) -> bool {
        self.hot[off].bits != [0; 2] || self.cold_at(off) != [0; 3]
    }

    pub(super) fn bits(&self, off: usize) -> TierBits {
        let (h, c) = (self.hot[off].bits, self.cold_at(off));
        [h[HOT_DEVICE], c[0], c[1], c[2], h[HOT_RETAINED]]
    }

    /// Appends `e` (a `cold` slot, if any, is the caller's), keeping the
    /// last chunk's summary exact: `AND` in the new bits.
    #[inline]
    pub(super) fn push(&mut self, e: HotEntry) {
        let off = self.hot.len();
        self.hot.push(e);
        if off % 64 == 0 {
            self.points.push(0);
        }
        if off % CHUNK == 0 {
            self.sums.push(if self.ordered { e.bits } else { [0; 2] });
        } else {
            let s = self.sums.last_mut().expect("a chunk per CHUNK entries");
            *s = [s[0] & e.bits[0], s[1] & e.bits[1]];
        }
    }

    #[inline]
    pub(super) fn is_point(&self, off: usize) -> bool {
        self.points[off / 64] >> (off % 64) & 1 == 1
    }

    #[inline]
    pub(super) fn set_point(&mut self, off: usize, on: bool) {
        let (w, b) = (off / 64, off % 64);
        self.points[w] = self.points[w] & !(1 << b) | u64::from(on) << b;
    }

    /// Recomputes the summary of chunk `c` from its entries (exact).
    pub(super) fn resum(&mut self, c: usize) {
        let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(self.hot.len()));
        let mut s = [if self.ordered { u64::MAX } else { 0 }; 2];
        for e in &self.hot[lo..hi] {
            s = [s[0] & e.bits[0], s[1] & e.bits[1]];
        }
        self.sums[c] = s;
    }
}
