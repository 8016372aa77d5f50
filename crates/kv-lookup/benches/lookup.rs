//! `cargo bench -p kv-lookup --bench lookup -- [--json FILE] [--quick]`
//!
//! Runs the same event streams and lookups through `kv_lookup::InventoryIndex`
//! and `dynamo-kv-router` 1.6.1's `RadixTree` in one process and prints one
//! row per metric with the ratio between them (ratio > 1: ours is better;
//! for latencies `dynamo / ours`, for rates `ours / dynamo`).
//!
//! Workloads:
//! - `synthetic`: 64 workers (32 decode publishing retained blocks, 32
//!   prefill publishing device blocks), >= 1M distinct blocks: 2,048 shared
//!   16-block system prompts, each conversation one of them plus 112 own
//!   blocks, stored whole by one decode and as a random prefix by one
//!   prefill. Lookups are 128-block requests: a stored conversation's first
//!   64..=128 blocks, then fresh blocks, on a random prefill target.
//! - `mooncake`: the project's copy of the Mooncake conversation trace; every
//!   512-token hash id expands to 512 synthetic token ids derived from the id,
//!   truncated to `input_length`, re-hashed at `--block-size` tokens with
//!   `kv_descriptor`. Requests go round-robin to 32 prefill and 32 decode
//!   workers; each request is first looked up on its prefill target, then
//!   both workers publish the blocks they did not hold (parent = last held).
//!
//! After its lookups the synthetic workload removes every announced block
//! again (Removed events in store order): the `apply removed blocks` row.
//!
//! Event rates count blocks carried by events, over the time spent inside the
//! apply call; lookup latencies time each call alone.

use std::collections::HashSet;
use std::io::BufRead;
use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::RadixTree;
use kv_descriptor::{
    chain_sequence_hash, token_block_hashes, EngineId, KvEvent, KvEventData, LayoutFingerprint,
    Role, SequenceHash, StorageTier, StoredBlock, TokenBlockHash,
};
use kv_lookup::{InventoryIndex, LookupBudget, WorkerInfo, WorkerKey};

/// One block: (sequence hash, token hash).
type Block = (u64, u64);

struct Args {
    json: Option<String>,
    quick: bool,
    block_size: usize,
    trace_requests: usize,
    trace: String,
}

fn parse_args() -> Args {
    let mut a = Args {
        json: None,
        quick: false,
        block_size: 16,
        trace_requests: usize::MAX,
        trace: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/mooncake_conversation_trace.jsonl"
        )
        .into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => a.json = it.next(),
            "--quick" => a.quick = true,
            "--block-size" => {
                a.block_size = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--block-size N")
            }
            "--trace-requests" => {
                a.trace_requests = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--trace-requests N")
            }
            "--trace" => a.trace = it.next().expect("--trace PATH"),
            // cargo bench passes `--bench`; libtest-style filters are ignored too.
            _ => {}
        }
    }
    a
}

struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Appends `tokens` fresh blocks chained on `parent`.
fn chain_blocks(parent: Option<u64>, tok: impl IntoIterator<Item = u64>) -> Vec<Block> {
    let mut p = parent.map(SequenceHash);
    tok.into_iter()
        .map(|t| {
            let s = chain_sequence_hash(p, TokenBlockHash(t));
            p = Some(s);
            (s.0, t)
        })
        .collect()
}

/// Something that happens to an index, independent of the implementation.
enum Op<'a> {
    /// Worker `worker` publishes `blocks` (children of `parent`) in `tier`.
    Store {
        worker: usize,
        tier: StorageTier,
        parent: Option<Block>,
        blocks: &'a [Block],
    },
    /// Lookup of `blocks` for prefill target `worker`.
    Lookup { worker: usize, blocks: &'a [Block] },
    /// Worker `worker` drops `blocks` from `tier`.
    Remove {
        worker: usize,
        tier: StorageTier,
        blocks: &'a [Block],
    },
}

const WORKERS: usize = 64;
const DECODES: usize = 32;
const FP: LayoutFingerprint = LayoutFingerprint(0x5EED);

fn role(w: usize) -> Role {
    if w < DECODES {
        Role::Decode
    } else {
        Role::Prefill
    }
}

