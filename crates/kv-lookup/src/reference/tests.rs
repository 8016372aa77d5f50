use super::*;
use crate::{InventoryIndex, LookupBudget};
use kv_descriptor::{chain_stored_blocks, LayoutFingerprint, TokenBlockHash};

/// Stores and removals of long chains, over and over and without clears,
/// resyncs or restarts, so that every worker's log is compacted many
/// times (each compaction is computed on one copy and taken by the
/// replay from the mutation's memo, `index::MutationMemo`): the index keeps
/// agreeing with the reference model on every outcome, every lookup and
/// `holds`, and the logs stay compacted.
#[test]
fn churn_that_compacts_worker_logs_agrees_with_the_reference_model() {
    let mut rng = SplitMix(11);
    let fast = InventoryIndex::new();
    let mut naive = NaiveIndex::default();
    let chains: Vec<Vec<StoredBlock>> = (0..6)
        .map(|_| chain_stored_blocks(None, (0..700).map(|_| TokenBlockHash(rng.next()))))
        .collect();
    let hashes: Vec<Vec<SequenceHash>> = chains
        .iter()
        .map(|c| c.iter().map(|b| b.sequence_hash).collect())
        .collect();
    // Workers 0..4 decode (retained tier), 4 prefill (device tier).
    let infos: Vec<WorkerInfo> = (0..5u64)
        .map(|k| WorkerInfo {
            engine: EngineId(uuid_from(rng.next(), k)),
            role: if k < 4 { Role::Decode } else { Role::Prefill },
            layout_fingerprint: LayoutFingerprint(1),
            tp_size: 1,
        })
        .collect();
    for (k, info) in infos.iter().enumerate() {
        fast.register_worker(WorkerKey(k as u64), *info).unwrap();
        naive.register(WorkerKey(k as u64), *info);
    }
    let mut next_id = [1u64; 5];
    // Worker `k`'s next event, its id taken in order.
    let mut event = |k: usize, info: WorkerInfo, tier: StorageTier, data: KvEventData| {
        next_id[k] += 1;
        KvEvent {
            publisher: info.engine,
            event_id: next_id[k] - 1,
            role: info.role,
            layout_fingerprint: info.layout_fingerprint,
            tp_size: 1,
            tier,
            data,
        }
    };
    // Holder bits set by each worker's stores (what its log received).
    let mut logged = [0u64; 5];
    for step in 0..1_200 {
        let k = rng.below(5) as usize;
        let info = infos[k];
        let tier = if k < 4 {
            StorageTier::RetainedGpuDirect
        } else {
            StorageTier::Device
        };
        let c = rng.below(6) as usize;
        let data = if rng.below(2) == 0 {
            let hi = 1 + rng.below(700) as usize;
            KvEventData::Stored {
                parent: None,
                blocks: chains[c][..hi].to_vec(),
            }
        } else {
            let lo = rng.below(700) as usize;
            KvEventData::Removed {
                sequence_hashes: hashes[c][lo..].to_vec(),
            }
        };
        let stores = matches!(data, KvEventData::Stored { .. });
        let e = event(k, info, tier, data);
        let got = fast.apply_event(&e).ok();
        assert_eq!(got, naive.apply(&e), "step {step}");
        if let (true, Some(EventOutcome::Applied { changed })) = (stores, got) {
            logged[k] += changed;
        }
        for (c, h) in hashes.iter().enumerate() {
            let i = (step * 7 + c * 113) % h.len();
            let want = naive.lookup(&h[..=i], infos[4].engine).unwrap();
            let got = fast.lookup(
                &h[..=i],
                infos[4].engine,
                LookupBudget::new(1_000_000, u32::MAX),
            );
            assert_eq!(
                (got.baseline.native_blocks, got.baseline.retained_blocks),
                (want.native_blocks, want.retained_blocks),
                "step {step}"
            );
            let base = want.native_blocks.max(want.retained_blocks);
            match got.donor {
                Ok(d) => {
                    assert_eq!(d.blocks, want.donor_blocks, "step {step}");
                    assert!(want.best_donors.contains(&d.engine), "step {step}");
                    assert_eq!(d.tied as usize, want.best_donors.len(), "step {step}");
                }
                Err(_) => assert!(want.donor_blocks <= base, "step {step}"),
            }
            let b = h[i];
            for info in &infos {
                assert_eq!(fast.holds(info.engine, b), naive.holds(info.engine, b));
            }
        }
    }
    // Compactions happened: each worker's logs took many more hashes
    // than they hold now, and are within the compaction bound.
    let (live, standby) = fast.state.both();
    for st in [&live, &standby] {
        for (k, info) in infos.iter().enumerate() {
            let slot = st.by_engine[&info.engine] as usize;
            let rec = st.workers[slot].as_ref().unwrap();
            let log: usize = rec.logs.iter().map(Vec::len).sum();
            let held: u64 = rec.live.iter().sum();
            // Uncompacted, a log holds every hash its stores logged.
            assert!(
                logged[k] > 2 * (log as u64 + 1_024),
                "worker {k}: {logged:?} {log}"
            );
            assert!(log as u64 <= 2 * held + 1_024 + 700, "worker {k}");
        }
    }
    assert_eq!(
        live.workers
            .iter()
            .flatten()
            .map(|w| w.logs.clone())
            .collect::<Vec<_>>(),
        standby
            .workers
            .iter()
            .flatten()
            .map(|w| w.logs.clone())
            .collect::<Vec<_>>(),
    );
    drop((live, standby));
    // A clear drops exactly what the compacted log lists: everything held.
    for (k, info) in infos.iter().enumerate() {
        let tier = if k < 4 {
            StorageTier::RetainedGpuDirect
        } else {
            StorageTier::Device
        };
        let e = event(k, *info, tier, KvEventData::Cleared);
        assert_eq!(fast.apply_event(&e).ok(), naive.apply(&e), "clear {k}");
    }
    assert_eq!(fast.stats().held_blocks, [0; TIERS]);
    for h in hashes.iter().flatten() {
        for info in &infos {
            assert!(fast.holds(info.engine, *h).is_empty());
        }
    }
}

/// Conversations of 2,100 blocks: runs far longer than a chunk, with
/// removals of ranges inside them, cold-tier and dead entries, resyncs,
/// lookups that end mid-chunk and conversations that diverge inside a
/// chunk (each shares a prefix of `c * 2_100 / 48` blocks with the one
/// before).
#[test]
fn long_conversations_agree_with_the_reference_model() {
    let mut donors = 0;
    for seed in 1..=4 {
        let r = cross_check_shaped(seed, 600, 2_100, true).unwrap();
        assert!(r.lookups > 100 && r.donors_found > 0, "{r:?}");
        donors += r.donors_found;
    }
    assert!(donors > 30, "{donors}");
}
