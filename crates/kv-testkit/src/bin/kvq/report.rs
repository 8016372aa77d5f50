//! Human-readable output of a qualification: the summary table printed at
//! the end of a run, `REPORT.md`, and the TTFT CDF plot (`ttft_cdf.svg`,
//! reuse OFF against ON) once a section produced replay samples.

use std::fmt::Write as _;
use std::path::Path;

use kv_testkit::replay::percentile;
use plotters::prelude::*;

use crate::record::Record;
use crate::section::{Profile, Status, TtftSamples};

/// File name of the TTFT CDF plot inside the output directory.
pub const TTFT_PLOT: &str = "ttft_cdf.svg";

/// Fixed-width table: section, status, checks passed/total, wall time.
pub fn summary_table(r: &Record) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<28} {:<8} {:>9} {:>11}",
        "section", "status", "checks", "time"
    );
    for sec in &r.sections {
        let ok = sec.checks.iter().filter(|c| c.passed).count();
        let _ = writeln!(
            s,
            "{:<28} {:<8} {:>9} {:>9.0}ms",
            sec.name,
            status_word(sec.status),
            format!("{ok}/{}", sec.checks.len()),
            sec.duration_ms
        );
    }
    // A skipped section does not fail the run, but the closing line must not
    // let it pass for a checked one.
    let skipped = r
        .sections
        .iter()
        .filter(|sec| sec.status == Status::Skipped)
        .count();
    let _ = writeln!(
        s,
        "{} in {:.1}s: {} section(s), {skipped} of them skipped, {} failure(s)",
        if r.passed { "PASSED" } else { "FAILED" },
        r.duration_s,
        r.sections.len(),
        r.failures.len()
    );
    s
}

