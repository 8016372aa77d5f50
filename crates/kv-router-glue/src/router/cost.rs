//! The cost model and admission: is fetching this prefix worth it?
//!
//! Estimated TTFT saving, in µs (issue #6):
//!
//! ```text
//! saving = reused_tokens x prefill_token_us − transfer_blocks x block_us − lookup_us
//! ```
//!
//! with `block_us` the GPU or host estimate depending on the path. A fetch is
//! admitted only when `saving >= minimum_estimated_ttft_saving_ms x 1000` and
//! `transfer_blocks >= minimum_transfer_prefix_blocks`. Every decision keeps
//! every term ([`CostTerms`]) so that an operator can see why.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::{ReuseSettings, SettingsError};

/// Which transfer path a fetch would take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferPath {
    /// Donor bank in GPU memory (CUDA IPC, NVLink, NIXL VRAM).
    Gpu,
    /// Donor bank in host memory (shared memory, NIXL DRAM).
    Host,
}

/// What the advisor knows about one candidate fetch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostInputs {
    /// Tokens the target would not recompute (`transfer_blocks x tokens_per_block`).
    pub reused_tokens: u64,
    /// Blocks to move.
    pub transfer_blocks: u64,
    /// Path of the donor's bank.
    pub path: TransferPath,
    /// Time the donor lookup took, in µs.
    pub lookup_us: f64,
}

/// Every term of one estimate, in µs unless the name says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostTerms {
    /// Path priced.
    pub path: TransferPath,
    /// Tokens not recomputed.
    pub reused_tokens: u64,
    /// Prefill cost per token used, µs.
    pub prefill_token_us: f64,
    /// `reused_tokens x prefill_token_us`.
    pub recompute_saved_us: f64,
    /// Blocks moved.
    pub transfer_blocks: u64,
    /// Per-block cost used for `path`, µs.
    pub block_us: f64,
    /// `transfer_blocks x block_us`.
    pub transfer_cost_us: f64,
    /// Lookup cost charged, µs.
    pub lookup_us: f64,
    /// `recompute_saved_us − transfer_cost_us − lookup_us`.
    pub saving_us: f64,
    /// Threshold: `minimum_estimated_ttft_saving_ms x 1000`.
    pub minimum_saving_us: f64,
    /// Threshold: `minimum_transfer_prefix_blocks`.
    pub minimum_blocks: u32,
}

impl std::fmt::Display for CostTerms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{path:?}: {tok} tok x {p:.2} µs = {rs:.1} µs − {b} blk x {bu:.2} µs = {tc:.1} µs − lookup {l:.1} µs \
             => saving {s:.1} µs (min {ms:.1} µs, min {mb} blk)",
            path = self.path,
            tok = self.reused_tokens,
            p = self.prefill_token_us,
            rs = self.recompute_saved_us,
            b = self.transfer_blocks,
            bu = self.block_us,
            tc = self.transfer_cost_us,
            l = self.lookup_us,
            s = self.saving_us,
            ms = self.minimum_saving_us,
            mb = self.minimum_blocks,
        )
    }
}

/// Why a fetch was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefuseReason {
    /// `enable_decode_to_prefill_reuse` is off.
    ReuseDisabled,
    /// The donor is on the GPU path and `enable_decode_to_prefill_gpu_reuse` is off.
    GpuPathDisabled,
    /// Fewer blocks than `minimum_transfer_prefix_blocks`.
    TooFewBlocks,
    /// Estimated saving below `minimum_estimated_ttft_saving_ms`.
    SavingBelowMinimum,
    /// The lookup found no usable donor (reason from the lookup).
    NoDonor(String),
    /// The hint could not be built (reason).
    HintUnavailable(String),
    /// The request was cancelled during its donor lookup
    /// ([`crate::Advisor::advise_cancellable`]).
    Cancelled,
}

