//! Section `faults`: the fault matrix of issue #11
//! (`kv_testkit::faults::fault_table`: donor killed / SIGTERMed mid-transfer,
//! cancellation at each stage, deadline, failing rank, missing keys, stale
//! generation, allocation failure, damaged event streams, NATS restart)
//! followed by kv-bank's bank-level rows, and on the GPU profile the device
//! rows of `kv_testkit::faults::gpu` (CUDA device banks and destination
//! rows, CUDA IPC; `*_gpu`). Donor children are this binary
//! (`kvq child fault-donor ...`, `kvq child fault-donor-gpu ...`,
//! `kvq child bank-lease-owner ...`).
//!
//! Each row is one check (every run fetched and fell back as the row's
//! `expected` requires, none falsely completed, nothing leaked); the rows themselves go to `record.json` as the metric
//! [`ROWS_METRIC`], which the record lifts to its top-level `faults[]`.

use kv_testkit::faults::{
    fault_table_with, gpu, ChildCommand, Expected, FaultError, FaultRow, FaultTable,
};

use crate::section::{Ctx, Profile, SectionResult, Stop};

/// Section name.
pub const NAME: &str = "faults";
/// Metric holding the rows (`[{fault, expected, runs, fetches, fallbacks,
/// false_completions, leaks, detail}]`, `kv_testkit::faults::FaultRow`).
pub const ROWS_METRIC: &str = "rows";
/// Metric holding the faults that could not run here (`[{fault, reason}]`).
pub const SKIPPED_METRIC: &str = "skipped";

/// The section body: the full table (3 runs per in-process fault, 2 per
/// donor-process fault), about 15-30 s.
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let FaultTable { mut rows, skipped } = fault_table_with(false, &ChildCommand::kvq(&ctx.exe));
    if ctx.profile == Profile::Gpu {
        gpu_rows(ctx, r, &mut rows);
    }
    print!("{}", table(&rows));
    for s in &skipped {
        println!("skipped here: {} ({})", s.fault, s.reason);
    }
    for row in &rows {
        r.check(
            row.fault.as_str(),
            row.passed(),
            format!(
                "expected {}: {} runs, {} fetches, {} fallbacks, {} false completions, {} leaks: {}",
                expected_name(row.expected),
                row.runs,
                row.fetches,
                row.fallbacks,
                row.false_completions,
                row.leaks,
                row.detail
            ),
        );
    }
    let json = serde_json::to_value(&rows).map_err(|e| Stop::Error(format!("rows: {e}")))?;
    r.metric(ROWS_METRIC, json);
    let skipped =
        serde_json::to_value(&skipped).map_err(|e| Stop::Error(format!("skipped: {e}")))?;
    r.metric(SKIPPED_METRIC, skipped);
    r.metric("faults_run", rows.len() as u64);
    Ok(())
}

/// GPU profile only: the device rows (`kv_testkit::faults::gpu`: donor
/// killed mid-transfer over CUDA IPC, cancel and deadline with device
/// destination rows, control), appended to `rows`; every run with its device
/// free bytes goes to the metric `gpu_runs` (warm-ups to `gpu_warmup`). A
/// GPU profile without a usable GPU is a failed check, not a skip.
fn gpu_rows(ctx: &Ctx, r: &mut SectionResult, rows: &mut Vec<FaultRow>) {
    match gpu::gpu_fault_table(false, &gpu::child_command(&ctx.exe)) {
        Ok(t) => {
            println!(
                "GPU fault rows on {:?}: {}",
                t.ordinals,
                t.devices.join(", ")
            );
            for o in t.warmup.iter().chain(&t.runs) {
                println!(
                    "  {} seed {} passed {}: {}{}",
                    o.fault,
                    o.seed,
                    o.passed(),
                    gpu::summary(o),
                    if o.leaks.is_empty() {
                        String::new()
                    } else {
                        format!("; leaks: {}", o.leaks.join(", "))
                    }
                );
            }
            r.metric("gpu_devices", t.devices.clone());
            r.metric(
                "gpu_runs",
                serde_json::to_value(&t.runs).unwrap_or_default(),
            );
            r.metric(
                "gpu_warmup",
                serde_json::to_value(&t.warmup).unwrap_or_default(),
            );
            rows.extend(t.rows);
        }
        Err(FaultError::Skipped(reason)) => r.check(
            "gpu_rows",
            false,
            format!("GPU profile without a GPU: {reason}"),
        ),
        Err(e) => r.check("gpu_rows", false, format!("GPU rows not run: {e}")),
    }
}

/// `expected` as `record.json` spells it (`fallback`, `fetch`, `fallback_then_fetch`).
pub fn expected_name(e: Expected) -> String {
    serde_json::to_value(e)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The fault table as printed (fixed-width columns, the record's names).
pub fn table(rows: &[FaultRow]) -> String {
    let line = |f: &str, e: &str, runs: &str, fetches: &str, fallbacks: &str, fc: &str, l: &str| {
        format!("{f:<30} {e:<19} {runs:>5} {fetches:>7} {fallbacks:>9} {fc:>17} {l:>5}\n")
    };
    let mut s = line(
        "fault",
        "expected",
        "runs",
        "fetches",
        "fallbacks",
        "false_completions",
        "leaks",
    );
    for r in rows {
        s.push_str(&line(
            &r.fault,
            &expected_name(r.expected),
            &r.runs.to_string(),
            &r.fetches.to_string(),
            &r.fallbacks.to_string(),
            &r.false_completions.to_string(),
            &r.leaks.to_string(),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(fault: &str, expected: Expected, counts: [u32; 3]) -> FaultRow {
        FaultRow {
            runs: counts[0],
            fetches: counts[1],
            fallbacks: counts[2],
            ..FaultRow::new(fault, expected)
        }
    }

    #[test]
    fn table_has_one_line_per_row_and_the_record_columns() {
        let rows = vec![
            row("rank_part_fails", Expected::Fallback, [3, 0, 3]),
            row("none", Expected::Fetch, [3, 3, 0]),
            row("gapped_events", Expected::FallbackThenFetch, [3, 3, 3]),
        ];
        let t = table(&rows);
        let lines: Vec<Vec<&str>> = t.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(
            lines,
            [
                vec![
                    "fault",
                    "expected",
                    "runs",
                    "fetches",
                    "fallbacks",
                    "false_completions",
                    "leaks"
                ],
                vec!["rank_part_fails", "fallback", "3", "0", "3", "0", "0"],
                // The control row's completions are fetches, not fallbacks.
                vec!["none", "fetch", "3", "3", "0", "0", "0"],
                vec![
                    "gapped_events",
                    "fallback_then_fetch",
                    "3",
                    "3",
                    "3",
                    "0",
                    "0"
                ],
            ]
        );
        assert!(rows.iter().all(FaultRow::passed), "{rows:?}");
    }

    #[test]
    fn a_row_passes_only_with_the_counts_its_expectation_needs() {
        // A control row counting its completions as fallbacks (the old
        // table) or an event row without its repair fetch fails.
        assert!(!row("none", Expected::Fetch, [3, 0, 3]).passed());
        assert!(!row("gapped_events", Expected::FallbackThenFetch, [3, 0, 3]).passed());
        assert!(!row("rank_part_fails", Expected::Fallback, [3, 1, 3]).passed());
        assert!(!row("rank_part_fails", Expected::Fallback, [0, 0, 0]).passed());
    }
}
