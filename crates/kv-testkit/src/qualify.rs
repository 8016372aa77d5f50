//! Entry points the qualification runner (`kvq`, `cargo xtask qualify`)
//! calls; each returns a serde struct whose field names are the
//! `record.json` keys.
//!
//! - [`trace_replay`]: the Mooncake trace, OFF vs ON, in virtual time.
//! - [`session_replay`]: the multi-turn session workload, OFF vs ON.
//! - [`serving_smoke`]: real engines with the reference model, OFF / ON /
//!   forced fallback.

use std::path::PathBuf;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::replay::{compare, ReplayComparison, ReplayError, ReplayOptions, Workload};
use crate::sessions::{generate, LengthDistributions, SessionError, SessionParams};
use crate::trace::{default_trace_path, MooncakeTrace, TraceError};

pub use crate::smoke::{
    serving_smoke, ServingSmokeResult, SmokeError, SmokeOptions, SmokeRequest, SmokeRun,
};

/// Why a qualification entry point failed.
#[derive(Debug, thiserror::Error)]
pub enum QualifyError {
    /// The trace could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The replay refused its options or workload.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The session generator refused its parameters.
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// Options of [`trace_replay`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceReplayOptions {
    /// Trace file (default: [`default_trace_path`]).
    pub trace_path: PathBuf,
    /// Replay only the first this many requests (`None`: all 12,031).
    pub requests: Option<usize>,
    /// Cluster, timing and admission.
    pub replay: ReplayOptions,
}

impl Default for TraceReplayOptions {
    fn default() -> Self {
        Self {
            trace_path: default_trace_path(),
            requests: None,
            replay: ReplayOptions::default(),
        }
    }
}

/// OFF-vs-ON figures shared by [`TraceReplayResult`] and
/// [`SessionReplayResult`] (flattened into them: the keys appear at the top
/// level of each).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayFigures {
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens computed by prefill, reuse OFF.
    pub off_prefill_tokens: u64,
    /// Prompt tokens computed by prefill, reuse ON.
    pub on_prefill_tokens: u64,
    /// Prompt tokens hit in prefill's native cache, OFF.
    pub off_native_hit_tokens: u64,
    /// Prompt tokens hit in prefill's native cache, ON.
    pub on_native_hit_tokens: u64,
    /// Prompt tokens fetched from decode donors, ON.
    pub on_donor_hit_tokens: u64,
    /// K/V bytes fetched from donors, ON.
    pub on_bytes_moved: u64,
    /// Fetches completed, ON.
    pub fetches: u64,
    /// Admitted fetches that fell back to recompute, ON.
    pub fetch_fallbacks: u64,
    /// Donors found but refused by the admission rule, ON.
    pub refused_by_cost: u64,
    /// Median TTFT OFF, ms.
    pub ttft_p50_off_ms: f64,
    /// Median TTFT ON, ms.
    pub ttft_p50_on_ms: f64,
    /// p90 TTFT OFF, ms.
    pub ttft_p90_off_ms: f64,
    /// p90 TTFT ON, ms.
    pub ttft_p90_on_ms: f64,
    /// p99 TTFT OFF, ms.
    pub ttft_p99_off_ms: f64,
    /// p99 TTFT ON, ms.
    pub ttft_p99_on_ms: f64,
    /// Mean TTFT OFF, ms.
    pub ttft_mean_off_ms: f64,
    /// Mean TTFT ON, ms.
    pub ttft_mean_on_ms: f64,
    /// Requests whose ON TTFT exceeds OFF's by more than 1 µs (this counts
    /// the lookup latency paid by requests that found no donor, and queueing
    /// order changes caused by other requests finishing earlier).
    pub slower_than_off: u64,
    /// Requests whose ON TTFT exceeds OFF's by more than 1 ms.
    pub slower_than_off_by_1ms: u64,
    /// Requests whose ON TTFT is below OFF's by more than 1 µs.
    pub faster_than_off: u64,
    /// Per-request TTFT OFF, ms, in workload order (for a CDF plot).
    pub ttft_off_ms: Vec<f64>,
    /// Per-request TTFT ON, ms, same order.
    pub ttft_on_ms: Vec<f64>,
    /// Wall time of both replays (hashing included), s.
    pub wall_s: f64,
    /// Options the replay ran with.
    pub options: ReplayOptions,
}

