//! The harness of the local cluster: starts the processes, plays the
//! frontend (picks a prefill and a decode worker per request, hands the
//! prefilled blocks to the decode), computes OFF itself, injects the faults
//! and counts (module docs of [`super`]).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::time::{Duration, Instant};

use kv_bank::child_process::{ChildProcess, ChildStderr, ChildStdin};
use kv_descriptor::EngineId;
use kv_router_glue::nats_server::{find_nats_server, NatsServer};
use serde::{Deserialize, Serialize};

use super::control::{read_frame, write_frame, AdviseStatus, Command, Reply};
use super::{
    layout, model_config, ClusterError, ClusterReport, Recovery, BANK_LEASE, DECODE_ROLE,
    PREFILL_ROLE, ROUTER_ROLE,
};
use crate::faults::ChildCommand;
use crate::model::{argmax, KvCache, ReferenceModel};

/// Shape of one cluster run. Lengths in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterOptions {
    /// Fresh conversations per phase (5 phases: healthy, then one after
    /// each fault).
    pub conversations_per_phase: u32,
    /// Turns of each conversation within its phase.
    pub turns: u32,
    /// First prompt of a conversation.
    pub first_prompt_tokens: u32,
    /// User tokens appended per later turn (after the previous output).
    pub new_tokens_per_turn: u32,
    /// Output tokens per request.
    pub output_tokens: u32,
    /// TP size of every worker.
    pub tp: u32,
    /// CUDA device banks and fetch rows (CUDA IPC); `false`: host shm.
    pub gpu: bool,
    /// Seed of the prompt tokens.
    pub seed: u64,
}

impl Default for ClusterOptions {
    /// 10 conversations x 4 turns per phase (200 phase requests and 40
    /// post-fault turns), 48-token first prompts, 16 new and 8 output
    /// tokens per turn, TP2 on host shm.
    fn default() -> Self {
        Self {
            conversations_per_phase: 10,
            turns: 4,
            first_prompt_tokens: 48,
            new_tokens_per_turn: 16,
            output_tokens: 8,
            tp: 2,
            gpu: false,
            seed: 18,
        }
    }
}

#[derive(Debug, Deserialize)]
struct Hello {
    pid: u32,
    engine_id: EngineId,
    control: PathBuf,
}

#[derive(Debug, Deserialize)]
struct Ready {
    event: String,
}

struct Worker {
    key: String,
    child: ChildProcess,
    control: UnixStream,
    engine: EngineId,
}

impl Worker {
    fn call(&mut self, cmd: &Command) -> Result<Reply, ClusterError> {
        write_frame(&mut self.control, cmd)?;
        match read_frame::<Reply>(&mut self.control)? {
            Some(Reply::Error(e)) => Err(ClusterError::Worker {
                worker: self.key.clone(),
                reason: e,
            }),
            Some(r) => Ok(r),
            None => Err(ClusterError::Worker {
                worker: self.key.clone(),
                reason: format!("closed its control socket ({})", self.child.stderr_tail()),
            }),
        }
    }
}

struct Conversation {
    id: u32,
    prompt: Vec<u32>,
    turn: u32,
}

/// Counters of one span of requests (a phase, or what followed a fault).
#[derive(Debug, Default, Clone, Copy)]
struct Span {
    requests: u64,
    fetches: u64,
    fallbacks: u64,
}

struct Cluster<'a> {
    opts: ClusterOptions,
    exe: &'a ChildCommand,
    dir: PathBuf,
    nats: NatsServer,
    router: ChildProcess,
    router_kind: RouterProcess,
    decode: Vec<Worker>,
    prefill: Vec<Worker>,
    model: ReferenceModel,
    report: ClusterReport,
    advise_us: Vec<u64>,
    pids: Vec<u32>,
    last_kill: Option<Instant>,
}

fn process_err(process: &str) -> impl Fn(String) -> ClusterError + '_ {
    move |reason| ClusterError::Process {
        process: process.to_string(),
        reason,
    }
}

