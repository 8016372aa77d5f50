//! [`InventorySync`]: the router's side of inventory snapshots.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::{
    EngineId, KvEvent, KvEventData, LayoutFingerprint, Role, SequenceHash, StorageTier,
    StoredBlock, Wire,
};
use kv_lookup::{EventOutcome, InventoryIndex, LookupError};

use super::{
    inventory_subject, InventoryError, InventoryPlane, InventoryReply, InventoryRequest,
    SnapshotBlock, MAX_SNAPSHOT_PAGE_BLOCKS,
};
use crate::{
    KvStreamResume, Registration, RemoteDonorDirectory, WorkerAnnouncement, WorkerRegistry,
};

/// Default of [`InventorySync::new`]'s per-request timeout.
pub const DEFAULT_INVENTORY_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a snapshot older than what the stream already applied is asked
/// again before [`InventoryError::Stale`].
pub(crate) const STALE_RETRIES: usize = 3;

/// What one worker's rebuild did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncOutcome {
    /// The snapshot replaced the worker's inventory in the index and the
    /// donor slot map.
    Applied {
        /// Ready blocks it listed.
        blocks: usize,
        /// The event id it is consistent with; the stream resumes after it.
        last_event_id: u64,
    },
    /// The worker's incarnation is retired (replaced or removed): nothing asked.
    Retired,
}

/// What [`InventorySync::rebuild_inventory`] did, per worker.
#[derive(Debug, Default)]
pub struct RebuildReport {
    /// Workers whose snapshot was applied (or that are retired), with the outcome.
    pub synced: Vec<(EngineId, SyncOutcome)>,
    /// Workers whose snapshot failed; their events still apply, and the
    /// next [`InventorySync::rebuild_worker`] may repair them.
    pub failed: Vec<(EngineId, InventoryError)>,
}

/// The router's inventory rebuild: asks each worker for its snapshot,
/// applies it to the kv-lookup index and the donor slot map, and filters the
/// event stream afterwards so that nothing counts twice.
///
/// Order matters: subscribe the [`crate::KvEventReceiver`] *before* asking
/// for snapshots, so every event after a snapshot's `last_event_id` reaches
/// [`InventorySync::apply_event`]. Give the sync that receiver's
/// [`crate::KvEventReceiver::resume_handle`]
/// ([`InventorySync::with_stream_resume`]) so that the stream resumes right
/// after each applied snapshot.
pub struct InventorySync {
    plane: Arc<dyn InventoryPlane>,
    namespace: String,
    timeout: Duration,
    page_blocks: u32,
    /// Highest event id applied per publisher (from a snapshot or the stream).
    applied: HashMap<EngineId, u64>,
    /// Publishers whose inventory came from a snapshot at this event id.
    snapshot_at: HashMap<EngineId, u64>,
    /// The event receiver to move past each applied snapshot, for engines
    /// whose subject has none in `streams`.
    resume: Option<KvStreamResume>,
    /// One event receiver per followed subject (the router binary's layout).
    streams: HashMap<String, KvStreamResume>,
    /// The event subject each engine announced (which receiver to move).
    engine_subject: HashMap<EngineId, String>,
}

/// What an inventory snapshot request needs, apart from the sync's state:
/// cloned out of an [`InventorySync`] ([`InventorySync::asker`]) so that the
/// request, which may wait the full timeout on an unresponsive worker, runs
/// without the lock that guards the sync.
#[derive(Clone)]
pub struct SnapshotAsker {
    plane: Arc<dyn InventoryPlane>,
    namespace: String,
    timeout: Duration,
    page_blocks: u32,
}

impl std::fmt::Debug for SnapshotAsker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotAsker")
            .field("plane", &self.plane.name())
            .field("namespace", &self.namespace)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl std::fmt::Debug for InventorySync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InventorySync")
            .field("plane", &self.plane.name())
            .field("namespace", &self.namespace)
            .field("synced", &self.snapshot_at.len())
            .finish()
    }
}

impl InventorySync {
    /// Asks over `plane` under `namespace`, waiting `timeout` per page.
    ///
    /// # Errors
    /// [`InventoryError::Subject`] for a bad namespace token.
    pub fn new(
        plane: Arc<dyn InventoryPlane>,
        namespace: &str,
        timeout: Duration,
    ) -> Result<Self, InventoryError> {
        inventory_subject(namespace, EngineId(uuid::Uuid::nil()))?;
        Ok(Self {
            plane,
            namespace: namespace.to_string(),
            timeout,
            page_blocks: MAX_SNAPSHOT_PAGE_BLOCKS,
            applied: HashMap::new(),
            snapshot_at: HashMap::new(),
            resume: None,
            streams: HashMap::new(),
            engine_subject: HashMap::new(),
        })
    }