#[derive(Default)]
struct Measured {
    block_events: u64,
    apply_ns: u64,
    removed_blocks: u64,
    remove_ns: u64,
    lookups_ns: Vec<u64>,
    found: u64,
    exhausted: u64,
    probes: u64,
    note: String,
}

impl Measured {
    fn events_per_s(&self) -> f64 {
        self.block_events as f64 / (self.apply_ns as f64 / 1e9)
    }
    fn removals_per_s(&self) -> f64 {
        self.removed_blocks as f64 / (self.remove_ns as f64 / 1e9)
    }
    fn pct(&mut self, p: f64) -> f64 {
        self.lookups_ns.sort_unstable();
        let i = ((self.lookups_ns.len() as f64 - 1.0) * p).round() as usize;
        self.lookups_ns[i] as f64 / 1e3
    }
}

/// Drives `kv_lookup` through `ops`.
fn run_ours<'a>(ops: impl Iterator<Item = Op<'a>>, capacity: usize) -> Measured {
    let index = InventoryIndex::with_capacity(capacity);
    let engines: Vec<EngineId> = (0..WORKERS).map(|w| EngineId(uuid_for(w))).collect();
    for (w, &engine) in engines.iter().enumerate() {
        let info = WorkerInfo {
            engine,
            role: role(w),
            layout_fingerprint: FP,
            tp_size: 1,
        };
        index.register_worker(WorkerKey(w as u64), info).unwrap();
    }
    let mut next_id = vec![1u64; WORKERS];
    let mut m = Measured::default();
    let mut hashes: Vec<SequenceHash> = Vec::new();
    for op in ops {
        match op {
            Op::Store {
                worker,
                tier,
                parent,
                blocks,
            } => {
                let e = KvEvent {
                    publisher: engines[worker],
                    event_id: next_id[worker],
                    role: role(worker),
                    layout_fingerprint: FP,
                    tp_size: 1,
                    tier,
                    data: KvEventData::Stored {
                        parent: parent.map(|b| SequenceHash(b.0)),
                        blocks: blocks
                            .iter()
                            .map(|&(s, t)| StoredBlock {
                                sequence_hash: SequenceHash(s),
                                token_hash: TokenBlockHash(t),
                            })
                            .collect(),
                    },
                };
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = index.apply_event(&e);
                m.apply_ns += t0.elapsed().as_nanos() as u64;
                assert!(
                    matches!(r, Ok(kv_lookup::EventOutcome::Applied { .. })),
                    "{r:?}"
                );
                m.block_events += blocks.len() as u64;
            }
            Op::Remove {
                worker,
                tier,
                blocks,
            } => {
                let e = KvEvent {
                    publisher: engines[worker],
                    event_id: next_id[worker],
                    role: role(worker),
                    layout_fingerprint: FP,
                    tp_size: 1,
                    tier,
                    data: KvEventData::Removed {
                        sequence_hashes: blocks.iter().map(|b| SequenceHash(b.0)).collect(),
                    },
                };
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = index.apply_event(&e);
                m.remove_ns += t0.elapsed().as_nanos() as u64;
                assert!(
                    matches!(r, Ok(kv_lookup::EventOutcome::Applied { .. })),
                    "{r:?}"
                );
                m.removed_blocks += blocks.len() as u64;
            }
            Op::Lookup { worker, blocks } => {
                hashes.clear();
                hashes.extend(blocks.iter().map(|b| SequenceHash(b.0)));
                let t0 = Instant::now();
                let out = index.lookup(&hashes, engines[worker], LookupBudget::default());
                m.lookups_ns.push(t0.elapsed().as_nanos() as u64);
                m.found += out.donor.is_ok() as u64;
                m.exhausted += out.budget_exhausted as u64;
                m.probes += u64::from(out.probes);
            }
        }
    }
    let s = index.stats();
    m.note = format!(
        "{} distinct blocks, {} held (worker, block) pairs, {:.0} MiB table",
        s.entries,
        s.held_blocks.iter().sum::<u64>(),
        s.table_bytes as f64 / (1 << 20) as f64
    );
    m
}

