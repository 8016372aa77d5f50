//! Concurrent rows: `T` threads issue lookups while `E` threads apply KV
//! events, for kv-lookup and for dynamo-kv-router 1.6.1's concurrent indexers,
//! each first loaded with the same workload (single-threaded, untimed).
//!
//! Event load: each event thread owns the decode workers `w` with
//! `w % E == thread` and cycles through its own fresh 64-block root chains:
//! it stores one on its next worker (retained tier) and, once that worker
//! holds `KEEP` churn chains, removes the oldest, so the index size stays
//! put. Lookups are the workload's requests, round robin per thread.
//!
//! How each indexer takes events, and when an event counts (only once it is
//! visible to lookups, so the same events are compared under two contracts):
//! - ours, per event ([`Publish::PerEvent`], the strict contract):
//!   `InventoryIndex::apply_event` on the event thread; the event is visible
//!   to every lookup when the call returns (read-your-writes), and counts then;
//! - ours, batched ([`Publish::Batched`], crtc-pool's contract): each event
//!   thread collects its next [`BATCH`] events and applies them with one
//!   `InventoryIndex::apply_events` call (one publication: lookups see the
//!   64 at once when it returns); they count when it returns, events still
//!   collected when the run stops do not count;
//! - `positional`: `PositionalIndexer::apply_event` on the event thread, with
//!   the per-writer block map Dynamo's pool threads keep (churn under
//!   `dp_rank` 1, so each thread's map knows everything its writers hold);
//! - `crtc-pool`: `ConcurrentRadixTreeCompressed` in a `ThreadPoolIndexer`
//!   with `E` pool threads (its `apply_event` is private); one producer
//!   thread enqueues the same churn and waits for a flush every [`BATCH`]
//!   events, so queues stay bounded; events count when their flush
//!   returns (all applied and visible), events enqueued after the last
//!   flush do not count. Dynamo gets `E + 1` event-side threads there.
//!
//! Measured over `secs` of wall time: lookups/s, KV events/s (one event is
//! one 64-block store or removal), their sum, and the p99 of every lookup's
//! own latency under that load.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::{
    concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed, positional::PositionalIndexer,
    SyncIndexer, ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::LocalBlockHash;
use kv_descriptor::{
    EngineId, KvEvent, KvEventData, SequenceHash, StorageTier, StoredBlock, TokenBlockHash,
};
use kv_lookup::{EventOutcome, LookupBudget};

use crate::flash::{local_hashes, removed_event, stored_event, JUMP};
use crate::{chain_blocks, role, Block, Op, SplitMix, DECODES, FP};

/// Churn chains a worker holds before its oldest is removed.
const KEEP: usize = 4;
/// Blocks per churn chain (one KV event).
const CHURN_LEN: usize = 64;
/// Events per publication of crtc-pool (one flush) and of ours batched
/// (one `apply_events` call).
pub(crate) const BATCH: usize = 64;

/// How kv-lookup's event threads publish their events: the visibility
/// contract a row of ours measures.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Publish {
    /// One `apply_event` per event: visible when the call returns.
    PerEvent,
    /// One `apply_events` per [`BATCH`] events of a thread: visible together
    /// when the call returns, as crtc-pool's events at its flush.
    Batched,
    /// One `apply_event` per event, each event a removal of blocks no
    /// worker holds: a publication per event that changes no entry, only
    /// the publisher's event id (a diagnostic load of `--only
    /// interference`, which separates the cost of publishing from that of
    /// the writes).
    NoChange,
}

/// One concurrent measurement.
pub(crate) struct Load {
    pub(crate) lookups_per_s: f64,
    pub(crate) events_per_s: f64,
    pub(crate) p99_us: f64,
    /// Lookups flagged `budget_exhausted` (ours only; time budget, e.g. when
    /// descheduled).
    pub(crate) exhausted: u64,
    /// Most probes one lookup spent (ours only).
    pub(crate) max_probes: u32,
}

/// Fresh churn chains: `per_thread` for each of `e` event threads
/// (thread `k` uses chains `k, k + e, ...`); none for `e == 0`, the
/// lookups-alone baseline (`T+0`).
pub(crate) fn churn_chains(e: usize, seed: u64) -> (Vec<Vec<Block>>, usize) {
    if e == 0 {
        return (Vec::new(), 0);
    }
    let owned = DECODES.div_ceil(e);
    // A chain comes back only after its previous holder removed it.
    let per_thread = 2 * (KEEP + 1) * owned + 8;
    let mut rng = SplitMix(seed);
    let chains = (0..per_thread * e)
        .map(|_| chain_blocks(None, (0..CHURN_LEN).map(|_| rng.next())))
        .collect();
    (chains, per_thread)
}

