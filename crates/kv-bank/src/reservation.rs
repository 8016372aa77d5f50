//! Destination reservations on the fetching side: native cache blocks that
//! an incoming fetch writes into.
//!
//! A reserved block cannot be handed out again until its fetch either
//! completed, or was cancelled *and* quiesced (the transfer engine confirmed
//! no write to it is still in flight). Cancelling alone is not enough: a copy
//! already queued on a GPU stream could still land in a block that was
//! reused, corrupting another request's KV.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::{leaks, BankError};

/// Per-block states, counts per state, and the free blocks as a bitset.
///
/// Why not four ordered sets: a fetch of a 32K-token prompt reserves,
/// completes and releases ~512 blocks, and as `BTreeSet` moves that was
/// 70-130 µs per fetch on the host path before its copies were issued
/// (session 25, 2-core VM: `reserve_exact` + `cancel` of 512 of 520
/// blocks); an array write per block and a word scan for `reserve(n)` cost
/// a few µs. Invariants: `free_bits` has bit `b` set exactly when
/// `states[b]` is `Free`, bits past `states.len()` are zero, and
/// `counts[s]` is the number of blocks in state `s`.
#[derive(Debug)]
struct PoolState {
    states: Vec<BlockState>,
    /// Bit `b % 64` of word `b / 64`: block `b` is free.
    free_bits: Vec<u64>,
    /// Blocks per state, indexed by `BlockState as usize`.
    counts: [usize; 4],
}

/// The four states a block of the pool can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    Free = 0,
    /// Reserved by a live or cancelled-not-quiesced reservation.
    Reserved = 1,
    /// Held by a reservation dropped without complete / cancel + quiesce.
    Orphaned = 2,
    /// Holds a completed fetch's KV while its [`CompletedBlocks`] is held:
    /// not free for another fetch.
    Completed = 3,
}

impl BlockState {
    /// Counted in [`leaks::RESERVED_BLOCKS`]: held by a reservation that has
    /// not ended (live, cancelled-not-quiesced, or orphaned).
    fn counts_as_reserved(self) -> bool {
        matches!(self, BlockState::Reserved | BlockState::Orphaned)
    }
}

impl PoolState {
    fn new(capacity: u32) -> Self {
        let n = capacity as usize;
        let mut free_bits = vec![u64::MAX; n.div_ceil(64)];
        if n % 64 != 0 {
            // No bit past the last block.
            *free_bits.last_mut().expect("n % 64 != 0 implies a word") = (1u64 << (n % 64)) - 1;
        }
        Self {
            states: vec![BlockState::Free; n],
            free_bits,
            counts: [n, 0, 0, 0],
        }
    }

    fn count(&self, s: BlockState) -> usize {
        self.counts[s as usize]
    }

    fn is_free(&self, b: u32) -> bool {
        self.states[b as usize] == BlockState::Free
    }

