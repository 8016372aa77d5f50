//! Two copies of a state machine, so that readers never wait for the writer
//! (the *left-right* scheme, built on `arc_swap` and `Arc` with no unsafe code).
//!
//! Readers load the published copy through an [`ArcSwap`]: no lock and, on
//! its fast path, no write to any cache line another thread reads, so
//! lookups scale with threads and never queue behind event application. One
//! writer at a time (a mutex) mutates the *standby* copy, publishes it with
//! one pointer swap, and takes the previous copy back as its new standby.
//! Before its next write it waits until no reader still holds that copy
//! (`Arc::get_mut` succeeds once the last reader's guard is gone; readers hold
//! a copy for one lookup, microseconds) and replays the mutations the copy
//! missed. Both copies apply the same mutations in the same order through
//! the same deterministic [`Replay::apply`], so they are equal after a replay.
//!
//! Costs: twice the memory, every mutation applied twice (the replay runs
//! while the writer lock is held, not while a reader waits), one pointer swap
//! per write call (batches amortize it).
//!
//! Memory ordering: a reader's last access to a copy happens-before the
//! writer's first mutation of it, by the same guarantee that lets
//! `arc_swap` free a swapped-out value: its guards pay their debt into the
//! `Arc` strong count (released on drop), and `Arc::get_mut` acquires it.

use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

/// A deterministic state machine: the same mutations, applied in the same
/// order to equal states, leave equal states and give equal results.
pub(crate) trait Replay {
    /// One mutation, kept for the replay on the other copy.
    type Op;
    /// What applying it reports.
    type Out;
    /// Applies `op`. Must depend only on `self` and `op` (no clocks, no
    /// random state, no iteration over randomly seeded hash maps).
    fn apply(&mut self, op: &Self::Op) -> Self::Out;
}

/// The writer's side: the unpublished copy and what it has not seen yet.
struct Standby<S: Replay> {
    copy: Arc<S>,
    missed: Vec<S::Op>,
}

/// Readers: [`Twin::read`]; the one writer: [`Twin::write`].
pub(crate) struct Twin<S: Replay> {
    live: ArcSwap<S>,
    writer: Mutex<Standby<S>>,
}

/// Mutations of one [`Twin::write`] call, applied to the standby copy.
pub(crate) struct Batch<'a, S: Replay> {
    state: &'a mut S,
    log: &'a mut Vec<S::Op>,
}

impl<S: Replay> Batch<'_, S> {
    /// Applies `op` to the standby copy and keeps it for the other one.
    pub(crate) fn apply(&mut self, op: S::Op) -> S::Out {
        let out = self.state.apply(&op);
        self.log.push(op);
        out
    }
}

impl<S: Replay> Twin<S> {
    /// Two copies that must be equal (built the same way).
    pub(crate) fn new(a: S, b: S) -> Self {
        Self {
            live: ArcSwap::from_pointee(a),
            writer: Mutex::new(Standby {
                copy: Arc::new(b),
                missed: Vec::new(),
            }),
        }
    }

    /// The published copy: every write that returned before this call is in
    /// it. Hold the guard briefly: the writer's next write waits for it.
    #[inline]
    pub(crate) fn read(&self) -> Guard<Arc<S>> {
        self.live.load()
    }

    /// Runs `f` on the standby copy (after bringing it up to date), then
    /// publishes it if `f` applied anything. Writers are serialized.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut Batch<'_, S>) -> R) -> R {
        let mut guard = self.writer.lock();
        let standby = &mut *guard;
        let state = exclusive(&mut standby.copy);
        for op in &standby.missed {
            state.apply(op);
        }
        standby.missed.clear();
        let mut batch = Batch {
            state,
            log: &mut standby.missed,
        };
        let out = f(&mut batch);
        if !standby.missed.is_empty() {
            // The swap pays every reader's debt on the old copy into its
            // strong count, so `exclusive` sees them all.
            let old = self.live.swap(Arc::clone(&standby.copy));
            standby.copy = old;
        }
        out
    }

    /// Both copies after a replay, for tests that they stay equal.
    #[cfg(test)]
    pub(crate) fn both(&self) -> (Arc<S>, Arc<S>) {
        self.write(|_| ());
        let standby = self.writer.lock();
        (self.live.load_full(), Arc::clone(&standby.copy))
    }
}

/// Spins before [`exclusive`] yields: ~40-150 µs of `pause`, longer than
/// a lookup holds a copy (µs), so the writer yields only for a descheduled
/// reader; a yield on a loaded machine can cost a whole time slice.
const SPINS_BEFORE_YIELD: u32 = 4096;

/// `&mut` to the copy once no reader holds it. Readers hold a copy for one
/// lookup, so this spins, then yields (a reader may be descheduled).
fn exclusive<S>(copy: &mut Arc<S>) -> &mut S {
    let mut spins = 0u32;
    while Arc::get_mut(copy).is_none() {
        if spins < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        spins = spins.saturating_add(1);
    }
    Arc::get_mut(copy).expect("no reader holds the standby copy")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A log whose invariant (`sum == len * (len - 1) / 2` when it holds
    /// `0..len`) a torn or stale-mutated copy would break.
    #[derive(Default, PartialEq, Eq, Debug)]
    struct Seq {
        items: Vec<u64>,
        sum: u64,
    }

    impl Replay for Seq {
        type Op = u64;
        type Out = usize;
        fn apply(&mut self, op: &u64) -> usize {
            self.items.push(*op);
            self.sum += op;
            self.items.len()
        }
    }

    #[test]
    fn copies_stay_equal_and_readers_see_whole_writes() {
        let twin = Arc::new(Twin::new(Seq::default(), Seq::default()));
        let done = Arc::new(AtomicBool::new(false));
        let start = Arc::new(std::sync::Barrier::new(4));
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (twin, done, start) = (twin.clone(), done.clone(), start.clone());
                std::thread::spawn(move || {
                    let mut last = 0usize;
                    let mut reads = 0u64;
                    start.wait();
                    loop {
                        let finished = done.load(Ordering::Acquire);
                        let s = twin.read();
                        let n = s.items.len() as u64;
                        // Writes add pairs (2k, 2k + 1) in one batch: a reader
                        // sees whole batches, in order, never going back.
                        assert_eq!(n % 2, 0, "half a batch visible");
                        assert_eq!(s.sum, n * n.saturating_sub(1) / 2);
                        assert!(s.items.iter().enumerate().all(|(i, &v)| v == i as u64));
                        assert!(s.items.len() >= last);
                        last = s.items.len();
                        reads += 1;
                        if finished {
                            break reads;
                        }
                    }
                })
            })
            .collect();
        start.wait();
        for k in 0..300u64 {
            let len = twin.write(|b| {
                b.apply(2 * k);
                b.apply(2 * k + 1)
            });
            assert_eq!(len as u64, 2 * k + 2);
            // Read-your-writes: the write is published when `write` returns.
            assert_eq!(twin.read().items.len() as u64, 2 * k + 2);
        }
        done.store(true, Ordering::Release);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
        let (live, standby) = twin.both();
        assert_eq!(live.items.len(), 600);
        assert_eq!(*live, *standby);
    }

    #[test]
    fn a_write_that_applies_nothing_publishes_nothing() {
        let twin = Twin::new(Seq::default(), Seq::default());
        twin.write(|b| b.apply(0));
        let before = twin.read_full_ptr();
        twin.write(|_| ());
        assert_eq!(before, twin.read_full_ptr());
    }

    impl<S: Replay> Twin<S> {
        fn read_full_ptr(&self) -> *const S {
            Arc::as_ptr(&self.live.load_full())
        }
    }
}
