//! The soak: random faults over many fetches, counted.

use super::*;

/// What a soak did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SoakReport {
    /// Seed of the fault sequence.
    pub seed: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Requests served (one per injected run).
    pub requests: u64,
    /// Fetches that completed (control runs and repaired event runs).
    pub fetches: u64,
    /// Runs that fell back as their fault requires.
    pub fallbacks: u64,
    /// Runs whose fetch completed under a fault that forbids it.
    pub false_completions: u64,
    /// Runs whose outputs differed from OFF.
    pub wrong_outputs: u64,
    /// Leaked resources, summed over runs, plus any growth over the whole soak.
    pub leaks: u64,
    /// Runs that failed any check, with their detail (first 20).
    pub failures: Vec<String>,
    /// Per-fault rows (as in the fault table).
    pub per_fault: Vec<FaultRow>,
}

impl SoakReport {
    /// No false completion, no wrong output, no leak, no failed run, at least one request.
    pub fn passed(&self) -> bool {
        self.requests > 0
            && self.false_completions == 0
            && self.wrong_outputs == 0
            && self.leaks == 0
            && self.failures.is_empty()
    }
}

/// Random faults from [`Fault::IN_PROCESS`] (and the donor-process faults
/// when `child` is given, one run in ten) over fresh conversations until
/// `minutes` passed; counts fetches, fallbacks, false completions, wrong
/// outputs and leaks. Deterministic sequence for a seed; never panics.
///
/// ```no_run
/// let r = kv_testkit::faults::soak(0.05, 42);
/// assert!(r.passed(), "{r:?}");
/// ```
pub fn soak(minutes: f64, seed: u64) -> SoakReport {
    soak_with(minutes, seed, None)
}

/// [`soak()`], with the donor-process faults when `child` is given (kvq:
/// `Some(&ChildCommand::current_kvq())`).
pub fn soak_with(minutes: f64, seed: u64, child: Option<&ChildCommand>) -> SoakReport {
    let t0 = Instant::now();
    // Non-finite or negative minutes mean "one request" (kvq refuses them
    // before calling); `from_secs_f64` would panic on infinity.
    let secs = minutes * 60.0;
    let budget = if secs.is_finite() && secs > 0.0 {
        Duration::from_secs_f64(secs.min(1e9))
    } else {
        Duration::ZERO
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let whole = {
        let _g = run_lock();
        kv_bank::leaks::snapshot()
    };
    let mut r = SoakReport {
        seed,
        seconds: 0.0,
        requests: 0,
        fetches: 0,
        fallbacks: 0,
        false_completions: 0,
        wrong_outputs: 0,
        leaks: 0,
        failures: Vec::new(),
        per_fault: Vec::new(),
    };
    let mut rows: HashMap<Fault, FaultRow> = HashMap::new();
    // The link-cut fault joins the donor-process faults where it can run
    // (NIXL runtime, network namespaces); otherwise it would only skip.
    let net_ok = child.is_some() && link_cut::available();
    let mut n = 0u64;
    while t0.elapsed() < budget || n == 0 {
        n += 1;
        let fault = match child {
            Some(_) if rng.gen_range(0..10) == 0 => {
                let pool: &[Fault] = if net_ok {
                    &[
                        Fault::DonorKilledMidTransfer,
                        Fault::SigtermDuringTransfer,
                        Fault::LinkCutMidTransfer,
                    ]
                } else {
                    &[Fault::DonorKilledMidTransfer, Fault::SigtermDuringTransfer]
                };
                pool[rng.gen_range(0..pool.len())]
            }
            _ => Fault::IN_PROCESS[rng.gen_range(0..Fault::IN_PROCESS.len())],
        };
        let run_seed = rng.gen::<u64>();
        let row = rows
            .entry(fault)
            .or_insert_with(|| FaultRow::new(fault.name(), fault.expected()));
        r.requests += 1;
        match run_fault(fault, run_seed, child) {
            Ok(o) => {
                let t = o.tally();
                row.count(t);
                r.fetches += u64::from(o.completed || o.fetched);
                r.fallbacks += u64::from(fault != Fault::None && o.fell_back);
                r.false_completions += u64::from(t.false_completion);
                r.wrong_outputs += u64::from(!o.outputs_match);
                r.leaks += u64::from(t.leaks);
                if !o.passed() {
                    row.detail = format!("{}{}", o.detail, leak_note(&o.leaks));
                    if r.failures.len() < 20 {
                        r.failures.push(format!(
                            "{} seed {run_seed}: {}{}",
                            fault.name(),
                            o.detail,
                            leak_note(&o.leaks)
                        ));
                    }
                }
            }
            Err(e) => {
                row.runs += 1;
                row.detail = format!("setup failed: {e}");
                if r.failures.len() < 20 {
                    r.failures.push(format!(
                        "{} seed {run_seed}: setup failed: {e}",
                        fault.name()
                    ));
                }
            }
        }
    }
    let end = {
        let _g = run_lock();
        kv_bank::leaks::snapshot()
    };
    let growth = end.leaks_since(&whole);
    r.leaks += growth.len() as u64;
    for l in growth {
        if r.failures.len() < 20 {
            r.failures.push(format!("soak-wide leak: {l}"));
        }
    }
    let mut per_fault: Vec<FaultRow> = rows.into_values().collect();
    per_fault.sort_by(|a, b| a.fault.cmp(&b.fault));
    r.per_fault = per_fault;
    r.seconds = t0.elapsed().as_secs_f64();
    r
}
