//! `cargo xtask fuzz --seconds N [--target NAME]...`: runs the cargo-fuzz
//! targets of `fuzz/` (the standalone kv-descriptor fuzz crate) for a fixed
//! time each and reports runs executed and new crash artifacts per target.
//!
//! Owns: choosing the toolchain cargo-fuzz runs on, installing cargo-fuzz when
//! missing, the per-target run over the committed corpus `fuzz/corpus/<target>`,
//! and reading libFuzzer's run count. Crash inputs land in
//! `fuzz/artifacts/<target>/`, which `cargo test -p kv-descriptor --test
//! decoder_robustness` replays on stable, so a crash stays a failing test.
//!
//! Toolchain: cargo-fuzz passes `-Z` flags (sanitizer, coverage options).
//! When rustup lists a nightly toolchain, `cargo +nightly fuzz` runs; else the
//! default (stable) toolchain runs with `RUSTC_BOOTSTRAP=1`, which makes rustc
//! and cargo accept those flags.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::command;
use crate::error::{Result, XtaskError};
use crate::workspace;

/// The replay that turns a crash artifact into a failing stable test.
pub const REPLAY_COMMAND: &str = "cargo test -p kv-descriptor --test decoder_robustness";

/// How cargo-fuzz gets a compiler that accepts `-Z` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toolchain {
    /// `cargo +nightly fuzz ...` (a rustup nightly toolchain is installed).
    Nightly,
    /// `RUSTC_BOOTSTRAP=1 cargo fuzz ...` on the default toolchain.
    StableBootstrap,
}

impl Toolchain {
    /// Nightly when `rustup toolchain list` names one, else stable + bootstrap.
    pub fn detect() -> Self {
        let list = command::capture(Command::new("rustup").args(["toolchain", "list"]));
        match list {
            Ok(l) if lists_nightly(&l) => Self::Nightly,
            _ => Self::StableBootstrap,
        }
    }

    /// `cargo [+nightly] fuzz` through the rustup proxy on `PATH` (not
    /// `$CARGO`, which names the stable cargo binary and ignores `+nightly`).
    fn cargo_fuzz(self) -> Command {
        let mut c = Command::new("cargo");
        c.current_dir(workspace::root());
        match self {
            Self::Nightly => {
                c.arg("+nightly");
            }
            Self::StableBootstrap => {
                c.env("RUSTC_BOOTSTRAP", "1");
            }
        }
        c.arg("fuzz");
        c
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Nightly => "rustup nightly toolchain (cargo +nightly fuzz)",
            Self::StableBootstrap => "default toolchain with RUSTC_BOOTSTRAP=1",
        }
    }
}

/// True when `rustup toolchain list` output has a `nightly...` toolchain.
fn lists_nightly(list: &str) -> bool {
    list.lines().any(|l| l.trim_start().starts_with("nightly"))
}

/// The fuzz crate: `<root>/fuzz`.
pub fn fuzz_dir() -> PathBuf {
    workspace::root().join("fuzz")
}

/// Target names: the `*.rs` stems in `<fuzz>/fuzz_targets`, sorted.
///
/// # Errors
/// The folder cannot be read.
pub fn available_targets(fuzz: &Path) -> Result<Vec<String>> {
    let dir = fuzz.join("fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(XtaskError::io(&dir))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_owned()))
        .collect();
    names.sort();
    Ok(names)
}

/// Checks the arguments and returns the targets to run, in order, before
/// anything runs: `seconds` must be at least 1 and every requested target must
/// exist (none requested = all of `available`).
///
/// # Errors
/// [`XtaskError::Usage`] naming the flag and the bad value.
pub fn select(seconds: u64, requested: &[String], available: &[String]) -> Result<Vec<String>> {
    if seconds == 0 {
        return Err(XtaskError::Usage {
            flag: "--seconds",
            reason: "must be at least 1 (seconds of fuzzing per target)".into(),
        });
    }
    if requested.is_empty() {
        return Ok(available.to_vec());
    }
    let unknown: Vec<&str> = requested
        .iter()
        .filter(|r| !available.contains(r))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        return Err(XtaskError::Usage {
            flag: "--target",
            reason: format!(
                "unknown target(s) {}; fuzz/fuzz_targets has: {}",
                unknown.join(", "),
                available.join(", ")
            ),
        });
    }
    let mut seen = BTreeSet::new();
    Ok(requested
        .iter()
        .filter(|r| seen.insert(r.as_str()))
        .cloned()
        .collect())
}

