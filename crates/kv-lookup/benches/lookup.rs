//! `cargo bench -p kv-lookup --bench lookup -- [--json FILE] [--quick]
//! [--threads T+E,...] [--seconds S] [--only single|concurrent|interference]
//! [--rounds R]`
//!
//! Runs the same event streams and lookups through `kv_lookup::InventoryIndex`
//! and every dynamo-kv-router 1.6.1 indexer that takes these events (`RadixTree`,
//! `ConcurrentRadixTreeCompressed` in its `ThreadPoolIndexer`, `PositionalIndexer`)
//! in one process and prints one row per metric and baseline with the ratio
//! (ratio > 1: ours is better; for latencies `dynamo / ours`, for rates
//! `ours / dynamo`). Single-threaded rows first, then the concurrent rows of
//! `lookup/concurrent.rs` for each `T+E` (lookup threads + event threads;
//! default `1+1` with `--quick`, else `1+1,2+2,4+4,8+8`; `T+0` is the
//! lookups-alone baseline, against which a `T+E` row's lookups/s show what
//! the event threads cost the lookups), `S` seconds each
//! (default 1 with `--quick`, else 2). Ours runs the concurrent load twice
//! with the same events: per event (`apply_event`, each event visible when
//! its call returns: rows `T+E lookups/s` etc., against each dynamo indexer)
//! and batched (64 events of a thread per `apply_events` call, visible per
//! batch, the contract of crtc-pool's flush every 64 events: rows
//! `T+E batched lookups/s` etc., against the best dynamo indexer of each
//! metric); events count once visible. Not measured: `BranchShardedIndexer`
//! (a router-side sharding of the same CRTC shards) and the cuckoo-filter
//! `DcCkfState` / `LocalCkfAdapter` (approximate membership, keyed by
//! canonical hashes these workloads do not produce). `--only interference`
//! runs neither table but `lookup/interference.rs`'s rows: each indexer's
//! lookups under another index's event load (synthetic workload only), each
//! row `R` pairs of a lone run and a loaded run (default 3).
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

#[path = "lookup/concurrent.rs"]
mod concurrent;
#[path = "lookup/flash.rs"]
mod flash;
#[path = "lookup/interference.rs"]
mod interference;
#[path = "lookup/rows.rs"]
mod rows;

use rows::{concurrent_rows, single_rows, Row};

/// One block: (sequence hash, token hash).
type Block = (u64, u64);

struct Args {
    json: Option<String>,
    quick: bool,
    block_size: usize,
    trace_requests: usize,
    trace: String,
    /// (lookup threads, event threads) of each concurrent run.
    threads: Vec<(usize, usize)>,
    seconds: f64,
    single: bool,
    concurrent: bool,
    /// `--only interference` (`lookup/interference.rs`).
    interference: bool,
    /// `--rounds R`: pairs per interference row.
    rounds: usize,
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
        threads: Vec::new(),
        seconds: 0.0,
        single: true,
        concurrent: true,
        interference: false,
        rounds: 3,
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
            "--threads" => {
                a.threads = it
                    .next()
                    .expect("--threads T+E,...")
                    .split(',')
                    .map(|p| {
                        let (t, e) = p.split_once('+').expect("--threads T+E,...");
                        (t.parse().expect("T"), e.parse().expect("E"))
                    })
                    .collect()
            }
            "--rounds" => a.rounds = it.next().and_then(|v| v.parse().ok()).expect("--rounds R"),
            "--seconds" => a.seconds = it.next().and_then(|v| v.parse().ok()).expect("--seconds S"),
            "--only" => match it.next().as_deref() {
                Some("single") => a.concurrent = false,
                Some("concurrent") => a.single = false,
                Some("interference") => {
                    (a.single, a.concurrent, a.interference) = (false, false, true)
                }
                other => panic!("--only single|concurrent|interference, got {other:?}"),
            },
            // cargo bench passes `--bench`; libtest-style filters are ignored too.
            _ => {}
        }
    }
    if a.threads.is_empty() {
        a.threads = if a.quick {
            vec![(1, 1)]
        } else {
            vec![(1, 1), (2, 2), (4, 4), (8, 8)]
        };
    }
    if a.seconds == 0.0 {
        a.seconds = if a.quick { 1.0 } else { 2.0 };
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
    drive_ours(ops, capacity).0
}

/// `ops` applied to a fresh index: the index, its workers' engines and their
/// next event ids (for [`concurrent`]).
fn load_ours<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    capacity: usize,
) -> (InventoryIndex, Vec<EngineId>, Vec<u64>) {
    let (_, index, engines, next_id) = drive_ours(ops, capacity);
    (index, engines, next_id)
}

