//! Single-threaded drivers for dynamo-kv-router 1.6.1's concurrent indexers
//! (the "Flash Indexer"): `ConcurrentRadixTreeCompressed` behind
//! `ThreadPoolIndexer` (its `apply_event` is private: events are enqueued and
//! a flush waits for them) and `PositionalIndexer` (its public `apply_event`,
//! called inline with the per-writer block map its pool threads keep).
//! Lookups call `find_matches(&[LocalBlockHash], false)` on the caller's
//! thread, as Dynamo's router does.

use std::time::Instant;

use dynamo_kv_router::indexer::{
    concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed, positional::PositionalIndexer,
    SyncIndexer, ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};

use crate::{Block, Measured, Op, WORKERS};

/// `PositionalIndexer` jump size: Dynamo's default for the router.
pub(crate) const JUMP: usize = 32;

/// Dynamo's event for a store of `blocks` under `parent` by `worker`.
pub(crate) fn stored_event(
    worker: u64,
    dp_rank: u32,
    id: u64,
    parent: Option<Block>,
    blocks: &[Block],
) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: id,
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
            dp_rank,
        },
    )
}

/// Dynamo's event for a removal of `blocks` by `worker`.
pub(crate) fn removed_event(worker: u64, dp_rank: u32, id: u64, blocks: &[Block]) -> RouterEvent {
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: blocks
                    .iter()
                    .map(|b| ExternalSequenceBlockHash(b.0))
                    .collect(),
            }),
            dp_rank,
        },
    )
}

/// Request blocks as Dynamo's lookup key (token hashes).
pub(crate) fn local_hashes(blocks: &[Block]) -> Vec<LocalBlockHash> {
    blocks.iter().map(|b| LocalBlockHash(b.1)).collect()
}

/// `ConcurrentRadixTreeCompressed` in a one-thread `ThreadPoolIndexer`.
/// Apply time is enqueue + flush of each run of consecutive events (the
/// flush before a lookup makes the lookup see them, as ours does).
pub(crate) fn run_crtc<'a>(ops: impl Iterator<Item = Op<'a>>) -> Measured {
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, 16);
    let mut next_id = vec![1u64; WORKERS];
    let mut m = Measured::default();
    // (started, is removal) of the run of events not flushed yet.
    let mut pending: Option<(Instant, bool)> = None;
    let flush = |pending: &mut Option<(Instant, bool)>, m: &mut Measured| {
        if let Some((t0, removal)) = pending.take() {
            futures::executor::block_on(pool.flush_and_wait()).expect("crtc flush");
            let ns = t0.elapsed().as_nanos() as u64;
            if removal {
                m.remove_ns += ns;
            } else {
                m.apply_ns += ns;
            }
        }
    };
    for op in ops {
        match op {
            Op::Store {
                worker,
                parent,
                blocks,
                ..
            } => {
                if matches!(pending, Some((_, true))) {
                    flush(&mut pending, &mut m);
                }
                let e = stored_event(worker as u64, 0, next_id[worker], parent, blocks);
                next_id[worker] += 1;
                pending.get_or_insert((Instant::now(), false));
                pool.enqueue_event(e).expect("crtc accepts events");
                m.block_events += blocks.len() as u64;
            }
            Op::Remove { worker, blocks, .. } => {
                if matches!(pending, Some((_, false))) {
                    flush(&mut pending, &mut m);
                }
                let e = removed_event(worker as u64, 0, next_id[worker], blocks);
                next_id[worker] += 1;
                pending.get_or_insert((Instant::now(), true));
                pool.enqueue_event(e).expect("crtc accepts events");
                m.removed_blocks += blocks.len() as u64;
            }
            Op::Lookup { blocks, .. } => {
                flush(&mut pending, &mut m);
                let seq = local_hashes(blocks);
                let t0 = Instant::now();
                let scores = pool.backend().find_matches(&seq, false);
                m.lookups_ns.push(t0.elapsed().as_nanos() as u64);
                m.found += !scores.scores.is_empty() as u64;
            }
        }
    }
    flush(&mut pending, &mut m);
    m.note = "compressed tree".into();
    m
}

/// `PositionalIndexer`, events applied inline on this thread.
pub(crate) fn run_positional<'a>(ops: impl Iterator<Item = Op<'a>>) -> Measured {
    let index = PositionalIndexer::new(JUMP);
    let mut blocks_of = Default::default();
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
                let e = stored_event(worker as u64, 0, next_id[worker], parent, blocks);
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = index.apply_event(&mut blocks_of, e, None);
                m.apply_ns += t0.elapsed().as_nanos() as u64;
                assert!(r.is_ok(), "positional refused an event: {r:?}");
                m.block_events += blocks.len() as u64;
            }
            Op::Remove { worker, blocks, .. } => {
                let e = removed_event(worker as u64, 0, next_id[worker], blocks);
                next_id[worker] += 1;
                let t0 = Instant::now();
                let r = index.apply_event(&mut blocks_of, e, None);
                m.remove_ns += t0.elapsed().as_nanos() as u64;
                assert!(r.is_ok(), "positional refused a removal: {r:?}");
                m.removed_blocks += blocks.len() as u64;
            }
            Op::Lookup { blocks, .. } => {
                let seq = local_hashes(blocks);
                let t0 = Instant::now();
                let scores = index.find_matches(&seq, false);
                m.lookups_ns.push(t0.elapsed().as_nanos() as u64);
                m.found += !scores.scores.is_empty() as u64;
            }
        }
    }
    m.note = "positional map".into();
    m
}
