//! Replays the whole Mooncake trace OFF and ON and prints the comparison:
//! `cargo run --release -p kv-testkit --example trace_replay [-- REQUESTS]`.

use kv_testkit::replay::{compare, ReplayOptions, Workload};
use kv_testkit::trace::{default_trace_path, MooncakeTrace};

fn main() {
    let n: usize = std::env::args().nth(1).map_or(usize::MAX, |a| {
        a.parse().expect("REQUESTS must be a number")
    });
    let t0 = std::time::Instant::now();
    let trace = MooncakeTrace::load(default_trace_path())
        .expect("trace")
        .head(n);
    let opts = ReplayOptions {
        progress: true,
        ..ReplayOptions::default()
    };
    let w =
        Workload::from_trace(&trace, "mooncake", opts.cluster.tokens_per_block).expect("workload");
    eprintln!(
        "hashed {} requests in {:.1} s",
        w.requests.len(),
        t0.elapsed().as_secs_f64()
    );
    let c = compare(&w, &opts).expect("replay");
    for m in [&c.off, &c.on] {
        println!(
            "reuse={} prefill_tokens={} native_hit={} donor_hit={} found={} refused={} fallbacks={} fetches={} ttft p50/p90/p99/mean = {:.1}/{:.1}/{:.1}/{:.1} ms makespan {:.0} s",
            m.reuse, m.prefill_tokens, m.native_hit_tokens, m.donor_hit_tokens, m.donor_found, m.refused_by_cost,
            m.fetch_fallbacks, m.fetches, m.ttft_p50_ms, m.ttft_p90_ms, m.ttft_p99_ms, m.ttft_mean_ms, m.makespan_s
        );
    }
    for th in [0.001, 0.1, 1.0, 10.0, 100.0, 1000.0] {
        let k = c
            .off
            .ttft_ms
            .iter()
            .zip(&c.on.ttft_ms)
            .filter(|(o, n)| **n > **o + th)
            .count();
        let f = c
            .off
            .ttft_ms
            .iter()
            .zip(&c.on.ttft_ms)
            .filter(|(o, n)| **n + th < **o)
            .count();
        println!("  slower by > {th} ms: {k}   faster by > {th} ms: {f}");
    }
    println!(
        "slower_than_off={} faster_than_off={} total {:.1} s",
        c.slower_than_off,
        c.faster_than_off,
        t0.elapsed().as_secs_f64()
    );
}
