//! The logical slot table of one bank: which sequence hash lives in which
//! slot, which slots are pending, pinned, or evictable, in LRU order.
//!
//! One table serves all TP ranks of a bank manager (logical slot ids are
//! shared), so the ranks can never disagree about a slot. Pure bookkeeping:
//! no memory, no clock, which keeps it easy to test against a model.

use std::collections::{HashMap, HashSet};

use kv_descriptor::SequenceHash;

/// State of one logical slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Holds nothing.
    Free,
    /// Reserved for a store that not every rank acknowledged yet: invisible to
    /// lookups and pins, never evicted.
    Pending { store: u64, hash: SequenceHash },
    /// Holds a sealed block on every rank; `stamp` orders eviction (smaller first).
    Ready { hash: SequenceHash, stamp: u64 },
}

/// Slot bookkeeping. Invariants (checked by `check` in tests):
/// - `by_hash` maps exactly the hashes of `Ready` slots;
/// - `lru` holds exactly the `Ready` slots with zero pins, in increasing stamp order;
/// - `free` holds exactly the `Free` slots;
/// - pins are only ever non-zero on `Ready` slots.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Vec<SlotState>,
    pins: Vec<u32>,
    by_hash: HashMap<SequenceHash, u32>,
    lru: Lru,
    free: Vec<u32>,
    next_stamp: u64,
}

/// "No slot" in [`Lru`]'s links.
const NIL: u32 = u32::MAX;

/// The evictable slots in eviction order (smallest stamp first), as a doubly
/// linked list threaded through per-slot arrays.
///
/// Why not a `BTreeMap` keyed by stamp: a fetch of a 32K-token prompt pins
/// and unpins ~512 slots, each a tree removal or insertion (~7-10% of the
/// donor's pin exchange in a `perf` profile of `pin_round_trip_latency` at
/// 512 blocks, session 25). Stamps only grow, so appending in stamp order
/// keeps the list sorted: linking, unlinking and appending are O(1).
#[derive(Debug)]
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Lru {
    fn new(slot_count: u32) -> Self {
        Self {
            prev: vec![NIL; slot_count as usize],
            next: vec![NIL; slot_count as usize],
            head: NIL,
            tail: NIL,
        }
    }

    /// Appends `slot` (not linked; its stamp is above every linked one's).
    fn push_back(&mut self, slot: u32) {
        self.prev[slot as usize] = self.tail;
        self.next[slot as usize] = NIL;
        match self.tail {
            NIL => self.head = slot,
            t => self.next[t as usize] = slot,
        }
        self.tail = slot;
    }

    /// Unlinks `slot` (linked).
    fn unlink(&mut self, slot: u32) {
        let (p, n) = (self.prev[slot as usize], self.next[slot as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.prev[slot as usize] = NIL;
        self.next[slot as usize] = NIL;
    }

    /// Linked slots, eviction order first.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), move |&s| {
            let n = self.next[s as usize];
            (n != NIL).then_some(n)
        })
    }

    /// Linked slots (tests: a walk of the list).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.iter().count()
    }
}

impl SlotTable {
    pub(crate) fn new(slot_count: u32) -> Self {
        Self {
            slots: vec![SlotState::Free; slot_count as usize],
            pins: vec![0; slot_count as usize],
            by_hash: HashMap::new(),
            lru: Lru::new(slot_count),
            // Reversed so that `pop` hands out slot 0 first.
            free: (0..slot_count).rev().collect(),
            next_stamp: 1,
        }
    }

