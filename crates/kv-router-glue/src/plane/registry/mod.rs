//! Worker registration: each worker publishes a [`WorkerAnnouncement`]
//! every announce period over the event plane (any [`crate::EventPlane`]:
//! in-process or NATS, on [`announce_subject`]); the router keeps a
//! [`WorkerRegistry`].
//!
//! Rules: a new incarnation (engine id) under a known worker key replaces
//! the old one, and the dropped engine id is returned so the caller drops its
//! inventory from the kv-lookup index and ignores its late events
//! ([`WorkerRegistry::is_retired`]); a replaced incarnation is refused
//! while it is remembered. A worker silent for `missed_periods` announce
//! periods is removed by [`WorkerRegistry::tick`], and its events are
//! ignored while it is away, but it is not replaced: when it announces again
//! (a network partition ended) it is taken back
//! ([`Registration::Readmitted`]), unless a new incarnation took its key
//! meanwhile. While the router's own connection is down
//! ([`WorkerRegistry::pause`]) nobody's silence counts: the workers'
//! announcements cannot reach it. One engine id serves one worker key: an
//! incarnation announcing under a key other than its own is ignored
//! ([`Registration::OtherKey`]), except one removed for silence whose new
//! key is free (taken back under it): free of live workers and of
//! remembered incarnations removed for silence, which may come back under
//! it. An incarnation announcing another `role`, `layout_fingerprint` or
//! `tp_size` than it registered with is ignored too
//! ([`Registration::IdentityChanged`]). Time is passed in (ms on any
//! monotonic clock) so tests never sleep.
//!
//! Memory: replaced and silenced incarnations are remembered for
//! [`FORGET_AFTER_SILENCE_WINDOWS`] silence windows after they were last
//! heard of (at least [`FORGET_AFTER_MIN_MS`]), at most
//! [`MAX_REMEMBERED`] of each, the one heard of longest ago forgotten first
//! ([`WorkerRegistry::forgotten`] counts them): without a bound a router
//! kept one entry per worker restart for its whole life. A replaced
//! incarnation that goes on announcing (a second process under its key) is
//! heard of every period and so stays refused while it runs. A forgotten
//! incarnation is unknown: when it announces again it registers as a new
//! incarnation would ([`Registration::New`] with its key free,
//! [`Registration::Replaced`] with its key taken). The registry hands the
//! ids it forgot to the caller ([`WorkerRegistry::take_forgotten`]), which
//! forgets them in its kv-lookup index too (`forget_retired`), so that
//! the index's memory of removed engines is bounded as this one is; there
//! the forgotten incarnation that comes back registers as a new worker,
//! empty, and its first event (its ids went on while it was away) is a gap
//! that keeps it from donor choice until its inventory snapshot.

use std::collections::{HashMap, VecDeque};

use kv_descriptor::{EngineId, GpuIdentity, LayoutFingerprint, Role, Wire};
use serde::{Deserialize, Serialize};

use crate::{PlaneError, Subject};

/// Longest accepted encoded announcement, in bytes.
pub const MAX_ANNOUNCEMENT_BYTES: usize = 16 * 1024;
/// Most GPU identities an announcement may list (one per TP rank).
pub const MAX_ANNOUNCED_GPUS: usize = 64;
const MAX_NAME: usize = super::directory::MAX_NAME_BYTES;

/// A replaced or silenced incarnation is forgotten once nothing of it was
/// heard for this many silence windows (`missed_periods` x
/// `announce_period_ms`), and not sooner than [`FORGET_AFTER_MIN_MS`]: its
/// stray announcements and events are in flight for seconds, far less.
pub const FORGET_AFTER_SILENCE_WINDOWS: u64 = 100;
/// Shortest time, in ms, a replaced or silenced incarnation is remembered
/// after it was last heard of (5 min); what a short announce period (10 ms
/// at least) would make of [`FORGET_AFTER_SILENCE_WINDOWS`] alone is too
/// little for a message delayed by a loaded server.
pub const FORGET_AFTER_MIN_MS: u64 = 300_000;
/// Most replaced incarnations, and most silenced ones, remembered at once
/// (each; the kv-lookup index's worker limit, so that a whole fleet dropped
/// at once is remembered); past it the one heard of longest ago is
/// forgotten first.
pub const MAX_REMEMBERED: usize = kv_lookup::MAX_WORKERS;

