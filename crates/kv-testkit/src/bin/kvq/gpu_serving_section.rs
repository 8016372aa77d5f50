//! `gpu_serving`: later-turn TTFT OFF vs ON vs ideal on real transformer
//! engines (docs/gpu-serving.md).
//!
//! kvq runs the Python harness `gpu_serving.harness` (kept in
//! `crates/kv-testkit/python`, carried by the GPU bundle) as a child process,
//! reads the JSON it writes, checks correctness (fetched blocks bit-equal,
//! logits bit-equal to the donor, no false completion, no leak), and lifts the
//! JSON into `record.json` as `gpu_serving` with the speed goals
//! evaluated beside it (`goals`: recorded, never a failing check). The GPU
//! profile runs the Llama-3.1-8B shape on `cuda:0`; the CPU profile runs the
//! same code at the tiny shape on the CPU. Skipped, with the harness's
//! reason, where python, torch, transformers or the `kv_reuse` wheel cannot
//! be imported.
//!
//! Environment: `KVQ_PYTHON` (interpreter, default `python3`),
//! `KVQ_GPU_SERVING_DIR` (folder holding the `gpu_serving` package, default
//! this crate's `python/`), `KVQ_GPU_SERVING_ARGS` (extra harness arguments,
//! whitespace-separated, after the profile's: the last value wins),
//! `KVQ_GPU_SERVING_TIMEOUT_S` (default 560).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use plotters::prelude::*;
use serde_json::{json, Value};

use crate::record::Record;
use crate::section::{Ctx, Profile, SectionResult, Stop};

/// Section name, also the record's field.
pub const NAME: &str = "gpu_serving";
/// File name of the TTFT-against-history plot in the output directory.
pub const PLOT: &str = "gpu_serving_ttft.svg";
/// Interpreter override.
pub const PYTHON_ENV: &str = "KVQ_PYTHON";
/// Package folder override (the bundle's `run.sh` sets it).
pub const DIR_ENV: &str = "KVQ_GPU_SERVING_DIR";
/// Extra harness arguments.
pub const ARGS_ENV: &str = "KVQ_GPU_SERVING_ARGS";
/// Wall-clock limit of the harness, seconds.
pub const TIMEOUT_ENV: &str = "KVQ_GPU_SERVING_TIMEOUT_S";

/// The harness arguments of a profile (before [`ARGS_ENV`]'s).
///
/// GPU: the workload (8 sessions x 6 turns up to 32K history,
/// 150-256-token turns, 64-128-token answers) over CUDA IPC (`--transport
/// cuda`: a CUDA donor bank, the prefill's own CUDA tensor as destination),
/// advised by the router service (`--router service`: nats-server and
/// kv-reuse-router as processes, the workers' agents publishing on NATS),
/// each timed request three times (`--repeats 3`, the minimum kept: single
/// forwards of one shape scattered 22-40 ms on the H200, and two samples
/// left ON/ideal at 16K moving by 10% between runs), a session's first turn
/// five times (`--first-turn-repeats 5`: its goal is ON within 1 ms of OFF on
/// forwards of up to 32K tokens, ~1.3 s, whose minimum of three still moved
/// by several ms between ON and OFF),
/// cut to fit one 600 s device call: the decode's answers are `forced` (first
/// token greedy, the rest seeded, their KV in one forward pass instead of one
/// decode step each), greedy agreement on every 4th later turn, and no turn
/// started after 440 s (`--budget-s`; the JSON then says `truncated` and the
/// `workload_size` check fails). CPU: the tiny shape over host shm
/// (`--transport host`), histories to 1K, 8 x 3 turns.
pub fn profile_args(profile: Profile) -> Vec<String> {
    let args: &[&str] = match profile {
        Profile::Gpu => &[
            "--model",
            "llama-3.1-8b",
            "--prefill-device",
            "cuda:0",
            "--decode-device",
            "cuda:0",
            "--transport",
            "cuda",
            "--answer",
            "forced",
            "--gen-tokens",
            "64",
            "128",
            "--greedy-every",
            "4",
            "--router",
            "service",
            "--repeats",
            "3",
            "--first-turn-repeats",
            "5",
            "--budget-s",
            "440",
        ],
        Profile::Cpu => &[
            "--model",
            "tiny",
            "--prefill-device",
            "cpu",
            "--decode-device",
            "cpu",
            "--transport",
            "host",
            "--sessions",
            "8",
            "--turns",
            "3",
            "--history-max",
            "1024",
            "--turn-tokens",
            "40",
            "60",
            "--gen-tokens",
            "8",
            "16",
            "--tokens-per-block",
            "16",
            "--greedy-every",
            "2",
        ],
    };
    args.iter().map(|s| (*s).to_owned()).collect()
}