impl std::fmt::Display for RefuseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RefuseReason::ReuseDisabled => write!(f, "reuse disabled"),
            RefuseReason::GpuPathDisabled => write!(f, "GPU reuse disabled"),
            RefuseReason::TooFewBlocks => write!(f, "too few blocks"),
            RefuseReason::SavingBelowMinimum => write!(f, "saving below minimum"),
            RefuseReason::NoDonor(r) => write!(f, "no donor: {r}"),
            RefuseReason::HintUnavailable(r) => write!(f, "hint unavailable: {r}"),
            RefuseReason::Cancelled => write!(f, "cancelled during lookup"),
        }
    }
}

/// Outcome of admission.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Fetch: attach the hint.
    Admit,
    /// Recompute normally.
    Refuse(RefuseReason),
}

/// One admission decision with every term that produced it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionDecision {
    /// Request the decision is about.
    pub request_id: String,
    /// Terms of the estimate; `None` when no estimate was made (reuse off, no donor).
    pub terms: Option<CostTerms>,
    /// Admit or refuse, with the reason.
    pub verdict: Verdict,
}

impl AdmissionDecision {
    /// True for [`Verdict::Admit`].
    pub fn admitted(&self) -> bool {
        self.verdict == Verdict::Admit
    }
}

impl std::fmt::Display for AdmissionDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = match &self.verdict {
            Verdict::Admit => "ADMIT".to_string(),
            Verdict::Refuse(r) => format!("REFUSE ({r})"),
        };
        match &self.terms {
            Some(t) => write!(f, "{}: {v}: {t}", self.request_id),
            None => write!(f, "{}: {v}", self.request_id),
        }
    }
}

/// The cost model for one layout (tokens per block), built from validated settings.
///
/// ```
/// use kv_router_glue::*;
/// let mut s = ReuseSettings::default();
/// s.enable_decode_to_prefill_reuse = true;
/// s.enable_decode_to_prefill_gpu_reuse = true;
/// let m = CostModel::new(s, 16).unwrap();
/// // 64 blocks of 16 tokens: 1024 x 30 µs − 64 x 25 µs − 100 µs = 29 020 µs
/// let d = m.admit("r1", CostInputs { reused_tokens: 1024, transfer_blocks: 64,
///                                   path: TransferPath::Gpu, lookup_us: 100.0 });
/// assert!(d.admitted());
/// assert_eq!(d.terms.unwrap().saving_us, 29_020.0);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    settings: ReuseSettings,
    /// The block size the settings were checked against at construction;
    /// `None` for [`CostModel::for_announced_layouts`]. Never used for
    /// pricing: [`CostInputs::reused_tokens`] carries the donor layout's
    /// own block size.
    tokens_per_block: Option<u32>,
}

impl CostModel {
    /// Builds a model, refusing settings it cannot use for blocks of
    /// `tokens_per_block` tokens ([`CostModel::check_block_size`]).
    ///
    /// # Errors
    /// Validation errors of [`ReuseSettings::validate`]; [`SettingsError::Unusable`]
    /// when reuse is enabled but an enabled path's block cost is at least the
    /// recompute cost of a whole block (`block_us >= tokens_per_block x
    /// prefill_token_us`): no fetch could ever save time, so enabling it is a
    /// configuration mistake. [`SettingsError::InvalidArgument`] naming
    /// `tokens_per_block` when it is 0.
    pub fn new(settings: ReuseSettings, tokens_per_block: u32) -> Result<Self, SettingsError> {
        settings.validate()?;
        Self::check_block_size(&settings, tokens_per_block)?;
        Ok(Self {
            settings,
            tokens_per_block: Some(tokens_per_block),
        })
    }

    /// Builds a model without a block size: the settings are validated,
    /// and [`CostModel::check_block_size`] is left to the caller for each
    /// donor layout as it becomes known (the advisor prices every decision
    /// with the donor layout's own block size). What the router service
    /// does when `--tokens-per-block` is not given.
    ///
    /// # Errors
    /// Validation errors of [`ReuseSettings::validate`].
    pub fn for_announced_layouts(settings: ReuseSettings) -> Result<Self, SettingsError> {
        settings.validate()?;
        Ok(Self {
            settings,
            tokens_per_block: None,
        })
    }

