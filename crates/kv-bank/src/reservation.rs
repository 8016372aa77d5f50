//! Destination reservations on the fetching side: native cache blocks that
//! an incoming fetch writes into.
//!
//! A reserved block cannot be handed out again until its fetch either
//! completed, or was cancelled *and* quiesced (the transfer engine confirmed
//! no write to it is still in flight). Cancelling alone is not enough: a copy
//! already queued on a GPU stream could still land in a block that was
//! reused, corrupting another request's KV.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::{leaks, BankError};

#[derive(Debug)]
struct PoolState {
    free: BTreeSet<u32>,
    /// Reserved by a live or cancelled-not-quiesced reservation.
    reserved: BTreeSet<u32>,
    /// Blocks of reservations dropped without complete/cancel+quiesce.
    orphaned: BTreeSet<u32>,
    /// Blocks of completed fetches whose [`CompletedBlocks`] is still held:
    /// they hold a request's KV and are not free for another fetch.
    completed: BTreeSet<u32>,
}

/// The four states a block of the pool can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    Free,
    Reserved,
    Orphaned,
    Completed,
}

impl BlockState {
    /// Counted in [`leaks::RESERVED_BLOCKS`]: held by a reservation that has
    /// not ended (live, cancelled-not-quiesced, or orphaned).
    fn counts_as_reserved(self) -> bool {
        matches!(self, BlockState::Reserved | BlockState::Orphaned)
    }
}

impl PoolState {
    fn set(&mut self, s: BlockState) -> &mut BTreeSet<u32> {
        match s {
            BlockState::Free => &mut self.free,
            BlockState::Reserved => &mut self.reserved,
            BlockState::Orphaned => &mut self.orphaned,
            BlockState::Completed => &mut self.completed,
        }
    }

    /// Moves `blocks` from state `from` to `to`; the leak counter follows
    /// from the two states, so no caller keeps it by hand.
    fn shift(&mut self, blocks: &[u32], from: BlockState, to: BlockState) {
        for b in blocks {
            self.set(from).remove(b);
            self.set(to).insert(*b);
        }
        let n = blocks.len() as u64;
        match (from.counts_as_reserved(), to.counts_as_reserved()) {
            (false, true) => leaks::RESERVED_BLOCKS.add(n),
            (true, false) => leaks::RESERVED_BLOCKS.sub(n),
            _ => {}
        }
    }
}

impl Drop for PoolState {
    fn drop(&mut self) {
        // The pool (the native cache it stands for) is gone, and its blocks with it.
        leaks::RESERVED_BLOCKS.sub((self.reserved.len() + self.orphaned.len()) as u64);
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
    /// Ids are `0..capacity`; each is in exactly one of the state's sets.
    capacity: u32,
}

impl DestinationPool {
    /// A pool of `capacity` free blocks, ids `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            state: Arc::new(Mutex::new(PoolState {
                free: (0..capacity).collect(),
                reserved: BTreeSet::new(),
                orphaned: BTreeSet::new(),
                completed: BTreeSet::new(),
            })),
        }
    }

    /// Reserves the `n` lowest free blocks.
    ///
    /// # Errors
    /// [`BankError::DestinationFull`] when fewer than `n` are free (nothing reserved).
    pub fn reserve(&self, n: usize) -> Result<DestinationReservation, BankError> {
        let mut st = self.state.lock();
        if st.free.len() < n {
            return Err(BankError::DestinationFull {
                needed: n,
                free: st.free.len(),
            });
        }
        let blocks: Vec<u32> = st.free.iter().take(n).copied().collect();
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
        if let Some(&block) = blocks.iter().find(|b| !st.free.contains(b)) {
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
        let mut seen = std::collections::HashMap::with_capacity(blocks.len());
        for (index, &block) in blocks.iter().enumerate() {
            if block >= self.capacity {
                return Err(BankError::BlockOutOfRange {
                    index,
                    block,
                    capacity: self.capacity,
                });
            }
            if let Some(&first) = seen.get(&block) {
                return Err(BankError::DuplicateBlock {
                    index,
                    block,
                    first,
                });
            }
            seen.insert(block, index);
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
        self.state.lock().free.len()
    }
    /// True when `block` is held by a reservation (live, cancelled-not-quiesced, or orphaned).
    pub fn is_reserved(&self, block: u32) -> bool {
        let st = self.state.lock();
        st.reserved.contains(&block) || st.orphaned.contains(&block)
    }
    /// Blocks of reservations dropped without an outcome.
    pub fn orphaned_blocks(&self) -> usize {
        self.state.lock().orphaned.len()
    }
    /// Frees orphaned blocks. Call only once the transfer engine quiesced
    /// every transfer that may have targeted them (e.g. after draining its streams).
    pub fn reclaim_orphans_after_quiesce(&self) -> usize {
        let mut st = self.state.lock();
        let orphans: Vec<u32> = st.orphaned.iter().copied().collect();
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
