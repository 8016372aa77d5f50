//! `State`'s own work: a worker's registration, removal and resync, and the
//! application of one checked event to one copy of the index (both copies
//! of the left-right twin run exactly this code, the second from the
//! first's memo). What the public `InventoryIndex` does around it (checks,
//! publication, logging) stays in `index.rs`.

use super::*;

impl State {
    pub(crate) fn new(group_capacity: usize) -> Self {
        Self {
            groups: Vec::new(),
            map_bytes: 0,
            workers: Vec::new(),
            by_engine: HashMap::new(),
            by_key: HashMap::new(),
            retired: HashSet::new(),
            free_slots: Vec::new(),
            donor_masks: Vec::new(),
            group_capacity,
            events_applied: 0,
            duplicates: 0,
            gaps: 0,
            from_retired: 0,
            unchained: 0,
        }
    }

    /// Counters and sizes of this copy.
    pub(crate) fn stats(&self) -> IndexStats {
        let st = self;
        let mut held = [0u64; TIERS];
        for w in st.workers.iter().flatten() {
            for (h, l) in held.iter_mut().zip(w.live) {
                *h += l;
            }
        }
        IndexStats {
            workers: st.by_engine.len(),
            workers_needing_resync: st
                .workers
                .iter()
                .flatten()
                .filter(|w| w.needs_resync)
                .count(),
            retired_incarnations: st.retired.len(),
            entries: st.groups.iter().map(HolderTable::len).sum(),
            held_blocks: held,
            table_bytes: st
                .groups
                .iter()
                .map(HolderTable::memory_bytes)
                .sum::<usize>()
                + st.map_bytes,
            events_applied: st.events_applied,
            duplicates: st.duplicates,
            gaps: st.gaps,
            from_retired: st.from_retired,
            unchained: st.unchained,
        }
    }

    pub(crate) fn register(
        &mut self,
        key: WorkerKey,
        info: WorkerInfo,
        locs: &mut Locs<'_>,
    ) -> Result<Registration, LookupError> {
        let engine = info.engine;
        if self.retired.contains(&engine) {
            return Err(LookupError::RetiredIncarnation { engine });
        }
        if info.tp_size == 0 {
            return Err(LookupError::ZeroTpSize { engine });
        }
        if let Some(&slot) = self.by_engine.get(&engine) {
            let rec = self.workers[slot as usize]
                .as_ref()
                .expect("slot of a live engine");
            check_identity(&rec.info, info.role, info.layout_fingerprint, info.tp_size)?;
            if rec.key == key {
                return Ok(Registration::AlreadyRegistered);
            }
            // Re-key (the engine was first seen through an event); whoever
            // held the new key before is an older incarnation.
            let old_key = rec.key;
            let replaced = self.retire_holder_of(key, locs);
            self.by_key.remove(&old_key);
            self.by_key.insert(key, slot);
            self.workers[slot as usize].as_mut().expect("live").key = key;
            self.rebuild_donor_masks();
            return Ok(match replaced {
                Some(old) => Registration::Replaced { old },
                None => Registration::AlreadyRegistered,
            });
        }
        let replaced = self.retire_holder_of(key, locs);
        self.insert_worker(key, info, locs)?;
        Ok(match replaced {
            Some(old) => Registration::Replaced { old },
            None => Registration::Registered,
        })
    }

    /// [`State::register`] for an incarnation that may have been removed:
    /// its retirement is forgotten, and the worker starts empty and
    /// excluded as a donor until a resync (its events were missed).
    pub(crate) fn readmit(
        &mut self,
        key: WorkerKey,
        info: WorkerInfo,
        locs: &mut Locs<'_>,
    ) -> Result<Registration, LookupError> {
        self.retired.remove(&info.engine);
        let registration = self.register(key, info, locs)?;
        let slot = *self.by_engine.get(&info.engine).expect("just registered");
        self.mark_needs_resync(slot);
        Ok(registration)
    }

