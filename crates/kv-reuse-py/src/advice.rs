//! `Advice` and `CostTerms`: one router decision as typed Python values.
//!
//! Both the in-process `Router.advise` and the service's `RouterClient.advise`
//! build their `Advice` here from kv_router_glue's `AdmissionDecision` (the
//! service's `AdviseReply` carries the whole decision, terms included), so
//! the two paths give the same fields for the same decision.
//!
//! `reason` is a stable snake_case code an engine may branch on: the
//! `verdict` label of `kv_reuse_decisions_total`
//! (`kv_router_glue::metrics::refuse_label`, an exhaustive `match` on
//! `RefuseReason`), so a new refusal kind has a code before it reaches
//! Python, and Python and the metrics name a refusal alike. Its detail is
//! an exhaustive `match` here (no wildcard).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyFloat, PyString};

use kv_descriptor::{HintEnvelope, Wire};
use kv_router_glue::metrics::refuse_label;
use kv_router_glue::{AdmissionDecision, RefuseReason, TransferPath, Verdict};

use crate::errors::descriptor;

/// Every term of the router's cost estimate for one request, in µs unless
/// the name says otherwise (kv_router_glue's `CostTerms`):
/// `saving_us = recompute_saved_us - transfer_cost_us - lookup_us`, and a
/// fetch is admitted only when `transfer_blocks >= minimum_blocks` and
/// `saving_us >= minimum_saving_us`.
#[pyclass(frozen, get_all, module = "kv_reuse")]
pub(crate) struct CostTerms {
    /// The transfer path priced: `"gpu"` (donor bank in device memory) or
    /// `"host"` (host shared memory).
    path: &'static str,
    /// Tokens the target would not recompute (`transfer_blocks x tokens_per_block`).
    reused_tokens: u64,
    /// Prefill cost per token used, µs (`transfer_source_prefill_token_us`).
    prefill_token_us: f64,
    /// `reused_tokens x prefill_token_us`, µs.
    recompute_saved_us: f64,
    /// Blocks the fetch would move.
    transfer_blocks: u64,
    /// Per-block transfer cost used for `path`, µs.
    block_us: f64,
    /// `transfer_blocks x block_us`, µs.
    transfer_cost_us: f64,
    /// Time the donor lookup took, charged against the saving, µs.
    lookup_us: f64,
    /// `recompute_saved_us - transfer_cost_us - lookup_us`, µs.
    saving_us: f64,
    /// Threshold: `minimum_estimated_ttft_saving_ms x 1000`, µs.
    minimum_saving_us: f64,
    /// Threshold: `minimum_transfer_prefix_blocks`, blocks.
    minimum_blocks: u32,
}

/// The Python name of a transfer path. Exhaustive: a new path must be named.
fn path_name(path: TransferPath) -> &'static str {
    match path {
        TransferPath::Gpu => "gpu",
        TransferPath::Host => "host",
    }
}

impl From<&kv_router_glue::CostTerms> for CostTerms {
    fn from(t: &kv_router_glue::CostTerms) -> Self {
        Self {
            path: path_name(t.path),
            reused_tokens: t.reused_tokens,
            prefill_token_us: t.prefill_token_us,
            recompute_saved_us: t.recompute_saved_us,
            transfer_blocks: t.transfer_blocks,
            block_us: t.block_us,
            transfer_cost_us: t.transfer_cost_us,
            lookup_us: t.lookup_us,
            saving_us: t.saving_us,
            minimum_saving_us: t.minimum_saving_us,
            minimum_blocks: t.minimum_blocks,
        }
    }
}

#[pymethods]
impl CostTerms {
    /// `CostTerms(path='host', reused_tokens=.., ..., minimum_blocks=..)`:
    /// every field, floats as Python's `repr` writes them.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let f = |v: f64| -> PyResult<String> { Ok(PyFloat::new(py, v).repr()?.to_string()) };
        Ok(format!(
            "CostTerms(path='{}', reused_tokens={}, prefill_token_us={}, recompute_saved_us={}, \
             transfer_blocks={}, block_us={}, transfer_cost_us={}, lookup_us={}, saving_us={}, \
             minimum_saving_us={}, minimum_blocks={})",
            self.path,
            self.reused_tokens,
            f(self.prefill_token_us)?,
            f(self.recompute_saved_us)?,
            self.transfer_blocks,
            f(self.block_us)?,
            f(self.transfer_cost_us)?,
            f(self.lookup_us)?,
            f(self.saving_us)?,
            f(self.minimum_saving_us)?,
            self.minimum_blocks,
        ))
    }
}

