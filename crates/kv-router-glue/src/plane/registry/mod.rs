//! Worker registration: each worker publishes a [`WorkerAnnouncement`]
//! every announce period over the event plane (any [`crate::EventPlane`]:
//! in-process or NATS, on [`announce_subject`]); the router keeps a
//! [`WorkerRegistry`].
//!
//! Rules: a new incarnation (engine id) under a known worker key replaces
//! the old one, and the dropped engine id is returned so the caller drops its
//! inventory from the kv-lookup index and ignores its late events
//! ([`WorkerRegistry::is_retired`]); a replaced incarnation is refused for
//! good. A worker silent for `missed_periods` announce periods is removed by
//! [`WorkerRegistry::tick`], and its events are ignored while it is away,
//! but it is not replaced: when it announces again (a network partition
//! ended) it is taken back ([`Registration::Readmitted`]), unless a new
//! incarnation took its key meanwhile. While the router's own connection
//! is down ([`WorkerRegistry::pause`]) nobody's silence counts: the
//! workers' announcements cannot reach it. Time is passed in (ms on any
//! monotonic clock) so tests never sleep.

use std::collections::{HashMap, HashSet};

use kv_descriptor::{EngineId, GpuIdentity, LayoutFingerprint, Role, Wire};
use serde::{Deserialize, Serialize};

use crate::{PlaneError, Subject};

/// Longest accepted encoded announcement, in bytes.
pub const MAX_ANNOUNCEMENT_BYTES: usize = 16 * 1024;
/// Most GPU identities an announcement may list (one per TP rank).
pub const MAX_ANNOUNCED_GPUS: usize = 64;
const MAX_NAME: usize = super::directory::MAX_NAME_BYTES;

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
    /// An announcement of an incarnation already replaced: ignored.
    Retired,
    /// An incarnation [`WorkerRegistry::tick`] removed for silence
    /// announces again, and no other incarnation took its key: registered
    /// again. The caller missed its events while it was away, so it treats
    /// its inventory as unknown until a resync (the kv-lookup index's
    /// `readmit_worker`, then an inventory snapshot).
    Readmitted,
}

#[derive(Debug, Clone)]
struct Entry {
    announcement: WorkerAnnouncement,
    last_seen_ms: u64,
}

/// The router's view of live workers.
#[derive(Debug)]
pub struct WorkerRegistry {
    announce_period_ms: u64,
    missed_periods: u32,
    by_key: HashMap<String, Entry>,
    /// Replaced incarnations: refused for good.
    retired: HashSet<EngineId>,
    /// Incarnations removed for silence, with their worker key: taken back
    /// when they announce again, retired when another incarnation
    /// registers under their key.
    silenced: HashMap<EngineId, String>,
    /// Set by [`WorkerRegistry::pause`]: [`WorkerRegistry::tick`] removes
    /// nobody.
    paused: bool,
}

impl WorkerRegistry {
    /// A registry removing a worker silent for more than
    /// `missed_periods` x `announce_period_ms`.
    pub fn new(announce_period_ms: u64, missed_periods: u32) -> Self {
        Self {
            announce_period_ms,
            missed_periods: missed_periods.max(1),
            by_key: HashMap::new(),
            retired: HashSet::new(),
            silenced: HashMap::new(),
            paused: false,
        }
    }

    /// Records an announcement seen at `now_ms`.
    pub fn announce(&mut self, a: WorkerAnnouncement, now_ms: u64) -> Registration {
        if self.retired.contains(&a.engine_id) {
            return Registration::Retired;
        }
        let entry = |a| Entry {
            announcement: a,
            last_seen_ms: now_ms,
        };
        if self.silenced.remove(&a.engine_id).is_some() {
            // Its key is free: a new incarnation under it would have
            // retired this one (below).
            debug_assert!(!self.by_key.contains_key(&a.worker_key));
            self.by_key.insert(a.worker_key.clone(), entry(a));
            return Registration::Readmitted;
        }
        match self.by_key.get_mut(&a.worker_key) {
            None => {
                // An incarnation of this key removed for silence is
                // replaced now: it must not come back next to this one.
                self.silenced.retain(|engine, key| {
                    let same = *key == a.worker_key;
                    if same {
                        self.retired.insert(*engine);
                    }
                    !same
                });
                self.by_key.insert(a.worker_key.clone(), entry(a));
                Registration::New
            }
            Some(e) if e.announcement.engine_id == a.engine_id => {
                e.announcement = a;
                e.last_seen_ms = now_ms;
                Registration::Refreshed
            }
            Some(e) => {
                let dropped = e.announcement.engine_id;
                self.retired.insert(dropped);
                *e = entry(a);
                Registration::Replaced { dropped }
            }
        }
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
    /// just announced, since the time the router was away tells nothing of
    /// it. Also right without a [`WorkerRegistry::pause`] before.
    pub fn resume(&mut self, now_ms: u64) {
        self.paused = false;
        for e in self.by_key.values_mut() {
            e.last_seen_ms = e.last_seen_ms.max(now_ms);
        }
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
    /// until they announce again ([`Registration::Readmitted`]).
    pub fn tick(&mut self, now_ms: u64) -> Vec<(String, EngineId)> {
        if self.paused {
            return Vec::new();
        }
        let limit = self
            .announce_period_ms
            .saturating_mul(self.missed_periods as u64);
        let dead: Vec<String> = self
            .by_key
            .iter()
            .filter(|(_, e)| now_ms.saturating_sub(e.last_seen_ms) > limit)
            .map(|(k, _)| k.clone())
            .collect();
        dead.into_iter()
            .filter_map(|k| {
                self.by_key
                    .remove(&k)
                    .map(|e| (k, e.announcement.engine_id))
            })
            .inspect(|(k, id)| {
                self.silenced.insert(*id, k.clone());
            })
            .collect()
    }

    /// Whether `engine` was replaced, or removed for silence and has not
    /// announced since: its events and directory records are ignored.
    pub fn is_retired(&self, engine: EngineId) -> bool {
        self.retired.contains(&engine) || self.silenced.contains_key(&engine)
    }

    /// Whether `engine` was replaced by a newer incarnation (refused for
    /// good, unlike one removed for silence).
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
