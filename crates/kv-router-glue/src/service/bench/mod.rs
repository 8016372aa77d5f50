//! The advise benchmark's measurement (`kvq bench advise` summarizes and
//! prints it): the same advise request decided in process and through the
//! router service over NATS on loopback, with a large index.
//!
//! Setup: the qualification scenario (a decode donor retaining 48 blocks in
//! a TP2 host bank, a prefill target holding the first 2), plus
//! `retained_blocks` synthetic retained blocks from 64 more decode workers
//! (chains of 128 blocks, applied through `InventoryIndex::apply_events` in
//! batches) so that the lookup runs against an index of that size. Every
//! request asks for the scenario's 48-block prompt on the target, which is
//! admitted with a hint while the measured lookup time leaves the saving
//! above the minimum, so a sample is the full path: bounded lookup, slot
//! resolution, cost model, hint envelope. (On a loaded machine a slow lookup
//! can make the cost model refuse; such a request is still decided and
//! timed, and [`AdviseBenchSamples::admitted`] counts the admitted ones.)
//!
//! Sample sets, one sample per request, in µs:
//! - `in_process_advise_us`: `RouterService::advise` on a decoded request;
//! - `in_process_handle_us`: `RouterService::handle` on the encoded payload
//!   (decode, advise, encode);
//! - `in_process_paced_us`: `RouterService::advise` with the thread asleep
//!   for 100 µs before each request, as the advise server's thread is
//!   between two requests over NATS: the same decision from cold caches and
//!   a core that may have gone idle (the back-to-back `in_process_advise`
//!   loop keeps both warm; the stage table's `decide` is the paced kind);
//! - `nats_round_trip_us`: a caller encodes the request, `request`s it on
//!   `kv_reuse.advise` through a local nats-server to an `AdviseServer` in
//!   the same process, and decodes the reply; five passes (the router's
//!   dedicated advise thread, the former shared runtime, a stage
//!   breakdown, and a blocking caller outside any runtime two ways: the
//!   `nats` submodule).

mod nats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{
    chain_sequence_hash, EngineId, KvEvent, KvEventData, Role, SequenceHash, StorageTier,
    StoredBlock, TokenBlockHash, Wire,
};
use kv_lookup::{WorkerInfo, WorkerKey};
pub use nats::StageSamples;

use super::ServiceError;
use super::{AdviseKeys, AdviseReply, AdviseRequest, AdviseResult, RouterService};
use crate::qualify::nats_server::NatsServer;
use crate::qualify::Scenario;
use crate::ReuseSettings;

/// Synthetic decode workers holding the extra retained blocks.
const FILL_WORKERS: u64 = 64;
/// Blocks per synthetic conversation (one `Stored` event).
const FILL_CHAIN: usize = 128;
/// Events per `apply_events` batch.
const FILL_BATCH: usize = 256;
/// Sleep before each `in_process_paced_us` request: about one NATS round
/// trip, the advise thread's idle time between two requests.
const PACE: Duration = Duration::from_micros(100);

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdviseBenchConfig {
    /// Synthetic retained blocks added to the index.
    pub retained_blocks: usize,
    /// Timed requests per sample set.
    pub requests: usize,
    /// Untimed requests before each set (caches, connection).
    pub warmup: usize,
    /// Busy-poll window of the dedicated advise server after each answer
    /// and of the blocking client while it waits, µs (0: sleep as usual;
    /// `AdviseServer::with_busy_poll`, `AdviseClient::set_busy_poll`).
    pub busy_poll_us: u64,
}

impl Default for AdviseBenchConfig {
    /// 1,000,000 retained blocks, 20,000 requests, 2,000 warm-up, no busy
    /// polling.
    fn default() -> Self {
        Self {
            retained_blocks: 1_000_000,
            requests: 20_000,
            warmup: 2_000,
            busy_poll_us: 0,
        }
    }
}

/// The raw samples of one run (µs per request) and the setup it ran on.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AdviseBenchSamples {
    /// Distinct (sequence hash, worker group) entries in the index
    /// (scenario + synthetic).
    pub index_entries: u64,
    /// Wall time of the synthetic fill, ms.
    pub index_fill_ms: f64,
    /// Blocks each request names.
    pub request_blocks: usize,
    /// Timed requests (all eight sets) admitted with a hint; the rest
    /// were decided without one (module docs).
    pub admitted: u64,
    /// Timed requests, all eight sets.
    pub timed: u64,
    /// `RouterService::advise`, µs.
    pub in_process_advise_us: Vec<f64>,
    /// `RouterService::handle` (decode + advise + encode), µs.
    pub in_process_handle_us: Vec<f64>,
    /// Encode, NATS request/reply on loopback, decode, µs: the router's
    /// serving path ([`crate::service::DedicatedAdviseServer`]) and a caller
    /// on its own current-thread runtime using `Client::request`.
    pub nats_round_trip_us: Vec<f64>,
    /// The same round trip with server and caller on one shared 2-worker
    /// multi-thread runtime (the router's serving path before the dedicated
    /// thread), µs.
    pub nats_shared_runtime_us: Vec<f64>,
    /// Per-stage breakdown of a third round-trip pass (dedicated server,
    /// caller with one reply subscription), µs per stage.
    pub stages: StageSamples,
    /// A caller outside any runtime through [`crate::service::AdviseClient`]
    /// (the `kv_reuse` wheel's `RouterClient`), µs.
    pub nats_blocking_client_us: Vec<f64>,
    /// The same caller through the former `RouterClient` design (a
    /// one-worker multi-thread runtime owning the connection), µs.
    pub nats_handoff_client_us: Vec<f64>,
    /// `RouterService::advise` after a 100 µs sleep each, µs.
    pub in_process_paced_us: Vec<f64>,
}

