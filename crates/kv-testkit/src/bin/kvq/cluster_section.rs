//! Section `cluster` and `kvq cluster`: the local cluster of separate
//! processes (`kv_testkit::cluster`: nats-server, router, 2 decode and 2
//! prefill workers, the children being `kvq child cluster-*`), >= 200
//! multi-turn requests, four faults across processes. CPU profile: host-shm
//! banks, TP2; GPU profile: CUDA device banks read over CUDA IPC (TP1 on
//! one GPU, TP2 on two).

use kv_testkit::cluster::{self, ClusterError, ClusterOptions, ClusterReport, RouterProcess};
use kv_testkit::faults::ChildCommand;

use crate::section::{Ctx, Profile, SectionResult, Stop};

/// Section name (and the record's top-level key).
pub const NAME: &str = "cluster";

/// The kvq child command the cluster starts its processes with.
pub fn children(exe: &std::path::Path) -> ChildCommand {
    ChildCommand {
        exe: exe.to_path_buf(),
        args: vec![crate::child::SUBCOMMAND.into()],
    }
}

/// The options of `profile` with `gpus` GPUs.
pub fn options(profile: Profile, gpus: u32) -> ClusterOptions {
    match profile {
        Profile::Cpu => ClusterOptions::default(),
        Profile::Gpu => ClusterOptions {
            gpu: true,
            tp: gpus.clamp(1, 2),
            ..ClusterOptions::default()
        },
    }
}

/// The section body.
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    if ctx.profile == Profile::Gpu && ctx.gpus == 0 {
        return Err(Stop::Error(
            "GPU profile but nvidia-smi lists no GPU".into(),
        ));
    }
    let opts = options(ctx.profile, ctx.gpus);
    let report = match cluster::run(&opts, &children(&ctx.exe), &RouterProcess::find(&ctx.exe)) {
        Ok(rep) => rep,
        Err(ClusterError::Skipped(why)) => return Err(Stop::Skip(why)),
        Err(e) => return Err(Stop::Error(e.to_string())),
    };
    println!("{}", summary(&report));
    record(&report, r);
    Ok(())
}

/// One line per run and one per recovery, as printed.
pub fn summary(c: &ClusterReport) -> String {
    let mut s = format!(
        "cluster ({}, TP{}, router {}): {} requests, {} fetches, {} fallbacks, {} advise unavailable, {} false completions, {} wrong outputs, {} leaks; advise p50 {} us p99 {} us; {:.1} s",
        c.memory, c.tp, c.router, c.requests, c.fetches, c.fallbacks, c.advise_unavailable,
        c.false_completions, c.wrong_outputs, c.leaks, c.advise_p50_us, c.advise_p99_us, c.seconds
    );
    for x in &c.recoveries {
        s.push_str(&format!(
            "\n  {:<34} injected {:<5} then {} requests, {} fetches, {} fallbacks ({})",
            x.fault, x.injected, x.requests_after, x.fetches_after, x.fallbacks_after, x.detail
        ));
    }
    s
}

