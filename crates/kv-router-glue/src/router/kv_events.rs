//! KV events over an event plane: per-publisher ids, gap detection, resync.
//!
//! A [`KvEventPublisher`] numbers its events 1, 2, 3, ... and keeps the last
//! few in a ring. A [`KvEventReceiver`] delivers each publisher's events in id
//! order: duplicates are dropped, and on a gap it holds the early arrivals and
//! publishes a [`ResyncRequest`]; the publisher replays the missing ids from
//! its ring. If the ids do not arrive within the gap timeout (the ring no
//! longer has them), the receiver reports [`KvStreamItem::Lost`] so that the
//! caller resyncs that publisher's whole inventory, then continues.
//!
//! One event must not be able to move a stream: an id more than
//! [`DEFAULT_MAX_EVENT_ID_JUMP`] (settable) ahead of the next expected one is
//! not held as the far end of a gap (after the gap timeout it would become
//! the stream's position and every later real event would be a duplicate). It
//! is kept aside unconfirmed; the stream moves there only when the next id
//! out there arrives too (the publisher really is there: `Lost` for the
//! skipped range, then both events), and an in-range event discards it. A
//! publisher heard from not at all for [`DEFAULT_PUBLISHER_IDLE_FORGET`]
//! (settable), with no gap open, is forgotten (restarted engines come back as
//! new incarnations, so the old ones would accumulate);
//! [`KvEventReceiver::forget_publisher`] forgets a retired one at once.
//!
//! After the caller rebuilt a publisher's inventory from a snapshot
//! consistent with event id N, [`KvEventReceiver::resume_from`] (or a
//! [`KvStreamResume`] handle, which `InventorySync` calls) moves the stream
//! to N + 1: without it, a receiver that never saw ids 1..=N would open a gap
//! for them on event N + 1, and when the publisher's ring no longer holds
//! them, event N + 1 would wait the whole gap timeout (late, not lost).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kv_descriptor::{EngineId, KvEvent, KvEventData, LayoutFingerprint, Role, StorageTier, Wire};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::{EventPlane, PlaneError, Subject, Subscription};

/// Asks `publisher` to publish again every event from `from_event_id` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRequest {
    /// Publisher whose events are missing.
    pub publisher: EngineId,
    /// First missing event id.
    pub from_event_id: u64,
}

/// Default of [`KvEventReceiver::with_max_jump`]: the most ids an event may
/// skip and still be held as the far end of a gap. Far more than a publisher
/// ring replays, so a real loss still ends in one `Lost`; a forged or corrupt
/// id beyond it never moves the stream.
pub const DEFAULT_MAX_EVENT_ID_JUMP: u64 = 4096;

/// Default of [`KvEventReceiver::with_idle_forget`]: how long a publisher
/// with no open gap may stay silent before the receiver forgets it. If it
/// speaks again later, its stream restarts with a gap from id 1 and ends in
/// `Lost` (a full resync), which is safe.
pub const DEFAULT_PUBLISHER_IDLE_FORGET: Duration = Duration::from_secs(15 * 60);

/// Subject of resync requests for an event subject: same namespace and
/// component, topic `<topic>_resync`.
///
/// # Errors
/// Never for a valid subject; kept fallible because it builds a subject.
pub fn resync_subject(events: &Subject) -> Result<Subject, PlaneError> {
    events.with_topic(&format!("{}_resync", events.topic()))
}

/// Fields every event of one publisher shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublisherHeader {
    /// Publishing engine incarnation.
    pub publisher: EngineId,
    /// Its role.
    pub role: Role,
    /// Its layout fingerprint.
    pub layout_fingerprint: LayoutFingerprint,
    /// Its TP size.
    pub tp_size: u32,
}

/// What a publisher did with a resync request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncOutcome {
    /// Another publisher's request.
    NotMine,
    /// Replayed this many events.
    Replayed(usize),
    /// The first requested id left the ring; the oldest kept is given (0: ring empty).
    TooOld {
        /// Oldest id still in the ring.
        oldest: u64,
    },
}

struct PublisherState {
    next_id: u64,
    ring: VecDeque<KvEvent>,
}

/// Publishes one engine's KV events with consecutive ids and replays on request.
pub struct KvEventPublisher {
    plane: Arc<dyn EventPlane>,
    subject: Subject,
    header: PublisherHeader,
    ring_capacity: usize,
    state: tokio::sync::Mutex<PublisherState>,
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("subject", &self.subject)
            .field("publisher", &self.header.publisher)
            .finish()
    }
}