    /// The `n` lowest free block ids (caller checked `n <= free`).
    fn lowest_free(&self, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        for (w, &word) in self.free_bits.iter().enumerate() {
            let mut bits = word;
            while bits != 0 && out.len() < n {
                out.push((w * 64) as u32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
            if out.len() == n {
                break;
            }
        }
        out
    }

    /// Moves `blocks` from state `from` to `to`; the leak counter follows
    /// from the two states, so no caller keeps it by hand. Every block must
    /// be in `from` (the handles below only move what they hold).
    fn shift(&mut self, blocks: &[u32], from: BlockState, to: BlockState) {
        for &b in blocks {
            let s = &mut self.states[b as usize];
            debug_assert_eq!(*s, from, "block {b}");
            *s = to;
            let bit = 1u64 << (b % 64);
            if from == BlockState::Free {
                self.free_bits[b as usize / 64] &= !bit;
            }
            if to == BlockState::Free {
                self.free_bits[b as usize / 64] |= bit;
            }
        }
        let n = blocks.len();
        self.counts[from as usize] -= n;
        self.counts[to as usize] += n;
        match (from.counts_as_reserved(), to.counts_as_reserved()) {
            (false, true) => leaks::RESERVED_BLOCKS.add(n as u64),
            (true, false) => leaks::RESERVED_BLOCKS.sub(n as u64),
            _ => {}
        }
    }

    /// Asserts the invariants listed on the type (tests).
    #[cfg(test)]
    fn check(&self) {
        let mut counts = [0usize; 4];
        for (b, &s) in self.states.iter().enumerate() {
            counts[s as usize] += 1;
            assert_eq!(
                self.free_bits[b / 64] >> (b % 64) & 1 == 1,
                s == BlockState::Free,
                "block {b}"
            );
        }
        assert_eq!(counts, self.counts);
        let set: u32 = self.free_bits.iter().map(|w| w.count_ones()).sum();
        assert_eq!(set as usize, self.counts[0], "no bit past the last block");
    }
}

impl Drop for PoolState {
    fn drop(&mut self) {
        // The pool (the native cache it stands for) is gone, and its blocks with it.
        leaks::RESERVED_BLOCKS
            .sub((self.count(BlockState::Reserved) + self.count(BlockState::Orphaned)) as u64);
    }
}

/// The destination blocks of one fetching engine (or rank): block ids
/// `0..capacity` of its native cache, each free, reserved, or orphaned.
///
/// ```
/// use kv_bank::DestinationPool;
/// let pool = DestinationPool::new(8);
/// let r = pool.reserve(3).unwrap();
/// assert_eq!(r.blocks(), &[0, 1, 2]);
/// assert_eq!(pool.free_blocks(), 5);
/// let c = r.cancel();            // fetch abandoned, copies may still be in flight
/// assert_eq!(pool.free_blocks(), 5);
/// c.quiesced();                  // the transfer engine drained its streams
/// assert_eq!(pool.free_blocks(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct DestinationPool {
    state: Arc<Mutex<PoolState>>,
    /// Ids are `0..capacity`; each has exactly one state.
    capacity: u32,
}

impl DestinationPool {
    /// A pool of `capacity` free blocks, ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            state: Arc::new(Mutex::new(PoolState::new(capacity))),
        }
    }

    /// Reserves the `n` lowest free blocks.
    ///
    /// # Errors
    /// [`BankError::DestinationFull`] when fewer than `n` are free (nothing reserved).
    pub fn reserve(&self, n: usize) -> Result<DestinationReservation, BankError> {
        let mut st = self.state.lock();
        let free = st.count(BlockState::Free);
        if free < n {
            return Err(BankError::DestinationFull { needed: n, free });
        }
        let blocks = st.lowest_free(n);
        st.shift(&blocks, BlockState::Free, BlockState::Reserved);
        Ok(self.handle(blocks))
    }

    /// Reserves exactly `blocks` (e.g. blocks the engine's allocator chose).
    ///
    /// The list is checked first ([`DestinationPool::check_blocks`]: every id
    /// below the capacity, none repeated), whatever the pool's state, so a
    /// caller bug is never reported as contention; then every block must be
    /// free.
    ///
    /// ```
    /// use kv_bank::{BankError, DestinationPool};
    /// let pool = DestinationPool::new(4);
    /// let held = pool.reserve_exact(&[2]).unwrap();
    /// // Contention: block 2 is another fetch's.
    /// assert!(matches!(pool.reserve_exact(&[1, 2]), Err(BankError::AlreadyReserved { block: 2 })));
    /// // Caller bugs, whatever the pool holds: no block 9, block 1 twice.
    /// assert!(matches!(
    ///     pool.reserve_exact(&[2, 9]),
    ///     Err(BankError::BlockOutOfRange { index: 1, block: 9, capacity: 4 })
    /// ));
    /// assert!(matches!(
    ///     pool.reserve_exact(&[1, 0, 1]),
    ///     Err(BankError::DuplicateBlock { index: 2, block: 1, first: 0 })
    /// ));
    /// # held.cancel().quiesced();
    /// ```
    ///
    /// # Errors
    /// Nothing is reserved on error.
    /// [`BankError::BlockOutOfRange`] or [`BankError::DuplicateBlock`] for
    /// the first bad id of the list (a caller bug);
    /// [`BankError::AlreadyReserved`] naming the first block that is not free
    /// (reserved, orphaned, or completed and still held: contention).
    pub fn reserve_exact(&self, blocks: &[u32]) -> Result<DestinationReservation, BankError> {
        self.check_blocks(blocks)?;
        let mut st = self.state.lock();
        if let Some(&block) = blocks.iter().find(|&&b| !st.is_free(b)) {
            return Err(BankError::AlreadyReserved { block });
        }
        st.shift(blocks, BlockState::Free, BlockState::Reserved);
        Ok(self.handle(blocks.to_vec()))
    }

    /// Checks a list of block ids for [`DestinationPool::reserve_exact`]
    /// without reserving anything or reading the pool's state: every id
    /// below [`DestinationPool::capacity`], none listed twice. A caller can
    /// run it before anything else is touched (the answer cannot change).
    ///
    /// ```
    /// use kv_bank::{BankError, DestinationPool};
    /// let pool = DestinationPool::new(8);
    /// assert!(pool.check_blocks(&[7, 0, 3]).is_ok());
    /// assert!(matches!(
    ///     pool.check_blocks(&[7, 8]),
    ///     Err(BankError::BlockOutOfRange { index: 1, block: 8, capacity: 8 })
    /// ));
    /// ```
    ///
    /// # Errors
    /// [`BankError::BlockOutOfRange`] or [`BankError::DuplicateBlock`] for
    /// the first bad id, in list order.
    pub fn check_blocks(&self, blocks: &[u32]) -> Result<(), BankError> {
        // One bit per block id: a bitset of the capacity, not a hash set (this
        // runs on every fetch into engine-chosen blocks, before its copies).
        let mut seen = vec![0u64; (self.capacity as usize).div_ceil(64)];
        for (index, &block) in blocks.iter().enumerate() {
            if block >= self.capacity {
                return Err(BankError::BlockOutOfRange {
                    index,
                    block,
                    capacity: self.capacity,
                });
            }
            let (w, bit) = (block as usize / 64, 1u64 << (block % 64));
            if seen[w] & bit != 0 {
                let first = blocks
                    .iter()
                    .position(|&b| b == block)
                    .expect("a block seen before is in the list");
                return Err(BankError::DuplicateBlock {
                    index,
                    block,
                    first,
                });
            }
            seen[w] |= bit;
        }
        Ok(())
    }

    fn handle(&self, blocks: Vec<u32>) -> DestinationReservation {
        DestinationReservation {
            pool: self.clone(),
            blocks,
            settled: false,
        }
    }

    fn shift(&self, blocks: &[u32], from: BlockState, to: BlockState) {
        self.state.lock().shift(blocks, from, to);
    }

    /// Block ids this pool hands out (`0..capacity`), whatever their state.
    ///
    /// ```
    /// let pool = kv_bank::DestinationPool::new(8);
    /// let r = pool.reserve(3).unwrap();
    /// assert_eq!((pool.capacity(), pool.free_blocks()), (8, 5));
    /// r.cancel().quiesced();
    /// ```
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Free blocks now.
    pub fn free_blocks(&self) -> usize {
        self.state.lock().count(BlockState::Free)
    }
    /// True when `block` is held by a reservation (live, cancelled-not-quiesced, or orphaned).
    pub fn is_reserved(&self, block: u32) -> bool {
        let st = self.state.lock();
        st.states
            .get(block as usize)
            .is_some_and(|s| s.counts_as_reserved())
    }
    /// Blocks of reservations dropped without an outcome.
    pub fn orphaned_blocks(&self) -> usize {
        self.state.lock().count(BlockState::Orphaned)
    }
    /// Frees orphaned blocks. Call only once the transfer engine quiesced
    /// every transfer that may have targeted them (e.g. after draining its streams).
    pub fn reclaim_orphans_after_quiesce(&self) -> usize {
        let mut st = self.state.lock();
        let orphans: Vec<u32> = (0..st.states.len() as u32)
            .filter(|&b| st.states[b as usize] == BlockState::Orphaned)
            .collect();
        st.shift(&orphans, BlockState::Orphaned, BlockState::Free);
        orphans.len()
    }
}

