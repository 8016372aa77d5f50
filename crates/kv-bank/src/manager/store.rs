//! The store path of a bank manager: stores taken, written (`write_pending`,
//! `write_pending_from_device`), acked by every rank once it wrote every
//! entry, failed, timed out and rolled back.

use std::time::Instant;

use kv_descriptor::{KvEventData, SequenceHash, StoredBlock};

use crate::DeviceRows;

use super::*;

impl BankManager {
    /// Rolls back every pending store older than the store timeout (returns
    /// their ids) and frees quarantined slots whose time passed. Every
    /// `store` runs it too.
    pub fn expire_overdue(&self) -> Vec<u64> {
        let mut st = self.shared.state.lock();
        self.expire_locked(&mut st, Instant::now())
    }

    pub(super) fn expire_locked(&self, st: &mut State, now: Instant) -> Vec<u64> {
        let timeout = self.shared.config.store_timeout;
        let overdue: Vec<u64> = st
            .pending
            .iter()
            .filter(|(_, p)| now.duration_since(p.started) >= timeout)
            .map(|(&id, _)| id)
            .collect();
        for id in &overdue {
            self.rollback_locked(st, *id, Rollback::TimedOut);
        }
        let (release, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.quarantine)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        st.quarantine = keep;
        for (_, slots) in release {
            free_unwritten_locked(st, &slots);
        }
        overdue
    }

    /// Removes pending store `id`. Its slots are freed at once only when no
    /// rank can still be writing them (every rank acked or is the one that
    /// failed, the bank is closing, or the caller aborted: every write went
    /// through `write_pending*`); otherwise they are quarantined for one
    /// more store timeout, so a late copy of a slow rank can never land in a
    /// slot that was handed to another store meanwhile. Either way a slot
    /// with a `write_pending*` copy running is freed only when it ends.
    pub(super) fn rollback_locked(&self, st: &mut State, id: u64, why: Rollback) {
        let Some(p) = st.pending.remove(&id) else {
            return;
        };
        let slots: Vec<u32> = p.entries.iter().map(|e| e.2).collect();
        st.stats.stores_rolled_back += 1;
        let quiet = match why {
            Rollback::Closing | Rollback::Aborted => true,
            Rollback::Failed(rank) => (0u32..).zip(p.acked()).all(|(r, a)| a || r == rank),
            Rollback::TimedOut => p.acked().all(|a| a),
        };
        if quiet {
            free_unwritten_locked(st, &slots);
        } else {
            st.quarantine
                .push((Instant::now() + self.shared.config.store_timeout, slots));
        }
    }

    /// When pending store `store_id` is past its deadline, rolls it back
    /// (as the expiry sweep would) and returns the [`BankError::StoreTimedOut`]
    /// its ack or write reports; `None` while it is in time (or unknown).
    fn time_out_locked(&self, st: &mut State, store_id: u64) -> Option<BankError> {
        let timeout = self.shared.config.store_timeout;
        let p = st.pending.get(&store_id)?;
        let waited = p.started.elapsed();
        if waited < timeout {
            return None;
        }
        let missing = p.missing_ranks();
        self.rollback_locked(st, store_id, Rollback::TimedOut);
        Some(BankError::StoreTimedOut {
            store_id,
            timeout_ms: timeout.as_millis() as u64,
            waited_ms: waited.as_millis() as u64,
            missing,
        })
    }

