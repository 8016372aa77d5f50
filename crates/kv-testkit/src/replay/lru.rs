//! The prefill workers' native prefix cache and the decode workers' retained
//! banks: LRU sets of blocks.

use super::*;

/// LRU set of blocks with lazy deletion: `touch` is O(1), eviction pops the
/// oldest live stamp. Stale queue entries are compacted when they outnumber
/// live ones, so memory stays O(capacity).
pub(super) struct LruBlocks {
    pub(super) capacity: usize,
    pub(super) stamps: HashMap<SequenceHash, u64>,
    pub(super) queue: VecDeque<(SequenceHash, u64)>,
    pub(super) clock: u64,
}

impl LruBlocks {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            stamps: HashMap::new(),
            queue: VecDeque::new(),
            clock: 0,
        }
    }

    pub(super) fn contains(&self, h: &SequenceHash) -> bool {
        self.stamps.contains_key(h)
    }

    /// Blocks `0..k` of `hashes` all held; returns `k`.
    pub(super) fn prefix_len(&self, hashes: &[StoredBlock]) -> usize {
        hashes
            .iter()
            .take_while(|b| self.contains(&b.sequence_hash))
            .count()
    }

    /// Inserts or refreshes `blocks`, tail first so that a prefix is always
    /// younger than its extensions and is evicted after them. Returns the
    /// newly added blocks (root first) and the evicted hashes.
    pub(super) fn insert(
        &mut self,
        blocks: &[StoredBlock],
    ) -> (Vec<StoredBlock>, Vec<SequenceHash>) {
        let mut added = Vec::new();
        for b in blocks.iter().rev() {
            self.clock += 1;
            if self.stamps.insert(b.sequence_hash, self.clock).is_none() {
                added.push(*b);
            }
            self.queue.push_back((b.sequence_hash, self.clock));
        }
        added.reverse();
        let mut evicted = Vec::new();
        while self.stamps.len() > self.capacity {
            let (h, stamp) = self
                .queue
                .pop_front()
                .expect("queue holds every live entry");
            if self.stamps.get(&h) == Some(&stamp) {
                self.stamps.remove(&h);
                evicted.push(h);
            }
        }
        if !evicted.is_empty() && !added.is_empty() {
            // A block both added and evicted by this call was never held:
            // it belongs in neither list (a Stored event for it would lie).
            let added_now: std::collections::HashSet<SequenceHash> =
                added.iter().map(|b| b.sequence_hash).collect();
            let stamps = &self.stamps;
            added.retain(|b| stamps.contains_key(&b.sequence_hash));
            evicted.retain(|h| !added_now.contains(h));
        }
        if self.queue.len() > 2 * self.stamps.len() + 1024 {
            let stamps = &self.stamps;
            self.queue.retain(|(h, s)| stamps.get(h) == Some(s));
        }
        (added, evicted)
    }
}
