//! The reader side of the directory: the newest usable record per engine.

use std::collections::HashMap;

use kv_descriptor::EngineId;

use super::{DirectoryChange, DonorRecord};
use crate::ResolveError;

/// What a reader (router, target) knows of the directory, fed by a
/// [`super::DirectoryWatch`] through [`DonorCache::apply`]. Time is passed
/// in (Unix epoch ms) so the lease rule is testable without sleeping.
#[derive(Debug, Default)]
pub struct DonorCache {
    entries: HashMap<EngineId, DonorRecord>,
    /// Newest generation ever seen per engine, kept after a delete so that a
    /// late put of an older generation is still refused.
    newest: HashMap<EngineId, u64>,
}

/// What [`DonorCache::apply`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheUpdate {
    /// A record of a generation not seen before for its engine (the
    /// caller resets what it knew of the older generation's slots).
    NewGeneration {
        /// The engine.
        engine: EngineId,
        /// Its generation now.
        generation: u64,
    },
    /// The same generation again (lease renewal).
    Renewed(EngineId),
    /// The entry is gone.
    Deleted(EngineId),
    /// Nothing changed: an older generation, or an invalid entry.
    Ignored(ResolveError),
}

impl DonorCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one watched change.
    pub fn apply(&mut self, change: DirectoryChange) -> CacheUpdate {
        match change {
            DirectoryChange::Put(r) => {
                let engine = r.engine_id();
                let generation = r.generation();
                let newest = self.newest.get(&engine).copied();
                match newest {
                    Some(n) if generation < n => {
                        CacheUpdate::Ignored(ResolveError::StaleGeneration {
                            donor: engine,
                            generation,
                            newest_seen: n,
                        })
                    }
                    Some(n) if generation == n && self.entries.contains_key(&engine) => {
                        self.entries.insert(engine, r);
                        CacheUpdate::Renewed(engine)
                    }
                    _ => {
                        self.newest.insert(engine, generation);
                        self.entries.insert(engine, r);
                        CacheUpdate::NewGeneration { engine, generation }
                    }
                }
            }
            DirectoryChange::Delete(engine) => {
                self.entries.remove(&engine);
                CacheUpdate::Deleted(engine)
            }
            DirectoryChange::Refused { key, error } => {
                CacheUpdate::Ignored(ResolveError::InvalidRecord {
                    key,
                    reason: error.to_string(),
                })
            }
        }
    }

    /// Forgets `engine` for good: its record and the newest generation
    /// seen of it, which a delete keeps so that a late put of an older
    /// generation is still refused. For an engine nothing publishes for
    /// any more (the router's registry forgot it, after its retention);
    /// without this, `newest` kept one entry per engine ever seen (trial
    /// h39, 2). Returns whether anything was known of it.
    ///
    /// ```
    /// use kv_router_glue::DonorCache;
    /// let mut cache = DonorCache::new();
    /// assert!(!cache.forget(kv_descriptor::EngineId::fresh()));
    /// assert_eq!(cache.generations_known(), 0);
    /// ```
    pub fn forget(&mut self, engine: EngineId) -> bool {
        let had_record = self.entries.remove(&engine).is_some();
        self.newest.remove(&engine).is_some() || had_record
    }

    /// Engines whose newest generation is remembered (those with a record
    /// and those deleted but not [`Self::forget`]-ten).
    pub fn generations_known(&self) -> usize {
        self.newest.len()
    }

    /// The usable record of `engine` at `now_unix_ms`.
    ///
    /// # Errors
    /// [`ResolveError::UnknownDonor`] when absent,
    /// [`ResolveError::LeaseLapsed`] when its lease expired.
    pub fn get(&self, engine: EngineId, now_unix_ms: u64) -> Result<&DonorRecord, ResolveError> {
        let r = self
            .entries
            .get(&engine)
            .ok_or(ResolveError::UnknownDonor { donor: engine })?;
        if r.lease_expires_unix_ms() <= now_unix_ms {
            return Err(ResolveError::LeaseLapsed {
                donor: engine,
                expired_unix_ms: r.lease_expires_unix_ms(),
                now_unix_ms,
            });
        }
        Ok(r)
    }

    /// Whether a record of `engine` is held, its lease lapsed or not
    /// ([`Self::get`] says whether it is usable).
    pub fn contains(&self, engine: EngineId) -> bool {
        self.entries.contains_key(&engine)
    }

    /// Number of entries held (lapsed ones included until deleted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries whose lease has not lapsed at `now_unix_ms`: the donors
    /// [`Self::get`] would resolve now. A lapsed record stays in the bucket
    /// until the bucket's own `max_age` (the directory TTL of whoever
    /// created it, not the donor's lease) deletes it.
    ///
    /// ```
    /// use kv_router_glue::DonorCache;
    /// assert_eq!(DonorCache::new().live(0), 0);
    /// ```
    pub fn live(&self, now_unix_ms: u64) -> usize {
        self.entries
            .values()
            .filter(|r| r.lease_expires_unix_ms() > now_unix_ms)
            .count()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