/// Checks, metrics and the record entry of one cluster report.
pub fn record(c: &ClusterReport, r: &mut SectionResult) {
    r.record = Some(serde_json::json!({
        "requests": c.requests,
        "fetches": c.fetches,
        "fallbacks": c.fallbacks,
        "false_completions": c.false_completions,
        "leaks": c.leaks,
        "advise_p50_us": c.advise_p50_us,
        "advise_p99_us": c.advise_p99_us,
        "recoveries": c.recoveries.iter().map(|x| serde_json::json!({
            "fault": x.fault,
            "fetches_after": x.fetches_after,
        })).collect::<Vec<_>>(),
    }));
    r.check(
        "requests_at_least_200",
        c.requests >= 200,
        format!("{} requests", c.requests),
    );
    r.check(
        "outputs_equal_off",
        c.wrong_outputs == 0,
        format!(
            "{} of {} differ (first logits bitwise, output tokens)",
            c.wrong_outputs, c.requests
        ),
    );
    r.check("fetches", c.fetches > 0, format!("{} fetches", c.fetches));
    r.check(
        "no_false_completion",
        c.false_completions == 0,
        format!("{} false completions", c.false_completions),
    );
    r.check(
        "no_leak",
        c.leaks == 0,
        format!("{} leaks {:?}", c.leaks, c.leak_details),
    );
    for x in &c.recoveries {
        r.check(
            x.fault.clone(),
            x.injected && x.fetches_after > 0,
            format!(
                "injected {}; then {} requests, {} fetches, {} fallbacks: {}",
                x.injected, x.requests_after, x.fetches_after, x.fallbacks_after, x.detail
            ),
        );
    }
    for (k, v) in [
        ("requests", c.requests),
        ("fetches", c.fetches),
        ("fallbacks", c.fallbacks),
        ("advise_unavailable", c.advise_unavailable),
        ("false_completions", c.false_completions),
        ("wrong_outputs", c.wrong_outputs),
        ("leaks", c.leaks),
        ("advise_p50_us", c.advise_p50_us),
        ("advise_p99_us", c.advise_p99_us),
        ("computed_tokens", c.computed_tokens),
        ("fetched_tokens", c.fetched_tokens),
    ] {
        r.metric(k, v);
    }
    r.metric("memory", c.memory.clone());
    r.metric("router", c.router.clone());
    r.metric(
        "recoveries",
        serde_json::to_value(&c.recoveries).unwrap_or_default(),
    );
}

/// `kvq cluster`: runs it once, prints the summary and the report as JSON;
/// exit 0 when every condition holds, 1 when one failed, 2 when the
/// cluster could not run (3 when skipped: no nats-server).
pub fn command(profile: Profile, json: Option<&std::path::Path>) -> i32 {
    let gpus = crate::record::devices().len() as u32;
    if profile == Profile::Gpu && gpus == 0 {
        eprintln!("kvq cluster: --profile gpu but nvidia-smi lists no GPU");
        return 2;
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| "kvq".into());
    match cluster::run(
        &options(profile, gpus),
        &children(&exe),
        &RouterProcess::find(&exe),
    ) {
        Ok(rep) => {
            println!("{}", summary(&rep));
            let text = serde_json::to_string_pretty(&rep).unwrap_or_default();
            match json {
                Some(p) => {
                    if let Err(e) = std::fs::write(p, &text) {
                        eprintln!("kvq cluster: cannot write {}: {e}", p.display());
                        return 2;
                    }
                }
                None => println!("{text}"),
            }
            let failures = rep.failures();
            for f in &failures {
                println!("FAILED: {f}");
            }
            i32::from(!failures.is_empty())
        }
        Err(ClusterError::Skipped(why)) => {
            println!("SKIP cluster: {why}");
            3
        }
        Err(e) => {
            eprintln!("kvq cluster: {e}");
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_has_the_issue_fields_and_a_missing_recovery_fails() {
        let mut c = ClusterReport {
            requests: 240,
            fetches: 90,
            recoveries: vec![cluster::Recovery {
                fault: "router_restarted".into(),
                fetches_after: 0,
                requests_after: 50,
                fallbacks_after: 0,
                injected: true,
                detail: String::new(),
            }],
            ..Default::default()
        };
        let mut r = SectionResult::new(NAME);
        record(&c, &mut r);
        let rec = r.record.clone().unwrap();
        for k in [
            "requests",
            "fetches",
            "fallbacks",
            "false_completions",
            "leaks",
            "advise_p50_us",
            "advise_p99_us",
        ] {
            assert!(rec.get(k).is_some(), "{k}");
        }
        assert_eq!(rec["recoveries"][0]["fault"], "router_restarted");
        let failed: Vec<_> = r.failed_checks().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["router_restarted"]);
        c.recoveries[0].fetches_after = 3;
        c.false_completions = 1;
        let mut r = SectionResult::new(NAME);
        record(&c, &mut r);
        let failed: Vec<_> = r.failed_checks().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["no_false_completion"]);
    }
}
