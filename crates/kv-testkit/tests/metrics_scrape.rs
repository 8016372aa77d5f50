//! The serving smoke's engines record into Prometheus registries; a
//! `MetricsServer` on an ephemeral port serves them, and a plain TCP
//! `GET /metrics` reads back exactly what the smoke counted.

use kv_router_glue::metrics::MetricsServer;
use kv_testkit::smoke::{
    metric_sample, scrape_metrics, serving_smoke_observed, ScrapedCounters, SmokeMetrics,
    SmokeOptions,
};

#[test]
fn scraped_metrics_equal_the_smokes_own_counts() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let metrics = SmokeMetrics::default();
    let on_server = rt
        .block_on(MetricsServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            metrics.on.clone(),
        ))
        .unwrap();
    let fb_server = rt
        .block_on(MetricsServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            metrics.fallback.clone(),
        ))
        .unwrap();
    assert_ne!(on_server.local_addr().port(), 0);

    // 2 conversations x 3 turns, TP2, host profile.
    let opts = SmokeOptions {
        conversations: 2,
        turns: 3,
        first_prompt_tokens: 50,
        new_tokens_per_turn: 20,
        output_tokens: 12,
        tp: 2,
        ..SmokeOptions::default()
    };
    let r = serving_smoke_observed(&opts, &metrics).unwrap();
    let (on, fb) = (&r.runs[1], &r.runs[2]);

    let body = scrape_metrics(on_server.local_addr()).unwrap();
    assert!(body.ends_with("# EOF\n"), "{body}");
    let c = ScrapedCounters::parse(&body);
    // ON: turns 1 and 2 of both conversations fetch; prompts 82 and 114
    // tokens fetch 48 and 80 (the sealed previous prompt + output), at
    // 2 (K,V) x 3 layers x 2 KV heads x 16 dims x 4 bytes per token.
    let bytes = 2 * (48 + 80) * 2 * 3 * 2 * 16 * 4;
    assert_eq!(on.fetches, 4);
    assert_eq!(on.bytes_moved, bytes);
    assert_eq!(c.fetches_completed, 4);
    assert_eq!(c.fetches_fallback, 0);
    assert_eq!(c.fallbacks, 0);
    assert_eq!(c.admitted, 4);
    assert_eq!(c.fetched_bytes, bytes);
    assert_eq!(c.host_payload_bytes, bytes, "host memcpy backend");
    assert_eq!(
        metric_sample(&body, "kv_reuse_transfer_latency_seconds_count"),
        Some(4.0)
    );
    // Every request was decided once: 2 refusals on turn 0 (no donor blocks).
    let decisions: f64 = body
        .lines()
        .filter(|l| l.starts_with("kv_reuse_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(decisions, 6.0, "{body}");
    // Retained: the final conversation of each (114 + 12 - 1 tokens cached)
    // holds 7 sealed blocks; earlier turns' blocks are its prefixes. Per rank
    // one block is 16 tokens x 2 x 3 layers x 1 KV head x 16 dims x 4 bytes.
    let retained = 2 * 7 * 16 * 2 * 3 * 16 * 4;
    assert_eq!(on.retained_bytes_per_rank, retained);
    assert_eq!(c.retained_bytes.len(), 2, "{:?}", c.retained_bytes);
    assert!(
        c.retained_bytes.values().all(|&b| b == retained),
        "{:?}",
        c.retained_bytes
    );

    let body = scrape_metrics(fb_server.local_addr()).unwrap();
    let c = ScrapedCounters::parse(&body);
    // Forced fallback: blocked, cancelled, killed; nothing completes.
    assert_eq!(fb.fallbacks, 3);
    assert_eq!(fb.fetches, 0);
    assert_eq!(c.fallbacks, 3, "{body}");
    assert_eq!(c.fetches_fallback, 3);
    assert_eq!(c.fetches_completed, 0);
    assert_eq!(c.fetched_bytes, 0);
    assert_eq!(c.admitted, 3);
    // The killed incarnation retains nothing; the restarted one its stores.
    assert_eq!(c.retained_bytes.len(), 4, "{:?}", c.retained_bytes);
    assert_eq!(c.retained_bytes.values().filter(|&&b| b == 0).count(), 2);
    assert!(c
        .retained_bytes
        .values()
        .any(|&b| b == fb.retained_bytes_per_rank && b > 0));

    rt.block_on(async {
        on_server.shutdown().await;
        fb_server.shutdown().await;
    });
}
