//! [`RouterInventory`]: what a router process keeps from the planes, and the
//! tasks that feed it.
//!
//! - **Worker announcements** (`kv.<namespace>.workers.announce`): each one
//!   registers the worker with the kv-lookup index (worker key = XXH3-64 of
//!   its `worker_key`); a prefill worker becomes an advise target; a new
//!   incarnation under a known key drops the old one everywhere (index,
//!   donor directory, targets) and its late events and directory renewals
//!   are ignored; a worker silent for `missed_periods` announce periods is
//!   dropped the same way. The first announcement naming an event subject
//!   subscribes to it.
//! - **KV events** on every announced subject, in per-publisher order
//!   ([`KvEventReceiver`]): applied to the index and to the
//!   [`RemoteDonorDirectory`]'s slot maps.
//! - **The donor directory** ([`DirectoryPlane::watch`]): applied to the
//!   [`RemoteDonorDirectory`], except puts of retired incarnations (a
//!   replaced donor's last renewal must not bring it back).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::{EngineId, Role};
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use parking_lot::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::RouterService;
use crate::{
    announce_subject, unix_now_ms, DirectoryChange, DirectoryPlane, EventPlane, KvEventReceiver,
    KvStreamItem, PlaneError, Registration, RemoteDonorDirectory, Subject, WorkerAnnouncement,
    WorkerRegistry, SUBJECT_ROOT,
};

/// Counters of what the followers took in (all since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FollowStats {
    /// Announcements accepted (new, refreshed or replacing).
    pub announcements: u64,
    /// Announcements refused (undecodable, invalid) or of retired incarnations.
    pub announcements_ignored: u64,
    /// Workers dropped (replaced or silent).
    pub workers_dropped: u64,
    /// KV events applied to the index.
    pub events_applied: u64,
    /// KV events of retired incarnations, ignored.
    pub late_events_ignored: u64,
    /// Events the index refused (unknown worker, layout mismatch).
    pub events_refused: u64,
    /// [`KvStreamItem::Lost`] ranges seen (the inventory of that publisher
    /// is incomplete until it republishes or a snapshot rebuilds it).
    pub lost_ranges: u64,
    /// Directory changes applied.
    pub directory_changes: u64,
    /// Directory puts of retired incarnations, ignored.
    pub directory_puts_ignored: u64,
}

#[derive(Debug, Default)]
struct Counters {
    announcements: AtomicU64,
    announcements_ignored: AtomicU64,
    workers_dropped: AtomicU64,
    events_applied: AtomicU64,
    late_events_ignored: AtomicU64,
    events_refused: AtomicU64,
    lost_ranges: AtomicU64,
    directory_changes: AtomicU64,
    directory_puts_ignored: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The router's inventory state: index, donor directory, worker registry and
/// the advise targets of the [`RouterService`].
pub struct RouterInventory {
    index: Arc<InventoryIndex>,
    remote: Arc<RemoteDonorDirectory>,
    service: Arc<RouterService>,
    registry: Mutex<WorkerRegistry>,
    subscribed: Mutex<HashSet<String>>,
    counters: Counters,
}

impl std::fmt::Debug for RouterInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterInventory")
            .field("workers", &self.registry.lock().len())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Parses a full subject string `kv.<namespace>.<component>.<topic>`.
///
/// # Errors
/// [`PlaneError::InvalidSubject`] naming `subject` when it has another root
/// or shape, or the failing token's field.
pub fn parse_subject(full: &str) -> Result<Subject, PlaneError> {
    let parts: Vec<&str> = full.split('.').collect();
    match parts.as_slice() {
        [root, ns, component, topic] if *root == SUBJECT_ROOT => Subject::new(ns, component, topic),
        _ => Err(PlaneError::InvalidSubject {
            field: "subject",
            value: full.to_string(),
        }),
    }
}

impl RouterInventory {
    /// State over `index` and `remote` (the ones the advisor of `service`
    /// reads), dropping workers silent for `missed_periods` x
    /// `announce_period_ms`.
    pub fn new(
        index: Arc<InventoryIndex>,
        remote: Arc<RemoteDonorDirectory>,
        service: Arc<RouterService>,
        announce_period_ms: u64,
        missed_periods: u32,
    ) -> Self {
        Self {
            index,
            remote,
            service,
            registry: Mutex::new(WorkerRegistry::new(announce_period_ms, missed_periods)),
            subscribed: Mutex::new(HashSet::new()),
            counters: Counters::default(),
        }
    }

