//! `kvq bench advise`: the router service's advise round trip over NATS on
//! loopback beside the in-process `RouterService::advise`, in one run
//! (samples from `kv_router_glue::service::bench`), with the issue-18
//! goals printed (p50 <= 100 µs, p99 <= 300 µs for the NATS round trip).
//! Goals are reported, never asserted: a slow machine prints `missed`.

use std::path::Path;

use kv_router_glue::service::bench::{run_advise_bench, AdviseBenchConfig, AdviseBenchSamples};
use kv_testkit::replay::percentile;
use serde::Serialize;

/// Goal for the NATS round trip's p50, µs (issue 18).
const GOAL_P50_US: f64 = 100.0;
/// Goal for the NATS round trip's p99, µs (issue 18).
const GOAL_P99_US: f64 = 300.0;

/// One printed row: a sample set's percentiles, and its ratios to the
/// in-process `advise` row (how many times slower; 1.0 for that row).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdviseRow {
    /// `in_process_advise`, `in_process_handle`, `nats_round_trip`.
    pub case: &'static str,
    /// Timed requests.
    pub requests: usize,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
    /// `p50_us` / in-process advise p50.
    pub p50_ratio: f64,
    /// `p99_us` / in-process advise p99.
    pub p99_ratio: f64,
}

fn row(case: &'static str, v: &[f64], base: Option<(f64, f64)>) -> AdviseRow {
    // Empty sets cannot happen (requests >= 1); NaN would print as such.
    let p50 = percentile(v, 0.5).unwrap_or(f64::NAN);
    let p99 = percentile(v, 0.99).unwrap_or(f64::NAN);
    let (b50, b99) = base.unwrap_or((p50, p99));
    AdviseRow {
        case,
        requests: v.len(),
        p50_us: p50,
        p99_us: p99,
        mean_us: v.iter().sum::<f64>() / v.len().max(1) as f64,
        p50_ratio: p50 / b50,
        p99_ratio: p99 / b99,
    }
}

/// The rows of `s`, in-process advise first (the ratios' baseline), the
/// router's serving path `nats_round_trip` third (the goals' row), then the
/// former shared-runtime path, the stage pass's total, and the blocking
/// caller outside any runtime (the `kv_reuse` wheel's `RouterClient`):
/// `AdviseClient`, then the former one-worker-runtime design; last the
/// in-process advise paced like the server's requests (cold caches).
pub fn rows(s: &AdviseBenchSamples) -> Vec<AdviseRow> {
    let base = row("in_process_advise", &s.in_process_advise_us, None);
    let b = Some((base.p50_us, base.p99_us));
    vec![
        base,
        row("in_process_handle", &s.in_process_handle_us, b),
        row("nats_round_trip", &s.nats_round_trip_us, b),
        row("nats_shared_runtime", &s.nats_shared_runtime_us, b),
        row("nats_reply_sub", &s.stages.total_us, b),
        row("nats_blocking_client", &s.nats_blocking_client_us, b),
        row("nats_handoff_client", &s.nats_handoff_client_us, b),
        row("in_process_paced", &s.in_process_paced_us, b),
    ]
}

/// One row per stage of the stage pass (`StageSamples::named`), in path
/// order, `total` last; the ratios are against that pass's total.
pub fn stage_rows(s: &AdviseBenchSamples) -> Vec<AdviseRow> {
    let named = s.stages.named();
    let total = row("total", named[named.len() - 1].1, None);
    let b = Some((total.p50_us, total.p99_us));
    named.iter().map(|(n, v)| row(n, v, b)).collect()
}

fn met(v: f64, goal: f64) -> &'static str {
    if v <= goal {
        "met"
    } else {
        "missed"
    }
}

