//! The worker processes of the local cluster: `kvq child cluster-decode`
//! and `kvq child cluster-prefill`, each the reference model plus the
//! product's agent for its role, over NATS.
//!
//! Arguments: `--nats URL --worker-key KEY --dir DIR --tp N [--gpu]`. The
//! worker binds its control socket `DIR/<key>-<pid>.ctl`, prints one hello
//! line `{"pid","worker_key","engine_id","control"}` and serves the
//! harness's [`Command`]s on the first connection until
//! [`Command::Shutdown`]; end of file on stdin (the lifeline) exits at once.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_bank::{
    sealed_blocks, BankConfig, BankMemory, CudaDeviceMemory, DestinationPool, LeaseConfig,
    StoreStatus,
};
use kv_descriptor::{EngineId, OwnerLease, Role as KvRole, SequenceHash, Wire};
use kv_router_glue::service::{
    AdviseKeys, AdviseReply, AdviseRequest, AdviseResult, ADVISE_SUBJECT,
};
use kv_router_glue::{
    announce_subject, DirectoryPlane, DonorAgent, DonorAgentConfig, EventPlane, FetchExecutor,
    NatsDirectory, NatsOptions, NatsPlane, PinServiceConfig, Subject, TargetAgent,
    WorkerAnnouncement,
};
use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
use kv_transfer::{CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend};
use serde_bytes::ByteBuf;

use super::control::{read_frame, write_frame, AdviseStatus, Command, Reply};
use super::{
    gpu_identities, layout, model_config, required, watch_lifeline, ClusterError, ANNOUNCE_PERIOD,
    BANK_LEASE, DIRECTORY_BUCKET, NAMESPACE, RECORD_TTL,
};
use crate::engines::prompt_hashes;
use crate::model::{argmax, KvCache, ReferenceModel};

/// Which worker this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Decode: generates, retains KV in a donor bank.
    Decode,
    /// Prefill: advises, fetches, computes prompts.
    Prefill,
}

/// Fetch rows per rank of a prefill worker (a prompt of the cluster's
/// conversations has at most a few dozen blocks).
const STAGING_BLOCKS: u32 = 256;
/// Bank budget of a decode worker, in blocks per rank.
const BANK_BLOCKS: u64 = 2048;
/// Longest wait for the router's advise reply.
const ADVISE_TIMEOUT: Duration = Duration::from_millis(500);

/// The KV events subject of decode worker `key`.
pub fn events_subject() -> Result<Subject, ClusterError> {
    Subject::new(NAMESPACE, "decode", "kv_events").map_err(|e| ClusterError::Argument {
        field: "subject",
        reason: e.to_string(),
    })
}

fn step(process: &str, what: &str) -> impl Fn(String) -> ClusterError {
    let process = process.to_string();
    let what = what.to_string();
    move |e| ClusterError::Process {
        process: process.clone(),
        reason: format!("{what}: {e}"),
    }
}

/// Runs a worker process (module docs); returns after a clean shutdown.
///
/// # Errors
/// [`ClusterError::Argument`] for a missing or bad argument;
/// [`ClusterError::Process`] when NATS, the agent or the control socket
/// cannot start.
pub fn main(role: Role, args: &[String]) -> Result<(), ClusterError> {
    let url = required(args, "--nats")?.to_string();
    let key = required(args, "--worker-key")?.to_string();
    let dir = PathBuf::from(required(args, "--dir")?);
    let tp: u32 = required(args, "--tp")?
        .parse()
        .map_err(|e| ClusterError::Argument {
            field: "--tp",
            reason: format!("{e}"),
        })?;
    let gpu = args.iter().any(|a| a == "--gpu");
    watch_lifeline();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| step(&key, "runtime")(e.to_string()))?;
    rt.block_on(serve(role, &url, &key, &dir, tp, gpu))
}