impl ReplayFigures {
    fn from_comparison(c: ReplayComparison, wall_s: f64) -> Self {
        let slower_1ms = c
            .off
            .ttft_ms
            .iter()
            .zip(&c.on.ttft_ms)
            .filter(|(o, n)| **n > **o + 1.0)
            .count() as u64;
        Self {
            requests: c.off.requests,
            off_prefill_tokens: c.off.prefill_tokens,
            on_prefill_tokens: c.on.prefill_tokens,
            off_native_hit_tokens: c.off.native_hit_tokens,
            on_native_hit_tokens: c.on.native_hit_tokens,
            on_donor_hit_tokens: c.on.donor_hit_tokens,
            on_bytes_moved: c.on.bytes_moved,
            fetches: c.on.fetches,
            fetch_fallbacks: c.on.fetch_fallbacks,
            refused_by_cost: c.on.refused_by_cost,
            ttft_p50_off_ms: c.off.ttft_p50_ms,
            ttft_p50_on_ms: c.on.ttft_p50_ms,
            ttft_p90_off_ms: c.off.ttft_p90_ms,
            ttft_p90_on_ms: c.on.ttft_p90_ms,
            ttft_p99_off_ms: c.off.ttft_p99_ms,
            ttft_p99_on_ms: c.on.ttft_p99_ms,
            ttft_mean_off_ms: c.off.ttft_mean_ms,
            ttft_mean_on_ms: c.on.ttft_mean_ms,
            slower_than_off: c.slower_than_off,
            slower_than_off_by_1ms: slower_1ms,
            faster_than_off: c.faster_than_off,
            ttft_off_ms: c.off.ttft_ms,
            ttft_on_ms: c.on.ttft_ms,
            wall_s,
            options: c.options,
        }
    }
}

/// `record.json` section `trace_replay`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceReplayResult {
    /// Trace file name.
    pub trace: String,
    /// The figures (flattened).
    #[serde(flatten)]
    pub figures: ReplayFigures,
}

/// Replays the Mooncake trace OFF and ON in virtual time
/// (see [`crate::replay`]); draws a progress bar when
/// `opts.replay.progress`.
///
/// # Errors
/// [`QualifyError::Trace`] (unreadable or invalid trace),
/// [`QualifyError::Replay`] (options out of range).
///
/// ```
/// use kv_testkit::qualify::{trace_replay, TraceReplayOptions};
/// let r = trace_replay(&TraceReplayOptions { requests: Some(40), ..Default::default() }).unwrap();
/// assert_eq!(r.figures.requests, 40);
/// let json = serde_json::to_value(&r).unwrap();
/// assert!(json["ttft_p99_on_ms"].is_number() && json["trace"].is_string());
/// ```
pub fn trace_replay(opts: &TraceReplayOptions) -> Result<TraceReplayResult, QualifyError> {
    let t0 = Instant::now();
    let mut trace = MooncakeTrace::load(&opts.trace_path)?;
    if let Some(n) = opts.requests {
        trace = trace.head(n);
    }
    let name = opts.trace_path.file_name().map_or_else(
        || opts.trace_path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    let w = Workload::from_trace(&trace, &name, opts.replay.cluster.tokens_per_block)?;
    let c = compare(&w, &opts.replay)?;
    Ok(TraceReplayResult {
        trace: name,
        figures: ReplayFigures::from_comparison(c, t0.elapsed().as_secs_f64()),
    })
}

/// Options of [`session_replay`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionReplayOptions {
    /// Trace the length distributions are drawn from (default: [`default_trace_path`]).
    pub trace_path: PathBuf,
    /// Generator parameters.
    pub params: SessionParams,
    /// Cluster, timing and admission (its `tokens_per_block` must equal
    /// `params.tokens_per_block`).
    pub replay: ReplayOptions,
}