    /// Starts storing `blocks` (sealed blocks in prefix order, the first a
    /// child of `parent`, `None` for a root block).
    ///
    /// Blocks already retained are skipped. The first block in the exclusion
    /// lineage, or whose parent is, ends the store: it and every later block
    /// are marked in the lineage and not stored. Slots come from the free
    /// list, then from LRU eviction of unpinned ready blocks (queued as a
    /// `Removed` event). The returned store must be acked by every rank.
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::BrokenChain`] when a sequence hash
    /// does not chain from its parent and token hash; [`BankError::BankFull`]
    /// when not enough slots are free or evictable; [`BankError::LeaseExpired`]
    /// or [`BankError::LeaseLost`] when the bank's lease lapsed (the generation
    /// ends); [`BankError::NotCreator`] in a process forked from the
    /// bank's creator. On error nothing changed.
    pub fn store(
        &self,
        parent: Option<SequenceHash>,
        blocks: &[StoredBlock],
    ) -> Result<PendingStore, BankError> {
        self.require_creator("store")?;
        let mut prev = parent;
        for (index, b) in blocks.iter().enumerate() {
            let expected = chain_sequence_hash(prev, b.token_hash);
            if expected != b.sequence_hash {
                return Err(BankError::BrokenChain {
                    index,
                    got: b.sequence_hash.0,
                    expected: expected.0,
                });
            }
            prev = Some(b.sequence_hash);
        }
        let lineage = &self.shared.config.lineage;
        let parents = std::iter::once(parent).chain(blocks.iter().map(|b| Some(b.sequence_hash)));
        let cut = lineage
            .first_tainted(blocks.iter().map(|b| b.sequence_hash).zip(parents))
            .unwrap_or(blocks.len());
        let excluded: Vec<SequenceHash> = blocks[cut..].iter().map(|b| b.sequence_hash).collect();

        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        self.expire_locked(&mut st, Instant::now());
        let pending_hashes: std::collections::HashSet<SequenceHash> = st
            .pending
            .values()
            .flat_map(|p| p.entries.iter().map(|e| e.0.sequence_hash))
            .collect();
        let mut new = Vec::new();
        let mut already = 0;
        for (i, b) in blocks[..cut].iter().enumerate() {
            if st.table.lookup(&b.sequence_hash).is_some()
                || pending_hashes.contains(&b.sequence_hash)
            {
                already += 1;
                continue;
            }
            if new
                .iter()
                .any(|(n, _): &(StoredBlock, _)| n.sequence_hash == b.sequence_hash)
            {
                already += 1;
                continue;
            }
            let parent_of = if i == 0 {
                parent
            } else {
                Some(blocks[i - 1].sequence_hash)
            };
            new.push((*b, parent_of));
        }
        // Consumed even by an empty store: its id must never name a later
        // store (acking it would commit that store before its ranks wrote).
        let store_id = st.next_store;
        let hashes: Vec<SequenceHash> = new.iter().map(|(b, _)| b.sequence_hash).collect();
        // The chain this store extends (its parent and the run's blocks
        // already held) must survive its own allocation: evicting it would
        // announce `Stored { parent }` for a parent just removed, which the
        // router's index refuses as unchained.
        // (New blocks are in it too: they are not ready, so it changes nothing.)
        let protect: std::collections::HashSet<SequenceHash> = parent
            .into_iter()
            .chain(blocks[..cut].iter().map(|b| b.sequence_hash))
            .collect();
        let (slots, evicted) = match st.table.allocate(store_id, &hashes, &protect) {
            Ok(allocated) => allocated,
            Err(available) => {
                let now = Instant::now();
                return Err(BankError::BankFull {
                    needed: hashes.len(),
                    available,
                    slot_count: st.table.slot_count(),
                    pinned: st.table.pinned_slots(),
                    pending: st.pending.values().map(|p| p.entries.len()).sum(),
                    quarantined: st.quarantine.iter().map(|(_, s)| s.len()).sum(),
                    // Rounded up: "0 ms" would read as free already.
                    quarantine_release_ms: st.quarantine.iter().map(|(at, _)| *at).min().map(
                        |at| {
                            at.saturating_duration_since(now)
                                .as_nanos()
                                .div_ceil(1_000_000) as u64
                        },
                    ),
                });
            }
        };
        // Only now is the store certain: record the lineage and effects.
        lineage.mark(&excluded);
        st.stats.blocks_excluded += excluded.len() as u64;
        if !evicted.is_empty() {
            st.stats.blocks_evicted += evicted.len() as u64;
            self.push_event(
                &mut st,
                KvEventData::Removed {
                    sequence_hashes: evicted,
                },
            );
        }
        let entries: Vec<(SequenceHash, u32)> =
            hashes.iter().copied().zip(slots.iter().copied()).collect();
        st.next_store += 1;
        if !slots.is_empty() {
            st.pending.insert(
                store_id,
                Pending::new(
                    new.into_iter()
                        .zip(slots)
                        .map(|((b, p), s)| (b, p, s))
                        .collect(),
                    self.shared.config.layout.tp_size(),
                ),
            );
        }
        Ok(PendingStore {
            store_id,
            entries,
            already_retained: already,
            excluded: excluded.len(),
        })
    }

    /// Writes rank `rank`'s part of entry `index` of pending store `store_id`
    /// (host-copy path). It refuses any slot that is not pending for that
    /// store, so it can never overwrite a ready or pinned block. The
    /// device-copy path is [`BankManager::write_pending_from_device`]. These
    /// two are the only public way to write a slot, and the only way to fill
    /// a pending store: [`BankManager::ack`] accepts a rank only once each of
    /// its entries was written through them, so a slot written any other way
    /// (a copy to [`RankBank::slot_addr`]) does not count, and its ack is
    /// refused.
    ///
    /// An entry counts as written when its copy returned `Ok`; a copy that
    /// fails leaves its entries unwritten, even ones written before (the
    /// failed copy may have changed part of their bytes), so the rank writes
    /// them again before it acks. Once the rank acked, its part is sealed:
    /// every later write of that rank to the store is refused
    /// ([`BankError::RankAcked`]), so a sealed part's bytes never change under
    /// a block that is, or is about to be, ready.
    ///
    /// The copy (a blocking host-to-device copy for device memory) runs
    /// outside the bank's lock, so other ranks' writes, pins, lookups and
    /// stores proceed meanwhile. The slot is marked as being written for the
    /// copy's duration: a rollback meanwhile (failure, timeout, close) does
    /// not free it until the copy ended, so the copy never lands in a slot
    /// handed to another store; and the ack that makes the store ready
    /// waits for the store's running copies, so no block is readable while
    /// one is still written.
    ///
    /// # Errors
    /// [`BankError::UnknownStore`] (also when the store was rolled back
    /// while the copy ran: the bytes landed in a slot that is freed, not
    /// retained); [`BankError::StoreTimedOut`] when the store's deadline
    /// ([`BankConfig::store_timeout`] after [`BankManager::store`]) passed:
    /// nothing is copied and the store is rolled back on every rank, as
    /// [`BankManager::ack`] does; [`BankError::BadRank`]; [`BankError::RankAcked`] when
    /// `rank` already acked the store (nothing is copied);
    /// [`BankError::InvalidArgument`] for `index` out of range or a wrong
    /// byte count; the memory's copy error; [`BankError::NotCreator`] in a
    /// process forked from the bank's creator (its writes would land in the
    /// creator's memory, unknown to the creator's slot table).
    pub fn write_pending(
        &self,
        store_id: u64,
        rank: u32,
        index: usize,
        bytes: &[u8],
    ) -> Result<(), BankError> {
        self.write_entries(store_id, rank, index, 1, |bank, slots| {
            bank.write_slot(slots[0], bytes)?;
            Ok(Source::Host(bytes.len() as u64))
        })
    }

    /// Writes rank `rank`'s part of entries `first..first + src.rows` of
    /// pending store `store_id` from device memory (row `i` of `src` into
    /// entry `first + i`), device to device: `cuMemcpyDtoDAsync` when
    /// `src` is on the rank's GPU, `cuMemcpyPeerAsync` from a peer GPU,
    /// then a stream synchronize, so the bytes landed before this returns
    /// and the ack that seals the store can follow. No payload byte passes
    /// through host memory: [`BankStats::store_bytes_from_device`] counts
    /// these bytes, [`BankStats::store_bytes_from_host`] does not.
    ///
    /// The same slot rules as [`BankManager::write_pending`]: only slots
    /// pending for this store, marked as being written for the copy's
    /// duration (a rollback meanwhile frees them only after it), the rank's
    /// ack waits for it, its entries count as written only if it succeeded,
    /// and a rank that acked can no longer write. The caller keeps `src`
    /// allocated and unwritten until this returns.
    ///
    /// # Errors
    /// As [`BankManager::write_pending`], with
    /// [`BankError::InvalidArgument`] naming `index` when the rows run past
    /// the store's entries and `source` for rows of the wrong size or not
    /// inside one device allocation of `src.ordinal`;
    /// [`BankError::Unsupported`] on a host-shm bank; [`BankError::Cuda`].
    pub fn write_pending_from_device(
        &self,
        store_id: u64,
        rank: u32,
        first: usize,
        src: DeviceRows,
    ) -> Result<(), BankError> {
        self.write_entries(store_id, rank, first, src.rows, |bank, slots| {
            bank.write_slots_from_device(slots, src)?;
            Ok(Source::Device((src.rows * src.row_bytes) as u64))
        })
    }

    /// The bookkeeping around a copy into entries `first..first + n` of a
    /// pending store: the slots are looked up and marked as being written
    /// under the lock (refused when `rank` already acked), `copy` runs
    /// outside it, then the marks are undone (freeing slots orphaned by a
    /// rollback meanwhile), the entries recorded as written by `rank` (or
    /// unwritten, when the copy failed) and the bytes counted.
    fn write_entries(
        &self,
        store_id: u64,
        rank: u32,
        first: usize,
        n: usize,
        copy: impl FnOnce(&RankBank, &[u32]) -> Result<Source, BankError>,
    ) -> Result<(), BankError> {
        self.require_creator("write_pending")?;
        let (bank, slots, end) = {
            let mut st = self.shared.state.lock();
            // A store past its deadline can no longer become ready (its
            // ack would time out): refused and rolled back here, as the ack
            // does, rather than copied into for nothing.
            if let Some(e) = self.time_out_locked(&mut st, store_id) {
                return Err(e);
            }
            let p = st
                .pending
                .get(&store_id)
                .ok_or(BankError::UnknownStore(store_id))?;
            if n == 0 {
                return Err(BankError::arg("index", "no rows to write"));
            }
            let end = first.checked_add(n).filter(|e| *e <= p.entries.len());
            let Some(end) = end else {
                return Err(BankError::arg(
                    "index",
                    format!(
                        "{} is not below the store's {} entries",
                        first.saturating_add(n - 1),
                        p.entries.len()
                    ),
                ));
            };
            let slots: Vec<u32> = p.entries[first..end].iter().map(|e| e.2).collect();
            // The clone keeps the rank's memory alive even if the generation
            // is closed (and its `banks` dropped) while the copy runs.
            let bank = self.rank_locked(&st, rank)?;
            if p.ranks[rank as usize].acked {
                return Err(BankError::RankAcked {
                    store_id,
                    rank,
                    index: first,
                });
            }
            let p = st.pending.get_mut(&store_id).expect("present above");
            p.ranks[rank as usize].in_flight += 1;
            for slot in &slots {
                *st.writing.entry(*slot).or_insert(0) += 1;
            }
            (bank, slots, end)
        };
        let copied = copy(&bank, &slots);
        let mut st = self.shared.state.lock();
        let still_pending = match st.pending.get_mut(&store_id) {
            Some(p) => {
                let part = &mut p.ranks[rank as usize];
                part.in_flight -= 1;
                // A failed copy may have changed part of the bytes: its
                // entries are unwritten until a copy into them succeeds.
                part.written[first..end].fill(copied.is_ok());
                true
            }
            None => false,
        };
        for slot in &slots {
            let n = st.writing.get_mut(slot).expect("counted above");
            *n -= 1;
            if *n == 0 {
                st.writing.remove(slot);
                if st.orphaned_writes.remove(slot) {
                    st.table.rollback(&[*slot]);
                }
            }
        }
        match copied {
            Ok(Source::Host(b)) => st.stats.store_bytes_from_host += b,
            Ok(Source::Device(b)) => st.stats.store_bytes_from_device += b,
            Err(_) => {}
        }
        self.shared.writes_done.notify_all();
        drop(st);
        copied?;
        if still_pending {
            Ok(())
        } else {
            Err(BankError::UnknownStore(store_id))
        }
    }

    /// Rank `rank` wrote its part of every slot of store `store_id`: its
    /// part is sealed (later writes of the rank are refused).
    ///
    /// The bank checks it rather than trusting the caller: the ack first
    /// waits (lock released, at most until the store's deadline) for the
    /// rank's `write_pending*` copies still running, then refuses with
    /// [`BankError::Unwritten`] while any entry of the rank was not written
    /// by a successful [`BankManager::write_pending`] /
    /// [`BankManager::write_pending_from_device`]. Otherwise a rank that
    /// acked without writing would publish what its slots held before: the
    /// bytes of an evicted block (another request's KV) under this store's
    /// sequence hashes.
    ///
    /// A refused ack changes nothing and does not roll the store back: the
    /// store stays pending and invisible (no lookup, pin or event sees it),
    /// the rank may write the missing entries and ack again, or
    /// [`BankManager::fail`] it; otherwise the store timeout rolls it back.
    /// Nothing is half-published either way, since only the last rank's
    /// successful ack makes the store ready.
    ///
    /// When the last rank acks, the blocks become ready and one `Stored`
    /// event per contiguous run of new blocks is queued. A block excluded
    /// while the store was pending ([`BankManager::exclude`]), or whose parent
    /// was, and every later block of the store join the lineage and are freed
    /// instead, as [`BankManager::store`] would have refused them. Acking
    /// again a rank that acked returns the store's status again.
    ///
    /// # Errors
    /// [`BankError::BadRank`]; [`BankError::UnknownStore`] (already ready,
    /// rolled back, or never made); [`BankError::Unwritten`] (naming the
    /// rank's first unwritten entry; the store stays pending);
    /// [`BankError::StoreTimedOut`] when the deadline passed: the store is
    /// rolled back on all ranks; [`BankError::LeaseExpired`] /
    /// [`BankError::LeaseLost`] when the lease lapsed (every pending store is
    /// rolled back with the generation).
    pub fn ack(&self, store_id: u64, rank: u32) -> Result<StoreStatus, BankError> {
        let tp = self.shared.config.layout.tp_size();
        if rank >= tp {
            return Err(BankError::BadRank { rank, tp_size: tp });
        }
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        let timeout = self.shared.config.store_timeout;
        // The ack seals the rank's part (and the last one makes the blocks
        // readable), so it first waits (lock released) for the rank's
        // `write_pending*` copies still running, at most until the store's
        // deadline: only a finished copy counts as written. The last ack
        // waits for every rank's copies (a rank that acked has none: its
        // ack waited for them, and it can start no more).
        loop {
            let Some(p) = st.pending.get(&store_id) else {
                return Err(BankError::UnknownStore(store_id));
            };
            let last = (0u32..).zip(p.acked()).all(|(r, a)| a || r == rank);
            let running = if last {
                p.in_flight()
            } else {
                p.ranks[rank as usize].in_flight
            };
            if running == 0 {
                break;
            }
            let deadline = p.started + timeout;
            if self
                .shared
                .writes_done
                .wait_until(&mut st, deadline)
                .timed_out()
            {
                break; // past the deadline: rolled back just below
            }
        }
        if let Some(e) = self.time_out_locked(&mut st, store_id) {
            return Err(e);
        }
        let Some(p) = st.pending.get_mut(&store_id) else {
            return Err(BankError::UnknownStore(store_id));
        };
        let part = &mut p.ranks[rank as usize];
        if let Some((missing, first)) = part.unwritten() {
            tracing::warn!(
                store_id,
                rank,
                missing,
                first,
                "rank acked a store with unwritten entries; ack refused, the store stays pending"
            );
            return Err(BankError::Unwritten {
                store_id,
                rank,
                missing,
                first,
            });
        }
        part.acked = true;
        let missing = p.missing_ranks();
        if !missing.is_empty() {
            return Ok(StoreStatus::Waiting { missing });
        }
        let mut p = st.pending.remove(&store_id).expect("present above");
        // The rule of `store`, again at commit: a block excluded while the
        // store was pending (or whose parent was) ends it; it and every later
        // (descendant) block join the lineage and are freed, never ready.
        let lineage = &self.shared.config.lineage;
        let cut = lineage
            .first_tainted(
                p.entries
                    .iter()
                    .map(|(b, parent, _)| (b.sequence_hash, *parent)),
            )
            .unwrap_or(p.entries.len());
        let dropped = p.entries.split_off(cut);
        if !dropped.is_empty() {
            let hashes: Vec<SequenceHash> = dropped.iter().map(|e| e.0.sequence_hash).collect();
            lineage.mark(&hashes);
            st.stats.blocks_excluded += hashes.len() as u64;
            let freed: Vec<u32> = dropped.iter().map(|e| e.2).collect();
            st.table.rollback(&freed);
        }
        let slots: Vec<u32> = p.entries.iter().map(|e| e.2).collect();
        st.table.commit(&slots);
        st.stats.stores_ready += 1;
        st.stats.blocks_stored += slots.len() as u64;
        // One Stored event per run whose blocks chain one after another.
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        // Each block carries its logical slot, so a router in another
        // process resolves it from the events alone.
        for (mut b, parent, slot) in p.entries {
            b.slot = Some(slot);
            if run.last().is_some_and(|l| Some(l.sequence_hash) != parent) {
                let blocks = std::mem::take(&mut run);
                self.push_event(
                    &mut st,
                    KvEventData::Stored {
                        parent: run_parent,
                        blocks,
                    },
                );
            }
            if run.is_empty() {
                run_parent = parent;
            }
            run.push(b);
        }
        if !run.is_empty() {
            self.push_event(
                &mut st,
                KvEventData::Stored {
                    parent: run_parent,
                    blocks: run,
                },
            );
        }
        Ok(StoreStatus::Ready)
    }

    /// Rank `rank` failed to write its part: the store is rolled back on all
    /// ranks at once (never visible, no event). If another rank had neither
    /// acked nor failed, it may still be copying into the slots, so they stay
    /// quarantined for one more store timeout before reuse; the same holds for
    /// a store that timed out. A caller whose ranks write only through
    /// `write_pending*` rolls back with [`BankManager::abort`] instead, which
    /// frees the slots at once.
    ///
    /// # Errors
    /// [`BankError::BadRank`]; [`BankError::UnknownStore`].
    pub fn fail(&self, store_id: u64, rank: u32) -> Result<(), BankError> {
        let tp = self.shared.config.layout.tp_size();
        if rank >= tp {
            return Err(BankError::BadRank { rank, tp_size: tp });
        }
        let mut st = self.shared.state.lock();
        if !st.pending.contains_key(&store_id) {
            return Err(BankError::UnknownStore(store_id));
        }
        tracing::warn!(
            store_id,
            rank,
            "rank failed its store part; rolling back on all ranks"
        );
        self.rollback_locked(&mut st, store_id, Rollback::Failed(rank));
        Ok(())
    }

    /// Rolls pending store `store_id` back on every rank (never visible, no
    /// event) and frees its slots at once: the caller's word that every
    /// rank wrote the store only through [`BankManager::write_pending`] /
    /// [`BankManager::write_pending_from_device`], the writers the bank
    /// tracks. A slot one of them is copying into right now is freed when
    /// that copy ends (and the copy returns [`BankError::UnknownStore`]); a
    /// later call of them is refused, so no byte lands in a reused slot.
    ///
    /// [`BankManager::fail`] is the call for ranks that may write otherwise
    /// (a rank process copying into the slots by address): it quarantines
    /// the slots for one more store timeout while a rank has neither acked
    /// nor failed, which `abort` does not.
    ///
    /// # Errors
    /// [`BankError::UnknownStore`] when the store is not pending (already
    /// ready, rolled back, timed out, or never made).
    pub fn abort(&self, store_id: u64) -> Result<(), BankError> {
        let mut st = self.shared.state.lock();
        if !st.pending.contains_key(&store_id) {
            return Err(BankError::UnknownStore(store_id));
        }
        self.rollback_locked(&mut st, store_id, Rollback::Aborted);
        Ok(())
    }
}

/// Where the bytes of one store write came from (what [`BankStats`] counts).
enum Source {
    Host(u64),
    Device(u64),
}

/// Frees rolled-back `slots`, except those a `write_pending` copy is still
/// writing: those are freed when their last copy ends.
fn free_unwritten_locked(st: &mut State, slots: &[u32]) {
    let (busy, free): (Vec<u32>, Vec<u32>) = slots.iter().partition(|s| st.writing.contains_key(s));
    st.orphaned_writes.extend(busy);
    st.table.rollback(&free);
}