/// Most forgotten ids [`WorkerRegistry::take_forgotten`] holds for the
/// caller: as many as both kinds of memory can forget at once, so a caller
/// that takes them after every call loses none, and one that never does
/// keeps a bounded list (the ones forgotten longest ago dropped first).
const MAX_PENDING_FORGOTTEN: usize = 2 * MAX_REMEMBERED;

mod memory;
use memory::Remembered;

/// The subject workers announce on, under `namespace`
/// (`kv.<namespace>.workers.announce`).
///
/// # Errors
/// [`PlaneError::InvalidSubject`] for a bad namespace token.
pub fn announce_subject(namespace: &str) -> Result<Subject, PlaneError> {
    Subject::new(namespace, "workers", "announce")
}

/// What a worker says about itself. Wire form: MessagePack map with named
/// fields `worker_key` (string, 1..=256 bytes, stable across restarts),
/// `engine_id` (hyphenated UUID, new per incarnation), `role`,
/// `layout_fingerprint` (u64), `tp_size` (u32, 1..=64), `gpus` (one
/// [`GpuIdentity`] per TP rank), `pin_endpoint` and `event_subject`
/// (strings, 1..=256 bytes); at most [`MAX_ANNOUNCEMENT_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireAnnouncement")]
pub struct WorkerAnnouncement {
    /// Stable name of the worker (host/slot), across incarnations.
    pub worker_key: String,
    /// This incarnation's engine id.
    pub engine_id: EngineId,
    /// Prefill or decode.
    pub role: Role,
    /// Fingerprint of the KV layout the worker serves.
    pub layout_fingerprint: LayoutFingerprint,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// The GPU of each TP rank, rank order.
    pub gpus: Vec<GpuIdentity>,
    /// Where targets reach its pin service.
    pub pin_endpoint: String,
    /// The subject its KV events are published on.
    pub event_subject: String,
}

#[derive(Deserialize)]
struct WireAnnouncement {
    worker_key: String,
    engine_id: EngineId,
    role: Role,
    layout_fingerprint: LayoutFingerprint,
    tp_size: u32,
    gpus: Vec<GpuIdentity>,
    pin_endpoint: String,
    event_subject: String,
}

/// Why an announcement is refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnouncementError {
    /// A field is out of range.
    #[error("invalid `worker_announcement.{field}`: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong, with the value seen.
        reason: String,
    },
    /// Bytes over [`MAX_ANNOUNCEMENT_BYTES`].
    #[error("`worker_announcement` is {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// Size in bytes.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Bytes that do not decode (the message names the type and the
    /// field; it already starts with "cannot decode `worker_announcement`").
    #[error("{0}")]
    Decode(kv_descriptor::DescriptorError),
}

fn bad(field: &'static str, reason: String) -> AnnouncementError {
    AnnouncementError::InvalidField { field, reason }
}

impl TryFrom<WireAnnouncement> for WorkerAnnouncement {
    type Error = AnnouncementError;
    fn try_from(w: WireAnnouncement) -> Result<Self, Self::Error> {
        let a = WorkerAnnouncement {
            worker_key: w.worker_key,
            engine_id: w.engine_id,
            role: w.role,
            layout_fingerprint: w.layout_fingerprint,
            tp_size: w.tp_size,
            gpus: w.gpus,
            pin_endpoint: w.pin_endpoint,
            event_subject: w.event_subject,
        };
        a.validate()?;
        Ok(a)
    }
}