/// A store (`remove == false`) or removal of `blocks` by decode `worker`.
pub(crate) struct Write<'a> {
    worker: usize,
    remove: bool,
    blocks: &'a [Block],
}

/// Event thread `k`'s apply function: takes the thread's next write and
/// returns how many events became visible to lookups during the call (all
/// earlier writes of the thread not counted yet, this one included).
pub(crate) type Apply = Box<dyn FnMut(&Write<'_>) -> u64 + Send>;

/// Runs `t` lookup threads and `e` event threads for `secs`; `writer(k)`
/// makes event thread `k`'s apply function, `lookup(r)` does the lookup of
/// request `r` (`0..requests`) and returns (budget exhausted, probes).
/// Events count when their apply function reports them visible.
///
/// Each indexer's request keys are built once before the run (a router has
/// them from hashing the prompt), so a timed lookup is the index's own work:
/// no per-request allocation or copy of a request's (up to ~8k) hashes.
pub(crate) fn drive<W, L>(
    t: usize,
    e: usize,
    secs: f64,
    requests: usize,
    chains: &(Vec<Vec<Block>>, usize),
    writer: W,
    lookup: L,
) -> Load
where
    W: Fn(usize) -> Apply + Sync,
    L: Fn(usize) -> (bool, u32) + Sync,
{
    let stop = AtomicBool::new(false);
    let events = AtomicU64::new(0);
    let start = Instant::now();
    let (lat, exhausted, max_probes, lookups) = std::thread::scope(|s| {
        for k in 0..e {
            let (stop, events, writer) = (&stop, &events, &writer);
            s.spawn(move || {
                let mut apply = writer(k);
                let owned: Vec<usize> = (0..DECODES).filter(|w| w % e == k).collect();
                let mut held: Vec<VecDeque<usize>> = vec![VecDeque::new(); DECODES];
                let mut n = 0u64;
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let c = k + (i % chains.1) * e;
                    let w = owned[i % owned.len()];
                    n += apply(&Write {
                        worker: w,
                        remove: false,
                        blocks: &chains.0[c],
                    });
                    held[w].push_back(c);
                    if held[w].len() > KEEP {
                        let old = held[w].pop_front().expect("held");
                        n += apply(&Write {
                            worker: w,
                            remove: true,
                            blocks: &chains.0[old],
                        });
                    }
                    i += 1;
                }
                events.fetch_add(n, Ordering::Relaxed);
            });
        }
        let readers: Vec<_> = (0..t)
            .map(|k| {
                let (stop, lookup) = (&stop, &lookup);
                s.spawn(move || {
                    let mut lat = Vec::with_capacity(1 << 20);
                    let (mut exhausted, mut max_probes) = (0u64, 0u32);
                    let mut i = k * 7919;
                    while !stop.load(Ordering::Relaxed) {
                        let t0 = Instant::now();
                        let (ex, probes) = lookup(i % requests);
                        lat.push(t0.elapsed().as_nanos() as u64);
                        exhausted += ex as u64;
                        max_probes = max_probes.max(probes);
                        i += 1;
                    }
                    (lat, exhausted, max_probes)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        let (mut ex, mut mp) = (0, 0);
        for r in readers {
            let (l, e, p) = r.join().expect("lookup thread");
            all.extend(l);
            ex += e;
            mp = mp.max(p);
        }
        let n = all.len() as u64;
        (all, ex, mp, n)
    });
    let wall = start.elapsed().as_secs_f64();
    let mut lat = lat;
    lat.sort_unstable();
    let p99 = if lat.is_empty() {
        f64::NAN
    } else {
        lat[((lat.len() - 1) as f64 * 0.99).round() as usize] as f64 / 1e3
    };
    Load {
        lookups_per_s: lookups as f64 / wall,
        events_per_s: events.load(Ordering::Relaxed) as f64 / wall,
        p99_us: p99,
        exhausted,
        max_probes,
    }
}

/// Ours, loaded: the index, its engines, each worker's next event id and
/// each request's (target, hashes), built once before any timed run.
pub(crate) struct Ours {
    index: Arc<kv_lookup::InventoryIndex>,
    engines: Vec<EngineId>,
    next_id: Vec<u64>,
    keys: Vec<(EngineId, Vec<SequenceHash>)>,
}

impl Ours {
    /// Preloads `ops` into a fresh index sized for `capacity` blocks.
    pub(crate) fn load<'a>(
        ops: impl Iterator<Item = Op<'a>>,
        capacity: usize,
        requests: &[(usize, Vec<Block>)],
    ) -> Self {
        let (index, engines, next_id) = crate::load_ours(ops, capacity);
        let keys = requests
            .iter()
            .map(|(w, b)| (engines[*w], b.iter().map(|x| SequenceHash(x.0)).collect()))
            .collect();
        Self {
            index: Arc::new(index),
            engines,
            next_id,
            keys,
        }
    }

    /// Event thread `k`'s apply function, publishing as `publish` says. An
    /// index takes one run of events: the ids go on from the preload's.
    pub(crate) fn writer(&self, publish: Publish) -> impl Fn(usize) -> Apply + Sync + '_ {
        let (index, engines, next_id) = (&self.index, &self.engines, &self.next_id);
        move |_k: usize| -> Apply {
            // Each worker belongs to one event thread, so a per-thread copy of the
            // next ids is exact for the workers it writes.
            let (index, engines) = (index.clone(), engines.clone());
            let mut next_id = next_id.clone();
            let mut pending: Vec<KvEvent> = Vec::with_capacity(BATCH);
            Box::new(move |w: &Write<'_>| {
                let data = if publish == Publish::NoChange {
                    // The complement of a churn chain's (random 64-bit)
                    // hash is held by no worker, but for a collision with
                    // one of ~2^21 held hashes (~2^-43 per block).
                    KvEventData::Removed {
                        sequence_hashes: w.blocks.iter().map(|b| SequenceHash(!b.0)).collect(),
                    }
                } else if w.remove {
                    KvEventData::Removed {
                        sequence_hashes: w.blocks.iter().map(|b| SequenceHash(b.0)).collect(),
                    }
                } else {
                    KvEventData::Stored {
                        parent: None,
                        blocks: w
                            .blocks
                            .iter()
                            .map(|&(s, t)| StoredBlock {
                                sequence_hash: SequenceHash(s),
                                token_hash: TokenBlockHash(t),
                                slot: None,
                            })
                            .collect(),
                    }
                };
                let e = KvEvent {
                    publisher: engines[w.worker],
                    event_id: {
                        next_id[w.worker] += 1;
                        next_id[w.worker] - 1
                    },
                    role: role(w.worker),
                    layout_fingerprint: FP,
                    tp_size: 1,
                    tier: StorageTier::RetainedGpuDirect,
                    data,
                };
                match publish {
                    Publish::PerEvent | Publish::NoChange => {
                        let r = index.apply_event(&e);
                        assert!(matches!(r, Ok(EventOutcome::Applied { .. })), "{r:?}");
                        1
                    }
                    Publish::Batched => {
                        pending.push(e);
                        if pending.len() < BATCH {
                            return 0;
                        }
                        let r = index.apply_events(&pending);
                        let applied_all = r.applied == BATCH as u64
                            && r.duplicates == 0
                            && r.from_retired == 0
                            && r.gaps.is_empty()
                            && r.unchained.is_empty()
                            && r.refused.is_empty();
                        assert!(applied_all, "every event of the batch applied: {r:?}");
                        pending.clear();
                        BATCH as u64
                    }
                }
            })
        }
    }

    /// One lookup of request `r` on this index: (budget exhausted, probes).
    pub(crate) fn lookup(&self, budget: LookupBudget) -> impl Fn(usize) -> (bool, u32) + Sync + '_ {
        move |r: usize| {
            let (target, hashes) = &self.keys[r];
            let out = self.index.lookup(hashes, *target, budget);
            (out.budget_exhausted, out.probes)
        }
    }

    /// Requests this index was loaded with.
    pub(crate) fn requests(&self) -> usize {
        self.keys.len()
    }
}

