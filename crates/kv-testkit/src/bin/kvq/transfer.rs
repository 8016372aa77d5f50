//! kv-transfer's checks in kvq: the native oracle as qualification sections
//! (native backend and NIXL), `kvq oracle`, and `kvq bench transfer`.

use std::path::Path;

use kv_transfer::bench::{BenchOpts, BenchRow};
use kv_transfer::oracle::{self, OracleBackend, OracleReport};
use kv_transfer::TransferError;

use crate::section::{Ctx, Profile, SectionResult, Stop};

fn oracle_profile(p: Profile) -> oracle::Profile {
    match p {
        Profile::Cpu => oracle::Profile::Cpu,
        Profile::Gpu => oracle::Profile::Gpu,
    }
}

/// True under CI, where a missing runtime is a failure (one rule for every
/// crate: [`kv_transfer::ci_requires`]).
fn in_ci() -> bool {
    kv_transfer::ci_requires()
}

/// Section `transfer_oracle`: the oracle with the profile's native backend.
pub fn oracle_native(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    oracle_section(ctx, r, OracleBackend::Native)
}

/// Section `transfer_oracle_nixl`: the oracle through two NIXL agents. Skipped
/// with the reason when the NIXL runtime does not load, except under CI.
pub fn oracle_nixl(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    oracle_section(ctx, r, OracleBackend::Nixl)
}

fn oracle_section(ctx: &Ctx, r: &mut SectionResult, backend: OracleBackend) -> Result<(), Stop> {
    let rep = match oracle::run_backend(oracle_profile(ctx.profile), backend) {
        Ok(rep) => rep,
        Err(TransferError::NixlUnavailable(why)) if !in_ci() => {
            return Err(Stop::Skip(format!("NIXL runtime unavailable: {why}")))
        }
        Err(e) => return Err(Stop::Error(format!("oracle ({backend:?}): {e}"))),
    };
    record_oracle(&rep, r);
    Ok(())
}

/// Section `transfer_cuda_ipc` (GPU): kv-transfer's two-process fetch check.
/// The donor (this process) exports a bank region; one child per visible GPU
/// (at most two: same-GPU and peer) maps it by CUDA IPC, fetches contiguous
/// and scattered blocks and a 7-block fetch, checks the bytes, and reports
/// each case's throughput against a raw device copy measured in the child.
pub fn cuda_ipc(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let rep = kv_transfer::ipc_check::run(&ctx.exe, &[crate::child::SUBCOMMAND])
        .map_err(|e| Stop::Error(format!("ipc_check: {e}")))?;
    r.check(
        "children_ran",
        !rep.children.is_empty(),
        format!("{} importer(s)", rep.children.len()),
    );
    for c in &rep.children {
        let g = c.ordinal;
        r.check(
            format!("gpu{g}_bytes_match"),
            c.bytes_ok,
            format!("GPU {g}: scattered fetch bytes checked"),
        );
        r.check(
            format!("gpu{g}_no_host_payload"),
            c.host_payload_bytes == 0,
            format!("GPU {g}: {} host payload bytes", c.host_payload_bytes),
        );
        r.metric(&format!("gpu{g}_import_us"), c.import_us);
        for row in &c.rows {
            r.metric(
                &format!("gpu{g}/{}/ratio", row.name),
                (row.ratio * 1e3).round() / 1e3,
            );
            r.metric(
                &format!("gpu{g}/{}/GBps", row.name),
                (row.gbps * 100.0).round() / 100.0,
            );
            r.metric(
                &format!("gpu{g}/{}/p50_us", row.name),
                (row.p50_us * 10.0).round() / 10.0,
            );
        }
    }
    r.check(
        "verdict",
        rep.passed(),
        "every importer checked its bytes with no host payload",
    );
    Ok(())
}

