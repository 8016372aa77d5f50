//! Virtual-time replay: a discrete-event simulation of P prefill and D decode
//! workers serving a workload, with reuse OFF and ON.
//!
//! What is simulated (all times virtual, from [`TimingModel`]; no clock is read
//! except by the real `kv_lookup` lookup, whose *virtual* cost is
//! [`TimingModel::lookup_us`]):
//! - **Router**: on arrival, picks the prefill worker with the earliest
//!   estimated finish (its backlog plus the request's compute after that
//!   worker's native prefix hit), the way a KV-aware router trades load
//!   against overlap. Routing is identical OFF and ON.
//! - **Prefill workers**: one request at a time, FCFS. A native prefix cache
//!   of [`ClusterConfig::prefill_cache_blocks`] blocks with LRU eviction
//!   (tail blocks evicted before their prefix). A prefill always computes at
//!   least the prompt's last token. TTFT = prefill end − arrival.
//! - **Decode workers**: chosen by fewest active requests; unbounded batch;
//!   a request decodes for `output_tokens x decode_us_per_token`. When it
//!   finishes, ON only, the worker's retained bank keeps every full block of
//!   prompt + output (LRU, [`ClusterConfig::decode_bank_blocks`]) and
//!   publishes `Stored` / `Removed` KV events (tier `retained_gpu_direct`) to
//!   a real [`kv_lookup::InventoryIndex`].
//! - **Reuse (ON)**: after routing, the router looks the request up in the
//!   index (real [`InventoryIndex::lookup`]) against the target's native
//!   baseline, and kv-router-glue's [`CostModel`] admits the fetch only when
//!   its estimated saving reaches the minimum ([`replay_reuse_settings`]). When the request starts
//!   on the prefill worker, the executor re-checks the truth: the donor must
//!   still hold every hinted block and the target must still hold the hint's
//!   `fetch_from` baseline; otherwise it falls back to recompute, paying
//!   [`TimingModel::fetch_setup_us`] for nothing.
//!
//! Deliberately absent: chunked prefill batching, decode memory pressure and
//! preemption, network contention between concurrent fetches.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use indicatif::{ProgressBar, ProgressStyle};
use kv_descriptor::{
    chain_sequence_hash, token_block_hashes, DType, EngineId, KvEvent, KvEventData, KvLayout, Role,
    SequenceHash, StorageTier, StoredBlock, TensorOrder,
};
use kv_lookup::{InventoryIndex, LookupBudget, WorkerInfo, WorkerKey};
use kv_router_glue::{CostInputs, CostModel, ReuseSettings, TransferPath};
use serde::{Deserialize, Serialize};

use crate::trace::{splitmix64, synthetic_tokens, MooncakeTrace};

/// Costs of the simulated hardware. Every default comes from the project's
/// measured anchors (lent H200, Llama-3.1-8B shape) unless marked as an
/// assumption; `docs/qualification/prefill_cost_h200.json` is this project's
/// own re-measurement of the prefill cost (59.8 ms at 2,048 tokens, 253.9 ms at
/// 8,192, 1,364 ms at 32,768: within 4% of the fit below), and
/// `docs/qualification/h200-x2/bench_transfer_gpu.json` of the block copies.
///
/// Prefill of `s` tokens on top of `p` cached tokens costs
/// `prefill_us_per_token x s + prefill_us_per_token_sq x ((p + s)^2 − p^2)` µs:
/// a linear (MLP, projections) plus a quadratic (attention) term, fitted to the
/// anchors' 61 ms at 2,048 tokens and 1,395 ms at 32,768 tokens (it then gives
/// 265 ms at 8,192 and 586 ms at 16,384 against 256 and 583 measured).
///
/// ```
/// use kv_testkit::replay::TimingModel;
/// let t = TimingModel::default();
/// let full = t.prefill_us(0, 16_384);
/// assert!((full / 1000.0 - 583.0).abs() < 10.0); // ms, anchor 583 ms
/// assert!(t.prefill_us(16_000, 384) < full / 20.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimingModel {
    /// Linear prefill cost, µs per computed token (fit: 28.93).
    pub prefill_us_per_token: f64,
    /// Attention prefill cost, µs per token² (fit: 4.162e-4).
    pub prefill_us_per_token_sq: f64,
    /// Moving one block donor→target, µs. Default 6.6: a 16-token Llama-8B
    /// block is 2 MiB (128 KiB/token), moved by the gather+scatter kernel pair
    /// at 317 GB/s (anchors, 2 MiB scattered blocks). Measured here: 5.8 µs
    /// GPU0 -> GPU1 and 1.2 µs on one GPU (kv-transfer's gather kernel), so
    /// the default is the conservative cross-GPU figure.
    pub transfer_us_per_block: f64,
    /// Fixed cost of one fetch (hint validation, pin round trip, completion),
    /// µs. Default 100: **assumption** (one same-host control round trip plus
    /// a cached IPC mapping; the anchors' 7-block fetch took ~10 µs of copy).
    pub fetch_setup_us: f64,
    /// Virtual latency of one donor lookup on the router, µs: the request
    /// reaches its prefill worker this much later (the worker is not
    /// blocked). Default 20: **assumption**, an upper bound for kv-lookup's
    /// in-memory walk of a few thousand blocks plus routing overhead.
    pub lookup_us: f64,
    /// Decode time per output token of one request under batching, µs.
    /// Default 10,000: **assumption** (no decode anchor; typical inter-token
    /// latency of an 8B model under load).
    pub decode_us_per_token: f64,
    /// K/V bytes per token (all layers, K and V, whole TP group); used only
    /// to report bytes moved. Default 131,072 (anchors: 128 KiB/token).
    pub kv_bytes_per_token: u64,
}

