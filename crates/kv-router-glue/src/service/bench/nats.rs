//! The advise benchmark's NATS passes: the round trip through a local
//! nats-server, three ways in one run, and the per-stage breakdown.
//!
//! - `shared_runtime`: what the router did before [`DedicatedAdviseServer`]:
//!   the advise server and the caller on one 2-worker multi-thread runtime,
//!   the caller using `Client::request`.
//! - `round_trip`: the router's serving path ([`DedicatedAdviseServer`],
//!   its own thread and connection) and a caller on its own current-thread
//!   runtime using `Client::request` (per-request inbox on the client's
//!   shared inbox subscription, with a timeout).
//! - `stages`: the same server, a caller publishing with a fixed reply
//!   subject on one dedicated subscription, every stage timestamped on one
//!   monotonic clock (caller and server share the process).
//! - `blocking_client` / `handoff_client`: the same server and a caller
//!   outside any runtime, as a Python prefill worker's `RouterClient` is:
//!   [`AdviseClient`] (the connection driven on the calling thread) against
//!   the former `RouterClient` design (a one-worker multi-thread runtime
//!   owning the connection, the caller blocking on it: two thread
//!   hand-offs per round trip). The two alternate in chunks of
//!   [`CHUNK`] requests so that both see the same machine load.
//!
//! With [`super::AdviseBenchConfig::busy_poll_us`] > 0 the dedicated server
//! busy-polls that long after each answer (every pass but
//! `shared_runtime`) and so does the [`AdviseClient`] while it waits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kv_descriptor::Wire;
use tokio_util::sync::CancellationToken;

use super::{micros, AdviseBenchError};
use crate::service::{
    AdviseClient, AdviseReply, AdviseRequest, AdviseResult, AdviseServer, DedicatedAdviseServer,
    DedicatedOptions, RouterService, ServerStages, StageProbe, ADVISE_SUBJECT,
};
use crate::{NatsOptions, NatsPlane};

/// Requests per turn when two passes alternate.
const CHUNK: usize = 500;

/// Per-stage durations of the `stages` pass, µs per timed request, in
/// request order. The stages add up to [`StageSamples::total_us`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StageSamples {
    /// Caller: MessagePack encode of the request.
    pub encode_request_us: Vec<f64>,
    /// Caller: `publish_with_reply` until the request is queued in the
    /// client's command channel.
    pub queue_request_us: Vec<f64>,
    /// Queued by the caller until the server's loop took it: caller's
    /// connection task, socket, nats-server routing, server's connection
    /// task, subscription channel.
    pub to_server_us: Vec<f64>,
    /// Server: request decode.
    pub decode_us: Vec<f64>,
    /// Server: lookup, slot resolution, cost model, hint.
    pub decide_us: Vec<f64>,
    /// Server: reply encode.
    pub encode_reply_us: Vec<f64>,
    /// Server: `publish` until the reply is queued.
    pub queue_reply_us: Vec<f64>,
    /// Reply queued by the server until the caller's loop took it (the same
    /// hops back).
    pub to_client_us: Vec<f64>,
    /// Caller: reply decode.
    pub decode_reply_us: Vec<f64>,
    /// The whole round trip of this pass.
    pub total_us: Vec<f64>,
}

impl StageSamples {
    /// `(name, samples)` of every stage in path order, then `total`.
    pub fn named(&self) -> [(&'static str, &[f64]); 10] {
        [
            ("encode_request", &self.encode_request_us),
            ("queue_request", &self.queue_request_us),
            ("to_server", &self.to_server_us),
            ("decode", &self.decode_us),
            ("decide", &self.decide_us),
            ("encode_reply", &self.encode_reply_us),
            ("queue_reply", &self.queue_reply_us),
            ("to_client", &self.to_client_us),
            ("decode_reply", &self.decode_reply_us),
            ("total", &self.total_us),
        ]
    }
}

/// The three passes' samples (module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct NatsSamples {
    pub shared_runtime_us: Vec<f64>,
    pub round_trip_us: Vec<f64>,
    pub stages: StageSamples,
    pub blocking_client_us: Vec<f64>,
    pub handoff_client_us: Vec<f64>,
    pub admitted: u64,
}