fn status_word(s: Status) -> &'static str {
    match s {
        Status::Passed => "passed",
        Status::Failed => "FAILED",
        Status::Skipped => "skipped",
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Writes `REPORT.md` (and the TTFT plot when replay samples exist) into `dir`.
///
/// # Errors
/// The failed write, naming the file.
pub fn write(r: &Record, dir: &Path) -> Result<(), String> {
    let mut md = String::new();
    let profile = match r.profile {
        Profile::Cpu => "cpu",
        Profile::Gpu => "gpu",
    };
    let _ = writeln!(md, "# Qualification report ({profile} profile)\n");
    let _ = writeln!(
        md,
        "- result: **{}**\n- commit: `{}`{}\n- rustc: `{}`\n- host: `{}`",
        if r.passed { "PASSED" } else { "FAILED" },
        r.git_sha,
        if r.dirty { " (dirty)" } else { "" },
        r.rustc,
        r.host
    );
    if r.devices.is_empty() {
        let _ = writeln!(md, "- devices: none");
    }
    for d in &r.devices {
        let _ = writeln!(
            md,
            "- device {}: {} `{}` ({} MiB, driver {})",
            d.index, d.name, d.uuid, d.memory_mib, d.driver
        );
    }
    let _ = writeln!(md, "- commands:");
    for c in &r.commands {
        let _ = writeln!(md, "  - `{c}`");
    }
    let _ = writeln!(
        md,
        "\n## Sections\n\n| section | status | checks | time (ms) |\n| --- | --- | --- | --- |"
    );
    for s in &r.sections {
        let ok = s.checks.iter().filter(|c| c.passed).count();
        let _ = writeln!(
            md,
            "| {} | {}{} | {ok}/{} | {:.0} |",
            s.name,
            status_word(s.status),
            s.skip_reason
                .as_deref()
                .map(|w| format!(": {w}"))
                .unwrap_or_default(),
            s.checks.len(),
            s.duration_ms
        );
    }
    if !r.failures.is_empty() {
        let _ = writeln!(md, "\n## Failures\n");
        for f in &r.failures {
            let _ = writeln!(md, "- `{}.{}`: {}", f.section, f.check, f.detail);
        }
    }
    for s in r.sections.iter().filter(|s| !s.metrics.is_empty()) {
        let _ = writeln!(md, "\n## {}\n\n| metric | value |\n| --- | --- |", s.name);
        // Tables (the fault rows) get their own section below, not a cell.
        for (k, v) in s.metrics.iter().filter(|(_, v)| !v.is_array()) {
            let _ = writeln!(md, "| {k} | {v} |");
        }
    }
    if !r.faults.is_empty() {
        let _ = writeln!(
            md,
            "\n## Fault table\n\n| fault | expected | runs | fetches | fallbacks | false completions | leaks |\n| --- | --- | --- | --- | --- | --- | --- |"
        );
        for f in &r.faults {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} |",
                f["fault"].as_str().unwrap_or("?"),
                f["expected"].as_str().unwrap_or("?"),
                f["runs"],
                f["fetches"],
                f["fallbacks"],
                f["false_completions"],
                f["leaks"]
            );
        }
        let _ = writeln!(
            md,
            "\n`fetches`: runs whose expected fetch completed with outputs equal to OFF; \
             `fallbacks`: runs that fell back with outputs equal to OFF and the destination \
             untouched. A row passes when both equal `runs` where `expected` requires them \
             (`fetch`: the control rows; `fallback_then_fetch`: no hint while the inventory \
             is damaged, a fetch after the repair) and are 0 elsewhere."
        );
        for s in &r.faults_skipped {
            let _ = writeln!(
                md,
                "- skipped here: `{}` ({})",
                s["fault"].as_str().unwrap_or("?"),
                s["reason"].as_str().unwrap_or("?")
            );
        }
    }
    if let Some(c) = &r.cluster {
        let _ = writeln!(
            md,
            "\n## Local cluster\n\n{} requests through the router service over NATS (2 decode, 2 prefill processes): \
             {} fetches, {} fallbacks, {} false completions, {} leaks; advise round trip p50 {} µs, p99 {} µs.\n\n\
             | fault | fetches after recovery |\n| --- | --- |",
            c["requests"], c["fetches"], c["fallbacks"], c["false_completions"], c["leaks"],
            c["advise_p50_us"], c["advise_p99_us"]
        );
        for x in c["recoveries"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} | {} |",
                x["fault"].as_str().unwrap_or("?"),
                x["fetches_after"]
            );
        }
    }
    let replays: Vec<(&str, &TtftSamples)> = r
        .sections
        .iter()
        .filter_map(|s| s.ttft.as_ref().map(|t| (s.name.as_str(), t)))
        .filter(|(_, t)| !t.off_ms.is_empty() && !t.on_ms.is_empty())
        .collect();
    if !replays.is_empty() {
        let _ = writeln!(
            md,
            "\n## TTFT (reuse OFF vs ON)\n\n![TTFT CDF]({TTFT_PLOT})\n\n| replay | n | OFF p50 | ON p50 | OFF p90 | ON p90 | OFF p99 | ON p99 | p50 OFF/ON |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        for (name, t) in &replays {
            let (off, on) = (sorted(&t.off_ms), sorted(&t.on_ms));
            // Both sample sets are non-empty (filtered above), so `None`
            // cannot occur; NaN would print as such rather than as a figure.
            let q = |v: &[f64], p| percentile(v, p).unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x |",
                off.len(),
                q(&off, 0.5),
                q(&on, 0.5),
                q(&off, 0.9),
                q(&on, 0.9),
                q(&off, 0.99),
                q(&on, 0.99),
                q(&off, 0.5) / q(&on, 0.5)
            );
        }
        let _ = writeln!(md, "\nTimes in ms.");
        ttft_plot(&dir.join(TTFT_PLOT), &replays)?;
    }
    crate::gpu_serving_section::report(r, dir, &mut md)?;
    let path = dir.join("REPORT.md");
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A log-scale axis range over `values`: from `lo_margin` x the smallest
/// positive value (clamped to 1e-3..1e9, so an empty or all-zero series still
/// gives a drawable axis) to `hi_margin` x the largest, and at least one
/// decade wide.
pub fn log_axis(
    values: impl Iterator<Item = f64> + Clone,
    lo_margin: f64,
    hi_margin: f64,
) -> (f64, f64) {
    let lo = values
        .clone()
        .filter(|x| *x > 0.0)
        .fold(f64::INFINITY, f64::min)
        .clamp(1e-3, 1e9)
        * lo_margin;
    let hi = values.fold(0.0_f64, f64::max).max(lo * 10.0) * hi_margin;
    (lo, hi)
}

/// Draws `chart`'s series legend at `position` in this report's style
/// (translucent white box, black border).
pub fn draw_legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
}

