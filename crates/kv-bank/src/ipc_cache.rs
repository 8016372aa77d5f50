//! The process-wide cache of imported device mappings (CUDA IPC and fabric
//! imports, see `cuda.rs`): one mapping per donor allocation per process,
//! shared and refcounted by every import of it.
//!
//! Opening a mapping is slow (`cuIpcOpenMemHandle` 0.1-3 ms, growing with
//! the allocation; the first import on a device also creates its primary
//! context, ~120-155 ms), and so is closing one. The cache's lock is held
//! only to look up and update entries, never across an open or a close: the
//! entry of a handle being opened or closed is marked busy, lookups of that
//! same handle wait for it (they need its outcome), and lookups of every
//! other handle proceed. The cache is generic over the mapping and takes
//! the open and close steps as closures, so its concurrency is tested
//! without a GPU; it holds no unsafe code.

use std::collections::HashMap;

use kv_descriptor::CUDA_HANDLE_BYTES;
use parking_lot::{Condvar, Mutex};

use crate::IpcCacheStats;

/// Cache key: (is fabric, handle bytes).
pub(crate) type MapKey = (bool, [u8; CUDA_HANDLE_BYTES]);

enum Entry<V> {
    /// Being opened or closed by one thread, outside the lock.
    Busy,
    /// Mapped, with the number of live imports using it.
    Open { value: V, refs: usize },
}

struct State<V> {
    maps: HashMap<MapKey, Entry<V>>,
    stats: IpcCacheStats,
}

/// Refcounted mappings by handle (see the module docs).
pub(crate) struct MappingCache<V> {
    state: Mutex<State<V>>,
    /// Notified whenever a busy entry settles (opened, failed, closed).
    settled: Condvar,
}

impl<V> MappingCache<V> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                maps: HashMap::new(),
                stats: IpcCacheStats::default(),
            }),
            settled: Condvar::new(),
        }
    }

    /// Counters, with `live` = mappings open now.
    pub(crate) fn stats(&self) -> IpcCacheStats {
        let st = self.state.lock();
        IpcCacheStats {
            live: st
                .maps
                .values()
                .filter(|e| matches!(e, Entry::Open { .. }))
                .count() as u64,
            ..st.stats
        }
    }

    /// The mapping of `key`: an existing one (`hit` checks it against the
    /// request and returns what the caller needs; `true` = cache hit), else
    /// one made by `open` (returns the mapping and what the caller needs;
    /// `false`). `open` runs without the cache's lock; a concurrent
    /// `acquire` of the same key waits for its outcome, other keys do not.
    ///
    /// # Errors
    /// `hit`'s error (the existing mapping does not fit the request), or
    /// `open`'s (then nothing is cached and the next `acquire` opens again).
    pub(crate) fn acquire<T, E>(
        &self,
        key: MapKey,
        hit: impl FnOnce(&V) -> Result<T, E>,
        open: impl FnOnce() -> Result<(V, T), E>,
    ) -> Result<(T, bool), E> {
        let mut st = self.state.lock();
        loop {
            match st.maps.get_mut(&key) {
                Some(Entry::Open { value, refs }) => {
                    let t = hit(value)?;
                    *refs += 1;
                    st.stats.hits += 1;
                    return Ok((t, true));
                }
                Some(Entry::Busy) => self.settled.wait(&mut st),
                None => break,
            }
        }
        st.maps.insert(key, Entry::Busy);
        drop(st);
        // Settles the busy entry even if `open` panics, so that waiters on
        // this key wake up (and retry) instead of hanging.
        let mut busy = BusyGuard {
            cache: self,
            key,
            settled: false,
        };
        let opened = open();
        let mut st = self.state.lock();
        busy.settled = true;
        let r = match opened {
            Ok((value, t)) => {
                st.stats.opens += 1;
                st.maps.insert(key, Entry::Open { value, refs: 1 });
                Ok((t, false))
            }
            Err(e) => {
                st.maps.remove(&key);
                Err(e)
            }
        };
        drop(st);
        self.settled.notify_all();
        r
    }

    /// Drops one reference to `key`'s mapping; the last one closes it with
    /// `close`, without the cache's lock (a lookup of the same key meanwhile
    /// waits, then opens it anew). Unknown keys are ignored.
    pub(crate) fn release(&self, key: &MapKey, close: impl FnOnce(V)) {
        let mut st = self.state.lock();
        let Some(Entry::Open { refs, .. }) = st.maps.get_mut(key) else {
            return;
        };
        *refs -= 1;
        if *refs > 0 {
            return;
        }
        let Some(Entry::Open { value, .. }) = st.maps.insert(*key, Entry::Busy) else {
            unreachable!("the entry was open just above, under the same lock");
        };
        st.stats.closes += 1;
        drop(st);
        let mut busy = BusyGuard {
            cache: self,
            key: *key,
            settled: false,
        };
        close(value);
        self.state.lock().maps.remove(key);
        busy.settled = true;
        self.settled.notify_all();
    }
}