impl WorkerAnnouncement {
    /// Checks every bound.
    ///
    /// # Errors
    /// [`AnnouncementError::InvalidField`] naming `worker_key`, `tp_size`,
    /// `gpus`, `pin_endpoint` or `event_subject`.
    pub fn validate(&self) -> Result<(), AnnouncementError> {
        for (f, v) in [
            ("worker_key", &self.worker_key),
            ("pin_endpoint", &self.pin_endpoint),
            ("event_subject", &self.event_subject),
        ] {
            if v.is_empty() || v.len() > MAX_NAME {
                return Err(bad(
                    f,
                    format!("must be 1..={MAX_NAME} bytes, got {}", v.len()),
                ));
            }
        }
        // Checked here, before the router registers anything: an
        // announcement whose events cannot be followed (a wildcard, another
        // shape) used to register the worker, make a prefill an advise
        // target and replace a live incarnation, and only then be found
        // unusable.
        if let Err(e) = Subject::parse(&self.event_subject) {
            return Err(bad(
                "event_subject",
                format!("{e} (expected `kv.<namespace>.<component>.<topic>`)"),
            ));
        }
        if self.tp_size == 0 || self.tp_size as usize > MAX_ANNOUNCED_GPUS {
            return Err(bad(
                "tp_size",
                format!("must be 1..={MAX_ANNOUNCED_GPUS}, got {}", self.tp_size),
            ));
        }
        if self.gpus.len() != self.tp_size as usize {
            return Err(bad(
                "gpus",
                format!("{} identities for TP{}", self.gpus.len(), self.tp_size),
            ));
        }
        Ok(())
    }

    /// Decodes and validates, refusing oversized input before decoding.
    ///
    /// # Errors
    /// [`AnnouncementError::TooLarge`] or [`AnnouncementError::Decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, AnnouncementError> {
        if bytes.len() > MAX_ANNOUNCEMENT_BYTES {
            return Err(AnnouncementError::TooLarge {
                size: bytes.len(),
                limit: MAX_ANNOUNCEMENT_BYTES,
            });
        }
        Self::from_wire(bytes).map_err(AnnouncementError::Decode)
    }
}

impl Wire for WorkerAnnouncement {
    const WHAT: &'static str = "worker_announcement";
}

/// What [`WorkerRegistry::announce`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// A worker key seen for the first time.
    New,
    /// The same incarnation again (its silence clock restarts).
    Refreshed,
    /// A new incarnation under a known key: `dropped` is the old engine
    /// id, whose inventory the caller drops and whose late events it ignores.
    Replaced {
        /// The replaced incarnation.
        dropped: EngineId,
    },
    /// An announcement of an incarnation already replaced (and still
    /// remembered, [`WorkerRegistry::remembered`]) while another
    /// incarnation holds its key: ignored.
    Retired,
    /// An incarnation [`WorkerRegistry::tick`] removed for silence
    /// announces again, and no other incarnation took its key; or a
    /// replaced incarnation announces again after what replaced it was
    /// removed for silence (the key is free): registered
    /// again. The caller missed its events while it was away, so it treats
    /// its inventory as unknown until a resync (the kv-lookup index's
    /// `readmit_worker`, then an inventory snapshot).
    Readmitted,
    /// An announcement of an incarnation under a worker key other than the
    /// one it is registered under (or was replaced or removed for silence
    /// under, while remembered): ignored. One engine id is one process, and
    /// a process serves one worker key; taking the second key would drop
    /// the worker under the first when that key goes silent, or let a
    /// stale process take a live worker's key (trial h42, 1). An
    /// incarnation removed for silence may come back under a new key that
    /// is free (a key that changed while it was away): held neither by a
    /// live worker nor by a remembered incarnation removed for silence
    /// ([`WorkerRegistry::silenced_under`]), which may come back as well
    /// and would be refused then (trial h44, 6).
    OtherKey {
        /// The key it is registered (or remembered) under.
        registered_under: String,
    },
    /// An announcement of a live incarnation (same engine id, same key)
    /// whose `role`, `layout_fingerprint` or `tp_size` is not what it
    /// registered with: ignored, and its silence clock not restarted, as
    /// for [`Registration::OtherKey`]. Engine ids are per incarnation, so
    /// only a faulty publisher does this; accepted as a refresh, it was
    /// refused by the kv-lookup index and stayed an advise target with the
    /// registered facts (trial h44, 6). Should it go on announcing the new
    /// facts, it is dropped for silence and then taken back with them
    /// ([`Registration::Readmitted`]), as a worker whose key changed is.
    IdentityChanged {
        /// The first field (in the order of [`IdentityField`]) that differs.
        field: IdentityField,
    },
}

/// The facts an incarnation registers with that its later announcements
/// must repeat (the kv-lookup index keys its entries by them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityField {
    /// `role`.
    Role,
    /// `layout_fingerprint`.
    LayoutFingerprint,
    /// `tp_size`.
    TpSize,
}

