//! [`AdviseClient`]: a blocking client of the router service's advise
//! request/reply, for callers outside any async runtime (the `kv_reuse`
//! wheel's `RouterClient`, a prefill worker's scheduler thread).
//!
//! Why not a multi-thread runtime with a worker that owns the connection:
//! there every round trip crosses threads twice (the caller queues the
//! request for the connection task on the worker, the worker hands the reply
//! back to the blocked caller), and each crossing is a futex wake-up of a
//! parked thread. Here the connection lives on a current-thread runtime and
//! the caller drives it itself inside [`AdviseClient::request`]
//! (`Runtime::block_on`): the request is written, the reply read and decoded
//! on the calling thread, with no wake-up of another thread on the client
//! side. `kvq bench advise` measures both (`nats_blocking_client` and
//! `nats_handoff_client`, `docs/router-service.md`).
//!
//! Between calls nobody would drive the connection, so server `PING`s
//! would go unanswered (the server drops a client after two missed ones)
//! and a reconnect would wait for the next call. A keep-alive thread drives
//! the runtime for a few µs every [`KEEPALIVE_INTERVAL`]: it answers
//! `PING`s, runs the client's timers and reconnects. While a call holds the
//! runtime, the keep-alive's turn returns at once without it.
//!
//! Threads: [`AdviseClient::request`] takes `&self`, so several threads may
//! share one client (behind an `Arc`); each drives the runtime in its own
//! `block_on` (a current-thread runtime lets one of them drive the socket
//! while the others' futures are polled when woken), and the muxed inbox
//! routes each reply to its request.
//!
//! Busy polling ([`AdviseClient::set_busy_poll`], off by default): while a
//! reply is outstanding the caller keeps polling the socket for up to the
//! given time instead of sleeping in `epoll_wait`, which saves the wake-up
//! of a parked thread (a C-state exit on an idle core) and keeps the
//! caller's caches warm for decoding the reply. It spends the caller's core
//! for at most that long per request (the caller is blocked anyway); on a
//! host with fewer free cores than spinning threads it makes latency worse
//! (they take the cores nats-server needs).
//!
//! Replies come through async-nats' muxed inbox: one long-lived wildcard
//! subscription per connection and a fresh token per request, so a request
//! costs one `PUB` and no `SUB`/`UNSUB`.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_descriptor::Wire;

use super::wire::{AdviseReply, AdviseRequest};

/// How often the keep-alive thread drives an idle client's connection
/// (module docs). Far below the server's ping interval (2 min by default),
/// and short enough that a reconnect's back-off timers fire on time.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(100);

/// Longest advise subject [`check_advise_subject`] takes, in bytes: far
/// under nats-server's 4 KiB protocol line, which a `PUB` of it with its
/// reply inbox must fit.
pub const MAX_ADVISE_SUBJECT_BYTES: usize = 256;

/// Checks that `subject` is one an advise request can be published to:
/// not empty, at most [`MAX_ADVISE_SUBJECT_BYTES`], no whitespace, no empty token (a leading, trailing or doubled
/// `.`) and no wildcard (`*`, `>`). A wildcard is a subscriber's pattern: a
/// request published there reaches no replica (NATS answers "no
/// responders"), so the client is refused at construction instead of
/// failing every advise later.
///
/// ```
/// use kv_router_glue::service::{check_advise_subject, AdviseClientError};
/// assert!(check_advise_subject("kv_reuse.advise").is_ok());
/// let e = check_advise_subject("kv_reuse.>").unwrap_err();
/// assert!(matches!(e, AdviseClientError::Subject { .. }));
/// assert!(e.to_string().contains("wildcard"), "{e}");
/// assert!(check_advise_subject(&"a".repeat(257)).is_err());
/// ```
///
/// # Errors
/// [`AdviseClientError::Subject`] naming the subject and what is wrong.
pub fn check_advise_subject(subject: &str) -> Result<(), AdviseClientError> {
    let reason = if subject.is_empty() {
        "it is empty"
    } else if subject.len() > MAX_ADVISE_SUBJECT_BYTES {
        // nats-server refuses a protocol line over 4 KiB: the client then
        // reconnected ~20 times a second (trial h44, 7).
        "it is longer than 256 bytes"
    } else if subject.contains(char::is_whitespace) {
        "it contains whitespace"
    } else if subject.contains(['*', '>']) {
        "it contains a wildcard (`*` or `>`), which only a subscriber may use; a request \
         published there reaches no replica"
    } else if subject.split('.').any(str::is_empty) {
        "it has an empty token (a leading, trailing or doubled `.`)"
    } else {
        return Ok(());
    };
    Err(AdviseClientError::Subject {
        subject: subject.into(),
        reason,
    })
}

