//! [`RouterInventory`]: what a router process keeps from the planes, and the
//! tasks that feed it.
//!
//! - **Worker announcements** (`kv.<namespace>.workers.announce`): each one
//!   registers the worker with the kv-lookup index (worker key = XXH3-64 of
//!   its `worker_key`); a prefill worker becomes an advise target; a new
//!   incarnation under a known key drops the old one everywhere (index,
//!   donor directory, targets, inventory sync) and its late events and
//!   directory renewals are ignored while the registry remembers it (an
//!   announcement of it is counted in `announcements_ignored` and logged at
//!   most once per [`RETIRED_LOG_EVERY`]). A worker silent for
//!   `missed_periods` announce periods is dropped the same way, except that
//!   it is not replaced: when it announces again it is taken back
//!   (`workers_readmitted`), excluded as a donor until its inventory
//!   snapshot is applied (its events while it was away were missed). The
//!   registry forgets such incarnations once not heard of for
//!   [`crate::FORGET_AFTER_SILENCE_WINDOWS`] silence windows (at least
//!   [`crate::FORGET_AFTER_MIN_MS`]) or past [`crate::MAX_REMEMBERED`]
//!   (`incarnations_forgotten`), and the index forgets them with it; one
//!   that announces after that registers as new, empty, its first event a
//!   gap (`register_in_index` in `follow_liveness.rs`). The router's own
//!   disconnection is no worker's silence: while the event plane reports
//!   its connection down (polled every [`CONNECTION_POLL`]) no worker is
//!   dropped, and once it is back every worker gets a fresh deadline and
//!   every decode worker is asked a new snapshot, those that served one
//!   before being no donor until it is applied
//!   ([`RouterInventory::on_connection`]).
//!   The first announcement naming
//!   an event subject subscribes to it; once no registered worker names a
//!   subject any more (its last worker dropped, or announcing another
//!   subject), its subscription is dropped (`event_subjects_released`), so
//!   a fleet whose worker keys change with every restart (pod names) does
//!   not accumulate subscriptions, tasks and receivers of dead workers.
//! - **Inventory rebuild** ([`InventorySync`], issue 18): a decode worker
//!   announced while its event subject is already followed and its directory
//!   record already applied is asked for its inventory snapshot once, so a
//!   router (re)started after the worker went idle still finds its blocks.
//!   Both conditions are the order `docs/agents.md` requires (receiver
//!   subscribed before the request; record before the snapshot, because a
//!   record's first put resets the donor's slot map); an announcement that
//!   comes before them, or a snapshot that fails, is retried at the worker's
//!   next announcement.
//! - **KV events** on every announced subject, in per-publisher order
//!   ([`KvEventReceiver`]): applied once through
//!   [`InventorySync::apply_events`] to the index and to the
//!   [`RemoteDonorDirectory`]'s slot maps (events a snapshot already holds
//!   are duplicates). Group commit: with each item it receives, a subject's
//!   follower takes every item its receiver already holds
//!   ([`KvEventReceiver::try_next`], at most `FOLLOW_BATCH_MAX`) and applies
//!   each run of consecutive events with one index publication
//!   ([`RouterInventory::on_events`]); it never waits for more, so a lone
//!   event applies at once. A [`KvStreamItem::Lost`] range ends a run (the
//!   events before it apply first); one the snapshot does not cover asks a
//!   new snapshot ([`InventorySync::on_lost`]).
//! - **The donor directory** ([`DirectoryPlane::watch`]): applied to the
//!   [`RemoteDonorDirectory`], except puts of retired incarnations (a
//!   replaced donor's last renewal must not bring it back). A new generation
//!   of a donor whose snapshot was applied resets its slot map, so the
//!   snapshot is forgotten and asked again at the next announcement.
//! - **Re-opening.** A follower whose stream ends (a NATS key-value watch
//!   ends on an error such as its bucket being deleted; a subscription
//!   ends when its client closes) is not left dead: the directory watch is
//!   re-opened and the announcements subscribed again, after
//!   [`REOPEN_BACKOFF_MIN`] doubling to [`REOPEN_BACKOFF_MAX`] between
//!   failed tries, and [`RouterInventory::follower_down`] names it until
//!   then (the router's `/healthz` answers 503 with that reason); a deleted
//!   bucket is created again by the re-open when the directory may create
//!   it ([`crate::NatsDirectory`]'s watch). A re-opened
//!   watch delivers every current record again (renewals change nothing);
//!   a record deleted while no watch was open stays cached until its lease
//!   lapses, which is when the advisor stops resolving it anyway.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::{EngineId, KvEvent, Role};
use kv_lookup::{EventOutcome, InventoryIndex, LookupError};
use tokio_util::sync::CancellationToken;

