//! The client of the router service: `advise` as NATS request/reply on
//! `kv_reuse.advise` (MessagePack `AdviseRequest` / `AdviseReply`, schema in
//! kv_router_glue::service and docs/wire-formats.md, "Advise"), answered by
//! whichever `kv-reuse-router` replica of the queue group takes it.
//!
//! The round trip is `kv_router_glue::service::AdviseClient`'s: the
//! connection lives on a current-thread runtime that the calling Python
//! thread drives itself while it waits (GIL released), so a request and
//! its reply cross no other thread; a keep-alive thread answers server
//! `PING`s between calls. (The former one-worker multi-thread runtime
//! handed every request to its worker and the reply back: two thread
//! wake-ups per advise, `nats_handoff_client` in `kvq bench advise`.) The
//! first runtime of the process also creates tokio's process-wide signal
//! socket pair (2 fds kept until exit); later clients add none that
//! outlive them.
//!
//! Threads: one client may serve several Python threads (an executor's, as
//! docs/python.md suggests for async code); their advises run concurrently.
//! `conn`'s lock is held for a clone or a take only, never across a round
//! trip or a GIL release: held through `allow_threads` while another thread
//! waited for it holding the GIL, it deadlocked both (helper-22 finding 1).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kv_descriptor::{SequenceHash, Wire};
use kv_router_glue::redact_url;
use kv_router_glue::service::{
    AdviseClient, AdviseClientError, AdviseKeys, AdviseReply, AdviseRequest, AdviseResult,
    ADVISE_SUBJECT,
};

use crate::advice::Advice;
use crate::errors::{bad_argument, descriptor, uint, uints, AdviseRefused, RouterUnavailable};
use crate::layout::engine_id;
use crate::nats_auth::NatsCredentials;
use crate::process_bound::ProcessBound;
use crate::reprs::Repr;

/// A client of the router service over NATS.
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct RouterClient {
    conn: Mutex<Option<Arc<AdviseClient>>>,
    /// The process that connected: a forked child may not advise on the
    /// parent's connection (crate::process_bound).
    home: ProcessBound,
    /// The window given to `AdviseClient::set_busy_poll`, µs.
    busy_poll_us: u64,
    /// `nats_url` with any password or token as `***` (`redact_url`), for
    /// the repr: the raw URL is not kept, so no repr can show its secret.
    shown_url: String,
    subject: String,
    timeout_s: f64,
}

/// Largest `busy_poll_us` (one second): a longer spin would outlast any
/// reply worth waiting for on a spinning core.
const MAX_BUSY_POLL_US: u64 = 1_000_000;

// `RouterClient`'s signature names the subject as a literal (so that
// `inspect.signature` shows it): the same as kv-router-glue's.
const _: () = assert!(str_eq(ADVISE_SUBJECT, "kv_reuse.advise"));

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// `busy_poll_us` as given: an int in 0..=MAX_BUSY_POLL_US µs, or None for 0.
fn busy_poll_us_arg(v: &Bound<'_, PyAny>) -> PyResult<u64> {
    crate::errors::uint_in_or("busy_poll_us", v, 0..=MAX_BUSY_POLL_US, 0)
}

/// The Python exception for a failed connect or round trip: bad arguments
/// name the argument, everything else means no router answered.
fn unavailable(e: AdviseClientError) -> PyErr {
    match e {
        AdviseClientError::Subject { subject, reason } => bad_argument(
            "subject",
            format!("{subject:?} is not a NATS subject to publish to: {reason}"),
        ),
        AdviseClientError::Timeout => bad_argument("timeout_s", "must be positive"),
        other => RouterUnavailable::new_err(other.to_string()),
    }
}

/// Seconds in (0, 3600] as a duration, naming `argument` otherwise.
fn seconds(argument: &str, s: f64) -> PyResult<Duration> {
    if s.is_finite() && s > 0.0 && s <= 3600.0 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(bad_argument(
            argument,
            format!("{s} is not in (0, 3600] seconds"),
        ))
    }
}