/// Drives dynamo's `RadixTree` through the same `ops`.
fn run_dynamo<'a>(ops: impl Iterator<Item = Op<'a>>) -> Measured {
    let mut tree = RadixTree::new();
    let mut next_id = vec![1u64; WORKERS];
    let mut m = Measured::default();
    for op in ops {
        match op {
            Op::Store {
                worker,
                parent,
                blocks,
                ..
            } => {
                let e = RouterEvent::new(
                    worker as u64,
                    KvCacheEvent {
                        event_id: next_id[worker],
                        data: KvCacheEventData::Stored(KvCacheStoreData {
                            parent_hash: parent.map(|b| ExternalSequenceBlockHash(b.0)),
                            start_position: None,
                            blocks: blocks
                                .iter()
                                .map(|&(s, t)| KvCacheStoredBlockData {
                                    block_hash: ExternalSequenceBlockHash(s),
                                    tokens_hash: LocalBlockHash(t),
                                    mm_extra_info: None,
                                })
                                .collect(),
                        }),
                        dp_rank: 0,
                    },
                );
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = tree.apply_event(e);
                m.apply_ns += t0.elapsed().as_nanos() as u64;
                assert!(r.is_ok(), "dynamo refused an event: {r:?}");
                m.block_events += blocks.len() as u64;
            }
            Op::Remove { worker, blocks, .. } => {
                let e = RouterEvent::new(
                    worker as u64,
                    KvCacheEvent {
                        event_id: next_id[worker],
                        data: KvCacheEventData::Removed(KvCacheRemoveData {
                            block_hashes: blocks
                                .iter()
                                .map(|b| ExternalSequenceBlockHash(b.0))
                                .collect(),
                        }),
                        dp_rank: 0,
                    },
                );
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = tree.apply_event(e);
                m.remove_ns += t0.elapsed().as_nanos() as u64;
                assert!(r.is_ok(), "dynamo refused a removal: {r:?}");
                m.removed_blocks += blocks.len() as u64;
            }
            Op::Lookup { blocks, .. } => {
                let seq: Vec<LocalBlockHash> = blocks.iter().map(|b| LocalBlockHash(b.1)).collect();
                let t0 = Instant::now();
                let scores = tree.find_matches(seq, false);
                m.lookups_ns.push(t0.elapsed().as_nanos() as u64);
                m.found += !scores.scores.is_empty() as u64;
            }
        }
    }
    m.note = format!("{} tree blocks", tree.current_size());
    m
}

fn uuid_for(w: usize) -> uuid::Uuid {
    uuid::Uuid::from_u64_pair(0xC0FFEE, w as u64 + 1)
}

/// Synthetic workload: shared roots, per-conversation tails, 128-block lookups.
struct Synthetic {
    convs: Vec<Vec<Block>>,
    /// (decode worker, prefill worker, prefill prefix length) per conversation.
    owners: Vec<(usize, usize, usize)>,
    requests: Vec<(usize, Vec<Block>)>,
}

fn synthetic(quick: bool) -> Synthetic {
    let mut rng = SplitMix(42);
    let roots: Vec<Vec<Block>> = (0..2048)
        .map(|_| chain_blocks(None, (0..16).map(|_| rng.next())))
        .collect();
    let n_convs = if quick { 1_000 } else { 9_400 };
    let mut convs = Vec::with_capacity(n_convs);
    let mut owners = Vec::with_capacity(n_convs);
    for c in 0..n_convs {
        let mut conv = roots[c % roots.len()].clone();
        let tail = chain_blocks(conv.last().map(|b| b.0), (0..112).map(|_| rng.next()));
        conv.extend(tail);
        convs.push(conv);
        owners.push((
            rng.below(DECODES as u64) as usize,
            DECODES + rng.below(DECODES as u64) as usize,
            16 + rng.below(97) as usize,
        ));
    }
    let n_req = if quick { 2_000 } else { 20_000 };
    let requests = (0..n_req)
        .map(|_| {
            let conv = &convs[rng.below(convs.len() as u64) as usize];
            let keep = 64 + rng.below(65) as usize;
            let mut req = conv[..keep].to_vec();
            let tail = chain_blocks(req.last().map(|b| b.0), (0..128 - keep).map(|_| rng.next()));
            req.extend(tail);
            (DECODES + rng.below(DECODES as u64) as usize, req)
        })
        .collect();
    Synthetic {
        convs,
        owners,
        requests,
    }
}

