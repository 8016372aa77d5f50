//! Who is a worker: [`InventoryIndex`]'s registrations, removals,
//! readmissions, resync requirements and the forgetting of retired
//! incarnations. Each goes through the twin's one mutation path
//! ([`Mutation`]), so both copies of the state agree; `state.rs` holds what
//! each copy does.

use super::*;

impl InventoryIndex {
    /// Registers a worker incarnation under its stable `key`.
    ///
    /// If `key` belonged to another incarnation, that one is retired: its
    /// entries are dropped and its later events are ignored (until
    /// [`InventoryIndex::forget_retired`]). If the engine was
    /// first seen through an event (keyed by [`WorkerKey::of_engine`]), it is
    /// re-keyed. Registration before the first event is optional but is the
    /// only way a restart is recognized.
    ///
    /// # Errors
    /// [`LookupError::RetiredIncarnation`], [`LookupError::ZeroTpSize`],
    /// [`LookupError::IdentityMismatch`] when the engine is known with another
    /// role, layout fingerprint or TP size, [`LookupError::TooManyWorkers`].
    ///
    /// # Examples
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let old = worker(Role::Decode);
    /// assert_eq!(index.register_worker(WorkerKey(1), old)?, Registration::Registered);
    /// index.apply_event(&event(&old, 1, RET, stored(4)))?;
    /// // The worker restarts: a new incarnation under the same key replaces the old one.
    /// let new = WorkerInfo { engine: EngineId::fresh(), ..old };
    /// assert_eq!(index.register_worker(WorkerKey(1), new)?, Registration::Replaced { old: old.engine });
    /// assert_eq!(index.stats().held_blocks_in(RET), 0); // the old one's 4 blocks are gone
    /// // The old incarnation's late events are ignored and it cannot come back
    /// // (unless the index is told to forget it: `forget_retired`).
    /// assert_eq!(index.apply_event(&event(&old, 2, RET, stored(4)))?, EventOutcome::FromRetiredIncarnation);
    /// let refused = index.register_worker(WorkerKey(2), old);
    /// assert_eq!(refused, Err(LookupError::RetiredIncarnation { engine: old.engine }));
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn register_worker(
        &self,
        key: WorkerKey,
        info: WorkerInfo,
    ) -> Result<Registration, LookupError> {
        match self
            .state
            .write(|b| b.apply(Mutation::Register { key, info }))
        {
            Effect::Register(r) => r,
            _ => unreachable!("a registration reports a registration"),
        }
    }

    /// Retires an incarnation: drops all its entries and ignores its later
    /// events (until [`InventoryIndex::forget_retired`]). Returns false when
    /// the engine was not live.
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// let d = worker(Role::Decode);
    /// index.apply_event(&event(&d, 1, StorageTier::Device, stored(4)))?;
    /// assert!(index.remove_worker(d.engine));
    /// assert!(!index.remove_worker(d.engine)); // no longer live
    /// assert_eq!((index.stats().workers, index.stats().entries), (0, 0));
    /// let late = index.apply_event(&event(&d, 2, StorageTier::Device, KvEventData::Cleared))?;
    /// assert_eq!(late, EventOutcome::FromRetiredIncarnation);
    /// # Ok::<(), LookupError>(())
    /// ```
    pub fn remove_worker(&self, engine: EngineId) -> bool {
        match self.state.write(|b| b.apply(Mutation::Remove { engine })) {
            Effect::Remove(r) => r,
            _ => unreachable!("a removal reports a removal"),
        }
    }

    /// Takes back an incarnation [`InventoryIndex::remove_worker`] removed
    /// (a worker dropped for silence that announces again; the caller
    /// decides that it was not replaced): registers it as
    /// [`InventoryIndex::register_worker`] does, but forgets its retirement,
    /// and excludes it as a donor until [`InventoryIndex::resync_worker`],
    /// because the events it published while removed were never applied.
    /// Its entries start empty; its next events apply (as after a gap).
    /// A live engine is only marked for the resync.
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// let index = InventoryIndex::new();
    /// let d = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(42), tp_size: 1 };
    /// index.register_worker(WorkerKey(1), d).unwrap();
    /// index.remove_worker(d.engine);
    /// assert!(index.register_worker(WorkerKey(1), d).is_err(), "retired");
    /// index.readmit_worker(WorkerKey(1), d).unwrap();
    /// assert_eq!(index.workers_needing_resync(), vec![d.engine]);
    /// index.resync_worker(d.engine, 9, &[]).unwrap();
    /// assert!(index.workers_needing_resync().is_empty());
    /// ```
    ///
    /// # Errors
    /// As [`InventoryIndex::register_worker`], except
    /// [`LookupError::RetiredIncarnation`], which it never returns.
    pub fn readmit_worker(
        &self,
        key: WorkerKey,
        info: WorkerInfo,
    ) -> Result<Registration, LookupError> {
        match self
            .state
            .write(|b| b.apply(Mutation::Readmit { key, info }))
        {
            Effect::Register(r) => r,
            _ => unreachable!("a readmission reports a registration"),
        }
    }