#[pymethods]
impl RouterClient {
    /// Connects to the NATS server at `nats_url` (`nats://host:port`).
    /// `timeout_s` bounds the connection and each advise (seconds);
    /// the NATS keywords (`**nats`, keyword only): `user`/`password` or
    /// `token` authenticate (the router's NATS permissions,
    /// docs/security.md), or `creds` (a `.creds` file); `tls_ca` (PEM CA
    /// file) turns TLS on, `tls_cert` + `tls_key` present a client
    /// certificate; `inbox_prefix` replaces `_INBOX` as the prefix of its
    /// reply subjects (`_INBOX_target` with the example permissions).
    /// `busy_poll_us` (keyword only, 0 to 1,000,000 µs, default 0): poll
    /// for each reply without sleeping for up to that long, then sleep
    /// until it arrives, so the calling thread is not parked and woken
    /// while the reply is on its way (`AdviseClient::set_busy_poll`;
    /// docs/router-service.md, "Latency: busy polling": it pays only on a
    /// host with a core to spare for the spin). Releases the GIL while
    /// connecting.
    ///
    /// Raises `RouterUnavailable` when the server cannot be reached,
    /// `BadArgument` naming a bad argument (`nats_url` when it is not a
    /// NATS URL: empty, another scheme, no host; or when it carries
    /// credentials, `nats://user:password@host` or `nats://token@host`,
    /// and keywords give some too, or its servers carry different ones;
    /// `subject` when a request cannot be published to it: empty,
    /// whitespace, an empty token, or a wildcard `*` / `>`, a subscriber's
    /// pattern that no replica answers, so every advise would fail with
    /// "no responders"; `busy_poll_us` outside 0..=1000000).
    #[new]
    #[pyo3(signature = (nats_url, timeout_s = 2.0, subject = "kv_reuse.advise", *, busy_poll_us = 0, **nats))]
    fn new(
        py: Python<'_>,
        nats_url: &str,
        #[pyo3(from_py_with = "crate::errors::seconds")] timeout_s: f64,
        subject: &str,
        #[pyo3(from_py_with = "busy_poll_us_arg")] busy_poll_us: u64,
        nats: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        // A malformed URL is the caller's argument, not an unreachable router.
        crate::nats_runtime::check_nats_url(nats_url)?;
        let timeout = seconds("timeout_s", timeout_s)?;
        let busy_poll = busy_poll_us;
        // Before the credentials are read: a wildcard (`kv_reuse.>`) was
        // taken and every advise then failed with "no responders".
        kv_router_glue::service::check_advise_subject(subject).map_err(unavailable)?;
        // The same mapping as every other connection (NatsOptions'
        // `connect_options`); `AdviseClient::connect` bounds the connection
        // and each advise with `timeout` and turns async-nats' own request
        // timeout off.
        let options = NatsCredentials::from_kwargs(nats)?.connect_options(
            nats_url,
            "kv-reuse-py",
            timeout,
        )?;
        let mut client = py
            .allow_threads(|| AdviseClient::connect(nats_url, options, subject, timeout))
            .map_err(unavailable)?;
        client.set_busy_poll(Duration::from_micros(busy_poll));
        Ok(Self {
            conn: Mutex::new(Some(Arc::new(client))),
            home: ProcessBound::here("RouterClient"),
            busy_poll_us: busy_poll,
            shown_url: redact_url(nats_url),
            subject: subject.to_owned(),
            timeout_s,
        })
    }

    /// The busy-poll window of each advise, µs (0: never spins).
    #[getter]
    fn busy_poll_us(&self) -> u64 {
        self.busy_poll_us
    }

    /// Asks the router service whether request `request_id` (prompt block
    /// hashes `sequence_hashes`, routed to prefill engine `target`) may fetch
    /// instead of recompute: the same `Advice` as `Router.advise`. Releases
    /// the GIL while it waits.
    ///
    /// Raises `AdviseRefused` when the service refused the request (the
    /// message names the field or the cause: unknown target, draining),
    /// `RouterUnavailable` when no replica answered within `timeout_s` (or
    /// none listens), `DescriptorRefused` for a reply that does not decode,
    /// `BadArgument` naming `sequence_hashes[i]` (negative, past u64).
    /// An empty `sequence_hashes` (a prompt of no whole block) is answered
    /// here, without a round trip, with the advice `Router.advise` gives it:
    /// `reason='no_donor'`, the index's `EmptyRequest` detail.
    fn advise(
        &self,
        py: Python<'_>,
        request_id: &str,
        sequence_hashes: &Bound<'_, PyAny>,
        target: &str,
    ) -> PyResult<Advice> {
        let hashes = uints::<u64>("sequence_hashes", sequence_hashes)?;
        let keys = AdviseKeys::SequenceHashes(hashes.into_iter().map(SequenceHash).collect());
        self.ask(py, "advise", request_id, keys, target)
    }

    /// `advise` for a prompt given as token ids: the service hashes its
    /// whole blocks of `tokens_per_block` tokens (the target's block size;
    /// a partial tail block is ignored). Raises as `advise`; `AdviseRefused`
    /// names `tokens_per_block` when it is 0 and `token_ids` when there are
    /// more than the service takes; `BadArgument` names `token_ids[i]` or
    /// `tokens_per_block` when negative or past u32. Token ids that fill no
    /// whole block are answered here as `advise` answers an empty
    /// `sequence_hashes` (`reason='no_donor'`, no round trip).
    fn advise_tokens(
        &self,
        py: Python<'_>,
        request_id: &str,
        token_ids: &Bound<'_, PyAny>,
        tokens_per_block: &Bound<'_, PyAny>,
        target: &str,
    ) -> PyResult<Advice> {
        let token_ids: Vec<u32> = uints("token_ids", token_ids)?;
        let tokens_per_block: u32 = uint("tokens_per_block", tokens_per_block)?;
        let keys = AdviseKeys::Tokens {
            token_ids,
            tokens_per_block,
        };
        self.ask(py, "advise_tokens", request_id, keys, target)
    }