impl Default for TimingModel {
    fn default() -> Self {
        Self {
            prefill_us_per_token: 28.93,
            prefill_us_per_token_sq: 4.162e-4,
            transfer_us_per_block: 6.6,
            fetch_setup_us: 100.0,
            lookup_us: 20.0,
            decode_us_per_token: 10_000.0,
            kv_bytes_per_token: 128 * 1024,
        }
    }
}

impl TimingModel {
    /// µs to compute `computed` tokens after `cached` tokens already in cache.
    pub fn prefill_us(&self, cached: u64, computed: u64) -> f64 {
        let (p, s) = (cached as f64, computed as f64);
        self.prefill_us_per_token * s + self.prefill_us_per_token_sq * ((p + s) * (p + s) - p * p)
    }
}

/// The router's admission settings used by replays: kv-router-glue's
/// [`ReuseSettings`], priced by its [`CostModel`] (the product's own
/// admission), with reuse and the GPU path on.
///
/// Estimated saving = `fetched tokens x 30 µs − blocks x 6.6 µs − lookup µs`,
/// admitted at 1 ms or more. 30 µs/token is the low end of the anchors'
/// 30-43 µs; 6.6 µs/block is [`TimingModel::transfer_us_per_block`]. The
/// estimate is linear on purpose (what an operator configures) and ignores
/// [`TimingModel::fetch_setup_us`]; the simulated truth has both the attention
/// term and the setup cost, so estimate and truth can disagree, as in
/// production.
///
/// ```
/// let s = kv_testkit::replay::replay_reuse_settings();
/// assert!(s.enable_decode_to_prefill_reuse && s.enable_decode_to_prefill_gpu_reuse);
/// kv_router_glue::CostModel::new(s, 16).unwrap();
/// ```
pub fn replay_reuse_settings() -> ReuseSettings {
    ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        enable_decode_to_prefill_gpu_reuse: true,
        minimum_estimated_ttft_saving_ms: 1.0,
        minimum_transfer_prefix_blocks: 1,
        transfer_source_gpu_estimated_block_us: 6.6,
        transfer_source_prefill_token_us: 30.0,
        ..ReuseSettings::default()
    }
}

/// Shape of the simulated cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterConfig {
    /// Prefill workers (default 4).
    pub prefill_workers: u32,
    /// Decode workers (default 4).
    pub decode_workers: u32,
    /// Tokens per KV block (default 16, vLLM's default).
    pub tokens_per_block: u32,
    /// Native prefix-cache capacity of each prefill worker, in blocks.
    /// Default 16,384 blocks = 262,144 tokens = 32 GiB of Llama-8B K/V:
    /// **assumption**, a prefill worker's cache after activations of long
    /// prompts (an H200 has ~100 GiB for K/V at most).
    pub prefill_cache_blocks: u32,
    /// Retained-bank capacity of each decode worker, in blocks. Default
    /// 32,768 blocks = 524,288 tokens = 64 GiB: **assumption**.
    pub decode_bank_blocks: u32,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            prefill_workers: 4,
            decode_workers: 4,
            tokens_per_block: 16,
            prefill_cache_blocks: 16_384,
            decode_bank_blocks: 32_768,
        }
    }
}

/// Everything a replay run needs besides the workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayOptions {
    /// Cluster shape.
    pub cluster: ClusterConfig,
    /// Simulated costs.
    pub timing: TimingModel,
    /// Router admission settings (ON runs), priced by kv-router-glue's
    /// [`CostModel`]; default [`replay_reuse_settings`].
    pub admission: ReuseSettings,
    /// Draw an indicatif progress bar on stderr.
    pub progress: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            cluster: ClusterConfig::default(),
            timing: TimingModel::default(),
            admission: replay_reuse_settings(),
            progress: false,
        }
    }
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// An option is out of range.
    #[error("invalid replay option `{field}`: {reason}")]
    Option {
        /// Offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A request of the workload is inconsistent.
    #[error("invalid request {index}: `{field}`: {reason}")]
    Request {
        /// Index in the workload.
        index: usize,
        /// Offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// One request as the replay sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayRequest {
    /// Arrival in µs of virtual time; for a follow-up, the think time after
    /// its parent's last output token instead.
    pub arrival_us: f64,
    /// The request this one follows (its next turn), if any; must be earlier.
    pub parent: Option<usize>,
    /// Prompt tokens (at least 1).
    pub prompt_tokens: u32,
    /// Output tokens (at least 1).
    pub output_tokens: u32,
    /// Every full block of prompt + output, root first (what the decode
    /// worker retains); the first `prompt_tokens / tokens_per_block` are the
    /// prompt's.
    pub blocks: Vec<StoredBlock>,
    /// Turn number inside a session (0 = first); 0 for trace requests.
    pub turn: u32,
}

/// A workload: requests in arrival order of their roots.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Name recorded in results (trace file name or generator description).
    pub name: String,
    /// Tokens per block the hashes were computed with.
    pub tokens_per_block: u32,
    /// The requests.
    pub requests: Vec<ReplayRequest>,
}

/// Full-block chain of `tokens`: sequence and token hashes, root first
/// (Dynamo's scheme, see [`kv_descriptor::sequence_hashes`]).
pub fn block_chain(tokens: &[u32], tokens_per_block: usize) -> Vec<StoredBlock> {
    let mut parent = None;
    token_block_hashes(tokens, tokens_per_block)
        .into_iter()
        .map(|token_hash| {
            let s = chain_sequence_hash(parent, token_hash);
            parent = Some(s);
            StoredBlock {
                sequence_hash: s,
                token_hash,
            }
        })
        .collect()
}

