//! Adversarial workloads against the reference model, with the structural
//! invariants of both copies and of the writer's full map checked after
//! every mutating call: entry points exact, chunk summaries exact, the map
//! pointing at exactly the live entries, both copies laid out alike.

use kv_descriptor::KvEventData;

use super::*;
use crate::reference::{conversations, lookup_disagreement, Live, NaiveIndex, SplitMix};
use crate::LookupBudget;

const BIG: LookupBudget = LookupBudget::new(1_000_000, u32::MAX);

/// Asserts the structural invariants of both copies and the writer's map.
pub(crate) fn assert_structure(index: &InventoryIndex) {
    let (live, standby) = index.state.both();
    assert_eq!(live.groups.len(), standby.groups.len());
    for (g, (a, b)) in live.groups.iter().zip(&standby.groups).enumerate() {
        a.assert_entry_points_exact();
        a.assert_summaries_exact();
        b.assert_entry_points_exact();
        b.assert_summaries_exact();
        assert_eq!(
            a.layout_digest(),
            b.layout_digest(),
            "group {g}: copies differ"
        );
    }
    index.state.inspect(|st, maps| {
        assert_eq!(maps.groups.len(), st.groups.len());
        for (t, m) in st.groups.iter().zip(&maps.groups) {
            t.assert_map_exact(m);
        }
        for (t, m) in standby.groups.iter().zip(&maps.groups) {
            t.assert_map_exact(m);
        }
    });
}

/// The fast lookup against the naive one.
fn compare_lookup(
    fast: &InventoryIndex,
    naive: &NaiveIndex,
    hashes: &[SequenceHash],
    target: EngineId,
) -> Result<(), String> {
    let want = naive.lookup(hashes, target);
    let got = fast.lookup(hashes, target, BIG);
    match lookup_disagreement(&got, want.as_ref()) {
        Some(what) => Err(format!("{what}: fast {got:?} naive {want:?}")),
        None => Ok(()),
    }
}