    /// Asks pages of at most `blocks` (1..=[`MAX_SNAPSHOT_PAGE_BLOCKS`],
    /// clamped) blocks: small pages exercise paging in tests.
    pub fn with_page_blocks(mut self, blocks: u32) -> Self {
        self.page_blocks = blocks.clamp(1, MAX_SNAPSHOT_PAGE_BLOCKS);
        self
    }

    /// Moves `events` (the router's [`crate::KvEventReceiver`], from its
    /// [`crate::KvEventReceiver::resume_handle`]) past each applied
    /// snapshot's `last_event_id`. Without it, when a worker's replay ring is
    /// shorter than what the receiver missed, the first event after the
    /// snapshot waits one gap timeout behind a covered `Lost` range.
    pub fn with_stream_resume(mut self, events: KvStreamResume) -> Self {
        self.resume = Some(events);
        self
    }

    /// Moves `events`, the receiver of `subject`, past each applied snapshot
    /// of an engine that announced `subject` as its event subject (a router
    /// with one receiver per subject registers each here; it takes
    /// precedence over [`InventorySync::with_stream_resume`]). A later call
    /// for the same subject replaces the handle (a re-subscribed receiver).
    pub fn add_stream_resume(&mut self, subject: &crate::Subject, events: KvStreamResume) {
        self.streams.insert(subject.as_str().to_string(), events);
    }

    /// Stops moving the receiver of `subject` (it ended).
    pub fn remove_stream_resume(&mut self, subject: &crate::Subject) {
        self.streams.remove(subject.as_str());
    }

    /// A handle for asking snapshots without holding this sync
    /// ([`SnapshotAsker::fetch`], then [`InventorySync::apply_snapshot`]).
    pub fn asker(&self) -> SnapshotAsker {
        SnapshotAsker {
            plane: self.plane.clone(),
            namespace: self.namespace.clone(),
            timeout: self.timeout,
            page_blocks: self.page_blocks,
        }
    }

    /// The event id the snapshot of `engine` was consistent with, if one was applied.
    pub fn snapshot_event_id(&self, engine: EngineId) -> Option<u64> {
        self.snapshot_at.get(&engine).copied()
    }

    /// Whether a `Lost` range of `publisher` ending at `to_event_id` is
    /// covered by its applied snapshot (nothing to repair).
    pub fn covers(&self, publisher: EngineId, to_event_id: u64) -> bool {
        self.snapshot_at
            .get(&publisher)
            .is_some_and(|&at| to_event_id <= at)
    }

    /// Forgets `engine` (retired or removed).
    pub fn forget(&mut self, engine: EngineId) {
        self.applied.remove(&engine);
        self.snapshot_at.remove(&engine);
        self.engine_subject.remove(&engine);
    }

    /// The bookkeeping half of [`InventorySync::on_registration`]: a
    /// replaced incarnation is forgotten, the announced event subject noted;
    /// true when the worker needs a snapshot (a decode worker without an
    /// applied one). The caller then asks it, e.g. outside its lock.
    pub fn note_registration(
        &mut self,
        announcement: &WorkerAnnouncement,
        registration: &Registration,
    ) -> bool {
        match registration {
            Registration::Retired
            | Registration::OtherKey { .. }
            | Registration::IdentityChanged { .. } => return false,
            Registration::Replaced { dropped } => self.forget(*dropped),
            // A readmitted worker was forgotten when it was dropped.
            Registration::New | Registration::Refreshed | Registration::Readmitted => {}
        }
        self.engine_subject
            .insert(announcement.engine_id, announcement.event_subject.clone());
        announcement.role == Role::Decode && !self.snapshot_at.contains_key(&announcement.engine_id)
    }

