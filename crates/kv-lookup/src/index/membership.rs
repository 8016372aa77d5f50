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
    /// entries are dropped and its later events are ignored. If the engine was
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
    /// // The old incarnation's late events are ignored and it cannot come back.
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
    /// events. Returns false when the engine was not live.
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
}