impl IdentityField {
    /// The field's name in the announcement.
    pub fn name(self) -> &'static str {
        match self {
            IdentityField::Role => "role",
            IdentityField::LayoutFingerprint => "layout_fingerprint",
            IdentityField::TpSize => "tp_size",
        }
    }

    /// The field's value in `a`, as log lines print it.
    pub fn value_in(self, a: &WorkerAnnouncement) -> String {
        match self {
            IdentityField::Role => format!("{:?}", a.role),
            IdentityField::LayoutFingerprint => format!("{:#x}", a.layout_fingerprint.0),
            IdentityField::TpSize => a.tp_size.to_string(),
        }
    }

    /// The first field whose value differs between `registered` and
    /// `announced`, if any.
    pub fn first_change(
        registered: &WorkerAnnouncement,
        announced: &WorkerAnnouncement,
    ) -> Option<IdentityField> {
        if registered.role != announced.role {
            Some(IdentityField::Role)
        } else if registered.layout_fingerprint != announced.layout_fingerprint {
            Some(IdentityField::LayoutFingerprint)
        } else if registered.tp_size != announced.tp_size {
            Some(IdentityField::TpSize)
        } else {
            None
        }
    }
}

impl std::fmt::Display for IdentityField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone)]
struct Entry {
    announcement: WorkerAnnouncement,
    last_seen_ms: u64,
}

/// What the registry keeps of an incarnation removed for silence.
#[derive(Debug, Clone)]
struct Silenced {
    /// The worker key it was registered under.
    key: String,
    /// Heard announcing under another key since, and refused for it: a
    /// process whose key changed, which will not come back under `key`,
    /// so `key` is no longer kept for it (neither taken for it nor retired
    /// by another's registration). Two silenced incarnations that swapped
    /// keys otherwise refused each other for as long as both ran, each
    /// refusal renewing its memory (trial h47, 4).
    moved: bool,
}

/// The router's view of live workers.
#[derive(Debug)]
pub struct WorkerRegistry {
    announce_period_ms: u64,
    missed_periods: u32,
    by_key: HashMap<String, Entry>,
    /// The worker key of each engine in `by_key` (one key per engine).
    key_of: HashMap<EngineId, String>,
    /// Replaced incarnations, with the worker key they were replaced
    /// under: refused while remembered.
    retired: Remembered<String>,
    /// Incarnations removed for silence, with their worker key: taken back
    /// when they announce again, retired when another incarnation
    /// registers under their key (unless they moved, [`Silenced`]).
    silenced: Remembered<Silenced>,
    /// How long, in ms, an incarnation in `retired` or `silenced` is
    /// remembered after it was last heard of.
    retention_ms: u64,
    /// Incarnations forgotten from `retired` and `silenced` so far.
    forgotten: u64,
    /// The ids of those not yet handed out by
    /// [`WorkerRegistry::take_forgotten`], oldest first.
    pending_forgotten: VecDeque<EngineId>,
    /// Set by [`WorkerRegistry::pause`]: [`WorkerRegistry::tick`] removes
    /// nobody.
    paused: bool,
}

impl WorkerRegistry {
    /// A registry removing a worker silent for more than
    /// `missed_periods` x `announce_period_ms` (`missed_periods` 0 counts
    /// as 1), remembering replaced and silenced incarnations as the module
    /// documentation says.
    pub fn new(announce_period_ms: u64, missed_periods: u32) -> Self {
        let missed_periods = missed_periods.max(1);
        let window = announce_period_ms.saturating_mul(missed_periods as u64);
        Self {
            announce_period_ms,
            missed_periods,
            by_key: HashMap::new(),
            key_of: HashMap::new(),
            retired: Remembered::new(MAX_REMEMBERED),
            silenced: Remembered::new(MAX_REMEMBERED),
            retention_ms: window
                .saturating_mul(FORGET_AFTER_SILENCE_WINDOWS)
                .max(FORGET_AFTER_MIN_MS),
            forgotten: 0,
            pending_forgotten: VecDeque::new(),
            paused: false,
        }
    }

