//! Loom model tests of the left-right protocol: every interleaving of the
//! twin's locks, swap, reader holds and waits with up to 5 preemptions
//! (68,159 for the combining model), on loom's primitives (`twin/sync.rs`). Run with `cargo xtask loom`
//! (`RUSTFLAGS="--cfg kv_loom" cargo test -p kv-lookup --lib --release twin::model`,
//! its own target directory).
//!
//! What is checked, in every explored interleaving:
//! - the writer never mutates a copy while a reader holds it (each reader
//!   announces itself on the copy with an atomic that the mutation checks;
//!   an interleaving in which both overlap fails the model);
//! - a reader sees whole batches, in order, never going back;
//! - the replay leaves the second copy as the first application left the
//!   first (the memo check), and both copies end equal;
//! - combined submitters each get their own op's result, one thread's ops
//!   apply in its call order, every op applies exactly once, and no result
//!   is left behind.

use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;

use super::{Pass, Replay, Twin};

/// A log with a count of the readers inside it right now.
#[derive(Default)]
struct Log {
    items: Vec<u64>,
    readers: AtomicUsize,
}

impl Replay for Log {
    type Op = u64;
    type Out = usize;
    /// First applications so far.
    type Shared = u64;
    /// The log's length after the first application.
    type Memo = usize;

    fn apply(&mut self, op: &u64, pass: Pass<'_, Self>) -> usize {
        assert_eq!(
            self.readers.load(SeqCst),
            0,
            "the writer mutates a copy a reader holds"
        );
        self.items.push(*op);
        let len = self.items.len();
        match pass {
            Pass::First { shared, memo } => {
                *shared += 1;
                *memo = len;
            }
            Pass::Replay { memo } => assert_eq!(*memo, len, "replay diverged"),
        }
        assert_eq!(
            self.readers.load(SeqCst),
            0,
            "a reader entered a copy being mutated"
        );
        len
    }
}

/// Reads the published copy as a lookup does (hold, read, release) and
/// returns its items.
fn read(twin: &Twin<Log>) -> Vec<u64> {
    let copy = twin.read();
    copy.readers.fetch_add(1, SeqCst);
    let items = copy.items.clone();
    copy.readers.fetch_sub(1, SeqCst);
    items
}

/// Runs `f` under every interleaving with up to 5 preemptions and returns
/// how many loom ran (printed, and checked to be more than one: a model
/// that never branches checks nothing). Unbounded, the lock's and the
/// writer's wait loops make the space too large for CI (minutes).
fn model(f: impl Fn() + Sync + Send + 'static) -> usize {
    model_bounded(Some(5), f)
}

/// [`model`] with at most `preemptions` preemptions per interleaving
/// (`None`: exhaustive).
fn model_bounded(preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) -> usize {
    use std::sync::atomic::{AtomicUsize as StdCount, Ordering::Relaxed};
    let count = std::sync::Arc::new(StdCount::new(0));
    let mut b = loom::model::Builder::new();
    b.preemption_bound = preemptions;
    let runs = count.clone();
    b.check(move || {
        runs.fetch_add(1, Relaxed);
        f()
    });
    let runs = count.load(Relaxed);
    println!("{runs} interleavings");
    assert!(runs > 1, "{runs} interleaving(s)");
    runs
}

#[test]
fn model_readers_never_share_a_copy_with_the_writer_and_see_whole_batches() {
    model(|| {
        let twin = Arc::new(Twin::new(Log::default(), Log::default(), 0));
        let writer = {
            let twin = twin.clone();
            thread::spawn(move || {
                for k in 0..3u64 {
                    let len = twin.write(|b| {
                        b.apply(2 * k);
                        b.apply(2 * k + 1)
                    });
                    assert_eq!(len as u64, 2 * k + 2);
                }
            })
        };
        let mut last = 0;
        for _ in 0..3 {
            let items = read(&twin);
            assert_eq!(items.len() % 2, 0, "half a batch visible: {items:?}");
            assert!(items.iter().enumerate().all(|(i, &v)| v == i as u64));
            assert!(items.len() >= last, "went back from {last} to {items:?}");
            last = items.len();
        }
        writer.join().unwrap();
        // Read-your-writes once the writer returned.
        assert_eq!(read(&twin), [0, 1, 2, 3, 4, 5]);
        let (live, standby) = twin.both();
        assert_eq!(live.items, standby.items);
        assert_eq!(twin.inspect(|_, first_applications| *first_applications), 6);
    });
}

#[test]
fn model_combined_submitters_get_their_own_results_in_call_order() {
    model(|| {
        let twin = Arc::new(Twin::new(Log::default(), Log::default(), 0));
        let a = {
            let twin = twin.clone();
            thread::spawn(move || (twin.submit(1), twin.submit(2)))
        };
        let b = {
            let twin = twin.clone();
            thread::spawn(move || twin.submit(10))
        };
        let seen = read(&twin);
        let (a1, a2) = a.join().unwrap();
        let b1 = b.join().unwrap();
        assert!(a1 < a2, "thread a's ops out of call order: {a1}, {a2}");
        let mut lens = [a1, a2, b1];
        lens.sort_unstable();
        assert_eq!(lens, [1, 2, 3], "each op applied once, each result its own");
        let (live, standby) = twin.both();
        assert_eq!(live.items, standby.items);
        let items = &live.items;
        assert_eq!(items[a1 - 1], 1);
        assert_eq!(items[a2 - 1], 2);
        assert_eq!(items[b1 - 1], 10);
        assert!(
            items.starts_with(&seen),
            "{seen:?} is not a prefix of {items:?}"
        );
        assert!(
            twin.writer.lock().done.is_empty(),
            "a result was left behind"
        );
        assert_eq!(twin.inspect(|_, first_applications| *first_applications), 3);
    });
}

/// `InventoryIndex::holds` inspects the writer's state from inside a lookup
/// (a cancellation check) while it holds the published copy; a writer may at
/// that moment hold the writer lock and wait for that very copy. The
/// inspection must give up rather than wait (session 26's deadlock), and
/// when it gets the lock it sees a whole state.
#[test]
fn model_an_inspection_inside_a_read_never_deadlocks_with_a_writer_waiting_for_that_copy() {
    model_bounded(Some(5), || {
        let twin = Arc::new(Twin::new(Log::default(), Log::default(), 0));
        // The standby copy now misses op 0: the next write must replay it
        // there, so it waits for readers of that copy once it publishes.
        twin.write(|b| b.apply(0));
        let writer = {
            let twin = twin.clone();
            thread::spawn(move || {
                twin.write(|b| b.apply(1));
                twin.write(|b| b.apply(2))
            })
        };
        let held = twin.read();
        let inside = twin.try_inspect_for(std::time::Duration::from_millis(5), |live, first| {
            (live.items.len(), *first)
        });
        if let Some((len, first_applications)) = inside {
            assert_eq!(
                len as u64, first_applications,
                "inspected a state mid-write"
            );
        }
        assert!(!held.items.is_empty());
        drop(held);
        assert_eq!(writer.join().unwrap(), 3);
    });
}