pub use super::follow_stats::FollowStats;
use super::follow_stats::{bump, Counters};
use super::RouterService;
use crate::log_throttle::LogThrottle;
use crate::{
    CacheUpdate, DirectoryChange, InventoryError, InventorySync, KvStreamItem, PlaneError,
    Registration, RemoteDonorDirectory, Subject, SyncOutcome, WorkerAnnouncement, WorkerRegistry,
};

/// Most stream items an event follower takes from its receiver at once
/// (the first awaited, the rest already waiting) before applying them.
/// Bounds the run of events one index publication carries (and the time
/// the follower holds the state lock for it); 256 events of a few blocks
/// take well under a millisecond.
pub(crate) const FOLLOW_BATCH_MAX: usize = 256;

/// First wait before re-opening a follower's ended stream (the directory
/// watch, the announcements subscription); doubled after each failed try.
pub const REOPEN_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between tries to re-open an ended stream: a bucket deleted
/// by an operator is watched again within this of being recreated.
pub const REOPEN_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Shortest time between two log lines of refused announcements: anyone
/// who can publish on the announce subject can send garbage, and 20,000
/// garbage announcements in 0.15 s wrote 20,000 WARN lines (3.8 MB) before
/// (helper-20). Every refusal is still counted (`announcements_ignored`).
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// Shortest time between two log lines of ignored announcements of
/// replaced incarnations: such an incarnation (two live processes under one
/// worker key, say) announces every period for as long as it runs.
pub const RETIRED_LOG_EVERY: Duration = Duration::from_secs(10);

/// How often the follower checks the event plane's connection
/// ([`EventPlane::is_connected`]): well below any announce period (10 ms
/// at least, 3 periods of silence at least), so that the router's own
/// disconnection is seen before it could count as the workers' silence.
pub const CONNECTION_POLL: Duration = Duration::from_millis(20);

/// What one async mutex guards: the registry and the sync must be seen
/// together (every sync call reads `is_retired`, and a snapshot must not
/// interleave with the events and directory changes it is ordered against).
/// A snapshot request is never awaited under it
/// ([`RouterInventory::rebuild`]): a worker that does not answer would hold
/// every other worker's events and announcements for the full timeout.
struct Tracked {
    registry: WorkerRegistry,
    sync: InventorySync,
    /// Event subjects named by registered workers, with their followers.
    subjects: HashMap<String, SubjectFollower>,
    /// Generation of the next subject follower.
    next_generation: u64,
    /// Donor layouts whose block size was checked against the cost model
    /// ([`RouterInventory::check_layout`]), each once.
    checked_layouts: HashSet<kv_descriptor::LayoutFingerprint>,
}

/// One event subject's follower, as the state knows it.
struct SubjectFollower {
    /// `false` while the receiver subscribes, `true` once it is subscribed
    /// (a snapshot may be asked from then on).
    followed: bool,
    /// Tells this subject's follower task whether it is still the one: a
    /// subject released and named again gets a new follower, and the old
    /// task (still subscribing, say) must not touch the new one's state.
    generation: u64,
    /// Cancelled when the subject is released.
    stop: CancellationToken,
}

impl Tracked {
    /// Whether `generation` is still `subject`'s follower.
    fn is_current(&self, subject: &Subject, generation: u64) -> bool {
        self.subjects
            .get(subject.as_str())
            .is_some_and(|f| f.generation == generation)
    }
}