async fn serve(
    role: Role,
    url: &str,
    key: &str,
    dir: &Path,
    tp: u32,
    gpu: bool,
) -> Result<(), ClusterError> {
    let fail = |what: &str| step(key, what);
    // Every connection of this process is made from these options, through
    // kv-router-glue's one NATS connect path: credentials in the URL, TLS or
    // any setting added here apply to each alike; only the name differs.
    let nats = NatsOptions {
        name: key.to_string(),
        ..NatsOptions::default()
    };
    let named = |suffix: &str| NatsOptions {
        name: format!("{key}-{suffix}"),
        ..nats.clone()
    };
    let plane = NatsPlane::connect(url, nats.clone())
        .await
        .map_err(|e| fail("nats")(e.to_string()))?;
    let plane: Arc<dyn EventPlane> = Arc::new(plane);
    let directory: Arc<dyn DirectoryPlane> = Arc::new(
        NatsDirectory::connect_with(url, named("directory"), DIRECTORY_BUCKET, RECORD_TTL * 4)
            .await
            .map_err(|e| fail("directory")(e.to_string()))?,
    );
    let control_path = dir.join(format!("{key}-{}.ctl", std::process::id()));
    let listener =
        UnixListener::bind(&control_path).map_err(|e| fail("control bind")(e.to_string()))?;
    let model =
        Arc::new(ReferenceModel::new(model_config()).map_err(|e| fail("model")(e.to_string()))?);
    let layout = layout(tp)?;
    let ordinals: Option<Vec<u32>> = gpu.then(|| (0..tp).collect());
    let host = format!("cluster-{}", std::process::id());
    let gpus = gpu_identities(tp, &host, ordinals.as_deref());
    // The incarnation is chosen before anything opens, so the hello (and
    // the control connection) come first: the leak baseline below then
    // already holds every fd the harness's connection and NATS use.
    let owner = OwnerLease::fresh(match role {
        Role::Decode => KvRole::Decode,
        Role::Prefill => KvRole::Prefill,
    });
    // Advise is NATS request/reply, which the event plane does not offer:
    // a prefill worker has its own client for it.
    let client = match role {
        Role::Prefill => Some(
            NatsPlane::connect(url, named("advise"))
                .await
                .map_err(|e| fail("advise client")(e.to_string()))?
                .client()
                .clone(),
        ),
        Role::Decode => None,
    };
    println!(
        "{}",
        serde_json::json!({
            "event": "hello",
            "pid": std::process::id(),
            "worker_key": key,
            "engine_id": owner.engine_id,
            "control": control_path,
        })
    );
    let (mut conn, _) = listener
        .accept()
        .map_err(|e| fail("control accept")(e.to_string()))?;
    let _ = std::fs::remove_file(&control_path);
    // On the GPU profile the CUDA driver opens its own fds (about 33 on the
    // lent H200) when a process first makes a context current, and keeps
    // them for the process's life: bind every ordinal's primary context
    // before the baseline, so the leak check sees what the workers open.
    for &ordinal in ordinals.iter().flatten() {
        kv_bank::device_memory_info(ordinal)
            .map_err(|e| fail("cuda context before the leak baseline")(e.to_string()))?;
    }
    let baseline = kv_bank::leaks::snapshot();
    let mut state = match role {
        Role::Decode => {
            let mut bank = BankConfig::new(
                layout,
                owner,
                BANK_BLOCKS * u64::from(tp) * layout.rank_block_bytes() as u64,
            );
            bank.lease = LeaseConfig::background(BANK_LEASE, BANK_LEASE / 6);
            let config = DonorAgentConfig {
                worker_key: key.to_string(),
                bank,
                host_id: host.clone(),
                cuda_ordinals: ordinals.clone(),
                gpus,
                pin_endpoint: format!(
                    "unix:{}",
                    dir.join(format!("{key}-{}.pin", std::process::id()))
                        .display()
                ),
                // Unix socket (mode 0600): no key.
                pin_auth_key: None,
                pin_config: PinServiceConfig::default(),
                namespace: NAMESPACE.into(),
                event_subject: events_subject()?,
                event_ring: 4096,
                record_ttl: RECORD_TTL,
            };
            let agent = Arc::new(
                DonorAgent::open(config, directory.clone(), plane.clone())
                    .await
                    .map_err(|e| fail("donor agent")(e.to_string()))?,
            );
            let ticker = agent.clone();
            let tick = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(ANNOUNCE_PERIOD).await;
                    // A failed tick (NATS down) is retried on the next one.
                    let _ = ticker.tick().await;
                }
            });
            State::Decode {
                agent: Some(agent),
                tick,
                baseline,
            }
        }
        Role::Prefill => {
            let (staging, backend) =
                staging(tp, layout.rank_block_bytes(), gpu).map_err(fail("staging"))?;
            let executor = FetchExecutor::new(
                layout,
                DestinationPool::new(STAGING_BLOCKS),
                staging.clone(),
                STAGING_BLOCKS,
                backend,
            )
            .map_err(|e| fail("executor")(e.to_string()))?;
            let agent = TargetAgent::connect(executor, directory.clone(), ordinals.clone())
                .await
                .map_err(|e| fail("target agent")(e.to_string()))?;
            let engine = owner.engine_id;
            let announcement = WorkerAnnouncement {
                worker_key: key.to_string(),
                engine_id: engine,
                role: KvRole::Prefill,
                layout_fingerprint: layout.fingerprint(),
                tp_size: tp,
                gpus,
                // A prefill worker serves no pins; the field must be non-empty.
                pin_endpoint: "none:".into(),
                event_subject: events_subject()?.as_str().to_string(),
            };
            let bytes = announcement
                .to_wire()
                .map_err(|e| fail("announcement")(e.to_string()))?;
            let subject =
                announce_subject(NAMESPACE).map_err(|e| fail("announce subject")(e.to_string()))?;
            let announcer = plane.clone();
            let tick = tokio::spawn(async move {
                loop {
                    let _ = announcer.publish(&subject, bytes.clone()).await;
                    tokio::time::sleep(ANNOUNCE_PERIOD).await;
                }
            });
            State::Prefill {
                agent: Some(agent),
                staging,
                layout,
                engine,
                client: client.ok_or_else(|| fail("advise client")("not connected".into()))?,
                tick,
                baseline,
            }
        }
    };
    loop {
        let cmd: Option<Command> = read_frame(&mut conn)?;
        let Some(cmd) = cmd else { break };
        let reply = match cmd {
            Command::Shutdown => {
                let leaks = state.close().await;
                write_frame(&mut conn, &Reply::Closed { leaks })?;
                break;
            }
            Command::Prefill {
                request_id,
                prompt,
                hold_if_donor,
            } => state
                .prefill(&model, &request_id, &prompt, hold_if_donor)
                .await
                .unwrap_or_else(Reply::Error),
            Command::Decode {
                prompt,
                parts,
                first_token,
                max_new,
            } => state
                .decode(&model, &prompt, &parts, first_token, max_new as usize)
                .await
                .unwrap_or_else(Reply::Error),
        };
        write_frame(&mut conn, &reply)?;
    }
    drop(conn);
    Ok(())
}

