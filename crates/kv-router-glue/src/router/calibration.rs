//! Calibration of the cost model from measured TTFT savings.
//!
//! A sample is one request served twice (reuse off, reuse on) with the measured
//! TTFT difference. Ordinary least squares ([`crate::ols`]) fits
//!
//! ```text
//! saving_us ≈ β_tok x reused_tokens + β_blk x transfer_blocks + β_0      (tokens and blocks vary independently)
//! saving_us ≈ β_blk x transfer_blocks + β_0                              (tokens = blocks x tokens_per_block)
//! ```
//!
//! The second form is used when every sample has `reused_tokens =
//! transfer_blocks x tokens_per_block` (the normal case: then the per-token and
//! per-block terms cannot be told apart and only their net effect per block is
//! identifiable). For each block count `n` up to the largest observed, the
//! one-sided 95% lower confidence bound of the predicted saving is computed;
//! reuse is suggested only for block counts where that bound is positive for
//! `n` and for every larger observed count. If there is no such `n`, the
//! verdict is [`CalibrationVerdict::KeepOff`] and nothing is enabled.

use crate::ols::{self, OlsFit};
use crate::{CalibrationError, CostModel, ReuseSettings, TransferPath};

/// One measured request: what was reused and how much TTFT it saved.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CalibrationSample {
    /// Tokens not recomputed.
    pub reused_tokens: u64,
    /// Blocks moved.
    pub transfer_blocks: u64,
    /// TTFT with reuse off minus TTFT with reuse on, in µs (negative: reuse lost).
    pub measured_saving_us: f64,
}

/// Which linear form was fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalibrationModel {
    /// `β_tok x tokens + β_blk x blocks + β_0`.
    TokensAndBlocks,
    /// `β_blk x blocks + β_0` (tokens proportional to blocks).
    BlocksOnly,
}

/// Result of a calibration: the fit, the bounds and the verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// Form fitted.
    pub model: CalibrationModel,
    /// Coefficients in column order: `[tokens, blocks, 1]` or `[blocks, 1]`.
    pub fit: OlsFit,
    /// Samples used.
    pub samples: usize,
    /// Largest observed block count.
    pub max_observed_blocks: u64,
    /// Predicted saving and its 95% lower bound (µs) at `max_observed_blocks`.
    pub at_max_blocks: (f64, f64),
    /// Enable or keep off.
    pub verdict: CalibrationVerdict,
}

/// What calibration recommends.
#[derive(Debug, Clone, PartialEq)]
pub enum CalibrationVerdict {
    /// The fitted saving is positive with 95% confidence from `minimum_blocks`
    /// up to the largest observed size. `suggested` has reuse enabled, the
    /// fitted costs and `minimum_transfer_prefix_blocks >= minimum_blocks`.
    Enable {
        /// Smallest block count with a positive lower bound (and all larger observed).
        minimum_blocks: u64,
        /// Settings to apply.
        suggested: Box<ReuseSettings>,
    },
    /// Reuse stays off; the reason says which bound failed.
    KeepOff {
        /// Human-readable reason with the numbers.
        reason: String,
    },
}

impl Calibration {
    /// True when the verdict enables reuse.
    pub fn enables(&self) -> bool {
        matches!(self.verdict, CalibrationVerdict::Enable { .. })
    }

    /// Multi-line report of coefficients, standard errors and the verdict.
    pub fn report(&self) -> String {
        let names: &[&str] = match self.model {
            CalibrationModel::TokensAndBlocks => &["µs per token", "µs per block", "fixed µs"],
            CalibrationModel::BlocksOnly => &["net µs per block", "fixed µs"],
        };
        let mut out = format!(
            "calibration: {} samples, model {:?}, r2 {:.4}, sigma {:.1} µs, dof {}\n",
            self.samples, self.model, self.fit.r2, self.fit.sigma, self.fit.dof
        );
        for (i, n) in names.iter().enumerate() {
            out.push_str(&format!(
                "  {n:<18} {:>12.3} ± {:.3}\n",
                self.fit.coef[i], self.fit.std_err[i]
            ));
        }
        out.push_str(&format!(
            "  at {} blocks: predicted {:.1} µs, 95% lower bound {:.1} µs\n",
            self.max_observed_blocks, self.at_max_blocks.0, self.at_max_blocks.1
        ));
        match &self.verdict {
            CalibrationVerdict::Enable { minimum_blocks, .. } => out.push_str(&format!(
                "  verdict: ENABLE for >= {minimum_blocks} blocks\n"
            )),
            CalibrationVerdict::KeepOff { reason } => {
                out.push_str(&format!("  verdict: KEEP OFF: {reason}\n"))
            }
        }
        out
    }
}

