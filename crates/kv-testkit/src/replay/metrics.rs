//! What a replay measures: per-run metrics, percentiles, and the OFF vs ON
//! comparison of one workload.

use super::*;

/// Metrics of one run (OFF or ON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Reuse enabled.
    pub reuse: bool,
    /// Requests served.
    pub requests: u64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens computed by prefill.
    pub prefill_tokens: u64,
    /// Prompt tokens served from the target's native prefix cache.
    pub native_hit_tokens: u64,
    /// Prompt tokens fetched from a decode donor's retained bank.
    pub donor_hit_tokens: u64,
    /// K/V bytes fetched from donors ([`TimingModel::kv_bytes_per_token`]).
    pub bytes_moved: u64,
    /// Lookups that found a donor beyond the target's native baseline.
    pub donor_found: u64,
    /// Of those, fetches refused by the admission rule.
    pub refused_by_cost: u64,
    /// Admitted fetches that fell back to recompute at execution (donor
    /// evicted the blocks, or the target lost its baseline, while queued).
    pub fetch_fallbacks: u64,
    /// Admitted fetches that completed.
    pub fetches: u64,
    /// TTFT per request in workload order, ms.
    pub ttft_ms: Vec<f64>,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile TTFT, ms.
    pub ttft_p90_ms: f64,
    /// 99th percentile TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Mean TTFT, ms.
    pub ttft_mean_ms: f64,
    /// Mean TTFT of requests with `turn > 0`, ms (0 when there are none).
    pub later_turn_ttft_mean_ms: f64,
    /// Virtual time at which the last request finished decoding, s.
    pub makespan_s: f64,
}

/// Nearest-rank percentile (`q` in 0..=1) of unsorted values; 0 when empty.
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// OFF and ON runs of one workload, compared request by request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayComparison {
    /// Workload name.
    pub workload: String,
    /// Options used (printed with the results).
    pub options: ReplayOptions,
    /// Reuse OFF.
    pub off: RunMetrics,
    /// Reuse ON.
    pub on: RunMetrics,
    /// Requests whose ON TTFT exceeds OFF's by more than 1 µs.
    pub slower_than_off: u64,
    /// Requests whose ON TTFT is below OFF's by more than 1 µs.
    pub faster_than_off: u64,
}

/// Runs OFF then ON and compares.
///
/// # Errors
/// As [`run`].
///
/// ```
/// use kv_testkit::replay::{compare, ReplayOptions, Workload};
/// use kv_testkit::trace::{default_trace_path, MooncakeTrace};
/// let trace = MooncakeTrace::load(default_trace_path()).unwrap().head(50);
/// let w = Workload::from_trace(&trace, "mooncake[..50]", 16).unwrap();
/// let c = compare(&w, &ReplayOptions::default()).unwrap();
/// assert_eq!(c.off.ttft_ms.len(), 50);
/// assert!(c.on.prefill_tokens <= c.off.prefill_tokens);
/// ```
pub fn compare(workload: &Workload, opts: &ReplayOptions) -> Result<ReplayComparison, ReplayError> {
    let off = run(workload, opts, false)?;
    let on = run(workload, opts, true)?;
    let slower_than_off = off
        .ttft_ms
        .iter()
        .zip(&on.ttft_ms)
        .filter(|(o, n)| **n > **o + 1e-3)
        .count() as u64;
    let faster_than_off = off
        .ttft_ms
        .iter()
        .zip(&on.ttft_ms)
        .filter(|(o, n)| **n + 1e-3 < **o)
        .count() as u64;
    Ok(ReplayComparison {
        workload: workload.name.clone(),
        options: opts.clone(),
        off,
        on,
        slower_than_off,
        faster_than_off,
    })
}