/// Fetch rows of each rank and the copy backend that fills them.
type Staging = (Vec<Arc<dyn BankMemory>>, Arc<dyn CopyBackend>);

fn staging(tp: u32, rbb: usize, gpu: bool) -> Result<Staging, String> {
    let len = STAGING_BLOCKS as usize * rbb;
    if gpu {
        let mem = (0..tp)
            .map(|o| CudaDeviceMemory::new(o, len).map(|m| Arc::new(m) as Arc<dyn BankMemory>))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let backend = CudaCopyBackend::new(CudaMode::Auto).map_err(|e| e.to_string())?;
        Ok((mem, Arc::new(backend)))
    } else {
        let mem = (0..tp)
            .map(|_| HostBuffer::zeroed(len).map(|b| Arc::new(b) as Arc<dyn BankMemory>))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        Ok((mem, Arc::new(HostCopyBackend)))
    }
}

// One value per process: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum State {
    Decode {
        agent: Option<Arc<DonorAgent>>,
        tick: tokio::task::JoinHandle<()>,
        baseline: kv_bank::leaks::LeakSnapshot,
    },
    Prefill {
        agent: Option<TargetAgent>,
        staging: Vec<Arc<dyn BankMemory>>,
        layout: kv_descriptor::KvLayout,
        engine: EngineId,
        client: async_nats::Client,
        tick: tokio::task::JoinHandle<()>,
        baseline: kv_bank::leaks::LeakSnapshot,
    },
}

impl State {
    /// Closes the agent and returns what leaked since it opened.
    async fn close(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        let baseline = match self {
            State::Decode {
                agent,
                tick,
                baseline,
            } => {
                tick.abort();
                if let Some(a) = agent.take() {
                    // The tick task held the other reference; it is aborted.
                    let _ = (&mut *tick).await;
                    match Arc::try_unwrap(a) {
                        Ok(a) => {
                            if let Err(e) = a.close(Duration::from_secs(2)).await {
                                notes.push(format!("close: {e}"));
                            }
                        }
                        Err(_) => notes.push("agent still shared at close".into()),
                    }
                }
                baseline.clone()
            }
            State::Prefill {
                agent,
                staging,
                tick,
                baseline,
                ..
            } => {
                tick.abort();
                let _ = (&mut *tick).await;
                agent.take();
                staging.clear();
                baseline.clone()
            }
        };
        let leaks = kv_bank::leaks::snapshot().leaks_since(&baseline);
        notes.extend(leaks.iter().map(|l| format!("{l:?}")));
        notes
    }