    /// Whether a fetch of blocks of `tokens_per_block` tokens could ever
    /// save time under `settings`: with reuse enabled, each enabled path's
    /// block cost must be below the recompute cost of a block
    /// (`tokens_per_block x transfer_source_prefill_token_us`).
    ///
    /// ```
    /// use kv_router_glue::*;
    /// let mut s = ReuseSettings::default();
    /// s.enable_decode_to_prefill_reuse = true;
    /// s.transfer_source_estimated_block_us = 1000.0;
    /// // 16 x 30 µs = 480 µs a block: never worth 1000 µs; 64 x 30 = 1920 µs is.
    /// assert!(CostModel::check_block_size(&s, 16).is_err());
    /// assert!(CostModel::check_block_size(&s, 64).is_ok());
    /// ```
    ///
    /// # Errors
    /// [`SettingsError::Unusable`] naming the path's key, its value and the
    /// recompute cost; [`SettingsError::InvalidArgument`] naming
    /// `tokens_per_block` when it is 0.
    pub fn check_block_size(
        settings: &ReuseSettings,
        tokens_per_block: u32,
    ) -> Result<(), SettingsError> {
        if tokens_per_block == 0 {
            return Err(SettingsError::InvalidArgument {
                argument: "tokens_per_block",
                reason: format!("{tokens_per_block}, must be at least 1"),
            });
        }
        if !settings.enable_decode_to_prefill_reuse {
            return Ok(());
        }
        let block_recompute =
            f64::from(tokens_per_block) * settings.transfer_source_prefill_token_us;
        let mut paths = vec![(
            "transfer_source_estimated_block_us",
            settings.transfer_source_estimated_block_us,
        )];
        if settings.enable_decode_to_prefill_gpu_reuse {
            paths.push((
                "transfer_source_gpu_estimated_block_us",
                settings.transfer_source_gpu_estimated_block_us,
            ));
        }
        for (key, block_us) in paths {
            if block_us >= block_recompute {
                return Err(SettingsError::Unusable {
                    key,
                    reason: format!(
                        "= {block_us} µs is not below the recompute cost of a block \
                         ({tokens_per_block} tokens x {} µs = {block_recompute} µs): no fetch could save time",
                        settings.transfer_source_prefill_token_us
                    ),
                });
            }
        }
        Ok(())
    }

    /// The settings in force.
    pub fn settings(&self) -> &ReuseSettings {
        &self.settings
    }

    /// The block size the settings were checked against by
    /// [`CostModel::new`] (`None` for [`CostModel::for_announced_layouts`]).
    /// Pricing never uses it: each decision counts the donor layout's own
    /// tokens per block.
    pub fn tokens_per_block(&self) -> Option<u32> {
        self.tokens_per_block
    }

    /// Per-block cost of `path`, µs.
    pub fn block_us(&self, path: TransferPath) -> f64 {
        match path {
            TransferPath::Gpu => self.settings.transfer_source_gpu_estimated_block_us,
            TransferPath::Host => self.settings.transfer_source_estimated_block_us,
        }
    }

    /// Computes every term of the estimate (no decision).
    pub fn estimate(&self, inputs: CostInputs) -> CostTerms {
        let s = &self.settings;
        let block_us = self.block_us(inputs.path);
        let recompute_saved_us = inputs.reused_tokens as f64 * s.transfer_source_prefill_token_us;
        let transfer_cost_us = inputs.transfer_blocks as f64 * block_us;
        CostTerms {
            path: inputs.path,
            reused_tokens: inputs.reused_tokens,
            prefill_token_us: s.transfer_source_prefill_token_us,
            recompute_saved_us,
            transfer_blocks: inputs.transfer_blocks,
            block_us,
            transfer_cost_us,
            lookup_us: inputs.lookup_us,
            saving_us: recompute_saved_us - transfer_cost_us - inputs.lookup_us,
            minimum_saving_us: s.minimum_estimated_ttft_saving_ms * 1000.0,
            minimum_blocks: s.minimum_transfer_prefix_blocks,
        }
    }