/// Blocks reserved for one incoming fetch.
///
/// End it with [`DestinationReservation::complete`] (the fetch delivered:
/// the blocks hold valid KV, and stay out of the pool while the returned
/// [`CompletedBlocks`] is held) or [`DestinationReservation::cancel`] followed by
/// [`CancelledReservation::quiesced`]. Dropped without either, its blocks
/// become orphaned: still unusable until
/// [`DestinationPool::reclaim_orphans_after_quiesce`].
#[derive(Debug)]
pub struct DestinationReservation {
    pool: DestinationPool,
    blocks: Vec<u32>,
    settled: bool,
}

impl DestinationReservation {
    /// Reserved block ids, in fetch order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
    /// The fetch delivered every byte: the blocks hold valid KV. They stay
    /// out of the pool (no later reservation can overwrite them) until the
    /// returned [`CompletedBlocks`] is dropped, once the caller's cache has
    /// copied or stopped using them.
    pub fn complete(mut self) -> CompletedBlocks {
        self.settled = true;
        let blocks = std::mem::take(&mut self.blocks);
        self.pool
            .shift(&blocks, BlockState::Reserved, BlockState::Completed);
        CompletedBlocks {
            pool: self.pool.clone(),
            blocks,
        }
    }
    /// The fetch was abandoned; blocks stay reserved until quiesced.
    pub fn cancel(mut self) -> CancelledReservation {
        self.settled = true;
        CancelledReservation {
            pool: self.pool.clone(),
            blocks: std::mem::take(&mut self.blocks),
            released: false,
        }
    }
}