/// Synthetic output token `pos` of request `salt`: unique to that request.
pub(crate) fn output_token(salt: u64, pos: usize) -> u32 {
    splitmix64(splitmix64(salt ^ 0x6F75_7470_7574_0000) ^ pos as u64) as u32
}

impl Workload {
    /// The Mooncake trace as a workload: prompt = [`synthetic_tokens`] of the
    /// request's hash ids, output = tokens unique to the request; arrival =
    /// `timestamp_ms`. Hashing runs on two threads.
    ///
    /// # Errors
    /// [`ReplayError::Option`] (`tokens_per_block`) when it is 0.
    pub fn from_trace(
        trace: &MooncakeTrace,
        name: &str,
        tokens_per_block: u32,
    ) -> Result<Self, ReplayError> {
        if tokens_per_block == 0 {
            return Err(ReplayError::Option {
                field: "tokens_per_block",
                reason: "must be at least 1".into(),
            });
        }
        let bs = tokens_per_block as usize;
        let reqs = trace.requests();
        let build = |i: usize| {
            let r = &reqs[i];
            let mut tokens = synthetic_tokens(&r.hash_ids, r.input_length as usize);
            tokens.extend((0..r.output_length as usize).map(|p| output_token(i as u64, p)));
            ReplayRequest {
                arrival_us: r.timestamp_ms as f64 * 1000.0,
                parent: None,
                prompt_tokens: r.input_length,
                output_tokens: r.output_length.max(1),
                blocks: block_chain(&tokens, bs),
                turn: 0,
            }
        };
        let half = reqs.len() / 2;
        let (a, b) = std::thread::scope(|s| {
            let h = s.spawn(|| (half..reqs.len()).map(build).collect::<Vec<_>>());
            let a: Vec<_> = (0..half).map(build).collect();
            (a, h.join().expect("hashing thread"))
        });
        let mut requests = a;
        requests.extend(b);
        Ok(Self {
            name: name.to_string(),
            tokens_per_block,
            requests,
        })
    }
}

/// LRU set of blocks with lazy deletion: `touch` is O(1), eviction pops the
/// oldest live stamp. Stale queue entries are compacted when they outnumber
/// live ones, so memory stays O(capacity).
struct LruBlocks {
    capacity: usize,
    stamps: HashMap<SequenceHash, u64>,
    queue: VecDeque<(SequenceHash, u64)>,
    clock: u64,
}

impl LruBlocks {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            stamps: HashMap::new(),
            queue: VecDeque::new(),
            clock: 0,
        }
    }

    fn contains(&self, h: &SequenceHash) -> bool {
        self.stamps.contains_key(h)
    }

    /// Blocks `0..k` of `hashes` all held; returns `k`.
    fn prefix_len(&self, hashes: &[StoredBlock]) -> usize {
        hashes
            .iter()
            .take_while(|b| self.contains(&b.sequence_hash))
            .count()
    }

    /// Inserts or refreshes `blocks`, tail first so that a prefix is always
    /// younger than its extensions and is evicted after them. Returns the
    /// newly added blocks (root first) and the evicted hashes.
    fn insert(&mut self, blocks: &[StoredBlock]) -> (Vec<StoredBlock>, Vec<SequenceHash>) {
        let mut added = Vec::new();
        for b in blocks.iter().rev() {
            self.clock += 1;
            if self.stamps.insert(b.sequence_hash, self.clock).is_none() {
                added.push(*b);
            }
            self.queue.push_back((b.sequence_hash, self.clock));
        }
        added.reverse();
        let mut evicted = Vec::new();
        while self.stamps.len() > self.capacity {
            let (h, stamp) = self
                .queue
                .pop_front()
                .expect("queue holds every live entry");
            if self.stamps.get(&h) == Some(&stamp) {
                self.stamps.remove(&h);
                evicted.push(h);
            }
        }
        if !evicted.is_empty() && !added.is_empty() {
            // A block both added and evicted by this call was never held:
            // it belongs in neither list (a Stored event for it would lie).
            let added_now: std::collections::HashSet<SequenceHash> =
                added.iter().map(|b| b.sequence_hash).collect();
            let stamps = &self.stamps;
            added.retain(|b| stamps.contains_key(&b.sequence_hash));
            evicted.retain(|h| !added_now.contains(h));
        }
        if self.queue.len() > 2 * self.stamps.len() + 1024 {
            let stamps = &self.stamps;
            self.queue.retain(|(h, s)| stamps.get(h) == Some(s));
        }
        (added, evicted)
    }
}

/// Metrics of one run (OFF or ON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Reuse enabled.
    pub reuse: bool,
    /// Requests served.
    pub requests: u64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens computed by prefill.
    pub prefill_tokens: u64,
    /// Prompt tokens served from the target's native prefix cache.
    pub native_hit_tokens: u64,
    /// Prompt tokens fetched from a decode donor's retained bank.
    pub donor_hit_tokens: u64,
    /// K/V bytes fetched from donors ([`TimingModel::kv_bytes_per_token`]).
    pub bytes_moved: u64,
    /// Lookups that found a donor beyond the target's native baseline.
    pub donor_found: u64,
    /// Of those, fetches refused by the admission rule.
    pub refused_by_cost: u64,
    /// Admitted fetches that fell back to recompute at execution (donor
    /// evicted the blocks, or the target lost its baseline, while queued).
    pub fetch_fallbacks: u64,
    /// Admitted fetches that completed.
    pub fetches: u64,
    /// TTFT per request in workload order, ms.
    pub ttft_ms: Vec<f64>,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile TTFT, ms.
    pub ttft_p90_ms: f64,
    /// 99th percentile TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Mean TTFT, ms.
    pub ttft_mean_ms: f64,
    /// Mean TTFT of requests with `turn > 0`, ms (0 when there are none).
    pub later_turn_ttft_mean_ms: f64,
    /// Virtual time at which the last request finished decoding, s.
    pub makespan_s: f64,
}