/// Empirical CDF of each replay's OFF and ON TTFT samples on one chart.
fn ttft_plot(path: &Path, replays: &[(&str, &TtftSamples)]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let series: Vec<(String, Vec<f64>, RGBColor)> = replays
        .iter()
        .enumerate()
        .flat_map(|(i, (name, t))| {
            let shade = |c: RGBColor| RGBColor(c.0, c.1.saturating_add(60 * i as u8), c.2);
            [
                (format!("{name} OFF"), sorted(&t.off_ms), shade(RED)),
                (format!("{name} ON"), sorted(&t.on_ms), shade(BLUE)),
            ]
        })
        .collect();
    // TTFTs span orders of magnitude (a cached prefix vs a long queue): log x.
    let (x_min, x_max) = log_axis(
        series.iter().flat_map(|(_, v, _)| v.iter().copied()),
        0.9,
        1.1,
    );
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF: reuse OFF vs ON", ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..1.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| err(&e))?;
    for (label, v, color) in series {
        let n = v.len() as f64;
        let points = v
            .iter()
            .enumerate()
            .filter(|(_, x)| **x > 0.0)
            .map(|(i, x)| (*x, (i + 1) as f64 / n));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerRight).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::section::SectionResult;

    #[test]
    fn log_axis_spans_the_positive_values_and_at_least_a_decade() {
        let (lo, hi) = log_axis([0.0, 5.0, 200.0].into_iter(), 0.9, 1.1);
        assert!(
            (lo - 4.5).abs() < 1e-9 && (hi - 220.0).abs() < 1e-9,
            "{lo} {hi}"
        );
        // One value: widened to a decade. No positive value: the clamp's floor.
        let (lo, hi) = log_axis([3.0].into_iter(), 1.0, 1.0);
        assert_eq!((lo, hi), (3.0, 30.0));
        let (lo, hi) = log_axis(std::iter::empty(), 1.0, 1.0);
        assert!((lo - 1e9).abs() < 1.0 && hi >= lo * 10.0, "{lo} {hi}");
    }

    #[test]
    fn report_has_table_failures_percentiles_and_plot() {
        let dir = std::env::temp_dir().join(format!("kvq-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = SectionResult {
            name: "replay".into(),
            status: Status::Failed,
            skip_reason: None,
            duration_ms: 12.0,
            checks: vec![],
            metrics: Default::default(),
            ttft: Some(TtftSamples {
                off_ms: vec![40.0, 10.0, 30.0, 20.0],
                on_ms: vec![5.0, 10.0, 15.0, 20.0],
            }),
            record: None,
        };
        s.check("on_not_slower", false, "p99 ON 20 > 19");
        s.metric("requests", 4);
        let r = Record::new(Profile::Cpu, 0, 0.5, vec![s], Vec::new());
        write(&r, &dir).unwrap();
        let md = std::fs::read_to_string(dir.join("REPORT.md")).unwrap();
        assert!(md.contains("| replay | FAILED | 0/1 | 12 |"), "{md}");
        assert!(
            md.contains("`replay.on_not_slower`: p99 ON 20 > 19"),
            "{md}"
        );
        // OFF p50 = 20, ON p50 = 10 -> 2x.
        assert!(
            md.contains("| replay | 4 | 20.00 | 10.00 |") && md.contains("| 2.00x |"),
            "{md}"
        );
        let svg = std::fs::read_to_string(dir.join(TTFT_PLOT)).unwrap();
        assert!(svg.contains("<svg") && svg.contains("replay OFF") && svg.contains("replay ON"));
        assert!(summary_table(&r)
            .contains("FAILED in 0.5s: 1 section(s), 0 of them skipped, 1 failure(s)"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fault_table_keeps_fetches_and_fallbacks_apart() {
        use kv_testkit::faults::{Expected, FaultRow};
        let dir = std::env::temp_dir().join(format!("kvq-report-faults-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows = vec![
            FaultRow {
                runs: 3,
                fetches: 3,
                ..FaultRow::new("none", Expected::Fetch)
            },
            FaultRow {
                runs: 3,
                fallbacks: 3,
                ..FaultRow::new("rank_part_fails", Expected::Fallback)
            },
        ];
        let mut s = SectionResult {
            name: crate::fault_section::NAME.into(),
            status: Status::Passed,
            skip_reason: None,
            duration_ms: 1.0,
            checks: vec![],
            metrics: Default::default(),
            ttft: None,
            record: None,
        };
        s.check("none", true, "");
        s.metric(
            crate::fault_section::ROWS_METRIC,
            serde_json::to_value(&rows).unwrap(),
        );
        let r = Record::new(Profile::Cpu, 0, 0.5, vec![s], Vec::new());
        assert_eq!(r.faults[0]["fetches"], 3);
        assert_eq!(r.faults[0]["fallbacks"], 0);
        write(&r, &dir).unwrap();
        let md = std::fs::read_to_string(dir.join("REPORT.md")).unwrap();
        assert!(
            md.contains(
                "| fault | expected | runs | fetches | fallbacks | false completions | leaks |"
            ),
            "{md}"
        );
        assert!(md.contains("| none | fetch | 3 | 3 | 0 | 0 | 0 |"), "{md}");
        assert!(
            md.contains("| rank_part_fails | fallback | 3 | 0 | 3 | 0 | 0 |"),
            "{md}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn summary_counts_skipped_sections_apart_from_passed_ones() {
        let section = |name: &str, status| SectionResult {
            name: name.into(),
            status,
            skip_reason: (status == Status::Skipped).then(|| "no NIXL runtime".into()),
            duration_ms: 1.0,
            checks: vec![],
            metrics: Default::default(),
            ttft: None,
            record: None,
        };
        let mut smoke = section("smoke", Status::Passed);
        smoke.check("outputs_equal", true, "");
        let r = Record::new(
            Profile::Cpu,
            0,
            0.5,
            vec![smoke, section("nixl", Status::Skipped)],
            Vec::new(),
        );
        let table = summary_table(&r);
        assert!(
            table.contains("nixl                         skipped"),
            "{table}"
        );
        assert!(
            table.contains("PASSED in 0.5s: 2 section(s), 1 of them skipped, 0 failure(s)"),
            "{table}"
        );
    }
}