impl Drop for DestinationReservation {
    fn drop(&mut self) {
        if !self.settled {
            self.pool
                .shift(&self.blocks, BlockState::Reserved, BlockState::Orphaned);
            tracing::warn!(
                blocks = self.blocks.len(),
                "destination reservation dropped without outcome; orphaned"
            );
        }
    }
}

/// The blocks of a completed fetch, holding its KV: block ids in fetch
/// order (derefs to `[u32]`). While this is held no reservation of the pool
/// can include them; dropping it returns them to the pool free.
///
/// Why a guard and not plain ids: when completion freed the blocks at once,
/// a second fetch on the same pool could reserve and overwrite them before
/// the first request's cache had read them.
///
/// ```
/// use kv_bank::DestinationPool;
/// let pool = DestinationPool::new(4);
/// let done = pool.reserve(2).unwrap().complete();
/// assert_eq!(&done[..], &[0, 1]);
/// assert_eq!(pool.reserve(2).unwrap().blocks(), &[2, 3]); // not 0, 1
/// drop(done);
/// assert_eq!(pool.free_blocks(), 2); // 0 and 1 are free again
/// ```
#[derive(Debug)]
pub struct CompletedBlocks {
    pool: DestinationPool,
    blocks: Vec<u32>,
}

impl std::ops::Deref for CompletedBlocks {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.blocks
    }
}

impl PartialEq for CompletedBlocks {
    fn eq(&self, other: &Self) -> bool {
        self.blocks == other.blocks
    }
}

impl Eq for CompletedBlocks {}

impl Drop for CompletedBlocks {
    fn drop(&mut self) {
        self.pool
            .shift(&self.blocks, BlockState::Completed, BlockState::Free);
    }
}

/// A cancelled fetch whose writes may still be in flight.
#[derive(Debug)]
pub struct CancelledReservation {
    pool: DestinationPool,
    blocks: Vec<u32>,
    released: bool,
}

impl CancelledReservation {
    /// Block ids still reserved.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
    /// The transfer engine confirmed no write is in flight: blocks are free again.
    pub fn quiesced(mut self) {
        self.released = true;
        self.pool
            .shift(&self.blocks, BlockState::Reserved, BlockState::Free);
    }
}