    async fn advise(
        client: &async_nats::Client,
        request_id: &str,
        target: EngineId,
        hashes: &[SequenceHash],
    ) -> (AdviseStatus, Option<kv_descriptor::HintEnvelope>, u64) {
        let req = AdviseRequest {
            request_id: request_id.to_string(),
            target,
            keys: AdviseKeys::SequenceHashes(hashes.to_vec()),
        };
        let payload = match req.to_wire() {
            Ok(p) => p,
            Err(e) => return (AdviseStatus::Unavailable(format!("encode: {e}")), None, 0),
        };
        let t0 = Instant::now();
        let sent = tokio::time::timeout(
            ADVISE_TIMEOUT,
            client.request(ADVISE_SUBJECT, payload.into()),
        )
        .await;
        let us = t0.elapsed().as_micros() as u64;
        let msg = match sent {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return (AdviseStatus::Unavailable(e.to_string()), None, us),
            Err(_) => return (AdviseStatus::Unavailable("timed out".into()), None, us),
        };
        match AdviseReply::from_wire(&msg.payload) {
            Ok(AdviseReply {
                result: AdviseResult::Decided { hint, .. },
                ..
            }) => (
                AdviseStatus::Decided {
                    admitted: hint.is_some(),
                },
                hint,
                us,
            ),
            Ok(AdviseReply {
                result: AdviseResult::Refused(r),
                ..
            }) => (AdviseStatus::Refused(r.to_string()), None, us),
            Err(e) => (AdviseStatus::Unavailable(format!("reply: {e}")), None, us),
        }
    }

    async fn prefill(
        &mut self,
        model: &ReferenceModel,
        request_id: &str,
        prompt: &[u32],
        hold_if_donor: Option<(EngineId, PathBuf)>,
    ) -> Result<Reply, String> {
        let State::Prefill {
            agent: Some(agent),
            staging,
            layout,
            engine,
            client,
            ..
        } = self
        else {
            return Err("not a prefill worker".into());
        };
        if prompt.is_empty() {
            return Err("empty prompt".into());
        }
        let layout = *layout;
        let bs = layout.tokens_per_block() as usize;
        let hashes = prompt_hashes(prompt, bs);
        let (advise, hint, advise_us) = Self::advise(client, request_id, *engine, &hashes).await;
        let mut cache = KvCache::new(layout);
        let mut fallback = None;
        let mut fetched_tokens = 0u64;
        let mut held = false;
        let mut donor = None;
        if let Some(env) = &hint {
            let action = env.fetch_gpu_actions().ok().and_then(|mut a| a.pop());
            donor = action.as_ref().map(|a| a.donor_engine_id);
            let hold = match (&hold_if_donor, &action) {
                (Some((victim, path)), Some(a)) if a.donor_engine_id == *victim => {
                    Some((path.clone(), a.donor_control_endpoint.clone()))
                }
                _ => None,
            };
            held = hold.is_some();
            let control = match action.as_ref() {
                Some(a) => liveness(hold, &a.donor_control_endpoint),
                None => DeliveryControl::new(),
            };
            // The fetch maps, pins and copies synchronously.
            let result = tokio::task::block_in_place(|| agent.fetch(env, &hashes, &control));
            match result {
                Ok(outcome) => {
                    let from = action.as_ref().map_or(0, |a| a.fetch_from as usize);
                    if from != 0 {
                        fallback = Some(format!(
                            "hint fetches from block {from}, this worker holds none"
                        ));
                    } else {
                        let rbb = layout.rank_block_bytes();
                        let mut ok = true;
                        for (j, row) in outcome.target_blocks.iter().enumerate() {
                            let parts = staging
                                .iter()
                                .map(|buf| {
                                    let mut v = vec![0u8; rbb];
                                    buf.read_bytes(*row as usize * rbb, &mut v).map(|_| v)
                                })
                                .collect::<Result<Vec<_>, _>>();
                            match parts
                                .map_err(|e| e.to_string())
                                .and_then(|p| cache.import_blocks(j, &p).map_err(|e| e.to_string()))
                            {
                                Ok(()) => {}
                                Err(e) => {
                                    fallback = Some(format!("import: {e}"));
                                    ok = false;
                                    break;
                                }
                            }
                        }
                        if ok {
                            fetched_tokens = cache.len_tokens() as u64;
                        } else {
                            cache = KvCache::new(layout);
                        }
                    }
                    drop(outcome);
                }
                Err(e) => fallback = Some(e.to_string()),
            }
        }
        let start = cache.len_tokens();
        let logits = model
            .prefill(&mut cache, &prompt[start..])
            .map_err(|e| format!("model: {e}"))?;
        let parts = cache
            .export_blocks(0, cache.sealed_blocks())
            .map_err(|e| format!("export: {e}"))?;
        Ok(Reply::Prefilled {
            first_token: argmax(&logits),
            first_logits: logits,
            parts: parts.into_iter().map(ByteBuf::from).collect(),
            computed_tokens: (prompt.len() - start) as u64,
            fetched_tokens,
            fallback,
            advise,
            advise_us,
            donor,
            held,
        })
    }

