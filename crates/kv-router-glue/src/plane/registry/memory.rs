//! What [`super::WorkerRegistry`] remembers of incarnations that are no
//! longer live (replaced ones, ones dropped for silence), bounded in time
//! and in count: an incarnation is forgotten once nothing of it was heard
//! for the retention, and past the cap the one heard of longest ago goes
//! first. Without a bound a long-running router kept one entry per worker
//! restart for its whole life.

use std::collections::{BTreeMap, HashMap};

use kv_descriptor::EngineId;

/// A bounded map from engine id to `V`, ordered by when each was last
/// heard of (ms on the registry's clock).
#[derive(Debug)]
pub(super) struct Remembered<V> {
    entries: HashMap<EngineId, (Stamp, V)>,
    /// Every entry by its stamp, the one heard of longest ago first.
    order: BTreeMap<Stamp, EngineId>,
    /// Tie-break of equal times, so that two entries never share a stamp
    /// and equal times keep the order they were heard in.
    next_seq: u64,
    cap: usize,
}

/// (last heard at, in ms; sequence number of that hearing).
type Stamp = (u64, u64);

impl<V> Remembered<V> {
    /// Empty; holds at most `cap` entries (at least 1).
    pub(super) fn new(cap: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
            cap: cap.max(1),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn contains(&self, engine: &EngineId) -> bool {
        self.entries.contains_key(engine)
    }

    fn stamp(&mut self, now_ms: u64) -> Stamp {
        self.next_seq += 1;
        (now_ms, self.next_seq)
    }

    /// Remembers `engine` with `value`, heard of at `now_ms` (replacing
    /// what was remembered of it); returns the older entries the cap made
    /// it forget, the one heard of longest ago first.
    pub(super) fn remember(&mut self, engine: EngineId, value: V, now_ms: u64) -> Vec<EngineId> {
        self.take(&engine);
        let stamp = self.stamp(now_ms);
        self.entries.insert(engine, (stamp, value));
        self.order.insert(stamp, engine);
        let mut evicted = Vec::new();
        while self.entries.len() > self.cap {
            let (_, oldest) = self.order.pop_first().expect("as many as entries");
            self.entries.remove(&oldest);
            evicted.push(oldest);
        }
        evicted
    }

    /// Notes that `engine` was heard of at `now_ms` (it moves to the back
    /// of the eviction order); false when it is not remembered.
    pub(super) fn heard(&mut self, engine: &EngineId, now_ms: u64) -> bool {
        if !self.entries.contains_key(engine) {
            return false;
        }
        let (_, seq) = self.stamp(now_ms);
        let entry = self.entries.get_mut(engine).expect("checked above");
        // A clock that stepped back never makes an entry older.
        let new = (entry.0 .0.max(now_ms), seq);
        let old = std::mem::replace(&mut entry.0, new);
        self.order.remove(&old);
        self.order.insert(new, *engine);
        true
    }

    /// What is remembered of `engine`.
    pub(super) fn get(&self, engine: &EngineId) -> Option<&V> {
        self.entries.get(engine).map(|(_, v)| v)
    }

    /// What is remembered of `engine`, to change (its stamp stays).
    pub(super) fn get_mut(&mut self, engine: &EngineId) -> Option<&mut V> {
        self.entries.get_mut(engine).map(|(_, v)| v)
    }

    /// Forgets `engine`, returning its value.
    pub(super) fn take(&mut self, engine: &EngineId) -> Option<V> {
        let (stamp, value) = self.entries.remove(engine)?;
        self.order.remove(&stamp);
        Some(value)
    }

    /// An entry for which `matches` is true, if any (a scan: only an
    /// incarnation back from silence under a new key asks).
    pub(super) fn find(&self, mut matches: impl FnMut(&EngineId, &V) -> bool) -> Option<EngineId> {
        self.entries
            .iter()
            .find(|(e, (_, v))| matches(e, v))
            .map(|(e, _)| *e)
    }

    /// Forgets every entry for which `take` is true; returns them.
    pub(super) fn take_where(
        &mut self,
        mut take: impl FnMut(&EngineId, &V) -> bool,
    ) -> Vec<(EngineId, V)> {
        let taken: Vec<EngineId> = self
            .entries
            .iter()
            .filter(|(e, (_, v))| take(e, v))
            .map(|(e, _)| *e)
            .collect();
        taken
            .into_iter()
            .filter_map(|e| self.take(&e).map(|v| (e, v)))
            .collect()
    }

    /// Forgets every entry last heard of more than `retention_ms` before
    /// `now_ms`; returns them, the one heard of longest ago first.
    pub(super) fn forget_older_than(&mut self, retention_ms: u64, now_ms: u64) -> Vec<EngineId> {
        let mut forgotten = Vec::new();
        while let Some((&(heard, _), &engine)) = self.order.first_key_value() {
            if now_ms.saturating_sub(heard) <= retention_ms {
                break;
            }
            self.take(&engine);
            forgotten.push(engine);
        }
        forgotten
    }

    /// Every entry heard of before `now_ms` counts as heard of at `now_ms`
    /// (their order kept): the time the router could hear nothing tells
    /// nothing of them.
    pub(super) fn restamp(&mut self, now_ms: u64) {
        let order = std::mem::take(&mut self.order);
        for (_, engine) in order {
            let (stamp, _) = self.entries.get_mut(&engine).expect("listed");
            stamp.0 = stamp.0.max(now_ms);
            self.order.insert(*stamp, engine);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<EngineId> {
        (0..n).map(|_| EngineId::fresh()).collect()
    }

    #[test]
    fn the_cap_forgets_the_one_heard_of_longest_ago() {
        let e = ids(4);
        let mut m = Remembered::new(3);
        for (t, &id) in e[..3].iter().enumerate() {
            assert_eq!(m.remember(id, (), t as u64), []);
        }
        // e[0] heard again: e[1] is now the oldest.
        assert!(m.heard(&e[0], 10));
        assert_eq!(m.remember(e[3], (), 11), [e[1]]);
        assert_eq!(m.len(), 3);
        assert!(!m.contains(&e[1]));
        assert!(m.contains(&e[0]) && m.contains(&e[2]) && m.contains(&e[3]));
        assert!(!m.heard(&e[1], 12), "forgotten");
    }

    #[test]
    fn entries_are_forgotten_after_the_retention_counted_from_their_last_hearing() {
        let e = ids(2);
        let mut m = Remembered::new(8);
        m.remember(e[0], "a", 0);
        m.remember(e[1], "b", 50);
        m.heard(&e[0], 100);
        // Exactly the retention is still remembered.
        assert_eq!(m.forget_older_than(100, 150), []);
        assert_eq!(m.forget_older_than(100, 151), [e[1]]);
        assert!(!m.contains(&e[1]) && m.contains(&e[0]));
        assert_eq!(m.forget_older_than(100, 201), [e[0]]);
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn a_restamp_moves_every_older_hearing_to_now_in_order() {
        let e = ids(3);
        let mut m = Remembered::new(3);
        m.remember(e[0], (), 0);
        m.remember(e[1], (), 10);
        m.restamp(1_000);
        m.remember(e[2], (), 1_000);
        assert_eq!(m.forget_older_than(100, 1_100), []);
        // The order survives the restamp: e[0] goes first at the cap.
        let newest = EngineId::fresh();
        assert_eq!(m.remember(newest, (), 1_050), [e[0]]);
        assert!(m.contains(&e[1]));
        assert_eq!(m.forget_older_than(100, 1_101), [e[1], e[2]]);
    }

    #[test]
    fn take_where_removes_only_the_matching_entries() {
        let e = ids(3);
        let mut m = Remembered::new(8);
        for (i, &id) in e.iter().enumerate() {
            m.remember(id, i % 2, i as u64);
        }
        let mut taken = m.take_where(|_, &v| v == 0);
        taken.sort_by_key(|&(_, v)| v);
        assert_eq!(taken.len(), 2);
        assert_eq!(m.len(), 1);
        assert!(m.contains(&e[1]));
        assert_eq!(m.take(&e[1]), Some(1));
        assert_eq!(m.forget_older_than(0, u64::MAX), []);
    }
}
