//! Event planes: how KV events, manifests and control messages travel.
//!
//! One trait, [`EventPlane`], with two implementations: [`InProcessPlane`]
//! (the embedded default: one process, tokio channels) and [`NatsPlane`]
//! (several processes or hosts, through `async-nats`). Subjects are scoped by
//! namespace and component ([`Subject`]).
//!
//! # Readiness
//! [`EventPlane::subscribe`] returns only once the subscription is registered
//! where publishers deliver (for NATS: after a request that the server
//! itself answers, sent after the `SUB` on the same connection), so anything
//! published after it returns is delivered.
//! Publishers of one-shot events call [`EventPlane::wait_for_subscribers`]
//! first: it resolves only when that many subscriptions answer a readiness
//! probe, so a one-shot event is never sent into the void.

mod in_process;
#[cfg(feature = "nats")]
mod nats;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use in_process::InProcessPlane;
// The advise server's drain (service feature) is its only user outside.
#[cfg(feature = "service")]
pub(crate) use nats::server_round_trip;
// The advise client (service feature) connects to these too.
#[cfg(feature = "service")]
pub(crate) use nats::connect_addrs;
// The directory's bucket creation waits on these.
#[cfg(feature = "nats")]
pub use nats::{
    inbox_prefix_problem, nats_server_addrs, nats_slow_consumer_drops, redact_url, NatsAuth,
    NatsOptions, NatsOptionsError, NatsPlane, NatsTls, FORWARD_CAPACITY,
};
#[cfg(feature = "nats")]
pub(crate) use nats::{PermissionRefusals, Refusal};

use crate::PlaneError;

/// Boxed future returned by [`EventPlane`] methods (keeps the trait object-safe).
pub type PlaneFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PlaneError>> + Send + 'a>>;

/// First token of every subject, so that our traffic is easy to filter on a shared server.
pub const SUBJECT_ROOT: &str = "kv";

/// A subject `kv.<namespace>.<component>.<topic>`.
///
/// Each token is non-empty and holds no `.`, `*`, `>` or whitespace, so a
/// subject can never act as a wildcard or spill into another namespace.
///
/// ```
/// use kv_router_glue::Subject;
/// let s = Subject::new("prod", "decode", "kv_events").unwrap();
/// assert_eq!(s.as_str(), "kv.prod.decode.kv_events");
/// assert!(Subject::new("prod", "a.b", "x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject {
    full: String,
}

impl Subject {
    /// Builds and checks a subject.
    ///
    /// # Errors
    /// [`PlaneError::InvalidSubject`] naming `namespace`, `component` or `topic`.
    pub fn new(namespace: &str, component: &str, topic: &str) -> Result<Self, PlaneError> {
        for (field, v) in [
            ("namespace", namespace),
            ("component", component),
            ("topic", topic),
        ] {
            if v.is_empty()
                || v.chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace())
            {
                return Err(PlaneError::InvalidSubject {
                    field,
                    value: v.to_string(),
                });
            }
        }
        Ok(Self {
            full: format!("{SUBJECT_ROOT}.{namespace}.{component}.{topic}"),
        })
    }

    /// The full subject string.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// Parses a full subject string `kv.<namespace>.<component>.<topic>`
    /// (what a worker announcement's `event_subject` carries).
    ///
    /// ```
    /// use kv_router_glue::Subject;
    /// assert_eq!(Subject::parse("kv.prod.d0.kv_events").unwrap().as_str(), "kv.prod.d0.kv_events");
    /// assert!(Subject::parse(">").is_err());
    /// assert!(Subject::parse("kv.prod.*.kv_events").is_err());
    /// ```
    ///
    /// # Errors
    /// [`PlaneError::InvalidSubject`] naming `subject` when it has another
    /// root or shape, or the failing token's field.
    pub fn parse(full: &str) -> Result<Self, PlaneError> {
        let parts: Vec<&str> = full.split('.').collect();
        match parts.as_slice() {
            [root, ns, component, topic] if *root == SUBJECT_ROOT => {
                Self::new(ns, component, topic)
            }
            _ => Err(PlaneError::InvalidSubject {
                field: "subject",
                value: full.to_string(),
            }),
        }
    }

    /// A sibling subject with another topic (same namespace and component).
    ///
    /// # Errors
    /// As [`Subject::new`] for `topic`.
    pub fn with_topic(&self, topic: &str) -> Result<Self, PlaneError> {
        let mut parts = self.full.splitn(4, '.');
        let _root = parts.next();
        let ns = parts.next().unwrap_or_default();
        let comp = parts.next().unwrap_or_default();
        Self::new(ns, comp, topic)
    }

    /// The topic (last token).
    pub fn topic(&self) -> &str {
        self.full.rsplit('.').next().unwrap_or_default()
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.full)
    }
}