/// Turns an oracle report into checks (one per verdict field) and metrics.
pub fn record_oracle(rep: &OracleReport, r: &mut SectionResult) {
    if let Some(why) = &rep.fail_closed {
        // The GPU path refused a transport it could not verify device-direct
        // (one-process NIXL VRAM rides tcp/lo): the required outcome.
        r.record = Some(serde_json::json!({
            "backend": rep.backend,
            "tp_size": rep.tp_size,
            "fail_closed": why,
            "host_payload_bytes_reported": rep.host_payload_bytes,
        }));
        r.check("gpu_path_fails_closed", rep.passed(), why.clone());
        r.check(
            "no_completion_reported",
            !rep.positive_complete && !rep.false_completion,
            "the refused fetch reported no completion",
        );
        r.check("pins_released", rep.pins_released, "no pin outstanding");
        r.check("banks_closed", rep.banks_closed, "donor bank closed");
        return;
    }
    r.record = Some(serde_json::json!({
        "backend": rep.backend,
        "transport": rep.transport,
        "tp_size": rep.tp_size,
        "positive": {
            "keys": rep.keys,
            "bytes": rep.bytes,
            "copies": rep.copies,
            "host_payload_bytes": rep.host_payload_bytes,
            "bytes_ok": rep.bytes_ok,
        },
        "missing_key": {
            "keys": rep.missing_keys,
            "untouched_rows_ok": rep.untouched_rows_ok,
            "false_completion": rep.false_completion,
        },
    }));
    r.check(
        "bytes_match",
        rep.bytes_ok,
        format!(
            "{} bytes in {} copies, TP{}",
            rep.bytes, rep.copies, rep.tp_size
        ),
    );
    r.check(
        "untouched_rows_keep_poison",
        rep.untouched_rows_ok,
        format!("{} of {} keys absent", rep.missing_keys, rep.keys),
    );
    r.check(
        "positive_completes",
        rep.positive_complete,
        format!("{} µs", rep.positive_us),
    );
    r.check(
        "missing_keys_never_complete",
        !rep.false_completion,
        format!("false completion: {}", rep.false_completion),
    );
    r.check(
        "pins_released",
        rep.pins_released,
        "no pin outstanding after both cases",
    );
    r.check(
        "donor_bank_closed",
        rep.banks_closed,
        "generation dead, memory freed",
    );
    if rep.profile == oracle::Profile::Gpu {
        r.check(
            "no_host_payload",
            rep.host_payload_bytes == 0,
            format!("{} host payload bytes", rep.host_payload_bytes),
        );
    }
    r.check(
        "verdict",
        rep.passed(),
        format!("backend {}, transport {}", rep.backend, rep.transport),
    );
    for (k, v) in [
        ("tp_size", u64::from(rep.tp_size)),
        ("bytes", rep.bytes),
        ("copies", rep.copies),
        ("host_payload_bytes", rep.host_payload_bytes),
        ("positive_us", rep.positive_us),
    ] {
        r.metric(k, v);
    }
    r.metric("backend", rep.backend.clone());
    r.metric("transport", rep.transport.clone());
}

/// `kvq oracle`: runs one oracle and prints its JSON report; exit 0 when it passed.
pub fn oracle_command(profile: Profile, nixl: bool) -> i32 {
    let backend = if nixl {
        OracleBackend::Nixl
    } else {
        OracleBackend::Native
    };
    match oracle::run_backend(oracle_profile(profile), backend) {
        Ok(rep) => {
            println!("{}", serde_json::to_string_pretty(&rep).unwrap_or_default());
            println!(
                "oracle {}: {}",
                rep.backend,
                if rep.passed() { "PASSED" } else { "FAILED" }
            );
            i32::from(!rep.passed())
        }
        Err(e) => {
            eprintln!("kvq oracle: {e}");
            2
        }
    }
}