/// async-nats' words for a failed request: its kind, then its source unless
/// that only repeats the kind (a `NoResponders` error's source is the text
/// "no responders", which its `Display` showed as "no responders: no
/// responders").
fn request_reason(e: &async_nats::RequestError) -> String {
    let kind = e.kind().to_string();
    match std::error::Error::source(e).map(ToString::to_string) {
        Some(source) if source != kind => format!("{kind}: {source}"),
        _ => kind,
    }
}

/// Why an [`AdviseClient`] could not connect or a round trip failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdviseClientError {
    /// `subject` is not one a request can be published to
    /// ([`check_advise_subject`]).
    #[error("subject {subject:?} is not a NATS subject to publish to: {reason}")]
    Subject {
        /// The rejected subject.
        subject: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `timeout` is zero.
    #[error("timeout must be positive")]
    Timeout,
    /// The runtime or the keep-alive thread could not start.
    #[error("nats_url {url}: {what}: {reason}")]
    Start {
        /// NATS URL.
        url: String,
        /// `runtime` or `keepalive thread`.
        what: &'static str,
        /// The OS or runtime error.
        reason: String,
    },
    /// No connection within the timeout.
    #[error("nats_url {url}: no connection within {timeout:?}")]
    ConnectTimeout {
        /// NATS URL.
        url: String,
        /// The connect bound.
        timeout: Duration,
    },
    /// The connection was refused (unreachable, credentials, TLS).
    #[error("nats_url {url}: {reason}")]
    Connect {
        /// NATS URL.
        url: String,
        /// Client error.
        reason: String,
    },
    /// The request was not answered: no responders, connection closed,
    /// oversized payload.
    #[error("advise on {subject}: {reason}")]
    Request {
        /// Advise subject.
        subject: String,
        /// Client error.
        reason: String,
    },
    /// No reply within the timeout.
    #[error("advise on {subject}: no reply within {timeout:?}")]
    NoReply {
        /// Advise subject.
        subject: String,
        /// The per-request bound.
        timeout: Duration,
    },
    /// The request could not be encoded or the reply did not decode.
    #[error("advise {what}: {reason}")]
    Wire {
        /// `request` or `reply`.
        what: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// The reply answers another request.
    #[error("advise reply is for request {got:?}, not {expected:?}")]
    WrongReply {
        /// The request's `request_id`.
        expected: String,
        /// The reply's `request_id`.
        got: String,
    },
    /// [`AdviseClient::close`] ran.
    #[error("the client is closed")]
    Closed,
}

/// A blocking advise client (module docs). One call at a time is in flight
/// per client (calls take `&mut self`); concurrent callers each hold their
/// own client or share one behind a lock.
pub struct AdviseClient {
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    client: Option<async_nats::Client>,
    /// Dropping the sender stops the keep-alive thread.
    keepalive: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    subject: String,
    timeout: Duration,
    busy_poll: Duration,
}

impl std::fmt::Debug for AdviseClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdviseClient")
            .field("subject", &self.subject)
            .field("timeout", &self.timeout)
            .field("busy_poll", &self.busy_poll)
            .field("connected", &self.client.is_some())
            .finish_non_exhaustive()
    }
}