    /// Forgets that `engine` was retired; false when it was not
    /// remembered as retired (live, never seen, or forgotten already).
    /// Nothing else of it is left to drop: `retire` dropped its entries
    /// and its record.
    pub(crate) fn forget_retired(&mut self, engine: EngineId) -> bool {
        self.retired.remove(&engine)
    }

    /// Marks a live engine as needing a resync (no donor until then);
    /// false when it is not live.
    pub(crate) fn require_resync(&mut self, engine: EngineId) -> bool {
        match self.by_engine.get(&engine) {
            Some(&slot) => {
                self.mark_needs_resync(slot);
                true
            }
            None => false,
        }
    }

    fn insert_worker(
        &mut self,
        key: WorkerKey,
        info: WorkerInfo,
        locs: &mut Locs<'_>,
    ) -> Result<u32, LookupError> {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let s = self.workers.len();
                if s >= MAX_WORKERS {
                    return Err(LookupError::TooManyWorkers {
                        engine: info.engine,
                        limit: MAX_WORKERS,
                    });
                }
                self.workers.push(None);
                s as u32
            }
        };
        let (g, _) = split(slot);
        while self.groups.len() <= g {
            let cap = if self.groups.is_empty() {
                self.group_capacity
            } else {
                0
            };
            self.groups.push(HolderTable::with_capacity(cap));
            locs.add_group();
        }
        self.workers[slot as usize] = Some(WorkerRecord::new(key, info));
        self.by_engine.insert(info.engine, slot);
        self.by_key.insert(key, slot);
        self.rebuild_donor_masks();
        Ok(slot)
    }

    /// Retires the incarnation that holds `key`, if any, and returns it.
    fn retire_holder_of(&mut self, key: WorkerKey, locs: &mut Locs<'_>) -> Option<EngineId> {
        let slot = *self.by_key.get(&key)?;
        let old = self.workers[slot as usize]
            .as_ref()
            .expect("live")
            .info
            .engine;
        self.retire(slot, locs);
        Some(old)
    }

    /// Drops every entry of `slot`, frees it and remembers the engine as retired.
    pub(crate) fn retire(&mut self, slot: u32, locs: &mut Locs<'_>) {
        self.drop_entries(slot, locs);
        let rec = self.workers[slot as usize]
            .take()
            .expect("retiring a live slot");
        self.by_engine.remove(&rec.info.engine);
        if self.by_key.get(&rec.key) == Some(&slot) {
            self.by_key.remove(&rec.key);
        }
        self.retired.insert(rec.info.engine);
        self.free_slots.push(slot);
    }

    /// Clears every tier of `slot` using its logs (exact, no table scan).
    pub(crate) fn drop_entries(&mut self, slot: u32, locs: &mut Locs<'_>) {
        for t in 0..TIERS {
            self.clear_tier(slot, t, locs);
        }
    }

    fn clear_tier(&mut self, slot: u32, tier: usize, locs: &mut Locs<'_>) -> u64 {
        let (g, bit) = split(slot);
        let rec = self.workers[slot as usize].as_mut().expect("live slot");
        let log = std::mem::take(&mut rec.logs[tier]);
        rec.removed[tier] = Vec::new();
        let mut changed = 0;
        let table = &mut self.groups[g];
        let mut locator = locs.group(g);
        for h in log {
            changed += u64::from(table.clear_deferring(&mut locator, h, tier, bit));
        }
        table.finish_clears(&mut locator);
        rec.live[tier] = 0;
        changed
    }

    /// Sets `slot`'s bit in `tier` for every hash of `hashes`, prefetching
    /// index slots and entries ahead (events carry hashes that are random in
    /// the table: without prefetch each block waits for two misses in turn).
    /// `chained`: `hashes` are proven to be one chain in chain order (a
    /// Stored event that passed its chain check), so their run may be
    /// skipped through by chunks; a resync's unchecked list is not.
    /// `memoize`: a compaction of the worker's log is handed to the replay
    /// on the other copy ([`MutationMemo::compacted`]); false where a
    /// mutation may store more than once (a resync, which empties the log
    /// first and so never compacts it): each copy then compacts its own.
    pub(crate) fn store(
        &mut self,
        slot: u32,
        tier: usize,
        hashes: &[SequenceHash],
        chained: bool,
        memoize: bool,
        locs: &mut Locs<'_>,
    ) -> u64 {
        let (g, bit) = split(slot);
        let table = &mut self.groups[g];
        let (mut locator, memo) = locs.group_and_compaction(g);
        let rec = self.workers[slot as usize].as_mut().expect("live slot");
        let mut changed = 0;
        for (i, &h) in hashes.iter().enumerate() {
            table.prefetch_pass(&locator, hashes, i);
            // In a chained list block `i`'s parent is block `i - 1`.
            let follows = chained && i > 0;
            let room = hashes.len() - i;
            if table.set_with_room(&mut locator, h, tier, bit, chained, follows, room) {
                rec.logs[tier].push(h);
                changed += 1;
            }
        }
        table.close_run();
        rec.live[tier] += changed;
        if rec.log_needs_compaction(tier) {
            let mut own = None;
            let memo = if memoize { memo } else { &mut own };
            compact_log(table, locator.map(), rec, tier, bit, memo);
        }
        changed
    }

    fn remove(
        &mut self,
        slot: u32,
        tier: usize,
        hashes: &[SequenceHash],
        locs: &mut Locs<'_>,
    ) -> u64 {
        let (g, bit) = split(slot);
        let table = &mut self.groups[g];
        let mut locator = locs.group(g);
        let rec = self.workers[slot as usize].as_mut().expect("live slot");
        let mut changed = 0;
        for (i, &h) in hashes.iter().enumerate() {
            table.prefetch_pass(&locator, hashes, i);
            if table.clear_deferring(&mut locator, h, tier, bit) {
                // For the next log compaction (see `WorkerRecord::removed`).
                rec.removed[tier].push(h);
                changed += 1;
            }
        }
        table.finish_clears(&mut locator);
        // No log compaction here: removals never grow the log, and
        // compacting while a worker drains would re-read every entry it
        // still lists. The next store compacts if the log got too stale.
        rec.live[tier] -= changed;
        changed
    }

    /// Applies event `e`, with the parts of it computed once before the
    /// lock ([`CheckedEvent`]).
    pub(crate) fn apply_event(
        &mut self,
        e: &CheckedEvent,
        locs: &mut Locs<'_>,
    ) -> Result<EventOutcome, LookupError> {
        let engine = e.publisher;
        if e.event_id == 0 {
            return Err(LookupError::ZeroEventId { engine });
        }
        if e.tp_size == 0 {
            return Err(LookupError::ZeroTpSize { engine });
        }
        let slot = match self.by_engine.get(&engine) {
            Some(&slot) => slot,
            None if self.retired.contains(&engine) => {
                self.from_retired += 1;
                return Ok(EventOutcome::FromRetiredIncarnation);
            }
            None => {
                let info = WorkerInfo {
                    engine,
                    role: e.role,
                    layout_fingerprint: e.layout_fingerprint,
                    tp_size: e.tp_size,
                };
                self.insert_worker(WorkerKey::of_engine(engine), info, locs)?
            }
        };
        let rec = self.workers[slot as usize]
            .as_mut()
            .expect("slot of a live engine");
        check_identity(&rec.info, e.role, e.layout_fingerprint, e.tp_size)?;
        let last = rec.last_event_id;
        if e.event_id <= last {
            self.duplicates += 1;
            return Ok(EventOutcome::Duplicate {
                last_event_id: last,
            });
        }
        let gap = e.event_id != last + 1;
        rec.last_event_id = e.event_id;
        let tier = tier_index(e.tier);
        let unchained = match &e.change {
            Change::Stored {
                parent,
                hashes,
                broken_link,
            } => self.why_unchained(slot, tier, *parent, hashes.is_empty(), *broken_link, locs),
            _ => None,
        };
        let changed = match (&e.change, unchained) {
            (_, Some(_)) => {
                self.unchained += 1;
                0
            }
            (Change::Stored { hashes, .. }, None) => {
                // Chained: `why_unchained` found no broken link.
                self.store(slot, tier, hashes, true, true, locs)
            }
            (Change::Removed { hashes }, None) => self.remove(slot, tier, hashes, locs),
            (Change::Cleared, None) => self.clear_tier(slot, tier, locs),
        };
        if gap || unchained.is_some() {
            self.mark_needs_resync(slot);
        }
        if gap {
            self.events_applied += 1;
            self.gaps += 1;
            return Ok(EventOutcome::Gap {
                expected: last + 1,
                got: e.event_id,
                changed,
            });
        }
        if let Some(cause) = unchained {
            return Ok(EventOutcome::Unchained { cause });
        }
        self.events_applied += 1;
        Ok(EventOutcome::Applied { changed })
    }

    /// Why a Stored event of `slot` in `tier` does not chain, if it does not
    /// (see [`InventoryIndex::apply_event`]). Reads only (one map answer).
    fn why_unchained(
        &self,
        slot: u32,
        tier: usize,
        parent: Option<SequenceHash>,
        no_blocks: bool,
        broken_link: Option<UnchainedStore>,
        locs: &mut Locs<'_>,
    ) -> Option<UnchainedStore> {
        if no_blocks {
            return None;
        }
        if let Some(p) = parent {
            let (g, bit) = split(slot);
            if self.groups[g].get(&mut locs.group(g), p)[tier] >> bit & 1 == 0 {
                return Some(UnchainedStore::ParentNotHeld { parent: p });
            }
        }
        broken_link
    }

    /// Excludes `slot` as a donor until a resync.
    fn mark_needs_resync(&mut self, slot: u32) {
        let rec = self.workers[slot as usize].as_mut().expect("live");
        if !rec.needs_resync {
            rec.needs_resync = true;
            self.rebuild_donor_masks();
        }
    }

    /// Recomputes the donor candidate bitsets; called on every membership or
    /// resync-state change (rare), so lookups read them without work.
    pub(crate) fn rebuild_donor_masks(&mut self) {
        let groups = self.groups.len();
        let mut masks: Vec<DonorMask> = Vec::new();
        for (slot, rec) in self.workers.iter().enumerate() {
            let Some(rec) = rec else { continue };
            if rec.info.role != Role::Decode || rec.needs_resync {
                continue;
            }
            let (g, bit) = split(slot as u32);
            let i = match masks.iter().position(|m| {
                m.fingerprint == rec.info.layout_fingerprint && m.tp_size == rec.info.tp_size
            }) {
                Some(i) => i,
                None => {
                    masks.push(DonorMask {
                        fingerprint: rec.info.layout_fingerprint,
                        tp_size: rec.info.tp_size,
                        groups: vec![0; groups],
                    });
                    masks.len() - 1
                }
            };
            masks[i].groups[g] |= 1 << bit;
        }
        self.donor_masks = masks;
    }
}

fn check_identity(
    known: &WorkerInfo,
    role: Role,
    fp: LayoutFingerprint,
    tp: u32,
) -> Result<(), LookupError> {
    if known.role != role {
        return Err(LookupError::role_mismatch(known.engine, known.role, role));
    }
    if known.layout_fingerprint != fp {
        return Err(LookupError::fingerprint_mismatch(
            known.engine,
            known.layout_fingerprint,
            fp,
        ));
    }
    if known.tp_size != tp {
        return Err(LookupError::tp_mismatch(known.engine, known.tp_size, tp));
    }
    Ok(())
}