fn package_dir() -> PathBuf {
    std::env::var_os(DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/python")))
}

/// The section body.
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let dir = package_dir();
    if !dir.join("gpu_serving/harness.py").is_file() {
        return Err(Stop::Skip(format!(
            "no gpu_serving package under {} (set {DIR_ENV})",
            dir.display()
        )));
    }
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".into());
    let timeout = std::env::var(TIMEOUT_ENV)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(560);
    let out = ctx.out_dir.join("gpu_serving.json");
    let _ = std::fs::remove_file(&out);
    let mut args = profile_args(ctx.profile);
    if let Ok(extra) = std::env::var(ARGS_ENV) {
        args.extend(extra.split_whitespace().map(str::to_owned));
    }
    let pythonpath = match std::env::var_os("PYTHONPATH") {
        Some(p) if !p.is_empty() => format!("{}:{}", dir.display(), p.to_string_lossy()),
        _ => dir.display().to_string(),
    };
    println!(
        "gpu_serving: {python} -m gpu_serving.harness {}",
        args.join(" ")
    );
    let mut child = match Command::new(&python)
        .args(["-m", "gpu_serving.harness", "--out"])
        .arg(&out)
        .args(&args)
        .env("PYTHONPATH", pythonpath)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Stop::Skip(format!(
                "no Python interpreter `{python}` ({e})"
            )))
        }
        Err(e) => return Err(Stop::Error(format!("cannot start `{python}`: {e}"))),
    };
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if t0.elapsed() > Duration::from_secs(timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Stop::Error(format!(
                    "harness ran past {timeout} s ({TIMEOUT_ENV}); shrink it with {ARGS_ENV}"
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(Stop::Error(format!("waiting for the harness: {e}"))),
        }
    };
    let text = std::fs::read_to_string(&out).map_err(|e| {
        Stop::Error(format!(
            "harness exited {status} without {}: {e}",
            out.display()
        ))
    })?;
    let mut v: Value = serde_json::from_str(&text)
        .map_err(|e| Stop::Error(format!("{}: not JSON: {e}", out.display())))?;
    if let Some(reason) = v["skipped"].as_str() {
        return Err(Stop::Skip(reason.to_owned()));
    }
    if let Some(e) = v["error"].as_str() {
        return Err(Stop::Error(format!("harness: {e}")));
    }
    if !status.success() {
        return Err(Stop::Error(format!("harness exited {status}")));
    }
    for (name, passed, detail) in checks(ctx.profile, &v) {
        r.check(name, passed, detail);
    }
    v["goals"] = goals(&v);
    for k in [
        "bytes_moved",
        "host_payload_bytes",
        "fetched_turns",
        "max_logit_diff_vs_off",
        "greedy_agreement",
        "fallbacks",
        "wall_s",
    ] {
        r.metric(k, v[k].clone());
    }
    for b in v["buckets"].as_array().into_iter().flatten() {
        r.metric(&format!("ratio_{}", b["history"]), b["ratio"].clone());
    }
    r.record = Some(v);
    Ok(())
}