/// Why the benchmark could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdviseBenchError {
    /// The scenario or the synthetic fill failed.
    #[error("advise bench setup `{what}`: {reason}")]
    Setup {
        /// Step (`scenario`, `fill`, `runtime`).
        what: &'static str,
        /// Why.
        reason: String,
    },
    /// No nats-server could be started (`KV_NATS_SERVER`, `PATH`).
    #[error("advise bench needs a nats-server: {reason}")]
    NatsServer {
        /// The harness's message.
        reason: String,
    },
    /// Connecting or a request failed.
    #[error("advise bench NATS `{what}`: {reason}")]
    Nats {
        /// Step (`connect`, `request`).
        what: &'static str,
        /// Client error.
        reason: String,
    },
    /// The advise subscription failed.
    #[error("advise bench service: {0}")]
    Service(#[from] ServiceError),
    /// A reply was not the expected decision.
    #[error("advise bench: unexpected reply {0}")]
    UnexpectedReply(String),
}

fn setup(what: &'static str) -> impl Fn(String) -> AdviseBenchError {
    move |reason| AdviseBenchError::Setup { what, reason }
}

/// Adds `blocks` synthetic retained blocks of [`FILL_WORKERS`] decode
/// workers to the scenario's index.
fn fill(s: &Scenario, blocks: usize) -> Result<(), AdviseBenchError> {
    let fp = s.layout.fingerprint();
    let engines: Vec<EngineId> = (0..FILL_WORKERS)
        .map(|w| {
            let engine = EngineId(uuid::Uuid::from_u128(0xb0_0000 + u128::from(w)));
            s.index
                .register_worker(
                    WorkerKey(10_000 + w),
                    WorkerInfo {
                        engine,
                        role: Role::Decode,
                        layout_fingerprint: fp,
                        tp_size: 2,
                    },
                )
                .map(|_| engine)
                .map_err(|e| setup("fill")(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let mut next_id = vec![1u64; engines.len()];
    let mut batch = Vec::with_capacity(FILL_BATCH);
    let mut made = 0usize;
    let mut chain = 0u64;
    while made < blocks {
        let w = (chain % FILL_WORKERS) as usize;
        let n = FILL_CHAIN.min(blocks - made);
        let mut prev: Option<SequenceHash> = None;
        let stored: Vec<StoredBlock> = (0..n)
            .map(|i| {
                // Distinct token hashes per (chain, position): no prefix is
                // shared with the scenario's prompt or another chain.
                let token_hash = TokenBlockHash(xxhash_rust::xxh3::xxh3_64(
                    &[chain.to_le_bytes(), (i as u64).to_le_bytes()].concat(),
                ));
                let sequence_hash = chain_sequence_hash(prev, token_hash);
                prev = Some(sequence_hash);
                StoredBlock {
                    sequence_hash,
                    token_hash,
                    slot: Some(i as u32),
                }
            })
            .collect();
        batch.push(KvEvent {
            publisher: engines[w],
            event_id: next_id[w],
            role: Role::Decode,
            layout_fingerprint: fp,
            tp_size: 2,
            tier: StorageTier::RetainedGpuDirect,
            data: KvEventData::Stored {
                parent: None,
                blocks: stored,
            },
        });
        next_id[w] += 1;
        made += n;
        chain += 1;
        if batch.len() == FILL_BATCH || made >= blocks {
            let report = s.index.apply_events(&batch);
            if !(report.refused.is_empty() && report.unchained.is_empty() && report.gaps.is_empty())
            {
                return Err(setup("fill")(format!("{report:?}")));
            }
            batch.clear();
        }
    }
    Ok(())
}

fn request(s: &Scenario, i: usize) -> AdviseRequest {
    AdviseRequest {
        request_id: format!("bench-{i}"),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    }
}

fn admitted(reply: &AdviseReply) -> bool {
    matches!(&reply.result, AdviseResult::Decided { hint: Some(_), .. })
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the benchmark (module docs).
///
/// # Errors
/// [`AdviseBenchError`] naming the step that failed.
pub fn run_advise_bench(cfg: AdviseBenchConfig) -> Result<AdviseBenchSamples, AdviseBenchError> {
    let s = Scenario::new().map_err(setup("scenario"))?;
    let started = Instant::now();
    fill(&s, cfg.retained_blocks)?;
    let index_fill_ms = started.elapsed().as_secs_f64() * 1e3;
    let advisor = s
        .advisor(ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            ..ReuseSettings::default()
        })
        .map_err(setup("scenario"))?;
    let service = Arc::new(RouterService::new(Arc::new(advisor)));
    service.add_target(s.target);

    // The setup must be admissible: some of a few tries admit (one slow
    // lookup alone may be refused by the cost model).
    if !(0..16).any(|i| admitted(&service.advise(&request(&s, i)))) {
        let probe = service.advise(&request(&s, 0));
        return Err(AdviseBenchError::UnexpectedReply(format!("{probe:?}")));
    }
    let mut admitted_n = 0u64;
    let mut in_process_advise_us = Vec::with_capacity(cfg.requests);
    let reqs: Vec<AdviseRequest> = (0..cfg.warmup + cfg.requests)
        .map(|i| request(&s, i))
        .collect();
    for (i, req) in reqs.iter().enumerate() {
        let t = Instant::now();
        let reply = service.advise(req);
        let dt = t.elapsed();
        if i >= cfg.warmup {
            admitted_n += u64::from(admitted(&reply));
            in_process_advise_us.push(micros(dt));
        }
    }
    let mut in_process_paced_us = Vec::with_capacity(cfg.requests);
    for (i, req) in reqs.iter().enumerate() {
        std::thread::sleep(PACE);
        let t = Instant::now();
        let reply = service.advise(req);
        let dt = t.elapsed();
        if i >= cfg.warmup {
            admitted_n += u64::from(admitted(&reply));
            in_process_paced_us.push(micros(dt));
        }
    }
    let payloads: Vec<Vec<u8>> = reqs
        .iter()
        .map(|r| r.to_wire().map_err(|e| setup("scenario")(e.to_string())))
        .collect::<Result<_, _>>()?;
    let mut in_process_handle_us = Vec::with_capacity(cfg.requests);
    for (i, p) in payloads.iter().enumerate() {
        let t = Instant::now();
        let bytes = service.handle(p);
        let dt = t.elapsed();
        if i >= cfg.warmup {
            let reply = AdviseReply::from_wire(&bytes)
                .map_err(|e| AdviseBenchError::UnexpectedReply(e.to_string()))?;
            admitted_n += u64::from(admitted(&reply));
            in_process_handle_us.push(micros(dt));
        }
    }

    let nats = NatsServer::start().map_err(|reason| AdviseBenchError::NatsServer { reason })?;
    let n = nats::run_nats_passes(
        &nats.url(),
        &service,
        &reqs,
        cfg.warmup,
        Duration::from_micros(cfg.busy_poll_us),
    )?;
    Ok(AdviseBenchSamples {
        index_entries: s.index.stats().entries as u64,
        index_fill_ms,
        request_blocks: s.hashes.len(),
        admitted: admitted_n + n.admitted,
        timed: 8 * cfg.requests as u64,
        in_process_advise_us,
        in_process_handle_us,
        nats_round_trip_us: n.round_trip_us,
        nats_shared_runtime_us: n.shared_runtime_us,
        stages: n.stages,
        nats_blocking_client_us: n.blocking_client_us,
        nats_handoff_client_us: n.handoff_client_us,
        in_process_paced_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_fills_the_index_and_admits_on_every_path() {
        if let Err(e) = crate::qualify::nats_server::find_nats_server() {
            if kv_transfer::ci_requires() {
                panic!("advise bench test: {e}, under CI");
            }
            println!("SKIP small_run_fills_the_index_and_admits_on_every_path: {e}");
            return;
        }
        let out = run_advise_bench(AdviseBenchConfig {
            retained_blocks: 10_000,
            requests: 50,
            warmup: 5,
            busy_poll_us: 0,
        })
        .unwrap();
        // Every synthetic block plus the scenario's 48 (donor and target).
        assert!(out.index_entries >= 10_000 + 48, "{}", out.index_entries);
        assert_eq!(out.request_blocks, 48);
        assert_eq!(out.timed, 400);
        // Decided on every path; admitted unless this machine is so loaded
        // that lookups took milliseconds.
        assert!(out.admitted > 0, "{} of {}", out.admitted, out.timed);
        for set in [
            &out.in_process_advise_us,
            &out.in_process_handle_us,
            &out.nats_round_trip_us,
            &out.nats_shared_runtime_us,
            &out.nats_blocking_client_us,
            &out.nats_handoff_client_us,
            &out.in_process_paced_us,
        ] {
            assert_eq!(set.len(), 50);
            assert!(set.iter().all(|v| *v > 0.0 && v.is_finite()));
        }
        // Every stage timed for every request, and the stages add up to
        // the round trip they split (consecutive timestamps, one clock).
        for (name, v) in out.stages.named() {
            assert_eq!(v.len(), 50, "{name}");
            assert!(v.iter().all(|x| *x >= 0.0 && x.is_finite()), "{name}");
        }
        for i in 0..50 {
            let parts: f64 = out.stages.named()[..9].iter().map(|(_, v)| v[i]).sum();
            let total = out.stages.total_us[i];
            assert!((parts - total).abs() < 0.01, "{parts} vs {total}");
            assert!(out.stages.to_server_us[i] > 0.0 && out.stages.to_client_us[i] > 0.0);
        }
    }
}
