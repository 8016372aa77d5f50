//! The decode engine: continues generation and retains every sealed block
//! of prompt + output in its bank.

use super::*;

/// A decode engine: continues generation from a prefilled cache and retains
/// every sealed block of prompt + output in its bank when the request ends.
pub struct DecodeEngine {
    pub(super) model: Arc<ReferenceModel>,
    pub(super) bank: Arc<BankManager>,
    pub(super) host_id: String,
    pub(super) budget_bytes: u64,
    pub(super) profile: MemoryProfile,
    pub(super) metrics: Arc<ReuseMetrics>,
}

fn new_bank(
    config: BankConfig,
    host_id: &str,
    profile: &MemoryProfile,
) -> Result<BankManager, EngineError> {
    match profile {
        MemoryProfile::Host => BankManager::new_host_shm(config, host_id),
        MemoryProfile::Cuda { ordinals } => BankManager::new_cuda(config, host_id, ordinals),
    }
    .map_err(bank_err("new"))
}

impl DecodeEngine {
    /// A decode engine with a bank of `budget_bytes` (all ranks together)
    /// for `tp` ranks in `profile`'s memory.
    ///
    /// # Errors
    /// [`EngineError::Model`] for an unsupported `tp`, [`EngineError::Bank`]
    /// when the bank cannot be created.
    pub fn new(
        model: Arc<ReferenceModel>,
        tp: u32,
        budget_bytes: u64,
        host_id: &str,
        profile: &MemoryProfile,
    ) -> Result<Self, EngineError> {
        Self::with_metrics(
            model,
            tp,
            budget_bytes,
            host_id,
            profile,
            Arc::new(ReuseMetrics::new()),
        )
    }

    /// [`DecodeEngine::new`] recording its bank's retained bytes (per
    /// engine incarnation and rank) into `metrics`.
    ///
    /// # Errors
    /// Those of [`DecodeEngine::new`].
    pub fn with_metrics(
        model: Arc<ReferenceModel>,
        tp: u32,
        budget_bytes: u64,
        host_id: &str,
        profile: &MemoryProfile,
        metrics: Arc<ReuseMetrics>,
    ) -> Result<Self, EngineError> {
        let layout = model.config().layout(tp)?;
        let config = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), budget_bytes);
        let bank = Arc::new(new_bank(config, host_id, profile)?);
        metrics.observe_bank(&bank);
        Ok(Self {
            model,
            bank,
            host_id: host_id.to_string(),
            budget_bytes,
            profile: profile.clone(),
            metrics,
        })
    }

    /// The metrics its retained bytes are recorded into.
    pub fn metrics(&self) -> &Arc<ReuseMetrics> {
        &self.metrics
    }

    /// The retained bank (donor side of a fetch).
    pub fn bank(&self) -> &Arc<BankManager> {
        &self.bank
    }
    /// Current incarnation.
    pub fn engine_id(&self) -> EngineId {
        self.bank.owner().engine_id
    }

    /// Kills this incarnation's bank (closes it: pins refused, memory freed)
    /// and starts a new incarnation with an empty bank, as a restarted
    /// process would. Returns the old bank's final events (`Cleared`).
    ///
    /// # Errors
    /// [`EngineError::Bank`] when the new bank cannot be created.
    pub fn kill_and_restart(&mut self) -> Result<Vec<KvEvent>, EngineError> {
        let _ = self.bank.close(Duration::from_secs(1));
        let events = self.bank.drain_events();
        // The dead incarnation retains nothing any more.
        let old = self.bank.owner().engine_id;
        for rank in 0..self.bank.manifest().layout().tp_size() {
            self.metrics.set_retained_bytes(old, rank, 0);
        }
        let layout = self.bank.config().layout;
        let config = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), self.budget_bytes);
        self.bank = Arc::new(new_bank(config, &self.host_id, &self.profile)?);
        self.metrics.observe_bank(&self.bank);
        Ok(events)
    }

    /// Generates `max_new` tokens in total, the first being `first_token`
    /// (from prefill), continuing `cache` (which holds the prompt); then
    /// stores every sealed block of the conversation (`all_tokens` = prompt +
    /// output) in the bank. Returns the output and the bank's events.
    ///
    /// # Errors
    /// [`EngineError::Model`]; [`EngineError::Bank`] when the store fails
    /// (the store is rolled back by the bank; generation output is lost).
    pub fn decode(
        &self,
        mut cache: KvCache,
        prompt: &[u32],
        first_token: u32,
        max_new: usize,
    ) -> Result<(Vec<u32>, Vec<KvEvent>), EngineError> {
        let mut out = vec![first_token];
        while out.len() < max_new {
            let logits = self.model.prefill(&mut cache, &out[out.len() - 1..])?;
            out.push(argmax(&logits));
        }
        let bs = cache.layout().tokens_per_block() as usize;
        let computed: Vec<u32> = prompt
            .iter()
            .chain(&out)
            .copied()
            .take(cache.len_tokens())
            .collect();
        let blocks = sealed_blocks(None, &computed, bs);
        let store = self.bank.store(None, &blocks).map_err(bank_err("store"))?;
        if !store.is_empty() {
            let index: HashMap<SequenceHash, usize> = blocks
                .iter()
                .enumerate()
                .map(|(i, b)| (b.sequence_hash, i))
                .collect();
            for rank in 0..cache.layout().tp_size() {
                for (e, (h, _slot)) in store.entries.iter().enumerate() {
                    let parts = cache.export_blocks(index[h], 1)?;
                    self.bank
                        .write_pending(store.store_id, rank, e, &parts[rank as usize])
                        .map_err(bank_err("write_pending"))?;
                }
                let status = self
                    .bank
                    .ack(store.store_id, rank)
                    .map_err(bank_err("ack"))?;
                if rank + 1 == cache.layout().tp_size() && status != StoreStatus::Ready {
                    return Err(EngineError::Bank {
                        op: "ack",
                        reason: format!(
                            "store {} not ready after every rank acked",
                            store.store_id
                        ),
                    });
                }
            }
        }
        self.metrics.observe_bank(&self.bank);
        Ok((out, self.bank.drain_events()))
    }
}