/// Runs executed according to libFuzzer's output: the last
/// `stat::number_of_executed_units: N`, else the last `Done N runs`, else the
/// last status line `#N ...`.
pub fn parse_runs(output: &str) -> Option<u64> {
    let (mut stat, mut done, mut status) = (None, None, None);
    for line in output.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("stat::number_of_executed_units:") {
            stat = rest.trim().parse().ok().or(stat);
        } else if let Some(rest) = line.strip_prefix("Done ") {
            let mut words = rest.split_whitespace();
            if let (Some(n), Some("runs")) = (words.next(), words.next()) {
                done = n.parse().ok().or(done);
            }
        } else if let Some(rest) = line.strip_prefix('#') {
            let n = rest.split(|c: char| !c.is_ascii_digit()).next();
            status = n.and_then(|n| n.parse().ok()).or(status);
        }
    }
    stat.or(done).or(status)
}

/// The outcome of one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Target name.
    pub target: String,
    /// Runs executed, when libFuzzer printed a count.
    pub runs: Option<u64>,
    /// Files in `fuzz/artifacts/<target>/` that did not exist before the run.
    pub new_artifacts: Vec<PathBuf>,
    /// `None` when cargo fuzz exited 0, else its status.
    pub failure: Option<String>,
}

/// `cargo xtask fuzz`: validates, ensures cargo-fuzz, runs every selected
/// target for `seconds`, prints the table.
///
/// # Errors
/// [`XtaskError::Usage`] on bad arguments (nothing runs);
/// [`XtaskError::FuzzCrash`] when a target left new artifacts;
/// [`XtaskError::CommandFailed`] when a run failed otherwise (e.g. build).
pub fn run(seconds: u64, requested: &[String]) -> Result<()> {
    let fuzz = fuzz_dir();
    let targets = select(seconds, requested, &available_targets(&fuzz)?)?;
    let toolchain = Toolchain::detect();
    eprintln!("fuzz: toolchain: {}", toolchain.describe());
    ensure_cargo_fuzz(toolchain)?;
    let mut outcomes = Vec::new();
    for t in &targets {
        outcomes.push(run_target(toolchain, &fuzz, t, seconds)?);
    }
    print_table(&outcomes, seconds);
    verdict(&outcomes)
}

/// Installs cargo-fuzz (`cargo install cargo-fuzz --locked`) unless
/// `cargo fuzz --version` already works.
fn ensure_cargo_fuzz(toolchain: Toolchain) -> Result<()> {
    let mut probe = toolchain.cargo_fuzz();
    probe.arg("--version");
    if let Ok(v) = command::capture(&mut probe) {
        eprintln!("prerequisite: {v}");
        return Ok(());
    }
    eprintln!("prerequisite: cargo-fuzz missing; installing it with cargo install");
    let mut c = Command::new("cargo");
    c.args(["install", "cargo-fuzz", "--locked"]);
    command::run(&mut c).map_err(|e| XtaskError::Prerequisite {
        what: "cargo-fuzz",
        reason: e.to_string(),
    })
}

/// Files directly under `dir` (none when it does not exist).
fn files_in(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect()
}

/// One `cargo fuzz run` over the committed corpus; stderr (cargo's build
/// output and libFuzzer's log) is echoed line by line and kept for the count.
fn run_target(toolchain: Toolchain, fuzz: &Path, target: &str, seconds: u64) -> Result<Outcome> {
    let artifacts = fuzz.join("artifacts").join(target);
    let before = files_in(&artifacts);
    let mut c = toolchain.cargo_fuzz();
    c.args(["run", "--fuzz-dir", "fuzz", target])
        .arg(Path::new("fuzz").join("corpus").join(target))
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        // The fuzz crate keeps its own target dir (sanitizer builds); an
        // inherited CARGO_TARGET_DIR would mix them into the workspace's.
        .env_remove("CARGO_TARGET_DIR")
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    let line = command::describe(&c);
    eprintln!("$ {line}");
    let mut child = c.spawn().map_err(|source| XtaskError::Spawn {
        program: "cargo".into(),
        source,
    })?;
    let mut log = String::new();
    if let Some(err) = child.stderr.take() {
        for l in BufReader::new(err).lines() {
            let Ok(l) = l else { break };
            eprintln!("{l}");
            log.push_str(&l);
            log.push('\n');
        }
    }
    let status = child.wait().map_err(|source| XtaskError::Spawn {
        program: "cargo".into(),
        source,
    })?;
    let new_artifacts = files_in(&artifacts).difference(&before).cloned().collect();
    Ok(Outcome {
        target: target.to_owned(),
        runs: parse_runs(&log),
        new_artifacts,
        failure: (!status.success()).then(|| format!("`{line}` failed ({status})")),
    })
}