impl KvEventPublisher {
    /// A publisher keeping the last `ring_capacity` events (at least 1) for replay.
    pub fn new(
        plane: Arc<dyn EventPlane>,
        subject: Subject,
        header: PublisherHeader,
        ring_capacity: usize,
    ) -> Self {
        Self {
            plane,
            subject,
            header,
            ring_capacity: ring_capacity.max(1),
            state: tokio::sync::Mutex::new(PublisherState {
                next_id: 1,
                ring: VecDeque::new(),
            }),
        }
    }

    /// Publishes one event and returns its id. Ids are assigned and sent under
    /// one lock, so the wire order is the id order.
    ///
    /// # Errors
    /// [`PlaneError::Codec`] or the plane's publish error; the id is consumed
    /// either way (a receiver sees a gap and resyncs from the ring).
    pub async fn publish(&self, tier: StorageTier, data: KvEventData) -> Result<u64, PlaneError> {
        let mut st = self.state.lock().await;
        let event = KvEvent {
            publisher: self.header.publisher,
            event_id: st.next_id,
            role: self.header.role,
            layout_fingerprint: self.header.layout_fingerprint,
            tp_size: self.header.tp_size,
            tier,
            data,
        };
        st.next_id += 1;
        if st.ring.len() == self.ring_capacity {
            st.ring.pop_front();
        }
        st.ring.push_back(event.clone());
        let bytes = event.to_wire().map_err(|e| PlaneError::Codec {
            what: "kv_event",
            reason: e.to_string(),
        })?;
        self.plane.publish(&self.subject, bytes).await?;
        Ok(event.event_id)
    }

    /// Replays the ring from `req.from_event_id` when the request is for this publisher.
    ///
    /// # Errors
    /// The plane's publish error.
    pub async fn handle_resync(&self, req: &ResyncRequest) -> Result<ResyncOutcome, PlaneError> {
        if req.publisher != self.header.publisher {
            return Ok(ResyncOutcome::NotMine);
        }
        let st = self.state.lock().await;
        let oldest = st.ring.front().map_or(0, |e| e.event_id);
        if st.ring.is_empty() || req.from_event_id < oldest {
            return Ok(ResyncOutcome::TooOld { oldest });
        }
        let mut n = 0;
        for e in st.ring.iter().filter(|e| e.event_id >= req.from_event_id) {
            let bytes = e.to_wire().map_err(|err| PlaneError::Codec {
                what: "kv_event",
                reason: err.to_string(),
            })?;
            self.plane.publish(&self.subject, bytes).await?;
            n += 1;
        }
        Ok(ResyncOutcome::Replayed(n))
    }

    /// Subscribes to the resync subject (ready on return) and serves requests
    /// in a background task until the returned handle is aborted or dropped
    /// with the runtime.
    ///
    /// # Errors
    /// The plane's subscribe error.
    pub async fn serve_resync(self: &Arc<Self>) -> Result<tokio::task::JoinHandle<()>, PlaneError> {
        let mut sub = self
            .plane
            .subscribe(&resync_subject(&self.subject)?)
            .await?;
        let me = Arc::clone(self);
        Ok(tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                match rmp_serde::from_slice::<ResyncRequest>(&m.payload) {
                    Ok(req) => {
                        if let Err(e) = me.handle_resync(&req).await {
                            tracing::warn!(error = %e, "resync replay failed");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "undecodable resync request"),
                }
            }
        }))
    }
}

/// What a [`KvEventReceiver`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvStreamItem {
    /// The next event of its publisher, in id order.
    Event(KvEvent),
    /// Events `from_event_id..=to_event_id` of `publisher` could not be
    /// recovered: resync its whole inventory.
    Lost {
        /// Publisher.
        publisher: EngineId,
        /// First lost id.
        from_event_id: u64,
        /// Last lost id.
        to_event_id: u64,
    },
}

/// Counters of a receiver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Events delivered in order.
    pub delivered: u64,
    /// Events dropped as already delivered.
    pub duplicates: u64,
    /// Gaps seen (each sends one resync request).
    pub gaps: u64,
    /// Gaps that ended in [`KvStreamItem::Lost`].
    pub lost: u64,
    /// Payloads that did not decode as a KV event.
    pub undecodable: u64,
    /// Events whose id jumped more than the bound ahead and that no next id
    /// confirmed (discarded; see [`KvEventReceiver::with_max_jump`]).
    pub implausible_jumps: u64,
    /// Publishers forgotten (idle or [`KvEventReceiver::forget_publisher`]).
    pub forgotten: u64,
}