    /// The router's call per announcement, after
    /// [`WorkerRegistry::announce`] returned `registration` and the worker
    /// was registered in `index` (and its directory record applied): a
    /// replaced incarnation is forgotten; a decode worker without an
    /// applied snapshot is rebuilt ([`InventorySync::rebuild_worker`]).
    /// `None` when nothing was asked. A failed rebuild is asked again at
    /// the worker's next announcement, so a router started before its
    /// workers, or while one was unreachable, catches up by itself.
    pub async fn on_registration(
        &mut self,
        announcement: &WorkerAnnouncement,
        registration: &Registration,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Option<Result<SyncOutcome, InventoryError>> {
        if !self.note_registration(announcement, registration) {
            return None;
        }
        Some(
            self.rebuild_worker(announcement.engine_id, index, remote, registry)
                .await,
        )
    }

    /// The router's call for a [`crate::KvStreamItem::Lost`] range of
    /// `publisher` ending at `to_event_id`: `None` when the applied snapshot
    /// covers it, else the outcome of a new snapshot.
    pub async fn on_lost(
        &mut self,
        publisher: EngineId,
        to_event_id: u64,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Option<Result<SyncOutcome, InventoryError>> {
        if self.covers(publisher, to_event_id) {
            return None;
        }
        Some(
            self.rebuild_worker(publisher, index, remote, registry)
                .await,
        )
    }

    /// Rebuilds every engine of `engines` (the registered decode workers)
    /// one after the other; see [`InventorySync::rebuild_worker`].
    pub async fn rebuild_inventory(
        &mut self,
        engines: impl IntoIterator<Item = EngineId>,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> RebuildReport {
        let mut report = RebuildReport::default();
        for engine in engines {
            match self.rebuild_worker(engine, index, remote, registry).await {
                Ok(o) => report.synced.push((engine, o)),
                Err(e) => report.failed.push((engine, e)),
            }
        }
        report
    }

    /// Asks `engine` for its whole inventory (page by page) and replaces
    /// what the index and `remote` know of it. The worker must already be
    /// registered in `index`. A retired incarnation is not asked.
    ///
    /// Pages may reflect different event ids (the worker kept storing while
    /// it was paged); the stream resumes after the smallest, which is safe:
    /// the events after it are applied again on top (a `Stored` of a held
    /// block and a `Removed` of an absent one change nothing).
    ///
    /// # Errors
    /// The transport's [`InventoryError`]; [`InventoryError::Wire`] for a
    /// malformed page; [`InventoryError::Refused`];
    /// [`InventoryError::Mismatch`] for a page of another engine, bank
    /// generation, layout or TP size; [`InventoryError::Stale`];
    /// [`InventoryError::Index`]. On error nothing was applied.
    pub async fn rebuild_worker(
        &mut self,
        engine: EngineId,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Result<SyncOutcome, InventoryError> {
        let asker = self.asker();
        let mut tries = 0;
        loop {
            if registry.is_retired(engine) {
                return Ok(SyncOutcome::Retired);
            }
            let pages = asker.fetch(engine).await?;
            match self.apply_snapshot(engine, pages, index, remote, registry) {
                Err(InventoryError::Stale { .. }) if tries + 1 < STALE_RETRIES => tries += 1,
                done => return done,
            }
        }
    }

    /// Applies the snapshot `pages` of `engine` (from [`SnapshotAsker::fetch`]):
    /// replaces what the index and `remote` know of it and moves its event
    /// receiver past the snapshot. A retired incarnation is not applied.
    ///
    /// # Errors
    /// [`InventoryError::Stale`] when the stream already applied an event
    /// after the snapshot (ask again); [`InventoryError::Index`]. On error
    /// nothing was applied.
    pub fn apply_snapshot(
        &mut self,
        engine: EngineId,
        pages: SnapshotPages,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Result<SyncOutcome, InventoryError> {
        // The registry may have retired it while the pages were asked.
        if registry.is_retired(engine) {
            return Ok(SyncOutcome::Retired);
        }
        let applied = self.applied.get(&engine).copied().unwrap_or(0);
        if pages.last_event_id < applied {
            return Err(InventoryError::Stale {
                engine,
                snapshot_event_id: pages.last_event_id,
                applied_event_id: applied,
            });
        }
        let hashes: Vec<SequenceHash> = pages.blocks.iter().map(|b| b.sequence_hash).collect();
        index.resync_worker(
            engine,
            pages.last_event_id,
            &[(StorageTier::RetainedGpuDirect, hashes)],
        )?;
        let synthetic = |data| KvEvent {
            publisher: engine,
            event_id: pages.last_event_id,
            role: Role::Decode,
            layout_fingerprint: pages.layout_fingerprint,
            tp_size: pages.tp_size,
            tier: StorageTier::RetainedGpuDirect,
            data,
        };
        remote.ingest_event(&synthetic(KvEventData::Cleared));
        remote.ingest_event(&synthetic(KvEventData::Stored {
            parent: None,
            blocks: pages
                .blocks
                .iter()
                .map(|b| StoredBlock {
                    sequence_hash: b.sequence_hash,
                    token_hash: b.token_hash,
                    slot: Some(b.slot),
                })
                .collect(),
        }));
        self.applied.insert(engine, pages.last_event_id);
        self.snapshot_at.insert(engine, pages.last_event_id);
        // The stream goes on after the snapshot: events it holds are not
        // waited for (their gap would end in a covered `Lost` only after the
        // gap timeout) and count nothing twice.
        let events = self
            .engine_subject
            .get(&engine)
            .and_then(|subject| self.streams.get(subject))
            .or(self.resume.as_ref());
        if let Some(events) = events {
            events.resume_from(engine, pages.last_event_id);
        }
        Ok(SyncOutcome::Applied {
            blocks: pages.blocks.len(),
            last_event_id: pages.last_event_id,
        })
    }

    /// Applies one event of the stream to `index` and `remote`, once: a
    /// duplicate (at or below the snapshot's id, or a replay) and an event
    /// of a retired incarnation change neither.
    ///
    /// # Errors
    /// The index's [`LookupError`] (e.g. an unknown engine).
    pub fn apply_event(
        &mut self,
        event: &KvEvent,
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Result<EventOutcome, LookupError> {
        if registry.is_retired(event.publisher) {
            return Ok(EventOutcome::FromRetiredIncarnation);
        }
        let outcome = index.apply_event(event)?;
        self.note_outcome(event, &outcome, remote);
        Ok(outcome)
    }

    /// Applies consecutive events of the stream as
    /// [`InventorySync::apply_event`] one by one would, in order, but with
    /// one [`InventoryIndex::apply_events`] call: the index publishes them
    /// together (a lookup sees none or all of them), so lookups switch
    /// copies once per run instead of once per event. Returns each event's
    /// result, in order: what `apply_event` would have returned for it
    /// (events of a retired incarnation are
    /// [`EventOutcome::FromRetiredIncarnation`] and reach neither the index
    /// nor `remote`; the others reach `remote` when applied, as there).
    ///
    /// Errors are per event, in the returned vector (the index's
    /// [`LookupError`], e.g. a layout mismatch): a refused event does not
    /// stop the others.
    pub fn apply_events(
        &mut self,
        events: &[KvEvent],
        index: &InventoryIndex,
        remote: &RemoteDonorDirectory,
        registry: &WorkerRegistry,
    ) -> Vec<Result<EventOutcome, LookupError>> {
        if events.is_empty() {
            return Vec::new();
        }
        let live: Vec<bool> = events
            .iter()
            .map(|e| !registry.is_retired(e.publisher))
            .collect();
        let applied = if live.iter().all(|&l| l) {
            index.apply_events(events).outcomes
        } else {
            // Late events of a replaced worker are rare: copy the others.
            let kept: Vec<KvEvent> = events
                .iter()
                .zip(&live)
                .filter(|&(_, &l)| l)
                .map(|(e, _)| e.clone())
                .collect();
            if kept.is_empty() {
                Vec::new()
            } else {
                index.apply_events(&kept).outcomes
            }
        };
        let mut applied = applied.into_iter();
        let mut out = Vec::with_capacity(events.len());
        for (event, live) in events.iter().zip(live) {
            if !live {
                out.push(Ok(EventOutcome::FromRetiredIncarnation));
                continue;
            }
            let result = applied
                .next()
                .expect("the index reports one outcome per event");
            if let Ok(outcome) = &result {
                self.note_outcome(event, outcome, remote);
            }
            out.push(result);
        }
        out
    }

    /// What follows an event's index outcome: an applied event (in order
    /// or after a gap) goes to `remote` and raises the publisher's applied
    /// high-water mark.
    fn note_outcome(
        &mut self,
        event: &KvEvent,
        outcome: &EventOutcome,
        remote: &RemoteDonorDirectory,
    ) {
        match outcome {
            EventOutcome::Applied { .. } | EventOutcome::Gap { .. } => {
                remote.ingest_event(event);
                let at = self.applied.entry(event.publisher).or_insert(0);
                *at = (*at).max(event.event_id);
            }
            EventOutcome::Duplicate { .. }
            | EventOutcome::FromRetiredIncarnation
            | EventOutcome::Unchained { .. } => {}
        }
    }

    /// The highest event id of `engine` applied so far, from its snapshot
    /// or its stream (`None` before either, or after
    /// [`InventorySync::forget`]). A snapshot older than it is stale.
    pub fn applied_event_id(&self, engine: EngineId) -> Option<u64> {
        self.applied.get(&engine).copied()
    }
}

impl SnapshotAsker {
    /// Asks `engine` for its whole inventory, page by page (each page
    /// waits at most the sync's timeout).
    ///
    /// # Errors
    /// The transport's [`InventoryError`]; [`InventoryError::Wire`] for a
    /// malformed page; [`InventoryError::Refused`];
    /// [`InventoryError::Mismatch`] for a page of another engine, or pages
    /// of one snapshot that disagree on bank generation, layout or TP size.
    pub async fn fetch(&self, engine: EngineId) -> Result<SnapshotPages, InventoryError> {
        let subject = inventory_subject(&self.namespace, engine)?;
        let mut from_slot = 0;
        let mut out: Option<SnapshotPages> = None;
        loop {
            let req = InventoryRequest {
                engine_id: engine,
                from_slot,
                max_blocks: self.page_blocks,
            };
            let bytes = req.to_wire().map_err(|e| InventoryError::Transport {
                subject: subject.to_string(),
                reason: format!("encoding the request: {e}"),
            })?;
            let answer = self.plane.request(&subject, bytes, self.timeout).await?;
            let page = match InventoryReply::decode(&answer)? {
                InventoryReply::Snapshot(s) => s,
                InventoryReply::Refused(refusal) => {
                    return Err(InventoryError::Refused { engine, refusal })
                }
            };
            let mismatch = |field, reason| InventoryError::Mismatch {
                engine,
                field,
                reason,
            };
            if page.engine_id != engine {
                return Err(mismatch(
                    "engine_id",
                    format!("{} answered", page.engine_id),
                ));
            }
            if page.blocks.len() > self.page_blocks as usize {
                return Err(mismatch(
                    "blocks",
                    format!(
                        "{} blocks for a page of {}",
                        page.blocks.len(),
                        self.page_blocks
                    ),
                ));
            }
            if page.blocks.first().is_some_and(|b| b.slot < from_slot) {
                return Err(mismatch(
                    "blocks.slot",
                    format!(
                        "page from slot {from_slot} starts at {}",
                        page.blocks[0].slot
                    ),
                ));
            }
            let all = out.get_or_insert_with(|| SnapshotPages {
                bank_generation: page.bank_generation,
                layout_fingerprint: page.layout_fingerprint,
                tp_size: page.tp_size,
                last_event_id: page.last_event_id,
                blocks: Vec::new(),
            });
            if (page.bank_generation, page.layout_fingerprint, page.tp_size)
                != (all.bank_generation, all.layout_fingerprint, all.tp_size)
            {
                return Err(mismatch(
                    "bank_generation",
                    format!(
                        "pages of one snapshot differ: generation {} / layout {:?} / TP{} after {} / {:?} / TP{}",
                        page.bank_generation, page.layout_fingerprint, page.tp_size,
                        all.bank_generation, all.layout_fingerprint, all.tp_size
                    ),
                ));
            }
            all.last_event_id = all.last_event_id.min(page.last_event_id);
            all.blocks.extend(page.blocks);
            match page.next_slot {
                Some(next) if next > from_slot => from_slot = next,
                Some(next) => {
                    return Err(mismatch(
                        "next_slot",
                        format!("{next} does not advance past {from_slot}"),
                    ))
                }
                None => break,
            }
        }
        Ok(out.expect("at least one page"))
    }
}

/// Every page of one snapshot, merged ([`SnapshotAsker::fetch`]); the
/// snapshot is consistent with event id [`SnapshotPages::last_event_id`].
pub struct SnapshotPages {
    bank_generation: u64,
    layout_fingerprint: LayoutFingerprint,
    tp_size: u32,
    last_event_id: u64,
    blocks: Vec<SnapshotBlock>,
}

impl SnapshotPages {
    /// The smallest event id of the pages (the stream resumes after it).
    pub fn last_event_id(&self) -> u64 {
        self.last_event_id
    }
    /// Ready blocks listed.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }
}
