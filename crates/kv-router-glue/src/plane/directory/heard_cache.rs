//! [`HeardCache`]: a [`DonorCache`] bounded in time, for every reader of the
//! directory (the router's [`crate::RemoteDonorDirectory`], the wheel's
//! `DonorDirectory`).
//!
//! A [`DonorCache`] keeps the newest generation it saw of every engine,
//! after its record is deleted too (so that a late put of an older
//! generation is still refused), and the record of a donor that crashed
//! before deleting it (a bucket's `max_age` expiry reaches no watcher). In
//! a long-lived reader that was one entry per donor incarnation ever seen,
//! for the life of the process (trial h39, 2). The router's worker registry
//! forgets the engines it registered (`RemoteDonorDirectory::forget_for_good`),
//! but a bucket shared by several namespaces also feeds every router the
//! records of other namespaces' donors, which its registry never knows (a
//! fresh-user trial); the wheel has no registry at all. So an engine is
//! forgotten for good ([`DonorCache::forget`]) once nothing of it was heard
//! (no put, no delete) for [`HeardCache::FORGET_AFTER_MS`] and it has no
//! record [`DonorCache::get`] would answer (none, or its lease lapsed): a
//! live record is never dropped, whatever its lease length (a donor renews
//! it every fifth of its lease, up to hours apart).

use std::collections::HashMap;

use kv_descriptor::EngineId;

use super::{CacheUpdate, DirectoryChange, DonorCache};
use crate::FORGET_AFTER_MIN_MS;

/// A [`DonorCache`] with when each engine was last heard of (module docs).
/// Time is passed in as Unix epoch milliseconds, as [`DonorCache::get`]
/// takes it, so that forgetting is testable without sleeping.
///
/// ```
/// use kv_router_glue::{DirectoryChange, HeardCache};
/// let mut heard = HeardCache::new();
/// let engine = kv_descriptor::EngineId::fresh();
/// let t0 = 1_700_000_000_000; // Unix ms
/// // A delete of an engine whose record this reader never saw: its id is
/// // remembered (a put of it could still be in flight) ...
/// heard.apply(DirectoryChange::Delete(engine), t0);
/// assert_eq!(heard.remembered(), 1);
/// assert_eq!(heard.sweep(t0 + HeardCache::FORGET_AFTER_MS), Vec::new());
/// // ... until nothing of it was heard for the retention.
/// assert_eq!(heard.sweep(t0 + HeardCache::FORGET_AFTER_MS + 1), vec![engine]);
/// assert_eq!((heard.remembered(), heard.cache().generations_known()), (0, 0));
/// ```
#[derive(Debug, Default)]
pub struct HeardCache {
    cache: DonorCache,
    /// Unix ms of the last change applied for each engine.
    heard: HashMap<EngineId, u64>,
    /// No sweep before this (Unix ms).
    next_sweep_ms: u64,
}

/// What [`HeardCache::apply`] did: the change's own [`CacheUpdate`], and
/// the engines the sweep it ran (when one was due) forgot for good, whose
/// other state (a router's slot maps) the caller drops with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeardUpdate {
    /// What the change did to the cache.
    pub update: CacheUpdate,
    /// Engines forgotten for good by this call's sweep (usually none).
    pub forgotten: Vec<EngineId>,
}

impl HeardCache {
    /// An engine not heard of for this long (ms), without a usable record,
    /// is forgotten for good: the worker registry's shortest retention
    /// ([`FORGET_AFTER_MIN_MS`], 5 min). A put delayed by a loaded server is
    /// in flight for seconds, far less.
    pub const FORGET_AFTER_MS: u64 = FORGET_AFTER_MIN_MS;

    /// How often (ms) [`HeardCache::apply`] looks for engines to forget: a
    /// tenth of [`HeardCache::FORGET_AFTER_MS`], so an engine is forgotten
    /// at most this late, and a stream of changes costs one scan of the
    /// remembered engines per period, not one per change.
    pub const SWEEP_EVERY_MS: u64 = Self::FORGET_AFTER_MS / 10;

    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cache, to read ([`DonorCache::get`], [`DonorCache::live`]).
    pub fn cache(&self) -> &DonorCache {
        &self.cache
    }

    /// Applies one watched change at `now_ms` (Unix ms) and notes the
    /// engine heard of; every [`HeardCache::SWEEP_EVERY_MS`] it also
    /// forgets the engines not heard of for [`HeardCache::FORGET_AFTER_MS`]
    /// ([`HeardCache::sweep`]). A refused entry names no engine and
    /// refreshes nothing.
    pub fn apply(&mut self, change: DirectoryChange, now_ms: u64) -> HeardUpdate {
        let engine = match &change {
            DirectoryChange::Put(r) => Some(r.engine_id()),
            DirectoryChange::Delete(e) => Some(*e),
            DirectoryChange::Refused { .. } => None,
        };
        let update = self.cache.apply(change);
        if let Some(engine) = engine {
            self.heard.insert(engine, now_ms);
        }
        let forgotten = if now_ms >= self.next_sweep_ms {
            self.next_sweep_ms = now_ms.saturating_add(Self::SWEEP_EVERY_MS);
            self.sweep(now_ms)
        } else {
            Vec::new()
        };
        HeardUpdate { update, forgotten }
    }

    /// Forgets for good ([`DonorCache::forget`]) every engine last heard of
    /// more than [`HeardCache::FORGET_AFTER_MS`] before `now_ms` (Unix ms)
    /// whose record is gone or lapsed at `now_ms`; returns them.
    pub fn sweep(&mut self, now_ms: u64) -> Vec<EngineId> {
        let cache = &mut self.cache;
        let mut forgotten = Vec::new();
        self.heard.retain(|&engine, &mut at| {
            let quiet = now_ms.saturating_sub(at) > Self::FORGET_AFTER_MS;
            if quiet && cache.get(engine, now_ms).is_err() {
                cache.forget(engine);
                forgotten.push(engine);
                return false;
            }
            true
        });
        forgotten
    }