/// `kvq bench transfer`: runs `kv_transfer::bench::run`, prints one row per
/// case with its ratio to the raw copy measured in the same run, and writes
/// `{profile, repeats, quick, sweep, rows}` as JSON when asked. `sweep`
/// (GPU profile) runs the gather's launch-knob sweep instead of the rows.
pub fn bench_command(
    profile: Profile,
    repeats: usize,
    quick: bool,
    sweep: bool,
    json: Option<&Path>,
) -> i32 {
    let opts = BenchOpts {
        profile: oracle_profile(profile),
        repeats,
        quick,
        nixl: true,
        sweep,
    };
    let rows = match kv_transfer::bench::run(&opts) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("kvq bench transfer: {e}");
            return 2;
        }
    };
    print!("{}", bench_table(&rows));
    if let Some(path) = json {
        let doc = serde_json::json!({ "profile": opts.profile, "repeats": repeats, "quick": quick, "sweep": sweep, "rows": rows });
        if let Err(e) = std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap_or_default()) {
            eprintln!("kvq bench transfer: cannot write {}: {e}", path.display());
            return 2;
        }
        println!("json: {}", path.display());
    }
    0
}

/// Fixed-width table of benchmark rows.
pub fn bench_table(rows: &[BenchRow]) -> String {
    let mut s = format!(
        "{:<44} {:>12} {:>9} {:>9} {:>7} {:>10}\n",
        "case", "bytes", "GB/s", "raw GB/s", "ratio", "p50 µs"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<44} {:>12} {:>9.2} {:>9.2} {:>7.3} {:>10.1}\n",
            r.name, r.bytes, r.gbps, r.raw_gbps, r.ratio, r.p50_us
        ));
        if let Some(p) = r.phases {
            s.push_str(&format!(
                "  phases µs: host plan {:.1}, host tables {:.1}, upload {:.1}, kernel {:.1} (kernel ratio {:.3})\n",
                p.host_plan_us, p.host_tables_us, p.upload_us, p.kernel_us, p.kernel_ratio
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::section::{self, Section, Status};

    #[test]
    fn cpu_oracle_section_passes_with_every_verdict_check() {
        let s = Section {
            name: "transfer_oracle",
            profiles: &[Profile::Cpu],
            body: oracle_native,
        };
        let ctx = Ctx {
            profile: Profile::Cpu,
            trace_path: "/nonexistent".into(),
            trace_requests: None,
            out_dir: std::env::temp_dir(),
            exe: std::env::current_exe().unwrap(),
            gpus: 0,
        };
        let r = section::run(&s, &ctx);
        assert_eq!(r.status, Status::Passed, "{:#?}", r.checks);
        assert_eq!(r.checks.len(), 7);
        assert!(r.metrics["bytes"].as_u64().unwrap() > 0);
    }

    #[test]
    fn a_failed_verdict_field_fails_its_check() {
        let mut rep = oracle::run(oracle::Profile::Cpu).unwrap();
        rep.false_completion = true;
        let mut r = SectionResult::new("x");
        record_oracle(&rep, &mut r);
        let failed: Vec<_> = r.failed_checks().map(|c| c.name.clone()).collect();
        assert_eq!(failed, ["missing_keys_never_complete", "verdict"]);
    }

    #[test]
    fn bench_table_shows_ratio() {
        let row = BenchRow {
            name: "host_memcpy/scattered/1024x64KiB".into(),
            bytes: 64 << 20,
            blocks: 1024,
            gbps: 5.0,
            raw_gbps: 10.0,
            ratio: 0.5,
            p50_us: 13421.7,
            phases: Some(kv_transfer::bench_sweep::Phases {
                host_plan_us: 12.5,
                host_tables_us: 3.0,
                upload_us: 2.0,
                kernel_us: 40.0,
                kernel_ratio: 0.95,
            }),
            gather_upload: None,
        };
        let t = bench_table(&[row]);
        assert!(
            t.contains("host_memcpy/scattered/1024x64KiB")
                && t.contains("0.500")
                && t.contains("13421.7")
                && t.contains(
                    "host plan 12.5, host tables 3.0, upload 2.0, kernel 40.0 (kernel ratio 0.950)"
                ),
            "{t}"
        );
    }
}
