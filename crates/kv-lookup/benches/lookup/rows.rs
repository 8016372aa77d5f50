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

/// The four concurrent metrics of one load: (name, value, unit, higher is
/// better).
fn metrics(l: &concurrent::Load) -> [(&'static str, f64, &'static str, bool); 4] {
    [
        ("lookups/s", l.lookups_per_s, "1/s", true),
        ("events/s", l.events_per_s, "1/s", true),
        (
            "lookups+events/s",
            l.lookups_per_s + l.events_per_s,
            "1/s",
            true,
        ),
        ("lookup p99 under load", l.p99_us, "us", false),
    ]
}

/// `ours / dynamo` for rates, `dynamo / ours` for latencies.
fn ratio(ours: f64, dynamo: f64, higher_better: bool) -> f64 {
    if higher_better {
        ours / dynamo
    } else {
        dynamo / ours
    }
}

/// Concurrent rows of one workload for each `T+E` of `args`.
///
/// Ours runs twice per `T+E`, with the same events: per event (rows
/// `... T1+E1 lookups/s` etc., against each dynamo indexer: the strict
/// contract, each event visible when its `apply_event` returns) and batched
/// (rows `... T1+E1 batched lookups/s` etc., against the best dynamo indexer
/// of each metric: crtc-pool's contract, events visible [`concurrent::BATCH`]
/// at a time). Both are printed with their ratio against the best dynamo
/// indexer.
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
    use concurrent::Publish;
    let budget = LookupBudget::default();
    let mut rows = Vec::new();
    for &(t, e) in &args.threads {
        let chains = concurrent::churn_chains(e, 7 + e as u64);
        let secs = args.seconds;
        let run_ours = |publish| {
            let l = concurrent::ours(
                ops(),
                capacity,
                requests,
                &chains,
                t,
                e,
                secs,
                budget,
                publish,
            );
            // The budget guarantee under load: never more probes than allowed
            // (a lookup the OS deschedules past its time budget is flagged
            // `budget_exhausted`, which is allowed and counted).
            assert!(l.max_probes <= budget.max_probes);
            l
        };
        let ours = run_ours(Publish::PerEvent);
        let batched = run_ours(Publish::Batched);
        let dynamo = [
            (
                "CRTC-pool",
                concurrent::crtc_pool(ops(), requests, &chains, t, e, secs),
            ),
            (
                "Positional",
                concurrent::positional(ops(), requests, &chains, t, e, secs),
            ),
        ];
        let name = |m: &str| format!("{prefix} T{t}+E{e} {m}");
        for (vs, d) in &dynamo {
            for ((m, o, unit, hi), (_, dv, _, _)) in metrics(&ours).into_iter().zip(metrics(d)) {
                rows.push(Row {
                    name: name(m),
                    vs,
                    ours: o,
                    dynamo: dv,
                    unit,
                    ratio: ratio(o, dv, hi),
                });
            }
        }
        // Per metric, the best dynamo indexer's value and name.
        let best: Vec<(&'static str, f64)> = (0..4)
            .map(|i| {
                let hi = metrics(&ours)[i].3;
                dynamo
                    .iter()
                    .map(|(vs, d)| (*vs, metrics(d)[i].1))
                    .reduce(|a, b| {
                        let better = if hi { b.1 > a.1 } else { b.1 < a.1 };
                        if better {
                            b
                        } else {
                            a
                        }
                    })
                    .expect("dynamo indexers")
            })
            .collect();
        for ((m, o, unit, hi), &(vs, dv)) in metrics(&batched).into_iter().zip(&best) {
            rows.push(Row {
                name: name(&format!("batched {m}")),
                vs,
                ours: o,
                dynamo: dv,
                unit,
                ratio: ratio(o, dv, hi),
            });
        }
        for (label, l) in [
            ("per event (visible when apply_event returns)", &ours),
            (
                "batched (64 per apply_events, visible per batch, as crtc-pool)",
                &batched,
            ),
        ] {
            let m = metrics(l);
            println!(
                "{prefix} T{t}+E{e}: ours {label}: {:.0} lookups/s, {:.0} events/s, p99 {:.2} us, max probes {} (budget {}), {} lookups flagged budget-exhausted",
                l.lookups_per_s, l.events_per_s, l.p99_us, l.max_probes, budget.max_probes, l.exhausted
            );
            let vs_best: Vec<String> = m
                .iter()
                .zip(&best)
                .map(|((name, o, _, hi), (vs, dv))| {
                    format!("{name} {:.2}x {vs}", ratio(*o, *dv, *hi))
                })
                .collect();
            println!(
                "    against the best dynamo indexer: {}",
                vs_best.join(", ")
            );
        }
    }
    rows
}