fn nats_err(what: &'static str) -> impl Fn(String) -> AdviseBenchError {
    move |reason| AdviseBenchError::Nats { what, reason }
}

/// The options every connection of the bench is made with (the dedicated
/// server's and each caller's): one value, applied through
/// [`NatsOptions::connect_options`] as by every other client of the
/// project, so credentials in the URL, TLS or any other setting added here
/// reach all of them alike.
fn bench_options() -> NatsOptions {
    NatsOptions {
        name: "kv-advise-bench".into(),
        ..NatsOptions::default()
    }
}

/// A caller's connection to `url`, made as [`NatsPlane::connect`] makes
/// its own (the plane itself is not needed: only its client).
async fn connect(url: &str, options: &NatsOptions) -> Result<async_nats::Client, AdviseBenchError> {
    NatsPlane::connect(url, options.clone())
        .await
        .map(|plane| plane.client().clone())
        .map_err(|e| nats_err("connect")(e.to_string()))
}

fn check(reply: &AdviseReply, req: &AdviseRequest) -> Result<bool, AdviseBenchError> {
    if reply.request_id != req.request_id {
        return Err(AdviseBenchError::UnexpectedReply(format!(
            "reply for `{}` to `{}`",
            reply.request_id, req.request_id
        )));
    }
    match &reply.result {
        AdviseResult::Refused(r) => Err(AdviseBenchError::UnexpectedReply(format!("refused: {r}"))),
        AdviseResult::Decided { hint, .. } => Ok(hint.is_some()),
    }
}

fn current_thread() -> Result<tokio::runtime::Runtime, AdviseBenchError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| AdviseBenchError::Setup {
            what: "runtime",
            reason: e.to_string(),
        })
}

/// Requests `reqs` one at a time with `Client::request`; the samples of
/// those after `warmup` and how many were admitted.
async fn request_loop(
    caller: &async_nats::Client,
    reqs: &[AdviseRequest],
    warmup: usize,
) -> Result<(Vec<f64>, u64), AdviseBenchError> {
    let mut samples = Vec::with_capacity(reqs.len().saturating_sub(warmup));
    let mut admitted = 0u64;
    for (i, req) in reqs.iter().enumerate() {
        let t = Instant::now();
        let payload = req.to_wire().map_err(|e| AdviseBenchError::Setup {
            what: "scenario",
            reason: e.to_string(),
        })?;
        let m = caller
            .request(ADVISE_SUBJECT, payload.into())
            .await
            .map_err(|e| nats_err("request")(e.to_string()))?;
        let reply = AdviseReply::from_wire(&m.payload)
            .map_err(|e| AdviseBenchError::UnexpectedReply(e.to_string()))?;
        let dt = t.elapsed();
        let hinted = check(&reply, req)?;
        if i >= warmup {
            admitted += u64::from(hinted);
            samples.push(micros(dt));
        }
    }
    Ok((samples, admitted))
}

/// Caller-side timestamps of one request of the `stages` pass.
struct CallerStages {
    start: Instant,
    encoded: Instant,
    queued: Instant,
    received: Instant,
    decoded: Instant,
}

