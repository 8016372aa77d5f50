//! The donor directory across processes: a donor publishes its
//! [`DonorRecord`] (manifest, pin endpoint, NIXL agent metadata, lease) when
//! its bank opens or changes generation, re-puts it before the lease lapses,
//! and deletes it on close. Readers (the router, targets) keep a watched
//! [`DonorCache`].
//!
//! Backends of [`DirectoryPlane`]: [`InProcessDirectory`] (the embedded
//! default) and, with feature `nats`, [`NatsDirectory`] (a JetStream
//! key-value bucket keyed by engine id, `max_age` = the lease TTL, so an
//! entry whose donor stopped re-putting disappears by itself).
//!
//! Rules of the cache: an entry whose `lease_expires_unix_ms` is past, or
//! whose generation is older than one already seen for that engine, is never
//! used (a typed [`ResolveError`](crate::ResolveError)).

mod cache;
mod heard_cache;
#[cfg(feature = "nats")]
mod nats;
mod nixl_regions;
mod record;
mod reopening;

pub use cache::{CacheUpdate, DonorCache};
pub use heard_cache::{HeardCache, HeardUpdate};
#[cfg(feature = "nats")]
pub use nats::{NatsDirectory, NATS_MIN_MAX_AGE};
pub use nixl_regions::{NixlMemKind, NixlRankRegion};
pub use record::{
    DonorRecord, DonorRecordError, DonorRecordParts, MAX_DONOR_RECORD_BYTES, MAX_NAME_BYTES,
    MAX_NIXL_AGENT_NAME_BYTES,
};
pub use reopening::{watch_reopening, REOPEN_MAX, REOPEN_MIN};

use kv_descriptor::{EngineId, Wire};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::{PlaneError, PlaneFuture};

/// Why `bucket` is not a JetStream key-value bucket name, or `None` when it
/// is one: non-empty ASCII letters, digits, `_` and `-` only (the rule of
/// async-nats and the NATS clients; the stream behind it is `KV_<bucket>`).
/// Checked before any request so that a bad name reads as a configuration
/// error rather than a failed connection.
///
/// ```
/// use kv_router_glue::bucket_name_problem;
/// assert_eq!(bucket_name_problem("kv_donors-2"), None);
/// assert!(bucket_name_problem("bad bucket.name").is_some());
/// assert!(bucket_name_problem("").is_some());
/// ```
pub fn bucket_name_problem(bucket: &str) -> Option<&'static str> {
    if bucket.is_empty() {
        Some("is empty")
    } else if !bucket
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        Some("may hold only ASCII letters, digits, `_` and `-`")
    } else {
        None
    }
}

/// One change seen by a directory watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectoryChange {
    /// An entry was put (new, renewed or a new generation).
    Put(DonorRecord),
    /// The donor closed its bank (or its entry expired).
    Delete(EngineId),
    /// Bytes under the engine's key that are not a valid record: refused,
    /// the cache is unchanged.
    Refused {
        /// The key, as stored.
        key: String,
        /// Why, naming the field.
        error: DonorRecordError,
    },
}

/// A live watch: first every current entry, then every change.
pub struct DirectoryWatch {
    rx: mpsc::UnboundedReceiver<DirectoryChange>,
    // Stops a backend's forwarding task when the watch is dropped.
    #[allow(dead_code)]
    _guard: Option<crate::event_plane::AbortOnDrop>,
    /// How to open the backend's watch again when it ends
    /// ([`watch_reopening`]); `None`: the watch ends with it.
    reopen: Option<Box<reopening::Reopen>>,
}

impl std::fmt::Debug for DirectoryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectoryWatch").finish_non_exhaustive()
    }
}

impl DirectoryWatch {
    /// A watch fed by `rx`, whose backend task (if any) `guard` stops.
    pub(crate) fn new(
        rx: mpsc::UnboundedReceiver<DirectoryChange>,
        guard: Option<crate::event_plane::AbortOnDrop>,
    ) -> Self {
        Self {
            rx,
            _guard: guard,
            reopen: None,
        }
    }

    /// The next change; `None` once the backend went away (never, for a
    /// [`watch_reopening`] one: it waits for the watch opened again).
    pub async fn next(&mut self) -> Option<DirectoryChange> {
        loop {
            if let Some(change) = self.rx.recv().await {
                return Some(change);
            }
            let fresh = self.reopen.as_mut()?.open_again().await;
            self.adopt(fresh);
        }
    }