    /// Forgets `engine` for good now, whenever it was last heard of
    /// ([`DonorCache::forget`]): for an incarnation a registry forgot,
    /// whose puts can no longer be in flight. Returns whether anything was
    /// known of it.
    pub fn forget(&mut self, engine: EngineId) -> bool {
        let heard = self.heard.remove(&engine).is_some();
        self.cache.forget(engine) || heard
    }

    /// Engines remembered now: with a record, or deleted (or never put)
    /// and not forgotten yet.
    pub fn remembered(&self) -> usize {
        self.heard.len()
    }
}

#[cfg(all(test, feature = "worker"))]
mod tests {
    use std::collections::HashSet;

    use kv_descriptor::{OwnerLease, Role};

    use super::*;
    use crate::plane::directory::tests_support::record;
    use crate::ResolveError;

    const T0: u64 = 1_000_000;
    const FORGET: u64 = HeardCache::FORGET_AFTER_MS;

    fn owner(generation: u64) -> OwnerLease {
        OwnerLease {
            generation,
            ..OwnerLease::fresh(Role::Decode)
        }
    }

    /// A deleted engine is forgotten (its newest generation too) once not
    /// heard of for the retention; until then a late put of an older
    /// generation is still refused.
    #[test]
    fn a_deleted_engine_is_forgotten_after_the_retention_not_before() {
        let mut c = HeardCache::new();
        let o = owner(2);
        let put = c.apply(DirectoryChange::Put(record(o, T0 + 60_000)), T0);
        assert_eq!(
            put,
            HeardUpdate {
                update: CacheUpdate::NewGeneration {
                    engine: o.engine_id,
                    generation: 2
                },
                forgotten: vec![]
            }
        );
        c.apply(DirectoryChange::Delete(o.engine_id), T0 + 1_000);
        assert_eq!(c.cache().generations_known(), 1);
        // Within the retention: remembered, an older generation refused.
        let late = OwnerLease { generation: 1, ..o };
        assert_eq!(
            c.apply(DirectoryChange::Put(record(late, T0 + 60_000)), T0 + 2_000)
                .update,
            CacheUpdate::Ignored(ResolveError::StaleGeneration {
                donor: o.engine_id,
                generation: 1,
                newest_seen: 2
            })
        );
        assert_eq!(c.sweep(T0 + 2_000 + FORGET), vec![]);
        assert_eq!((c.remembered(), c.cache().generations_known()), (1, 1));
        // One ms past it (from the last hearing, the late put): forgotten.
        assert_eq!(c.sweep(T0 + 2_001 + FORGET), vec![o.engine_id]);
        assert_eq!((c.remembered(), c.cache().generations_known()), (0, 0));
    }

    /// A record whose lease has not lapsed is never forgotten, however long
    /// since its last put (a long lease is renewed every fifth of it); once
    /// lapsed and quiet for the retention, it is.
    #[test]
    fn a_live_record_is_kept_a_lapsed_one_forgotten() {
        let mut c = HeardCache::new();
        let long = owner(1);
        let short = owner(1);
        c.apply(DirectoryChange::Put(record(long, T0 + 3_600_000)), T0);
        c.apply(DirectoryChange::Put(record(short, T0 + 10_000)), T0);
        let later = T0 + 2 * FORGET;
        assert_eq!(c.sweep(later), vec![short.engine_id]);
        assert!(c.cache().get(long.engine_id, later).is_ok());
        assert_eq!(
            c.cache().get(short.engine_id, later).unwrap_err(),
            ResolveError::UnknownDonor {
                donor: short.engine_id
            }
        );
        assert_eq!((c.remembered(), c.cache().generations_known()), (1, 1));
    }

    /// `forget` drops an engine at once, its record and generation too.
    #[test]
    fn forget_drops_an_engine_at_once() {
        let mut c = HeardCache::new();
        let o = owner(3);
        c.apply(DirectoryChange::Put(record(o, T0 + 3_600_000)), T0);
        assert!(c.forget(o.engine_id));
        assert!(!c.forget(o.engine_id));
        assert_eq!((c.remembered(), c.cache().generations_known()), (0, 0));
        assert_eq!(c.cache().len(), 0);
    }

    /// `apply` sweeps by itself, at most once per tenth of the retention:
    /// engines that come and go without end leave a bounded memory.
    #[test]
    fn applying_changes_keeps_the_memory_bounded_by_the_retention() {
        let mut c = HeardCache::new();
        let step = 1_000; // one donor incarnation put and deleted per second
        let mut now = T0;
        let mut seen = HashSet::new();
        let mut forgotten = 0;
        for _ in 0..3 * FORGET / step {
            let o = owner(1);
            seen.insert(o.engine_id);
            forgotten += c
                .apply(DirectoryChange::Put(record(o, now + 15_000)), now)
                .forgotten
                .len();
            forgotten += c
                .apply(DirectoryChange::Delete(o.engine_id), now)
                .forgotten
                .len();
            now += step;
        }
        // At most the retention plus one sweep period of them.
        let bound = ((FORGET + HeardCache::SWEEP_EVERY_MS) / step + 1) as usize;
        assert!(c.remembered() <= bound, "{} > {bound}", c.remembered());
        assert!(c.remembered() >= (FORGET / step) as usize);
        assert_eq!(c.cache().generations_known(), c.remembered());
        assert_eq!(seen.len(), 900);
        assert_eq!(forgotten + c.remembered(), 900);
    }
}