/// Correctness checks over the harness JSON: (name, passed, detail).
pub fn checks(profile: Profile, v: &Value) -> Vec<(String, bool, String)> {
    let n = |k: &str| v[k].as_u64();
    let mut out = vec![
        (
            "fetched".to_owned(),
            n("fetched_turns").unwrap_or(0) > 0,
            format!(
                "{} turns fetched a prefix, {} bytes",
                v["fetched_turns"], v["bytes_moved"]
            ),
        ),
        (
            "logits_bit_equal_to_donor".to_owned(),
            v["logits_bit_equal_to_donor"] == json!(true),
            "target's first-token logits vs the donor continuing on its own KV, every fetched turn"
                .to_owned(),
        ),
        (
            "no_false_completion".to_owned(),
            n("false_completions") == Some(0),
            format!(
                "{} fetched turns with a block checksum differing from the donor's",
                v["false_completions"]
            ),
        ),
        (
            "no_leak".to_owned(),
            n("leaks") == Some(0),
            format!("{} ({})", v["leaks"], v["leaks_detail"]),
        ),
    ];
    // The warm regime, when asked for, ran every turn (a failing warm request
    // stops only the warm regime; the harness records why in `warm_error`).
    if v["regime"] == json!("churn+warm") {
        out.push((
            "warm_regime".to_owned(),
            v["warm_error"].is_null() && !v["warm"].is_null(),
            format!(
                "warm error {}, warm {}",
                v["warm_error"],
                !v["warm"].is_null()
            ),
        ));
    }
    // The donor-killed turn (when the harness ran it): it fell back, produced
    // its first token and the prefill kept no row, pin, mapping or fd.
    if !v["donor_kill"].is_null() {
        let k = &v["donor_kill"];
        out.push((
            "donor_kill_falls_back".to_owned(),
            k["ok"] == json!(true) && k["first_token_produced"] == json!(true),
            format!(
                "fell back {}, first token {}, prefill leaks grown {}, free rows {} -> {}",
                k["fell_back"],
                k["first_token_produced"],
                k["prefill_leaks_grown"],
                k["free_rows_before"],
                k["free_rows_after"]
            ),
        ));
    }
    // With the router service (`--router service`), both servers ran as
    // processes and exited cleanly after the run (the router drains on SIGTERM).
    if !v["router_service"].is_null() {
        let codes = &v["router_service"]["exit_codes"];
        out.push((
            "router_service_exited_cleanly".to_owned(),
            codes["router"] == json!(0),
            format!("exit codes {codes}"),
        ));
    }
    if profile == Profile::Gpu {
        out.push((
            "router_service".to_owned(),
            v["router_mode"] == json!("service"),
            format!("router {}", v["router"]),
        ));
        let w = &v["workload"];
        let ok = w["sessions"].as_u64().unwrap_or(0) >= 8
            && w["turns"].as_u64().unwrap_or(0) >= 6
            && w["history_max"].as_u64().unwrap_or(0) >= 32768
            && v["truncated"].is_null();
        out.push((
            "workload_size".to_owned(),
            ok,
            format!(
                "{} sessions x {} turns to {} tokens (>= 8 x 6 to 32768), truncated: {}",
                w["sessions"], w["turns"], w["history_max"], v["truncated"]
            ),
        ));
        // The GPU profile's fetches must go device to device (CUDA IPC into
        // the prefill's own tensor): any host payload means KV crossed host
        // memory, which is what made ON slower than OFF before.
        out.push((
            "device_direct".to_owned(),
            v["transport_path"] == json!("cuda_ipc") && n("host_payload_bytes") == Some(0),
            format!(
                "transport path {}, wheel transport {}, host payload {} bytes",
                v["transport_path"], v["transport"], v["host_payload_bytes"]
            ),
        ));
    }
    out
}

