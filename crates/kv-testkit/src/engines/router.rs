//! The router: an index fed by KV events, the product's advisor and cost
//! model, and a directory of local donors.

use super::*;

/// The router: index fed by KV events, advisor with the product's cost
/// model, directory of local donors.
pub struct Router {
    pub(super) index: Arc<InventoryIndex>,
    pub(super) directory: Arc<LocalDonorDirectory>,
    pub(super) advisor: ObservedAdvisor,
    pub(super) metrics: Arc<ReuseMetrics>,
    pub(super) next_key: u64,
}

impl Router {
    /// A router with `settings` (reuse OFF when `enable_decode_to_prefill_reuse` is false).
    ///
    /// # Errors
    /// [`EngineError::Router`] when the cost model refuses the settings.
    pub fn new(settings: ReuseSettings, tokens_per_block: u32) -> Result<Self, EngineError> {
        Self::with_metrics(settings, tokens_per_block, Arc::new(ReuseMetrics::new()))
    }

    /// [`Router::new`] recording its decisions (by verdict) and donor
    /// lookup times into `metrics`.
    ///
    /// # Errors
    /// Those of [`Router::new`].
    pub fn with_metrics(
        settings: ReuseSettings,
        tokens_per_block: u32,
        metrics: Arc<ReuseMetrics>,
    ) -> Result<Self, EngineError> {
        let model =
            CostModel::new(settings, tokens_per_block).map_err(|e| EngineError::Router {
                op: "cost_model",
                reason: e.to_string(),
            })?;
        let index = Arc::new(InventoryIndex::new());
        let directory = Arc::new(LocalDonorDirectory::new());
        let advisor = Advisor::new(
            index.clone(),
            directory.clone(),
            LiveCostModel::new(model),
            Arc::new(DecisionLog::new(256)),
            16_384,
        );
        Ok(Self {
            index,
            directory,
            advisor: ObservedAdvisor::new(advisor, metrics.clone()),
            metrics,
            next_key: 1,
        })
    }

    /// The metrics its decisions are recorded into.
    pub fn metrics(&self) -> &Arc<ReuseMetrics> {
        &self.metrics
    }

    /// Registers a worker incarnation (under a new key unless `key` is given,
    /// which retires the key's previous incarnation); returns its key.
    ///
    /// # Errors
    /// [`EngineError::Router`] when the index refuses it.
    pub fn register(
        &mut self,
        engine: EngineId,
        role: Role,
        layout: &KvLayout,
        key: Option<WorkerKey>,
    ) -> Result<WorkerKey, EngineError> {
        let key = key.unwrap_or_else(|| {
            self.next_key += 1;
            WorkerKey(self.next_key)
        });
        self.register_key(key, engine, role, layout)?;
        Ok(key)
    }

    /// Registers a worker incarnation under the caller-chosen `key` (which
    /// retires the key's previous incarnation). Unlike [`Router::register`]
    /// it takes `&self` and never allocates a key.
    ///
    /// # Errors
    /// [`EngineError::Router`] when the index refuses it.
    pub fn register_key(
        &self,
        key: WorkerKey,
        engine: EngineId,
        role: Role,
        layout: &KvLayout,
    ) -> Result<(), EngineError> {
        let info = WorkerInfo {
            engine,
            role,
            layout_fingerprint: layout.fingerprint(),
            tp_size: layout.tp_size(),
        };
        self.index
            .register_worker(key, info)
            .map(|_| ())
            .map_err(|e| EngineError::Router {
                op: "register",
                reason: e.to_string(),
            })
    }

    /// The inventory index its events feed (for inspection and resync).
    pub fn index(&self) -> &Arc<InventoryIndex> {
        &self.index
    }

    /// Makes a decode bank resolvable as a donor.
    pub fn add_donor(&self, bank: Arc<BankManager>) {
        self.directory.insert(bank, "inproc://decode");
    }

    /// Applies KV events from a worker.
    ///
    /// # Errors
    /// [`EngineError::Router`] when the index refuses an event.
    pub fn apply(&self, events: &[KvEvent]) -> Result<(), EngineError> {
        for e in events {
            self.index
                .apply_event(e)
                .map_err(|err| EngineError::Router {
                    op: "apply_event",
                    reason: err.to_string(),
                })?;
        }
        Ok(())
    }

    /// Applies KV events from a worker, skipping any the index refuses;
    /// returns the outcome of each event it accepted, in order.
    pub fn apply_with_outcomes(&self, events: &[KvEvent]) -> Vec<EventOutcome> {
        events
            .iter()
            .filter_map(|e| self.index.apply_event(e).ok())
            .collect()
    }

    /// Advice for a request routed to `target`, given the prompt's sealed
    /// block hashes directly (what [`Router::advise`] computes from tokens).
    pub fn advise_hashes(
        &self,
        request_id: &str,
        hashes: &[SequenceHash],
        target: EngineId,
    ) -> Advice {
        self.advisor.advise(request_id, hashes, target)
    }

    /// [`Router::advise_hashes`] for a request that may be cancelled while
    /// its lookup runs (`cancelled` is asked inside the lookup).
    pub fn advise_hashes_cancellable(
        &self,
        request_id: &str,
        hashes: &[SequenceHash],
        target: EngineId,
        cancelled: &dyn Fn() -> bool,
    ) -> Advice {
        self.advisor
            .advise_cancellable(request_id, hashes, target, cancelled)
    }

    /// Advice for a request routed to `target`.
    pub fn advise(
        &self,
        request_id: &str,
        prompt: &[u32],
        target: EngineId,
        tokens_per_block: usize,
    ) -> Advice {
        self.advise_hashes(request_id, &prompt_hashes(prompt, tokens_per_block), target)
    }
}