/// Store ops for `blocks` on `worker`, skipping what it already holds
/// (engines only announce new blocks, parented on the last held one).
fn new_suffix<'a>(
    held: &mut HashSet<u64>,
    blocks: &'a [Block],
) -> Option<(Option<Block>, &'a [Block])> {
    let start = blocks.iter().position(|b| !held.contains(&b.0))?;
    held.extend(blocks[start..].iter().map(|b| b.0));
    Some((start.checked_sub(1).map(|i| blocks[i]), &blocks[start..]))
}

fn synthetic_ops(s: &Synthetic) -> impl Iterator<Item = Op<'_>> {
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); WORKERS];
    let mut stores = Vec::new();
    for (conv, &(d, p, plen)) in s.convs.iter().zip(&s.owners) {
        if let Some((parent, blocks)) = new_suffix(&mut held[d], conv) {
            stores.push(Op::Store {
                worker: d,
                tier: StorageTier::RetainedGpuDirect,
                parent,
                blocks,
            });
        }
        if let Some((parent, blocks)) = new_suffix(&mut held[p], &conv[..plen]) {
            stores.push(Op::Store {
                worker: p,
                tier: StorageTier::Device,
                parent,
                blocks,
            });
        }
    }
    // After the lookups every worker drops what it announced, in order.
    let removals: Vec<Op<'_>> = stores
        .iter()
        .map(|op| match op {
            Op::Store {
                worker,
                tier,
                blocks,
                ..
            } => Op::Remove {
                worker: *worker,
                tier: *tier,
                blocks,
            },
            _ => unreachable!("only stores so far"),
        })
        .collect();
    stores
        .into_iter()
        .chain(s.requests.iter().map(|(w, r)| Op::Lookup {
            worker: *w,
            blocks: r,
        }))
        .chain(removals)
}

/// Mooncake requests as block lists at `block_size` tokens.
fn mooncake(path: &str, block_size: usize, limit: usize) -> Vec<Vec<Block>> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("cannot open trace {path}: {e}"));
    let mut out = Vec::new();
    let mut tokens: Vec<u32> = Vec::new();
    for line in std::io::BufReader::new(f).lines().take(limit) {
        let v: serde_json::Value =
            serde_json::from_str(&line.unwrap()).expect("trace line is JSON");
        let input = v["input_length"].as_u64().expect("input_length") as usize;
        tokens.clear();
        for id in v["hash_ids"].as_array().expect("hash_ids") {
            let id = id.as_u64().expect("hash id");
            let mut g = SplitMix(id.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5);
            tokens.extend((0..512).map(|_| (g.next() % 128_000) as u32));
        }
        tokens.truncate(input);
        let toks = token_block_hashes(&tokens, block_size);
        out.push(chain_blocks(None, toks.into_iter().map(|t| t.0)));
    }
    out
}

fn mooncake_ops(reqs: &[Vec<Block>]) -> impl Iterator<Item = Op<'_>> {
    let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); WORKERS];
    let mut ops = Vec::new();
    for (r, blocks) in reqs.iter().enumerate() {
        if blocks.is_empty() {
            continue;
        }
        let (p, d) = (DECODES + r % DECODES, r % DECODES);
        ops.push(Op::Lookup { worker: p, blocks });
        for (w, tier) in [
            (p, StorageTier::Device),
            (d, StorageTier::RetainedGpuDirect),
        ] {
            if let Some((parent, b)) = new_suffix(&mut held[w], blocks) {
                ops.push(Op::Store {
                    worker: w,
                    tier,
                    parent,
                    blocks: b,
                });
            }
        }
    }
    ops.into_iter()
}

struct Row {
    name: String,
    ours: f64,
    dynamo: f64,
    unit: &'static str,
    ratio: f64,
}

