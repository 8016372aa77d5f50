//! The fault table: rows folded from runs, the faults skipped here, and the
//! qualify table with kv-bank's bank-level rows.

use super::*;

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

/// A row named `fault` with nothing run yet.
pub(super) fn empty_row(fault: &str) -> FaultRow {
    FaultRow {
        fault: fault.into(),
        runs: 0,
        fallbacks: 0,
        false_completions: 0,
        leaks: 0,
        detail: String::new(),
    }
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
        let mut row = empty_row(f.name());
        let mut skipped = None;
        for i in 0..runs {
            match run_fault(f, seed.wrapping_add(u64::from(i)), child) {
                Ok(o) => {
                    row.runs += 1;
                    // For the control row a completion is the expected end.
                    if o.passed() {
                        row.fallbacks += 1;
                    }
                    if o.completed && f != Fault::None {
                        row.false_completions += 1;
                    }
                    row.leaks += o.leaks.len() as u32;
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
/// In `record.json` as `faults[{fault, runs, fallbacks, false_completions, leaks}]`.
/// For the control row `none` and the event-stream rows, `fallbacks` counts
/// runs that ended as required (completed correctly; repaired).
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
    table
        .rows
        .extend(kv_bank::qualify_faults(&child.exe, &["child".to_string()]));
    table
}
