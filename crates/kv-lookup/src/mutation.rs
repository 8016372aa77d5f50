//! Every change to the index as a value, so that the standby copy of the
//! index's state can replay what the published copy already applied (see
//! [`crate::twin`]).

use kv_descriptor::{
    EngineId, KvEvent, KvEventData, LayoutFingerprint, Role, SequenceHash, StorageTier,
};

use crate::chain::{first_broken_link, UnchainedStore};
use crate::holder_table::tier_index;
use crate::index::{EventOutcome, Locs, MutationMemo, Registration, State, WriterMaps};
use crate::twin::{Pass, Replay};
use crate::worker::{WorkerInfo, WorkerKey};
use crate::LookupError;

/// One change, as [`crate::InventoryIndex`]'s mutating methods receive it.
pub(crate) enum Mutation {
    /// [`crate::InventoryIndex::register_worker`].
    Register { key: WorkerKey, info: WorkerInfo },
    /// [`crate::InventoryIndex::remove_worker`].
    Remove { engine: EngineId },
    /// [`crate::InventoryIndex::readmit_worker`].
    Readmit { key: WorkerKey, info: WorkerInfo },
    /// [`crate::InventoryIndex::require_resync`].
    RequireResync { engine: EngineId },
    /// [`crate::InventoryIndex::forget_retired`].
    ForgetRetired { engine: EngineId },
    /// [`crate::InventoryIndex::apply_event`] (owned: the replay needs it later).
    Event(CheckedEvent),
    /// [`crate::InventoryIndex::resync_worker`].
    Resync {
        engine: EngineId,
        last_event_id: u64,
        inventory: Vec<(StorageTier, Vec<SequenceHash>)>,
    },
}

/// An event as the index applies it, with the part of its chain check that
/// depends on the event alone (each block's sequence hash chained from its
/// parent's) done once outside the writer lock; whether the index holds its
/// `parent` is checked when it is applied.
///
/// It keeps what both copies need (the replay applies it later) and no
/// more: a Stored event's token hashes and slots are read by the chain
/// check only, so its blocks are not copied, only their sequence hashes.
pub(crate) struct CheckedEvent {
    // The event's header, as sent.
    pub(crate) publisher: EngineId,
    pub(crate) event_id: u64,
    pub(crate) role: Role,
    pub(crate) layout_fingerprint: LayoutFingerprint,
    pub(crate) tp_size: u32,
    pub(crate) tier: StorageTier,
    pub(crate) change: Change,
}

/// [`KvEventData`] as the index applies it.
pub(crate) enum Change {
    /// [`KvEventData::Stored`].
    Stored {
        parent: Option<SequenceHash>,
        /// The blocks' sequence hashes in block order.
        hashes: Vec<SequenceHash>,
        /// [`first_broken_link`] of the blocks.
        broken_link: Option<UnchainedStore>,
    },
    /// [`KvEventData::Removed`].
    Removed { hashes: Vec<SequenceHash> },
    /// [`KvEventData::Cleared`].
    Cleared,
}

impl CheckedEvent {
    pub(crate) fn new(event: &KvEvent) -> Self {
        let change = match &event.data {
            KvEventData::Stored { parent, blocks } => Change::Stored {
                parent: *parent,
                hashes: blocks.iter().map(|b| b.sequence_hash).collect(),
                broken_link: first_broken_link(*parent, blocks),
            },
            KvEventData::Removed { sequence_hashes } => Change::Removed {
                hashes: sequence_hashes.clone(),
            },
            KvEventData::Cleared => Change::Cleared,
        };
        Self {
            publisher: event.publisher,
            event_id: event.event_id,
            role: event.role,
            layout_fingerprint: event.layout_fingerprint,
            tp_size: event.tp_size,
            tier: event.tier,
            change,
        }
    }
}

/// What a [`Mutation`] reported; the variant matches the mutation's.
pub(crate) enum Effect {
    Register(Result<Registration, LookupError>),
    Remove(bool),
    RequireResync(bool),
    ForgetRetired(bool),
    Event(Result<EventOutcome, LookupError>),
    Resync(Result<(), LookupError>),
}

impl Replay for State {
    type Op = Mutation;
    type Out = Effect;
    type Shared = WriterMaps;
    type Memo = MutationMemo;

