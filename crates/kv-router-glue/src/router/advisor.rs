//! The router-side advisor: after the router picked a prefill target, find a
//! donor within budget, price the fetch, and attach the hint or say why not.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kv_bank::BankManager;
use kv_descriptor::{BankManifest, EngineId, FetchGpuHint, FetchPart, HintEnvelope, SequenceHash};
use kv_lookup::{InventoryIndex, LookupBudget, LookupOutcome, NoDonorReason};
use parking_lot::RwLock;

use crate::{
    validate_hint, AdmissionDecision, CostInputs, DecisionLog, LiveCostModel, RefuseReason,
    ResolveError, TransferPath, Verdict,
};

/// A donor's bank as the router needs it to write a hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedDonor {
    /// The donor's current manifest (engine, generation, layout, slot count, location).
    pub manifest: BankManifest,
    /// Logical slot of each asked hash, in order.
    pub slot_ids: Vec<u32>,
    /// Where the target reaches the donor's control plane.
    pub control_endpoint: String,
}

/// Maps a donor and sequence hashes to slots. The index knows *who* holds a
/// prefix; only the donor's bank knows *where*.
pub trait DonorDirectory: Send + Sync {
    /// Resolves `hashes` in `donor`'s bank.
    ///
    /// # Errors
    /// [`ResolveError::UnknownDonor`] when the donor is unknown,
    /// [`ResolveError::BlockGone`] naming the first block it no longer holds.
    fn resolve(
        &self,
        donor: EngineId,
        hashes: &[SequenceHash],
    ) -> Result<ResolvedDonor, ResolveError>;
}

/// Directory over bank managers of this process (local cluster, tests, qualify).
#[derive(Default)]
pub struct LocalDonorDirectory {
    donors: RwLock<HashMap<EngineId, (Arc<BankManager>, String)>>,
}

impl std::fmt::Debug for LocalDonorDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalDonorDirectory")
            .field("donors", &self.donors.read().len())
            .finish()
    }
}

impl LocalDonorDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds (or replaces) the bank of its owner engine.
    pub fn insert(&self, bank: Arc<BankManager>, control_endpoint: impl Into<String>) {
        let engine = bank.owner().engine_id;
        self.donors
            .write()
            .insert(engine, (bank, control_endpoint.into()));
    }
    /// Forgets a donor (it closed its bank or died).
    pub fn remove(&self, engine: EngineId) {
        self.donors.write().remove(&engine);
    }
}

impl DonorDirectory for LocalDonorDirectory {
    fn resolve(
        &self,
        donor: EngineId,
        hashes: &[SequenceHash],
    ) -> Result<ResolvedDonor, ResolveError> {
        let donors = self.donors.read();
        let (bank, endpoint) = donors
            .get(&donor)
            .ok_or(ResolveError::UnknownDonor { donor })?;
        let slot_ids = hashes
            .iter()
            .enumerate()
            .map(|(index, h)| {
                bank.lookup(h)
                    .ok_or(ResolveError::BlockGone { index, hash: *h })
            })
            .collect::<Result<Vec<u32>, ResolveError>>()?;
        Ok(ResolvedDonor {
            manifest: bank.manifest().clone(),
            slot_ids,
            control_endpoint: endpoint.clone(),
        })
    }
}

/// What the advisor decided for one request.
#[derive(Debug, Clone)]
pub struct Advice {
    /// The decision with every term (also recorded in the advisor's log).
    pub decision: AdmissionDecision,
    /// The envelope to attach to the request sent to the prefill target, when admitted.
    pub hint: Option<HintEnvelope>,
    /// The lookup's outcome, when a lookup ran.
    pub lookup: Option<LookupOutcome>,
}

/// Runs donor lookup, admission and hint construction for a chosen target.
///
/// Nothing here reserves anything on the donor: the hint names slots, and the
/// target's fetch executor pins them (or falls back) when it runs.
pub struct Advisor {
    index: Arc<InventoryIndex>,
    directory: Arc<dyn DonorDirectory>,
    model: LiveCostModel,
    log: Arc<DecisionLog>,
    max_probes: u32,
}

