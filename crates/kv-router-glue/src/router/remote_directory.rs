//! [`RemoteDonorDirectory`]: the router-side [`DonorDirectory`] for donors in
//! other processes. Manifests come from the directory ([`DonorCache`], fed
//! by a [`crate::DirectoryWatch`]); slot ids come from the donor's own
//! `RetainedGpuDirect` KV events, whose `Stored` blocks carry their logical
//! slot.
//!
//! A slot learned here may be stale (the donor evicted and reused it after
//! the event): harmless, because the donor's pin service decides every pin
//! from its slot table and refuses a slot that no longer holds the asked
//! sequence hash; the target then recomputes.
//!
//! Memory: the cache is a [`HeardCache`], so an engine not heard of in the
//! directory for [`HeardCache::FORGET_AFTER_MS`] without a usable record is
//! forgotten for good, its slot map with it, whether or not the worker
//! registry ever knew it: a bucket shared by several namespaces feeds every
//! router the other namespaces' records, which no registry forgets
//! ([`RemoteDonorDirectory::forget_for_good`] stays the registry's path).

use std::collections::HashMap;

use kv_descriptor::{EngineId, KvEvent, KvEventData, SequenceHash, StorageTier};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;

use crate::plane::directory::{CacheUpdate, DirectoryChange, HeardCache, HeardUpdate};
use crate::{DonorDirectory, ResolveError, ResolvedDonor};

/// Slots of one donor engine, for the generation the directory holds.
///
/// FxHash, not std's SipHash: every advise resolves each fetched block here
/// (2,048 lookups for a 32K-token prompt at 16 tokens per block), and a
/// profile of the router binary under back-to-back 2,048-block advises put
/// SipHash and its map operations at ~10% of the router's CPU. The keys are
/// already uniform 64-bit hashes, and only the donor's own KV events (a
/// permission-gated subject, docs/nats-permissions.conf) insert them, so
/// there is no flooding input to defend against with a keyed hash.
#[derive(Debug, Default)]
struct DonorSlots {
    slots: FxHashMap<SequenceHash, u32>,
}

#[derive(Debug, Default)]
struct State {
    cache: HeardCache,
    slots: HashMap<EngineId, DonorSlots>,
}

impl State {
    /// Applies `change` at `now_ms` (Unix ms): the slot map of an engine
    /// with a new generation or deleted goes (the old generation's slots
    /// mean nothing), and so does that of every engine the cache's sweep
    /// forgot.
    fn apply(&mut self, change: DirectoryChange, now_ms: u64) -> CacheUpdate {
        let HeardUpdate { update, forgotten } = self.cache.apply(change, now_ms);
        match &update {
            CacheUpdate::NewGeneration { engine, .. } | CacheUpdate::Deleted(engine) => {
                self.slots.remove(engine);
            }
            CacheUpdate::Renewed(_) | CacheUpdate::Ignored(_) => {}
        }
        for engine in &forgotten {
            self.slots.remove(engine);
        }
        update
    }
}

/// Router-side directory over the [`crate::DirectoryPlane`] cache and the
/// donors' KV events. The clock is injected (Unix epoch ms) so lease lapse
/// is testable; [`RemoteDonorDirectory::new`] uses the system clock.
pub struct RemoteDonorDirectory {
    state: RwLock<State>,
    clock: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl std::fmt::Debug for RemoteDonorDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.read();
        f.debug_struct("RemoteDonorDirectory")
            .field("donors", &st.cache.cache().len())
            .field("remembered", &st.cache.remembered())
            .field("slot_maps", &st.slots.len())
            .finish()
    }
}

/// Now, Unix epoch ms (0 if the clock is before 1970).
pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Default for RemoteDonorDirectory {
    fn default() -> Self {
        Self::new()
    }
}

impl RemoteDonorDirectory {
    /// An empty directory on the system clock.
    pub fn new() -> Self {
        Self::with_clock(unix_now_ms)
    }

    /// An empty directory reading time (Unix epoch ms) from `clock`.
    pub fn with_clock(clock: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Self {
            state: RwLock::default(),
            clock: Box::new(clock),
        }
    }

