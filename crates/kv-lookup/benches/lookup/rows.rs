//! Result rows: one metric of kv-lookup against one dynamo indexer, and
//! the drivers that produce them per workload.

use kv_lookup::LookupBudget;

use crate::{concurrent, flash, run_dynamo, run_ours, Args, Block, Measured, Op};

pub(crate) struct Row {
    pub(crate) name: String,
    /// Which dynamo indexer the row compares against.
    pub(crate) vs: &'static str,
    pub(crate) ours: f64,
    pub(crate) dynamo: f64,
    pub(crate) unit: &'static str,
    pub(crate) ratio: f64,
}

fn rows_for(
    prefix: &str,
    vs: &'static str,
    ours: &mut Measured,
    dynamo: &mut Measured,
) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut row = |name: String, ours: f64, dynamo: f64, unit, ratio| {
        rows.push(Row {
            name,
            vs,
            ours,
            dynamo,
            unit,
            ratio,
        })
    };
    for (label, p) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
        let (o, d) = (ours.pct(p), dynamo.pct(p));
        row(format!("{prefix} lookup {label}"), o, d, "us", d / o);
    }
    let (o, d) = (ours.events_per_s(), dynamo.events_per_s());
    row(
        format!("{prefix} apply stored blocks"),
        o,
        d,
        "blocks/s",
        o / d,
    );
    if ours.removed_blocks > 0 {
        let (o, d) = (ours.removals_per_s(), dynamo.removals_per_s());
        row(
            format!("{prefix} apply removed blocks"),
            o,
            d,
            "blocks/s",
            o / d,
        );
    }
    rows
}

/// Single-threaded rows of one workload against every dynamo indexer.
pub(crate) fn single_rows<'a, F, I>(prefix: &str, ops: F, capacity: usize) -> Vec<Row>
where
    F: Fn() -> I,
    I: Iterator<Item = Op<'a>>,
{
    let mut ours = run_ours(ops(), capacity);
    println!(
        "{prefix}: ours: {}; {} lookups, donor found in {}, {} budget-exhausted, {:.1} probes avg",
        ours.note,
        ours.lookups_ns.len(),
        ours.found,
        ours.exhausted,
        ours.probes as f64 / ours.lookups_ns.len().max(1) as f64,
    );
    let mut rows = Vec::new();
    for (vs, mut d) in [
        ("RadixTree", run_dynamo(ops())),
        ("CRTC-pool", flash::run_crtc(ops())),
        ("Positional", flash::run_positional(ops())),
    ] {
        println!("{prefix}: dynamo {vs}: {}; matched {}", d.note, d.found);
        rows.extend(rows_for(prefix, vs, &mut ours, &mut d));
    }
    rows
}

/// Concurrent rows of one workload for each `T+E` of `args`.
pub(crate) fn concurrent_rows<'a, F, I>(
    prefix: &str,
    args: &Args,
    ops: F,
    capacity: usize,
    requests: &[(usize, Vec<Block>)],
) -> Vec<Row>
where
    F: Fn() -> I,
    I: Iterator<Item = Op<'a>>,
{
    let budget = LookupBudget::default();
    let mut rows = Vec::new();
    for &(t, e) in &args.threads {
        let chains = concurrent::churn_chains(e, 7 + e as u64);
        let secs = args.seconds;
        let ours = concurrent::ours(ops(), capacity, requests, &chains, t, e, secs, budget);
        // The budget guarantee under load: never more probes than allowed
        // (a lookup the OS deschedules past its time budget is flagged
        // `budget_exhausted`, which is allowed and counted).
        assert!(ours.max_probes <= budget.max_probes);
        for (vs, d) in [
            (
                "CRTC-pool",
                concurrent::crtc_pool(ops(), requests, &chains, t, e, secs),
            ),
            (
                "Positional",
                concurrent::positional(ops(), requests, &chains, t, e, secs),
            ),
        ] {
            let name = |m: &str| format!("{prefix} T{t}+E{e} {m}");
            let (oc, dc) = (
                ours.lookups_per_s + ours.events_per_s,
                d.lookups_per_s + d.events_per_s,
            );
            for (m, o, dv, unit, ratio) in [
                (
                    "lookups/s",
                    ours.lookups_per_s,
                    d.lookups_per_s,
                    "1/s",
                    ours.lookups_per_s / d.lookups_per_s,
                ),
                (
                    "events/s",
                    ours.events_per_s,
                    d.events_per_s,
                    "1/s",
                    ours.events_per_s / d.events_per_s,
                ),
                ("lookups+events/s", oc, dc, "1/s", oc / dc),
                (
                    "lookup p99 under load",
                    ours.p99_us,
                    d.p99_us,
                    "us",
                    d.p99_us / ours.p99_us,
                ),
            ] {
                rows.push(Row {
                    name: name(m),
                    vs,
                    ours: o,
                    dynamo: dv,
                    unit,
                    ratio,
                });
            }
        }
        println!(
            "{prefix} T{t}+E{e}: ours {:.0} lookups/s, {:.0} events/s, p99 {:.2} us, max probes {} (budget {}), {} lookups flagged budget-exhausted",
            ours.lookups_per_s, ours.events_per_s, ours.p99_us, ours.max_probes, budget.max_probes, ours.exhausted
        );
    }
    rows
}