    /// Records an announcement seen at `now_ms`.
    pub fn announce(&mut self, a: WorkerAnnouncement, now_ms: u64) -> Registration {
        self.forget_expired(now_ms);
        if let Some(key) = self.key_of.get(&a.engine_id) {
            if *key != a.worker_key {
                // Live under another key: that key's heartbeat is not
                // refreshed by this (trial h42, 1).
                return Registration::OtherKey {
                    registered_under: key.clone(),
                };
            }
        }
        if let Some(replaced_under) = self.retired.get(&a.engine_id).cloned() {
            // Heard of again: a replaced incarnation that keeps announcing (a
            // second process under the key) stays refused while another
            // incarnation holds its key, and under any other key.
            if replaced_under != a.worker_key {
                self.retired.heard(&a.engine_id, now_ms);
                return Registration::OtherKey {
                    registered_under: replaced_under,
                };
            }
            if self.by_key.contains_key(&a.worker_key) {
                self.retired.heard(&a.engine_id, now_ms);
                return Registration::Retired;
            }
            // Nobody holds the key any more (what replaced it was dropped
            // for silence): it is the only process announcing under it, so it
            // is taken back like a silenced one instead of being refused
            // while nobody serves the key (trial h39, 1: a stale incarnation
            // back after the retention replaced the live one, which then
            // stayed refused for as long as it ran, after the stale one died
            // too). What replaced it, silenced, is replaced in its turn.
            self.retired.take(&a.engine_id);
            self.retire_silenced_under(&a.worker_key, now_ms);
            self.insert_live(a, now_ms);
            return Registration::Readmitted;
        }
        if let Some(silenced_under) = self.silenced.get(&a.engine_id).map(|s| s.key.clone()) {
            // Its own key was taken by a new incarnation (which retired it
            // from `silenced`), so a live holder is another worker's: a
            // process back from silence does not take it. Nor does it take
            // another key held by an incarnation removed for silence: that
            // one may come back too (a partition ending), and taking the
            // key would retire it, refused then under its own key for as
            // long as the mover runs (trial h44, 6).
            let taken = self.by_key.contains_key(&a.worker_key)
                || (a.worker_key != silenced_under && self.silenced_under(&a.worker_key).is_some());
            if taken {
                self.silenced.heard(&a.engine_id, now_ms);
                if let Some(s) = self.silenced.get_mut(&a.engine_id) {
                    s.moved = a.worker_key != s.key;
                }
                return Registration::OtherKey {
                    registered_under: silenced_under,
                };
            }
            // Its own key, or a new key free of live and silenced
            // incarnations: taken back. (Under its own key nobody else is
            // silenced: a registration under a key retires its silenced
            // incarnations.)
            self.silenced.take(&a.engine_id);
            self.retire_silenced_under(&a.worker_key, now_ms);
            self.insert_live(a, now_ms);
            return Registration::Readmitted;
        }
        match self.by_key.get_mut(&a.worker_key) {
            None => {
                // An incarnation of this key removed for silence is
                // replaced now: it must not come back next to this one.
                self.retire_silenced_under(&a.worker_key, now_ms);
                self.insert_live(a, now_ms);
                Registration::New
            }
            Some(e) if e.announcement.engine_id == a.engine_id => {
                if let Some(field) = IdentityField::first_change(&e.announcement, &a) {
                    // Not heard as a refresh: a publisher that goes on with
                    // the new facts is dropped for silence, then taken back
                    // with them, its entries rebuilt from its snapshot.
                    return Registration::IdentityChanged { field };
                }
                e.announcement = a;
                e.last_seen_ms = now_ms;
                Registration::Refreshed
            }
            Some(e) => {
                let dropped = e.announcement.engine_id;
                let key = a.worker_key.clone();
                *e = Entry {
                    announcement: a,
                    last_seen_ms: now_ms,
                };
                let engine = e.announcement.engine_id;
                self.key_of.remove(&dropped);
                self.key_of.insert(engine, key.clone());
                self.retire(dropped, key, now_ms);
                Registration::Replaced { dropped }
            }
        }
    }

    /// Registers `a` live under its (free) key.
    fn insert_live(&mut self, a: WorkerAnnouncement, now_ms: u64) {
        debug_assert!(!self.by_key.contains_key(&a.worker_key), "a free key");
        self.key_of.insert(a.engine_id, a.worker_key.clone());
        self.by_key.insert(
            a.worker_key.clone(),
            Entry {
                announcement: a,
                last_seen_ms: now_ms,
            },
        );
    }

    /// Retires every incarnation removed for silence under `key` (one that
    /// registers under it replaces them).
    fn retire_silenced_under(&mut self, key: &str, now_ms: u64) {
        for (engine, s) in self.silenced.take_where(|_, s| s.key == key && !s.moved) {
            self.retire(engine, s.key, now_ms);
        }
    }