/// Environment variable naming the router binary to run (default: the
/// product's `kv-reuse-router` next to the kvq executable).
pub const ROUTER_BIN_ENV: &str = "KVQ_ROUTER_BIN";

/// Which router process the cluster runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterProcess {
    /// The product binary `kv-reuse-router` at this path.
    Product(PathBuf),
    /// kvq's own stand-in role ([`super::router`]).
    StandIn,
}

impl RouterProcess {
    /// The product binary (`$KVQ_ROUTER_BIN`, else `kv-reuse-router` next
    /// to `exe`, where `cargo build` and the GPU bundle put it), else the
    /// stand-in.
    pub fn find(exe: &Path) -> Self {
        if let Some(p) = std::env::var_os(ROUTER_BIN_ENV) {
            return Self::Product(PathBuf::from(p));
        }
        match exe.parent().map(|d| d.join("kv-reuse-router")) {
            Some(p) if p.is_file() => Self::Product(p),
            _ => Self::StandIn,
        }
    }

    /// The path, or `kvq stand-in`.
    pub fn describe(&self) -> String {
        match self {
            Self::Product(p) => p.display().to_string(),
            Self::StandIn => "kvq stand-in".into(),
        }
    }
}

/// The reuse settings of the router process, as `KV_REUSE_*` variables
/// (both routers read them): reuse on, any saving admitted (the reference
/// model's prompts are short), the GPU path when `gpu`.
fn router_env(cmd: &mut Process, gpu: bool) {
    cmd.env("KV_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE", "true")
        .env("KV_REUSE_MINIMUM_ESTIMATED_TTFT_SAVING_MS", "0")
        .env("KV_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS", "1")
        .env(
            "KV_REUSE_ENABLE_DECODE_TO_PREFILL_GPU_REUSE",
            if gpu { "true" } else { "false" },
        );
}

fn spawn_router(
    exe: &ChildCommand,
    router: &RouterProcess,
    url: &str,
    gpu: bool,
) -> Result<ChildProcess, ClusterError> {
    let mut cmd = match router {
        RouterProcess::Product(bin) => {
            let mut c = Process::new(bin);
            c.args(["--nats-url", url, "--namespace", super::NAMESPACE])
                .args(["--metrics-addr", "127.0.0.1:0"])
                .args(["--directory-bucket", super::DIRECTORY_BUCKET])
                .args([
                    "--directory-ttl-ms",
                    &(super::RECORD_TTL * 4).as_millis().to_string(),
                ])
                .args([
                    "--announce-period-ms",
                    &super::ANNOUNCE_PERIOD.as_millis().to_string(),
                ])
                .args(["--missed-periods", "8"])
                .args([
                    "--tokens-per-block",
                    &model_config().tokens_per_block.to_string(),
                ]);
            c
        }
        RouterProcess::StandIn => {
            let mut c = Process::new(&exe.exe);
            c.args(exe.args_for_role(ROUTER_ROLE)).args(["--nats", url]);
            if gpu {
                c.arg("--gpu");
            }
            c
        }
    };
    router_env(&mut cmd, gpu);
    let mut child = ChildProcess::spawn_with(cmd, ChildStdin::Lifeline, ChildStderr::Capture)
        .map_err(|e| process_err("router")(e.to_string()))?;
    let ready: Ready = child
        .next_json("ready", Duration::from_secs(30))
        .map_err(|e| process_err("router")(format!("{e}; stderr: {}", child.stderr_tail())))?;
    if ready.event != "ready" {
        return Err(process_err("router")(format!(
            "first line event {:?}",
            ready.event
        )));
    }
    Ok(child)
}