    pub(crate) fn slot_count(&self) -> u32 {
        self.slots.len() as u32
    }
    pub(crate) fn state(&self, slot: u32) -> Option<SlotState> {
        self.slots.get(slot as usize).copied()
    }
    pub(crate) fn lookup(&self, hash: &SequenceHash) -> Option<u32> {
        self.by_hash.get(hash).copied()
    }
    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }
    #[cfg(test)]
    pub(crate) fn evictable_count(&self) -> usize {
        self.lru.len()
    }
    pub(crate) fn pinned_slots(&self) -> usize {
        self.pins.iter().filter(|&&p| p > 0).count()
    }
    pub(crate) fn total_pins(&self) -> u64 {
        self.pins.iter().map(|&p| u64::from(p)).sum()
    }
    /// Ready hashes, in slot order.
    pub(crate) fn ready_hashes(&self) -> Vec<SequenceHash> {
        self.slots
            .iter()
            .filter_map(|s| match s {
                SlotState::Ready { hash, .. } => Some(*hash),
                _ => None,
            })
            .collect()
    }

    /// Takes `hashes.len()` slots for pending store `store`: free slots first,
    /// then the least recently used unpinned ready slots, whose hashes are
    /// returned as evicted. Ready blocks in `protect` (the chain the store
    /// extends: its parent and the run's blocks already held) are never
    /// evicted for it, so the store never announces a parent it just evicted.
    /// All or nothing: `Err(available)` changes nothing.
    pub(crate) fn allocate(
        &mut self,
        store: u64,
        hashes: &[SequenceHash],
        protect: &HashSet<SequenceHash>,
    ) -> Result<(Vec<u32>, Vec<SequenceHash>), usize> {
        let is_protected = |slots: &[SlotState], s: u32| matches!(slots[s as usize], SlotState::Ready { hash, .. } if protect.contains(&hash));
        let evictable: Vec<u32> = self
            .lru
            .iter()
            .filter(|&s| !is_protected(&self.slots, s))
            .take(hashes.len().saturating_sub(self.free.len()))
            .collect();
        let available = self.free.len() + evictable.len();
        if hashes.len() > available {
            let all = self.free.len()
                + self
                    .lru
                    .iter()
                    .filter(|&s| !is_protected(&self.slots, s))
                    .count();
            return Err(all);
        }
        let mut victims = evictable.into_iter();
        let mut slots = Vec::with_capacity(hashes.len());
        let mut evicted = Vec::new();
        for &hash in hashes {
            let slot = match self.free.pop() {
                Some(s) => s,
                None => {
                    let s = victims.next().expect("availability checked above");
                    self.lru.unlink(s);
                    if let SlotState::Ready { hash: old, .. } = self.slots[s as usize] {
                        self.by_hash.remove(&old);
                        evicted.push(old);
                    }
                    s
                }
            };
            self.slots[slot as usize] = SlotState::Pending { store, hash };
            slots.push(slot);
        }
        Ok((slots, evicted))
    }

    /// Makes pending slots ready. `slots` is in prefix order (root first):
    /// ancestors get larger stamps than descendants, so eviction takes the
    /// tail of a prefix before its root and retained prefixes stay usable.
    pub(crate) fn commit(&mut self, slots: &[u32]) {
        let n = slots.len() as u64;
        // Stamps fall along `slots`: linked from the last one back, so the
        // list stays in increasing stamp order.
        for (i, &slot) in slots.iter().enumerate().rev() {
            if let SlotState::Pending { hash, .. } = self.slots[slot as usize] {
                let stamp = self.next_stamp + (n - 1 - i as u64);
                self.slots[slot as usize] = SlotState::Ready { hash, stamp };
                self.by_hash.insert(hash, slot);
                self.lru.push_back(slot);
            }
        }
        self.next_stamp += n;
    }

    /// Frees pending slots (a store rolled back).
    pub(crate) fn rollback(&mut self, slots: &[u32]) {
        for &slot in slots {
            if matches!(self.slots[slot as usize], SlotState::Pending { .. }) {
                self.slots[slot as usize] = SlotState::Free;
                self.free.push(slot);
            }
        }
    }

    /// Frees a ready, unpinned slot (explicit removal); false if it is pinned or not ready.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        match self.slots[slot as usize] {
            SlotState::Ready { hash, .. } if self.pins[slot as usize] == 0 => {
                self.lru.unlink(slot);
                self.by_hash.remove(&hash);
                self.slots[slot as usize] = SlotState::Free;
                self.free.push(slot);
                true
            }
            _ => false,
        }
    }

    /// Pins ready slots (caller checked readiness); a pinned slot leaves the LRU.
    pub(crate) fn pin(&mut self, slots: &[u32]) {
        for &slot in slots {
            let SlotState::Ready { .. } = self.slots[slot as usize] else {
                panic!("pin of slot {slot} that is not ready");
            };
            if self.pins[slot as usize] == 0 {
                self.lru.unlink(slot);
            }
            self.pins[slot as usize] += 1;
        }
    }

    /// Releases pins taken by `pin(slots)`; slots whose last pin went are
    /// used-recently again (same prefix-order stamping as `commit`).
    pub(crate) fn unpin(&mut self, slots: &[u32]) {
        let n = slots.len() as u64;
        let mut unpinned = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            let p = &mut self.pins[slot as usize];
            *p -= 1;
            if *p == 0 {
                if let SlotState::Ready { hash, .. } = self.slots[slot as usize] {
                    let stamp = self.next_stamp + (n - 1 - i as u64);
                    self.slots[slot as usize] = SlotState::Ready { hash, stamp };
                    unpinned.push(slot);
                }
            }
        }
        // Stamps fall along `slots`: linked last first (increasing stamps).
        for &slot in unpinned.iter().rev() {
            self.lru.push_back(slot);
        }
        self.next_stamp += n;
    }

    /// Asserts every invariant listed on the type (test support).
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let mut free = self.free.clone();
        free.sort_unstable();
        let mut expect_free = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            let slot = i as u32;
            match *s {
                SlotState::Free => expect_free.push(slot),
                SlotState::Pending { .. } => {
                    assert_eq!(self.pins[i], 0, "pending slot {slot} pinned")
                }
                SlotState::Ready { hash, .. } => {
                    assert_eq!(self.by_hash.get(&hash), Some(&slot));
                }
            }
            if !matches!(s, SlotState::Ready { .. }) {
                assert_eq!(self.pins[i], 0);
            }
        }
        assert_eq!(free, expect_free);
        assert_eq!(
            self.by_hash.len(),
            self.slots
                .iter()
                .filter(|s| matches!(s, SlotState::Ready { .. }))
                .count()
        );
        // The list: exactly the unpinned ready slots, in increasing stamp
        // order, with links that agree both ways.
        let listed: Vec<u32> = self.lru.iter().collect();
        let mut last = None;
        for (k, &slot) in listed.iter().enumerate() {
            let SlotState::Ready { stamp, .. } = self.slots[slot as usize] else {
                panic!("listed slot {slot} is not ready");
            };
            assert_eq!(self.pins[slot as usize], 0, "listed slot {slot} pinned");
            assert!(last < Some(stamp), "stamps out of order at {slot}");
            last = Some(stamp);
            let prev = if k == 0 { NIL } else { listed[k - 1] };
            assert_eq!(self.lru.prev[slot as usize], prev, "prev link of {slot}");
        }
        assert_eq!(self.lru.tail, listed.last().copied().unwrap_or(NIL));
        assert_eq!(
            self.lru.len(),
            self.slots
                .iter()
                .enumerate()
                .filter(|(i, s)| matches!(s, SlotState::Ready { .. }) && self.pins[*i] == 0)
                .count()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    #[test]
    fn eviction_takes_prefix_tails_first_and_skips_pins() {
        let mut t = SlotTable::new(4);
        let none = HashSet::new();
        let (a, ev) = t.allocate(1, &[h(1), h(2), h(3)], &none).unwrap();
        assert_eq!((a.clone(), ev), (vec![0, 1, 2], vec![]));
        t.commit(&a);
        t.pin(&[a[2]]); // the tail is pinned
                        // One free slot, then the LRU: the unpinned tail-most block (h2) goes first.
        let (b, ev) = t.allocate(2, &[h(10), h(11)], &none).unwrap();
        assert_eq!(b, vec![3, 1]);
        assert_eq!(ev, vec![h(2)]);
        assert_eq!(t.lookup(&h(2)), None);
        assert_eq!(t.lookup(&h(3)), Some(2));
        // Pending slots and pinned slots are not available.
        assert_eq!(t.allocate(3, &[h(20), h(21)], &none), Err(1));
        t.check();
        t.rollback(&b);
        assert_eq!(t.free_count(), 2);
        t.unpin(&[a[2]]);
        assert_eq!(t.evictable_count(), 2);
        t.check();
    }

    /// Unpinning a fetched prefix makes it most recently used in prefix
    /// order: its tail goes before its root, and both after every block
    /// that was evictable before (the list stays in stamp order).
    #[test]
    fn an_unpinned_prefix_is_evicted_tail_first_after_older_blocks() {
        let mut t = SlotTable::new(5);
        let none = HashSet::new();
        let (a, _) = t.allocate(1, &[h(1), h(2), h(3)], &none).unwrap();
        t.commit(&a);
        let (b, _) = t.allocate(2, &[h(4), h(5)], &none).unwrap();
        t.commit(&b);
        t.pin(&a);
        t.check();
        t.unpin(&a);
        t.check();
        assert_eq!(t.evictable_count(), 5);
        // h5 and h4 (older than the unpin) first, then the prefix tail first.
        let (_, ev) = t.allocate(3, &[h(10), h(11), h(12), h(13)], &none).unwrap();
        assert_eq!(ev, vec![h(5), h(4), h(3), h(2)]);
        assert_eq!(t.lookup(&h(1)), Some(a[0]));
        t.check();
    }

    /// A store that extends a held chain never evicts that chain's blocks,
    /// even when they are next in LRU order; without room beside them it is
    /// refused, changing nothing.
    #[test]
    fn a_store_never_evicts_the_chain_it_extends() {
        let mut t = SlotTable::new(3);
        let none = HashSet::new();
        let (a, _) = t.allocate(1, &[h(1), h(2)], &none).unwrap();
        t.commit(&a);
        let (b, _) = t.allocate(2, &[h(7)], &none).unwrap();
        t.commit(&b);
        // LRU order: h2 (tail of the older chain) first, then h1, then h7.
        let protect: HashSet<SequenceHash> = [h(1), h(2)].into_iter().collect();
        let (c, ev) = t.allocate(3, &[h(3)], &protect).unwrap();
        assert_eq!(
            ev,
            vec![h(7)],
            "the chain h1-h2 is skipped, the other chain's block goes"
        );
        assert_eq!(t.lookup(&h(2)), Some(a[1]));
        t.rollback(&c);
        let protect: HashSet<SequenceHash> = [h(1), h(2)].into_iter().collect();
        assert_eq!(t.allocate(4, &[h(3), h(4)], &protect), Err(1));
        assert_eq!(t.lookup(&h(1)), Some(a[0]));
        t.check();
    }
}