impl AdviseClient {
    /// Connects to `url` (one server or a comma-separated list,
    /// [`crate::nats_server_addrs`]) with `options` (name, credentials, TLS;
    /// build them with [`crate::NatsOptions::connect_options`] for the same
    /// `url`: async-nats ignores credentials written into the URL, and that
    /// method takes them from it;
    /// its request timeout is not used: `timeout` bounds the connection and
    /// each request; with a list, each server is tried for its share of
    /// `timeout`) and starts the keep-alive thread. Advise requests go
    /// to `subject` ([`super::ADVISE_SUBJECT`] for the router service).
    ///
    /// # Errors
    /// [`AdviseClientError::Subject`], [`AdviseClientError::Timeout`] for
    /// bad arguments; [`AdviseClientError::Start`],
    /// [`AdviseClientError::ConnectTimeout`], [`AdviseClientError::Connect`].
    pub fn connect(
        url: &str,
        options: async_nats::ConnectOptions,
        subject: &str,
        timeout: Duration,
    ) -> Result<Self, AdviseClientError> {
        check_advise_subject(subject)?;
        if timeout.is_zero() {
            return Err(AdviseClientError::Timeout);
        }
        let start = |what: &'static str| {
            let url = crate::redact_url(url);
            move |e: std::io::Error| AdviseClientError::Start {
                url,
                what,
                reason: e.to_string(),
            }
        };
        let runtime = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(start("runtime"))?,
        );
        let servers = crate::event_plane::connect_addrs(url).map_err(|reason| {
            AdviseClientError::Connect {
                url: crate::redact_url(url),
                reason,
            }
        })?;
        // async-nats tries the servers one after the other (in random
        // order), each for the connection timeout: with all of `timeout`
        // each, a hung server tried first used up the whole bound before
        // a live one was tried. Each gets its share.
        let share = u32::try_from(servers.len()).unwrap_or(u32::MAX).max(1);
        let options = options
            .connection_timeout(timeout / share)
            .request_timeout(None);
        let client = runtime
            .block_on(async { tokio::time::timeout(timeout, options.connect(servers)).await })
            .map_err(|_| AdviseClientError::ConnectTimeout {
                url: crate::redact_url(url),
                timeout,
            })?
            .map_err(|e| AdviseClientError::Connect {
                url: crate::redact_url(url),
                reason: e.to_string(),
            })?;
        let (stop, stopped) = mpsc::channel::<()>();
        let driven = runtime.clone();
        let thread = std::thread::Builder::new()
            .name("kv-advise-keepalive".into())
            .spawn(move || keepalive(&driven, &stopped))
            .map_err(start("keepalive thread"))?;
        Ok(Self {
            runtime: Some(runtime),
            client: Some(client),
            keepalive: Some((stop, thread)),
            subject: subject.into(),
            timeout,
            busy_poll: Duration::ZERO,
        })
    }

    /// Polls for each reply without sleeping for up to `limit` (then
    /// sleeps until it arrives or the timeout passes); `Duration::ZERO`
    /// (the default) never spins. Module docs for when it pays.
    pub fn set_busy_poll(&mut self, limit: Duration) {
        self.busy_poll = limit;
    }

    /// The subject requests go to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The per-request (and connect) bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// True until [`AdviseClient::close`].
    pub fn is_open(&self) -> bool {
        self.client.is_some()
    }

    /// Connections made so far: 1 after [`AdviseClient::connect`], one more
    /// per reconnect (a health signal; 0 once closed).
    pub fn connection_count(&self) -> u64 {
        self.client.as_ref().map_or(0, |c| {
            c.statistics()
                .connects
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// One round trip: publishes `payload` (an encoded [`AdviseRequest`])
    /// on the subject and returns the reply's payload, driving the
    /// connection on the calling thread until it arrives or the timeout
    /// passes. Must not be called from inside an async runtime (blocks).
    ///
    /// # Errors
    /// [`AdviseClientError::Closed`], [`AdviseClientError::Request`] (no
    /// responders: nothing subscribes to the subject; connection closed;
    /// payload over the server's limit), [`AdviseClientError::NoReply`].
    pub fn request(&self, payload: Vec<u8>) -> Result<Vec<u8>, AdviseClientError> {
        let (Some(runtime), Some(client)) = (&self.runtime, &self.client) else {
            return Err(AdviseClientError::Closed);
        };
        let (subject, timeout, busy_poll) = (&self.subject, self.timeout, self.busy_poll);
        runtime.block_on(async {
            let asked =
                tokio::time::timeout(timeout, client.request(subject.clone(), payload.into()));
            tokio::pin!(asked);
            let spin_until = Instant::now() + busy_poll;
            let outcome = loop {
                // `yield_now` makes the runtime poll its socket without
                // blocking before it polls `asked` again; past the limit the
                // branch is off and the runtime sleeps until the reply.
                tokio::select! {
                    biased;
                    r = &mut asked => break r,
                    _ = tokio::task::yield_now(), if Instant::now() < spin_until => {}
                }
            };
            match outcome {
                // One copy of a few KiB (ns): keeps `bytes` out of the API.
                Ok(Ok(m)) => Ok(m.payload.to_vec()),
                Ok(Err(e)) => Err(AdviseClientError::Request {
                    subject: subject.clone(),
                    reason: request_reason(&e),
                }),
                Err(_) => Err(AdviseClientError::NoReply {
                    subject: subject.clone(),
                    timeout,
                }),
            }
        })
    }

    /// [`AdviseClient::request`] for `request`: encodes it, decodes the
    /// reply and checks that it answers `request.request_id`.
    ///
    /// # Errors
    /// [`AdviseClient::request`]'s, [`AdviseClientError::Wire`],
    /// [`AdviseClientError::WrongReply`].
    pub fn advise(&self, request: &AdviseRequest) -> Result<AdviseReply, AdviseClientError> {
        let payload = request.to_wire().map_err(|e| AdviseClientError::Wire {
            what: "request",
            reason: e.to_string(),
        })?;
        let bytes = self.request(payload)?;
        let reply = AdviseReply::from_wire(&bytes).map_err(|e| AdviseClientError::Wire {
            what: "reply",
            reason: e.to_string(),
        })?;
        if reply.request_id != request.request_id {
            return Err(AdviseClientError::WrongReply {
                expected: request.request_id.clone(),
                got: reply.request_id,
            });
        }
        Ok(reply)
    }

    /// Pushes queued messages to the server, waiting up to `wait`; false
    /// when that did not finish (or the client is closed).
    pub fn flush(&self, wait: Duration) -> bool {
        let (Some(runtime), Some(client)) = (&self.runtime, &self.client) else {
            return false;
        };
        matches!(
            runtime.block_on(async { tokio::time::timeout(wait, client.flush()).await }),
            Ok(Ok(()))
        )
    }

    /// Flushes queued messages (up to 1 s), stops the keep-alive thread and
    /// closes the connection. Idempotent; later requests fail with
    /// [`AdviseClientError::Closed`].
    pub fn close(&mut self) {
        self.flush(Duration::from_secs(1));
        self.shut_down(Duration::from_secs(1));
    }

    /// Stops the keep-alive thread, drops the connection and shuts the
    /// runtime down, waiting up to `wait` for its tasks.
    fn shut_down(&mut self, wait: Duration) {
        if let Some((stop, thread)) = self.keepalive.take() {
            drop(stop);
            // The thread sleeps on the channel; the drop wakes it at once.
            let _ = thread.join();
        }
        drop(self.client.take());
        if let Some(runtime) = self.runtime.take() {
            // The keep-alive thread's clone went with it.
            if let Ok(rt) = Arc::try_unwrap(runtime) {
                rt.shutdown_timeout(wait);
            }
        }
    }
}

impl Drop for AdviseClient {
    fn drop(&mut self) {
        // No flush: a dropped client has nothing a caller waits for.
        self.shut_down(Duration::ZERO);
    }
}

/// The keep-alive thread's loop (module docs): every
/// [`KEEPALIVE_INTERVAL`] until the sender is dropped, one short turn of
/// the runtime. Three `yield_now`s: the first lets the runtime poll its I/O
/// and timers without blocking, the second runs the tasks that woke (the
/// connection task answers a `PING`, writes, reconnects), the third returns
/// once those are idle again. When a call holds the runtime, `block_on`
/// polls these on this thread without it and they return at once.
fn keepalive(runtime: &tokio::runtime::Runtime, stopped: &mpsc::Receiver<()>) {
    while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(KEEPALIVE_INTERVAL) {
        runtime.block_on(async {
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        });
    }
}