impl<'a> Cluster<'a> {
    fn spawn_worker(&mut self, role: &str, key: &str) -> Result<Worker, ClusterError> {
        let mut cmd = Process::new(&self.exe.exe);
        cmd.args(self.exe.args_for_role(role))
            .args(["--nats", &self.nats.url(), "--worker-key", key, "--dir"])
            .arg(&self.dir)
            .args(["--tp", &self.opts.tp.to_string()]);
        if self.opts.gpu {
            cmd.arg("--gpu");
        }
        let err = process_err(key);
        let mut child = ChildProcess::spawn_with(cmd, ChildStdin::Lifeline, ChildStderr::Capture)
            .map_err(|e| err(e.to_string()))?;
        let hello: Hello = child
            .next_json("hello", Duration::from_secs(30))
            .map_err(|e| err(format!("{e}; stderr: {}", child.stderr_tail())))?;
        let control = UnixStream::connect(&hello.control)
            .map_err(|e| err(format!("control {}: {e}", hello.control.display())))?;
        self.pids.push(hello.pid);
        Ok(Worker {
            key: key.to_string(),
            child,
            control,
            engine: hello.engine_id,
        })
    }

    /// OFF: the same model, the whole prompt computed, then decoded.
    fn off(&self, prompt: &[u32]) -> Result<(Vec<f32>, Vec<u32>), ClusterError> {
        let bad = |e: crate::model::ModelError| ClusterError::Worker {
            worker: "off".into(),
            reason: e.to_string(),
        };
        let mut cache = KvCache::new(layout(self.opts.tp)?);
        let logits = self.model.prefill(&mut cache, prompt).map_err(bad)?;
        let mut out = vec![argmax(&logits)];
        while out.len() < self.opts.output_tokens as usize {
            let l = self
                .model
                .prefill(&mut cache, &out[out.len() - 1..])
                .map_err(bad)?;
            out.push(argmax(&l));
        }
        Ok((logits, out))
    }