/// The goals, evaluated on the buckets (bucket i of four: 2K, 8K,
/// 16K, 32K at full size): churn OFF/ON >= 7x / 10x / 14x at 8K / 16K / 32K,
/// ON <= 1.15 x ideal at every bucket, first turns no slower than OFF by more
/// than 1 ms (the median of ON - OFF paired by repetition over every first
/// turn, `first_turns.paired_p50_ms`, when present; else of per-turn ON -
/// OFF, `on_minus_off_p50_ms`; else the difference of the p50s), 0 false
/// completions, 0 leaks. `null` where not measured.
pub fn goals(v: &Value) -> Value {
    let buckets: Vec<&Value> = v["buckets"].as_array().into_iter().flatten().collect();
    let full = v["workload"]["history_max"].as_f64().unwrap_or(0.0);
    let mut g = serde_json::Map::new();
    for (frac, want) in [(0.25, 7.0), (0.5, 10.0), (1.0, 14.0)] {
        let edge = (full * frac) as u64;
        let ratio = buckets
            .iter()
            .find(|b| b["history"].as_u64() == Some(edge))
            .and_then(|b| b["ratio"].as_f64());
        g.insert(
            format!("ratio_{edge}_ge_{want}"),
            ratio.map_or(Value::Null, |r| json!(r >= want)),
        );
    }
    let over: Vec<f64> = buckets
        .iter()
        .filter_map(|b| b["on_over_ideal"].as_f64())
        .collect();
    g.insert(
        "on_le_1_15_ideal".into(),
        if over.is_empty() {
            Value::Null
        } else {
            json!(over.iter().all(|x| *x <= 1.15))
        },
    );
    // First turns: the median of ON - OFF over every repetition of every
    // first turn, paired by repetition (`paired_p50_ms`: the two requests of
    // a pair ran back to back, so slow drifts cancel and everything ON costs,
    // in the forward too, stays); else the median of each turn's minimum ON -
    // minimum OFF (older records); else the two p50s (turns of different
    // sizes, so one noisy turn can move either). What ON adds outside the
    // forward (`added_p50_ms`) is a diagnosis, never the goal: it would hide
    // a slowdown ON caused inside the forward.
    let f = &v["first_turns"];
    g.insert(
        "first_turns_within_1ms".into(),
        match (
            f["paired_p50_ms"].as_f64(),
            f["on_minus_off_p50_ms"].as_f64(),
            f["on_p50_ms"].as_f64(),
            f["off_p50_ms"].as_f64(),
        ) {
            (Some(d), _, _, _) | (None, Some(d), _, _) => json!(d <= 1.0),
            (None, None, Some(on), Some(off)) => json!(on <= off + 1.0),
            _ => Value::Null,
        },
    );
    // The warm regime (when run): ON-warm no slower than OFF-warm (the
    // prefill's own prefix cache) by more than 1 ms in every bucket, by the
    // median of ON - OFF paired by repetition (`gpu_serving.regimes.paired_ms`).
    g.insert(
        "warm_turns_within_1ms".into(),
        v["warm"]["within_1ms"]
            .as_bool()
            .map_or(Value::Null, Value::Bool),
    );
    g.insert(
        "zero_false_completions".into(),
        json!(v["false_completions"].as_u64() == Some(0)),
    );
    g.insert("zero_leaks".into(), json!(v["leaks"].as_u64() == Some(0)));
    Value::Object(g)
}