    /// A change already delivered, without waiting. For a
    /// [`watch_reopening`] one whose backend ended, each call also moves
    /// the re-opening on (a try started in the background, taken in once
    /// open), so a reader that only polls still gets there.
    pub fn try_next(&mut self) -> Option<DirectoryChange> {
        loop {
            match self.rx.try_recv() {
                Ok(change) => return Some(change),
                Err(mpsc::error::TryRecvError::Empty) => return None,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    let fresh = self.reopen.as_mut()?.poll_open()?;
                    self.adopt(fresh);
                }
            }
        }
    }

    /// Reads from `fresh`'s backend from now on, keeping how to re-open.
    fn adopt(&mut self, fresh: DirectoryWatch) {
        self.rx = fresh.rx;
        self._guard = fresh._guard;
    }
}

/// Where donor records live. Keys are engine ids; values are
/// [`DonorRecord`] wire bytes.
pub trait DirectoryPlane: Send + Sync {
    /// Puts (or renews) `record` under its engine id.
    fn put<'a>(&'a self, record: &'a DonorRecord) -> PlaneFuture<'a, ()>;
    /// Deletes the engine's entry (bank closed).
    fn delete<'a>(&'a self, engine: EngineId) -> PlaneFuture<'a, ()>;
    /// Watches every entry: the current ones first, then changes.
    fn watch<'a>(&'a self) -> PlaneFuture<'a, DirectoryWatch>;
}

/// The directory key of an engine: its hyphenated UUID.
pub fn directory_key(engine: EngineId) -> String {
    engine.0.hyphenated().to_string()
}

/// In-process directory (one process: tests, the embedded cluster).
#[derive(Default)]
pub struct InProcessDirectory {
    inner: Mutex<InProcessState>,
}

#[derive(Default)]
struct InProcessState {
    entries: std::collections::BTreeMap<String, Vec<u8>>,
    watchers: Vec<mpsc::UnboundedSender<DirectoryChange>>,
}

impl std::fmt::Debug for InProcessDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessDirectory")
            .field("entries", &self.inner.lock().entries.len())
            .finish()
    }
}

impl InProcessDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores raw bytes under `key` as a backend would, valid or not: what
    /// watchers see for a corrupt or foreign entry (tests of refusal).
    pub fn put_raw(&self, key: &str, bytes: Vec<u8>) {
        let change = decode_change(key, &bytes);
        let mut st = self.inner.lock();
        st.entries.insert(key.to_string(), bytes);
        st.watchers.retain(|w| w.send(change.clone()).is_ok());
    }

    /// Ends every open watch, as a backend that went away does (tests of a
    /// follower that opens its watch again).
    #[cfg(test)]
    pub(crate) fn end_watches(&self) {
        self.inner.lock().watchers.clear();
    }
}

/// A stored value as a watcher sees it.
pub(crate) fn decode_change(key: &str, bytes: &[u8]) -> DirectoryChange {
    match DonorRecord::decode(bytes) {
        Ok(r) if directory_key(r.engine_id()) == key => DirectoryChange::Put(r),
        Ok(r) => DirectoryChange::Refused {
            key: key.to_string(),
            error: DonorRecordError::InvalidField {
                field: "engine_id",
                reason: format!("{} stored under key {key}", r.engine_id().0),
            },
        },
        Err(error) => DirectoryChange::Refused {
            key: key.to_string(),
            error,
        },
    }
}

impl DirectoryPlane for InProcessDirectory {
    fn put<'a>(&'a self, record: &'a DonorRecord) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            let bytes = record.to_wire().map_err(|e| PlaneError::Publish {
                subject: directory_key(record.engine_id()),
                reason: e.to_string(),
            })?;
            self.put_raw(&directory_key(record.engine_id()), bytes);
            Ok(())
        })
    }

    fn delete<'a>(&'a self, engine: EngineId) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            let mut st = self.inner.lock();
            st.entries.remove(&directory_key(engine));
            st.watchers
                .retain(|w| w.send(DirectoryChange::Delete(engine)).is_ok());
            Ok(())
        })
    }

    fn watch<'a>(&'a self) -> PlaneFuture<'a, DirectoryWatch> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut st = self.inner.lock();
            for (k, v) in &st.entries {
                let _ = tx.send(decode_change(k, v));
            }
            st.watchers.push(tx);
            Ok(DirectoryWatch::new(rx, None))
        })
    }
}

#[cfg(all(test, feature = "worker", feature = "nats"))]
mod nats_tests;
#[cfg(all(test, feature = "worker"))]
mod tests;
#[cfg(all(test, feature = "worker"))]
pub(crate) mod tests_support;