    /// Excludes live `engine` as a donor until its next
    /// [`InventoryIndex::resync_worker`] (its entries stay, its events
    /// still apply): what the caller does when it knows it missed events
    /// the stream cannot show as a gap, e.g. after its own disconnection
    /// from the event transport. Returns false when `engine` is not live.
    pub fn require_resync(&self, engine: EngineId) -> bool {
        match self
            .state
            .write(|b| b.apply(Mutation::RequireResync { engine }))
        {
            Effect::RequireResync(r) => r,
            _ => unreachable!("a resync requirement reports a resync requirement"),
        }
    }

    /// Forgets that `engine` was retired (replaced, or removed by
    /// [`InventoryIndex::remove_worker`]): the id is then as unknown to the
    /// index as one never seen. Returns false, changing nothing, when
    /// `engine` is not remembered as retired (live, never seen, or
    /// forgotten already). Goes through the same writer path as every
    /// mutation (both copies forget it; one publication).
    ///
    /// The index remembers each retired incarnation until then
    /// ([`IndexStats::retired_incarnations`]), one more per worker restart
    /// or removal: a caller that bounds its own memory of dropped workers
    /// (the router's worker registry forgets them after a retention)
    /// forgets each one here too, once its stray messages can no longer be
    /// in flight.
    ///
    /// What a forgotten id then gets (nothing the index held of it before
    /// its retirement comes back: those entries were dropped with it):
    /// - [`InventoryIndex::register_worker`] registers it as a new worker
    ///   ([`Registration::Registered`], or `Replaced` when its key is
    ///   taken), empty, instead of [`LookupError::RetiredIncarnation`];
    /// - its events are no longer [`EventOutcome::FromRetiredIncarnation`]:
    ///   they are not refused either, but one that comes before any
    ///   registration registers it as any unknown publisher's does (keyed
    ///   by [`WorkerKey::of_engine`]). Its event ids go on from where they
    ///   were while a new record expects id 1, so its first event after
    ///   coming back is a [`EventOutcome::Gap`] (unless it is id 1), which
    ///   excludes it as a donor until [`InventoryIndex::resync_worker`].
    ///
    /// ```
    /// # use kv_descriptor::*;
    /// # use kv_lookup::*;
    /// # let index = InventoryIndex::new();
    /// # let fp = LayoutFingerprint(42);
    /// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
    /// # let tokens: Vec<u32> = (0..64).collect();
    /// # let hashes = sequence_hashes(&tokens, 16);
    /// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
    /// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
    /// # let stored = |n: usize| KvEventData::Stored { parent: None, blocks: blocks[..n].to_vec() };
    /// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
    /// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
    /// const RET: StorageTier = StorageTier::RetainedGpuDirect;
    /// let (d, p) = (worker(Role::Decode), worker(Role::Prefill));
    /// index.register_worker(WorkerKey(1), d)?;
    /// index.register_worker(WorkerKey(2), p)?;
    /// index.apply_event(&event(&d, 1, RET, stored(4)))?;
    /// index.remove_worker(d.engine); // its 4 blocks go with it
    /// assert_eq!(index.register_worker(WorkerKey(1), d), Err(LookupError::RetiredIncarnation { engine: d.engine }));
    /// assert_eq!(index.stats().retired_incarnations, 1);
    /// assert!(index.forget_retired(d.engine));
    /// assert!(!index.forget_retired(d.engine)); // forgotten already
    /// assert!(!index.forget_retired(p.engine)); // live: untouched
    /// assert_eq!(index.stats().retired_incarnations, 0);
    /// // It registers as a new worker would, holding nothing of before.
    /// assert_eq!(index.register_worker(WorkerKey(1), d)?, Registration::Registered);
    /// let donor = || index.lookup(&hashes, p.engine, LookupBudget::default()).donor;
    /// assert_eq!(donor(), Err(NoDonorReason::NoRootCoverage));
    /// // It published events 2 and 3 while it was away: its next one is a
    /// // gap, and it is no donor until a resync.
    /// let next = index.apply_event(&event(&d, 4, RET, stored(4)))?;
    /// assert_eq!(next, EventOutcome::Gap { expected: 1, got: 4, changed: 4 });
    /// assert_eq!(donor(), Err(NoDonorReason::NoCompatibleDonor));
    /// index.resync_worker(d.engine, 4, &[(RET, hashes.clone())])?;
    /// assert_eq!(donor()?.blocks, 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forget_retired(&self, engine: EngineId) -> bool {
        match self
            .state
            .write(|b| b.apply(Mutation::ForgetRetired { engine }))
        {
            Effect::ForgetRetired(r) => r,
            _ => unreachable!("forgetting a retired incarnation reports whether it was one"),
        }
    }
}