/// One delivered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaneMessage {
    /// Subject it was published on.
    pub subject: String,
    /// Payload bytes as published.
    pub payload: Vec<u8>,
}

/// A live subscription; dropping it unsubscribes.
pub struct Subscription {
    subject: String,
    rx: Inbox,
    _guard: Option<AbortOnDrop>,
}

/// Where a subscription's messages wait: unbounded in process (a slow
/// subscriber costs memory, never a lost event), bounded behind NATS
/// (`FORWARD_CAPACITY`): a slow subscriber's overflow is dropped and
/// counted (slow consumer) instead of this side growing without bound.
pub(crate) enum Inbox {
    Unbounded(tokio::sync::mpsc::UnboundedReceiver<PlaneMessage>),
    #[cfg(feature = "nats")]
    Bounded(tokio::sync::mpsc::Receiver<PlaneMessage>),
}

impl Inbox {
    async fn recv(&mut self) -> Option<PlaneMessage> {
        match self {
            Inbox::Unbounded(rx) => rx.recv().await,
            #[cfg(feature = "nats")]
            Inbox::Bounded(rx) => rx.recv().await,
        }
    }

    fn try_recv(&mut self) -> Option<PlaneMessage> {
        match self {
            Inbox::Unbounded(rx) => rx.try_recv().ok(),
            #[cfg(feature = "nats")]
            Inbox::Bounded(rx) => rx.try_recv().ok(),
        }
    }
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("subject", &self.subject)
            .finish()
    }
}

/// Aborts the forwarding task of a subscription when the subscription goes away.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Subscription {
    pub(crate) fn new(subject: String, rx: Inbox, guard: Option<AbortOnDrop>) -> Self {
        Self {
            subject,
            rx,
            _guard: guard,
        }
    }

    /// Subject subscribed to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Next message; `None` once the plane is closed.
    pub async fn next(&mut self) -> Option<PlaneMessage> {
        self.rx.recv().await
    }

    /// The next message if one is already queued, without waiting; `None`
    /// when none is (or the plane is closed: [`Subscription::next`] tells
    /// the two apart).
    pub fn try_next(&mut self) -> Option<PlaneMessage> {
        self.rx.try_recv()
    }

    /// Next message, or `None` when `timeout` passes first or the plane is closed.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Option<PlaneMessage> {
        tokio::time::timeout(timeout, self.rx.recv())
            .await
            .ok()
            .flatten()
    }
}

/// A publish/subscribe transport for bytes on [`Subject`]s.
///
/// Delivery is at-most-once (as core NATS); loss after a disconnect is
/// detected one level up by event ids and repaired by resync
/// ([`crate::KvEventReceiver`]).
pub trait EventPlane: Send + Sync {
    /// Short name for logs (`in_process`, `nats`).
    fn name(&self) -> &'static str;

    /// Publishes `payload` on `subject`.
    fn publish<'a>(&'a self, subject: &'a Subject, payload: Vec<u8>) -> PlaneFuture<'a, ()>;

    /// Subscribes; resolves once the subscription is registered (see the module docs).
    fn subscribe<'a>(&'a self, subject: &'a Subject) -> PlaneFuture<'a, Subscription>;

    /// Resolves with the number of ready subscriptions on `subject` once it is
    /// at least `n`.
    ///
    /// # Errors
    /// [`PlaneError::NotReady`] when `timeout` passes first.
    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a Subject,
        n: usize,
        timeout: Duration,
    ) -> PlaneFuture<'a, usize>;

    /// Whether this process's connection to the transport is up now (a
    /// plane without one, such as the in-process plane, always is). A
    /// follower uses it to tell its own disconnection, during which nothing
    /// published reaches it, from the publishers' silence.
    fn is_connected(&self) -> bool {
        true
    }
}
