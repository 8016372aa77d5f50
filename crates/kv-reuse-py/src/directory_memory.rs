//! [`HeardCache`]: the `DonorCache` of a `DonorDirectory`, bounded in time.
//!
//! A [`DonorCache`] keeps the newest generation it saw of every engine,
//! after its record is deleted too (so that a late put of an older
//! generation is still refused); in a long-lived prefill worker that was
//! one entry per donor incarnation ever seen, for the life of the process
//! (trial h39, 2). The router forgets them when its worker registry does
//! (`RemoteDonorDirectory::forget_for_good`); the wheel has no registry, so
//! an engine is forgotten for good ([`DonorCache::forget`]) once nothing of
//! it was heard (no put, no delete) for [`FORGET_AFTER_MS`], the registry's
//! shortest retention, and it has no record `manifest` would answer (none,
//! or its lease lapsed): a live record is never dropped, whatever its lease
//! length (a donor renews it every fifth of its lease, up to hours apart).

use std::collections::HashMap;

use kv_descriptor::EngineId;
use kv_router_glue::{CacheUpdate, DirectoryChange, DonorCache, FORGET_AFTER_MIN_MS};

/// An engine not heard of for this long (ms), without a usable record, is
/// forgotten for good: the worker registry's shortest retention
/// ([`FORGET_AFTER_MIN_MS`], 5 min). A put delayed by a loaded server is in
/// flight for seconds, far less.
pub(crate) const FORGET_AFTER_MS: u64 = FORGET_AFTER_MIN_MS;

/// How often (ms) [`HeardCache::apply`] looks for engines to forget: a tenth
/// of the retention, so an engine is forgotten at most this late.
const SWEEP_EVERY_MS: u64 = FORGET_AFTER_MS / 10;

/// A [`DonorCache`] with when each engine was last heard of (module docs).
#[derive(Debug, Default)]
pub(crate) struct HeardCache {
    cache: DonorCache,
    /// Unix ms of the last change applied for each engine.
    heard: HashMap<EngineId, u64>,
    /// No sweep before this (Unix ms).
    next_sweep_ms: u64,
}

impl HeardCache {
    /// The cache, to read (`get`, `live`).
    pub(crate) fn cache(&self) -> &DonorCache {
        &self.cache
    }

    /// Applies one watched change at `now_ms` (Unix ms); every
    /// [`SWEEP_EVERY_MS`] it also forgets the engines not heard of for
    /// [`FORGET_AFTER_MS`] ([`HeardCache::sweep`]).
    pub(crate) fn apply(&mut self, change: DirectoryChange, now_ms: u64) -> CacheUpdate {
        let engine = match &change {
            DirectoryChange::Put(r) => Some(r.engine_id()),
            DirectoryChange::Delete(e) => Some(*e),
            DirectoryChange::Refused { .. } => None,
        };
        let update = self.cache.apply(change);
        if let Some(engine) = engine {
            self.heard.insert(engine, now_ms);
        }
        if now_ms >= self.next_sweep_ms {
            self.next_sweep_ms = now_ms.saturating_add(SWEEP_EVERY_MS);
            self.sweep(now_ms);
        }
        update
    }

    /// Forgets for good ([`DonorCache::forget`]) every engine last heard of
    /// more than [`FORGET_AFTER_MS`] before `now_ms` whose record is gone or
    /// lapsed; returns how many.
    pub(crate) fn sweep(&mut self, now_ms: u64) -> usize {
        let cache = &mut self.cache;
        let before = self.heard.len();
        self.heard.retain(|&engine, &mut at| {
            let quiet = now_ms.saturating_sub(at) > FORGET_AFTER_MS;
            if quiet && cache.get(engine, now_ms).is_err() {
                cache.forget(engine);
                return false;
            }
            true
        });
        before - self.heard.len()
    }

    /// Engines remembered now (with a record, or deleted and not forgotten).
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.heard.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_descriptor::*;
    use kv_router_glue::{DonorRecord, DonorRecordParts, ResolveError};

