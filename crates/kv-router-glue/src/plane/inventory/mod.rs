//! Inventory snapshots: how a router that (re)starts learns what every
//! worker already holds, instead of waiting for events it missed.
//!
//! A worker answers [`InventoryRequest`]s on `kv.<ns>.inventory.<engine_id>`
//! ([`inventory_subject`]) with pages of its ready blocks
//! ([`InventorySnapshot`]), each consistent with its KV event stream up to
//! `last_event_id`. The router side, [`InventorySync`], applies a worker's
//! pages to the kv-lookup index and the donor slot map, then takes the event
//! stream from there on: events at or below the snapshot's id are duplicates
//! (ignored), later ones apply once, and a `Lost` range the snapshot covers
//! needs nothing. Several router replicas may each do this on the same stream.
//!
//! Transports of the request/reply, one trait [`InventoryPlane`]:
//! [`InProcessInventory`] (one process) and, with feature `nats`,
//! [`NatsInventory`] (NATS request/reply).

mod in_process;
#[cfg(feature = "nats")]
mod nats;
mod sync;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
mod wire;

use std::time::Duration;

use kv_descriptor::EngineId;
use tokio::sync::{mpsc, oneshot};

pub use in_process::InProcessInventory;
#[cfg(feature = "nats")]
pub use nats::NatsInventory;
// Used by the router service's follower only.
#[cfg(feature = "service")]
pub(crate) use sync::STALE_RETRIES;
pub use sync::{
    InventorySync, RebuildReport, SnapshotAsker, SnapshotPages, SyncOutcome,
    DEFAULT_INVENTORY_TIMEOUT,
};
// Used by the worker agents and tests only.
#[cfg(any(feature = "worker", test))]
pub(crate) use wire::all_ranks;
pub use wire::{
    InventoryRefusal, InventoryReply, InventoryRequest, InventorySnapshot, InventoryWireError,
    SnapshotBlock, MAX_INVENTORY_REPLY_BYTES, MAX_INVENTORY_REQUEST_BYTES,
    MAX_SNAPSHOT_PAGE_BLOCKS, MAX_SNAPSHOT_TP,
};

use crate::event_plane::AbortOnDrop;
use crate::{PlaneError, Subject};

/// The subject worker `engine` answers inventory requests on, under
/// `namespace`: `kv.<namespace>.inventory.<engine_id>` (hyphenated UUID).
///
/// # Errors
/// [`PlaneError::InvalidSubject`] for a bad namespace token.
pub fn inventory_subject(namespace: &str, engine: EngineId) -> Result<Subject, PlaneError> {
    Subject::new(namespace, "inventory", &engine.to_string())
}

/// Why an inventory request or its application failed.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// Nobody serves the subject (the worker is gone or not serving yet).
    #[error("no responder on `{subject}`")]
    NoResponder {
        /// The subject asked.
        subject: String,
    },
    /// No answer within the timeout.
    #[error("no answer on `{subject}` within {waited_ms} ms")]
    Timeout {
        /// The subject asked.
        subject: String,
        /// How long it waited.
        waited_ms: u64,
    },
    /// The transport failed (connection, subscribe, publish).
    #[error("inventory transport on `{subject}`: {reason}")]
    Transport {
        /// The subject.
        subject: String,
        /// The transport's message.
        reason: String,
    },
    /// The reply (or request) bytes were refused.
    #[error("inventory wire: {0}")]
    Wire(#[from] InventoryWireError),
    /// The worker refused.
    #[error("worker {engine} refused the snapshot: {refusal}")]
    Refused {
        /// The worker asked.
        engine: EngineId,
        /// Why.
        refusal: InventoryRefusal,
    },
    /// A page answered for another engine, generation or layout than asked
    /// (named in `field`): nothing of it was applied.
    #[error("snapshot of {engine} does not match the request: `{field}` {reason}")]
    Mismatch {
        /// The worker asked.
        engine: EngineId,
        /// The field that differs (`engine_id`, `bank_generation`, ...).
        field: &'static str,
        /// What differs, with both values.
        reason: String,
    },
    /// The snapshots kept reflecting fewer events than the router had
    /// already applied from the stream (it would undo them); retried and
    /// given up.
    #[error("snapshot of {engine} at event {snapshot_event_id} is older than event {applied_event_id} already applied")]
    Stale {
        /// The worker.
        engine: EngineId,
        /// The last snapshot's `last_event_id`.
        snapshot_event_id: u64,
        /// The highest event id the router applied.
        applied_event_id: u64,
    },
    /// The subject could not be built.
    #[error("inventory subject: {0}")]
    Subject(#[from] PlaneError),
    /// The kv-lookup index refused the snapshot (the worker is not registered there).
    #[error("index: {0}")]
    Index(#[from] kv_lookup::LookupError),
}

/// One request delivered to a server: its bytes and where the answer goes.
#[derive(Debug)]
pub struct IncomingRequest {
    /// Request bytes as sent.
    pub payload: Vec<u8>,
    reply: oneshot::Sender<Vec<u8>>,
}

impl IncomingRequest {
    /// Answers the request (a requester that gave up is not an error).
    pub fn respond(self, payload: Vec<u8>) {
        let _ = self.reply.send(payload);
    }
}

/// Requests arriving on a served subject; dropping it stops serving.
pub struct InventoryRequests {
    subject: String,
    rx: mpsc::UnboundedReceiver<IncomingRequest>,
    _guard: Option<AbortOnDrop>,
}

impl std::fmt::Debug for InventoryRequests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InventoryRequests")
            .field("subject", &self.subject)
            .finish()
    }
}

impl InventoryRequests {
    /// The served subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The next request; `None` once the transport closed.
    pub async fn next(&mut self) -> Option<IncomingRequest> {
        self.rx.recv().await
    }
}

/// Request/reply transport of inventory snapshots (the event plane is
/// publish/subscribe only). Both calls are object-safe boxed futures.
pub trait InventoryPlane: Send + Sync {
    /// Short name for logs (`in_process`, `nats`).
    fn name(&self) -> &'static str;

    /// Sends `payload` to the server of `subject`, waits at most `timeout`
    /// for its answer.
    ///
    /// # Errors
    /// [`InventoryError::NoResponder`], [`InventoryError::Timeout`],
    /// [`InventoryError::Transport`].
    fn request<'a>(
        &'a self,
        subject: &'a Subject,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> InventoryFuture<'a, Vec<u8>>;

    /// Serves `subject`; ready on return (a request sent afterwards reaches
    /// it). A second server on the same subject replaces the first
    /// in-process; over NATS both answer and the requester takes the first.
    ///
    /// # Errors
    /// [`InventoryError::Transport`] when the subscription fails.
    fn serve<'a>(&'a self, subject: &'a Subject) -> InventoryFuture<'a, InventoryRequests>;
}

/// Boxed future of [`InventoryPlane`] methods.
pub type InventoryFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, InventoryError>> + Send + 'a>>;