    /// Applies one watched directory change at the directory's clock. A
    /// new generation of an engine resets its slot map (the old
    /// generation's slots mean nothing); engines quiet for
    /// [`HeardCache::FORGET_AFTER_MS`] without a usable record are
    /// forgotten for good, slot maps included (module docs, "Memory").
    pub fn apply_directory(&self, change: DirectoryChange) -> CacheUpdate {
        let now = (self.clock)();
        self.state.write().apply(change, now)
    }

    /// Feeds one KV event of a donor (what the router's event ingest calls
    /// for every event it accepted). Only tier `RetainedGpuDirect` is used:
    /// `Stored` blocks with a slot add it, `Removed` drops, `Cleared` resets
    /// the donor's map. Returns how many slot entries changed.
    pub fn ingest_event(&self, event: &KvEvent) -> usize {
        if event.tier != StorageTier::RetainedGpuDirect {
            return 0;
        }
        let mut st = self.state.write();
        let map = st.slots.entry(event.publisher).or_default();
        match &event.data {
            KvEventData::Stored { blocks, .. } => blocks
                .iter()
                .filter_map(|b| b.slot.map(|s| map.slots.insert(b.sequence_hash, s)))
                .count(),
            KvEventData::Removed { sequence_hashes } => sequence_hashes
                .iter()
                .filter(|h| map.slots.remove(h).is_some())
                .count(),
            KvEventData::Cleared => {
                let n = map.slots.len();
                map.slots.clear();
                n
            }
        }
    }

    /// Feeds every change of `watch` into this directory until the watch
    /// ends (its backend went away) or the returned task is aborted.
    pub fn follow(
        self: &std::sync::Arc<Self>,
        mut watch: crate::DirectoryWatch,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            while let Some(change) = watch.next().await {
                me.apply_directory(change);
            }
        })
    }

    /// Drops everything known of `engine` (a replaced or removed
    /// incarnation, see [`crate::WorkerRegistry`]) but the newest
    /// generation seen of it, so that a late put of an older one is still
    /// refused.
    pub fn forget(&self, engine: EngineId) {
        let now = (self.clock)();
        let mut st = self.state.write();
        // The delete drops the slot map (`State::apply`).
        st.apply(DirectoryChange::Delete(engine), now);
    }

    /// [`Self::forget`], and the newest generation seen of `engine` too
    /// ([`HeardCache::forget`]): for an incarnation the router's registry
    /// forgot, whose puts can no longer be in flight.
    pub fn forget_for_good(&self, engine: EngineId) {
        let mut st = self.state.write();
        st.cache.forget(engine);
        st.slots.remove(&engine);
    }

    /// Whether the directory holds a record of `engine` (lapsed or not):
    /// one was put and neither deleted, nor dropped by [`Self::forget`],
    /// nor forgotten for good since.
    pub fn holds_record(&self, engine: EngineId) -> bool {
        self.state.read().cache.cache().contains(engine)
    }

    /// Engines whose newest generation the cache remembers
    /// ([`crate::DonorCache::generations_known`]).
    pub fn generations_known(&self) -> usize {
        self.state.read().cache.cache().generations_known()
    }

    /// Slot maps held (one per engine whose KV events were ingested since
    /// its last new generation, delete or forgetting).
    pub fn slot_maps(&self) -> usize {
        self.state.read().slots.len()
    }
}

impl DonorDirectory for RemoteDonorDirectory {
    fn resolve(
        &self,
        donor: EngineId,
        hashes: &[SequenceHash],
    ) -> Result<ResolvedDonor, ResolveError> {
        let now = (self.clock)();
        let st = self.state.read();
        let record = st.cache.cache().get(donor, now)?;
        let map = st.slots.get(&donor);
        let slot_ids = hashes
            .iter()
            .enumerate()
            .map(|(index, h)| {
                map.and_then(|m| m.slots.get(h).copied())
                    .ok_or(ResolveError::BlockGone { index, hash: *h })
            })
            .collect::<Result<Vec<u32>, ResolveError>>()?;
        Ok(ResolvedDonor {
            manifest: record.manifest().clone(),
            slot_ids,
            control_endpoint: record.pin_endpoint().to_string(),
        })
    }
}

#[cfg(all(test, feature = "worker"))]
#[path = "remote_directory_tests.rs"]
mod tests;