async fn stages_loop(
    caller: &async_nats::Client,
    reqs: &[AdviseRequest],
) -> Result<(Vec<CallerStages>, u64), AdviseBenchError> {
    let inbox = caller.new_inbox();
    let mut replies = caller
        .subscribe(inbox.clone())
        .await
        .map_err(|e| nats_err("subscribe")(e.to_string()))?;
    crate::event_plane::server_round_trip(caller, Duration::from_secs(5))
        .await
        .map_err(nats_err("subscribe"))?;
    let mut out = Vec::with_capacity(reqs.len());
    let mut admitted = 0u64;
    for req in reqs {
        let start = Instant::now();
        let payload = req.to_wire().map_err(|e| AdviseBenchError::Setup {
            what: "scenario",
            reason: e.to_string(),
        })?;
        let encoded = Instant::now();
        caller
            .publish_with_reply(ADVISE_SUBJECT, inbox.clone(), payload.into())
            .await
            .map_err(|e| nats_err("publish")(e.to_string()))?;
        let queued = Instant::now();
        let m = tokio::time::timeout(Duration::from_secs(5), replies.next())
            .await
            .map_err(|_| nats_err("reply")("no reply within 5 s".into()))?
            .ok_or_else(|| nats_err("reply")("reply subscription ended".into()))?;
        let received = Instant::now();
        let reply = AdviseReply::from_wire(&m.payload)
            .map_err(|e| AdviseBenchError::UnexpectedReply(e.to_string()))?;
        let decoded = Instant::now();
        admitted += u64::from(check(&reply, req)?);
        out.push(CallerStages {
            start,
            encoded,
            queued,
            received,
            decoded,
        });
    }
    Ok((out, admitted))
}

/// Joins caller and server timestamps (both in request order: one request
/// in flight at a time) into per-stage µs, skipping the first `warmup`.
fn join_stages(
    caller: &[CallerStages],
    server: &[ServerStages],
    warmup: usize,
) -> Result<StageSamples, AdviseBenchError> {
    if caller.len() != server.len() {
        return Err(AdviseBenchError::UnexpectedReply(format!(
            "{} requests timed by the caller, {} answered by the server",
            caller.len(),
            server.len()
        )));
    }
    let us = |a: Instant, b: Instant| micros(b.saturating_duration_since(a));
    let mut s = StageSamples::default();
    for (c, v) in caller.iter().zip(server).skip(warmup) {
        s.encode_request_us.push(us(c.start, c.encoded));
        s.queue_request_us.push(us(c.encoded, c.queued));
        s.to_server_us.push(us(c.queued, v.received));
        s.decode_us.push(us(v.received, v.decoded));
        s.decide_us.push(us(v.decoded, v.decided));
        s.encode_reply_us.push(us(v.decided, v.encoded));
        s.queue_reply_us.push(us(v.encoded, v.queued));
        s.to_client_us.push(us(v.queued, c.received));
        s.decode_reply_us.push(us(c.received, c.decoded));
        s.total_us.push(us(c.start, c.decoded));
    }
    Ok(s)
}

/// The former `RouterClient` design (module docs): the connection on a
/// one-worker multi-thread runtime, each request blocked on from outside it.
struct HandoffClient {
    runtime: tokio::runtime::Runtime,
    client: async_nats::Client,
}

impl HandoffClient {
    fn connect(url: &str, options: &NatsOptions) -> Result<Self, AdviseBenchError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| AdviseBenchError::Setup {
                what: "runtime",
                reason: e.to_string(),
            })?;
        let client = runtime.block_on(connect(url, options))?;
        Ok(Self { runtime, client })
    }

    fn advise(&self, req: &AdviseRequest) -> Result<AdviseReply, AdviseBenchError> {
        let payload = req.to_wire().map_err(|e| AdviseBenchError::Setup {
            what: "scenario",
            reason: e.to_string(),
        })?;
        let m = self
            .runtime
            .block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(5),
                    self.client.request(ADVISE_SUBJECT, payload.into()),
                )
                .await
            })
            .map_err(|_| nats_err("request")("no reply within 5 s".into()))?
            .map_err(|e| nats_err("request")(e.to_string()))?;
        AdviseReply::from_wire(&m.payload)
            .map_err(|e| AdviseBenchError::UnexpectedReply(e.to_string()))
    }
}