/// The stable code of a refusal (the router's metric label,
/// [`refuse_label`], so Python and `kv_reuse_decisions_total` name a
/// refusal alike) and its human detail (`terms` words the threshold
/// refusals).
fn refusal(
    reason: &RefuseReason,
    terms: Option<&kv_router_glue::CostTerms>,
) -> (&'static str, String) {
    (refuse_label(reason), refusal_detail(reason, terms))
}

/// The human detail of a refusal (see [`refusal`]). Exhaustive on purpose
/// (module doc): no wildcard.
fn refusal_detail(reason: &RefuseReason, terms: Option<&kv_router_glue::CostTerms>) -> String {
    match reason {
        RefuseReason::ReuseDisabled => "enable_decode_to_prefill_reuse is off".into(),
        RefuseReason::GpuPathDisabled => {
            "the donor's bank is in GPU memory and enable_decode_to_prefill_gpu_reuse is off".into()
        }
        RefuseReason::TooFewBlocks => match terms {
            Some(t) => format!(
                "{} blocks to fetch, fewer than minimum_transfer_prefix_blocks = {}",
                t.transfer_blocks, t.minimum_blocks
            ),
            None => "fewer blocks to fetch than minimum_transfer_prefix_blocks".into(),
        },
        RefuseReason::SavingBelowMinimum => match terms {
            Some(t) => format!(
                "estimated saving {:.1} µs is below minimum_estimated_ttft_saving_ms \
                 ({:.1} µs)",
                t.saving_us, t.minimum_saving_us
            ),
            None => "estimated saving below minimum_estimated_ttft_saving_ms".into(),
        },
        RefuseReason::NoDonor(why) | RefuseReason::HintUnavailable(why) => why.clone(),
        RefuseReason::Cancelled => "the request was cancelled during its donor lookup".into(),
    }
}

/// What the router decided for one request.
#[pyclass(frozen, get_all, module = "kv_reuse")]
pub(crate) struct Advice {
    /// True when a fetch hint is attached.
    admitted: bool,
    /// None when admitted; else the stable refusal code: `no_donor`,
    /// `too_few_blocks`, `saving_below_minimum`, `reuse_disabled`,
    /// `gpu_path_disabled`, `hint_unavailable` or `cancelled`.
    reason: Option<&'static str>,
    /// None when admitted; else the refusal in words (the lookup's no-donor
    /// reason, the thresholds missed): for logs, not for branching.
    detail: Option<String>,
    /// The cost estimate, or None when none was made: reuse off, no donor,
    /// cancelled, or a donor record the hint could not be built from
    /// (a `hint_unavailable` found after pricing keeps its terms).
    terms: Option<Py<CostTerms>>,
    /// The hint envelope (MessagePack) to send to the target, when admitted.
    /// Bytes and `CostTerms` hold no Python references: no cycle passes
    /// through an `Advice`, so it needs no `__traverse__`.
    hint: Option<Py<PyBytes>>,
    /// The donor the hint names (its engine id, a UUID string), when
    /// admitted: the key of its `DonorDirectory.manifest`, which
    /// `Target.fetch` needs with the hint. None when refused.
    donor_engine_id: Option<String>,
    /// Deprecated: the Rust `Debug` text of the verdict (`Admit`,
    /// `Refuse(NoDonor("..."))`), unchanged from earlier versions for
    /// readers that log it; its form is not stable. Use `admitted`,
    /// `reason` and `detail`.
    verdict: String,
}

impl Advice {
    /// The Python form of `decision` (in-process `Router` or the service)
    /// with its hint, encoded, and the donor the hint names.
    ///
    /// # Errors
    /// `DescriptorRefused` when the hint does not encode, or its actions
    /// do not decode.
    pub(crate) fn new(
        py: Python<'_>,
        decision: &AdmissionDecision,
        hint: Option<&HintEnvelope>,
    ) -> PyResult<Self> {
        let (hint, donor_engine_id) = match hint {
            Some(h) => {
                let wire = h.to_wire().map_err(descriptor)?;
                let actions = h.fetch_gpu_actions().map_err(descriptor)?;
                // An advisor's hint has exactly one `kv.fetch_gpu` action.
                let donor = actions.first().map(|a| a.donor_engine_id.to_string());
                (Some(PyBytes::new(py, &wire).unbind()), donor)
            }
            None => (None, None),
        };
        let (reason, detail) = match &decision.verdict {
            Verdict::Admit => (None, None),
            Verdict::Refuse(r) => {
                let (code, detail) = refusal(r, decision.terms.as_ref());
                (Some(code), Some(detail))
            }
        };
        let terms = decision
            .terms
            .as_ref()
            .map(|t| Py::new(py, CostTerms::from(t)))
            .transpose()?;
        Ok(Self {
            admitted: decision.admitted(),
            reason,
            detail,
            terms,
            hint,
            donor_engine_id,
            verdict: format!("{:?}", decision.verdict),
        })
    }
}