impl Drop for CancelledReservation {
    fn drop(&mut self) {
        if !self.released {
            self.pool
                .shift(&self.blocks, BlockState::Reserved, BlockState::Orphaned);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The pool against a model of four ordered sets (the representation
    //! this one replaced), under random sequences of every operation.

    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(usize),
        ReserveExact(Vec<u32>),
        Complete(usize),
        Cancel(usize),
        Quiesce(usize),
        Orphan(usize),
        Release(usize),
        Reclaim,
    }

    fn op(cap: u32) -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..cap as usize + 2).prop_map(Op::Reserve),
            proptest::collection::vec(0..cap + 2, 0..6).prop_map(Op::ReserveExact),
            any::<usize>().prop_map(Op::Complete),
            any::<usize>().prop_map(Op::Cancel),
            any::<usize>().prop_map(Op::Quiesce),
            any::<usize>().prop_map(Op::Orphan),
            any::<usize>().prop_map(Op::Release),
            Just(Op::Reclaim),
        ]
    }

    /// Model: the free set, and which blocks each handle holds.
    struct Model {
        free: BTreeSet<u32>,
        orphaned: BTreeSet<u32>,
    }

    proptest! {
        #[test]
        fn the_pool_matches_a_model_of_ordered_sets(cap in 1u32..140, ops in proptest::collection::vec(op(140), 1..60)) {
            let pool = DestinationPool::new(cap);
            let mut m = Model { free: (0..cap).collect(), orphaned: BTreeSet::new() };
            let (mut live, mut cancelled, mut done) = (Vec::new(), Vec::new(), Vec::new());
            for o in ops {
                match o {
                    Op::Reserve(n) => match pool.reserve(n) {
                        Ok(r) => {
                            let want: Vec<u32> = m.free.iter().take(n).copied().collect();
                            prop_assert_eq!(r.blocks(), &want[..]);
                            for b in &want { m.free.remove(b); }
                            live.push(r);
                        }
                        Err(BankError::DestinationFull { needed, free }) => {
                            prop_assert_eq!((needed, free), (n, m.free.len()));
                            prop_assert!(n > m.free.len());
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    },
                    Op::ReserveExact(ids) => {
                        let bad = ids.iter().enumerate().find(|&(i, &b)| b >= cap || ids[..i].contains(&b));
                        let held = ids.iter().find(|b| !m.free.contains(b));
                        match pool.reserve_exact(&ids) {
                            Ok(r) => {
                                prop_assert!(bad.is_none() && held.is_none());
                                prop_assert_eq!(r.blocks(), &ids[..]);
                                for b in &ids { m.free.remove(b); }
                                live.push(r);
                            }
                            Err(BankError::BlockOutOfRange { index, block, capacity }) => {
                                prop_assert_eq!((Some((index, &block)), capacity), (bad, cap));
                                prop_assert!(block >= cap);
                            }
                            Err(BankError::DuplicateBlock { index, block, first }) => {
                                prop_assert_eq!(Some((index, &block)), bad);
                                prop_assert_eq!(ids.iter().position(|&b| b == block), Some(first));
                            }
                            Err(BankError::AlreadyReserved { block }) => {
                                prop_assert!(bad.is_none());
                                prop_assert_eq!(Some(&block), held);
                            }
                            Err(e) => prop_assert!(false, "{e}"),
                        }
                    }
                    Op::Complete(i) if !live.is_empty() => {
                        let r: DestinationReservation = live.swap_remove(i % live.len());
                        done.push(r.complete());
                    }
                    Op::Cancel(i) if !live.is_empty() => {
                        cancelled.push(live.swap_remove(i % live.len()).cancel());
                    }
                    Op::Quiesce(i) if !cancelled.is_empty() => {
                        let c: CancelledReservation = cancelled.swap_remove(i % cancelled.len());
                        m.free.extend(c.blocks().iter().copied());
                        c.quiesced();
                    }
                    Op::Orphan(i) if !live.is_empty() => {
                        let r = live.swap_remove(i % live.len());
                        m.orphaned.extend(r.blocks().iter().copied());
                        drop(r);
                    }
                    Op::Release(i) if !done.is_empty() => {
                        let d: CompletedBlocks = done.swap_remove(i % done.len());
                        m.free.extend(d.iter().copied());
                    }
                    Op::Reclaim => {
                        prop_assert_eq!(pool.reclaim_orphans_after_quiesce(), m.orphaned.len());
                        m.free.append(&mut m.orphaned);
                    }
                    _ => {}
                }
                pool.state.lock().check();
                prop_assert_eq!(pool.free_blocks(), m.free.len());
                prop_assert_eq!(pool.orphaned_blocks(), m.orphaned.len());
                let held: BTreeSet<u32> = live.iter().flat_map(|r| r.blocks().to_vec())
                    .chain(cancelled.iter().flat_map(|c| c.blocks().to_vec()))
                    .chain(m.orphaned.iter().copied())
                    .collect();
                for b in 0..cap + 1 {
                    prop_assert_eq!(pool.is_reserved(b), held.contains(&b), "block {}", b);
                }
            }
            for c in cancelled { c.quiesced(); }
            drop((live, done));
        }
    }
}