    /// A one-rank host donor record of `owner`, its lease ending at `expires`.
    fn record(owner: OwnerLease, expires: u64) -> DonorRecord {
        let layout = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
        let part = BankDescriptor::new(BankParts {
            layout,
            tp_rank: 0,
            location: MemoryLocation::Host {
                host_id: "h".into(),
            },
            owner,
            export: ExportHandle::HostShm {
                name: "/kvbank-py-memory-test".into(),
            },
            slot_count: 8,
            slot_bytes: layout.rank_block_bytes() as u64,
        })
        .unwrap();
        DonorRecord::new(DonorRecordParts {
            worker_key: "decode-0".into(),
            manifest: BankManifest::new(vec![part]).unwrap(),
            pin_endpoint: "unix:/tmp/kv-pin-decode-0.sock".into(),
            nixl_agent_name: None,
            nixl_agent_metadata: None,
            nixl_rank_regions: None,
            lease_expires_unix_ms: expires,
            published_unix_ms: 1_000,
        })
        .unwrap()
    }

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
        let mut c = HeardCache::default();
        let o = owner(2);
        let t0 = 1_000_000;
        let put = c.apply(DirectoryChange::Put(record(o, t0 + 60_000)), t0);
        assert!(matches!(
            put,
            CacheUpdate::NewGeneration { generation: 2, .. }
        ));
        c.apply(DirectoryChange::Delete(o.engine_id), t0 + 1_000);
        assert_eq!(c.cache().generations_known(), 1);
        // Within the retention: remembered, an older generation refused.
        let late = OwnerLease { generation: 1, ..o };
        assert!(matches!(
            c.apply(DirectoryChange::Put(record(late, t0 + 60_000)), t0 + 2_000),
            CacheUpdate::Ignored(ResolveError::StaleGeneration { newest_seen: 2, .. })
        ));
        assert_eq!(c.sweep(t0 + 2_000 + FORGET_AFTER_MS), 0);
        assert_eq!((c.remembered(), c.cache().generations_known()), (1, 1));
        // One ms past it (from the last hearing, the late put): forgotten.
        assert_eq!(c.sweep(t0 + 2_001 + FORGET_AFTER_MS), 1);
        assert_eq!((c.remembered(), c.cache().generations_known()), (0, 0));
    }

    /// A record whose lease has not lapsed is never forgotten, however long
    /// since its last put (a long lease is renewed every fifth of it); once
    /// lapsed and quiet for the retention, it is.
    #[test]
    fn a_live_record_is_kept_a_lapsed_one_forgotten() {
        let mut c = HeardCache::default();
        let t0 = 1_000_000;
        let long = owner(1);
        let short = owner(1);
        c.apply(DirectoryChange::Put(record(long, t0 + 3_600_000)), t0);
        c.apply(DirectoryChange::Put(record(short, t0 + 10_000)), t0);
        let later = t0 + 2 * FORGET_AFTER_MS;
        assert_eq!(c.sweep(later), 1);
        assert!(c.cache().get(long.engine_id, later).is_ok());
        assert!(matches!(
            c.cache().get(short.engine_id, later),
            Err(ResolveError::UnknownDonor { .. })
        ));
        assert_eq!((c.remembered(), c.cache().generations_known()), (1, 1));
    }

    /// `apply` sweeps by itself, at most once per tenth of the retention:
    /// engines that come and go without end leave a bounded memory.
    #[test]
    fn applying_changes_keeps_the_memory_bounded_by_the_retention() {
        let mut c = HeardCache::default();
        let step = 1_000; // one donor incarnation put and deleted per second
        let mut now = 1_000_000;
        let mut seen = std::collections::HashSet::new();
        for _ in 0..3 * FORGET_AFTER_MS / step {
            let o = owner(1);
            seen.insert(o.engine_id);
            c.apply(DirectoryChange::Put(record(o, now + 15_000)), now);
            c.apply(DirectoryChange::Delete(o.engine_id), now);
            now += step;
        }
        // At most the retention plus one sweep period of them.
        let bound = ((FORGET_AFTER_MS + SWEEP_EVERY_MS) / step + 1) as usize;
        assert!(c.remembered() <= bound, "{} > {bound}", c.remembered());
        assert!(c.remembered() >= (FORGET_AFTER_MS / step) as usize);
        assert_eq!(c.cache().generations_known(), c.remembered());
        assert_eq!(seen.len(), 900);
    }
}
