//! The holder table: sequence hash -> which of up to 64 workers hold it, per tier.
//!
//! One table serves one *worker group* (worker slots `64g .. 64g + 63`), so a
//! holder set is one `u64` bitset per tier and a donor walk is a chain of
//! `AND`s. The table is open addressing with linear probing over one flat
//! array of cache-line-sized slots: a probe costs one cache line, and the
//! lookup can prefetch the slot of a block before it needs it
//! ([`HolderTable::prefetch`]), which `std`'s `HashMap` cannot offer.
//!
//! Invariants:
//! - A slot is occupied iff one of its tier bitsets is non-zero; an entry
//!   whose last bit is cleared is deleted at once (backward-shift deletion,
//!   so there are no tombstones and probe chains stay short).
//! - Load factor stays at or below 3/4 (the table doubles before it passes).

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

/// One slot, padded to a cache line so that a probe touches one line.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Slot {
    key: u64,
    bits: TierBits,
}

impl Slot {
    #[inline]
    fn is_empty(&self) -> bool {
        self.bits.iter().all(|&b| b == 0)
    }
}

/// How far ahead (in hashes) walks and event application prefetch slots:
/// enough outstanding misses to cover DRAM latency, few enough not to waste
/// bandwidth when a walk stops early.
pub(crate) const PREFETCH_DISTANCE: usize = 8;

/// Smallest capacity (slots); a power of two.
const MIN_CAPACITY: usize = 1024;

/// Fibonacci-hashing multiplier (2^64 / golden ratio). Sequence hashes are
/// already XXH3 outputs, but tests and callers also use small integers; the
/// multiply spreads those over the table, and taking the top bits keeps the
/// best-mixed part.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// Open-addressing map from sequence hash to tier bitsets of one worker group.
pub(crate) struct HolderTable {
    slots: Vec<Slot>,
    /// `capacity - 1`.
    mask: usize,
    /// `64 - log2(capacity)`.
    shift: u32,
    len: usize,
}

impl HolderTable {
    /// A table that holds `expected` entries without growing.
    pub(crate) fn with_capacity(expected: usize) -> Self {
        let want = expected.saturating_mul(4) / 3 + 1;
        let cap = want.next_power_of_two().max(MIN_CAPACITY);
        Self {
            slots: vec![Slot::default(); cap],
            mask: cap - 1,
            shift: 64 - cap.trailing_zeros(),
            len: 0,
        }
    }