/// Nearest-rank percentile (`q` in 0..=1) of unsorted values; 0 when empty.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    Enqueue(usize, usize),
    PrefillDone(usize),
    DecodeDone(usize, usize),
}

struct Hint {
    donor: usize,
    fetch_from: usize,
    blocks: usize,
}

struct PrefillWorker {
    engine: EngineId,
    cache: LruBlocks,
    queue: VecDeque<usize>,
    running: Option<usize>,
    busy_until_us: f64,
    queued_est_us: f64,
}

struct DecodeWorker {
    engine: EngineId,
    bank: LruBlocks,
    active: u32,
    next_event_id: u64,
}

/// Time as integer nanoseconds for a total order in the event heap.
fn ns(us: f64) -> u64 {
    (us * 1000.0).round() as u64
}

fn validate(w: &Workload, opts: &ReplayOptions) -> Result<(), ReplayError> {
    let c = &opts.cluster;
    let opt = |field, reason: &str| {
        Err(ReplayError::Option {
            field,
            reason: reason.to_string(),
        })
    };
    if c.prefill_workers == 0 || c.decode_workers == 0 {
        return opt(
            "cluster.prefill_workers",
            "prefill and decode workers must be at least 1",
        );
    }
    if c.prefill_workers + c.decode_workers > 4096 {
        return opt(
            "cluster.prefill_workers",
            "at most 4,096 workers in all (kv-lookup MAX_WORKERS)",
        );
    }
    if c.tokens_per_block != w.tokens_per_block {
        return Err(ReplayError::Option {
            field: "cluster.tokens_per_block",
            reason: format!(
                "{} but the workload was hashed at {}",
                c.tokens_per_block, w.tokens_per_block
            ),
        });
    }
    let t = &opts.timing;
    for (field, v) in [
        ("timing.prefill_us_per_token", t.prefill_us_per_token),
        ("timing.prefill_us_per_token_sq", t.prefill_us_per_token_sq),
        ("timing.transfer_us_per_block", t.transfer_us_per_block),
        ("timing.fetch_setup_us", t.fetch_setup_us),
        ("timing.lookup_us", t.lookup_us),
        ("timing.decode_us_per_token", t.decode_us_per_token),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            return Err(ReplayError::Option {
                field,
                reason: format!("must be finite and non-negative, got {v}"),
            });
        }
    }
    let bs = w.tokens_per_block as usize;
    for (index, r) in w.requests.iter().enumerate() {
        let bad = |field, reason: String| {
            Err(ReplayError::Request {
                index,
                field,
                reason,
            })
        };
        if r.prompt_tokens == 0 {
            return bad("prompt_tokens", "must be at least 1".into());
        }
        let want = (r.prompt_tokens as usize + r.output_tokens as usize) / bs;
        if r.blocks.len() != want {
            return bad(
                "blocks",
                format!(
                    "{} blocks, (prompt + output) / tokens_per_block = {want}",
                    r.blocks.len()
                ),
            );
        }
        if let Some(p) = r.parent {
            if p >= index {
                return bad("parent", format!("{p} is not an earlier request"));
            }
        }
    }
    Ok(())
}

/// The simulation state of one run.
struct Sim<'a> {
    reqs: &'a [ReplayRequest],
    opts: ReplayOptions,
    cost: CostModel,
    reuse: bool,
    bs: usize,
    fp: kv_descriptor::LayoutFingerprint,
    index: InventoryIndex,
    prefill: Vec<PrefillWorker>,
    decode: Vec<DecodeWorker>,
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    arrival_us: Vec<f64>,
    est_us: Vec<f64>,
    hints: Vec<Option<Hint>>,
    /// Lookup latency charged to each request (0 when none ran).
    lookup_us: Vec<f64>,
    ttft_ms: Vec<f64>,
    m: RunMetrics,
}