    async fn decode(
        &mut self,
        model: &ReferenceModel,
        prompt: &[u32],
        parts: &[ByteBuf],
        first_token: u32,
        max_new: usize,
    ) -> Result<Reply, String> {
        let State::Decode {
            agent: Some(agent), ..
        } = self
        else {
            return Err("not a decode worker".into());
        };
        let layout = agent.bank().config().layout;
        let mut cache = KvCache::new(layout);
        if parts.first().is_some_and(|p| !p.is_empty()) {
            cache
                .import_blocks(0, parts)
                .map_err(|e| format!("import: {e}"))?;
        }
        // The prefill hands over sealed blocks; the tail is recomputed here
        // (token by token, as the prefill computed it: the same bits).
        let held = cache.len_tokens();
        if held < prompt.len() {
            model
                .prefill(&mut cache, &prompt[held..])
                .map_err(|e| format!("tail: {e}"))?;
        }
        let mut out = vec![first_token];
        while out.len() < max_new {
            let logits = model
                .prefill(&mut cache, &out[out.len() - 1..])
                .map_err(|e| format!("decode: {e}"))?;
            out.push(argmax(&logits));
        }
        let bs = layout.tokens_per_block() as usize;
        let computed: Vec<u32> = prompt
            .iter()
            .chain(&out)
            .copied()
            .take(cache.len_tokens())
            .collect();
        let blocks = sealed_blocks(None, &computed, bs);
        let store = agent
            .store(None, &blocks)
            .map_err(|e| format!("store: {e}"))?;
        if !store.is_empty() {
            let index: std::collections::HashMap<SequenceHash, usize> = blocks
                .iter()
                .enumerate()
                .map(|(i, b)| (b.sequence_hash, i))
                .collect();
            let mut status = StoreStatus::Waiting { missing: vec![] };
            for rank in 0..layout.tp_size() {
                for (e, (h, _slot)) in store.entries.iter().enumerate() {
                    let p = cache
                        .export_blocks(index[h], 1)
                        .map_err(|e| format!("export: {e}"))?;
                    agent
                        .bank()
                        .write_pending(store.store_id, rank, e, &p[rank as usize])
                        .map_err(|e| format!("write_pending: {e}"))?;
                }
                // A failed publish (NATS down) leaves the blocks ready in the
                // bank; the router sees a gap and loses them, never a false one.
                match agent.ack(store.store_id, rank).await {
                    Ok(s) => status = s,
                    Err(kv_router_glue::AgentError::Plane(_)) => status = StoreStatus::Ready,
                    Err(e) => return Err(format!("ack: {e}")),
                }
            }
            if status != StoreStatus::Ready {
                return Err(format!(
                    "store {} not ready after every ack",
                    store.store_id
                ));
            }
        }
        Ok(Reply::Decoded { output: out })
    }
}

/// The delivery's liveness probe: the donor's pin socket still accepts a
/// connection (a SIGKILLed donor's socket file remains, but refuses). With
/// `hold`, the first probe first signals `<hold>.in` and waits for
/// `<hold>.go`, so the harness can kill the donor while this fetch holds
/// its pin.
fn liveness(hold: Option<(PathBuf, String)>, endpoint: &str) -> DeliveryControl {
    let socket = endpoint.strip_prefix("unix:").map(PathBuf::from);
    let hold = std::sync::Mutex::new(hold);
    let probe = move || {
        if let Some((path, _)) = hold.lock().ok().and_then(|mut h| h.take()) {
            let _ = std::fs::write(path.with_extension("in"), b"");
            let go = path.with_extension("go");
            let t0 = Instant::now();
            while !go.exists() && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        socket
            .as_ref()
            .is_none_or(|p| UnixStream::connect(p).is_ok())
    };
    DeliveryControl {
        donor_alive: Some(Arc::new(probe)),
        ..DeliveryControl::new()
    }
}
