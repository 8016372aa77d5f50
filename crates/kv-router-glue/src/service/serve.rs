//! Serving [`RouterService`] on NATS request/reply: [`serve_advise`] and
//! [`AdviseServer`].
//!
//! One queue-group subscription on the advise subject ([`ADVISE_SUBJECT`]
//! unless [`AdviseServer::bind_on`] names another; group
//! [`ADVISE_QUEUE_GROUP`]), so each request reaches one replica of those
//! serving that subject. Every
//! request with a reply subject gets exactly one reply: the decision, or a
//! typed [`crate::service::AdviseRefusal`] for a malformed, oversized or
//! unknown-target request (the refusal is decided before any lookup, so it
//! changes nothing). A request without a reply subject cannot be answered
//! and is only counted ([`ServeReport::no_reply`]).
//!
//! Shutdown (the [`CancellationToken`] fires): the subscription is drained
//! (`UNSUB`, then every message the server routed to it before processing
//! the `UNSUB` is still delivered), each of those is answered, the requests
//! one being decided finishes, the replies are flushed, and the counts come back.
//! Other replicas of the queue group take the requests published after the
//! `UNSUB`; with none, the caller's request times out and it recomputes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::router_service::encode_reply;
use super::wire::{AdviseRequest, AdviseResult, ADVISE_QUEUE_GROUP, ADVISE_SUBJECT};
use super::RouterService;
use crate::event_plane::server_round_trip;
use crate::metrics::ReuseMetrics;

/// Longest wait for the server's confirmation of the subscription, for the
/// drained messages at shutdown, and for the final flush.
const SERVER_WAIT: Duration = Duration::from_secs(5);

/// The same two drain waits when the connection is already down as the
/// shutdown begins: the `UNSUB` and the queued replies can only leave on a
/// reconnect, which this grace still lets complete the drain, while a stop
/// with NATS gone no longer takes 10 s (helper-20 finding 15).
const DISCONNECTED_WAIT: Duration = Duration::from_secs(1);

/// Why the advise server could not start or stopped with an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// The `SUB` could not be sent (connection closed).
    #[error("cannot subscribe to `{subject}` (queue group `{queue_group}`): {reason}")]
    Subscribe {
        /// Subject ([`ADVISE_SUBJECT`] or [`AdviseServer::bind_on`]'s).
        subject: String,
        /// Queue group ([`ADVISE_QUEUE_GROUP`]).
        queue_group: String,
        /// Client error.
        reason: String,
    },
    /// The server did not confirm the subscription within 5 s.
    #[error("nats-server did not confirm the `{subject}` subscription: {reason}")]
    NotConfirmed {
        /// Subject subscribed to.
        subject: String,
        /// Round-trip error.
        reason: String,
    },
    /// The subscription ended without a shutdown (the client was closed).
    #[error("the `{subject}` subscription ended without a shutdown (client closed)")]
    SubscriptionClosed {
        /// Subject subscribed to.
        subject: String,
    },
    /// The dedicated advise thread or its runtime could not start, or it
    /// ended without a result ([`crate::service::DedicatedAdviseServer`]).
    #[error("advise thread: {reason}")]
    Thread {
        /// The OS or runtime error.
        reason: String,
    },
    /// The dedicated advise connection to `url` failed (unreachable,
    /// credentials or TLS refused).
    #[error("advise connection to `{url}`: {reason}")]
    Connect {
        /// NATS URL.
        url: String,
        /// The plane's message.
        reason: String,
    },
    /// The drain (`UNSUB`) at shutdown could not be sent.
    #[error("cannot drain the `{subject}` subscription: {reason}")]
    Drain {
        /// Subject subscribed to.
        subject: String,
        /// Client error.
        reason: String,
    },
}

/// What one [`AdviseServer::run`] did, counted from its start.
///
/// `received = decided + refused + no_reply` once the run returned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServeReport {
    /// Messages received on the advise subject.
    pub received: u64,
    /// Answered with a decision (the advisor ran).
    pub decided: u64,
    /// Answered with a refusal (malformed, oversized, empty, unknown target,
    /// draining).
    pub refused: u64,
    /// Requests without a reply subject (nothing to answer).
    pub no_reply: u64,
    /// Replies the client refused to queue (connection closed).
    pub reply_errors: u64,
    /// Of the received, those that arrived after the shutdown began (routed
    /// before the server processed the `UNSUB`), all answered.
    pub after_shutdown: u64,
    /// The drain reached the server: it answered the round trip after the
    /// `UNSUB` (so every request routed here before it was taken) and the
    /// replies were flushed, each within 5 s (1 s when the connection was
    /// already down at shutdown, in case it comes back). `false` when the
    /// connection was down at shutdown (requests the server routed here may
    /// have gone unanswered: their callers time out and recompute) or the
    /// subscription had already ended.
    pub drain_confirmed: bool,
}