struct PublisherTrack {
    next_expected: u64,
    held: BTreeMap<u64, KvEvent>,
    gap_deadline: Option<Instant>,
    /// Last event beyond the jump bound, not yet confirmed by its successor.
    far: Option<KvEvent>,
    /// When the publisher was last heard from.
    last_seen: Instant,
}

impl PublisherTrack {
    fn new(now: Instant) -> Self {
        Self {
            next_expected: 1,
            held: BTreeMap::new(),
            gap_deadline: None,
            far: None,
            last_seen: now,
        }
    }
}

/// Stream positions queued by [`KvStreamResume`] handles, applied by the
/// receiver at its next poll.
#[derive(Default)]
struct ResumeQueue {
    /// Highest snapshot event id per publisher since the last poll.
    pending: parking_lot::Mutex<HashMap<EngineId, u64>>,
    /// Wakes a receiver waiting in [`KvEventReceiver::next`].
    wake: tokio::sync::Notify,
}

/// A handle that tells a [`KvEventReceiver`] owned elsewhere (the router's
/// event loop) that a publisher's inventory was rebuilt from a snapshot;
/// from [`KvEventReceiver::resume_handle`]. `InventorySync` holds one (see
/// `InventorySync::with_stream_resume`) and calls it after each applied
/// snapshot. Cheap to clone; it does not keep the receiver alive.
#[derive(Clone)]
pub struct KvStreamResume {
    queue: Weak<ResumeQueue>,
}

impl std::fmt::Debug for KvStreamResume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStreamResume")
            .field("receiver_alive", &(self.queue.strong_count() > 0))
            .finish()
    }
}

impl KvStreamResume {
    /// Queues [`KvEventReceiver::resume_from`]`(publisher, last_event_id)`
    /// for the receiver; it is applied before the receiver's next item (a
    /// receiver waiting in `next` wakes for it). Of several positions queued
    /// for one publisher the highest wins. Returns false when the receiver
    /// was dropped (nothing to resume).
    pub fn resume_from(&self, publisher: EngineId, last_event_id: u64) -> bool {
        let Some(queue) = self.queue.upgrade() else {
            return false;
        };
        let mut pending = queue.pending.lock();
        let at = pending.entry(publisher).or_insert(last_event_id);
        *at = (*at).max(last_event_id);
        drop(pending);
        queue.wake.notify_one();
        true
    }
}

/// Receives KV events in per-publisher id order, repairing gaps by resync.
pub struct KvEventReceiver {
    sub: Subscription,
    plane: Arc<dyn EventPlane>,
    resync: Subject,
    gap_timeout: Duration,
    max_jump: u64,
    idle_forget: Duration,
    /// Next time idle publishers are looked for.
    next_prune: Instant,
    tracks: HashMap<EngineId, PublisherTrack>,
    ready: VecDeque<KvStreamItem>,
    stats: ReceiverStats,
    /// Positions from [`KvStreamResume`] handles.
    resume: Arc<ResumeQueue>,
    /// Resync requests for holes that a resume left behind the new position.
    resync_due: Vec<ResyncRequest>,
}

impl std::fmt::Debug for KvEventReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventReceiver")
            .field("sub", &self.sub)
            .field("stats", &self.stats)
            .finish()
    }
}

/// Messages one [`KvEventReceiver::try_next`] takes from the plane before it
/// looks at expired gap deadlines anyway (see there).
const TRY_NEXT_MESSAGES: usize = 1024;

impl KvEventReceiver {
    /// Subscribes to `events` (ready on return). A gap not repaired within
    /// `gap_timeout` becomes [`KvStreamItem::Lost`]. The jump bound is
    /// [`DEFAULT_MAX_EVENT_ID_JUMP`], the idle time
    /// [`DEFAULT_PUBLISHER_IDLE_FORGET`].
    ///
    /// # Errors
    /// The plane's subscribe error.
    pub async fn subscribe(
        plane: Arc<dyn EventPlane>,
        events: &Subject,
        gap_timeout: Duration,
    ) -> Result<Self, PlaneError> {
        let sub = plane.subscribe(events).await?;
        Ok(Self {
            sub,
            resync: resync_subject(events)?,
            plane,
            gap_timeout,
            max_jump: DEFAULT_MAX_EVENT_ID_JUMP,
            idle_forget: DEFAULT_PUBLISHER_IDLE_FORGET,
            next_prune: Instant::now() + DEFAULT_PUBLISHER_IDLE_FORGET,
            tracks: HashMap::new(),
            ready: VecDeque::new(),
            stats: ReceiverStats::default(),
            resume: Arc::new(ResumeQueue::default()),
            resync_due: Vec::new(),
        })
    }