/// The `blocking_client` and `handoff_client` passes, alternating chunks
/// of [`CHUNK`] requests; must run outside any runtime (both block).
fn blocking_passes(
    url: &str,
    options: &NatsOptions,
    reqs: &[AdviseRequest],
    warmup: usize,
    busy_poll: Duration,
    out: &mut NatsSamples,
) -> Result<(), AdviseBenchError> {
    let connect_options = options
        .clone()
        .connect_options(url)
        .map_err(|e| nats_err("connect")(e.to_string()))?;
    let mut blocking =
        AdviseClient::connect(url, connect_options, ADVISE_SUBJECT, Duration::from_secs(5))
            .map_err(|e| nats_err("connect")(e.to_string()))?;
    blocking.set_busy_poll(busy_poll);
    let handoff = HandoffClient::connect(url, options)?;
    for chunk in (0..reqs.len()).collect::<Vec<_>>().chunks(CHUNK) {
        for pass in 0..2 {
            for &i in chunk {
                let req = &reqs[i];
                let t = Instant::now();
                let reply = if pass == 0 {
                    blocking
                        .advise(req)
                        .map_err(|e| nats_err("request")(e.to_string()))?
                } else {
                    handoff.advise(req)?
                };
                let dt = t.elapsed();
                let hinted = check(&reply, req)?;
                if i >= warmup {
                    out.admitted += u64::from(hinted);
                    let set = if pass == 0 {
                        &mut out.blocking_client_us
                    } else {
                        &mut out.handoff_client_us
                    };
                    set.push(micros(dt));
                }
            }
        }
    }
    blocking.close();
    Ok(())
}

/// Runs the NATS passes (module docs) against a nats-server at `url`.
pub(super) fn run_nats_passes(
    url: &str,
    service: &Arc<RouterService>,
    reqs: &[AdviseRequest],
    warmup: usize,
    busy_poll: Duration,
) -> Result<NatsSamples, AdviseBenchError> {
    let options = bench_options();
    let mut out = NatsSamples::default();

    // Before: one shared multi-thread runtime for server and caller.
    let shared = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| AdviseBenchError::Setup {
            what: "runtime",
            reason: e.to_string(),
        })?;
    let (samples, admitted) = shared.block_on(async {
        let server_client = connect(url, &options).await?;
        let caller = connect(url, &options).await?;
        let server = AdviseServer::bind(server_client, service.clone()).await?;
        let shutdown = CancellationToken::new();
        let serving = tokio::spawn(server.run(shutdown.clone()));
        let r = request_loop(&caller, reqs, warmup).await;
        shutdown.cancel();
        let _ = serving.await;
        r
    })?;
    drop(shared);
    out.shared_runtime_us = samples;
    out.admitted += admitted;

    // The router's path: a dedicated advise thread; the caller on its own
    // current-thread runtime (as one prefill worker's client would be).
    let probe = Arc::new(StageProbe::new());
    let rt = current_thread()?;
    let server = rt.block_on(DedicatedAdviseServer::start(
        url,
        options.clone(),
        service.clone(),
        DedicatedOptions {
            metrics: None,
            probe: Some(probe.clone()),
            busy_poll,
            ..DedicatedOptions::default()
        },
    ))?;
    blocking_passes(url, &options, reqs, warmup, busy_poll, &mut out)?;
    probe.take();
    rt.block_on(async {
        let caller = connect(url, &options).await?;
        let (samples, admitted) = request_loop(&caller, reqs, warmup).await?;
        out.round_trip_us = samples;
        out.admitted += admitted;
        probe.take();
        let (caller_stages, admitted) = stages_loop(&caller, reqs).await?;
        out.admitted += admitted;
        let report = server.stop().await?;
        if report.refused != 0 {
            return Err(AdviseBenchError::UnexpectedReply(format!(
                "{} requests refused by the server",
                report.refused
            )));
        }
        out.stages = join_stages(&caller_stages, &probe.take(), warmup)?;
        Ok::<_, AdviseBenchError>(())
    })?;
    Ok(out)
}