/// REPORT.md's `gpu_serving` part (bucket table, goals, plot) when the
/// section produced a record; writes the plot into `dir`.
///
/// # Errors
/// The failed plot write, naming the file.
pub fn report(r: &Record, dir: &Path, md: &mut String) -> Result<(), String> {
    let Some(v) = &r.gpu_serving else {
        return Ok(());
    };
    let _ = writeln!(
        md,
        "\n## gpu_serving: later-turn TTFT, {} ({} regime, transport {})\n\n![TTFT against history]({PLOT})\n\n| history | turns | OFF p50 | ON p50 | ideal p50 | OFF p99 | ON p99 | OFF/ON | ON/ideal |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        v["model"].as_str().unwrap_or("?"),
        v["regime"].as_str().unwrap_or("?"),
        v["transport"]
    );
    let f = |x: &Value| x.as_f64().map_or("-".to_owned(), |x| format!("{x:.2}"));
    for b in v["buckets"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            b["history"],
            b["turns"],
            f(&b["off_p50_ms"]),
            f(&b["on_p50_ms"]),
            f(&b["ideal_p50_ms"]),
            f(&b["off_p99_ms"]),
            f(&b["on_p99_ms"]),
            f(&b["ratio"]),
            f(&b["on_over_ideal"])
        );
    }
    let _ = writeln!(
        md,
        "\nTimes in ms, client-observed. Bytes moved {}, host payload {}, logits bit-equal to the donor {}, max |logit OFF - ON| {}, greedy agreement {}, fallbacks {}, false completions {}, leaks {}.\n\nGoals: `{}`",
        v["bytes_moved"],
        v["host_payload_bytes"],
        v["logits_bit_equal_to_donor"],
        v["max_logit_diff_vs_off"],
        v["greedy_agreement"],
        v["fallbacks"],
        v["false_completions"],
        v["leaks"],
        v["goals"]
    );
    let ft = &v["first_turns"];
    if !ft.is_null() {
        let _ = writeln!(
            md,
            "\nFirst turns (nothing to fetch; {} turns): OFF p50 {}, ON p50 {}, ON - OFF paired by repetition p50 {} over {} pairs (the goal's measure), per-turn minimum ON - minimum OFF p50 {} (of it the forward's own ON - OFF p50 {}; OFF's own samples of one turn spread over {} p50), what ON adds outside the forward p50 {}, advise p50 {} ms{}{}.",
            ft["turns"],
            f(&ft["off_p50_ms"]),
            f(&ft["on_p50_ms"]),
            f(&ft["paired_p50_ms"]),
            ft["pairs"],
            f(&ft["on_minus_off_p50_ms"]),
            f(&ft["forward_on_minus_off_p50_ms"]),
            f(&ft["off_spread_p50_ms"]),
            f(&ft["added_p50_ms"]),
            f(&ft["advise_p50_ms"]),
            // ON's prompt went to the prefill worker ahead of its advise (harness --stage-prompt).
            if v["prompt_staged"].as_bool() == Some(true) {
                "; ON's prompt staged ahead of the advise"
            } else {
                ""
            },
            // Only the router service has a busy-poll window.
            v["router_service"]["advise_busy_poll_us"]
                .as_u64()
                .map_or(String::new(), |us| format!("; advise busy poll {us} µs"))
        );
    }
    if let Some(wb) = v["warm"]["buckets"].as_array() {
        let _ = writeln!(
            md,
            "\nWarm regime (the prefill keeps its own prefix cache; the cost model decides what to fetch): {} of {} later turns fetched (p50 {} tokens), {} refused by the cost model, {} fallbacks.\n\n| history | turns | OFF p50 | ON p50 | OFF p99 | ON p99 | OFF/ON | ON - OFF paired p50 |\n| --- | --- | --- | --- | --- | --- | --- | --- |",
            v["warm"]["fetched_turns"],
            v["warm"]["later_turns"],
            v["warm"]["fetched_tokens_p50"],
            v["warm"]["refused_turns"],
            v["warm"]["fallbacks"]
        );
        for b in wb {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                b["history"],
                b["turns"],
                f(&b["off_p50_ms"]),
                f(&b["on_p50_ms"]),
                f(&b["off_p99_ms"]),
                f(&b["on_p99_ms"]),
                f(&b["ratio"]),
                f(&b["paired_p50_ms"])
            );
        }
    }
    if !v["donor_kill"].is_null() {
        let _ = writeln!(md, "\nDonor SIGKILLed mid-fetch: `{}`", v["donor_kill"]);
    }
    plot(&dir.join(PLOT), v)
}

