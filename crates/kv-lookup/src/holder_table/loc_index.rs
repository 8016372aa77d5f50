//! [`LocIndex`]: an open-addressing map from a sequence hash to where its
//! entry lives ([`Loc`]), and [`Locator`], how event application reaches
//! the writer's one full map (first application) or the answers it gave
//! (replay on the other copy).
//!
//! Invariants: linear probing from the hash's home slot, no tombstones
//! (deletion shifts later keys back, Knuth's Algorithm R), load factor at
//! or below 3/4.

use crate::prefetch::prefetch_read;

/// Where an entry lives: run id and offset in the run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Loc {
    pub(super) run: u32,
    pub(super) off: u32,
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

/// Smallest capacity (slots); a power of two.
const MIN_CAPACITY: usize = 1024;

/// Fibonacci-hashing multiplier (2^64 / golden ratio). Sequence hashes are
/// already XXH3 outputs, but tests and callers also use small integers; the
/// multiply spreads those over the index, and taking the top bits keeps the
/// best-mixed part.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// Hash -> [`Loc`], open addressing (see the module docs).
#[derive(Clone)]
pub(crate) struct LocIndex {
    slots: Vec<Slot>,
    /// `capacity - 1`.
    mask: usize,
    /// `64 - log2(capacity)`.
    shift: u32,
    len: usize,
}

impl LocIndex {
    /// An index that holds `expected` keys without growing.
    pub(crate) fn with_capacity(expected: usize) -> Self {
        let want = expected.saturating_mul(4) / 3 + 1;
        let cap = want.next_power_of_two().max(MIN_CAPACITY);
        Self {
            slots: vec![FREE_SLOT; cap],
            mask: cap - 1,
            shift: 64 - cap.trailing_zeros(),
            len: 0,
        }
    }

    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots (held or free).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the slot array.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(SPREAD) >> self.shift) as usize
    }

    /// Asks the CPU to load the home slot of `key` (see [`prefetch_read`]).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        prefetch_read(self.slots.as_ptr().wrapping_add(self.home(key)));
    }

    /// Slot holding `key`, if any.
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

    /// Where `key`'s entry lives, if indexed.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<Loc> {
        self.find(key).map(|i| self.slots[i].loc)
    }

    /// Indexes `key` (which must be absent) at `loc`, growing first if the
    /// load would pass 3/4.
    pub(crate) fn insert_new(&mut self, key: u64, loc: Loc) {
        debug_assert!(self.find(key).is_none(), "{key:#x} is indexed already");
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let mut i = self.home(key);
        while self.slots[i].loc.run != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = Slot { key, loc };
        self.len += 1;
    }

    /// Points `key` (which must be indexed) at `loc`.
    pub(crate) fn set_loc(&mut self, key: u64, loc: Loc) {
        let i = self.find(key).expect("moving an indexed key");
        self.slots[i].loc = loc;
    }

    /// Removes `key`; returns where it pointed.
    pub(crate) fn remove(&mut self, key: u64) -> Option<Loc> {
        let i = self.find(key)?;
        let loc = self.slots[i].loc;
        self.len -= 1;
        self.backward_shift(i);
        Some(loc)
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

/// How a table mutation finds a hash's entry: through the writer's full
/// map, or through the answers that map gave the same mutation on the
/// other copy.
///
/// Both copies of the index apply the same mutations in the same order and
/// so keep their runs in the same layout (run ids, offsets): a hash's
/// entry is at the same [`Loc`] in both. The full map therefore exists
/// once, on the writer's side; the first application of a mutation asks
/// it and logs each answer, and the replay on the other copy takes the
/// answers from the log in the same order, touching no map at all.
pub(crate) enum Locator<'a> {
    /// First application: the map, and the log of its answers (`None`
    /// where no replay follows: tests, a table of its own).
    Map {
        map: &'a mut LocIndex,
        log: Option<&'a mut Vec<Option<Loc>>>,
    },
    /// Replay: the first application's answers, from `pos` on.
    Replay {
        log: &'a [Option<Loc>],
        pos: &'a mut usize,
    },
}

impl Locator<'_> {
    /// Where `key`'s live entry is (one answer of the log).
    #[inline]
    pub(crate) fn find(&mut self, key: u64) -> Option<Loc> {
        match self {
            Locator::Map { map, log } => {
                let loc = map.get(key);
                if let Some(log) = log {
                    log.push(loc);
                }
                loc
            }
            Locator::Replay { log, pos } => {
                let loc = *log
                    .get(**pos)
                    .expect("a replay asks what its first application asked");
                **pos += 1;
                loc
            }
        }
    }

    /// The answer [`Self::find`] will give `ahead` calls from now, if this
    /// is a replay (for prefetching); `None` on the map.
    #[inline]
    pub(crate) fn peek(&self, ahead: usize) -> Option<Loc> {
        match self {
            Locator::Map { .. } => None,
            Locator::Replay { log, pos } => log.get(**pos + ahead).copied().flatten(),
        }
    }

    /// Asks the CPU to load the map slot of `key` (no-op on a replay).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if let Locator::Map { map, .. } = self {
            map.prefetch(key);
        }
    }

    /// The full map, if this is a first application (for debug checks).
    pub(crate) fn map(&self) -> Option<&LocIndex> {
        match self {
            Locator::Map { map, .. } => Some(map),
            Locator::Replay { .. } => None,
        }
    }

    /// `key` got a new entry at `loc`.
    #[inline]
    pub(crate) fn inserted(&mut self, key: u64, loc: Loc) {
        if let Locator::Map { map, .. } = self {
            map.insert_new(key, loc);
        }
    }

    /// `key`'s entry moved to `loc`.
    #[inline]
    pub(crate) fn moved(&mut self, key: u64, loc: Loc) {
        if let Locator::Map { map, .. } = self {
            map.set_loc(key, loc);
        }
    }

    /// `key`'s entry died.
    #[inline]
    pub(crate) fn removed(&mut self, key: u64) {
        if let Locator::Map { map, .. } = self {
            map.remove(key);
        }
    }
}