    fn apply(&mut self, op: &Mutation, pass: Pass<'_, Self>) -> Effect {
        match pass {
            Pass::First { shared, memo } => {
                memo.locs.clear();
                let out = self.apply_with(op, &mut Locs::of(Some(&mut *shared), memo));
                memo.map_bytes = shared.memory_bytes();
                self.map_bytes = memo.map_bytes;
                out
            }
            Pass::Replay { memo } => {
                let mut locs = Locs::of(None, memo);
                let out = self.apply_with(op, &mut locs);
                if let Locs::Replay { log, pos, .. } = locs {
                    debug_assert_eq!(pos, log.len(), "the replay asked what the first asked");
                }
                self.map_bytes = memo.map_bytes;
                out
            }
        }
    }
}

impl State {
    fn apply_with(&mut self, op: &Mutation, locs: &mut Locs<'_>) -> Effect {
        match op {
            Mutation::Register { key, info } => Effect::Register(self.register(*key, *info, locs)),
            Mutation::Remove { engine } => Effect::Remove(match self.by_engine.get(engine) {
                Some(&slot) => {
                    self.retire(slot, locs);
                    self.rebuild_donor_masks();
                    true
                }
                None => false,
            }),
            Mutation::Readmit { key, info } => Effect::Register(self.readmit(*key, *info, locs)),
            Mutation::RequireResync { engine } => {
                Effect::RequireResync(self.require_resync(*engine))
            }
            Mutation::ForgetRetired { engine } => {
                Effect::ForgetRetired(self.forget_retired(*engine))
            }
            Mutation::Event(c) => Effect::Event(self.apply_event(c, locs)),
            Mutation::Resync {
                engine,
                last_event_id,
                inventory,
            } => Effect::Resync(self.resync(*engine, *last_event_id, inventory, locs)),
        }
    }
}