/// The router's inventory state: index, donor directory, worker registry,
/// inventory sync and the advise targets of the [`RouterService`].
pub struct RouterInventory {
    index: Arc<InventoryIndex>,
    remote: Arc<RemoteDonorDirectory>,
    service: Arc<RouterService>,
    state: tokio::sync::Mutex<Tracked>,
    counters: Counters,
    /// Set while the directory watch has ended and is not open again.
    directory_down: AtomicBool,
    /// Set while the announcements subscription has ended and is not made again.
    announcements_down: AtomicBool,
    /// Log lines of undecodable announcements.
    refused_log: LogThrottle,
    /// Log lines of ignored announcements of replaced incarnations.
    retired_log: LogThrottle,
    /// Rate limit of the warning about an announcement under a second key.
    other_key_log: LogThrottle,
    /// Rate limit of the warning about an announcement changing a
    /// registered fact (role, layout, TP).
    identity_log: LogThrottle,
    /// Rate limit of the warning about a worker the index refused.
    index_refused_log: LogThrottle,
    /// Rate limit of the info line about a replaced incarnation: one per
    /// restart, but a crash loop restarting many times a second wrote one
    /// line each (trial h44: 4,999 lines for 5,000 incarnations).
    replaced_log: LogThrottle,
    /// Set while the router's own connection is down (the registry is
    /// paused); read without the state lock by each connection poll.
    connection_down: AtomicBool,
}

impl std::fmt::Debug for RouterInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `None` while a follower holds the state (a snapshot may be in flight).
        let workers = self.state.try_lock().ok().map(|st| st.registry.len());
        f.debug_struct("RouterInventory")
            .field("workers", &workers)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Parses a full subject string `kv.<namespace>.<component>.<topic>`
/// ([`Subject::parse`]).
///
/// # Errors
/// [`PlaneError::InvalidSubject`] naming `subject` when it has another root
/// or shape, or the failing token's field.
pub fn parse_subject(full: &str) -> Result<Subject, PlaneError> {
    Subject::parse(full)
}

impl RouterInventory {
    /// State over `index` and `remote` (the ones the advisor of `service`
    /// reads), rebuilding decode workers' inventories through `sync` (its
    /// plane reaches the workers' `kv.<ns>.inventory.<engine_id>` servers),
    /// dropping workers silent for `missed_periods` x `announce_period_ms`.
    pub fn new(
        index: Arc<InventoryIndex>,
        remote: Arc<RemoteDonorDirectory>,
        service: Arc<RouterService>,
        sync: InventorySync,
        announce_period_ms: u64,
        missed_periods: u32,
    ) -> Self {
        Self {
            index,
            remote,
            service,
            state: tokio::sync::Mutex::new(Tracked {
                registry: WorkerRegistry::new(announce_period_ms, missed_periods),
                sync,
                subjects: HashMap::new(),
                next_generation: 0,
                checked_layouts: HashSet::new(),
            }),
            counters: Counters::default(),
            directory_down: AtomicBool::new(false),
            announcements_down: AtomicBool::new(false),
            refused_log: LogThrottle::new(REFUSAL_LOG_EVERY),
            retired_log: LogThrottle::new(RETIRED_LOG_EVERY),
            other_key_log: LogThrottle::new(RETIRED_LOG_EVERY),
            identity_log: LogThrottle::new(RETIRED_LOG_EVERY),
            index_refused_log: LogThrottle::new(RETIRED_LOG_EVERY),
            replaced_log: LogThrottle::new(REFUSAL_LOG_EVERY),
            connection_down: AtomicBool::new(false),
        }
    }