/// Runs the bench (`--quick`: 100,000 blocks and 2,000 requests instead of
/// 1,000,000 and 20,000; `busy_poll_us`: `--busy-poll-us`, the server's and
/// the blocking client's spin window); prints the table and writes `--json`.
/// Exit 2 when it cannot run.
pub fn bench_command(quick: bool, busy_poll_us: u64, json: Option<&Path>) -> i32 {
    let cfg = if quick {
        AdviseBenchConfig {
            retained_blocks: 100_000,
            requests: 2_000,
            warmup: 200,
            busy_poll_us,
        }
    } else {
        AdviseBenchConfig {
            busy_poll_us,
            ..AdviseBenchConfig::default()
        }
    };
    let samples = match run_advise_bench(cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvq bench advise: {e}");
            return 2;
        }
    };
    let rows = rows(&samples);
    println!(
        "advise: {} index entries (fill {:.0} ms), {}-block requests, {} timed per case, {} of {} admitted with a hint, busy poll {} µs",
        samples.index_entries,
        samples.index_fill_ms,
        samples.request_blocks,
        cfg.requests,
        samples.admitted,
        samples.timed,
        cfg.busy_poll_us
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "case", "p50 µs", "p99 µs", "mean µs", "p50 x", "p99 x"
    );
    for r in &rows {
        println!(
            "{:<20} {:>9.1} {:>9.1} {:>9.1} {:>9.2} {:>9.2}",
            r.case, r.p50_us, r.p99_us, r.mean_us, r.p50_ratio, r.p99_ratio
        );
    }
    let stages = stage_rows(&samples);
    println!("stages of nats_reply_sub (p50 x, p99 x: share of that pass's total)");
    for r in &stages {
        println!(
            "  {:<18} {:>9.1} {:>9.1} {:>9.1} {:>9.2} {:>9.2}",
            r.case, r.p50_us, r.p99_us, r.mean_us, r.p50_ratio, r.p99_ratio
        );
    }
    let nats = &rows[2];
    println!(
        "goal nats_round_trip p50 <= {GOAL_P50_US} µs: {} ({:.1}); p99 <= {GOAL_P99_US} µs: {} ({:.1})",
        met(nats.p50_us, GOAL_P50_US),
        nats.p50_us,
        met(nats.p99_us, GOAL_P99_US),
        nats.p99_us
    );
    if let Some(path) = json {
        let doc = serde_json::json!({
            "bench": "advise",
            "quick": quick,
            "busy_poll_us": cfg.busy_poll_us,
            "retained_blocks": cfg.retained_blocks,
            "index_entries": samples.index_entries,
            "index_fill_ms": samples.index_fill_ms,
            "request_blocks": samples.request_blocks,
            "admitted": samples.admitted,
            "timed": samples.timed,
            "goal_p50_us": GOAL_P50_US,
            "goal_p99_us": GOAL_P99_US,
            "goal_p50_met": nats.p50_us <= GOAL_P50_US,
            "goal_p99_met": nats.p99_us <= GOAL_P99_US,
            "rows": rows,
            "stages": stages,
        });
        if let Err(e) = std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap_or_default()) {
            eprintln!("kvq bench advise: cannot write {}: {e}", path.display());
            return 2;
        }
        println!("json: {}", path.display());
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_router_glue::service::bench::StageSamples;

    #[test]
    fn rows_take_percentiles_and_ratios_against_in_process_advise() {
        let stage = |k: f64| (1..=100).map(|v| f64::from(v) * k).collect::<Vec<f64>>();
        let s = AdviseBenchSamples {
            index_entries: 1,
            index_fill_ms: 0.0,
            request_blocks: 48,
            admitted: 500,
            timed: 500,
            in_process_advise_us: stage(1.0),
            in_process_handle_us: stage(2.0),
            nats_round_trip_us: stage(10.0),
            nats_shared_runtime_us: stage(15.0),
            stages: StageSamples {
                encode_request_us: stage(0.5),
                queue_request_us: stage(0.5),
                to_server_us: stage(3.0),
                decode_us: stage(0.5),
                decide_us: stage(1.0),
                encode_reply_us: stage(0.5),
                queue_reply_us: stage(0.5),
                to_client_us: stage(3.0),
                decode_reply_us: stage(0.5),
                total_us: stage(10.0),
            },
            nats_blocking_client_us: stage(8.0),
            nats_handoff_client_us: stage(12.0),
            in_process_paced_us: stage(2.0),
        };
        let r = rows(&s);
        assert_eq!(r[0].case, "in_process_advise");
        assert_eq!((r[0].p50_us, r[0].p99_us), (50.0, 99.0));
        assert_eq!((r[0].p50_ratio, r[0].p99_ratio), (1.0, 1.0));
        assert_eq!((r[1].p50_ratio, r[1].p99_ratio), (2.0, 2.0));
        assert_eq!((r[2].p50_us, r[2].p99_us), (500.0, 990.0));
        assert_eq!((r[2].p50_ratio, r[2].p99_ratio), (10.0, 10.0));
        assert_eq!(r[2].mean_us, 505.0);
        assert_eq!(r[3].case, "nats_shared_runtime");
        assert_eq!((r[3].p50_us, r[3].p50_ratio), (750.0, 15.0));
        assert_eq!((r[4].case, r[4].p99_us), ("nats_reply_sub", 990.0));
        assert_eq!((r[5].case, r[5].p50_ratio), ("nats_blocking_client", 8.0));
        assert_eq!((r[6].case, r[6].p50_us), ("nats_handoff_client", 600.0));
        assert_eq!((r[7].case, r[7].p99_ratio), ("in_process_paced", 2.0));
        let st = stage_rows(&s);
        assert_eq!(st.len(), 10);
        assert_eq!(
            (st[2].case, st[2].p50_us, st[2].p50_ratio),
            ("to_server", 150.0, 0.3)
        );
        assert_eq!((st[9].case, st[9].p50_ratio), ("total", 1.0));
        assert_eq!((met(100.0, 100.0), met(100.1, 100.0)), ("met", "missed"));
    }
}