    /// Admission: estimate, then admit only when reuse (and, for the GPU path,
    /// GPU reuse) is on, the blocks reach the minimum and the saving reaches
    /// the minimum. Checks run in that order; the first failing one is the reason.
    pub fn admit(&self, request_id: &str, inputs: CostInputs) -> AdmissionDecision {
        let terms = self.estimate(inputs);
        let s = &self.settings;
        let verdict = if !s.enable_decode_to_prefill_reuse {
            Verdict::Refuse(RefuseReason::ReuseDisabled)
        } else if inputs.path == TransferPath::Gpu && !s.enable_decode_to_prefill_gpu_reuse {
            Verdict::Refuse(RefuseReason::GpuPathDisabled)
        } else if terms.transfer_blocks < u64::from(terms.minimum_blocks) {
            Verdict::Refuse(RefuseReason::TooFewBlocks)
        } else if terms.saving_us.is_nan() || terms.saving_us < terms.minimum_saving_us {
            // A NaN (e.g. a NaN lookup time from the caller) never admits.
            Verdict::Refuse(RefuseReason::SavingBelowMinimum)
        } else {
            Verdict::Admit
        };
        AdmissionDecision {
            request_id: request_id.to_string(),
            terms: Some(terms),
            verdict,
        }
    }
}

/// A cost model that can be retuned while routers read it.
///
/// A retune builds a new [`CostModel`] first and swaps it in only if that
/// succeeds, so readers see either the old or the new model, never a mix, and
/// an unusable retune leaves the old model in force.
#[derive(Debug, Clone)]
pub struct LiveCostModel {
    inner: Arc<RwLock<Arc<CostModel>>>,
}

impl LiveCostModel {
    /// Wraps a model.
    pub fn new(model: CostModel) -> Self {
        Self {
            inner: Arc::new(RwLock::new(Arc::new(model))),
        }
    }

    /// The model in force (a cheap snapshot).
    pub fn current(&self) -> Arc<CostModel> {
        self.inner.read().clone()
    }

    /// Replaces the settings, keeping the block size they are checked
    /// against (none for [`CostModel::for_announced_layouts`]).
    ///
    /// # Errors
    /// As [`CostModel::new`]; on error the previous model stays in force.
    pub fn retune(&self, settings: ReuseSettings) -> Result<(), SettingsError> {
        let next = match self.current().tokens_per_block {
            Some(tpb) => CostModel::new(settings, tpb)?,
            None => CostModel::for_announced_layouts(settings)?,
        };
        *self.inner.write() = Arc::new(next);
        Ok(())
    }
}

/// Bounded record of recent decisions plus totals per outcome.
#[derive(Debug)]
pub struct DecisionLog {
    capacity: usize,
    state: Mutex<DecisionLogState>,
}

#[derive(Debug, Default)]
struct DecisionLogState {
    recent: VecDeque<AdmissionDecision>,
    admitted: u64,
    refused: std::collections::BTreeMap<String, u64>,
}

impl DecisionLog {
    /// Keeps the last `capacity` decisions (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            state: Mutex::new(DecisionLogState::default()),
        }
    }

    /// Records one decision.
    pub fn record(&self, d: &AdmissionDecision) {
        let mut st = self.state.lock();
        match &d.verdict {
            Verdict::Admit => st.admitted += 1,
            Verdict::Refuse(r) => {
                let key = match r {
                    RefuseReason::NoDonor(_) => "no donor".to_string(),
                    RefuseReason::HintUnavailable(_) => "hint unavailable".to_string(),
                    other => other.to_string(),
                };
                *st.refused.entry(key).or_default() += 1;
            }
        }
        if st.recent.len() == self.capacity {
            st.recent.pop_front();
        }
        st.recent.push_back(d.clone());
    }

    /// The recent decisions, oldest first.
    pub fn recent(&self) -> Vec<AdmissionDecision> {
        self.state.lock().recent.iter().cloned().collect()
    }

    /// Number admitted so far.
    pub fn admitted(&self) -> u64 {
        self.state.lock().admitted
    }

    /// Refusals so far, by reason (the lookup's detail folded into `no donor`).
    pub fn refused(&self) -> std::collections::BTreeMap<String, u64> {
        self.state.lock().refused.clone()
    }
}
