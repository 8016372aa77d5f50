//! Qualification sections: what one section reports, and running one so that
//! neither an error nor a panic inside it can stop the others or pass silently.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

/// Qualification profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Host memory and POSIX shared memory; runs anywhere.
    Cpu,
    /// CUDA device memory, CUDA IPC and NIXL VRAM; a missing GPU is a failure.
    Gpu,
}

impl std::fmt::Display for Profile {
    /// `cpu` / `gpu`, as on the command line and in `record.json`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
        })
    }
}

/// What every section gets.
#[derive(Debug, Clone)]
// `profile` and `out_dir` are for sections that differ by profile or write
// artifacts (replay traces); not every build has one.
#[allow(dead_code)]
pub struct Ctx {
    /// Profile of this run.
    pub profile: Profile,
    /// Mooncake JSONL trace to replay / expand.
    pub trace_path: PathBuf,
    /// Use only the first N trace requests (all when `None`).
    pub trace_requests: Option<usize>,
    /// Output directory (sections may write artifacts next to the record).
    pub out_dir: PathBuf,
    /// This executable, for sections that start child processes (`kvq child ...`).
    pub exe: PathBuf,
    /// GPUs `nvidia-smi` listed when the run started (probed once, also written
    /// to the record).
    pub gpus: u32,
}

/// Outcome of a section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every check passed (and there was at least one).
    Passed,
    /// A check failed, the section returned an error, panicked, or checked nothing.
    Failed,
    /// Not applicable here, with a reason (never used to hide a failure).
    Skipped,
}

/// One named pass/fail observation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Short snake_case name, unique within its section.
    pub name: String,
    /// True when the observed behaviour matched the expectation.
    pub passed: bool,
    /// What was observed (values, counts), for the record and the report.
    pub detail: String,
}

/// TTFT samples of one replay, in milliseconds, one per request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TtftSamples {
    /// Reuse disabled (baseline: every prefix recomputed).
    pub off_ms: Vec<f64>,
    /// Reuse enabled.
    pub on_ms: Vec<f64>,
}

/// Everything one section reports.
#[derive(Debug, Clone, Serialize)]
pub struct SectionResult {
    /// Section name (`descriptor_wire`, `bank_lifecycle`, ...).
    pub name: String,
    /// Outcome, derived from the checks by [`run`].
    pub status: Status,
    /// Why the section was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip_reason: Option<String>,
    /// Wall time in milliseconds.
    pub duration_ms: f64,
    /// Checks in the order run.
    pub checks: Vec<Check>,
    /// Counts, bytes and timings (units in the key: `_bytes`, `_us`, `_ms`).
    pub metrics: BTreeMap<String, serde_json::Value>,
    /// TTFT samples when the section replays requests OFF and ON.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft: Option<TtftSamples>,
    /// This section's entry at the top level of `record.json` (`oracle`,
    /// `serving_smoke`, `trace_replay`, `session_replay`), in the record's
    /// fixed field names; lifted there by `Record::new`, not repeated here.
    #[serde(skip)]
    pub record: Option<serde_json::Value>,
}

impl SectionResult {
    /// An empty result (status `failed` until [`run`] derives it).
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            status: Status::Failed,
            skip_reason: None,
            duration_ms: 0.0,
            checks: Vec::new(),
            metrics: BTreeMap::new(),
            ttft: None,
            record: None,
        }
    }

    /// Records a check.
    pub fn check(&mut self, name: impl Into<String>, passed: bool, detail: impl Into<String>) {
        self.checks.push(Check {
            name: name.into(),
            passed,
            detail: detail.into(),
        });
    }

    /// Records a metric (overwrites one of the same key).
    pub fn metric(&mut self, key: &str, value: impl Into<serde_json::Value>) {
        self.metrics.insert(key.to_owned(), value.into());
    }

    /// Checks that failed.
    pub fn failed_checks(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.passed)
    }
}