fn drive_ours<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    capacity: usize,
) -> (Measured, InventoryIndex, Vec<EngineId>, Vec<u64>) {
    let rss_before = resident_bytes();
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
                                slot: None,
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
    let rss_growth = resident_bytes().saturating_sub(rss_before);
    m.note = format!(
        "{} distinct blocks, {} held (worker, block) pairs, {:.0} MiB table, \
         resident memory +{:.0} MiB",
        s.entries,
        s.held_blocks.iter().sum::<u64>(),
        s.table_bytes as f64 / (1 << 20) as f64,
        rss_growth as f64 / (1 << 20) as f64
    );
    (m, index, engines, next_id)
}

/// The process's resident memory in bytes (`/proc/self/statm`, field 2, in
/// 4 KiB pages on the x86-64 hosts this runs on); 0 where it cannot be read.
/// Freed small allocations stay resident, so growth across a build-and-drain
/// run is about its peak heap.
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
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

fn main() {
    let args = parse_args();
    let t_all = Instant::now();
    let mut rows = Vec::new();
    println!(
        "threads available: {}; concurrent runs T+E: {:?}, {} s each",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.threads,
        args.seconds
    );

    let s = synthetic(args.quick);
    let capacity = s.convs.len() * 112 + 2048 * 16;
    let prefix = format!("synthetic {}k-conv/64w", s.convs.len() / 1000);
    if args.single {
        rows.extend(single_rows(&prefix, || synthetic_ops(&s), capacity));
    }
    if args.concurrent {
        // Retained inventory loaded, then lookups of the same requests.
        let stores = || synthetic_ops(&s).filter(|op| matches!(op, Op::Store { .. }));
        rows.extend(concurrent_rows(
            &prefix,
            &args,
            stores,
            capacity,
            &s.requests,
        ));
    }
    if args.interference {
        let stores = || synthetic_ops(&s).filter(|op| matches!(op, Op::Store { .. }));
        interference::interference_rows(
            &prefix,
            &args.threads,
            args.seconds,
            args.rounds,
            stores,
            capacity,
            &s.requests,
        );
        return;
    }
    drop(s);

    let limit = if args.quick {
        1_500
    } else {
        args.trace_requests
    };
    let reqs = mooncake(&args.trace, args.block_size, limit);
    let prefix = format!("mooncake bs{}", args.block_size);
    if args.single {
        rows.extend(single_rows(&prefix, || mooncake_ops(&reqs), 0));
    }
    if args.concurrent {
        let requests: Vec<(usize, Vec<Block>)> = reqs
            .iter()
            .enumerate()
            .filter(|(_, b)| !b.is_empty())
            .map(|(r, b)| (DECODES + r % DECODES, b.clone()))
            .collect();
        let stores = || mooncake_ops(&reqs).filter(|op| !matches!(op, Op::Lookup { .. }));
        rows.extend(concurrent_rows(&prefix, &args, stores, 0, &requests));
    }

    println!(
        "\n{:<58} {:>11} {:>14} {:>14} {:>9} {:>8}",
        "name", "vs dynamo", "ours", "dynamo", "unit", "ratio"
    );
    for r in &rows {
        println!(
            "{:<58} {:>11} {:>14.3} {:>14.3} {:>9} {:>8.2}",
            r.name, r.vs, r.ours, r.dynamo, r.unit, r.ratio
        );
    }
    let synth_p99 = rows
        .iter()
        .find(|r| r.name.starts_with("synthetic") && r.name.ends_with("lookup p99"));
    if let Some(p99) = synth_p99 {
        println!(
            "goal: synthetic 128-block lookup p99 {:.2} us (<= 2: {})",
            p99.ours,
            if p99.ours <= 2.0 { "met" } else { "MISSED" }
        );
    }
    let loaded: Vec<&Row> = rows
        .iter()
        .filter(|r| r.name.ends_with("lookup p99 under load"))
        .collect();
    if !loaded.is_empty() {
        let worst = loaded.iter().map(|r| r.ours).fold(0.0, f64::max);
        println!(
            "goal: lookup p99 under load <= 10 us: worst {worst:.2} us ({})",
            if worst <= 10.0 { "met" } else { "MISSED" }
        );
    }
    let slower: Vec<String> = rows
        .iter()
        .filter(|r| r.ratio < 1.0)
        .map(|r| format!("{} (vs {})", r.name, r.vs))
        .collect();
    println!(
        "rows where dynamo was better: {}",
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
            .map(|r| serde_json::json!({"name": r.name, "vs": r.vs, "ours": r.ours, "dynamo": r.dynamo, "unit": r.unit, "ratio": r.ratio}))
            .collect();
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap())
            .unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
        println!("wrote {path}");
    }
}
