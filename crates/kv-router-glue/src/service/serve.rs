//! Serving [`RouterService`] on NATS request/reply: [`serve_advise`] and
//! [`AdviseServer`].
//!
//! One queue-group subscription on [`ADVISE_SUBJECT`] (group
//! [`ADVISE_QUEUE_GROUP`]), so each request reaches one replica. Every
//! request with a reply subject gets exactly one reply: the decision, or a
//! typed [`crate::service::AdviseRefusal`] for a malformed, oversized or
//! unknown-target request (the refusal is decided before any lookup, so it
//! changes nothing). A request without a reply subject cannot be answered
//! and is only counted ([`ServeReport::no_reply`]).
//!
//! Shutdown (the [`CancellationToken`] fires): the subscription is drained
//! (`UNSUB`, then every message the server routed to it before processing
//! the `UNSUB` is still delivered), each of those is answered, the requests
//! being decided finish, the replies are flushed, and the counts come back.
//! Other replicas of the queue group take the requests published after the
//! `UNSUB`; with none, the caller's request times out and it recomputes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::router_service::encode_reply;
use super::wire::{AdviseResult, ADVISE_QUEUE_GROUP, ADVISE_SUBJECT};
use super::RouterService;
use crate::event_plane::server_round_trip;
use crate::metrics::ReuseMetrics;

/// Requests decided at once by one server; the next request waits for one
/// of them to finish (an advise is a bounded lookup of a few µs, so this
/// only caps memory under a burst).
pub const MAX_IN_FLIGHT: usize = 256;

/// Longest wait for the server's confirmation of the subscription, for the
/// drained messages at shutdown, and for the final flush.
const SERVER_WAIT: Duration = Duration::from_secs(5);

/// Why the advise server could not start or stopped with an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// The `SUB` could not be sent (connection closed).
    #[error("cannot subscribe to `{subject}` (queue group `{queue_group}`): {reason}")]
    Subscribe {
        /// Subject ([`ADVISE_SUBJECT`]).
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
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    decided: AtomicU64,
    refused: AtomicU64,
    no_reply: AtomicU64,
    reply_errors: AtomicU64,
    after_shutdown: AtomicU64,
}

impl Counters {
    fn report(&self) -> ServeReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServeReport {
            received: get(&self.received),
            decided: get(&self.decided),
            refused: get(&self.refused),
            no_reply: get(&self.no_reply),
            reply_errors: get(&self.reply_errors),
            after_shutdown: get(&self.after_shutdown),
        }
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
    subscriber: async_nats::Subscriber,
}

impl std::fmt::Debug for AdviseServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdviseServer")
            .field("service", &self.service)
            .field("metrics", &self.metrics.is_some())
            .finish_non_exhaustive()
    }
}

impl AdviseServer {
    /// Queue-subscribes to [`ADVISE_SUBJECT`] in [`ADVISE_QUEUE_GROUP`] and
    /// waits until the server has processed the `SUB` (a request sent after
    /// this returns reaches this replica or another of the group).
    ///
    /// # Errors
    /// [`ServiceError::Subscribe`], [`ServiceError::NotConfirmed`].
    pub async fn bind(
        client: async_nats::Client,
        service: Arc<RouterService>,
    ) -> Result<Self, ServiceError> {
        let subscriber = client
            .queue_subscribe(ADVISE_SUBJECT, ADVISE_QUEUE_GROUP.to_string())
            .await
            .map_err(|e| ServiceError::Subscribe {
                subject: ADVISE_SUBJECT.into(),
                queue_group: ADVISE_QUEUE_GROUP.into(),
                reason: e.to_string(),
            })?;
        server_round_trip(&client, SERVER_WAIT)
            .await
            .map_err(|reason| ServiceError::NotConfirmed {
                subject: ADVISE_SUBJECT.into(),
                reason,
            })?;
        Ok(Self {
            client,
            service,
            metrics: None,
            subscriber,
        })
    }

    /// Records every answered request in `metrics`
    /// (`kv_reuse_advise_requests_total`, `kv_reuse_advise_latency_seconds`,
    /// and `kv_reuse_decisions_total` for decided ones).
    pub fn with_metrics(mut self, metrics: Arc<ReuseMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Answers requests until `shutdown` fires, then drains (module docs).
    ///
    /// # Errors
    /// [`ServiceError::SubscriptionClosed`] when the subscription ends
    /// without a shutdown (the client was closed); [`ServiceError::Drain`]
    /// when the `UNSUB` cannot be sent at shutdown. Requests already taken
    /// are answered (or counted in `reply_errors`) in both cases.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<ServeReport, ServiceError> {
        let counters = Arc::new(Counters::default());
        let mut tasks: JoinSet<()> = JoinSet::new();
        let mut ended: Option<ServiceError> = None;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                // Reap finished requests so the set stays bounded.
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                m = self.subscriber.next(), if tasks.len() < MAX_IN_FLIGHT => match m {
                    Some(m) => self.dispatch(m, &counters, &mut tasks, false),
                    None => {
                        ended = Some(ServiceError::SubscriptionClosed { subject: ADVISE_SUBJECT.into() });
                        break;
                    }
                },
            }
        }
        if ended.is_none() {
            if let Err(e) = self.subscriber.drain().await {
                ended = Some(ServiceError::Drain {
                    subject: ADVISE_SUBJECT.into(),
                    reason: e.to_string(),
                });
            } else {
                // The stream ends once the server answered the PING after
                // the UNSUB: everything routed here before it is delivered.
                let deadline = tokio::time::Instant::now() + SERVER_WAIT;
                while let Ok(Some(m)) =
                    tokio::time::timeout_at(deadline, self.subscriber.next()).await
                {
                    self.dispatch(m, &counters, &mut tasks, true);
                }
            }
        }
        while tasks.join_next().await.is_some() {}
        // Replies are queued in the client; push them to the server before
        // the caller closes the connection (a lost reply makes a caller time out).
        let _ = tokio::time::timeout(SERVER_WAIT, self.client.flush()).await;
        match ended {
            Some(e) => Err(e),
            None => Ok(counters.report()),
        }
    }

    fn dispatch(
        &self,
        m: async_nats::Message,
        counters: &Arc<Counters>,
        tasks: &mut JoinSet<()>,
        after_shutdown: bool,
    ) {
        counters.received.fetch_add(1, Ordering::Relaxed);
        if after_shutdown {
            counters.after_shutdown.fetch_add(1, Ordering::Relaxed);
        }
        let Some(reply_to) = m.reply else {
            counters.no_reply.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("advise request without a reply subject dropped");
            return;
        };
        let (service, client, metrics, counters) = (
            self.service.clone(),
            self.client.clone(),
            self.metrics.clone(),
            counters.clone(),
        );
        tasks.spawn(async move {
            let started = Instant::now();
            let reply = service.handle_reply(&m.payload);
            let bytes = encode_reply(&reply);
            let outcome = match &reply.result {
                AdviseResult::Decided { decision, .. } => {
                    counters.decided.fetch_add(1, Ordering::Relaxed);
                    if let Some(metrics) = &metrics {
                        metrics.record_decision(decision);
                    }
                    "decided"
                }
                AdviseResult::Refused(r) => {
                    counters.refused.fetch_add(1, Ordering::Relaxed);
                    r.label()
                }
            };
            if let Some(metrics) = &metrics {
                metrics.record_advise(outcome, started.elapsed());
            }
            if let Err(e) = client.publish(reply_to, bytes.into()).await {
                counters.reply_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "advise reply not queued");
            }
        });
    }
}