/// Later-turn TTFT against history length: OFF, ON and ideal, one point per turn.
fn plot(path: &Path, v: &Value) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let turns: Vec<&Value> = v["turns"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["turn"].as_u64().unwrap_or(0) > 0)
        .collect();
    let series = [
        ("OFF", "off_ms", RED),
        ("ON", "on_ms", BLUE),
        ("ideal", "ideal_ms", GREEN),
    ];
    let points = |key: &str| -> Vec<(f64, f64)> {
        turns
            .iter()
            .filter_map(|t| Some((t["history"].as_f64()?, t[key].as_f64()?)))
            .filter(|(_, y)| *y > 0.0)
            .collect()
    };
    let all: Vec<(f64, f64)> = series.iter().flat_map(|(_, k, _)| points(k)).collect();
    let x_max = all.iter().map(|p| p.0).fold(1.0_f64, f64::max) * 1.05;
    let (y_min, y_max) = crate::report::log_axis(all.iter().map(|p| p.1), 0.8, 1.2);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Later-turn TTFT against history: OFF / ON / ideal",
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, (y_min..y_max).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("history (tokens)")
        .y_desc("TTFT (ms, log scale)")
        .draw()
        .map_err(|e| err(&e))?;
    for (label, key, color) in series {
        chart
            .draw_series(
                points(key)
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 9, y), 3, color.filled()));
    }
    crate::report::draw_legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Value {
        json!({
            "model": "llama-3.1-8b", "regime": "churn+warm", "warm_error": null, "transport": ["cuda_same_device_copy"],
            "transport_path": "cuda_ipc", "truncated": null,
            "router_mode": "service", "router": "kv-reuse-router at nats://127.0.0.1:4222",
            "router_service": {"exit_codes": {"router": 0, "nats_server": 0}},
            "workload": {"sessions": 8, "turns": 6, "history_max": 32768},
            "fetched_turns": 40, "bytes_moved": 1000, "host_payload_bytes": 0,
            "logits_bit_equal_to_donor": true, "false_completions": 0, "leaks": 0,
            "leaks_detail": {}, "first_turns": {"off_p50_ms": 10.0, "on_p50_ms": 10.5},
            "warm": {"within_1ms": false, "buckets": [{"history": 8192, "turns": 5, "off_p50_ms": 30.0, "on_p50_ms": 32.0}]},
            "donor_kill": {"ok": true, "first_token_produced": true, "fell_back": ["donor gone", "transfer", "x"]},
            "buckets": [
                {"history": 2048, "ratio": 2.0, "on_over_ideal": 1.1},
                {"history": 8192, "ratio": 7.5, "on_over_ideal": 1.1},
                {"history": 16384, "ratio": 9.0, "on_over_ideal": 1.2},
            ],
            "turns": [
                {"turn": 0, "history": 100, "off_ms": 5.0, "on_ms": 5.0},
                {"turn": 1, "history": 2000, "off_ms": 50.0, "on_ms": 20.0, "ideal_ms": 18.0},
            ],
        })
    }

    #[test]
    fn goals_follow_the_buckets_and_leave_unmeasured_ones_null() {
        let g = goals(&sample());
        assert_eq!(g["ratio_8192_ge_7"], json!(true));
        assert_eq!(g["ratio_16384_ge_10"], json!(false));
        assert_eq!(g["ratio_32768_ge_14"], Value::Null);
        assert_eq!(g["on_le_1_15_ideal"], json!(false));
        assert_eq!(g["first_turns_within_1ms"], json!(true));
        assert_eq!(g["warm_turns_within_1ms"], json!(false));
        let mut v = sample();
        v["warm"] = Value::Null;
        assert_eq!(goals(&v)["warm_turns_within_1ms"], Value::Null);
        // The paired difference, when reported, decides over the p50s.
        v["first_turns"]["on_minus_off_p50_ms"] = json!(1.2);
        assert_eq!(goals(&v)["first_turns_within_1ms"], json!(false));
        v["first_turns"]["on_minus_off_p50_ms"] = json!(0.4);
        v["first_turns"]["on_p50_ms"] = json!(20.0);
        assert_eq!(goals(&v)["first_turns_within_1ms"], json!(true));
        // The paired median decides when reported, either way; what ON adds
        // outside the forward never does.
        v["first_turns"]["paired_p50_ms"] = json!(1.3);
        v["first_turns"]["added_p50_ms"] = json!(0.2);
        assert_eq!(goals(&v)["first_turns_within_1ms"], json!(false));
        v["first_turns"]["on_minus_off_p50_ms"] = json!(2.4);
        v["first_turns"]["paired_p50_ms"] = json!(0.6);
        v["first_turns"]["added_p50_ms"] = json!(1.5);
        assert_eq!(goals(&v)["first_turns_within_1ms"], json!(true));
        v["first_turns"] = json!({});
        assert_eq!(goals(&v)["first_turns_within_1ms"], Value::Null);
        assert_eq!(g["zero_leaks"], json!(true));
    }

    #[test]
    fn checks_fail_on_mismatch_false_completion_leak_or_small_workload() {
        let names = |v: &Value, p| -> Vec<String> {
            checks(p, v)
                .into_iter()
                .filter(|c| !c.1)
                .map(|c| c.0)
                .collect()
        };
        assert!(names(&sample(), Profile::Gpu).is_empty());
        let mut v = sample();
        v["logits_bit_equal_to_donor"] = json!(false);
        v["false_completions"] = json!(1);
        v["leaks"] = json!(2);
        v["fetched_turns"] = json!(0);
        v["workload"]["turns"] = json!(3);
        v["host_payload_bytes"] = json!(1000);
        assert_eq!(
            names(&v, Profile::Gpu),
            [
                "fetched",
                "logits_bit_equal_to_donor",
                "no_false_completion",
                "no_leak",
                "workload_size",
                "device_direct"
            ]
        );
        // The CPU profile's tiny workload is not held to the size.
        assert_eq!(names(&v, Profile::Cpu).len(), 4);
        // A run stopped by its budget, or one that moved KV through host shm,
        // fails its GPU checks even when everything else is right.
        let mut v = sample();
        v["truncated"] = json!("--budget-s 420 reached after 33 turns");
        assert_eq!(names(&v, Profile::Gpu), ["workload_size"]);
        let mut v = sample();
        v["transport_path"] = json!("host_shm");
        assert_eq!(names(&v, Profile::Gpu), ["device_direct"]);
        // The GPU profile is advised by the router service, and its router
        // must drain and exit 0; the CPU profile may use the in-process router.
        let mut v = sample();
        v["router_service"]["exit_codes"]["router"] = json!(-15);
        assert_eq!(names(&v, Profile::Cpu), ["router_service_exited_cleanly"]);
        let mut v = sample();
        v["router_mode"] = json!("in-process");
        v["router_service"] = Value::Null;
        assert_eq!(names(&v, Profile::Gpu), ["router_service"]);
        assert!(names(&v, Profile::Cpu).is_empty());
        // A donor-killed turn that fetched anyway (or leaked) fails on both profiles.
        let mut v = sample();
        v["donor_kill"]["ok"] = json!(false);
        assert_eq!(names(&v, Profile::Cpu), ["donor_kill_falls_back"]);
        let mut v = sample();
        v["warm_error"] = json!("s3 turn 2: warm_on: boom");
        assert_eq!(names(&v, Profile::Cpu), ["warm_regime"]);
        v["regime"] = json!("churn");
        assert!(names(&v, Profile::Cpu).is_empty());
    }

    #[test]
    fn plot_draws_later_turns() {
        let dir = std::env::temp_dir().join(format!("kvq-gpu-serving-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(PLOT);
        plot(&p, &sample()).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("<circle") && svg.contains("ideal"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn profiles_pick_the_shape_and_device() {
        let gpu = profile_args(Profile::Gpu).join(" ");
        assert!(gpu.contains("--model llama-3.1-8b") && gpu.contains("--prefill-device cuda:0"));
        assert!(gpu.contains("--transport cuda") && gpu.contains("--answer forced"));
        assert!(gpu.contains("--router service") && gpu.contains("--repeats 3"));
        assert!(gpu.contains("--first-turn-repeats 5"));
        let cpu = profile_args(Profile::Cpu).join(" ");
        assert!(cpu.contains("--model tiny") && cpu.contains("--decode-device cpu"));
        assert!(cpu.contains("--transport host"));
    }
}