    /// Remembers `engine` as replaced under `key` at `now_ms`.
    fn retire(&mut self, engine: EngineId, key: String, now_ms: u64) {
        let evicted = self.retired.remember(engine, key, now_ms);
        self.note_forgotten(evicted);
    }

    /// Counts `ids` as forgotten and keeps them for
    /// [`WorkerRegistry::take_forgotten`].
    fn note_forgotten(&mut self, ids: Vec<EngineId>) {
        self.forgotten += ids.len() as u64;
        self.pending_forgotten.extend(ids);
        let over = self
            .pending_forgotten
            .len()
            .saturating_sub(MAX_PENDING_FORGOTTEN);
        self.pending_forgotten.drain(..over);
    }

    /// Forgets the replaced and silenced incarnations not heard of for the
    /// retention at `now_ms`; nothing while paused (the router could hear
    /// nothing of them).
    fn forget_expired(&mut self, now_ms: u64) {
        if self.paused {
            return;
        }
        let retention = self.retention_ms;
        let mut ids = self.retired.forget_older_than(retention, now_ms);
        ids.extend(self.silenced.forget_older_than(retention, now_ms));
        self.note_forgotten(ids);
    }

    /// Stops counting silence: while the router's own connection to the
    /// workers is down their announcements cannot arrive, and
    /// [`WorkerRegistry::tick`] removes nobody until
    /// [`WorkerRegistry::resume`].
    pub fn pause(&mut self) {
        self.paused = true;
    }

    /// Counts silence again from `now_ms`: every registered worker gets a
    /// fresh deadline (`missed_periods` periods from now), as if it had
    /// just announced, and every remembered replaced or silenced
    /// incarnation a fresh retention, since the time the router was away
    /// tells nothing of them. Also right without a
    /// [`WorkerRegistry::pause`] before.
    pub fn resume(&mut self, now_ms: u64) {
        self.paused = false;
        for e in self.by_key.values_mut() {
            e.last_seen_ms = e.last_seen_ms.max(now_ms);
        }
        self.retired.restamp(now_ms);
        self.silenced.restamp(now_ms);
    }

    /// Whether [`WorkerRegistry::pause`] is in force.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The engine ids of the registered workers of `role`.
    pub fn engines(&self, role: Role) -> Vec<EngineId> {
        self.by_key
            .values()
            .filter(|e| e.announcement.role == role)
            .map(|e| e.announcement.engine_id)
            .collect()
    }

    /// Removes every worker silent for more than the allowed periods at
    /// `now_ms` (nobody while paused); returns their (worker key, engine
    /// id), which the caller drops from the index. Their events are ignored
    /// until they announce again ([`Registration::Readmitted`]). Also
    /// forgets the replaced and silenced incarnations not heard of for the
    /// retention ([`WorkerRegistry::forgotten`],
    /// [`WorkerRegistry::take_forgotten`]).
    pub fn tick(&mut self, now_ms: u64) -> Vec<(String, EngineId)> {
        if self.paused {
            return Vec::new();
        }
        self.forget_expired(now_ms);
        let limit = self
            .announce_period_ms
            .saturating_mul(self.missed_periods as u64);
        let dead: Vec<String> = self
            .by_key
            .iter()
            .filter(|(_, e)| now_ms.saturating_sub(e.last_seen_ms) > limit)
            .map(|(k, _)| k.clone())
            .collect();
        let mut removed = Vec::with_capacity(dead.len());
        for k in dead {
            if let Some(e) = self.by_key.remove(&k) {
                let id = e.announcement.engine_id;
                self.key_of.remove(&id);
                let evicted = self.silenced.remember(
                    id,
                    Silenced {
                        key: k.clone(),
                        moved: false,
                    },
                    now_ms,
                );
                self.note_forgotten(evicted);
                removed.push((k, id));
            }
        }
        removed
    }