/// When the advise server passed each stage of one request (monotonic
/// clock of this process; the benchmark compares them with its caller's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerStages {
    /// The subscription loop took the message.
    pub received: Instant,
    /// The MessagePack request was decoded (or refused as malformed).
    pub decoded: Instant,
    /// Lookup, slot resolution and cost model decided (or refused).
    pub decided: Instant,
    /// The reply was encoded.
    pub encoded: Instant,
    /// The reply was queued in the client's command channel.
    pub queued: Instant,
}

/// Collects [`ServerStages`] of every answered request, in answer order
/// ([`AdviseServer::with_stage_probe`]). Unbounded: for benchmarks only.
#[derive(Debug, Default)]
pub struct StageProbe {
    stages: parking_lot::Mutex<Vec<ServerStages>>,
}

impl StageProbe {
    /// An empty probe.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&self, s: ServerStages) {
        self.stages.lock().push(s);
    }

    /// Takes the stages recorded so far (the probe is empty afterwards).
    pub fn take(&self) -> Vec<ServerStages> {
        std::mem::take(&mut *self.stages.lock())
    }
}

/// Serves advise requests for `service` on `client` until `shutdown` fires;
/// [`AdviseServer::bind`] then [`AdviseServer::run`].
///
/// # Errors
/// As [`AdviseServer::bind`] and [`AdviseServer::run`].
pub async fn serve_advise(
    client: async_nats::Client,
    service: Arc<RouterService>,
    shutdown: CancellationToken,
) -> Result<ServeReport, ServiceError> {
    AdviseServer::bind(client, service)
        .await?
        .run(shutdown)
        .await
}

/// An advise subscription the server has confirmed, not yet served.
///
/// Split from [`AdviseServer::run`] so that a process can announce that it
/// is serving (the binary's `ready` line) only once requests reach it.
pub struct AdviseServer {
    client: async_nats::Client,
    service: Arc<RouterService>,
    metrics: Option<Arc<ReuseMetrics>>,
    probe: Option<Arc<StageProbe>>,
    busy_poll: Duration,
    subject: String,
    subscriber: async_nats::Subscriber,
}

impl std::fmt::Debug for AdviseServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdviseServer")
            .field("subject", &self.subject)
            .field("service", &self.service)
            .field("metrics", &self.metrics.is_some())
            .finish_non_exhaustive()
    }
}

impl AdviseServer {
    /// Queue-subscribes to [`ADVISE_SUBJECT`] in [`ADVISE_QUEUE_GROUP`] and
    /// waits until the server has processed the `SUB` (a request sent after
    /// this returns reaches this replica or another of the group);
    /// [`AdviseServer::bind_on`] with [`ADVISE_SUBJECT`].
    ///
    /// # Errors
    /// [`ServiceError::Subscribe`], [`ServiceError::NotConfirmed`].
    pub async fn bind(
        client: async_nats::Client,
        service: Arc<RouterService>,
    ) -> Result<Self, ServiceError> {
        Self::bind_on(client, service, ADVISE_SUBJECT).await
    }

    /// Queue-subscribes to `subject` in [`ADVISE_QUEUE_GROUP`] and waits
    /// until the server has processed the `SUB`. Routers serving different
    /// namespaces on one NATS server need a subject each: the replicas of
    /// one subject share its requests, whatever namespace each follows
    /// (`docs/router-service.md`, "Namespaces"). Its callers publish to the
    /// same subject ([`super::AdviseClient::connect`]'s `subject`).
    ///
    /// # Errors
    /// [`ServiceError::Subscribe`] (also for a `subject` that
    /// [`super::check_advise_subject`] refuses: empty, whitespace, an empty
    /// token or a wildcard), [`ServiceError::NotConfirmed`].
    pub async fn bind_on(
        client: async_nats::Client,
        service: Arc<RouterService>,
        subject: &str,
    ) -> Result<Self, ServiceError> {
        let refused = |reason: String| ServiceError::Subscribe {
            subject: subject.into(),
            queue_group: ADVISE_QUEUE_GROUP.into(),
            reason,
        };
        super::check_advise_subject(subject).map_err(|e| refused(e.to_string()))?;
        let subscriber = client
            .queue_subscribe(subject.to_string(), ADVISE_QUEUE_GROUP.to_string())
            .await
            .map_err(|e| refused(e.to_string()))?;
        server_round_trip(&client, SERVER_WAIT)
            .await
            .map_err(|reason| ServiceError::NotConfirmed {
                subject: subject.into(),
                reason,
            })?;
        Ok(Self {
            client,
            service,
            metrics: None,
            probe: None,
            busy_poll: Duration::ZERO,
            subject: subject.into(),
            subscriber,
        })
    }