    /// Closes the connection (flushing for up to 1 s). Idempotent.
    /// Advises in flight on other threads finish (each within `timeout_s`)
    /// on the closing connection; the last of them shuts it down. In a
    /// forked child it only lets go of the inherited connection, which stays
    /// the parent's.
    fn close(&self, py: Python<'_>) {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(c) = conn.and_then(|c| self.home.keep_here(c)) {
            py.allow_threads(move || match Arc::try_unwrap(c) {
                Ok(mut c) => c.close(),
                Err(shared) => {
                    shared.flush(Duration::from_secs(1));
                }
            });
        }
    }

    /// True until `close()`; false in a forked child, where `advise` is
    /// refused.
    #[getter]
    fn connected(&self) -> bool {
        self.home.is_home()
            && self
                .conn
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// `<kv_reuse.RouterClient nats_url='nats://user:***@host:4222'
    /// subject='kv_reuse.advise' timeout_s=2.0 busy_poll_us=0
    /// connected=True>`: no password or token (the URL is redacted, the
    /// credential keywords are not kept).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(Repr::object(py, "RouterClient")
            .field("nats_url", self.shown_url.as_str())?
            .field("subject", self.subject.as_str())?
            .field("timeout_s", self.timeout_s)?
            .field("busy_poll_us", self.busy_poll_us)?
            .field("connected", self.connected())?
            .finish())
    }
}

impl RouterClient {
    /// One advise round trip for `keys` (the request/reply of `advise`);
    /// `call` names the Python method in a refusal.
    fn ask(
        &self,
        py: Python<'_>,
        call: &str,
        request_id: &str,
        keys: AdviseKeys,
        target: &str,
    ) -> PyResult<Advice> {
        // Before anything else: in a forked child the connection is the
        // parent's, and `RouterUnavailable` sends the caller to recompute.
        self.home.check(call, RouterUnavailable::new_err)?;
        let request = AdviseRequest {
            request_id: request_id.to_owned(),
            target: engine_id(target, "target")?,
            keys,
        };
        // The service would refuse these too; refusing here names the
        // Python argument and spends no round trip.
        request
            .check()
            .map_err(|e| AdviseRefused::new_err(e.to_string()))?;
        // A prompt of no whole block: the service's advisor would refuse it
        // as the in-process `Router.advise` does; answering here gives the
        // same advice without a round trip (and without a reply about the
        // target, which is beside the point for such a prompt).
        if whole_blocks(&request.keys) == 0 {
            return Advice::empty_prompt(py, request_id);
        }
        let payload = request.to_wire().map_err(descriptor)?;
        let client = self
            .conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| RouterUnavailable::new_err("the client is closed"))?;
        // `client` moves in: after a `close()` on another thread the last
        // reference (and the connection's shutdown) drops here, without the GIL.
        let reply = py
            .allow_threads(move || client.request(payload))
            .map_err(unavailable)?;
        let reply = AdviseReply::from_wire(&reply).map_err(descriptor)?;
        if reply.request_id != request_id {
            return Err(RouterUnavailable::new_err(format!(
                "advise reply is for request {:?}, not {request_id:?}",
                reply.request_id
            )));
        }
        match reply.result {
            AdviseResult::Refused(r) => Err(AdviseRefused::new_err(r.to_string())),
            AdviseResult::Decided { decision, hint } => Advice::new(py, &decision, hint.as_ref()),
        }
    }
}

/// Whole blocks of a request's prompt: the hashes given, or the token ids
/// the service would hash (`tokens_per_block` > 0, checked before).
fn whole_blocks(keys: &AdviseKeys) -> usize {
    match keys {
        AdviseKeys::SequenceHashes(h) => h.len(),
        AdviseKeys::Tokens {
            token_ids,
            tokens_per_block,
        } => token_ids.len() / (*tokens_per_block).max(1) as usize,
    }
}

impl Drop for RouterClient {
    fn drop(&mut self) {
        // `AdviseClient`'s drop stops its keep-alive thread and shuts its
        // runtime down without waiting; it never takes the GIL. In a forked
        // child that thread does not exist: the client is forgotten.
        let conn = self
            .conn
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(conn.and_then(|c| self.home.keep_here(c)));
    }
}
