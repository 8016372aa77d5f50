//! The synchronization primitives [`super::Twin`] is built on, swappable for
//! loom's so that a model checker can run the left-right protocol through
//! every interleaving (`twin/model_tests.rs`, `cargo xtask loom`).
//!
//! Normal builds: `arc_swap` for the published copy, `parking_lot`'s mutex,
//! std's `Arc` and atomics. Under `--cfg kv_loom`: loom's `Arc`, mutex and
//! atomics, and the published copy as a loom mutex around an `Arc` whose
//! load clones it. That stand-in is what `arc_swap` guarantees, without its
//! lock-free machinery (which loom cannot see): a load returns the copy
//! published last and keeps it alive (a strong count the writer's
//! `Arc::get_mut` observes) until the guard drops. The model therefore
//! checks the protocol on top of that guarantee, not `arc_swap` itself.

#[cfg(not(kv_loom))]
mod imp {
    use std::sync::Arc;

    pub(crate) use parking_lot::Mutex;
    pub(crate) use std::sync::atomic::AtomicU64;

    /// What [`Published::load`] returns: derefs to the copy and keeps it
    /// alive while held.
    pub(crate) type ReadGuard<S> = arc_swap::Guard<Arc<S>>;

    /// The published copy (`arc_swap::ArcSwap`).
    pub(crate) struct Published<S>(arc_swap::ArcSwap<S>);

    impl<S> Published<S> {
        pub(crate) fn new(copy: S) -> Self {
            Self(arc_swap::ArcSwap::from_pointee(copy))
        }

        #[inline]
        pub(crate) fn load(&self) -> ReadGuard<S> {
            self.0.load()
        }

        #[cfg(test)]
        pub(crate) fn load_full(&self) -> Arc<S> {
            self.0.load_full()
        }

        /// Publishes `copy`; returns the previous one with every reader's
        /// hold on it in its strong count (`arc_swap` pays the guards' debt
        /// into the count on swap).
        pub(crate) fn swap(&self, copy: Arc<S>) -> Arc<S> {
            self.0.swap(copy)
        }
    }

    /// Spins `std::hint::spin_loop` up to `spins_before_yield` rounds of a
    /// wait, then yields the thread.
    #[inline]
    pub(crate) fn relax(spins: u32, spins_before_yield: u32) {
        if spins < spins_before_yield {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(kv_loom)]
mod imp {
    use loom::sync::Arc;

    pub(crate) use loom::sync::atomic::AtomicU64;

    use loom::sync::atomic::{AtomicBool, Ordering};

    /// A mutex with `parking_lot`'s method names: a loom atomic *token*
    /// taken by compare-and-swap (a waiter yields to loom's scheduler each
    /// round), around a loom mutex that only the token's holder locks, so
    /// it is never contended and loom still checks the data's causality.
    ///
    /// Why not loom's mutex alone: loom treats a `try_lock` that meets a
    /// held lock as a thread blocked on it, so a reader that holds its copy
    /// and tries the writer lock (`Twin::try_inspect_for`) while the writer
    /// holds it and waits for that copy was reported as a livelock ("Model
    /// exceeded maximum number of branches") that real threads do not have.
    pub(crate) struct Mutex<T> {
        token: AtomicBool,
        data: loom::sync::Mutex<T>,
    }

    /// [`Mutex`]'s guard: releases the token after the data's lock.
    pub(crate) struct MutexGuard<'a, T> {
        data: Option<loom::sync::MutexGuard<'a, T>>,
        token: &'a AtomicBool,
    }

    impl<T> std::ops::Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.data.as_ref().expect("guard holds the lock")
        }
    }

    impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.data.as_mut().expect("guard holds the lock")
        }
    }

    impl<T> Drop for MutexGuard<'_, T> {
        fn drop(&mut self) {
            self.data = None;
            self.token.store(false, Ordering::Release);
        }
    }

    impl<T> Mutex<T> {
        pub(crate) fn new(v: T) -> Self {
            Self {
                token: AtomicBool::new(false),
                data: loom::sync::Mutex::new(v),
            }
        }

        fn take_token(&self) -> bool {
            self.token
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        }

        fn guard(&self) -> MutexGuard<'_, T> {
            MutexGuard {
                data: Some(
                    self.data
                        .try_lock()
                        .expect("the token's holder locks alone"),
                ),
                token: &self.token,
            }
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            while !self.take_token() {
                loom::thread::yield_now();
            }
            self.guard()
        }

        /// One try: loom has no clock; the model explores the
        /// interleavings where the lock is free at that moment and where it
        /// is not.
        pub(crate) fn try_lock_for(&self, _wait: std::time::Duration) -> Option<MutexGuard<'_, T>> {
            self.take_token().then(|| self.guard())
        }
    }

    /// A cloned `Arc` of the published copy.
    pub(crate) type ReadGuard<S> = Arc<S>;

    /// The published copy: a loom mutex around an `Arc` (see the module docs).
    pub(crate) struct Published<S>(loom::sync::Mutex<Arc<S>>);

    impl<S> Published<S> {
        pub(crate) fn new(copy: S) -> Self {
            Self(loom::sync::Mutex::new(Arc::new(copy)))
        }

        pub(crate) fn load(&self) -> ReadGuard<S> {
            Arc::clone(&self.0.lock().expect("published copy lock"))
        }

        #[cfg(test)]
        pub(crate) fn load_full(&self) -> Arc<S> {
            self.load()
        }

        pub(crate) fn swap(&self, copy: Arc<S>) -> Arc<S> {
            std::mem::replace(&mut *self.0.lock().expect("published copy lock"), copy)
        }
    }

    /// Every round of a wait is a loom yield: the model must schedule the
    /// thread it waits for.
    pub(crate) fn relax(_spins: u32, _spins_before_yield: u32) {
        loom::thread::yield_now();
    }
}

#[cfg(kv_loom)]
pub(crate) use loom::sync::Arc;
#[cfg(not(kv_loom))]
pub(crate) use std::sync::Arc;

pub(crate) use imp::{relax, AtomicU64, Mutex, Published, ReadGuard};