impl Advice {
    /// The advice for a prompt of no whole block, as the index refuses it
    /// (`NoDonorReason::EmptyRequest`): what `Router.advise` gives such a
    /// prompt, for `RouterClient` to give without asking the service.
    pub(crate) fn empty_prompt(py: Python<'_>, request_id: &str) -> PyResult<Self> {
        let decision = AdmissionDecision {
            request_id: request_id.to_owned(),
            terms: None,
            verdict: Verdict::Refuse(RefuseReason::NoDonor(
                kv_lookup::NoDonorReason::EmptyRequest.to_string(),
            )),
        };
        Self::new(py, &decision, None)
    }
}

#[pymethods]
impl Advice {
    /// `Advice(admitted=True, donor_engine_id='...', terms=CostTerms(...))` or `Advice(admitted=False,
    /// reason='no_donor', detail='...', terms=None)`.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let terms = match &self.terms {
            Some(t) => t.get().__repr__(py)?,
            None => "None".into(),
        };
        match (&self.reason, &self.detail) {
            (Some(reason), Some(detail)) => Ok(format!(
                "Advice(admitted={}, reason='{reason}', detail={}, terms={terms})",
                py_bool(self.admitted),
                PyString::new(py, detail).repr()?,
            )),
            _ => match &self.donor_engine_id {
                Some(donor) => Ok(format!(
                    "Advice(admitted={}, donor_engine_id='{donor}', terms={terms})",
                    py_bool(self.admitted)
                )),
                None => Ok(format!(
                    "Advice(admitted={}, terms={terms})",
                    py_bool(self.admitted)
                )),
            },
        }
    }
}

/// `True` / `False`, as Python writes them.
fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every refusal kind, one each (the exhaustive `match` in `refusal`
    /// keeps this list honest only together with this test's own match).
    fn every_reason() -> Vec<RefuseReason> {
        let all = vec![
            RefuseReason::ReuseDisabled,
            RefuseReason::GpuPathDisabled,
            RefuseReason::TooFewBlocks,
            RefuseReason::SavingBelowMinimum,
            RefuseReason::NoDonor("x".into()),
            RefuseReason::HintUnavailable("y".into()),
            RefuseReason::Cancelled,
        ];
        // Fails to compile when a kind is added, as a reminder to list it above.
        for r in &all {
            match r {
                RefuseReason::ReuseDisabled
                | RefuseReason::GpuPathDisabled
                | RefuseReason::TooFewBlocks
                | RefuseReason::SavingBelowMinimum
                | RefuseReason::NoDonor(_)
                | RefuseReason::HintUnavailable(_)
                | RefuseReason::Cancelled => {}
            }
        }
        all
    }

    #[test]
    fn codes_are_the_documented_ones_and_distinct() {
        let mut seen = std::collections::HashSet::new();
        let mut codes = Vec::new();
        for r in every_reason() {
            let (code, detail) = refusal(&r, None);
            assert!(seen.insert(code), "{code} given twice");
            assert!(!detail.is_empty(), "{r:?} has no detail");
            codes.push(code);
        }
        // The Python API's values (docs/python.md, _native.pyi).
        assert_eq!(
            codes,
            [
                "reuse_disabled",
                "gpu_path_disabled",
                "too_few_blocks",
                "saving_below_minimum",
                "no_donor",
                "hint_unavailable",
                "cancelled"
            ]
        );
    }

    #[test]
    fn a_detail_carries_the_lookups_words_and_the_thresholds() {
        assert_eq!(
            refusal(
                &RefuseReason::NoDonor("no block of the prompt".into()),
                None
            )
            .1,
            "no block of the prompt"
        );
        let model = kv_router_glue::CostModel::new(
            kv_router_glue::ReuseSettings {
                enable_decode_to_prefill_reuse: true,
                minimum_transfer_prefix_blocks: 8,
                ..Default::default()
            },
            16,
        )
        .unwrap();
        let d = model.admit(
            "r",
            kv_router_glue::CostInputs {
                reused_tokens: 64,
                transfer_blocks: 4,
                path: TransferPath::Host,
                lookup_us: 1.0,
            },
        );
        assert_eq!(d.verdict, Verdict::Refuse(RefuseReason::TooFewBlocks));
        assert_eq!(
            refusal(&RefuseReason::TooFewBlocks, d.terms.as_ref()).1,
            "4 blocks to fetch, fewer than minimum_transfer_prefix_blocks = 8"
        );
    }
}