    /// Replaced and silenced incarnations forgotten so far (not heard of
    /// for the retention, or the oldest past [`MAX_REMEMBERED`]).
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// The engine ids forgotten since the last call (by
    /// [`WorkerRegistry::announce`] or [`WorkerRegistry::tick`]), the one
    /// forgotten longest ago first, each handed out once. The caller
    /// forgets each in its kv-lookup index (`InventoryIndex::forget_retired`;
    /// every one of them was dropped from it when it was replaced or
    /// silenced), which otherwise remembers every removed engine for its
    /// whole life. Of those not taken, at most 2 x [`MAX_REMEMBERED`] are
    /// kept, the oldest dropped first: a caller that takes them after each
    /// `announce` and `tick` loses none.
    ///
    /// ```
    /// use kv_descriptor::{EngineId, GpuIdentity, LayoutFingerprint, Role};
    /// use kv_router_glue::{Registration, WorkerAnnouncement, WorkerRegistry};
    /// let announce = |engine_id| WorkerAnnouncement {
    ///     worker_key: "host-1/gpu-0".into(),
    ///     engine_id,
    ///     role: Role::Decode,
    ///     layout_fingerprint: LayoutFingerprint(7),
    ///     tp_size: 1,
    ///     gpus: vec![GpuIdentity::new(uuid::Uuid::from_u128(1), 0, "host-1").unwrap()],
    ///     pin_endpoint: "unix:/tmp/pin".into(),
    ///     event_subject: "kv.ns.decode.events".into(),
    /// };
    /// // Announce every 1 s, dropped after 3 silent periods: replaced and
    /// // silenced incarnations are remembered 100 x 3 s = 300 s (5 min).
    /// let mut registry = WorkerRegistry::new(1_000, 3);
    /// let (old, new) = (EngineId::fresh(), EngineId::fresh());
    /// registry.announce(announce(old), 0);
    /// assert_eq!(registry.announce(announce(new), 1_000), Registration::Replaced { dropped: old });
    /// assert!(registry.take_forgotten().is_empty());
    /// registry.announce(announce(new), 301_000); // `new` stays live
    /// registry.tick(301_001); // `old` not heard of for more than 300 s
    /// assert_eq!(registry.take_forgotten(), vec![old]);
    /// assert!(registry.take_forgotten().is_empty(), "handed out once");
    /// assert_eq!(registry.forgotten(), 1);
    /// ```
    pub fn take_forgotten(&mut self) -> Vec<EngineId> {
        self.pending_forgotten.drain(..).collect()
    }

    /// How long, in ms, a replaced or silenced incarnation is remembered
    /// after it was last heard of: [`FORGET_AFTER_SILENCE_WINDOWS`] x
    /// `missed_periods` x `announce_period_ms`, at least
    /// [`FORGET_AFTER_MIN_MS`].
    pub fn retention_ms(&self) -> u64 {
        self.retention_ms
    }

    /// (replaced, silenced) incarnations remembered now, each at most
    /// [`MAX_REMEMBERED`].
    pub fn remembered(&self) -> (usize, usize) {
        (self.retired.len(), self.silenced.len())
    }

    /// Whether `engine` was replaced, or removed for silence and has not
    /// announced since, and is still remembered: its events and directory
    /// records are ignored.
    pub fn is_retired(&self, engine: EngineId) -> bool {
        self.retired.contains(&engine) || self.silenced.contains(&engine)
    }

    /// An incarnation removed for silence under `worker_key` and still
    /// remembered (it is taken back when it announces again), if any: such
    /// a key is not free for another incarnation back from silence. One
    /// heard announcing another key since (it moved) does not count.
    pub fn silenced_under(&self, worker_key: &str) -> Option<EngineId> {
        self.silenced.find(|_, s| s.key == worker_key && !s.moved)
    }

    /// Whether `engine` was replaced by a newer incarnation (refused while
    /// remembered, unlike one removed for silence).
    pub fn is_replaced(&self, engine: EngineId) -> bool {
        self.retired.contains(&engine)
    }

    /// The event subjects registered workers announce (a subject once per
    /// worker naming it).
    pub fn event_subjects(&self) -> impl Iterator<Item = &str> {
        self.by_key
            .values()
            .map(|e| e.announcement.event_subject.as_str())
    }

    /// The live announcement of `worker_key`.
    pub fn get(&self, worker_key: &str) -> Option<&WorkerAnnouncement> {
        self.by_key.get(worker_key).map(|e| &e.announcement)
    }

    /// Number of live workers.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no worker is live.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

#[cfg(all(test, feature = "worker"))]
mod tests;