impl std::fmt::Debug for Advisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Advisor")
            .field("max_probes", &self.max_probes)
            .finish()
    }
}

impl Advisor {
    /// An advisor over `index` and `directory`, pricing with `model`,
    /// recording into `log`; each lookup may spend at most `max_probes` probes
    /// and `transfer_source_lookup_budget_ms` of time.
    pub fn new(
        index: Arc<InventoryIndex>,
        directory: Arc<dyn DonorDirectory>,
        model: LiveCostModel,
        log: Arc<DecisionLog>,
        max_probes: u32,
    ) -> Self {
        Self {
            index,
            directory,
            model,
            log,
            max_probes,
        }
    }

    /// The live model (retune through it).
    pub fn model(&self) -> &LiveCostModel {
        &self.model
    }

    /// The decision log.
    pub fn log(&self) -> &Arc<DecisionLog> {
        &self.log
    }

    /// Advises on `request_id` whose root-aligned block hashes are
    /// `sequence_hashes`, routed to prefill worker `target`.
    ///
    /// Steps: reuse off → refuse without lookup; bounded lookup (no donor →
    /// refuse with the lookup's reason); resolve the donor's slots for the
    /// blocks beyond the target's baseline; admission by the cost model with
    /// the measured lookup time; on admit, a hint validated against the
    /// donor's manifest, in a `kv.fetch_gpu@1.0` envelope with `message_id =
    /// request_id`. Every outcome is recorded.
    pub fn advise(
        &self,
        request_id: &str,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
    ) -> Advice {
        self.advise_cancellable(request_id, sequence_hashes, target, &|| false)
    }

    /// [`Advisor::advise`] for a request that may be cancelled while its
    /// donor lookup runs: `cancelled` is asked inside the lookup
    /// ([`InventoryIndex::lookup_cancellable`]) and once more before the
    /// hint is emitted; a cancelled request is refused with
    /// [`RefuseReason::Cancelled`] and gets no hint (nothing was reserved or
    /// pinned for it: the lookup only reads).
    ///
    /// ```no_run
    /// # fn f(advisor: &kv_router_glue::Advisor, hashes: &[kv_descriptor::SequenceHash],
    /// #      target: kv_descriptor::EngineId, token: &kv_transfer::CancelToken) {
    /// let advice = advisor.advise_cancellable("req-7", hashes, target, &|| token.is_cancelled());
    /// if advice.hint.is_none() {
    ///     // recompute the prompt
    /// }
    /// # }
    /// ```
    pub fn advise_cancellable(
        &self,
        request_id: &str,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
        cancelled: &dyn Fn() -> bool,
    ) -> Advice {
        let mut advice = self.decide(request_id, sequence_hashes, target, cancelled);
        if advice.hint.is_some() && cancelled() {
            advice.hint = None;
            advice.decision.verdict = Verdict::Refuse(RefuseReason::Cancelled);
        }
        self.log.record(&advice.decision);
        advice
    }

