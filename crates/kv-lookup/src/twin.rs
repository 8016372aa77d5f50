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
//! and one wait for readers per write call (batches amortize them). A
//! mutation's first application may leave work for its replay (its
//! [`Replay::Memo`]), as long as the replay's result is the one it would
//! compute itself (the index's full-map answers and worker-log
//! compactions). State that only mutations need exists once
//! ([`Replay::Shared`], the index's full hash maps): the first application
//! reads and updates it, the replay works from the memo alone.
//!
//! Writers that arrive together are *combined* ([`Twin::submit`], flat
//! combining): each queues its mutation, then takes the writer lock; the
//! first to get it applies every queued mutation in one batch, publishes
//! once and leaves the others' results for them; a writer that finds its
//! result waiting returns it without touching a copy. Without this, `E`
//! event threads each paid the wait for readers and the swap per event, and
//! their lock convoy cut events/s as `E` grew (16-core rows in
//! `benches/RESULTS.md`: 69k events/s at one event thread, 38k at eight).
//! A batch holds at most one mutation per submitting thread, so a combiner
//! works for at most that many others.
//!
//! A write that panics while applying (a bug in [`Replay::apply`]) leaves
//! the twin *poisoned*: the published copy is whole and stays readable,
//! every later write panics instead of building on a half-applied standby
//! copy and shared state.
//!
//! Checked by loom (`twin/model_tests.rs`, `cargo xtask loom`): every
//! interleaving of two or three threads up to 5 preemptions, on loom's
//! primitives (`twin/sync.rs`; `arc_swap` is modeled by what it guarantees,
//! a mutex around an `Arc`), for: a writer never mutates a copy a reader
//! holds, readers see whole batches in order, combined submitters get their
//! own results in call order with every op applied once, and an inspection
//! inside a read gives up instead of deadlocking with a writer waiting for
//! that copy. Each fails on the deliberate break it names (no wait for
//! readers; a blocking inspection; a combiner dropping others' results).
//!
//! Memory ordering: a reader's last access to a copy happens-before the
//! writer's first mutation of it, by the same guarantee that lets
//! `arc_swap` free a swapped-out value: its guards pay their debt into the
//! `Arc` strong count (released on drop), and `Arc::get_mut` acquires it.

use std::sync::atomic::Ordering;

mod sync;
use sync::{relax, Arc, AtomicU64, Mutex, Published, ReadGuard};

/// A deterministic state machine: the same mutations, applied in the same
/// order to equal states, leave equal states and give equal results.
pub(crate) trait Replay {
    /// One mutation, kept for the replay on the other copy.
    type Op;
    /// What applying it reports.
    type Out;
    /// State only mutations read and write, kept once for both copies on
    /// the writer's side (readers never see it; see [`Pass`]).
    type Shared;
    /// What an op's first application leaves for its replay.
    type Memo: Default;
    /// Applies `op`. Must depend only on `self`, `op` and the pass (no
    /// clocks, no random state, no iteration over randomly seeded hash
    /// maps), so that the replay leaves the other copy equal.
    fn apply(&mut self, op: &Self::Op, pass: Pass<'_, Self>) -> Self::Out;
}

/// Which application of an op this is.
pub(crate) enum Pass<'a, S: Replay + ?Sized> {
    /// The first, on the copy about to be published: the writer's shared
    /// state (which it updates) and the op's memo to fill.
    First {
        shared: &'a mut S::Shared,
        memo: &'a mut S::Memo,
    },
    /// The replay on the other copy, with what the first left. The shared
    /// state already reflects the op (and maybe later ones): a replay must
    /// take what it needs from the memo.
    Replay { memo: &'a mut S::Memo },
}

/// The writer's side: the unpublished copy and what it has not seen yet.
struct Standby<S: Replay> {
    copy: Arc<S>,
    /// Ops the copy has not seen, with their first application's memos.
    missed: Vec<(S::Op, S::Memo)>,
    /// The writer-side state of both copies.
    shared: S::Shared,
    /// Set while a write applies and left set if it unwinds (a panic in
    /// [`Replay::apply`]): the standby copy, its log and the shared state
    /// may then disagree, so no later write may build on them. The
    /// published copy is whole and stays readable.
    poisoned: bool,
    /// Results a combiner left for submitters that have not taken them yet,
    /// by ticket; at most one per waiting thread.
    done: Vec<(u64, S::Out)>,
    /// The queue's vector between batches (swapped in, so draining the
    /// queue allocates nothing in the steady state).
    spare: Vec<(u64, S::Op)>,
}

/// Mutations submitted and not yet taken by a combiner, with their tickets.
struct Queue<Op> {
    next_ticket: u64,
    ops: Vec<(u64, Op)>,
}

/// Readers: [`Twin::read`]; writers: [`Twin::write`], [`Twin::submit`].
pub(crate) struct Twin<S: Replay> {
    live: Published<S>,
    writer: Mutex<Standby<S>>,
    /// Locked only to push or drain (never while applying), and always
    /// after `writer` when both are held, so the two cannot deadlock.
    queue: Mutex<Queue<S::Op>>,
    /// Publications so far (one per write that applied anything). Only the
    /// writer (under `writer`) adds to it; read without a lock.
    published: AtomicU64,
}

/// Mutations of one [`Twin::write`] call, applied to the standby copy.
pub(crate) struct Batch<'a, S: Replay> {
    state: &'a mut S,
    shared: &'a mut S::Shared,
    log: &'a mut Vec<(S::Op, S::Memo)>,
}