/// Ours: preload `ops`, then the concurrent phase, events published as
/// `publish` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ours<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    capacity: usize,
    requests: &[(usize, Vec<Block>)],
    chains: &(Vec<Vec<Block>>, usize),
    t: usize,
    e: usize,
    secs: f64,
    budget: LookupBudget,
    publish: Publish,
) -> Load {
    let o = Ours::load(ops, capacity, requests);
    drive(
        t,
        e,
        secs,
        o.requests(),
        chains,
        o.writer(publish),
        o.lookup(budget),
    )
}

/// `PositionalIndexer`: preload inline, churn from `e` threads.
pub(crate) fn positional<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    requests: &[(usize, Vec<Block>)],
    chains: &(Vec<Vec<Block>>, usize),
    t: usize,
    e: usize,
    secs: f64,
) -> Load {
    let index = Arc::new(PositionalIndexer::new(JUMP));
    let mut m = Default::default();
    preload_dynamo(ops, |ev| {
        index
            .apply_event(&mut m, ev, None)
            .expect("positional preload");
    });
    let writer = |_k: usize| -> Apply {
        let index = index.clone();
        let mut blocks_of = Default::default();
        let mut ids = vec![1u64; DECODES];
        Box::new(move |w: &Write<'_>| {
            let id = ids[w.worker];
            ids[w.worker] += 1;
            let ev = if w.remove {
                removed_event(w.worker as u64, 1, id, w.blocks)
            } else {
                stored_event(w.worker as u64, 1, id, None, w.blocks)
            };
            index
                .apply_event(&mut blocks_of, ev, None)
                .expect("positional event");
            1
        })
    };
    let keys: Vec<_> = requests.iter().map(|(_, b)| local_hashes(b)).collect();
    let lookup = |r: usize| {
        let s = index.find_matches(&keys[r], false);
        std::hint::black_box(s);
        (false, 0)
    };
    drive(t, e, secs, keys.len(), chains, writer, lookup)
}