    /// Number of sequence hashes with at least one holder.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the slot array (the table's memory, excluding `self`).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(SPREAD) >> self.shift) as usize
    }

    /// Asks the CPU to load the home slot of `hash` (see [`prefetch_read`]).
    #[inline]
    pub(crate) fn prefetch(&self, hash: SequenceHash) {
        let i = self.home(hash.0);
        prefetch_read(self.slots.as_ptr().wrapping_add(i));
    }

    /// Tier bitsets of `hash`, or all zero when no worker of the group holds it.
    #[inline]
    pub(crate) fn get(&self, hash: SequenceHash) -> TierBits {
        let mut i = self.home(hash.0);
        loop {
            let s = &self.slots[i];
            if s.is_empty() {
                return [0; TIERS];
            }
            if s.key == hash.0 {
                return s.bits;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Sets bit `bit` of tier `tier` for `hash`; returns true if it was clear.
    pub(crate) fn set(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let flag = 1u64 << bit;
        let mut i = self.home(hash.0);
        loop {
            let s = &mut self.slots[i];
            if s.is_empty() {
                s.key = hash.0;
                s.bits = [0; TIERS];
                s.bits[tier] = flag;
                self.len += 1;
                return true;
            }
            if s.key == hash.0 {
                let was_clear = s.bits[tier] & flag == 0;
                s.bits[tier] |= flag;
                return was_clear;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Clears bit `bit` of tier `tier` for `hash`; returns true if it was set.
    /// Deletes the entry when its last bit goes.
    pub(crate) fn clear(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        let flag = 1u64 << bit;
        let mut i = self.home(hash.0);
        loop {
            let s = &mut self.slots[i];
            if s.is_empty() {
                return false;
            }
            if s.key == hash.0 {
                if s.bits[tier] & flag == 0 {
                    return false;
                }
                s.bits[tier] &= !flag;
                if s.is_empty() {
                    self.len -= 1;
                    self.backward_shift(i);
                }
                return true;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Refills the hole at `hole` from later slots of its probe run so that
    /// every remaining key stays reachable from its home slot (Knuth's
    /// Algorithm R for linear probing).
    fn backward_shift(&mut self, mut hole: usize) {
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            if self.slots[j].is_empty() {
                return;
            }
            let home = self.home(self.slots[j].key);
            // The entry at `j` may move to `hole` only if `hole` lies on its
            // probe path, i.e. cyclically in [home, j).
            let movable = if hole <= j {
                home <= hole || home > j
            } else {
                home <= hole && home > j
            };
            if movable {
                self.slots[hole] = self.slots[j];
                self.slots[j].bits = [0; TIERS];
                hole = j;
            }
        }
    }

    fn grow(&mut self) {
        let mut bigger = HolderTable::with_capacity(self.slots.len()); // doubles: cap*4/3 rounds up
        for s in self.slots.iter().filter(|s| !s.is_empty()) {
            let mut i = bigger.home(s.key);
            while !bigger.slots[i].is_empty() {
                i = (i + 1) & bigger.mask;
            }
            bigger.slots[i] = *s;
            bigger.len += 1;
        }
        *self = bigger;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn set_get_clear_round_trip_with_colliding_keys() {
        let mut t = HolderTable::with_capacity(0);
        // Keys spaced by the table size collide on the home slot often
        // enough to exercise probe runs and backward shifts.
        let keys: Vec<u64> = (0..3000u64).map(|k| k * 1024).collect();
        for (n, &k) in keys.iter().enumerate() {
            assert!(t.set(SequenceHash(k), n % TIERS, (n % 64) as u32));
            assert!(!t.set(SequenceHash(k), n % TIERS, (n % 64) as u32));
        }
        assert_eq!(t.len(), 3000);
        assert!(t.slots.len() >= 4000, "grew to keep load <= 3/4");
        for (n, &k) in keys.iter().enumerate() {
            let mut want = [0u64; TIERS];
            want[n % TIERS] = 1 << (n % 64);
            assert_eq!(t.get(SequenceHash(k)), want);
        }
        for (n, &k) in keys.iter().enumerate().filter(|(n, _)| n % 3 == 0) {
            assert!(t.clear(SequenceHash(k), n % TIERS, (n % 64) as u32));
            assert!(!t.clear(SequenceHash(k), n % TIERS, (n % 64) as u32));
        }
        assert_eq!(t.len(), 2000);
        for (n, &k) in keys.iter().enumerate() {
            let got = t.get(SequenceHash(k));
            if n % 3 == 0 {
                assert_eq!(got, [0; TIERS]);
            } else {
                assert_eq!(got[n % TIERS], 1 << (n % 64));
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn matches_a_hashmap(ops in proptest::collection::vec((0u64..200, 0usize..TIERS, 0u32..64, proptest::bool::ANY), 1..600)) {
            let mut t = HolderTable::with_capacity(0);
            let mut m: HashMap<u64, TierBits> = HashMap::new();
            for (k, tier, bit, set) in ops {
                // Multiply so that keys cluster on few home slots.
                let key = k.wrapping_mul(1 << 54);
                let e = m.entry(key).or_default();
                let before = e[tier] & (1 << bit) != 0;
                if set {
                    proptest::prop_assert_eq!(t.set(SequenceHash(key), tier, bit), !before);
                    e[tier] |= 1 << bit;
                } else {
                    proptest::prop_assert_eq!(t.clear(SequenceHash(key), tier, bit), before);
                    e[tier] &= !(1 << bit);
                }
                if e.iter().all(|&b| b == 0) {
                    m.remove(&key);
                }
            }
            proptest::prop_assert_eq!(t.len(), m.len());
            for k in 0u64..200 {
                let key = k.wrapping_mul(1 << 54);
                proptest::prop_assert_eq!(t.get(SequenceHash(key)), m.get(&key).copied().unwrap_or_default());
            }
        }
    }
}