    /// Sets the jump bound: an event whose id is more than `max_jump` (at
    /// least 1) past the next expected id is set aside, and the stream moves
    /// there only once the id right after it arrives as well.
    pub fn with_max_jump(mut self, max_jump: u64) -> Self {
        self.max_jump = max_jump.max(1);
        self
    }

    /// Sets how long a publisher with no open gap may stay silent before it
    /// is forgotten (its next event then starts a gap from id 1).
    pub fn with_idle_forget(mut self, idle: Duration) -> Self {
        self.idle_forget = idle;
        self.next_prune = Instant::now() + idle;
        self
    }

    /// Forgets `publisher` (a retired incarnation): its position, held events
    /// and open gap. Returns false when it was not tracked.
    pub fn forget_publisher(&mut self, publisher: EngineId) -> bool {
        let known = self.tracks.remove(&publisher).is_some();
        self.stats.forgotten += u64::from(known);
        known
    }

    /// Moves `publisher`'s stream past `last_event_id`, the event id its
    /// inventory snapshot was consistent with (`SyncOutcome::Applied`), so
    /// that event `last_event_id + 1` is delivered as soon as it arrives.
    ///
    /// Events of `publisher` at or below `last_event_id` that were held
    /// behind a gap, or arrive later, are dropped as duplicates (the
    /// snapshot holds them); held events after it that are now contiguous
    /// are delivered, and a gap that the snapshot covers closes without a
    /// [`KvStreamItem::Lost`]. A hole left after the held events that follow
    /// `last_event_id` is asked again (a new [`ResyncRequest`] from the first
    /// id still missing, sent at the next poll, with a fresh gap timeout).
    /// An id at or below what was already delivered changes nothing (nothing
    /// is delivered twice). An unknown publisher is tracked from there.
    /// Returns whether the position moved.
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     plane: std::sync::Arc<dyn kv_router_glue::EventPlane>,
    /// #     subject: kv_router_glue::Subject,
    /// #     worker: kv_descriptor::EngineId,
    /// # ) -> Result<(), kv_router_glue::PlaneError> {
    /// use std::time::Duration;
    /// use kv_router_glue::{KvEventReceiver, KvStreamItem};
    ///
    /// let mut events = KvEventReceiver::subscribe(plane, &subject, Duration::from_secs(1)).await?;
    /// // ... the worker's inventory was rebuilt from a snapshot at event 6 ...
    /// assert!(events.resume_from(worker, 6));
    /// // Event 7 comes out as soon as it arrives, with no `Lost 1..=6` first.
    /// if let Some(KvStreamItem::Event(e)) = events.next().await {
    ///     assert_eq!((e.publisher, e.event_id), (worker, 7));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn resume_from(&mut self, publisher: EngineId, last_event_id: u64) -> bool {
        let next = last_event_id.saturating_add(1);
        // A new track starts at 1 anyway: an empty snapshot (id 0) adds none.
        if next <= 1 {
            return false;
        }
        let now = Instant::now();
        let track = self
            .tracks
            .entry(publisher)
            .or_insert_with(|| PublisherTrack::new(now));
        if next <= track.next_expected {
            return false;
        }
        track.last_seen = now;
        // Held events up to the snapshot's id are in the snapshot already.
        let kept = track.held.split_off(&next);
        self.stats.duplicates += track.held.len() as u64;
        track.held = kept;
        if track.far.as_ref().is_some_and(|f| f.event_id < next) {
            track.far = None;
            self.stats.duplicates += 1;
        }
        track.next_expected = next;
        Self::drain(track, &mut self.ready, &mut self.stats);
        if !track.held.is_empty() {
            // The open gap's request asked from before the snapshot, which
            // the ring may have refused as too old; the hole after it may
            // still be in the ring, so ask again from there, with a fresh
            // deadline.
            track.gap_deadline = Some(now + self.gap_timeout);
            self.stats.gaps += 1;
            self.resync_due.push(ResyncRequest {
                publisher,
                from_event_id: track.next_expected,
            });
        }
        true
    }

    /// A handle for calling [`KvEventReceiver::resume_from`] from code
    /// that does not own the receiver (`InventorySync`).
    pub fn resume_handle(&self) -> KvStreamResume {
        KvStreamResume {
            queue: Arc::downgrade(&self.resume),
        }
    }

    /// Publishers tracked now.
    pub fn publishers_tracked(&self) -> usize {
        self.tracks.len()
    }

    /// Counters so far.
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    /// Next item; `None` when the plane closed.
    pub async fn next(&mut self) -> Option<KvStreamItem> {
        loop {
            self.apply_resumes().await;
            if let Some(item) = self.ready.pop_front() {
                return Some(item);
            }
            let deadline = self.tracks.values().filter_map(|t| t.gap_deadline).min();
            let resume = Arc::clone(&self.resume);
            let msg = tokio::select! {
                // A snapshot applied elsewhere may release held events now.
                () = resume.wake.notified() => continue,
                m = self.sub.next() => m,
                () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)),
                    if deadline.is_some() =>
                {
                    self.expire_gaps();
                    continue;
                }
            };
            let msg = msg?;
            self.take(msg).await;
        }
    }

    /// The next item if one is available without waiting: delivered
    /// already, released by a queued [`KvStreamResume`] or a gap deadline
    /// that has passed, or made of a message the plane already queued.
    /// `None` when nothing is; a later [`KvEventReceiver::next`] waits for
    /// more (and reports a closed plane). Items come in the order `next`
    /// gives them; this awaits only the resync requests it sends (as `next`
    /// does), never a message or a deadline. The router's event follower
    /// calls it after each `next` to apply what a burst queued together.
    pub async fn try_next(&mut self) -> Option<KvStreamItem> {
        // Queued messages come before a gap's expiry: the replay that fills
        // a hole may be among them, and expiring first would report the
        // range lost and ask for a snapshot nobody needs. Bounded, so a
        // stream that keeps queueing behind a hole cannot hold its expiry
        // off: past the bound the rest waits for the next call.
        let mut taken = 0;
        loop {
            self.apply_resumes().await;
            if let Some(item) = self.ready.pop_front() {
                return Some(item);
            }
            if taken < TRY_NEXT_MESSAGES {
                if let Some(msg) = self.sub.try_next() {
                    taken += 1;
                    self.take(msg).await;
                    continue;
                }
            }
            let now = Instant::now();
            if self
                .tracks
                .values()
                .any(|t| t.gap_deadline.is_some_and(|d| d <= now))
            {
                self.expire_gaps();
            }
            return self.ready.pop_front();
        }
    }

    /// Decodes one message of the plane and accepts its event.
    async fn take(&mut self, msg: crate::PlaneMessage) {
        match KvEvent::from_wire(&msg.payload) {
            Ok(e) => self.accept(e).await,
            Err(e) => {
                self.stats.undecodable += 1;
                tracing::warn!(error = %e, subject = %msg.subject, "undecodable KV event");
            }
        }
    }

    /// Like [`KvEventReceiver::next`] with an overall timeout.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Option<KvStreamItem> {
        tokio::time::timeout(timeout, self.next())
            .await
            .ok()
            .flatten()
    }

    async fn accept(&mut self, e: KvEvent) {
        let now = Instant::now();
        self.forget_idle(now);
        let publisher = e.publisher;
        let track = self
            .tracks
            .entry(publisher)
            .or_insert_with(|| PublisherTrack::new(now));
        track.last_seen = now;
        let id = e.event_id;
        if id < track.next_expected || track.held.contains_key(&id) {
            self.stats.duplicates += 1;
            return;
        }
        // `u64::MAX` is never a real id (ids count from 1) and has no successor.
        if id - track.next_expected > self.max_jump || id == u64::MAX {
            match track.far.take() {
                Some(first) if first.event_id.checked_add(1) == Some(id) && id < u64::MAX => {
                    Self::move_to(publisher, track, first, e, &mut self.ready, &mut self.stats);
                }
                replaced => {
                    self.stats.implausible_jumps += u64::from(replaced.is_some());
                    tracing::warn!(%publisher, event_id = id, expected = track.next_expected,
                        "kv event id jumps beyond the bound: set aside until its successor arrives");
                    track.far = Some(e);
                }
            }
            return;
        }
        // An event near the stream's position contradicts a far one.
        if track.far.take().is_some() {
            self.stats.implausible_jumps += 1;
        }
        if id > track.next_expected {
            track.held.insert(id, e);
            if track.gap_deadline.is_none() {
                track.gap_deadline = Some(Instant::now() + self.gap_timeout);
                self.stats.gaps += 1;
                let req = ResyncRequest {
                    publisher,
                    from_event_id: track.next_expected,
                };
                self.send_resync(req).await;
            }
            return;
        }
        self.ready.push_back(KvStreamItem::Event(e));
        self.stats.delivered += 1;
        track.next_expected += 1;
        Self::drain(track, &mut self.ready, &mut self.stats);
    }

    /// Applies the positions queued by [`KvStreamResume`] handles and sends
    /// the resync requests that resumes left due.
    async fn apply_resumes(&mut self) {
        let pending = std::mem::take(&mut *self.resume.pending.lock());
        for (publisher, last_event_id) in pending {
            self.resume_from(publisher, last_event_id);
        }
        for req in std::mem::take(&mut self.resync_due) {
            self.send_resync(req).await;
        }
    }

    async fn send_resync(&self, req: ResyncRequest) {
        match rmp_serde::to_vec_named(&req) {
            Ok(bytes) => {
                if let Err(e) = self.plane.publish(&self.resync, bytes).await {
                    // The gap timeout still reports the loss.
                    tracing::warn!(error = %e, "resync request not sent");
                }
            }
            Err(e) => tracing::warn!(error = %e, "resync request not encoded"),
        }
    }

    /// The publisher's stream is confirmed far ahead (`first`, then `second`
    /// = `first + 1`): everything between the old position and `first` is
    /// lost (held events included), then both are delivered.
    fn move_to(
        publisher: EngineId,
        track: &mut PublisherTrack,
        first: KvEvent,
        second: KvEvent,
        ready: &mut VecDeque<KvStreamItem>,
        stats: &mut ReceiverStats,
    ) {
        ready.push_back(KvStreamItem::Lost {
            publisher,
            from_event_id: track.next_expected,
            to_event_id: first.event_id - 1,
        });
        stats.lost += 1;
        track.held.clear();
        track.gap_deadline = None;
        track.next_expected = second.event_id + 1;
        ready.push_back(KvStreamItem::Event(first));
        ready.push_back(KvStreamItem::Event(second));
        stats.delivered += 2;
    }

    /// Forgets publishers silent for the idle time with no open gap; scans at
    /// most four times per idle time.
    fn forget_idle(&mut self, now: Instant) {
        if now < self.next_prune {
            return;
        }
        self.next_prune = now + self.idle_forget / 4;
        let idle = self.idle_forget;
        let before = self.tracks.len();
        self.tracks.retain(|_, t| {
            t.gap_deadline.is_some() || now.saturating_duration_since(t.last_seen) < idle
        });
        self.stats.forgotten += (before - self.tracks.len()) as u64;
    }

    /// Moves held events that are now contiguous to `ready`.
    fn drain(
        track: &mut PublisherTrack,
        ready: &mut VecDeque<KvStreamItem>,
        stats: &mut ReceiverStats,
    ) {
        while let Some(e) = track.held.remove(&track.next_expected) {
            ready.push_back(KvStreamItem::Event(e));
            stats.delivered += 1;
            track.next_expected += 1;
        }
        if track.held.is_empty() {
            track.gap_deadline = None;
        }
    }

    fn expire_gaps(&mut self) {
        let now = Instant::now();
        for (publisher, track) in self.tracks.iter_mut() {
            if track.gap_deadline.is_some_and(|d| d <= now) {
                let Some((&first_held, _)) = track.held.iter().next() else {
                    track.gap_deadline = None;
                    continue;
                };
                self.ready.push_back(KvStreamItem::Lost {
                    publisher: *publisher,
                    from_event_id: track.next_expected,
                    to_event_id: first_held - 1,
                });
                self.stats.lost += 1;
                track.next_expected = first_held;
                track.gap_deadline = None;
                Self::drain(track, &mut self.ready, &mut self.stats);
                // A second hole behind the first gets its own deadline (and
                // is reported lost when it passes) without a second request:
                // the replay already asked for everything from the first hole.
                if !track.held.is_empty() {
                    track.gap_deadline = Some(now + self.gap_timeout);
                }
            }
        }
    }
}