/// Removes a busy entry whose open or close unwound, and wakes its waiters.
struct BusyGuard<'a, V> {
    cache: &'a MappingCache<V>,
    key: MapKey,
    settled: bool,
}

impl<V> Drop for BusyGuard<'_, V> {
    fn drop(&mut self) {
        if !self.settled {
            self.cache.state.lock().maps.remove(&self.key);
            self.cache.settled.notify_all();
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;

    fn key(b: u8) -> MapKey {
        (false, [b; CUDA_HANDLE_BYTES])
    }

    /// Opens `k` on another thread with an opener that blocks until released.
    fn slow_open(
        cache: &Arc<MappingCache<u64>>,
        k: MapKey,
        value: u64,
    ) -> (
        mpsc::Receiver<()>,
        mpsc::Sender<()>,
        std::thread::JoinHandle<(u64, bool)>,
    ) {
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let c = cache.clone();
        let h = std::thread::spawn(move || {
            c.acquire::<u64, String>(
                k,
                |v| Ok(*v),
                move || {
                    entered_tx.send(()).unwrap();
                    let _ = release_rx.recv_timeout(Duration::from_secs(30));
                    Ok((value, value))
                },
            )
            .unwrap()
        });
        entered.recv_timeout(Duration::from_secs(10)).unwrap();
        (entered, release, h)
    }

    /// Runs `f` on another thread and waits at most `limit` for it.
    fn within<T: Send + 'static>(
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit).ok()
    }

    #[test]
    fn a_slow_open_does_not_block_a_lookup_of_another_handle() {
        let cache = Arc::new(MappingCache::<u64>::new());
        let (_entered, release, slow) = slow_open(&cache, key(1), 11);
        let c = cache.clone();
        let other = within(Duration::from_secs(3), move || {
            c.acquire::<u64, String>(key(2), |v| Ok(*v), || Ok((22, 22)))
                .unwrap()
        });
        let _ = release.send(());
        assert_eq!(
            other.expect("a lookup of another handle waited behind a slow open"),
            (22, false)
        );
        assert_eq!(slow.join().unwrap(), (11, false));
        let s = cache.stats();
        assert_eq!((s.opens, s.hits, s.live), (2, 0, 2));
    }

    #[test]
    fn a_lookup_of_the_handle_being_opened_waits_and_shares_the_one_mapping() {
        let cache = Arc::new(MappingCache::<u64>::new());
        let (_entered, release, slow) = slow_open(&cache, key(1), 11);
        let c = cache.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            tx.send(c.acquire::<u64, String>(key(1), |v| Ok(*v), || panic!("opened twice")))
                .unwrap()
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "no mapping yet"
        );
        release.send(()).unwrap();
        assert_eq!(slow.join().unwrap(), (11, false));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap(),
            (11, true)
        );
        let s = cache.stats();
        assert_eq!((s.opens, s.hits, s.live), (1, 1, 1));
        // Two references: the first release keeps it, the second closes it.
        let closed = std::sync::atomic::AtomicU64::new(0);
        let close = |v: u64| {
            closed.fetch_add(v, std::sync::atomic::Ordering::SeqCst);
        };
        cache.release(&key(1), close);
        assert_eq!(closed.load(std::sync::atomic::Ordering::SeqCst), 0);
        cache.release(&key(1), close);
        assert_eq!(closed.load(std::sync::atomic::Ordering::SeqCst), 11);
        let s = cache.stats();
        assert_eq!((s.closes, s.live), (1, 0));
    }

    #[test]
    fn a_failed_open_leaves_nothing_and_the_next_lookup_opens_again() {
        let cache = MappingCache::<u64>::new();
        let e = cache
            .acquire::<u64, String>(key(3), |v| Ok(*v), || Err("stale handle".into()))
            .unwrap_err();
        assert_eq!(e, "stale handle");
        assert_eq!(cache.stats().live, 0);
        let r = cache
            .acquire::<u64, String>(key(3), |v| Ok(*v), || Ok((33, 33)))
            .unwrap();
        assert_eq!(r, (33, false));
        assert_eq!(cache.stats().opens, 1);
    }

    #[test]
    fn a_slow_close_does_not_block_a_lookup_of_another_handle() {
        let cache = Arc::new(MappingCache::<u64>::new());
        for k in [1, 2] {
            cache
                .acquire::<u64, String>(key(k), |v| Ok(*v), || Ok((k as u64, 0)))
                .unwrap();
        }
        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let c = cache.clone();
        let closer = std::thread::spawn(move || {
            c.release(&key(1), move |_| {
                entered_tx.send(()).unwrap();
                let _ = release_rx.recv_timeout(Duration::from_secs(30));
            })
        });
        entered.recv_timeout(Duration::from_secs(10)).unwrap();
        let c = cache.clone();
        let hit = within(Duration::from_secs(3), move || {
            c.acquire::<u64, String>(key(2), |v| Ok(*v), || panic!("mapped already"))
                .unwrap()
        });
        let _ = release.send(());
        assert_eq!(hit.expect("a lookup waited behind a slow close"), (2, true));
        closer.join().unwrap();
        assert_eq!(cache.stats().live, 1);
    }
}
