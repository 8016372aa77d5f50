//! Replays the Mooncake trace or the session workload OFF and ON and prints
//! the comparison:
//! `cargo run --release -p kv-testkit --example replay -- trace [REQUESTS]`
//! `cargo run --release -p kv-testkit --example replay -- sessions [SESSIONS]`
//! `cargo run --release -p kv-testkit --example replay -- smoke|smoke-gpu [TP]`
//! (`smoke-gpu` needs TP CUDA devices; exits 1 when outputs differ).

use kv_testkit::qualify::{
    session_replay, trace_replay, ReplayFigures, SessionReplayOptions, TraceReplayOptions,
};

fn print(f: &ReplayFigures) {
    println!(
        "requests {}  prefill tokens OFF {} ON {} ({:.1}% fewer)  native hits OFF {} ON {}  donor hits {}  fetches {}  fallbacks {}  refused {}",
        f.requests,
        f.off_prefill_tokens,
        f.on_prefill_tokens,
        100.0 * (1.0 - f.on_prefill_tokens as f64 / f.off_prefill_tokens.max(1) as f64),
        f.off_native_hit_tokens,
        f.on_native_hit_tokens,
        f.on_donor_hit_tokens,
        f.fetches,
        f.fetch_fallbacks,
        f.refused_by_cost
    );
    println!(
        "TTFT ms OFF p50/p90/p99/mean {:.1}/{:.1}/{:.1}/{:.1}  ON {:.1}/{:.1}/{:.1}/{:.1}",
        f.ttft_p50_off_ms,
        f.ttft_p90_off_ms,
        f.ttft_p99_off_ms,
        f.ttft_mean_off_ms,
        f.ttft_p50_on_ms,
        f.ttft_p90_on_ms,
        f.ttft_p99_on_ms,
        f.ttft_mean_on_ms
    );
    println!(
        "slower than OFF {} (by > 1 ms: {})  faster {}  wall {:.1} s",
        f.slower_than_off, f.slower_than_off_by_1ms, f.faster_than_off, f.wall_s
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "trace".into());
    let n: Option<usize> = args
        .next()
        .map(|a| a.parse().expect("count must be a number"));
    match what.as_str() {
        "trace" => {
            let mut o = TraceReplayOptions {
                requests: n,
                ..Default::default()
            };
            o.replay.progress = true;
            println!(
                "options: {}",
                serde_json::to_string(&o.replay).expect("serializable")
            );
            print(&trace_replay(&o).expect("trace replay").figures);
        }
        "sessions" => {
            let mut o = SessionReplayOptions::default();
            if let Some(n) = n {
                o.params.sessions = n as u32;
            }
            o.replay.progress = true;
            println!("{}", o.params.describe());
            let r = session_replay(&o).expect("session replay");
            print(&r.figures);
            println!(
                "later turns: {}  mean TTFT OFF {:.1} ms  ON {:.1} ms",
                r.later_turn_requests, r.later_turn_ttft_mean_off_ms, r.later_turn_ttft_mean_on_ms
            );
        }
        "smoke" | "smoke-gpu" => {
            let o = kv_testkit::qualify::SmokeOptions {
                gpu: what == "smoke-gpu",
                tp: n.map_or(2, |n| n as u32),
                ..Default::default()
            };
            let r = kv_testkit::qualify::serving_smoke(&o).unwrap_or_else(|e| {
                eprintln!("serving smoke: {e}");
                std::process::exit(2);
            });
            for run in &r.runs {
                for q in &run.requests {
                    println!(
                        "{:8} c{} t{} prompt {:4} computed {:4} reused {:4} fetched {:4} bytes {:7} out {:2} {}",
                        run.mode, q.conversation, q.turn, q.prompt_tokens, q.computed_tokens, q.reused_tokens,
                        q.fetched_tokens, q.bytes_moved, q.output_tokens, q.fallback.as_deref().unwrap_or("")
                    );
                }
            }
            println!(
                "profile {} tp {} transports {:?}: computed OFF {} ON {} reused ON {} bytes {} host payload {} \
                 outputs_match {} fallback_outputs_match {}",
                r.profile,
                o.tp,
                r.on_transports,
                r.off_computed_tokens,
                r.on_computed_tokens,
                r.on_reused_tokens,
                r.on_bytes_moved,
                r.on_host_payload_bytes,
                r.outputs_match,
                r.fallback_outputs_match
            );
            if !(r.outputs_match
                && r.fallback_outputs_match
                && r.on_computed_tokens < r.off_computed_tokens)
            {
                std::process::exit(1);
            }
        }
        other => {
            panic!("unknown workload {other:?}: use `trace`, `sessions`, `smoke` or `smoke-gpu`")
        }
    }
}