/// How a section body ends besides returning normally.
#[derive(Debug, Clone, PartialEq, Eq)]
// `Skip` is for sections whose runtime (NIXL, nats-server) may be absent
// outside CI; which sections use it depends on what has landed.
#[allow(dead_code)]
pub enum Stop {
    /// The section could not run to completion: recorded as a failed check `error`.
    Error(String),
    /// The section does not apply here: status `skipped` with this reason.
    Skip(String),
}

/// A section body.
pub type Body = fn(&Ctx, &mut SectionResult) -> Result<(), Stop>;

/// A named section and the profiles it runs in.
#[derive(Debug, Clone, Copy)]
pub struct Section {
    /// Name in the record and the summary.
    pub name: &'static str,
    /// Profiles that include it.
    pub profiles: &'static [Profile],
    /// The body.
    pub body: Body,
}

/// Runs one section: an `Err(Stop::Error)` or a panic becomes a failed check,
/// and a section that recorded no check fails (it proved nothing).
pub fn run(section: &Section, ctx: &Ctx) -> SectionResult {
    let mut r = SectionResult::new(section.name);
    let t0 = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(|| (section.body)(ctx, &mut r)));
    r.duration_ms = t0.elapsed().as_secs_f64() * 1e3;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(Stop::Skip(reason))) => {
            r.status = Status::Skipped;
            r.skip_reason = Some(reason);
            return r;
        }
        Ok(Err(Stop::Error(e))) => r.check("error", false, e),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            r.check("panic", false, msg);
        }
    }
    if r.checks.is_empty() {
        r.check("ran_checks", false, "section recorded no check");
    }
    r.status = if r.checks.iter().all(|c| c.passed) {
        Status::Passed
    } else {
        Status::Failed
    };
    r
}

/// A CPU-profile context over the head (`requests`) of the project's trace,
/// for section tests.
#[cfg(test)]
pub fn test_ctx(requests: usize) -> Ctx {
    Ctx {
        profile: Profile::Cpu,
        trace_path: kv_testkit::trace::default_trace_path(),
        trace_requests: Some(requests),
        out_dir: std::env::temp_dir(),
        exe: std::env::current_exe().expect("the test binary has a path"),
        gpus: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx {
            profile: Profile::Cpu,
            trace_path: PathBuf::from("/nonexistent"),
            trace_requests: None,
            out_dir: std::env::temp_dir(),
            exe: PathBuf::from("/nonexistent"),
            gpus: 0,
        }
    }

    fn section(body: Body) -> Section {
        Section {
            name: "t",
            profiles: &[Profile::Cpu],
            body,
        }
    }

    #[test]
    fn status_follows_checks_errors_panics_and_skips() {
        let pass = run(
            &section(|_, r| {
                r.check("a", true, "1");
                Ok(())
            }),
            &ctx(),
        );
        assert_eq!(pass.status, Status::Passed);

        let fail = run(
            &section(|_, r| {
                r.check("a", true, "1");
                r.check("b", false, "2");
                Ok(())
            }),
            &ctx(),
        );
        assert_eq!(fail.status, Status::Failed);
        assert_eq!(
            fail.failed_checks()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>(),
            ["b"]
        );

        let empty = run(&section(|_, _| Ok(())), &ctx());
        assert_eq!(
            (empty.status, empty.checks[0].name.as_str()),
            (Status::Failed, "ran_checks")
        );

        let err = run(&section(|_, _| Err(Stop::Error("boom".into()))), &ctx());
        assert_eq!(
            (err.status, err.checks[0].detail.as_str()),
            (Status::Failed, "boom")
        );

        let panicked = run(&section(|_, _| panic!("kaput {}", 7)), &ctx());
        assert_eq!(
            (panicked.status, panicked.checks[0].detail.as_str()),
            (Status::Failed, "kaput 7")
        );

        let skipped = run(&section(|_, _| Err(Stop::Skip("no gpu".into()))), &ctx());
        assert_eq!(
            (skipped.status, skipped.skip_reason.as_deref()),
            (Status::Skipped, Some("no gpu"))
        );
    }
}