    /// The index the advisor reads.
    pub fn index(&self) -> &Arc<InventoryIndex> {
        &self.index
    }

    /// Counters so far.
    pub fn stats(&self) -> FollowStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FollowStats {
            announcements: get(&c.announcements),
            announcements_ignored: get(&c.announcements_ignored),
            workers_dropped: get(&c.workers_dropped),
            events_applied: get(&c.events_applied),
            late_events_ignored: get(&c.late_events_ignored),
            events_refused: get(&c.events_refused),
            lost_ranges: get(&c.lost_ranges),
            directory_changes: get(&c.directory_changes),
            directory_puts_ignored: get(&c.directory_puts_ignored),
        }
    }

    fn drop_engine(&self, engine: EngineId) {
        self.index.remove_worker(engine);
        self.remote.forget(engine);
        self.service.remove_target(engine);
        bump(&self.counters.workers_dropped);
    }

    /// Takes in one announcement payload seen at `now_ms`; returns the
    /// announced event subject when it is new to this router (the caller
    /// subscribes to it).
    pub fn on_announcement(&self, payload: &[u8], now_ms: u64) -> Option<Subject> {
        let a = match WorkerAnnouncement::decode(payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "worker announcement refused");
                bump(&self.counters.announcements_ignored);
                return None;
            }
        };
        match self.registry.lock().announce(a.clone(), now_ms) {
            Registration::Retired => {
                bump(&self.counters.announcements_ignored);
                return None;
            }
            Registration::Replaced { dropped } => self.drop_engine(dropped),
            Registration::New | Registration::Refreshed => {}
        }
        bump(&self.counters.announcements);
        let info = WorkerInfo {
            engine: a.engine_id,
            role: a.role,
            layout_fingerprint: a.layout_fingerprint,
            tp_size: a.tp_size,
        };
        let key = WorkerKey(xxhash_rust::xxh3::xxh3_64(a.worker_key.as_bytes()));
        if let Err(e) = self.index.register_worker(key, info) {
            tracing::warn!(worker = %a.worker_key, error = %e, "index refused the worker");
        }
        if a.role == Role::Prefill {
            self.service.add_target(a.engine_id);
        }
        match parse_subject(&a.event_subject) {
            Ok(s) => self
                .subscribed
                .lock()
                .insert(s.as_str().to_string())
                .then_some(s),
            Err(e) => {
                tracing::warn!(worker = %a.worker_key, error = %e, "announced event subject unusable");
                None
            }
        }
    }

    /// Drops workers silent too long at `now_ms`; returns how many.
    pub fn tick(&self, now_ms: u64) -> usize {
        let dead = self.registry.lock().tick(now_ms);
        for (key, engine) in &dead {
            tracing::info!(worker = %key, engine = %engine, "worker silent: dropped");
            self.drop_engine(*engine);
        }
        dead.len()
    }

    /// Takes in one item of a KV event stream.
    pub fn on_event(&self, item: KvStreamItem) {
        match item {
            KvStreamItem::Event(e) => {
                if self.registry.lock().is_retired(e.publisher) {
                    bump(&self.counters.late_events_ignored);
                    return;
                }
                match self.index.apply_event(&e) {
                    Ok(_) => {
                        bump(&self.counters.events_applied);
                        self.remote.ingest_event(&e);
                    }
                    Err(err) => {
                        bump(&self.counters.events_refused);
                        tracing::debug!(publisher = %e.publisher, error = %err, "KV event refused by the index");
                    }
                }
            }
            KvStreamItem::Lost {
                publisher,
                from_event_id,
                to_event_id,
            } => {
                bump(&self.counters.lost_ranges);
                tracing::warn!(%publisher, from_event_id, to_event_id, "KV events lost: inventory incomplete");
            }
        }
    }

    /// Takes in one directory change.
    pub fn on_directory(&self, change: DirectoryChange) {
        if let DirectoryChange::Put(r) = &change {
            if self.registry.lock().is_retired(r.engine_id()) {
                bump(&self.counters.directory_puts_ignored);
                return;
            }
        }
        bump(&self.counters.directory_changes);
        self.remote.apply_directory(change);
    }

    /// Runs the followers on `plane` and `directory` until `shutdown`:
    /// announcements (and the event subscriptions they name), the silence
    /// tick every `announce_period`, and the directory watch.
    ///
    /// # Errors
    /// The plane's or directory's subscribe error at start (nothing runs).
    pub async fn follow(
        self: &Arc<Self>,
        plane: Arc<dyn EventPlane>,
        directory: &dyn DirectoryPlane,
        namespace: &str,
        announce_period: Duration,
        shutdown: CancellationToken,
    ) -> Result<JoinSet<()>, PlaneError> {
        let mut announcements = plane.subscribe(&announce_subject(namespace)?).await?;
        let mut watch = directory.watch().await?;
        let mut tasks = JoinSet::new();
        let (me, stop) = (self.clone(), shutdown.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    c = watch.next() => match c {
                        Some(c) => me.on_directory(c),
                        None => {
                            tracing::warn!("donor directory watch ended");
                            return;
                        }
                    },
                }
            }
        });
        let (me, stop) = (self.clone(), shutdown.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(announce_period);
            let mut streams: JoinSet<()> = JoinSet::new();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => { me.tick(unix_now_ms()); }
                    m = announcements.next() => {
                        let Some(m) = m else { return };
                        if let Some(subject) = me.on_announcement(&m.payload, unix_now_ms()) {
                            // One receiver per subject; its own task so a slow
                            // subscribe does not hold up announcements.
                            let (me, stop, plane) = (me.clone(), stop.clone(), plane.clone());
                            streams.spawn(async move { me.follow_events(plane, subject, stop).await });
                        }
                    }
                }
            }
        });
        Ok(tasks)
    }

    async fn follow_events(
        self: Arc<Self>,
        plane: Arc<dyn EventPlane>,
        subject: Subject,
        stop: CancellationToken,
    ) {
        let mut rx = match KvEventReceiver::subscribe(plane, &subject, Duration::from_secs(1)).await
        {
            Ok(rx) => rx,
            Err(e) => {
                tracing::warn!(%subject, error = %e, "cannot follow KV events");
                // Let a later announcement try again.
                self.subscribed.lock().remove(subject.as_str());
                return;
            }
        };
        tracing::info!(%subject, "following KV events");
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                item = rx.next() => match item {
                    Some(item) => self.on_event(item),
                    None => return,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kv_descriptor::{GpuIdentity, KvEvent, KvEventData, LayoutFingerprint, StorageTier, Wire};

    use super::*;
    use crate::{Advisor, CostModel, DecisionLog, LiveCostModel, ReuseSettings};

    fn inventory() -> (Arc<RouterInventory>, Arc<RouterService>) {
        let index = Arc::new(InventoryIndex::new());
        let remote = Arc::new(RemoteDonorDirectory::new());
        let advisor = Advisor::new(
            index.clone(),
            remote.clone(),
            LiveCostModel::new(CostModel::new(ReuseSettings::default(), 16).unwrap()),
            Arc::new(DecisionLog::new(8)),
            1024,
        );
        let service = Arc::new(RouterService::new(Arc::new(advisor)));
        let inv = RouterInventory::new(index, remote, service.clone(), 1_000, 3);
        (Arc::new(inv), service)
    }

    fn announcement(key: &str, engine: EngineId, role: Role, subject: &str) -> Vec<u8> {
        WorkerAnnouncement {
            worker_key: key.into(),
            engine_id: engine,
            role,
            layout_fingerprint: LayoutFingerprint(9),
            tp_size: 1,
            gpus: vec![GpuIdentity::new(uuid::Uuid::from_u128(1), 0, "h").unwrap()],
            pin_endpoint: "unix:/tmp/p".into(),
            event_subject: subject.into(),
        }
        .to_wire()
        .unwrap()
    }

    fn stored(publisher: EngineId, event_id: u64) -> KvEvent {
        let blocks = kv_bank::sealed_blocks(None, &(0..32).collect::<Vec<u32>>(), 16);
        KvEvent {
            publisher,
            event_id,
            role: Role::Decode,
            layout_fingerprint: LayoutFingerprint(9),
            tp_size: 1,
            tier: StorageTier::RetainedGpuDirect,
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        }
    }

    #[test]
    fn parse_subject_takes_only_our_four_token_subjects() {
        assert_eq!(
            parse_subject("kv.ns.decode.kv_events").unwrap().as_str(),
            "kv.ns.decode.kv_events"
        );
        for bad in [
            "other.ns.decode.x",
            "kv.ns.decode",
            "kv.ns.a.b.c",
            "kv.ns.*.x",
        ] {
            assert!(parse_subject(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn prefill_becomes_a_target_and_a_new_incarnation_drops_the_old_one() {
        let (inv, service) = inventory();
        let (old, new) = (EngineId::fresh(), EngineId::fresh());
        let subject = "kv.t.prefill.kv_events";
        let first = inv.on_announcement(&announcement("p0", old, Role::Prefill, subject), 0);
        assert_eq!(
            first.map(|s| s.as_str().to_string()).as_deref(),
            Some(subject)
        );
        // The same subject again: already followed, nothing to subscribe.
        assert!(inv
            .on_announcement(&announcement("p0", old, Role::Prefill, subject), 10)
            .is_none());
        let req = |target| crate::service::AdviseRequest {
            request_id: "r".into(),
            target,
            keys: crate::service::AdviseKeys::SequenceHashes(vec![kv_descriptor::SequenceHash(1)]),
        };
        let known = |t| {
            !matches!(
                service.advise(&req(t)).result,
                crate::service::AdviseResult::Refused(
                    crate::service::AdviseRefusal::UnknownTarget(_)
                )
            )
        };
        assert!(known(old));
        inv.on_announcement(&announcement("p0", new, Role::Prefill, subject), 20);
        assert!(!known(old), "replaced incarnation is no target");
        assert!(known(new));
        assert!(
            inv.index().worker(old).is_none(),
            "old engine left the index"
        );
        // The old incarnation's late announcement is ignored.
        inv.on_announcement(&announcement("p0", old, Role::Prefill, subject), 30);
        assert!(!known(old));
        let st = inv.stats();
        assert_eq!(
            (
                st.announcements,
                st.announcements_ignored,
                st.workers_dropped
            ),
            (3, 1, 1)
        );
    }

    #[test]
    fn events_of_retired_or_silent_workers_are_ignored() {
        let (inv, _) = inventory();
        let (d0, d1) = (EngineId::fresh(), EngineId::fresh());
        inv.on_announcement(&announcement("d0", d0, Role::Decode, "kv.t.decode.e"), 0);
        inv.on_event(KvStreamItem::Event(stored(d0, 1)));
        let h = kv_bank::sealed_blocks(None, &(0..32).collect::<Vec<u32>>(), 16)[0].sequence_hash;
        assert!(!inv.index().holds(d0, h).is_empty());
        // d0 restarts as d1: d0's inventory goes, its late event is ignored.
        inv.on_announcement(&announcement("d0", d1, Role::Decode, "kv.t.decode.e"), 100);
        assert!(inv.index().holds(d0, h).is_empty());
        inv.on_event(KvStreamItem::Event(stored(d0, 2)));
        assert!(inv.index().holds(d0, h).is_empty());
        // d1 goes silent for more than 3 periods of 1 s: dropped.
        assert_eq!(inv.tick(100 + 3_000), 0);
        assert_eq!(inv.tick(100 + 3_001), 1);
        assert!(inv.index().worker(d1).is_none());
        let st = inv.stats();
        assert_eq!(
            (
                st.events_applied,
                st.late_events_ignored,
                st.workers_dropped
            ),
            (1, 1, 2)
        );
    }
}
