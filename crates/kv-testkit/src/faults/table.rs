//! The fault table: rows folded from runs, the faults skipped here, and the
//! qualify table with kv-bank's bank-level rows.

use super::*;

/// What a fault row requires of every run; the row's `fetches` and
/// `fallbacks` are compared with it (`record.json` `faults[].expected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expected {
    /// The fetch is refused or abandoned and the request recomputes: every
    /// fault proper, kv-bank's bank-level rows included.
    Fallback,
    /// The fetch completes: the control rows (`none`, `none_gpu`).
    Fetch,
    /// While the inventory is damaged the request gets no hint and
    /// recomputes; after the repair a fetch completes: the event-stream rows
    /// (`*_events`) and `nats_server_restart`.
    FallbackThenFetch,
}

impl Expected {
    /// Rows that require a completed fetch in every run.
    pub fn fetch(self) -> bool {
        matches!(self, Expected::Fetch | Expected::FallbackThenFetch)
    }

    /// Rows that require a fallback in every run.
    pub fn fallback(self) -> bool {
        matches!(self, Expected::Fallback | Expected::FallbackThenFetch)
    }
}

/// One run as a row counts it ([`RunOutcome::tally`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunTally {
    /// The fetch the row expects completed, with outputs equal to OFF.
    pub fetched: bool,
    /// The request fell back: outputs equal to OFF, destination untouched.
    pub fell_back: bool,
    /// A fetch completed where the fault forbids it.
    pub false_completion: bool,
    /// Leaked resources.
    pub leaks: u32,
}

impl RunTally {
    /// The run ended as `expected` requires, with no false completion and no leak.
    pub fn is(&self, expected: Expected) -> bool {
        self.fetched == expected.fetch()
            && self.fell_back == expected.fallback()
            && !self.false_completion
            && self.leaks == 0
    }
}

/// One row of the fault table, as recorded in `record.json` `faults[]`.
/// Each column has one meaning on every row; which counts a row needs is
/// its [`Expected`] (a control row passes with `fetches == runs` and no
/// fallback, an event row with both equal to `runs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FaultRow {
    /// Fault name ([`Fault::name`], a GPU row's name, or a kv-bank row's).
    pub fault: String,
    /// What the row requires of every run.
    pub expected: Expected,
    /// Runs, setup failures included.
    pub runs: u32,
    /// Runs in which the expected fetch completed with outputs equal to OFF
    /// (always 0 on [`Expected::Fallback`] rows: a completion there is a
    /// false completion).
    pub fetches: u32,
    /// Runs that fell back with outputs equal to OFF and the destination
    /// untouched (for event rows: no hint while the inventory was damaged).
    pub fallbacks: u32,
    /// Runs whose fetch completed under a fault that forbids it.
    pub false_completions: u32,
    /// Leaked resources, summed over runs (see [`kv_bank::leaks`]).
    pub leaks: u32,
    /// What was observed (the first run's, or the last failed run's), for the report.
    pub detail: String,
}

impl FaultRow {
    /// A row named `fault` with nothing run yet.
    pub fn new(fault: &str, expected: Expected) -> Self {
        Self {
            fault: fault.into(),
            expected,
            runs: 0,
            fetches: 0,
            fallbacks: 0,
            false_completions: 0,
            leaks: 0,
            detail: String::new(),
        }
    }

    /// Counts one run that was set up and ran.
    pub fn count(&mut self, t: RunTally) {
        self.runs += 1;
        self.fetches += u32::from(t.fetched);
        self.fallbacks += u32::from(t.fell_back);
        self.false_completions += u32::from(t.false_completion);
        self.leaks += t.leaks;
    }

    /// At least one run, every run fetched and fell back as [`Expected`]
    /// requires, no false completion, nothing leaked.
    pub fn passed(&self) -> bool {
        let want = |required: bool| if required { self.runs } else { 0 };
        self.runs > 0
            && self.fetches == want(self.expected.fetch())
            && self.fallbacks == want(self.expected.fallback())
            && self.false_completions == 0
            && self.leaks == 0
    }
}