fn rows_for(prefix: &str, ours: &mut Measured, dynamo: &mut Measured) -> Vec<Row> {
    let mut rows = Vec::new();
    for (label, p) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
        let (o, d) = (ours.pct(p), dynamo.pct(p));
        rows.push(Row {
            name: format!("{prefix} lookup {label}"),
            ours: o,
            dynamo: d,
            unit: "us",
            ratio: d / o,
        });
    }
    let (o, d) = (ours.events_per_s(), dynamo.events_per_s());
    rows.push(Row {
        name: format!("{prefix} apply stored blocks"),
        ours: o,
        dynamo: d,
        unit: "blocks/s",
        ratio: o / d,
    });
    if ours.removed_blocks > 0 {
        let (o, d) = (ours.removals_per_s(), dynamo.removals_per_s());
        rows.push(Row {
            name: format!("{prefix} apply removed blocks"),
            ours: o,
            dynamo: d,
            unit: "blocks/s",
            ratio: o / d,
        });
    }
    rows
}

fn main() {
    let args = parse_args();
    let t_all = Instant::now();
    let mut rows = Vec::new();

    let s = synthetic(args.quick);
    let capacity = s.convs.len() * 112 + 2048 * 16;
    let mut ours = run_ours(synthetic_ops(&s), capacity);
    let mut dynamo = run_dynamo(synthetic_ops(&s));
    println!(
        "synthetic: {} workers; ours: {}; dynamo: {}; lookups {} (ours found a donor in {}, {} budget-exhausted, {:.1} probes avg; dynamo matched {})",
        WORKERS,
        ours.note,
        dynamo.note,
        ours.lookups_ns.len(),
        ours.found,
        ours.exhausted,
        ours.probes as f64 / ours.lookups_ns.len() as f64,
        dynamo.found
    );
    rows.extend(rows_for(
        &format!("synthetic {}k-conv/64w", s.convs.len() / 1000),
        &mut ours,
        &mut dynamo,
    ));
    drop(s);

    let limit = if args.quick {
        1_500
    } else {
        args.trace_requests
    };
    let reqs = mooncake(&args.trace, args.block_size, limit);
    let mut ours = run_ours(mooncake_ops(&reqs), 0);
    let mut dynamo = run_dynamo(mooncake_ops(&reqs));
    println!(
        "mooncake: {} requests at {} tokens/block; ours: {}; dynamo: {}; ours found a donor in {} ({} budget-exhausted, {:.1} probes avg)",
        reqs.len(),
        args.block_size,
        ours.note,
        dynamo.note,
        ours.found,
        ours.exhausted,
        ours.probes as f64 / ours.lookups_ns.len() as f64,
    );
    rows.extend(rows_for(
        &format!("mooncake bs{}", args.block_size),
        &mut ours,
        &mut dynamo,
    ));

    println!(
        "\n{:<40} {:>14} {:>14} {:>9} {:>8}",
        "name", "ours", "dynamo", "unit", "ratio"
    );
    for r in &rows {
        println!(
            "{:<40} {:>14.3} {:>14.3} {:>9} {:>8.2}",
            r.name, r.ours, r.dynamo, r.unit, r.ratio
        );
    }
    let goal = |name: &str| {
        rows.iter()
            .find(|r| r.name.ends_with(name) && r.name.starts_with("synthetic"))
    };
    if let (Some(p99), Some(rate)) = (goal("lookup p99"), goal("apply stored blocks")) {
        println!(
            "goals: synthetic 128-block lookup p99 {:.2} us (<= 5: {}), {:.1}M block events/s on one core (>= 5M: {})",
            p99.ours,
            if p99.ours <= 5.0 { "met" } else { "MISSED" },
            rate.ours / 1e6,
            if rate.ours >= 5e6 { "met" } else { "MISSED" }
        );
    }
    let slower: Vec<&str> = rows
        .iter()
        .filter(|r| r.ratio < 1.0)
        .map(|r| r.name.as_str())
        .collect();
    println!(
        "rows where dynamo was faster: {}",
        if slower.is_empty() {
            "none".to_string()
        } else {
            slower.join(", ")
        }
    );
    println!(
        "(ratio > 1: kv-lookup better; latencies dynamo/ours, rates ours/dynamo)  total {:.1}s",
        t_all.elapsed().as_secs_f64()
    );

    if let Some(path) = args.json {
        let json: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| serde_json::json!({"name": r.name, "ours": r.ours, "dynamo": r.dynamo, "unit": r.unit, "ratio": r.ratio}))
            .collect();
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap())
            .unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
