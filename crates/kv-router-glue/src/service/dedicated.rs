//! [`DedicatedAdviseServer`]: the advise subscription on its own OS thread,
//! with its own NATS connection and a current-thread tokio runtime.
//!
//! Why: on a shared multi-thread runtime one advise request crosses threads
//! several times (the connection task reads the message on one worker, the
//! subscription loop runs on another, the reply goes back to the connection
//! task through its command channel), and each crossing is a wake-up of a
//! parked worker (futex, tens of µs when the worker has gone to sleep). On
//! one thread that owns both the connection task and the loop, a request is
//! read, decided and its reply written without any cross-thread wake-up; the
//! rest of the router (event followers, metrics, the directory) stays on the
//! main runtime and cannot delay an answer. The stage breakdown of
//! `kvq bench advise` shows the difference (`docs/router-service.md`).
//!
//! The connection uses the caller's [`NatsOptions`] (name, credentials,
//! TLS), so it is under the same subject permissions as the router's main
//! connection; refusals, drain and counts are [`AdviseServer`]'s.

use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::serve::{AdviseServer, ServeReport, ServiceError, StageProbe};
use super::{RouterService, ADVISE_SUBJECT};
use crate::metrics::ReuseMetrics;
use crate::{NatsOptions, NatsPlane};

/// What a [`DedicatedAdviseServer`] adds to [`AdviseServer`]'s own settings.
///
/// Written with `..DedicatedOptions::default()` for the fields left as they
/// are (a field added later then keeps its default).
#[derive(Debug, Clone)]
pub struct DedicatedOptions {
    /// Subject to serve on (`AdviseServer::bind_on`); default
    /// [`ADVISE_SUBJECT`]. Routers of different namespaces on one NATS
    /// server need one each (`docs/router-service.md`, "Namespaces").
    pub subject: String,
    /// Records answered requests (`AdviseServer::with_metrics`).
    pub metrics: Option<Arc<ReuseMetrics>>,
    /// Records per-stage timestamps (`AdviseServer::with_stage_probe`).
    pub probe: Option<Arc<StageProbe>>,
    /// Spin window after each answer (`AdviseServer::with_busy_poll`);
    /// zero (the default) never spins.
    pub busy_poll: std::time::Duration,
}

impl Default for DedicatedOptions {
    fn default() -> Self {
        Self {
            subject: ADVISE_SUBJECT.to_string(),
            metrics: None,
            probe: None,
            busy_poll: std::time::Duration::ZERO,
        }
    }
}

/// A running advise server on its own thread (module docs).
///
/// Dropping it without [`DedicatedAdviseServer::stop`] cancels the server
/// and detaches the thread (the drain still runs there).
#[derive(Debug)]
pub struct DedicatedAdviseServer {
    shutdown: CancellationToken,
    client: async_nats::Client,
    done: Option<oneshot::Receiver<Result<ServeReport, ServiceError>>>,
    thread: Option<JoinHandle<()>>,
}

impl DedicatedAdviseServer {
    /// Starts the thread, connects to `url` with `options`, queue-subscribes
    /// to `extra.subject` and returns once the server confirmed the
    /// subscription (as [`AdviseServer::bind_on`]).
    ///
    /// # Errors
    /// [`ServiceError::Thread`] when the thread or its runtime cannot start,
    /// [`ServiceError::Connect`] when the connection fails (bad credentials,
    /// TLS, unreachable server), and [`AdviseServer::bind_on`]'s errors
    /// (naming `extra.subject`).
    pub async fn start(
        url: &str,
        options: NatsOptions,
        service: Arc<RouterService>,
        extra: DedicatedOptions,
    ) -> Result<Self, ServiceError> {
        let (ready_tx, ready_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let url = url.to_string();
        let thread = std::thread::Builder::new()
            .name("kv-advise".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(ServiceError::Thread {
                            reason: e.to_string(),
                        }));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let plane = match NatsPlane::connect(&url, options).await {
                        Ok(p) => p,
                        Err(e) => {
                            let _ = ready_tx.send(Err(ServiceError::Connect {
                                url: crate::redact_url(&url),
                                reason: e.to_string(),
                            }));
                            return;
                        }
                    };
                    let bound =
                        AdviseServer::bind_on(plane.client().clone(), service, &extra.subject)
                            .await;
                    let mut server = match bound {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    if let Some(m) = extra.metrics {
                        server = server.with_metrics(m);
                    }
                    if let Some(p) = extra.probe {
                        server = server.with_stage_probe(p);
                    }
                    server = server.with_busy_poll(extra.busy_poll);
                    if ready_tx.send(Ok(plane.client().clone())).is_err() {
                        return;
                    }
                    let _ = done_tx.send(server.run(stop).await);
                });
            })
            .map_err(|e| ServiceError::Thread {
                reason: e.to_string(),
            })?;
        let client = match ready_rx.await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(ServiceError::Thread {
                    reason: "the advise thread ended before binding".into(),
                });
            }
        };
        Ok(Self {
            shutdown,
            client,
            done: Some(done_rx),
            thread: Some(thread),
        })
    }

    /// True while the advise connection is connected (for a health check;
    /// the client reconnects by itself).
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// The advise connection's client (its state for a health check that
    /// outlives this handle's borrow; publishing on it is not needed).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Cancels the server, waits for its drain (as [`AdviseServer::run`])
    /// and for the thread to end.
    ///
    /// # Errors
    /// [`AdviseServer::run`]'s errors; [`ServiceError::Thread`] when the
    /// thread ended without a report (it panicked).
    pub async fn stop(mut self) -> Result<ServeReport, ServiceError> {
        self.shutdown.cancel();
        let report = match self.done.take() {
            Some(rx) => rx.await.map_err(|_| ServiceError::Thread {
                reason: "the advise thread ended without a report".into(),
            })?,
            None => unreachable!("done is taken only here"),
        };
        if let Some(t) = self.thread.take() {
            // The report is sent as the runtime's last step; joining is
            // short and keeps the connection's end ordered before ours.
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        report
    }
}

impl Drop for DedicatedAdviseServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