impl<'a> Sim<'a> {
    fn push(&mut self, at_us: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((ns(at_us), self.seq, ev)));
    }

    /// Prompt blocks that may come from a cache: all full prompt blocks,
    /// except that the last prompt token is always computed (it yields the
    /// first output token).
    fn reusable(&self, r: &ReplayRequest) -> usize {
        ((r.prompt_tokens as usize - 1) / self.bs).min(r.blocks.len())
    }

    fn arrive(&mut self, i: usize, now: f64) {
        let reqs = self.reqs;
        let r = &reqs[i];
        let t = self.opts.timing;
        let bs = self.bs;
        self.arrival_us[i] = now;
        let max_b = self.reusable(r);
        let prompt = &r.blocks[..max_b];
        // Router: earliest estimated finish over prefill workers.
        let mut best = (f64::INFINITY, 0usize, 0usize, 0.0);
        for (w, pw) in self.prefill.iter().enumerate() {
            let hit = pw.cache.prefix_len(prompt);
            let backlog = (pw.busy_until_us - now).max(0.0) + pw.queued_est_us;
            let cached = (hit * bs) as u64;
            let est = t.prefill_us(cached, u64::from(r.prompt_tokens) - cached);
            if backlog + est < best.0 {
                best = (backlog + est, w, hit, est);
            }
        }
        let (_, w, hit, est) = best;
        self.est_us[i] = est;
        if self.reuse && max_b > 0 {
            self.plan_fetch(i, w, hit, prompt);
        }
        self.prefill[w].queued_est_us += est;
        if self.lookup_us[i] > 0.0 {
            // The request reaches the worker once the router's lookup is done.
            self.push(now + self.lookup_us[i], Ev::Enqueue(i, w));
        } else {
            self.enqueue(i, w, now);
        }
    }

    fn enqueue(&mut self, i: usize, w: usize, now: f64) {
        let pw = &mut self.prefill[w];
        pw.queue.push_back(i);
        if pw.running.is_none() {
            self.start_next(w, now);
        }
    }

    /// Bounded donor lookup and admission for request `i` routed to `w`,
    /// whose native cache holds `hit` blocks of `prompt`.
    fn plan_fetch(&mut self, i: usize, w: usize, hit: usize, prompt: &[StoredBlock]) {
        let hashes: Vec<SequenceHash> = prompt.iter().map(|b| b.sequence_hash).collect();
        let out = self
            .index
            .lookup(&hashes, self.prefill[w].engine, LookupBudget::default());
        self.lookup_us[i] = self.opts.timing.lookup_us;
        let Ok(d) = out.donor else {
            return;
        };
        let k = d.blocks as usize;
        if k <= hit {
            return;
        }
        self.m.donor_found += 1;
        let blocks = (k - hit) as u64;
        let decision = self.cost.admit(
            "replay",
            CostInputs {
                reused_tokens: blocks * self.bs as u64,
                transfer_blocks: blocks,
                path: TransferPath::Gpu,
                lookup_us: self.opts.timing.lookup_us,
            },
        );
        if decision.admitted() {
            let donor = self
                .decode
                .iter()
                .position(|x| x.engine == d.engine)
                .expect("every donor the index returns was registered");
            self.hints[i] = Some(Hint {
                donor,
                fetch_from: hit,
                blocks: k,
            });
        } else {
            self.m.refused_by_cost += 1;
        }
    }

    /// Starts the next queued request on idle prefill worker `w`: resolves its
    /// native hit and hint against the truth at this instant, charges the time.
    fn start_next(&mut self, w: usize, now: f64) {
        let t = self.opts.timing;
        let bs = self.bs;
        let Some(i) = self.prefill[w].queue.pop_front() else {
            return;
        };
        let reqs = self.reqs;
        let r = &reqs[i];
        let max_b = self.reusable(r);
        let pw = &mut self.prefill[w];
        pw.queued_est_us -= self.est_us[i];
        if pw.queue.is_empty() {
            pw.queued_est_us = 0.0; // drop accumulated rounding error
        }
        let prompt = &r.blocks[..max_b];
        let native = pw.cache.prefix_len(prompt);
        let mut reused = native;
        let mut service = 0.0;
        if let Some(h) = self.hints[i].take() {
            if native >= h.blocks {
                // The native cache caught up while queued: nothing to fetch.
            } else if native >= h.fetch_from
                && prompt[native..h.blocks]
                    .iter()
                    .all(|b| self.decode[h.donor].bank.contains(&b.sequence_hash))
            {
                let blocks = h.blocks - native;
                service += t.fetch_setup_us + blocks as f64 * t.transfer_us_per_block;
                self.m.fetches += 1;
                self.m.donor_hit_tokens += (blocks * bs) as u64;
                self.m.bytes_moved += (blocks * bs) as u64 * t.kv_bytes_per_token;
                reused = h.blocks;
            } else {
                service += t.fetch_setup_us;
                self.m.fetch_fallbacks += 1;
            }
        }
        let cached = (reused * bs) as u64;
        let computed = u64::from(r.prompt_tokens) - cached;
        self.m.native_hit_tokens += (native * bs) as u64;
        self.m.prefill_tokens += computed;
        service += t.prefill_us(cached, computed);
        pw.running = Some(i);
        pw.busy_until_us = now + service;
        self.push(now + service, Ev::PrefillDone(w));
    }

    fn prefill_done(&mut self, w: usize, now: f64) {
        let i = self.prefill[w].running.take().expect("a running request");
        let reqs = self.reqs;
        let r = &reqs[i];
        self.ttft_ms[i] = (now - self.arrival_us[i]) / 1000.0;
        let prompt_blocks = r.prompt_tokens as usize / self.bs;
        self.prefill[w].cache.insert(&r.blocks[..prompt_blocks]);
        let d = (0..self.decode.len())
            .min_by_key(|&d| (self.decode[d].active, d))
            .expect("at least one decode worker");
        self.decode[d].active += 1;
        let done = now + f64::from(r.output_tokens) * self.opts.timing.decode_us_per_token;
        self.push(done, Ev::DecodeDone(i, d));
        self.start_next(w, now);
    }

    fn decode_done(&mut self, i: usize, d: usize, now: f64) -> Result<(), ReplayError> {
        let dw = &mut self.decode[d];
        dw.active -= 1;
        self.m.makespan_s = self.m.makespan_s.max(now / 1e6);
        if !self.reuse {
            return Ok(());
        }
        let (added, evicted) = dw.bank.insert(&self.reqs[i].blocks);
        // Removals first: the index must never see more than the bank holds.
        let removed = (!evicted.is_empty()).then_some(KvEventData::Removed {
            sequence_hashes: evicted,
        });
        let stored = (!added.is_empty()).then_some(KvEventData::Stored {
            parent: None,
            blocks: added,
        });
        for data in [removed, stored].into_iter().flatten() {
            let e = KvEvent {
                publisher: dw.engine,
                event_id: dw.next_event_id,
                role: Role::Decode,
                layout_fingerprint: self.fp,
                tp_size: 1,
                tier: StorageTier::RetainedGpuDirect,
                data,
            };
            dw.next_event_id += 1;
            self.index
                .apply_event(&e)
                .map_err(|e| ReplayError::Option {
                    field: "cluster",
                    reason: e.to_string(),
                })?;
        }
        Ok(())
    }
}