/// Fits the samples and decides whether reuse may be enabled on `path`.
///
/// `base` supplies every setting the fit does not determine; the suggested
/// settings are checked by [`CostModel::new`] and the verdict is `KeepOff` if
/// that refuses them.
///
/// # Errors
/// [`CalibrationError::BadSample`] for a non-finite saving,
/// [`CalibrationError::TooFewSamples`], [`CalibrationError::Singular`] (e.g. every
/// sample has the same block count).
///
/// ```
/// use kv_router_glue::*;
/// // Reuse saves 400 µs per 16-token block minus 300 µs fixed, with noise.
/// let samples: Vec<_> = (1..=20u64).map(|b| CalibrationSample {
///     reused_tokens: b * 16, transfer_blocks: b,
///     measured_saving_us: 400.0 * b as f64 - 300.0 + if b % 2 == 0 { 20.0 } else { -20.0 },
/// }).collect();
/// let c = calibrate(&samples, &ReuseSettings::default(), 16, TransferPath::Gpu).unwrap();
/// assert!(c.enables());
/// ```
pub fn calibrate(
    samples: &[CalibrationSample],
    base: &ReuseSettings,
    tokens_per_block: u32,
    path: TransferPath,
) -> Result<Calibration, CalibrationError> {
    for (index, s) in samples.iter().enumerate() {
        if !s.measured_saving_us.is_finite() {
            return Err(CalibrationError::BadSample {
                index,
                field: "measured_saving_us",
                value: s.measured_saving_us,
            });
        }
    }
    let tpb = u64::from(tokens_per_block.max(1));
    let proportional = samples
        .iter()
        .all(|s| s.reused_tokens == s.transfer_blocks * tpb);
    let y: Vec<f64> = samples.iter().map(|s| s.measured_saving_us).collect();
    let (model, fit) = if proportional {
        let rows: Vec<Vec<f64>> = samples
            .iter()
            .map(|s| vec![s.transfer_blocks as f64, 1.0])
            .collect();
        (
            CalibrationModel::BlocksOnly,
            ols::fit(&rows, &y, &["transfer_blocks", "intercept"])?,
        )
    } else {
        let rows: Vec<Vec<f64>> = samples
            .iter()
            .map(|s| vec![s.reused_tokens as f64, s.transfer_blocks as f64, 1.0])
            .collect();
        (
            CalibrationModel::TokensAndBlocks,
            ols::fit(
                &rows,
                &y,
                &["reused_tokens", "transfer_blocks", "intercept"],
            )?,
        )
    };
    let t = ols::t_one_sided_95(fit.dof);
    let point = |blocks: u64| -> Vec<f64> {
        match model {
            CalibrationModel::BlocksOnly => vec![blocks as f64, 1.0],
            CalibrationModel::TokensAndBlocks => vec![(blocks * tpb) as f64, blocks as f64, 1.0],
        }
    };
    let lower = |blocks: u64| {
        let (m, se) = fit.predict(&point(blocks));
        (m, m - t * se)
    };
    let max_observed_blocks = samples.iter().map(|s| s.transfer_blocks).max().unwrap_or(0);
    let at_max_blocks = lower(max_observed_blocks);
    // Walk down from the largest observed size while the bound stays positive.
    let mut minimum_blocks = None;
    let mut n = max_observed_blocks;
    while n >= 1 && lower(n).1 > 0.0 {
        minimum_blocks = Some(n);
        n -= 1;
    }
    let verdict = match minimum_blocks {
        None => CalibrationVerdict::KeepOff {
            reason: format!(
                "fitted saving is not positive with 95% confidence: at {max_observed_blocks} blocks predicted \
                 {:.1} µs, lower bound {:.1} µs",
                at_max_blocks.0, at_max_blocks.1
            ),
        },
        Some(min_blocks) => {
            let suggested = suggest(base, &fit, model, tpb, path, min_blocks);
            match CostModel::new(suggested.clone(), tokens_per_block) {
                Ok(_) => CalibrationVerdict::Enable {
                    minimum_blocks: min_blocks,
                    suggested: Box::new(suggested),
                },
                Err(e) => CalibrationVerdict::KeepOff {
                    reason: format!("fitted costs are not usable by the cost model: {e}"),
                },
            }
        }
    };
    Ok(Calibration {
        model,
        fit,
        samples: samples.len(),
        max_observed_blocks,
        at_max_blocks,
        verdict,
    })
}

/// Settings that reproduce the fit in the cost model's terms where the fit
/// identifies them; other fields keep `base`.
fn suggest(
    base: &ReuseSettings,
    fit: &OlsFit,
    model: CalibrationModel,
    tpb: u64,
    path: TransferPath,
    min_blocks: u64,
) -> ReuseSettings {
    let mut s = base.clone();
    s.enable_decode_to_prefill_reuse = true;
    if path == TransferPath::Gpu {
        s.enable_decode_to_prefill_gpu_reuse = true;
    }
    s.minimum_transfer_prefix_blocks = s
        .minimum_transfer_prefix_blocks
        .max(min_blocks.min(u64::from(u32::MAX)) as u32);
    let (token_us, block_us) = match model {
        CalibrationModel::TokensAndBlocks => (fit.coef[0], -fit.coef[1]),
        // Net saving per block = tpb x token_us − block_us: keep the configured
        // token cost and attribute the rest to the transfer.
        CalibrationModel::BlocksOnly => {
            let token_us = base.transfer_source_prefill_token_us;
            (token_us, tpb as f64 * token_us - fit.coef[0])
        }
    };
    let mut candidate = s.clone();
    candidate.transfer_source_prefill_token_us = token_us;
    match path {
        TransferPath::Gpu => candidate.transfer_source_gpu_estimated_block_us = block_us,
        TransferPath::Host => candidate.transfer_source_estimated_block_us = block_us,
    }
    // Fitted values outside the settings' ranges (e.g. a negative block cost
    // from noise) are not applied; the configured estimate stays.
    if candidate.validate().is_ok() {
        candidate
    } else {
        s
    }
}