fn print_table(outcomes: &[Outcome], seconds: u64) {
    println!("\nfuzz: {seconds} s per target");
    println!("{:<14} {:>12}  new crash artifacts", "target", "runs");
    for o in outcomes {
        let runs = o.runs.map_or_else(|| "?".into(), |r| r.to_string());
        let arts = if o.new_artifacts.is_empty() {
            match &o.failure {
                Some(_) => "0 (run failed)".to_owned(),
                None => "0".to_owned(),
            }
        } else {
            o.new_artifacts
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("{:<14} {:>12}  {arts}", o.target, runs);
    }
}

/// Crash artifacts first (they are the finding), then other failures.
fn verdict(outcomes: &[Outcome]) -> Result<()> {
    let crashes: Vec<PathBuf> = outcomes
        .iter()
        .flat_map(|o| o.new_artifacts.iter().cloned())
        .collect();
    if !crashes.is_empty() {
        return Err(XtaskError::FuzzCrash {
            artifacts: crashes,
            replay: REPLAY_COMMAND,
        });
    }
    match outcomes.iter().find_map(|o| o.failure.clone()) {
        Some(f) => Err(XtaskError::FuzzRunFailed(f)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn select_rejects_zero_seconds_and_unknown_targets() {
        let all = names(&["descriptor", "event", "hint"]);
        let e = select(0, &[], &all).unwrap_err();
        assert!(
            matches!(
                e,
                XtaskError::Usage {
                    flag: "--seconds",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("--seconds"), "{e}");

        let e = select(5, &names(&["event", "nope"]), &all).unwrap_err();
        assert!(
            matches!(
                e,
                XtaskError::Usage {
                    flag: "--target",
                    ..
                }
            ),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("--target") && msg.contains("nope"), "{msg}");
        assert!(!msg.contains("unknown target(s) event"), "{msg}");
    }

    #[test]
    fn select_defaults_to_all_and_keeps_requested_order_once() {
        let all = names(&["descriptor", "event", "hint"]);
        assert_eq!(select(1, &[], &all).unwrap(), all);
        assert_eq!(
            select(1, &names(&["hint", "descriptor", "hint"]), &all).unwrap(),
            names(&["hint", "descriptor"])
        );
    }

    #[test]
    fn available_targets_are_the_fuzz_target_files() {
        let t = available_targets(&fuzz_dir()).unwrap();
        for n in ["descriptor", "event", "hint", "manifest", "pin_control"] {
            assert!(t.iter().any(|x| x == n), "{t:?}");
        }
        assert!(!t.iter().any(|x| x == "write_seeds"), "{t:?}");
    }

    const LIBFUZZER_TAIL: &str = "\
#524288\tpulse  cov: 1021 ft: 3120 corp: 210/9876b lim: 4096 exec/s: 26214 rss: 412Mb
#541639\tDONE   cov: 1021 ft: 3121 corp: 211/9901b lim: 4096 exec/s: 8879 rss: 415Mb
###### Recommended dictionary. ######
\"\\x01\\x00\" # Uses: 1204
###### End of recommended dictionary. ######
Done 541639 runs in 61 second(s)
stat::number_of_executed_units: 541640
stat::average_exec_per_sec:     8879
stat::new_units_added:          57
";

    #[test]
    fn parse_runs_prefers_final_stats_then_done_then_status_line() {
        assert_eq!(parse_runs(LIBFUZZER_TAIL), Some(541_640));
        let no_stats: String = LIBFUZZER_TAIL
            .lines()
            .filter(|l| !l.starts_with("stat::"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(parse_runs(&no_stats), Some(541_639));
        let crashed = "#1024\tNEW    cov: 5 ft: 6\n#2048\tpulse  cov: 5\n\
                       ==123== ERROR: libFuzzer: deadly signal\n";
        assert_eq!(parse_runs(crashed), Some(2048));
        assert_eq!(parse_runs("   Compiling kv-descriptor v0.1.0\n"), None);
    }

    #[test]
    fn nightly_detected_from_rustup_list() {
        assert!(lists_nightly(
            "stable-x86_64-unknown-linux-gnu (active, default)\nnightly-x86_64-unknown-linux-gnu\n"
        ));
        assert!(!lists_nightly(
            "stable-x86_64-unknown-linux-gnu (default)\n1.95.0-x86_64-unknown-linux-gnu\n"
        ));
    }

    #[test]
    fn crash_artifacts_win_over_other_failures() {
        let ok = Outcome {
            target: "event".into(),
            runs: Some(10),
            new_artifacts: vec![],
            failure: None,
        };
        assert!(verdict(std::slice::from_ref(&ok)).is_ok());
        let crash = Outcome {
            target: "hint".into(),
            runs: Some(3),
            new_artifacts: vec!["fuzz/artifacts/hint/crash-ab".into()],
            failure: Some("exit 77".into()),
        };
        let e = verdict(&[ok, crash]).unwrap_err().to_string();
        assert!(e.contains("fuzz/artifacts/hint/crash-ab"), "{e}");
        assert!(e.contains(REPLAY_COMMAND), "{e}");
    }
}