/// Replays `workload` once, with reuse OFF (`reuse = false`) or ON.
///
/// # Errors
/// [`ReplayError`] naming the option or request field that is out of range;
/// nothing runs then.
pub fn run(
    workload: &Workload,
    opts: &ReplayOptions,
    reuse: bool,
) -> Result<RunMetrics, ReplayError> {
    validate(workload, opts)?;
    let c = opts.cluster;
    let layout = KvLayout::new(
        32,
        8,
        128,
        DType::Bf16,
        c.tokens_per_block,
        TensorOrder::BlockMajor,
        1,
    )
    .map_err(|e| ReplayError::Option {
        field: "cluster.tokens_per_block",
        reason: e.to_string(),
    })?;
    let reqs = &workload.requests;
    let n = reqs.len();
    let cost = CostModel::new(opts.admission.clone(), c.tokens_per_block).map_err(|e| {
        ReplayError::Option {
            field: "admission",
            reason: e.to_string(),
        }
    })?;
    let mut sim = Sim {
        reqs,
        opts: opts.clone(),
        cost,
        reuse,
        bs: c.tokens_per_block as usize,
        fp: layout.fingerprint(),
        index: InventoryIndex::with_capacity(if reuse {
            c.decode_bank_blocks as usize * c.decode_workers as usize
        } else {
            0
        }),
        prefill: (0..c.prefill_workers)
            .map(|_| PrefillWorker {
                engine: EngineId::fresh(),
                cache: LruBlocks::new(c.prefill_cache_blocks as usize),
                queue: VecDeque::new(),
                running: None,
                busy_until_us: 0.0,
                queued_est_us: 0.0,
            })
            .collect(),
        decode: (0..c.decode_workers)
            .map(|_| DecodeWorker {
                engine: EngineId::fresh(),
                bank: LruBlocks::new(c.decode_bank_blocks as usize),
                active: 0,
                next_event_id: 1,
            })
            .collect(),
        heap: BinaryHeap::new(),
        seq: 0,
        arrival_us: vec![0.0; n],
        est_us: vec![0.0; n],
        hints: (0..n).map(|_| None).collect(),
        lookup_us: vec![0.0; n],
        ttft_ms: vec![0.0; n],
        m: RunMetrics {
            reuse,
            requests: n as u64,
            prompt_tokens: reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
            prefill_tokens: 0,
            native_hit_tokens: 0,
            donor_hit_tokens: 0,
            bytes_moved: 0,
            donor_found: 0,
            refused_by_cost: 0,
            fetch_fallbacks: 0,
            fetches: 0,
            ttft_ms: Vec::new(),
            ttft_p50_ms: 0.0,
            ttft_p90_ms: 0.0,
            ttft_p99_ms: 0.0,
            ttft_mean_ms: 0.0,
            later_turn_ttft_mean_ms: 0.0,
            makespan_s: 0.0,
        },
    };
    let workers = sim
        .prefill
        .iter()
        .map(|p| (p.engine, Role::Prefill))
        .chain(sim.decode.iter().map(|d| (d.engine, Role::Decode)));
    for (k, (engine, role)) in workers.enumerate() {
        let info = WorkerInfo {
            engine,
            role,
            layout_fingerprint: sim.fp,
            tp_size: 1,
        };
        sim.index
            .register_worker(WorkerKey(k as u64), info)
            .map_err(|e| ReplayError::Option {
                field: "cluster",
                reason: e.to_string(),
            })?;
    }
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, r) in reqs.iter().enumerate() {
        match r.parent {
            Some(p) => children[p].push(i),
            None => sim.push(r.arrival_us, Ev::Arrive(i)),
        }
    }
    let bar = if opts.progress {
        let b = ProgressBar::new(n as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta})",
            )
            .expect("static template"),
        );
        b.set_message(format!(
            "{} reuse {}",
            workload.name,
            if reuse { "ON " } else { "OFF" }
        ));
        b
    } else {
        ProgressBar::hidden()
    };
    while let Some(Reverse((now_ns, _, ev))) = sim.heap.pop() {
        let now = now_ns as f64 / 1000.0;
        match ev {
            Ev::Arrive(i) => sim.arrive(i, now),
            Ev::Enqueue(i, w) => sim.enqueue(i, w, now),
            Ev::PrefillDone(w) => {
                sim.prefill_done(w, now);
                bar.inc(1);
            }
            Ev::DecodeDone(i, d) => {
                sim.decode_done(i, d, now)?;
                for &c in &children[i] {
                    sim.push(now + reqs[c].arrival_us, Ev::Arrive(c));
                }
            }
        }
    }
    bar.finish_and_clear();
    let ttft = std::mem::take(&mut sim.ttft_ms);
    let mut m = sim.m;
    m.ttft_p50_ms = percentile(&ttft, 0.50);
    m.ttft_p90_ms = percentile(&ttft, 0.90);
    m.ttft_p99_ms = percentile(&ttft, 0.99);
    m.ttft_mean_ms = ttft.iter().sum::<f64>() / n.max(1) as f64;
    let later: Vec<f64> = reqs
        .iter()
        .zip(&ttft)
        .filter(|(r, _)| r.turn > 0)
        .map(|(_, t)| *t)
        .collect();
    m.later_turn_ttft_mean_ms = if later.is_empty() {
        0.0
    } else {
        later.iter().sum::<f64>() / later.len() as f64
    };
    m.ttft_ms = ttft;
    Ok(m)
}

/// OFF and ON runs of one workload, compared request by request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayComparison {
    /// Workload name.
    pub workload: String,
    /// Options used (printed with the results).
    pub options: ReplayOptions,
    /// Reuse OFF.
    pub off: RunMetrics,
    /// Reuse ON.
    pub on: RunMetrics,
    /// Requests whose ON TTFT exceeds OFF's by more than 1 µs.
    pub slower_than_off: u64,
    /// Requests whose ON TTFT is below OFF's by more than 1 µs.
    pub faster_than_off: u64,
}