/// kv-bank's bank-level rows: every one requires a fallback (a refusal with
/// no effect) and none has a fetch.
impl From<kv_bank::FaultRow> for FaultRow {
    fn from(r: kv_bank::FaultRow) -> Self {
        Self {
            fault: r.fault,
            expected: Expected::Fallback,
            runs: r.runs,
            fetches: 0,
            fallbacks: r.fallbacks,
            false_completions: r.false_completions,
            leaks: r.leaks,
            detail: r.detail,
        }
    }
}

/// A fault that could not run here, and why (`record.json` `faults_skipped`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SkippedFault {
    /// Row name ([`Fault::name`]).
    pub fault: String,
    /// What was missing (e.g. no `nats-server`, no network namespaces).
    pub reason: String,
}

/// Rows of the faults that ran and the faults that could not run here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultTable {
    /// One row per fault that ran.
    pub rows: Vec<FaultRow>,
    /// Faults left out ([`FaultError::Skipped`]).
    pub skipped: Vec<SkippedFault>,
}

/// Runs each fault `runs` times (seeds `seed..seed+runs`) and folds the
/// outcomes into rows. A fault that cannot run here ([`FaultError::Skipped`])
/// is left out (see [`fault_table_rows`] to keep the reason); a setup error
/// is a row with no fallback and the error as detail.
pub fn fault_rows(
    faults: &[Fault],
    runs: u32,
    seed: u64,
    child: Option<&ChildCommand>,
) -> Vec<FaultRow> {
    fault_table_rows(faults, runs, seed, child).rows
}

/// [`fault_rows`], also returning the faults that were skipped and why.
pub fn fault_table_rows(
    faults: &[Fault],
    runs: u32,
    seed: u64,
    child: Option<&ChildCommand>,
) -> FaultTable {
    let mut table = FaultTable::default();
    let rows = &mut table.rows;
    for &f in faults {
        let mut row = FaultRow::new(f.name(), f.expected());
        let mut skipped = None;
        for i in 0..runs {
            match run_fault(f, seed.wrapping_add(u64::from(i)), child) {
                Ok(o) => {
                    row.count(o.tally());
                    if row.detail.is_empty() || !o.passed() {
                        row.detail = format!("{}{}", o.detail, leak_note(&o.leaks));
                    }
                }
                Err(FaultError::Skipped(r)) => {
                    skipped = Some(r);
                    break;
                }
                Err(e) => {
                    row.runs += 1;
                    row.detail = format!("setup failed: {e}");
                }
            }
        }
        match skipped {
            None => rows.push(row),
            Some(reason) => {
                eprintln!("fault {}: skipped: {reason}", f.name());
                table.skipped.push(SkippedFault {
                    fault: f.name().into(),
                    reason,
                });
            }
        }
    }
    table
}

pub(super) fn leak_note(leaks: &[String]) -> String {
    if leaks.is_empty() {
        String::new()
    } else {
        format!("; leaks: {}", leaks.join(", "))
    }
}

/// The fault table of `qualify` with the donor child started as
/// `kvq child ...` from the running executable (call it from kvq): every
/// [`Fault`] (1 run each when `quick`, else 3; donor-process faults 1 / 2)
/// followed by kv-bank's bank-level rows ([`kv_bank::qualify_faults`]).
/// In `record.json` as `faults[{fault, expected, runs, fetches, fallbacks,
/// false_completions, leaks, detail}]` ([`FaultRow`]).
pub fn fault_table(quick: bool) -> Vec<FaultRow> {
    fault_table_with(quick, &ChildCommand::current_kvq()).rows
}

/// [`fault_table`] with an explicit child command (its `exe` followed by
/// `child bank-lease-owner` must reach kv-bank's child too), keeping the
/// faults that could not run here.
pub fn fault_table_with(quick: bool, child: &ChildCommand) -> FaultTable {
    let (runs, child_runs) = if quick { (1, 1) } else { (3, 2) };
    let (with_child, alone): (Vec<Fault>, Vec<Fault>) =
        Fault::ALL.iter().partition(|f| f.needs_child());
    let mut table = fault_table_rows(&with_child, child_runs, 1, Some(child));
    let rest = fault_table_rows(&alone, runs, 1, Some(child));
    table.rows.extend(rest.rows);
    table.skipped.extend(rest.skipped);
    let _guard = run_lock();
    table.rows.extend(
        kv_bank::qualify_faults(&child.exe, &["child".to_string()])
            .into_iter()
            .map(FaultRow::from),
    );
    table
}