    /// The subject this server answers on.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Records every answered request in `metrics`
    /// (`kv_reuse_advise_requests_total`, `kv_reuse_advise_latency_seconds`,
    /// and `kv_reuse_decisions_total` for decided ones).
    pub fn with_metrics(mut self, metrics: Arc<ReuseMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Records the stage timestamps of every answered request in `probe`
    /// (the advise benchmark's per-stage breakdown).
    pub fn with_stage_probe(mut self, probe: Arc<StageProbe>) -> Self {
        self.probe = Some(probe);
        self
    }

    /// After each answer, keeps polling for the next request without
    /// sleeping for up to `window` (then sleeps until one arrives);
    /// `Duration::ZERO` (the default) never spins. While requests come
    /// closer than `window` apart the loop never parks, so a request costs
    /// no wake-up of this thread and finds its caches warm; each request
    /// spends at most `window` of one core. Worth it only with cores to
    /// spare (`docs/router-service.md`).
    pub fn with_busy_poll(mut self, window: Duration) -> Self {
        self.busy_poll = window;
        self
    }

    /// Answers requests until `shutdown` fires, then drains (module docs).
    ///
    /// Each request is decided and its reply queued inline on the
    /// subscription loop, in arrival order: a decision is a bounded lookup of
    /// a few µs, while handing it to a spawned task cost a cross-thread
    /// wake-up per request (about 10x the decision on a loaded host). One
    /// replica therefore decides one request at a time; more throughput
    /// comes from more replicas in the queue group.
    ///
    /// # Errors
    /// [`ServiceError::SubscriptionClosed`] when the subscription ends
    /// without a shutdown (the client was closed); [`ServiceError::Drain`]
    /// when the `UNSUB` cannot be sent at shutdown. Requests already taken
    /// are answered (or counted in `reply_errors`) in both cases.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<ServeReport, ServiceError> {
        let mut counters = ServeReport::default();
        let mut ended: Option<ServiceError> = None;
        // Busy polling (`with_busy_poll`): spin until this instant.
        let mut hot_until = Instant::now();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                m = self.subscriber.next() => match m {
                    Some(m) => {
                        self.answer(m, &mut counters, false).await;
                        if !self.busy_poll.is_zero() {
                            hot_until = Instant::now() + self.busy_poll;
                        }
                    }
                    None => {
                        ended = Some(ServiceError::SubscriptionClosed { subject: self.subject.clone() });
                        break;
                    }
                },
                // Makes the runtime poll the socket without blocking, then
                // loops; `next()` is re-created, which loses no message.
                _ = tokio::task::yield_now(), if Instant::now() < hot_until => {}
            }
        }
        let mut unsubscribed = false;
        let wait = if self.client.connection_state() == async_nats::connection::State::Connected {
            SERVER_WAIT
        } else {
            DISCONNECTED_WAIT
        };
        if ended.is_none() {
            if let Err(e) = self.subscriber.drain().await {
                ended = Some(ServiceError::Drain {
                    subject: self.subject.clone(),
                    reason: e.to_string(),
                });
            } else {
                // The stream ends once the server answered the PING after
                // the UNSUB: everything routed here before it is delivered.
                let deadline = tokio::time::Instant::now() + wait;
                loop {
                    match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                        Ok(Some(m)) => self.answer(m, &mut counters, true).await,
                        Ok(None) => {
                            unsubscribed = true;
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
        }
        // Replies are queued in the client; push them to the server before
        // the caller closes the connection (a lost reply makes a caller time out).
        let flushed = matches!(
            tokio::time::timeout(wait, self.client.flush()).await,
            Ok(Ok(()))
        );
        counters.drain_confirmed = unsubscribed && flushed;
        match ended {
            Some(e) => Err(e),
            None => Ok(counters),
        }
    }

    /// Decides one request and queues its reply (or counts why not).
    async fn answer(
        &self,
        m: async_nats::Message,
        counters: &mut ServeReport,
        after_shutdown: bool,
    ) {
        counters.received += 1;
        if after_shutdown {
            counters.after_shutdown += 1;
        }
        let Some(reply_to) = m.reply else {
            counters.no_reply += 1;
            tracing::debug!("advise request without a reply subject dropped");
            return;
        };
        let received = Instant::now();
        let decoded = AdviseRequest::decode(&m.payload);
        let decoded_at = Instant::now();
        let reply = self.service.reply_for(decoded);
        let decided_at = Instant::now();
        let bytes = encode_reply(&reply);
        let encoded_at = Instant::now();
        let outcome = match &reply.result {
            AdviseResult::Decided { decision, .. } => {
                counters.decided += 1;
                if let Some(metrics) = &self.metrics {
                    metrics.record_decision(decision);
                }
                "decided"
            }
            AdviseResult::Refused(r) => {
                counters.refused += 1;
                r.label()
            }
        };
        if let Some(metrics) = &self.metrics {
            metrics.record_advise(outcome, received.elapsed());
        }
        // Queues the reply in the client's command channel; the connection
        // task writes it without waiting for more (no extra flush needed).
        if let Err(e) = self.client.publish(reply_to, bytes.into()).await {
            counters.reply_errors += 1;
            tracing::warn!(error = %e, "advise reply not queued");
        }
        if let Some(probe) = &self.probe {
            probe.push(ServerStages {
                received,
                decoded: decoded_at,
                decided: decided_at,
                encoded: encoded_at,
                queued: Instant::now(),
            });
        }
    }
}