    /// Which follower stream has ended and is not open again yet, if any:
    /// `"donor directory watch down"` or `"worker announcements down"`
    /// (what the router's `/healthz` answers 503 with). `None` before
    /// [`RouterInventory::follow`] and while both are open.
    ///
    /// ```
    /// # use kv_router_glue::*;
    /// # use kv_router_glue::service::{RouterInventory, RouterService};
    /// # use std::sync::Arc;
    /// # let index = Arc::new(kv_lookup::InventoryIndex::new());
    /// # let remote = Arc::new(RemoteDonorDirectory::new());
    /// # let model = LiveCostModel::new(CostModel::new(ReuseSettings::default(), 16).unwrap());
    /// # let advisor = Advisor::new(index.clone(), remote.clone(), model, Arc::new(DecisionLog::new(8)), 1024);
    /// # let service = Arc::new(RouterService::new(Arc::new(advisor)));
    /// # let timeout = std::time::Duration::from_secs(1);
    /// # let sync = InventorySync::new(Arc::new(InProcessInventory::new()), "ns", timeout).unwrap();
    /// let inventory = RouterInventory::new(index, remote, service, sync, 1000, 3);
    /// assert_eq!(inventory.follower_down(), None);
    /// ```
    pub fn follower_down(&self) -> Option<&'static str> {
        // In `followers_up`'s order.
        const DOWN: [&str; 2] = ["donor directory watch down", "worker announcements down"];
        self.followers_up()
            .into_iter()
            .zip(DOWN)
            .find(|((_, up), _)| !up)
            .map(|(_, why)| why)
    }

    /// Whether each follower stream is open: `("directory", _)` the donor
    /// directory watch, `("announcements", _)` the announcements
    /// subscription (what `/metrics` shows as `kv_reuse_router_follower_up`).
    pub fn followers_up(&self) -> [(&'static str, bool); 2] {
        [
            ("directory", !self.directory_down.load(Ordering::SeqCst)),
            (
                "announcements",
                !self.announcements_down.load(Ordering::SeqCst),
            ),
        ]
    }

    /// Workers registered now (announced and not dropped); waits for the
    /// state lock, which a follower holds for one batch at a time.
    pub async fn workers(&self) -> usize {
        self.state.lock().await.registry.len()
    }

    /// (replaced, silenced) incarnations the worker registry remembers now
    /// ([`WorkerRegistry::remembered`], each at most
    /// [`crate::MAX_REMEMBERED`]; what `/metrics` shows as
    /// `kv_reuse_router_incarnations_remembered{kind}`); waits for the
    /// state lock as [`RouterInventory::workers`] does.
    pub async fn remembered(&self) -> (usize, usize) {
        self.state.lock().await.registry.remembered()
    }

    /// The index the advisor reads.
    pub fn index(&self) -> &Arc<InventoryIndex> {
        &self.index
    }

    /// Counters so far.
    pub fn stats(&self) -> FollowStats {
        self.counters.snapshot()
    }

    fn drop_engine(&self, st: &mut Tracked, engine: EngineId) {
        self.index.remove_worker(engine);
        self.remote.forget(engine);
        self.service.remove_target(engine);
        st.sync.forget(engine);
        bump(&self.counters.workers_dropped);
    }

    /// Drops the follower of every event subject no registered worker
    /// names any more: its task stops (dropping the receiver unsubscribes)
    /// and its resume handle goes. A later announcement naming it follows
    /// it afresh.
    fn release_unnamed_subjects(&self, st: &mut Tracked) {
        let named: HashSet<&str> = st.registry.event_subjects().collect();
        let unnamed: Vec<String> = st
            .subjects
            .keys()
            .filter(|s| !named.contains(s.as_str()))
            .cloned()
            .collect();
        for subject in unnamed {
            let follower = st.subjects.remove(&subject).expect("listed above");
            follower.stop.cancel();
            if let Ok(s) = parse_subject(&subject) {
                st.sync.remove_stream_resume(&s);
            }
            bump(&self.counters.event_subjects_released);
            tracing::info!(%subject, "no worker names the event subject: unsubscribed");
        }
    }

    /// Counts and logs one snapshot outcome (`None`: nothing was asked).
    fn note_snapshot(
        &self,
        engine: EngineId,
        outcome: Option<Result<SyncOutcome, InventoryError>>,
    ) {
        match outcome {
            None | Some(Ok(SyncOutcome::Retired)) => {}
            Some(Ok(SyncOutcome::Applied {
                blocks,
                last_event_id,
            })) => {
                bump(&self.counters.snapshots_applied);
                tracing::info!(%engine, blocks, last_event_id, "inventory snapshot applied");
            }
            Some(Err(e)) => {
                bump(&self.counters.snapshots_failed);
                tracing::warn!(%engine, error = %e, "inventory snapshot failed: asked again at the next announcement");
            }
        }
    }

    /// Takes in one announcement payload seen at `now_ms`; returns the
    /// announced event subject when it is new to this router (the caller
    /// subscribes to it, then [`RouterInventory::followed`]). A decode
    /// worker without an applied snapshot is rebuilt here once its subject
    /// is followed and its directory record applied (this awaits the
    /// worker's answer, at most the sync's timeout per page).
    pub async fn on_announcement(&self, payload: &[u8], now_ms: u64) -> Option<Subject> {
        self.announce(payload, now_ms).await.map(|(s, _)| s)
    }

    /// Counts an ignored announcement (`announcements_ignored`) and, at most
    /// once per `log`'s period, has `warn` log it with the number of lines
    /// left out since the last one.
    fn ignore_announcement(&self, log: &LogThrottle, warn: impl FnOnce(u64)) {
        bump(&self.counters.announcements_ignored);
        if let Some(suppressed) = log.admit(std::time::Instant::now()) {
            warn(suppressed);
        }
    }

    /// [`RouterInventory::on_announcement`], with the new subject's
    /// follower generation and stop token for the task that follows it.
    async fn announce(
        &self,
        payload: &[u8],
        now_ms: u64,
    ) -> Option<(Subject, (u64, CancellationToken))> {
        let a = match WorkerAnnouncement::decode(payload) {
            Ok(a) => a,
            Err(e) => {
                if let Some(suppressed) = self.refused_log.admit(std::time::Instant::now()) {
                    tracing::warn!(error = %e, suppressed, "worker announcement refused");
                }
                bump(&self.counters.announcements_ignored);
                return None;
            }
        };
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        // A worker (a refresh or a new incarnation) may move to another
        // subject, leaving its old one unnamed.
        let moved = st
            .registry
            .get(&a.worker_key)
            .is_some_and(|prev| prev.event_subject != a.event_subject);
        let registration = st.registry.announce(a.clone(), now_ms);
        self.note_forgotten(st);
        match registration {
            Registration::Retired => {
                self.ignore_announcement(&self.retired_log, |suppressed| {
                    // The incarnation holding the key now: not always the
                    // one that replaced this one (trial h39, 9), and never
                    // none, since a free key takes a replaced one back.
                    let holder = st
                        .registry
                        .get(&a.worker_key)
                        .map_or_else(|| "none".to_string(), |n| n.engine_id.to_string());
                    tracing::warn!(
                        worker = ?a.worker_key,
                        engine = %a.engine_id,
                        key_held_by = %holder,
                        suppressed,
                        "announcement of a replaced incarnation ignored (is a second process announcing this worker key?)"
                    );
                });
                return None;
            }
            Registration::OtherKey { registered_under } => {
                self.ignore_announcement(&self.other_key_log, |suppressed| {
                    // Who keeps the key from it: a live worker, or one
                    // dropped for silence that may come back (trial h44, 6).
                    let holder = match st.registry.get(&a.worker_key) {
                        Some(live) => live.engine_id.to_string(),
                        None => st.registry.silenced_under(&a.worker_key).map_or_else(
                            || "none".to_string(),
                            |e| format!("{e} (dropped for silence, may come back)"),
                        ),
                    };
                    tracing::warn!(
                        worker = ?a.worker_key,
                        engine = %a.engine_id,
                        registered_under = ?registered_under,
                        key_held_by = ?holder,
                        suppressed,
                        "announcement under a second worker key ignored (one engine announces one worker key: is a worker key computed twice, or a config copied?)"
                    );
                });
                return None;
            }
            Registration::IdentityChanged { field } => {
                self.ignore_announcement(&self.identity_log, |suppressed| {
                    let registered = st
                        .registry
                        .get(&a.worker_key)
                        .map_or_else(String::new, |r| field.value_in(r));
                    tracing::warn!(
                        worker = ?a.worker_key,
                        engine = %a.engine_id,
                        %field,
                        registered = %registered,
                        announced = %field.value_in(&a),
                        suppressed,
                        "announcement changing a registered fact ignored (an engine id is one incarnation: its role, layout and TP never change; is a publisher reusing an engine id?)"
                    );
                });
                return None;
            }
            Registration::Replaced { dropped } => {
                // Visible without inferring it from a later refusal: a
                // restart, or an incarnation the registry forgot coming back
                // and displacing the live one (trial h42, 3).
                if let Some(suppressed) = self.replaced_log.admit(std::time::Instant::now()) {
                    tracing::info!(
                        worker = ?a.worker_key,
                        engine = %a.engine_id,
                        replaced = %dropped,
                        suppressed,
                        "worker replaced by a new incarnation"
                    );
                }
                self.drop_engine(st, dropped)
            }
            Registration::New | Registration::Refreshed | Registration::Readmitted => {}
        }
        if moved {
            self.release_unnamed_subjects(st);
        }
        bump(&self.counters.announcements);
        self.register_in_index(&a, &registration);
        if a.role == Role::Prefill {
            self.service.add_target(a.engine_id);
        }
        let subject = match parse_subject(&a.event_subject) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(worker = ?a.worker_key, error = %e, "announced event subject unusable");
                return None;
            }
        };
        let fresh = !st.subjects.contains_key(subject.as_str());
        if fresh {
            let generation = st.next_generation;
            st.next_generation += 1;
            let stop = CancellationToken::new();
            let follower = SubjectFollower {
                followed: false,
                generation,
                stop: stop.clone(),
            };
            st.subjects.insert(subject.as_str().to_string(), follower);
            bump(&self.counters.event_subjects_followed);
            // Not followed yet: the snapshot waits for the next announcement.
            return Some((subject, (generation, stop)));
        }
        let followed = st
            .subjects
            .get(subject.as_str())
            .is_some_and(|f| f.followed)
            // Its record applied (held by the remote directory: the state
            // lock orders every change of it against this check).
            && self.remote.holds_record(a.engine_id);
        if followed && st.sync.note_registration(&a, &registration) {
            drop(guard);
            let outcome = self.rebuild(a.engine_id).await;
            self.note_snapshot(a.engine_id, Some(outcome));
        }
        None
    }

    /// Asks `engine`'s snapshot without holding the state lock and applies
    /// it under the lock; a snapshot overtaken meanwhile by the stream
    /// (the worker kept publishing) is asked again, at most
    /// `STALE_RETRIES` times.
    async fn rebuild(&self, engine: EngineId) -> Result<SyncOutcome, InventoryError> {
        let mut tries = 0;
        loop {
            let asker = {
                let st = self.state.lock().await;
                if st.registry.is_retired(engine) {
                    return Ok(SyncOutcome::Retired);
                }
                st.sync.asker()
            };
            let pages = asker.fetch(engine).await?;
            let mut guard = self.state.lock().await;
            let st = &mut *guard;
            match st
                .sync
                .apply_snapshot(engine, pages, &self.index, &self.remote, &st.registry)
            {
                Err(InventoryError::Stale { .. })
                    if tries + 1 < crate::plane::inventory::STALE_RETRIES =>
                {
                    tries += 1
                }
                done => return done,
            }
        }
    }

    /// Marks `subject` followed (its receiver is subscribed): announcements
    /// from now on may ask its workers' snapshots.
    pub async fn followed(&self, subject: &Subject) {
        if let Some(f) = self.state.lock().await.subjects.get_mut(subject.as_str()) {
            f.followed = true;
        }
    }

    /// [`RouterInventory::followed`] for the receiver `events` of
    /// `subject`: each snapshot applied for a worker announcing `subject`
    /// also moves `events` past it
    /// ([`InventorySync::add_stream_resume`]), so the worker's next event is
    /// applied at once instead of after a gap timeout and a covered `Lost`.
    pub async fn followed_with(&self, subject: &Subject, events: crate::KvStreamResume) {
        let mut st = self.state.lock().await;
        if let Some(f) = st.subjects.get_mut(subject.as_str()) {
            f.followed = true;
            st.sync.add_stream_resume(subject, events);
        }
    }

    /// Counts one event's result (and logs a refusal).
    fn count_event(&self, event: &KvEvent, result: &Result<EventOutcome, LookupError>) {
        let c = &self.counters;
        match result {
            Ok(EventOutcome::Applied { .. } | EventOutcome::Gap { .. }) => bump(&c.events_applied),
            Ok(EventOutcome::Duplicate { .. }) => bump(&c.events_duplicate),
            Ok(EventOutcome::FromRetiredIncarnation) => bump(&c.late_events_ignored),
            Ok(EventOutcome::Unchained { .. }) => bump(&c.events_refused),
            Err(err) => {
                bump(&c.events_refused);
                tracing::debug!(publisher = %event.publisher, error = %err, "KV event refused by the index");
            }
        }
    }

    /// Takes in items of one KV event stream, in order, as
    /// [`RouterInventory::on_event`] one item at a time would (same index
    /// content, donor slot maps and counters), but applies each run of
    /// consecutive events with one [`InventorySync::apply_events`]: one
    /// index publication per run instead of one per event. A
    /// [`KvStreamItem::Lost`] ends a run: the events before it are applied
    /// first, then it is handled (which may await a snapshot), then the
    /// events after it. Nothing is waited for beyond `items`.
    pub async fn on_events(&self, items: impl IntoIterator<Item = KvStreamItem>) {
        let mut run: Vec<KvEvent> = Vec::new();
        for item in items {
            match item {
                KvStreamItem::Event(e) => run.push(e),
                lost @ KvStreamItem::Lost { .. } => {
                    self.apply_run(&run).await;
                    run.clear();
                    self.on_event(lost).await;
                }
            }
        }
        self.apply_run(&run).await;
    }

    /// Applies `run` (consecutive events of one stream) under the state
    /// lock with one index publication, and counts each event.
    async fn apply_run(&self, run: &[KvEvent]) {
        if run.is_empty() {
            return;
        }
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let results = st
            .sync
            .apply_events(run, &self.index, &self.remote, &st.registry);
        for (event, result) in run.iter().zip(&results) {
            self.count_event(event, result);
        }
    }

    /// Takes in one item of a KV event stream: an event through
    /// [`InventorySync::apply_event`]; a lost range through
    /// [`InventorySync::on_lost`] (which may await a snapshot). The
    /// follower takes in what its receiver holds together
    /// ([`RouterInventory::on_events`]).
    pub async fn on_event(&self, item: KvStreamItem) {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        match item {
            KvStreamItem::Event(e) => {
                let result = st
                    .sync
                    .apply_event(&e, &self.index, &self.remote, &st.registry);
                self.count_event(&e, &result);
            }
            KvStreamItem::Lost {
                publisher,
                from_event_id,
                to_event_id,
            } => {
                bump(&self.counters.lost_ranges);
                tracing::warn!(%publisher, from_event_id, to_event_id, "KV events lost");
                if st.sync.covers(publisher, to_event_id) {
                    bump(&self.counters.lost_covered);
                    return;
                }
                // Only this subject's stream waits for the snapshot.
                drop(guard);
                let outcome = self.rebuild(publisher).await;
                self.note_snapshot(publisher, Some(outcome));
            }
        }
    }

    /// Takes in one directory change.
    pub async fn on_directory(&self, change: DirectoryChange) {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        if let DirectoryChange::Put(r) = &change {
            if st.registry.is_retired(r.engine_id()) {
                bump(&self.counters.directory_puts_ignored);
                return;
            }
        }
        bump(&self.counters.directory_changes);
        if let DirectoryChange::Put(r) = &change {
            self.check_layout(st, r);
        }
        if let CacheUpdate::NewGeneration { engine, .. } = self.remote.apply_directory(change) {
            // The put reset the donor's slot map: a snapshot applied
            // before it no longer stands; the next announcement asks again.
            if st.sync.snapshot_event_id(engine).is_some() {
                st.sync.forget(engine);
            }
        }
    }
}

#[path = "follow_tasks.rs"]
mod tasks;

#[path = "follow_liveness.rs"]
mod liveness;

#[cfg(test)]
#[path = "follow_tests.rs"]
mod tests;
