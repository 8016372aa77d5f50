//! Section `serving_smoke`: multi-turn conversations through real router,
//! prefill and decode engines running kv-testkit's reference model, reuse
//! OFF, ON, and ON with every fetch forced to fall back
//! (`kv_testkit::smoke::serving_smoke`). Reuse may change cost, never results.
//!
//! The ON and forced-fallback runs record into Prometheus registries served
//! by kv-router-glue's `MetricsServer` on ephemeral 127.0.0.1 ports; the
//! section scrapes `/metrics` over plain HTTP and checks the scraped counters
//! against the smoke's own counts.

use kv_router_glue::metrics::MetricsServer;
use kv_testkit::smoke::{
    scrape_metrics, serving_smoke_observed, ScrapedCounters, ServingSmokeResult, SmokeMetrics,
    SmokeOptions,
};

use crate::section::{Ctx, Profile, SectionResult, Stop};

/// The section body (default smoke: 3 conversations x 4 turns, TP2).
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    // The GPU profile keeps banks and fetched rows in device memory (rank r on
    // GPU r), so TP2 needs two GPUs; with one GPU it runs TP1.
    let opts = match ctx.profile {
        Profile::Gpu => {
            let gpus = ctx.gpus;
            if gpus == 0 {
                return Err(Stop::Error(
                    "GPU profile but nvidia-smi lists no GPU".into(),
                ));
            }
            SmokeOptions {
                gpu: true,
                tp: gpus.min(2),
                ..SmokeOptions::default()
            }
        }
        Profile::Cpu => SmokeOptions::default(),
    };
    let (res, on, fallback) = observed_smoke(&opts).map_err(Stop::Error)?;
    record(&res, r);
    record_scrapes(&res, &on, &fallback, r);
    Ok(())
}

/// One `/metrics` scrape: where, and the counters read (or why not).
#[derive(Debug, Clone)]
pub struct Scrape {
    /// `http://ADDR/metrics`.
    pub endpoint: String,
    /// The counters, or the scrape's error.
    pub counters: Result<ScrapedCounters, String>,
}

/// Runs the smoke with the ON and fallback registries served on
/// `127.0.0.1:0`, then scrapes both endpoints.
pub fn observed_smoke(opts: &SmokeOptions) -> Result<(ServingSmokeResult, Scrape, Scrape), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let metrics = SmokeMetrics::default();
    let bind = |m| {
        rt.block_on(MetricsServer::bind(([127, 0, 0, 1], 0).into(), m))
            .map_err(|e| format!("metrics endpoint bind: {e}"))
    };
    let on_server = bind(metrics.on.clone())?;
    let fb_server = bind(metrics.fallback.clone())?;
    let res = serving_smoke_observed(opts, &metrics).map_err(|e| e.to_string())?;
    let scrape = |server: &MetricsServer| {
        let addr = server.local_addr();
        Scrape {
            endpoint: format!("http://{addr}/metrics"),
            counters: scrape_metrics(addr)
                .map(|body| ScrapedCounters::parse(&body))
                .map_err(|e| e.to_string()),
        }
    };
    let (on, fallback) = (scrape(&on_server), scrape(&fb_server));
    rt.block_on(async {
        on_server.shutdown().await;
        fb_server.shutdown().await;
    });
    Ok((res, on, fallback))
}

/// Checks that the scraped counters equal the smoke's own counts, and the
/// endpoints and scraped values as metrics.
pub fn record_scrapes(
    s: &ServingSmokeResult,
    on: &Scrape,
    fallback: &Scrape,
    r: &mut SectionResult,
) {
    r.metric("on_metrics_endpoint", on.endpoint.clone());
    r.metric("fallback_metrics_endpoint", fallback.endpoint.clone());
    let (on_c, fb_c) = match (&on.counters, &fallback.counters) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            let err = |x: &Result<ScrapedCounters, String>, e: &str| {
                x.as_ref().err().map(|m| format!("{e}: {m}"))
            };
            r.check(
                "metrics_scraped",
                false,
                [err(a, &on.endpoint), err(b, &fallback.endpoint)]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join("; "),
            );
            return;
        }
    };
    r.check(
        "metrics_scraped",
        true,
        format!("{} and {}", on.endpoint, fallback.endpoint),
    );
    let (on_fetches, on_fallbacks, retained) = s.runs.get(1).map_or((0, 0, 0), |x| {
        (x.fetches, x.fallbacks, x.retained_bytes_per_rank)
    });
    r.check(
        "metrics_on_fetches_equal_smoke",
        on_c.fetches_completed == on_fetches
            && on_c.fetches_fallback == on_fallbacks
            && on_c.fallbacks == on_fallbacks
            && on_c.admitted == on_fetches + on_fallbacks,
        format!(
            "scraped completed {} fallback {} admitted {}; smoke fetches {on_fetches} fallbacks {on_fallbacks}",
            on_c.fetches_completed, on_c.fetches_fallback, on_c.admitted
        ),
    );
    r.check(
        "metrics_on_bytes_equal_smoke",
        on_c.fetched_bytes == s.on_bytes_moved
            && on_c.host_payload_bytes == s.on_host_payload_bytes,
        format!(
            "scraped {} B ({} B host payload); smoke {} B ({} B host payload)",
            on_c.fetched_bytes, on_c.host_payload_bytes, s.on_bytes_moved, s.on_host_payload_bytes
        ),
    );
    r.check(
        "metrics_fallback_fallbacks_equal_smoke",
        fb_c.fallbacks == s.fallback_fallbacks
            && fb_c.fetches_fallback == s.fallback_fallbacks
            && fb_c.fetches_completed == s.fallback_fetches
            && fb_c.fetched_bytes == 0,
        format!(
            "scraped fallbacks {} (fetches: fallback {} completed {}, {} B); smoke fallbacks {} fetches {}",
            fb_c.fallbacks,
            fb_c.fetches_fallback,
            fb_c.fetches_completed,
            fb_c.fetched_bytes,
            s.fallback_fallbacks,
            s.fallback_fetches
        ),
    );
    r.check(
        "metrics_on_retained_bytes_equal_bank",
        on_c.retained_bytes.len() == s.options.tp as usize
            && on_c.retained_bytes.values().all(|&b| b == retained)
            && retained > 0,
        format!(
            "scraped {:?}; bank {retained} B per rank",
            on_c.retained_bytes
        ),
    );
    for (k, v) in [
        ("scraped_on_fetches_completed", on_c.fetches_completed),
        ("scraped_on_fetched_bytes", on_c.fetched_bytes),
        ("scraped_on_host_payload_bytes", on_c.host_payload_bytes),
        (
            "scraped_on_retained_bytes_per_rank",
            on_c.retained_bytes.values().copied().max().unwrap_or(0),
        ),
        ("scraped_fallback_fallbacks", fb_c.fallbacks),
        ("scraped_fallback_fetches_completed", fb_c.fetches_completed),
    ] {
        r.metric(k, v);
    }
}