    /// Waits until a prefill's advise is decided by the router (it knows
    /// the prefill targets again), at most 15 s; returns the wait.
    fn wait_router(&mut self) -> Result<Duration, ClusterError> {
        let t0 = Instant::now();
        let probe: Vec<u32> = (0..self.opts.first_prompt_tokens).map(|t| t % 7).collect();
        loop {
            let mut all = true;
            for p in 0..self.prefill.len() {
                let r = self.prefill[p].call(&Command::Prefill {
                    request_id: format!("warmup-{p}"),
                    prompt: probe.clone(),
                    hold_if_donor: None,
                })?;
                all &= matches!(
                    r,
                    Reply::Prefilled {
                        advise: AdviseStatus::Decided { .. },
                        ..
                    }
                );
            }
            if all {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > Duration::from_secs(15) {
                return Err(process_err("router")(
                    "no decided advise within 15 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn new_tokens(&self, conv: u32, turn: u32, n: u32) -> Vec<u32> {
        let vocab = model_config().vocab;
        (0..n)
            .map(|i| {
                let mut x = self.opts.seed
                    ^ (u64::from(conv) << 40)
                    ^ (u64::from(turn) << 20)
                    ^ u64::from(i);
                // splitmix64 finalizer: well-mixed, deterministic tokens.
                x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((x ^ (x >> 31)) % u64::from(vocab)) as u32
            })
            .collect()
    }

    fn conversations(&self, first_id: u32) -> Vec<Conversation> {
        (first_id..first_id + self.opts.conversations_per_phase)
            .map(|id| Conversation {
                id,
                prompt: self.new_tokens(id, 0, self.opts.first_prompt_tokens),
                turn: 0,
            })
            .collect()
    }

    /// One turn of `conv` through the cluster; `hold` (victim decode index)
    /// stops the prefill inside a fetch from that decode, SIGKILLs it there
    /// and starts its next incarnation. Returns whether the hold happened.
    fn turn(
        &mut self,
        conv: &mut Conversation,
        span: &mut Span,
        hold: Option<usize>,
    ) -> Result<bool, ClusterError> {
        let (off_logits, off_out) = self.off(&conv.prompt)?;
        let p = ((conv.id + conv.turn) % self.prefill.len() as u32) as usize;
        let d = (conv.id % self.decode.len() as u32) as usize;
        let request_id = format!("c{}-t{}", conv.id, conv.turn);
        let hold_path = self.dir.join(format!("hold-{request_id}"));
        let cmd = Command::Prefill {
            request_id: request_id.clone(),
            prompt: conv.prompt.clone(),
            hold_if_donor: hold.map(|v| (self.decode[v].engine, hold_path.clone())),
        };
        let reply = match hold {
            None => self.prefill[p].call(&cmd)?,
            Some(v) => self.held_call(p, v, &cmd, &hold_path)?,
        };
        let Reply::Prefilled {
            first_token,
            first_logits,
            parts,
            computed_tokens,
            fetched_tokens,
            fallback,
            advise,
            advise_us,
            held,
            ..
        } = reply
        else {
            return Err(ClusterError::Worker {
                worker: self.prefill[p].key.clone(),
                reason: "answered Prefill with another reply".into(),
            });
        };
        let decoded = self.decode[d].call(&Command::Decode {
            prompt: conv.prompt.clone(),
            parts,
            first_token,
            max_new: self.opts.output_tokens,
        })?;
        let Reply::Decoded { output } = decoded else {
            return Err(ClusterError::Worker {
                worker: self.decode[d].key.clone(),
                reason: "answered Decode with another reply".into(),
            });
        };
        let same_logits = first_logits.len() == off_logits.len()
            && first_logits
                .iter()
                .zip(&off_logits)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        let equal = same_logits && output == off_out;
        let r = &mut self.report;
        r.requests += 1;
        span.requests += 1;
        r.computed_tokens += computed_tokens;
        r.fetched_tokens += fetched_tokens;
        if !equal {
            r.wrong_outputs += 1;
            eprintln!("cluster: {request_id}: output differs from OFF (fetched {fetched_tokens} tokens, fallback {fallback:?})");
        }
        match advise {
            AdviseStatus::Decided { admitted } => {
                self.advise_us.push(advise_us);
                if admitted && fetched_tokens == 0 {
                    r.fallbacks += 1;
                    span.fallbacks += 1;
                }
            }
            AdviseStatus::Unavailable(_) => r.advise_unavailable += 1,
            AdviseStatus::Refused(_) => {}
        }
        if fetched_tokens > 0 {
            r.fetches += 1;
            span.fetches += 1;
            // A fetch whose donor was killed inside it must not complete.
            if !equal || held {
                r.false_completions += 1;
            }
        }
        conv.prompt.extend(&off_out);
        conv.turn += 1;
        let more = self.new_tokens(conv.id, conv.turn, self.opts.new_tokens_per_turn);
        conv.prompt.extend(more);
        Ok(held)
    }

    /// Sends `cmd` to prefill `p` from a second thread, and when the
    /// prefill signals that it holds a fetch from decode `victim`,
    /// SIGKILLs that decode, lets the fetch go on, and starts the decode's
    /// next incarnation under the same worker key.
    fn held_call(
        &mut self,
        p: usize,
        victim: usize,
        cmd: &Command,
        hold: &Path,
    ) -> Result<Reply, ClusterError> {
        let inside = hold.with_extension("in");
        let go = hold.with_extension("go");
        let (prefill, decode) = (&mut self.prefill[p], &self.decode[victim]);
        let mut killed = false;
        let reply = std::thread::scope(|s| {
            let call = s.spawn(|| prefill.call(cmd));
            while !call.is_finished() {
                if !killed && inside.exists() {
                    let _ = decode.child.kill();
                    killed = true;
                    let _ = std::fs::write(&go, b"");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            call.join().unwrap_or_else(|_| {
                Err(ClusterError::Worker {
                    worker: "prefill".into(),
                    reason: "control thread panicked".into(),
                })
            })
        });
        if killed {
            self.last_kill = Some(Instant::now());
            let key = self.decode[victim].key.clone();
            let next = self.spawn_worker(DECODE_ROLE, &key)?;
            self.decode[victim] = next;
        }
        reply
    }

    fn phase(&mut self, convs: &mut [Conversation], span: &mut Span) -> Result<(), ClusterError> {
        for _ in 0..self.opts.turns {
            for c in convs.iter_mut() {
                self.turn(c, span, None)?;
            }
        }
        Ok(())
    }

    /// One more turn of each of `convs` (their donors may be gone).
    fn probe(&mut self, convs: &mut [Conversation], span: &mut Span) -> Result<(), ClusterError> {
        for c in convs.iter_mut() {
            self.turn(c, span, None)?;
        }
        Ok(())
    }

    fn shutdown(&mut self) -> Vec<String> {
        let mut leaks = Vec::new();
        for w in self.decode.iter_mut().chain(self.prefill.iter_mut()) {
            match w.call(&Command::Shutdown) {
                Ok(Reply::Closed { leaks: l }) => {
                    leaks.extend(l.into_iter().map(|x| format!("{}: {x}", w.key)))
                }
                Ok(_) | Err(_) => leaks.push(format!("{}: no clean shutdown", w.key)),
            }
            if w.child.wait_exit(Duration::from_secs(10)).is_none() {
                leaks.push(format!("{}: did not exit", w.key));
            }
        }
        // SIGTERM: the product router drains and exits 0.
        let _ = self.router.terminate();
        if self.router.wait_exit(Duration::from_secs(10)).is_none() {
            leaks.push("router: did not exit on SIGTERM".into());
        }
        leaks
    }
}

/// Shared-memory entries (`/dev/shm/kv*`) of any of `pids`.
fn shm_of(pids: &[u32]) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(kv_bank::leaks::PROJECT_SHM_PREFIX))
        .filter(|n| pids.iter().any(|p| n.contains(&format!("-{p}-"))))
        .collect()
}

/// Runs the cluster (module docs of [`super`]); the children are
/// `exe child cluster-*`.
///
/// # Errors
/// [`ClusterError::Skipped`] without nats-server (outside CI);
/// [`ClusterError::Process`], [`ClusterError::Control`] or
/// [`ClusterError::Worker`] when the cluster itself broke (a fault is not
/// an error: its effects are counted in the report).
pub fn run(
    opts: &ClusterOptions,
    exe: &ChildCommand,
    router: &RouterProcess,
) -> Result<ClusterReport, ClusterError> {
    let t0 = Instant::now();
    if let Err(e) = find_nats_server() {
        let why = e.to_string();
        if kv_transfer::ci_requires() {
            return Err(process_err("nats-server")(why));
        }
        return Err(ClusterError::Skipped(why));
    }
    layout(opts.tp)?;
    let nats = NatsServer::start().map_err(process_err("nats-server"))?;
    let dir = std::env::temp_dir().join(format!("kvq-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| process_err("harness")(e.to_string()))?;
    let router_process = spawn_router(exe, router, &nats.url(), opts.gpu)?;
    let model =
        ReferenceModel::new(model_config()).map_err(|e| process_err("harness")(e.to_string()))?;
    let mut c = Cluster {
        opts: *opts,
        exe,
        dir: dir.clone(),
        nats,
        router: router_process,
        router_kind: router.clone(),
        decode: Vec::new(),
        prefill: Vec::new(),
        model,
        report: ClusterReport {
            memory: if opts.gpu { "cuda_ipc" } else { "host_shm" }.into(),
            router: router.describe(),
            tp: opts.tp,
            ..ClusterReport::default()
        },
        advise_us: Vec::new(),
        pids: Vec::new(),
        last_kill: None,
    };
    let result = drive(&mut c);
    let mut leaks = c.shutdown();
    // A SIGKILLed decode's bank: its lease lapses, a scan reclaims it; what
    // is still there after that leaked.
    if let Some(k) = c.last_kill {
        let wait = (BANK_LEASE + Duration::from_millis(200)).saturating_sub(k.elapsed());
        std::thread::sleep(wait);
        let _ = kv_bank::reclaim_stale("kvbank", kv_bank::reclaim::ScanTime::now());
    }
    leaks.extend(shm_of(&c.pids).into_iter().map(|n| format!("/dev/shm/{n}")));
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    let mut r = c.report;
    leaks.append(&mut r.leak_details);
    r.leaks = leaks.len() as u64;
    r.leak_details = leaks;
    c.advise_us.sort_unstable();
    let pct = |q: f64| {
        c.advise_us
            .get(((c.advise_us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    r.advise_p50_us = pct(0.50);
    r.advise_p99_us = pct(0.99);
    r.seconds = t0.elapsed().as_secs_f64();
    Ok(r)
}

fn recovery(fault: &str, span: Span, injected: bool, detail: String) -> Recovery {
    Recovery {
        fault: fault.into(),
        fetches_after: span.fetches,
        requests_after: span.requests,
        fallbacks_after: span.fallbacks,
        injected,
        detail,
    }
}

fn drive(c: &mut Cluster<'_>) -> Result<(), ClusterError> {
    for i in 0..2 {
        let w = c.spawn_worker(DECODE_ROLE, &format!("decode-{i}"))?;
        c.decode.push(w);
    }
    for i in 0..2 {
        let w = c.spawn_worker(PREFILL_ROLE, &format!("prefill-{i}"))?;
        c.prefill.push(w);
    }
    c.wait_router()?;
    let n = c.opts.conversations_per_phase;
    let mut healthy = Span::default();
    let mut a = c.conversations(0);
    c.phase(&mut a, &mut healthy)?;
    println!(
        "cluster: healthy: {} requests, {} fetches, {} fallbacks",
        healthy.requests, healthy.fetches, healthy.fallbacks
    );

    // 1. decode-0 restarts under its worker key with a new incarnation.
    let old = c.decode[0].engine;
    let closed = c.decode[0].call(&Command::Shutdown);
    if let Ok(Reply::Closed { leaks }) = &closed {
        c.report
            .leak_details
            .extend(leaks.iter().map(|l| format!("decode-0 (old): {l}")));
    }
    let _ = c.decode[0].child.wait_exit(Duration::from_secs(10));
    c.decode[0] = c.spawn_worker(DECODE_ROLE, "decode-0")?;
    let new = c.decode[0].engine;
    std::thread::sleep(super::ANNOUNCE_PERIOD * 3);
    let mut span = Span::default();
    c.probe(&mut a, &mut span)?;
    let mut b = c.conversations(n);
    c.phase(&mut b, &mut span)?;
    let injected = closed.is_ok() && old != new;
    c.report.recoveries.push(recovery(
        "donor_restarted_new_incarnation",
        span,
        injected,
        format!("decode-0 {old} -> {new}"),
    ));

    // 2. decode-1 SIGKILLed while a prefill holds a fetch from it.
    let old = c.decode[1].engine;
    let mut span = Span::default();
    let mut held = false;
    for conv in b.iter_mut() {
        let hold = (!held).then_some(1);
        held |= c.turn(conv, &mut span, hold)?;
    }
    let new = c.decode[1].engine;
    let mut d = c.conversations(2 * n);
    c.phase(&mut d, &mut span)?;
    c.report.recoveries.push(recovery(
        "decode_killed_mid_fetch",
        span,
        held && old != new,
        format!("decode-1 {old} killed inside a fetch: {held}; next incarnation {new}"),
    ));

    // 3. The router SIGKILLed mid-run; requests meanwhile recompute.
    c.router.kill();
    let mut span = Span::default();
    let unavailable = c.report.advise_unavailable;
    c.probe(&mut d, &mut span)?;
    let down = c.report.advise_unavailable - unavailable;
    c.router = spawn_router(c.exe, &c.router_kind, &c.nats.url(), c.opts.gpu)?;
    let waited = c.wait_router()?;
    let mut e = c.conversations(3 * n);
    c.phase(&mut e, &mut span)?;
    c.report.recoveries.push(recovery(
        "router_restarted",
        span,
        down > 0,
        format!("{down} requests recomputed while it was down; advise decided again after {} ms (inventory relearned from new events only)", waited.as_millis()),
    ));

    // 4. nats-server restarted (same port, JetStream store kept).
    let restarted = c.nats.restart();
    let mut span = Span::default();
    std::thread::sleep(Duration::from_secs(1));
    c.probe(&mut e, &mut span)?;
    let mut f = c.conversations(4 * n);
    c.phase(&mut f, &mut span)?;
    c.report.recoveries.push(recovery(
        "nats_server_restarted",
        span,
        restarted.is_ok(),
        format!("restart: {restarted:?}"),
    ));
    Ok(())
}