impl Default for SessionReplayOptions {
    fn default() -> Self {
        Self {
            trace_path: default_trace_path(),
            params: SessionParams::default(),
            replay: ReplayOptions::default(),
        }
    }
}

/// `record.json` section `session_replay`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionReplayResult {
    /// Workload description (generator and seed).
    pub trace: String,
    /// The figures (flattened).
    #[serde(flatten)]
    pub figures: ReplayFigures,
    /// Requests with `turn > 0`.
    pub later_turn_requests: u64,
    /// Mean TTFT of later turns OFF, ms.
    pub later_turn_ttft_mean_off_ms: f64,
    /// Mean TTFT of later turns ON, ms.
    pub later_turn_ttft_mean_on_ms: f64,
    /// Generator parameters.
    pub params: SessionParams,
    /// [`SessionParams::describe`], for the report.
    pub params_description: String,
}

/// Generates the multi-turn session workload and replays it OFF and ON.
///
/// # Errors
/// [`QualifyError::Trace`], [`QualifyError::Session`], [`QualifyError::Replay`].
///
/// ```
/// use kv_testkit::qualify::{session_replay, SessionReplayOptions};
/// use kv_testkit::sessions::SessionParams;
/// let o = SessionReplayOptions {
///     params: SessionParams { sessions: 4, max_context_tokens: 8192, ..Default::default() },
///     ..Default::default()
/// };
/// let r = session_replay(&o).unwrap();
/// assert!(r.later_turn_requests > 0);
/// ```
pub fn session_replay(opts: &SessionReplayOptions) -> Result<SessionReplayResult, QualifyError> {
    let t0 = Instant::now();
    let trace = MooncakeTrace::load(&opts.trace_path)?;
    let d = LengthDistributions::from_trace(&trace)?;
    let w = generate(&opts.params, &d)?;
    let c = compare(&w, &opts.replay)?;
    let later_turn_requests = w.requests.iter().filter(|r| r.turn > 0).count() as u64;
    let (off_later, on_later) = (c.off.later_turn_ttft_mean_ms, c.on.later_turn_ttft_mean_ms);
    Ok(SessionReplayResult {
        trace: w.name.clone(),
        figures: ReplayFigures::from_comparison(c, t0.elapsed().as_secs_f64()),
        later_turn_requests,
        later_turn_ttft_mean_off_ms: off_later,
        later_turn_ttft_mean_on_ms: on_later,
        params: opts.params,
        params_description: opts.params.describe(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_are_the_agreed_names() {
        let r = trace_replay(&TraceReplayOptions {
            requests: Some(30),
            ..Default::default()
        })
        .unwrap();
        let v = serde_json::to_value(&r).unwrap();
        for k in [
            "trace",
            "requests",
            "off_prefill_tokens",
            "on_prefill_tokens",
            "ttft_p50_off_ms",
            "ttft_p50_on_ms",
            "ttft_p99_off_ms",
            "ttft_p99_on_ms",
            "slower_than_off",
            "ttft_off_ms",
            "ttft_on_ms",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["trace"], "mooncake_conversation_trace.jsonl");
        assert_eq!(v["ttft_off_ms"].as_array().unwrap().len(), 30);
        let o = SessionReplayOptions {
            params: SessionParams {
                sessions: 3,
                max_context_tokens: 4096,
                ..Default::default()
            },
            ..Default::default()
        };
        let s = serde_json::to_value(session_replay(&o).unwrap()).unwrap();
        for k in [
            "later_turn_ttft_mean_off_ms",
            "later_turn_ttft_mean_on_ms",
            "on_prefill_tokens",
            "slower_than_off",
        ] {
            assert!(s.get(k).is_some(), "missing {k}");
        }
        let e = trace_replay(&TraceReplayOptions {
            trace_path: "/nonexistent.jsonl".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent.jsonl"));
    }
}