/// Checks and metrics of one smoke result.
pub fn record(s: &ServingSmokeResult, r: &mut SectionResult) {
    r.record = Some(serde_json::json!({
        "off_computed_tokens": s.off_computed_tokens,
        "on_computed_tokens": s.on_computed_tokens,
        "on_reused_tokens": s.on_reused_tokens,
        "outputs_match": s.outputs_match,
        "fallback_outputs_match": s.fallback_outputs_match,
        "on_bytes_moved": s.on_bytes_moved,
        "on_host_payload_bytes": s.on_host_payload_bytes,
        "on_transports": s.on_transports,
        "profile": s.profile,
        "tp": s.options.tp,
    }));
    let requests = s.runs.first().map_or(0, |run| run.requests.len());
    println!(
        "serving_smoke: {requests} requests per run; computed tokens OFF {} ON {} ({} reused, {} B moved); forced fallback: {} fallbacks, {} fetches",
        s.off_computed_tokens, s.on_computed_tokens, s.on_reused_tokens, s.on_bytes_moved, s.fallback_fallbacks, s.fallback_fetches
    );
    r.check(
        "three_runs",
        s.runs.len() == 3,
        format!(
            "runs: {:?}",
            s.runs.iter().map(|x| x.mode.as_str()).collect::<Vec<_>>()
        ),
    );
    r.check(
        "on_outputs_equal_off",
        s.outputs_match,
        "outputs and first logits (bitwise) of ON vs OFF",
    );
    r.check(
        "fallback_outputs_equal_off",
        s.fallback_outputs_match,
        "outputs and first logits (bitwise) of forced fallback vs OFF",
    );
    r.check(
        "on_computes_fewer_tokens",
        s.on_computed_tokens < s.off_computed_tokens && s.on_reused_tokens > 0,
        format!(
            "OFF {} ON {} (reused {})",
            s.off_computed_tokens, s.on_computed_tokens, s.on_reused_tokens
        ),
    );
    r.check(
        "forced_fallback_never_fetches",
        s.fallback_fetches == 0 && s.fallback_fallbacks > 0,
        format!(
            "{} fallbacks, {} fetches",
            s.fallback_fallbacks, s.fallback_fetches
        ),
    );
    for (k, v) in [
        ("requests_per_run", requests as u64),
        ("off_computed_tokens", s.off_computed_tokens),
        ("on_computed_tokens", s.on_computed_tokens),
        ("on_reused_tokens", s.on_reused_tokens),
        ("on_bytes_moved", s.on_bytes_moved),
        ("fallback_fallbacks", s.fallback_fallbacks),
        ("fallback_fetches", s.fallback_fetches),
        ("tp", u64::from(s.options.tp)),
    ] {
        r.metric(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_smoke_passes_and_a_mismatch_fails() {
        let opts = SmokeOptions {
            conversations: 1,
            turns: 2,
            first_prompt_tokens: 40,
            new_tokens_per_turn: 8,
            output_tokens: 8,
            tp: 1,
            ..Default::default()
        };
        let (mut res, on, fallback) = observed_smoke(&opts).unwrap();
        let mut r = SectionResult::new("serving_smoke");
        record(&res, &mut r);
        record_scrapes(&res, &on, &fallback, &mut r);
        assert!(r.failed_checks().next().is_none(), "{:#?}", r.checks);
        assert_eq!(r.metrics["requests_per_run"], 2);
        assert_eq!(
            r.metrics["scraped_on_fetched_bytes"],
            serde_json::json!(res.on_bytes_moved)
        );
        assert!(r.metrics["on_metrics_endpoint"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:"));
        // A scrape that disagrees with the smoke fails its check.
        let mut off_by_one = on.clone();
        if let Ok(c) = &mut off_by_one.counters {
            c.fetches_completed += 1;
        }
        let mut r2 = SectionResult::new("serving_smoke");
        record_scrapes(&res, &off_by_one, &fallback, &mut r2);
        let failed: Vec<_> = r2.failed_checks().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["metrics_on_fetches_equal_smoke"]);
        res.outputs_match = false;
        let mut r = SectionResult::new("serving_smoke");
        record(&res, &mut r);
        let failed: Vec<_> = r.failed_checks().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["on_outputs_equal_off"]);
    }
}
