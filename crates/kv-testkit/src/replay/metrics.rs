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

/// Nearest-rank percentile (`q` in 0..=1) of `values` (any order; NaN
/// values are ignored); `None` when no finite value is left.
///
/// The one percentile of the test kit: the replay metrics and kvq's
/// REPORT.md both use it, so an empty sample set reads the same everywhere
/// (each caller says what it prints for `None`). Nearest rank: the smallest
/// value with at least `q` of the samples at or below it (rank
/// `ceil(q * n)`, clamped to `1..=n`).
///
/// ```
/// use kv_testkit::replay::percentile;
/// assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 0.5), Some(2.0));
/// assert_eq!(percentile(&[], 0.5), None);
/// ```
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
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