/// `ConcurrentRadixTreeCompressed` in a `ThreadPoolIndexer`, loaded: the
/// pool, each worker's next event id and each request's local hashes.
pub(crate) struct Crtc {
    pool: Arc<ThreadPoolIndexer<ConcurrentRadixTreeCompressed>>,
    ids: Vec<u64>,
    keys: Vec<Vec<LocalBlockHash>>,
}

impl Crtc {
    /// Preloads `ops` into a fresh tree whose pool has `e` threads (one
    /// for the preload when `e == 0`).
    pub(crate) fn load<'a>(
        ops: impl Iterator<Item = Op<'a>>,
        requests: &[(usize, Vec<Block>)],
        e: usize,
    ) -> Self {
        let pool = Arc::new(ThreadPoolIndexer::new(
            ConcurrentRadixTreeCompressed::new(),
            e.max(1),
            16,
        ));
        let ids = preload_dynamo(ops, |ev| pool.enqueue_event(ev).expect("crtc preload"));
        futures::executor::block_on(pool.flush_and_wait()).expect("crtc flush");
        let keys = requests.iter().map(|(_, b)| local_hashes(b)).collect();
        Self { pool, ids, keys }
    }

    /// The producer's apply function: one producer for all of the pool's
    /// lanes (see the module docs), so `drive` runs it as event thread 0
    /// with ownership of every decode. A tree takes one run of events.
    pub(crate) fn writer(&self) -> impl Fn(usize) -> Apply + Sync + '_ {
        move |_k: usize| -> Apply {
            let pool = self.pool.clone();
            let mut ids = self.ids.clone();
            let mut since_flush = 0;
            Box::new(move |w: &Write<'_>| {
                let id = ids[w.worker];
                ids[w.worker] += 1;
                let ev = if w.remove {
                    removed_event(w.worker as u64, 0, id, w.blocks)
                } else {
                    stored_event(w.worker as u64, 0, id, None, w.blocks)
                };
                pool.enqueue_event(ev).expect("crtc event");
                since_flush += 1;
                if since_flush < BATCH as u64 {
                    return 0;
                }
                futures::executor::block_on(pool.flush_and_wait()).expect("crtc flush");
                since_flush = 0;
                BATCH as u64
            })
        }
    }

    /// One lookup of request `r` on this tree (no budget: (false, 0)).
    pub(crate) fn lookup(&self) -> impl Fn(usize) -> (bool, u32) + Sync + '_ {
        move |r: usize| {
            let s = self.pool.backend().find_matches(&self.keys[r], false);
            std::hint::black_box(s);
            (false, 0)
        }
    }

    /// Requests this tree was loaded with.
    pub(crate) fn requests(&self) -> usize {
        self.keys.len()
    }
}

/// `ConcurrentRadixTreeCompressed` in a `ThreadPoolIndexer` of `e` threads
/// (one for the preload when `e == 0`, which then runs no producer).
pub(crate) fn crtc_pool<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    requests: &[(usize, Vec<Block>)],
    chains: &(Vec<Vec<Block>>, usize),
    t: usize,
    e: usize,
    secs: f64,
) -> Load {
    let c = Crtc::load(ops, requests, e);
    drive(
        t,
        e.min(1),
        secs,
        c.requests(),
        chains,
        c.writer(),
        c.lookup(),
    )
}

/// Feeds the stores and removals of `ops` to `apply` as Dynamo events;
/// returns the next event id per worker.
fn preload_dynamo<'a>(
    ops: impl Iterator<Item = Op<'a>>,
    mut apply: impl FnMut(dynamo_kv_router::protocols::RouterEvent),
) -> Vec<u64> {
    let mut next_id = vec![1u64; crate::WORKERS];
    for op in ops {
        match op {
            Op::Store {
                worker,
                parent,
                blocks,
                ..
            } => {
                apply(stored_event(
                    worker as u64,
                    0,
                    next_id[worker],
                    parent,
                    blocks,
                ));
                next_id[worker] += 1;
            }
            Op::Remove { worker, blocks, .. } => {
                apply(removed_event(worker as u64, 0, next_id[worker], blocks));
                next_id[worker] += 1;
            }
            Op::Lookup { .. } => {}
        }
    }
    next_id
}