impl State {
    fn resync(
        &mut self,
        engine: EngineId,
        last_event_id: u64,
        inventory: &[(StorageTier, Vec<SequenceHash>)],
        locs: &mut Locs<'_>,
    ) -> Result<(), LookupError> {
        let slot = *self
            .by_engine
            .get(&engine)
            .ok_or(LookupError::UnknownEngine { engine })?;
        self.drop_entries(slot, locs);
        for (tier, hashes) in inventory {
            // A snapshot's order is unchecked: its entries are never linked.
            self.store(slot, tier_index(*tier), hashes, false, false, locs);
        }
        let rec = self.workers[slot as usize]
            .as_mut()
            .expect("slot of a live engine");
        rec.last_event_id = last_event_id;
        rec.needs_resync = false;
        self.rebuild_donor_masks();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kv_descriptor::{
        sequence_hashes, token_block_hashes, KvEventData, LayoutFingerprint, Role, StoredBlock,
    };

    use super::*;
    use crate::index::split;
    use crate::InventoryIndex;

    /// A decode worker of layout fingerprint 1 and TP 1, as these tests register it.
    fn decode_info() -> WorkerInfo {
        WorkerInfo {
            engine: EngineId::fresh(),
            role: Role::Decode,
            layout_fingerprint: LayoutFingerprint(1),
            tp_size: 1,
        }
    }

    /// Event `event_id` of worker `info` on the retained GPU tier.
    fn retained_event(info: &WorkerInfo, event_id: u64, data: KvEventData) -> KvEvent {
        KvEvent {
            publisher: info.engine,
            event_id,
            role: info.role,
            layout_fingerprint: info.layout_fingerprint,
            tp_size: info.tp_size,
            tier: StorageTier::RetainedGpuDirect,
            data,
        }
    }

    fn chain(seed: u32, n: usize) -> Vec<StoredBlock> {
        let tokens: Vec<u32> = (0..n as u32 * 4).map(|t| t * 31 + seed).collect();
        sequence_hashes(&tokens, 4)
            .into_iter()
            .zip(token_block_hashes(&tokens, 4))
            .map(|(sequence_hash, token_hash)| StoredBlock {
                sequence_hash,
                token_hash,
                slot: None,
            })
            .collect()
    }

    /// Everything observable of one copy: counters, every worker's record
    /// and its holder bits for `hashes`, and the donor masks.
    fn digest(st: &State, hashes: &[SequenceHash]) -> String {
        let mut out = format!("{:?}\n", st.stats());
        for (slot, rec) in st.workers.iter().enumerate() {
            let Some(rec) = rec else { continue };
            let (g, bit) = split(slot as u32);
            let bits: Vec<u64> = hashes
                .iter()
                .flat_map(|&h| st.groups[g].bits_by_scan(h).map(|w| w >> bit & 1))
                .collect();
            out += &format!(
                "{slot} {:?} {:?} {} {} {:?} {bits:?}\n",
                rec.key, rec.info, rec.last_event_id, rec.needs_resync, rec.live
            );
        }
        for m in &st.donor_masks {
            out += &format!("{:?} {} {:?}\n", m.fingerprint, m.tp_size, m.groups);
        }
        out
    }

    #[test]
    fn both_copies_agree_after_concurrent_writers_of_every_mutation_kind() {
        let index = Arc::new(InventoryIndex::new());
        let all: Vec<SequenceHash> = (0..8)
            .flat_map(|s| chain(s, 40))
            .map(|b| b.sequence_hash)
            .collect();
        let threads: Vec<_> = (0..4u32)
            .map(|k| {
                let index = index.clone();
                std::thread::spawn(move || {
                    for round in 0..30u32 {
                        let info = WorkerInfo {
                            engine: EngineId::fresh(),
                            role: if k % 2 == 0 {
                                Role::Decode
                            } else {
                                Role::Prefill
                            },
                            layout_fingerprint: LayoutFingerprint(1),
                            tp_size: 1,
                        };
                        // A restart under the same key every round.
                        index
                            .register_worker(WorkerKey(u64::from(k)), info)
                            .unwrap();
                        let c = chain(k + 2 * (round % 4), 40);
                        let ev = |id, data| retained_event(&info, id, data);
                        let removed = KvEventData::Removed {
                            sequence_hashes: c[30..].iter().map(|b| b.sequence_hash).collect(),
                        };
                        let stored = KvEventData::Stored {
                            parent: None,
                            blocks: c.clone(),
                        };
                        // In order, a removal, then a gap (id 5) and its resync.
                        let batch = [ev(1, stored), ev(2, removed)];
                        assert_eq!(index.apply_events(&batch).applied, 2);
                        let gap = KvEventData::Cleared;
                        assert!(matches!(
                            index.apply_event(&ev(5, gap)),
                            Ok(EventOutcome::Gap { .. })
                        ));
                        let keep: Vec<SequenceHash> =
                            c[..10].iter().map(|b| b.sequence_hash).collect();
                        index
                            .resync_worker(
                                info.engine,
                                5,
                                &[(StorageTier::RetainedGpuDirect, keep)],
                            )
                            .unwrap();
                        if round % 7 == 6 {
                            assert!(index.remove_worker(info.engine));
                            // Taken back (dropped for silence, not replaced),
                            // marked again, resynced: both copies alike.
                            index.readmit_worker(WorkerKey(u64::from(k)), info).unwrap();
                            assert!(index.require_resync(info.engine));
                            index.resync_worker(info.engine, 9, &[]).unwrap();
                        }
                        if round % 7 == 3 {
                            assert!(index.remove_worker(info.engine));
                            // Forgotten as retired, registered again as new,
                            // its next event a gap, resynced: both copies alike.
                            assert!(index.forget_retired(info.engine));
                            index
                                .register_worker(WorkerKey(u64::from(k)), info)
                                .unwrap();
                            let gap = index.apply_event(&ev(7, KvEventData::Cleared));
                            assert!(matches!(gap, Ok(EventOutcome::Gap { .. })));
                            index.resync_worker(info.engine, 7, &[]).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (live, standby) = index.state.both();
        assert!(!std::ptr::eq(&*live, &*standby));
        let (a, b) = (digest(&live, &all), digest(&standby, &all));
        assert_eq!(a, b);
        for t in live.groups.iter().chain(&standby.groups) {
            t.assert_entry_points_exact();
        }
        // The copies hold what the last rounds left: 4 live workers (round 29
        // is not a removal round), 10 retained blocks each.
        assert_eq!(live.stats().workers, 4);
        assert_eq!(live.stats().held_blocks[4], 40);
        // Each round's restart retires the round before's incarnation (29
        // per thread); a removal taken back or forgotten leaves none.
        assert_eq!(live.stats().retired_incarnations, 4 * 29);
    }

    /// The events of `log_compaction_drops_duplicates_...` below, applied to
    /// two equal states by hand: the 4th store compacts the log. Returns the
    /// two states after the ops before it, the op itself and the chain.
    fn states_before_a_compacting_store() -> (State, State, WriterMaps, Mutation, Vec<SequenceHash>)
    {
        let (mut a, mut b, mut maps) = (State::new(0), State::new(0), WriterMaps::new(0));
        let info = decode_info();
        let c = chain(3, 700);
        let hashes: Vec<SequenceHash> = c.iter().map(|b| b.sequence_hash).collect();
        let ev = |id, data| Mutation::Event(CheckedEvent::new(&retained_event(&info, id, data)));
        let stored = || KvEventData::Stored {
            parent: None,
            blocks: c.clone(),
        };
        let removed = || KvEventData::Removed {
            sequence_hashes: hashes.clone(),
        };
        let mut ops = vec![Mutation::Register {
            key: WorkerKey(1),
            info,
        }];
        ops.push(ev(1, stored()));
        for k in 0..3 {
            ops.push(ev(2 + 2 * k, removed()));
            ops.push(ev(3 + 2 * k, stored()));
        }
        let last = ops.pop().expect("the 4th store");
        for op in &ops {
            let mut memo = MutationMemo::default();
            a.apply(op, first(&mut maps, &mut memo));
            b.apply(op, Pass::Replay { memo: &mut memo });
        }
        assert_eq!(a.workers[0].as_ref().unwrap().logs[4].len(), 2100);
        (a, b, maps, last, hashes)
    }

    /// The first application's pass.
    fn first<'a>(maps: &'a mut WriterMaps, memo: &'a mut MutationMemo) -> Pass<'a, State> {
        Pass::First { shared: maps, memo }
    }

    /// A compaction is computed on the first copy and taken by the replay
    /// from the mutation's memo (it would otherwise stay there), with the
    /// same result.
    #[test]
    fn the_replay_takes_the_first_copys_log_compaction_from_the_memo() {
        let (mut a, mut b, mut maps, op, hashes) = states_before_a_compacting_store();
        let mut memo = MutationMemo::default();
        assert!(memo.compacted.is_none());
        a.apply(&op, first(&mut maps, &mut memo));
        assert!(
            memo.compacted.is_some(),
            "the first copy left its compaction"
        );
        b.apply(&op, Pass::Replay { memo: &mut memo });
        assert!(memo.compacted.is_none(), "the replay took it");
        assert_compacted_alike(&a, &b, &hashes);
    }

    /// Both copies' logs of the compacting worker hold its 700 live hashes,
    /// alike, and the copies answer alike for `hashes`.
    fn assert_compacted_alike(a: &State, b: &State, hashes: &[SequenceHash]) {
        let (la, lb) = (
            &a.workers[0].as_ref().unwrap().logs[4],
            &b.workers[0].as_ref().unwrap().logs[4],
        );
        assert_eq!(la.len(), 700);
        assert_eq!(la, lb);
        assert_eq!(digest(a, hashes), digest(b, hashes));
    }

    /// The compacting store applied to the first copy, the memo it left
    /// one hash short, then the replay on the second: (first, second,
    /// the chain's hashes).
    fn replay_with_a_short_memo() -> (State, State, Vec<SequenceHash>) {
        let (mut a, mut b, mut maps, op, hashes) = states_before_a_compacting_store();
        let mut memo = MutationMemo::default();
        a.apply(&op, first(&mut maps, &mut memo));
        memo.compacted.as_mut().expect("compacted").pop();
        b.apply(&op, Pass::Replay { memo: &mut memo });
        (a, b, hashes)
    }

    /// Debug builds check the memo against a recomputation: a replay handed
    /// another log panics instead of diverging from the first copy.
    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "the other copy compacted the same log")]
    fn a_wrong_compaction_memo_is_caught_in_debug_builds() {
        replay_with_a_short_memo();
    }

    /// Release builds check only the memo's length: one that does not keep
    /// exactly the worker's live hashes is dropped and the replay compacts
    /// its own log, so the copies stay equal. (Runs under `cargo test
    /// --release`; debug builds panic first, test above.)
    #[cfg(not(debug_assertions))]
    #[test]
    fn a_memo_of_the_wrong_length_is_recomputed_in_release_builds() {
        let (a, b, hashes) = replay_with_a_short_memo();
        assert_compacted_alike(&a, &b, &hashes);
    }

    /// The compaction counts removals instead of probing the table: a hash
    /// stored, removed and stored again is logged twice and removed once,
    /// so it stays once, at its later position; a removed chain leaves; the
    /// kept log is in log order, `removed` is emptied, both copies alike.
    #[test]
    fn a_compaction_cancels_each_removal_against_the_earliest_logged_copy() {
        let index = InventoryIndex::new();
        let info = decode_info();
        index.register_worker(WorkerKey(1), info).unwrap();
        let (a, b) = (chain(5, 600), chain(6, 600));
        let hashes = |c: &[StoredBlock]| -> Vec<SequenceHash> {
            c.iter().map(|x| x.sequence_hash).collect()
        };
        let mut id = 0;
        let mut apply = |data| {
            id += 1;
            let e = retained_event(&info, id, data);
            assert!(matches!(
                index.apply_event(&e),
                Ok(EventOutcome::Applied { .. })
            ));
        };
        let stored = |c: &[StoredBlock]| KvEventData::Stored {
            parent: None,
            blocks: c.to_vec(),
        };
        // Log: a (600), b (600), a[..100] again; removed: a[..100], b.
        apply(stored(&a));
        apply(stored(&b));
        apply(KvEventData::Removed {
            sequence_hashes: hashes(&a[..100]),
        });
        apply(KvEventData::Removed {
            sequence_hashes: hashes(&b),
        });
        apply(stored(&a[..100]));
        apply(stored(&b));
        // Log 1900, live 1200: under 2 * 1200 + 1024, no compaction yet.
        let (live, standby) = index.state.both();
        assert_eq!(live.workers[0].as_ref().unwrap().logs[4].len(), 1900);
        drop((live, standby));
        apply(KvEventData::Removed {
            sequence_hashes: hashes(&b),
        });
        apply(KvEventData::Removed {
            sequence_hashes: hashes(&a[100..]),
        });
        // Live 100 (a[..100]); log 1900 > 2 * 100 + 1024: the next store
        // compacts. It stores c, 30 fresh blocks.
        let c = chain(7, 30);
        apply(stored(&c));
        let want: Vec<SequenceHash> = hashes(&a[..100]).into_iter().chain(hashes(&c)).collect();
        let (live, standby) = index.state.both();
        for st in [&live, &standby] {
            let rec = st.workers[0].as_ref().unwrap();
            assert_eq!(rec.logs[4], want, "live hashes once, in log order");
            assert!(rec.removed[4].is_empty());
            assert_eq!(rec.live[4], 130);
        }
    }

    /// A chain stored and removed over and over leaves its hash in the log
    /// once per store; the compaction that the 4th store triggers (a log of
    /// 2800 is over 2 * 700 live + 1024 slack) must keep each live hash
    /// exactly once in both copies, or a later Cleared event would count it
    /// twice.
    #[test]
    fn log_compaction_drops_duplicates_of_a_re_stored_chain_in_both_copies() {
        let index = InventoryIndex::new();
        let info = decode_info();
        index.register_worker(WorkerKey(1), info).unwrap();
        let c = chain(3, 700);
        let ev = |id, data| retained_event(&info, id, data);
        let mut id = 0;
        let mut next = || {
            id += 1;
            id
        };
        for round in 0..4 {
            if round > 0 {
                let removed = KvEventData::Removed {
                    sequence_hashes: c.iter().map(|b| b.sequence_hash).collect(),
                };
                let r = index.apply_event(&ev(next(), removed));
                assert_eq!(r, Ok(EventOutcome::Applied { changed: 700 }));
            }
            let stored = KvEventData::Stored {
                parent: None,
                blocks: c.clone(),
            };
            let r = index.apply_event(&ev(next(), stored));
            assert_eq!(r, Ok(EventOutcome::Applied { changed: 700 }));
        }
        let (live, standby) = index.state.both();
        for st in [&live, &standby] {
            let rec = st.workers[0].as_ref().unwrap();
            let mut log = rec.logs[4].clone();
            assert_eq!(log.len(), 700, "compacted to the live set");
            log.sort_unstable();
            log.dedup();
            assert_eq!(log.len(), 700, "no duplicates left");
        }
        // The next write waits until nobody holds its copy.
        drop((live, standby));
        let r = index.apply_event(&ev(next(), KvEventData::Cleared));
        assert_eq!(r, Ok(EventOutcome::Applied { changed: 700 }));
        assert_eq!(index.stats().held_blocks[4], 0);
    }
}