impl<S: Replay> Batch<'_, S> {
    /// Applies `op` to the standby copy and keeps it for the other one.
    pub(crate) fn apply(&mut self, op: S::Op) -> S::Out {
        let mut memo = S::Memo::default();
        let out = self.state.apply(
            &op,
            Pass::First {
                shared: self.shared,
                memo: &mut memo,
            },
        );
        self.log.push((op, memo));
        out
    }
}

impl<S: Replay> Twin<S> {
    /// Two copies that must be equal (built the same way), and the
    /// writer's state that goes with them.
    pub(crate) fn new(a: S, b: S, shared: S::Shared) -> Self {
        Self {
            live: Published::new(a),
            writer: Mutex::new(Standby {
                copy: Arc::new(b),
                missed: Vec::new(),
                shared,
                poisoned: false,
                done: Vec::new(),
                spare: Vec::new(),
            }),
            queue: Mutex::new(Queue {
                next_ticket: 0,
                ops: Vec::new(),
            }),
            published: AtomicU64::new(0),
        }
    }

    /// The published copy: every write that returned before this call is in
    /// it. Hold the guard briefly: the writer's next write waits for it.
    #[inline]
    pub(crate) fn read(&self) -> ReadGuard<S> {
        self.live.load()
    }

    /// Runs `f` on the standby copy (after bringing it up to date), then
    /// publishes it if `f` applied anything. Writers are serialized.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut Batch<'_, S>) -> R) -> R {
        let mut guard = self.writer.lock();
        self.write_locked(&mut guard, f)
    }

    /// Applies `op` and publishes it before returning, like a
    /// [`Twin::write`] of one mutation, but combined with the mutations
    /// other threads submit at the same time (see the module docs): one of
    /// the callers applies them all in one batch and publishes once.
    ///
    /// Each caller gets its own op's result. Per thread, ops apply in call
    /// order; ops of concurrent calls apply in queue order.
    ///
    /// # Panics
    /// When the thread that took this op panicked while applying its batch
    /// (a bug in [`Replay::apply`]); the op's effect is then unknown, and
    /// every later write panics too (the twin is *poisoned*: its standby
    /// copy, log and shared state may disagree), while readers keep the
    /// last published copy.
    pub(crate) fn submit(&self, op: S::Op) -> S::Out {
        let ticket = {
            let mut q = self.queue.lock();
            let t = q.next_ticket;
            q.next_ticket += 1;
            q.ops.push((t, op));
            t
        };
        let mut guard = self.writer.lock();
        // A combiner that took our op left its result here before it
        // released the lock we now hold.
        if let Some(i) = guard.done.iter().position(|(t, _)| *t == ticket) {
            return guard.done.swap_remove(i).1;
        }
        // Otherwise no combiner has taken it: it is still queued and this
        // thread combines.
        let standby = &mut *guard;
        let mut ops = std::mem::take(&mut standby.spare);
        std::mem::swap(&mut self.queue.lock().ops, &mut ops);
        let mut done = std::mem::take(&mut standby.done);
        let mut mine = None;
        self.write_locked(standby, |b| {
            for (t, op) in ops.drain(..) {
                let out = b.apply(op);
                if t == ticket {
                    mine = Some(out);
                } else {
                    done.push((t, out));
                }
            }
        });
        standby.done = done;
        standby.spare = ops;
        mine.expect("a submitted op is queued until its submitter or a combiner applies it")
    }

    /// [`Twin::write`] with the writer lock held.
    fn write_locked<R>(
        &self,
        standby: &mut Standby<S>,
        f: impl FnOnce(&mut Batch<'_, S>) -> R,
    ) -> R {
        assert!(
            !standby.poisoned,
            "an earlier mutation of this index panicked while it was applied; \
             no later mutation applies (lookups still read the last published state)"
        );
        standby.poisoned = true;
        let state = exclusive(&mut standby.copy);
        for (op, memo) in &mut standby.missed {
            state.apply(op, Pass::Replay { memo });
        }
        standby.missed.clear();
        let mut batch = Batch {
            state,
            shared: &mut standby.shared,
            log: &mut standby.missed,
        };
        let out = f(&mut batch);
        if !standby.missed.is_empty() {
            // The swap pays every reader's debt on the old copy into its
            // strong count, so `exclusive` sees them all.
            let old = self.live.swap(Arc::clone(&standby.copy));
            standby.copy = old;
            // Relaxed: a counter for metrics and tests; the swap above is
            // what orders the copy for readers.
            self.published.fetch_add(1, Ordering::Relaxed);
        }
        standby.poisoned = false;
        out
    }

    /// Publications so far: one per write or combined batch that applied
    /// anything. Takes no lock; a publication in progress may be missed.
    pub(crate) fn publications(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Runs `f` on the published copy and the writer's shared state, with
    /// the writer lock held: no mutation is in progress, so the shared
    /// state is exactly the published copy's (every write publishes
    /// before it releases the lock). For queries that need the writer's
    /// state; they wait for writers like a writer (tests).
    #[cfg(test)]
    pub(crate) fn inspect<R>(&self, f: impl FnOnce(&S, &S::Shared) -> R) -> R {
        let standby = self.writer.lock();
        let live = self.live.load();
        f(&live, &standby.shared)
    }

    /// [`Twin::inspect`] if the writer lock is free within `wait` and no
    /// write panicked (see `poisoned`); `None` (and `f` not run) if not.
    pub(crate) fn try_inspect_for<R>(
        &self,
        wait: std::time::Duration,
        f: impl FnOnce(&S, &S::Shared) -> R,
    ) -> Option<R> {
        let standby = self.writer.try_lock_for(wait)?;
        if standby.poisoned {
            return None;
        }
        let live = self.live.load();
        Some(f(&live, &standby.shared))
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
        relax(spins, SPINS_BEFORE_YIELD);
        spins = spins.saturating_add(1);
    }
    Arc::get_mut(copy).expect("no reader holds the standby copy")
}

#[cfg(all(test, kv_loom))]
mod model_tests;

// Real threads: under `kv_loom` the primitives are loom's, usable only
// inside a model.
#[cfg(all(test, not(kv_loom)))]
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
        type Shared = ();
        type Memo = ();
        fn apply(&mut self, op: &u64, _: Pass<'_, Self>) -> usize {
            self.items.push(*op);
            self.sum += op;
            self.items.len()
        }
    }

    #[test]
    fn copies_stay_equal_and_readers_see_whole_writes() {
        let twin = Arc::new(Twin::new(Seq::default(), Seq::default(), ()));
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
        let twin = Twin::new(Seq::default(), Seq::default(), ());
        twin.write(|b| b.apply(0));
        let before = twin.read_full_ptr();
        twin.write(|_| ());
        assert_eq!(before, twin.read_full_ptr());
    }

    /// Ops submitted while another write holds the lock are applied by
    /// one of their submitters in one batch: one publication for all.
    #[test]
    fn submits_queued_behind_a_write_are_combined_into_one_publication() {
        let twin = Twin::new(Seq::default(), Seq::default(), ());
        std::thread::scope(|s| {
            let handles = twin.write(|b| {
                b.apply(0);
                let handles: Vec<_> = (1..=3u64)
                    .map(|k| {
                        let twin = &twin;
                        s.spawn(move || (k, twin.submit(k)))
                    })
                    .collect();
                // All three are queued before this write releases the lock.
                while twin.queue.lock().ops.len() < 3 {
                    std::thread::yield_now();
                }
                handles
            });
            let mut lens: Vec<usize> = handles
                .into_iter()
                .map(|h| {
                    let (k, len) = h.join().unwrap();
                    // Each submitter got the length after its own op.
                    assert_eq!(twin.read().items[len - 1], k);
                    len
                })
                .collect();
            lens.sort_unstable();
            assert_eq!(lens, [2, 3, 4]);
        });
        assert_eq!(twin.publications(), 2, "the write, then one combined batch");
        let (live, standby) = twin.both();
        assert_eq!(live.sum, 6);
        assert_eq!(*live, *standby);
        assert!(twin.queue.lock().ops.is_empty());
        assert!(twin.writer.lock().done.is_empty());
    }

    /// A state whose result names the op and where it landed, so a result
    /// handed to the wrong submitter shows.
    #[derive(Default, PartialEq, Eq, Debug)]
    struct Echo {
        items: Vec<u64>,
    }

    impl Replay for Echo {
        type Op = u64;
        type Out = (u64, usize);
        type Shared = ();
        type Memo = ();
        fn apply(&mut self, op: &u64, _: Pass<'_, Self>) -> (u64, usize) {
            self.items.push(*op);
            (*op, self.items.len() - 1)
        }
    }

    #[test]
    fn concurrent_submitters_get_their_own_results_in_call_order() {
        const THREADS: u64 = 4;
        const OPS: u64 = 2_000;
        let twin = Arc::new(Twin::new(Echo::default(), Echo::default(), ()));
        let reader_done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (twin, done) = (twin.clone(), reader_done.clone());
            std::thread::spawn(move || {
                let mut last = 0;
                while !done.load(Ordering::Acquire) {
                    let n = twin.read().items.len();
                    assert!(n >= last, "a published copy went back");
                    last = n;
                }
            })
        };
        let writers: Vec<_> = (0..THREADS)
            .map(|k| {
                let twin = twin.clone();
                std::thread::spawn(move || {
                    let mut last_pos = None;
                    for i in 0..OPS {
                        let op = k * 1_000_000 + i;
                        let (echo, pos) = twin.submit(op);
                        assert_eq!(echo, op, "another submitter's result");
                        assert!(last_pos < Some(pos), "applied out of call order");
                        last_pos = Some(pos);
                        // Read-your-writes.
                        assert_eq!(twin.read().items[pos], op);
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        reader_done.store(true, Ordering::Release);
        reader.join().unwrap();
        let (live, standby) = twin.both();
        assert_eq!(*live, *standby);
        assert_eq!(live.items.len() as u64, THREADS * OPS);
        for k in 0..THREADS {
            let mine: Vec<u64> = live
                .items
                .iter()
                .copied()
                .filter(|v| v / 1_000_000 == k)
                .collect();
            let want: Vec<u64> = (0..OPS).map(|i| k * 1_000_000 + i).collect();
            assert_eq!(mine, want);
        }
        assert!(twin.publications() <= THREADS * OPS);
        assert!(twin.writer.lock().done.is_empty());
    }

    /// A write whose op panics mid-apply leaves the published copy as it
    /// was and readable, and every later write panics naming the cause
    /// instead of building on a half-applied standby copy.
    #[test]
    fn a_panic_while_applying_poisons_later_writes_but_not_reads() {
        /// `Seq`, but op 99 panics after its half of the work.
        #[derive(Default)]
        struct Fragile(Seq);
        impl Replay for Fragile {
            type Op = u64;
            type Out = usize;
            type Shared = ();
            type Memo = ();
            fn apply(&mut self, op: &u64, pass: Pass<'_, Self>) -> usize {
                let pass = match pass {
                    Pass::First { .. } => Pass::First {
                        shared: &mut (),
                        memo: &mut (),
                    },
                    Pass::Replay { .. } => Pass::Replay { memo: &mut () },
                };
                let n = self.0.apply(op, pass);
                assert_ne!(*op, 99, "op 99 fails mid-apply");
                n
            }
        }
        let twin = Twin::new(Fragile::default(), Fragile::default(), ());
        assert_eq!(twin.write(|b| b.apply(1)), 1);
        let quiet = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            twin.write(|b| {
                b.apply(2);
                b.apply(99)
            })
        }));
        assert!(quiet.is_err());
        // Readers see the last whole publication.
        assert_eq!(twin.read().0.items, [1]);
        assert_eq!(twin.publications(), 1);
        assert!(twin
            .try_inspect_for(std::time::Duration::ZERO, |_, _| ())
            .is_none());
        let later =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| twin.write(|b| b.apply(3))));
        let msg = later.expect_err("a later write panics");
        let msg = msg
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| msg.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(
            msg.contains("an earlier mutation of this index panicked"),
            "{msg}"
        );
        assert_eq!(twin.read().0.items, [1]);
    }

    impl<S: Replay> Twin<S> {
        fn read_full_ptr(&self) -> *const S {
            Arc::as_ptr(&self.live.load_full())
        }
    }
}