/// A random workload over `workers` workers (more than 64 spans groups)
/// and conversations of `blocks` blocks, with batches, cold tiers,
/// resyncs with shuffled and repeated hashes, removals in reverse order
/// and with repeats, stores listing a hash twice, empty events, restarts
/// and removals of workers (some forgotten as retired, then back). Checks
/// every outcome, lookups and `holds` against the reference model and,
/// every `check_every` steps, the structure.
fn fuzz(seed: u64, steps: u64, workers: u64, blocks: usize, check_every: u64) {
    let mut rng = SplitMix(seed);
    let fast = InventoryIndex::new();
    let mut naive = NaiveIndex::default();
    let fp = LayoutFingerprint(1);
    // Conversation c shares its first c * blocks / 8 blocks with c - 1.
    let (chains, convs) = conversations(&mut rng, 6, blocks, |c| c * blocks / 8);
    let new_info = |rng: &mut SplitMix, k: u64| WorkerInfo {
        engine: EngineId(uuid::Uuid::from_u64_pair(rng.next() | 1, k)),
        role: if k % 4 == 0 {
            Role::Prefill
        } else {
            Role::Decode
        },
        layout_fingerprint: fp,
        tp_size: 1,
    };
    let mut live: Vec<Live> = Vec::new();
    for k in 0..workers {
        let info = new_info(&mut rng, k);
        fast.register_worker(WorkerKey(k), info).unwrap();
        assert!(naive.register(WorkerKey(k), info));
        live.push(Live { info, next_id: 1 });
    }
    let prefills: Vec<usize> = (0..workers as usize).filter(|k| k % 4 == 0).collect();
    for step in 0..steps {
        let ctx = |what: &str| format!("seed {seed} step {step}: {what}");
        // Workers active in this run: a few per group, so that groups fill up.
        let k = if rng.below(2) == 0 {
            rng.below(workers) as usize
        } else {
            let few = [0, 1, 2, 3, 5, 64, 65, 66, 67, 69];
            few[rng.below(few.len() as u64) as usize] % workers as usize
        };
        let op = rng.below(100);
        let mutated;
        if op < 2 {
            // Restart under the same key.
            let info = WorkerInfo {
                engine: EngineId(uuid::Uuid::from_u64_pair(rng.next() | 1, step)),
                ..live[k].info
            };
            fast.register_worker(WorkerKey(k as u64), info).unwrap();
            assert!(naive.register(WorkerKey(k as u64), info));
            live[k] = Live { info, next_id: 1 };
            mutated = true;
        } else if op < 3 {
            // Removed, then under the key either a new incarnation or the
            // same one once both forgot it was retired (its ids go on, so
            // its next event is a gap).
            let engine = live[k].info.engine;
            assert!(fast.remove_worker(engine));
            naive.remove(engine);
            if rng.below(2) == 0 {
                assert!(fast.forget_retired(engine), "{}", ctx("forget"));
                assert!(naive.forget_retired(engine));
                live[k].next_id += 1;
            } else {
                live[k] = Live {
                    info: new_info(&mut rng, k as u64),
                    next_id: 1,
                };
            }
            let info = live[k].info;
            fast.register_worker(WorkerKey(k as u64), info).unwrap();
            assert!(naive.register(WorkerKey(k as u64), info));
            assert_eq!(
                fast.stats().retired_incarnations,
                naive.retired_incarnations(),
                "{}",
                ctx("retired")
            );
            mutated = true;
        } else if op < 7 {
            // A resync: per tier, a prefix, a shuffled sample with repeats,
            // or nothing.
            let snapshot: Vec<(StorageTier, Vec<SequenceHash>)> = ALL_TIERS
                .iter()
                .map(|&t| {
                    let c = &convs[rng.below(convs.len() as u64) as usize];
                    let hs = match rng.below(3) {
                        0 => c[..rng.below(c.len() as u64 + 1) as usize].to_vec(),
                        1 => (0..rng.below(2 * c.len() as u64))
                            .map(|_| c[rng.below(c.len() as u64) as usize])
                            .collect(),
                        _ => Vec::new(),
                    };
                    (t, hs)
                })
                .collect();
            let last = live[k].next_id - 1;
            fast.resync_worker(live[k].info.engine, last, &snapshot)
                .unwrap();
            naive.resync(live[k].info.engine, last, &snapshot);
            mutated = true;
        } else if op < 35 {
            let c = &convs[rng.below(convs.len() as u64) as usize];
            let c = &c[..1 + rng.below(c.len() as u64) as usize];
            let target = live[prefills[rng.below(prefills.len() as u64) as usize]]
                .info
                .engine;
            if let Err(e) = compare_lookup(&fast, &naive, c, target) {
                panic!("{}", ctx(&e));
            }
            for _ in 0..3 {
                let h = c[rng.below(c.len() as u64) as usize];
                let w = live[rng.below(workers) as usize].info.engine;
                assert_eq!(fast.holds(w, h), naive.holds(w, h), "{}", ctx("holds"));
            }
            mutated = false;
        } else {
            // A batch of 1 to 4 events, each of a random worker.
            let n = 1 + rng.below(4) as usize;
            let mut events = Vec::new();
            for j in 0..n {
                let k = if j == 0 {
                    k
                } else {
                    rng.below(workers) as usize
                };
                let l = &mut live[k];
                let id = l.event_id(&mut rng, 25);
                let tier = match rng.below(6) {
                    0 => ALL_TIERS[rng.below(TIERS as u64) as usize],
                    1 => StorageTier::HostPinned,
                    _ if l.info.role == Role::Decode => StorageTier::RetainedGpuDirect,
                    _ => StorageTier::Device,
                };
                let ci = rng.below(convs.len() as u64) as usize;
                let (c, bl) = (&convs[ci], &chains[ci]);
                let lo = rng.below(c.len() as u64) as usize;
                let hi = match rng.below(3) {
                    0 => lo + 1,
                    _ => lo + rng.below((c.len() - lo) as u64 + 1) as usize,
                };
                let data = match rng.below(20) {
                    0 => KvEventData::Cleared,
                    1..=2 => KvEventData::Removed {
                        sequence_hashes: c[lo..hi].to_vec(),
                    },
                    3..=4 => KvEventData::Removed {
                        // Leaf first, as an LRU evicts a conversation.
                        sequence_hashes: c[lo..hi].iter().rev().copied().collect(),
                    },
                    5 => KvEventData::Removed {
                        // Repeats, and an empty removal.
                        sequence_hashes: c[lo..hi]
                            .iter()
                            .chain(&c[lo..hi])
                            .copied()
                            .take(rng.below(2 * (hi - lo) as u64 + 1) as usize)
                            .collect(),
                    },
                    6..=9 => KvEventData::Stored {
                        parent: lo.checked_sub(1).map(|p| c[p]),
                        blocks: bl[lo..hi].to_vec(),
                    },
                    10 => {
                        // The same hash listed twice (does not chain).
                        let mut b = bl[lo..hi].to_vec();
                        b.push(bl[lo]);
                        KvEventData::Stored {
                            parent: lo.checked_sub(1).map(|p| c[p]),
                            blocks: b,
                        }
                    }
                    11 => KvEventData::Stored {
                        // Empty, with or without a parent.
                        parent: (rng.below(2) == 0).then(|| c[lo]),
                        blocks: Vec::new(),
                    },
                    12 => {
                        // A middle block as a root (roots are not checked).
                        KvEventData::Stored {
                            parent: None,
                            blocks: bl[lo..hi].to_vec(),
                        }
                    }
                    _ => KvEventData::Stored {
                        parent: None,
                        blocks: bl[..hi].to_vec(),
                    },
                };
                events.push(l.event(id, tier, data));
            }
            let want: Vec<_> = events.iter().map(|e| naive.apply(e)).collect();
            let got: Vec<_> = if events.len() == 1 && rng.below(2) == 0 {
                vec![fast.apply_event(&events[0]).ok()]
            } else {
                fast.apply_events(&events)
                    .outcomes
                    .into_iter()
                    .map(Result::ok)
                    .collect()
            };
            assert_eq!(got, want, "{}", ctx("outcomes"));
            mutated = true;
        }
        if mutated && step % check_every == 0 {
            assert_structure(&fast);
        }
    }
    assert_structure(&fast);
    // Every conversation's every prefix end, for every prefill target.
    for c in &convs {
        for &t in &prefills {
            for end in [1, c.len() / 3, c.len() / 2, c.len()] {
                if let Err(e) = compare_lookup(&fast, &naive, &c[..end.max(1)], live[t].info.engine)
                {
                    panic!("seed {seed} final: {e}");
                }
            }
        }
    }
}

#[test]
fn few_workers_long_conversations() {
    for seed in 1..=2 {
        fuzz(seed, 2_500, 8, 150, 1);
    }
}

#[test]
fn two_groups_long_conversations() {
    for seed in 11..=11 {
        fuzz(seed, 3_000, 70, 150, 1);
    }
}

#[test]
fn short_conversations_many_steps() {
    for seed in 21..=22 {
        fuzz(seed, 6_000, 8, 20, 3);
    }
}