    fn decide(
        &self,
        request_id: &str,
        sequence_hashes: &[SequenceHash],
        target: EngineId,
        cancelled: &dyn Fn() -> bool,
    ) -> Advice {
        let model = self.model.current();
        let s = model.settings();
        let refuse = |reason: RefuseReason, lookup: Option<LookupOutcome>| Advice {
            decision: AdmissionDecision {
                request_id: request_id.to_string(),
                terms: None,
                verdict: Verdict::Refuse(reason),
            },
            hint: None,
            lookup,
        };
        if !s.enable_decode_to_prefill_reuse {
            return refuse(RefuseReason::ReuseDisabled, None);
        }
        let budget = LookupBudget {
            time: Duration::from_secs_f64(s.transfer_source_lookup_budget_ms / 1000.0),
            max_probes: self.max_probes,
        };
        let lookup_span = crate::spans::lookup(request_id);
        let outcome = lookup_span.in_scope(|| {
            self.index
                .lookup_cancellable(sequence_hashes, target, budget, cancelled)
        });
        lookup_span.record("elapsed_us", outcome.elapsed.as_micros() as u64);
        if let Ok(d) = &outcome.donor {
            lookup_span.record("donor_blocks", d.blocks);
        }
        let donor = match outcome.donor {
            Ok(d) => d,
            Err(NoDonorReason::Cancelled { .. }) => {
                return refuse(RefuseReason::Cancelled, Some(outcome))
            }
            Err(reason) => return refuse(RefuseReason::NoDonor(reason.to_string()), Some(outcome)),
        };
        let fetch_from = outcome.baseline.blocks();
        let covered = donor.blocks as usize;
        let Some(fetched) = sequence_hashes.get(fetch_from as usize..covered) else {
            return refuse(
                RefuseReason::NoDonor(format!(
                    "donor covers {covered} blocks, baseline {fetch_from}"
                )),
                Some(outcome),
            );
        };
        let resolved = match self.directory.resolve(donor.engine, fetched) {
            Ok(r) => r,
            Err(e) => return refuse(RefuseReason::HintUnavailable(e.to_string()), Some(outcome)),
        };
        let layout = *resolved.manifest.layout();
        // The index chose this donor for the layout it announced; the
        // directory record is what the target will trust. A record of
        // another layout (a misconfigured donor, or a record that outlived
        // a re-layout) would only be refused by the target after the pin:
        // refuse it here, naming both.
        if let Some((_, info)) = self.index.worker(target) {
            if layout.fingerprint() != info.layout_fingerprint || layout.tp_size() != info.tp_size {
                return refuse(
                    RefuseReason::HintUnavailable(format!(
                        "donor {}'s directory record has layout fingerprint {:#x} (TP {}), the target's is {:#x} (TP {})",
                        donor.engine,
                        layout.fingerprint().0,
                        layout.tp_size(),
                        info.layout_fingerprint.0,
                        info.tp_size
                    )),
                    Some(outcome),
                );
            }
        }
        let path = if resolved.manifest.parts()[0].location().is_gpu() {
            TransferPath::Gpu
        } else {
            TransferPath::Host
        };
        let blocks = fetched.len() as u64;
        let mut decision = model.admit(
            request_id,
            CostInputs {
                reused_tokens: blocks * u64::from(layout.tokens_per_block()),
                transfer_blocks: blocks,
                path,
                lookup_us: outcome.elapsed.as_secs_f64() * 1e6,
            },
        );
        if !decision.admitted() {
            return Advice {
                decision,
                hint: None,
                lookup: Some(outcome),
            };
        }
        let owner = *resolved.manifest.owner();
        let hint = FetchGpuHint {
            donor_engine_id: owner.engine_id,
            bank_generation: owner.generation,
            layout_fingerprint: layout.fingerprint(),
            tp_size: layout.tp_size(),
            sequence_hashes: sequence_hashes[..covered].to_vec(),
            fetch_from,
            parts: (0..layout.tp_size())
                .map(|r| FetchPart {
                    tp_rank: r,
                    slot_ids: resolved.slot_ids.clone(),
                    expected_bytes: blocks * layout.rank_block_bytes() as u64,
                })
                .collect(),
            donor_control_endpoint: resolved.control_endpoint,
        };
        // The same check the target runs: never emit a hint it would refuse.
        let envelope = validate_hint(&hint, &resolved.manifest, &layout)
            .map_err(|e| e.to_string())
            .and_then(|_| {
                HintEnvelope::fetch_gpu(request_id, "fetch-0", &hint).map_err(|e| e.to_string())
            });
        let hint = match envelope {
            Ok(env) => Some(env),
            Err(e) => {
                decision.verdict = Verdict::Refuse(RefuseReason::HintUnavailable(e));
                None
            }
        };
        Advice {
            decision,
            hint,
            lookup: Some(outcome),
        }
    }
}