/// Runs OFF then ON and compares.
///
/// # Errors
/// As [`run`].
///
/// ```
/// use kv_testkit::replay::{compare, ReplayOptions, Workload};
/// use kv_testkit::trace::{default_trace_path, MooncakeTrace};
/// let trace = MooncakeTrace::load(default_trace_path()).unwrap().head(50);
/// let w = Workload::from_trace(&trace, "mooncake[..50]", 16).unwrap();
/// let c = compare(&w, &ReplayOptions::default()).unwrap();
/// assert_eq!(c.off.ttft_ms.len(), 50);
/// assert!(c.on.prefill_tokens <= c.off.prefill_tokens);
/// ```
pub fn compare(workload: &Workload, opts: &ReplayOptions) -> Result<ReplayComparison, ReplayError> {
    let off = run(workload, opts, false)?;
    let on = run(workload, opts, true)?;
    let slower_than_off = off
        .ttft_ms
        .iter()
        .zip(&on.ttft_ms)
        .filter(|(o, n)| **n > **o + 1e-3)
        .count() as u64;
    let faster_than_off = off
        .ttft_ms
        .iter()
        .zip(&on.ttft_ms)
        .filter(|(o, n)| **n + 1e-3 < **o)
        .count() as u64;
    Ok(ReplayComparison {
        workload: workload.name.clone(),
        options: opts.clone(),
        off,
        on,
        slower_than_off,
        faster_than_off,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(tokens: &[u32]) -> Vec<StoredBlock> {
        block_chain(tokens, 16)
    }

    fn opts(prefill_cache_blocks: u32, decode_bank_blocks: u32) -> ReplayOptions {
        ReplayOptions {
            cluster: ClusterConfig {
                prefill_workers: 1,
                decode_workers: 1,
                tokens_per_block: 16,
                prefill_cache_blocks,
                decode_bank_blocks,
            },
            ..ReplayOptions::default()
        }
    }

    /// Turn 1: 1,600-token prompt, 160 output tokens. Turn 2 (a follow-up
    /// after 1 s): turn 1's prompt + output + 96 new tokens.
    fn two_turns() -> Workload {
        let t1: Vec<u32> = (0..1600).collect();
        let out: Vec<u32> = (5000..5160).collect();
        let mut full1 = t1.clone();
        full1.extend(&out);
        let mut t2 = full1.clone();
        t2.extend(9000..9096);
        let mut full2 = t2.clone();
        full2.extend(20_000..20_010);
        Workload {
            name: "two-turns".into(),
            tokens_per_block: 16,
            requests: vec![
                ReplayRequest {
                    arrival_us: 0.0,
                    parent: None,
                    prompt_tokens: 1600,
                    output_tokens: 160,
                    blocks: blocks(&full1),
                    turn: 0,
                },
                ReplayRequest {
                    arrival_us: 1e6,
                    parent: Some(0),
                    prompt_tokens: 1856,
                    output_tokens: 10,
                    blocks: blocks(&full2),
                    turn: 1,
                },
            ],
        }
    }

    #[test]
    fn lru_evicts_tails_before_prefixes_and_stays_bounded() {
        let mut lru = LruBlocks::new(4);
        let a = blocks(&(0..48).collect::<Vec<u32>>()); // 3 blocks
        let b = blocks(&(100..148).collect::<Vec<u32>>()); // 3 other blocks
        assert_eq!(lru.insert(&a).0.len(), 3);
        let (added, evicted) = lru.insert(&b);
        assert_eq!(added, b);
        // a's tail (block 2) then block 1 go first; a's root survives.
        assert_eq!(evicted, vec![a[2].sequence_hash, a[1].sequence_hash]);
        assert_eq!(lru.prefix_len(&a), 1);
        assert_eq!(lru.prefix_len(&b), 3);
        for _ in 0..2000 {
            lru.insert(&b);
        }
        assert!(lru.queue.len() <= 2 * lru.stamps.len() + 1024 + 3);
    }

    #[test]
    fn follow_up_fetches_the_retained_conversation_with_exact_costs() {
        // No native cache: OFF recomputes turn 2 whole; ON fetches turn 1's
        // prompt + output (1,760 tokens = 110 blocks) from the decode bank.
        let w = two_turns();
        let o = opts(0, 1000);
        let t = o.timing;
        let c = compare(&w, &o).unwrap();
        assert_eq!(c.off.prefill_tokens, 1600 + 1856);
        assert_eq!(c.on.donor_hit_tokens, 1760);
        assert_eq!(c.on.prefill_tokens, 1600 + 96);
        assert_eq!(c.on.fetches, 1);
        assert_eq!(c.on.bytes_moved, 1760 * 128 * 1024);
        let ttft_off = t.prefill_us(0, 1856) / 1000.0;
        let ttft_on = (t.lookup_us
            + t.fetch_setup_us
            + 110.0 * t.transfer_us_per_block
            + t.prefill_us(1760, 96))
            / 1000.0;
        assert!(
            (c.off.ttft_ms[1] - ttft_off).abs() < 1e-5,
            "{} vs {ttft_off}",
            c.off.ttft_ms[1]
        );
        assert!(
            (c.on.ttft_ms[1] - ttft_on).abs() < 1e-5,
            "{} vs {ttft_on}",
            c.on.ttft_ms[1]
        );
        assert_eq!(c.on.later_turn_ttft_mean_ms, c.on.ttft_ms[1]);
        // Turn 1 has nothing to reuse; it pays only the lookup latency.
        assert!((c.on.ttft_ms[0] - c.off.ttft_ms[0] - t.lookup_us / 1000.0).abs() < 1e-5);
        assert_eq!(c.slower_than_off, 1);
        assert_eq!(c.faster_than_off, 1);
    }

    #[test]
    fn native_hit_is_preferred_and_admission_can_refuse() {
        let w = two_turns();
        // A native cache large enough: turn 2 hits turn 1's 100 prompt blocks
        // natively; the donor adds the 10 output blocks beyond them.
        let c = compare(&w, &opts(1000, 1000)).unwrap();
        assert_eq!(c.off.native_hit_tokens, 1600);
        assert_eq!(c.on.native_hit_tokens, 1600);
        assert_eq!(c.on.donor_hit_tokens, 160);
        // A minimum saving above what 10 blocks can save: refused, recompute.
        let mut o = opts(1000, 1000);
        o.admission.minimum_estimated_ttft_saving_ms = 10.0;
        let c = compare(&w, &o).unwrap();
        assert_eq!(
            (c.on.donor_found, c.on.refused_by_cost, c.on.fetches),
            (1, 1, 0)
        );
        assert_eq!(c.on.prefill_tokens, c.off.prefill_tokens);
    }

    #[test]
    fn evicted_donor_blocks_mean_no_fetch() {
        // A bank of 50 blocks cannot keep turn 1's 110: it keeps the first 50
        // (tail evicted first), so the donor covers 50 blocks only.
        let c = compare(&two_turns(), &opts(0, 50)).unwrap();
        assert_eq!(c.on.donor_hit_tokens, 50 * 16);
        assert_eq!(c.on.prefill_tokens, 1600 + 1856 - 800);
    }

    #[test]
    fn trace_slice_accounting_adds_up() {
        let trace = crate::trace::MooncakeTrace::load(crate::trace::default_trace_path())
            .unwrap()
            .head(300);
        let w = Workload::from_trace(&trace, "mooncake[..300]", 16).unwrap();
        let o = ReplayOptions::default();
        let c = compare(&w, &o).unwrap();
        for m in [&c.off, &c.on] {
            assert_eq!(
                m.prefill_tokens + m.native_hit_tokens + m.donor_hit_tokens,
                m.prompt_tokens
            );
            assert!(m.ttft_ms.iter().all(|t| *t > 0.0));
            assert!(m.ttft_p50_ms <= m.ttft_p90_ms && m.ttft_p90_ms <= m.ttft_p99_ms);
        }
        assert_eq!(c.off.donor_hit_tokens, 0);
        assert!(
            c.on.donor_hit_tokens > 0,
            "the first 300 requests share prefixes across workers"
        );
        assert!(c.on.prefill_tokens < c.off.prefill_tokens);
        // Deterministic: a second run gives the same numbers.
        let again = compare(&w, &o).unwrap();
        assert_eq!(again.on.prefill_tokens, c.on.prefill_tokens);
        assert_eq!(again.on.ttft_ms, c.on.ttft_ms);
    }

    #[test]
    fn bad_options_and_requests_name_the_field() {
        let mut w = two_turns();
        let mut o = opts(10, 10);
        o.cluster.tokens_per_block = 32;
        assert!(run(&w, &o, true)
            .unwrap_err()
            .to_string()
            .contains("cluster.tokens_per_block"));
        let mut o = opts(10, 10);
        o.timing.transfer_us_per_block = f64::NAN;
        assert!(run(&w, &o, true)
            .unwrap_err()
            .to_string()
            .contains("timing.transfer_us_per_block"));
        let mut o = opts(10, 10);
        o.admission.transfer_source_gpu_estimated_block_us = 1e6; // can never save time
        assert!(run(&w, &o, true)
            .unwrap_err()
            .to_string()
            .contains("`admission`"));
        w.requests[1].parent = Some(1);
        assert!(run(&w, &opts(10, 10), true)
            .unwrap_err()
            .to_string()
            .contains("`parent`"));
        w.requests[1].blocks.pop();
        assert!(run(&w, &opts(10, 10), true)
            .unwrap_err()
            .to_string()
            .contains("`blocks`"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// What the replay publishes about a bank (the `added` / `evicted`
        /// lists turned into Stored / Removed events) always equals what the
        /// bank holds, the bank never exceeds its capacity, and the queue of
        /// lazy stamps stays bounded.
        #[test]
        fn lru_reports_mirror_its_contents(
            capacity in 1usize..24,
            seqs in proptest::collection::vec((0u32..6, 1usize..10), 1..40),
        ) {
            let mut lru = LruBlocks::new(capacity);
            let mut mirror = std::collections::HashSet::new();
            for (root, len) in seqs {
                // Conversations sharing roots: prefix `root` extended to `len` blocks.
                let tokens: Vec<u32> = (0..len as u32 * 16).map(|t| if t < 16 { root } else { root * 1000 + t }).collect();
                let chain = blocks(&tokens);
                let (added, evicted) = lru.insert(&chain);
                for h in &evicted {
                    proptest::prop_assert!(mirror.remove(h), "evicted a block never reported");
                }
                for b in &added {
                    proptest::prop_assert!(mirror.insert(b.sequence_hash), "added a block already held");
                }
                let held: std::collections::HashSet<_> = lru.stamps.keys().copied().collect();
                proptest::prop_assert_eq!(&held, &mirror);
                proptest::prop_assert!(held.len() <= capacity);
                proptest::prop_assert!(lru.queue.len() <= 2 * held.len() + 1024 + chain.len());
                // The freshest request's prefix is kept before its tail.
                let k = lru.prefix_len(&chain);
                proptest::prop_assert!(chain[..k].iter().all(|b| held.contains(&b.sequence_hash)));
                proptest::prop_assert_eq!(k, chain.len().min(capacity));
            }
        }
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
