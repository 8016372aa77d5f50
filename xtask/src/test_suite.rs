//! `cargo xtask test`: every test of the workspace, after the prerequisites
//! and the layering check, closing with one `N passed, N failed, N skipped` line.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use crate::error::{Result, XtaskError};
use crate::prerequisites::Prerequisites;
use crate::{command, feature_sets, layering, workspace};

/// Test counts summed over every `test result:` line of libtest's output
/// (unit, integration and doc tests; `ignored` counts as skipped), plus the
/// tests that skipped themselves at run time.
///
/// A test that cannot run here (no GPU; no NIXL runtime, nats-server or
/// network namespaces outside CI) prints one line `SKIP <what>: <why>` and
/// returns, which libtest counts as passed. The suite runs with
/// `--nocapture` so those lines reach this tally: they are reported as
/// skipped, not passed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Tests that passed (libtest's count, run-time skips included).
    pub passed: u64,
    /// Tests that failed.
    pub failed: u64,
    /// Tests marked `#[ignore]`.
    pub skipped: u64,
    /// `SKIP ...` lines printed by tests that skipped themselves.
    pub skipped_at_run_time: Vec<String>,
    /// Names of the failed tests, from libtest's `failures:` lists.
    pub failed_tests: Vec<String>,
    /// Inside a `failures:` list (until the next `test result:` line).
    pub(crate) in_failures: bool,
    /// Names of the current `failures:` list, taken into `failed_tests` at
    /// its binary's `test result:` line.
    pub(crate) pending_failures: Vec<String>,
}

impl Tally {
    /// Adds the counts of one libtest summary line; other lines are ignored.
    /// Returns true when the line was a summary.
    ///
    /// The line format is libtest's: `test result: ok. 12 passed; 0 failed;
    /// 1 ignored; 0 measured; 0 filtered out; finished in 0.01s`.
    pub fn add_line(&mut self, line: &str) -> bool {
        // libtest prints `failures:` twice: first over the failed tests'
        // captured output (`---- name stdout ----` blocks, whose lines may
        // be indented too), then over the list of names, each as `    name`
        // (four spaces). Only the last list before `test result:` counts, and
        // a name may hold spaces: a doctest is `src/lib.rs - f (line 3)`.
        if line == "failures:" {
            self.in_failures = true;
            self.pending_failures.clear();
            return false;
        }
        if self.in_failures {
            if let Some(name) = line.strip_prefix("    ") {
                let name = name.trim();
                if !name.is_empty() {
                    self.pending_failures.push(name.to_string());
                }
                return false;
            }
        }
        // libtest may print `test name ... ` before the test's own output.
        if let Some(at) = line.find("SKIP ") {
            self.skipped_at_run_time.push(line[at..].trim().to_string());
            return false;
        }
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return false;
        };
        self.in_failures = false;
        self.failed_tests.append(&mut self.pending_failures);
        let Some((_, counts)) = rest.split_once(". ") else {
            return false;
        };
        let mut any = false;
        for part in counts.split(';') {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            let slot = match what {
                "passed" => &mut self.passed,
                "failed" => &mut self.failed,
                "ignored" => &mut self.skipped,
                _ => continue,
            };
            *slot += n;
            any = true;
        }
        any
    }

    /// Adds the counts, run-time skips and failed tests of another run
    /// (the loom models' `cargo test`).
    pub fn absorb(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
        self.skipped_at_run_time.extend(other.skipped_at_run_time);
        self.failed_tests.extend(other.failed_tests);
    }

    /// The closing line: `N passed, N failed, N skipped`, where passed
    /// excludes, and skipped includes, the tests that skipped at run time.
    pub fn closing_line(&self) -> String {
        let run_time = self.skipped_at_run_time.len() as u64;
        format!(
            "{} passed, {} failed, {} skipped ({} ignored, {run_time} at run time)",
            self.passed.saturating_sub(run_time),
            self.failed,
            self.skipped + run_time,
            self.skipped
        )
    }
}

/// Panic messages on the test run's stderr, so that the closing lines name
/// why each failed test failed (CI keeps only the head and tail of a long
/// log; a panic in the middle was lost).
///
/// libtest runs each test on a thread named after the test, and the default
/// panic hook prints `thread '<name>' (<tid>) panicked at <file:line:col>:`
/// followed by the message lines.
#[derive(Debug, Default)]
pub struct PanicLog {
    /// (thread name, `panicked at <location>: <message>`), in order.
    panics: Vec<(String, String)>,
    /// Message lines still to append to the last panic.
    open: usize,
}

/// Message lines kept per panic (an assertion's `left`/`right` included).
const PANIC_MESSAGE_LINES: usize = 4;

impl PanicLog {
    /// Records one stderr line.
    pub fn add_line(&mut self, line: &str) {
        if let Some((thread, location)) = line
            .strip_prefix("thread '")
            .and_then(|rest| rest.split_once('\''))
            .and_then(|(name, after)| {
                let at = after.find("panicked at ")?;
                Some((
                    name,
                    after[at + "panicked at ".len()..].trim_end_matches(':'),
                ))
            })
        {
            self.panics
                .push((thread.to_string(), format!("panicked at {location}")));
            self.open = PANIC_MESSAGE_LINES;
            return;
        }
        if self.open == 0 {
            return;
        }
        // After the message's first line, only indented lines continue it
        // (`assert_eq!`'s `  left:` / ` right:`): the hook prints its `note:`
        // after a process's first panic only, so a later panic's message
        // may be followed directly by another test's output.
        let continues = self.open == PANIC_MESSAGE_LINES || line.starts_with(' ');
        if line.is_empty()
            || line.starts_with("note: ")
            || line.starts_with("stack backtrace:")
            || !continues
        {
            self.open = 0;
            return;
        }
        if let Some((_, message)) = self.panics.last_mut() {
            message.push_str(if self.open == PANIC_MESSAGE_LINES {
                ": "
            } else {
                " | "
            });
            message.push_str(line.trim());
        }
        self.open -= 1;
    }

    /// The last panic of the thread named `test`, if any.
    pub fn of(&self, test: &str) -> Option<&str> {
        self.panics
            .iter()
            .rev()
            .find(|(thread, _)| thread == test)
            .map(|(_, m)| m.as_str())
    }
}

/// Free space a fresh `cargo test --workspace` build takes under `target/`,
/// measured on x86-64 Linux with CI's settings (no incremental state): about
/// 1.5 GB of build output plus 0.23 GB for the NIXL runtime.
const FRESH_BUILD_BYTES: u64 = 2 << 30;

/// Prints the free space of the target directory's filesystem, and a warning
/// when it is below [`FRESH_BUILD_BYTES`]: a full disk otherwise shows up
/// minutes later as a linker `Bus error`, far from its cause.
fn report_free_disk() {
    let target = workspace::target_dir();
    let probe = if target.exists() {
        target
    } else {
        workspace::root()
    };
    // `df -Pk` is POSIX; its second line's fourth column is free KiB.
    let free_kib = Command::new("df")
        .arg("-Pk")
        .arg(&probe)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|out| {
            out.lines()
                .nth(1)?
                .split_whitespace()
                .nth(3)?
                .parse::<u64>()
                .ok()
        });
    match free_kib {
        Some(kib) => {
            let free = kib * 1024;
            eprintln!(
                "disk: {:.1} GiB free under {}",
                free as f64 / (1u64 << 30) as f64,
                probe.display()
            );
            if free < FRESH_BUILD_BYTES {
                eprintln!(
                    "warning: a fresh test build needs about {} GiB; expect `No space left on device`",
                    FRESH_BUILD_BYTES >> 30
                );
            }
        }
        None => eprintln!(
            "disk: free space under {} unknown (`df -Pk` failed)",
            probe.display()
        ),
    }
}

/// Runs prerequisites, the layering check, the feature sets of
/// [`feature_sets::FEATURE_SETS`] (each `cargo check`ed alone, its graph
/// checked for CUDA / NIXL crates), `cargo fmt --all --check`,
/// `cargo test --workspace --no-fail-fast [extra]`, kv-lookup's loom models
/// ([`crate::loom`], their own cfg and target directory), the Python tests,
/// `cargo clippy --workspace
/// --all-targets -- -D warnings` and `cargo doc --workspace --no-deps` with
/// `-D warnings` (every crate's docs, intra-doc links included); every step
/// runs even after an earlier one failed, so one run shows every problem.
///
/// # Errors
/// [`XtaskError::TestsFailed`] when any test or step failed; prerequisite
/// errors (before anything is built) as they are.
pub fn run(extra: &[String]) -> Result<()> {
    let prereq = Prerequisites::ensure()?;
    let mut step_failures = Vec::new();

    match layering_check() {
        Ok(edges) => eprintln!("layering: {edges} internal dependency edges, all downward"),
        Err(e) => step_failures.push(format!("layering: {e}")),
    }

    // Each documented feature set on its own (the workspace test build
    // below unifies them all on); a set whose feature is not defined yet is
    // skipped with a printed line (`feature_sets::run`).
    match feature_sets::run(|c| prereq.apply(c)) {
        Ok(failed) => step_failures.extend(failed.into_iter().map(|f| format!("feature set {f}"))),
        Err(e) => step_failures.push(format!("feature sets: {e}")),
    }

    let mut fmt = workspace::cargo();
    fmt.args(["fmt", "--all", "--check"]);
    if let Err(e) = command::run(&mut fmt) {
        step_failures.push(format!("fmt (run `cargo fmt --all`): {e}"));
    }

    report_free_disk();
    let mut test = workspace::cargo();
    test.args(["test", "--workspace", "--no-fail-fast"])
        .args(extra);
    if crate::prerequisites::in_ci() {
        // CI builds once from scratch: incremental state would only add
        // ~0.8 GB to a ~1.5 GB target directory.
        test.env("CARGO_INCREMENTAL", "0");
    }
    // Test binaries' own arguments follow `--` (add one unless `extra` did).
    if !extra.iter().any(|a| a == "--") {
        test.arg("--");
    }
    test.arg("--nocapture");
    prereq.apply(&mut test);
    let (mut tally, mut panics, status) = tee_and_tally(&mut test, &mut std::io::stdout().lock())?;
    if !status.success() && tally.failed == 0 {
        let why = if tally.passed == 0 {
            "before any test ran: a build failure, or an argument cargo rejected; see its output above"
        } else {
            "a test binary did not build or crashed; see cargo's output above"
        };
        step_failures.push(format!(
            "`{}` exited with {status}, {why}",
            command::describe(&test)
        ));
    }

    // kv-lookup's loom models of the left-right twin: their own cfg and
    // target directory (`loom.rs`), so they never rebuild the units above.
    let mut models = crate::loom::command();
    if crate::prerequisites::in_ci() {
        models.env("CARGO_INCREMENTAL", "0");
    }
    let (loom_tally, loom_panics, loom_status) =
        tee_and_tally(&mut models, &mut std::io::stdout().lock())?;
    panics.panics.extend(loom_panics.panics);
    if !loom_status.success() && loom_tally.failed == 0 {
        step_failures.push(format!(
            "`{}` exited with {loom_status} before any model failed (a build failure?)",
            command::describe(&models)
        ));
    }
    tally.absorb(loom_tally);

    // The Python wheel, built with the workspace target directory (its
    // dependencies are the test build's), and its pytest counts; its
    // failures come named with their reason (`id - reason`).
    let mut python_failures = Vec::new();
    match crate::wheel::build_and_install().and_then(|_| crate::wheel::pytest()) {
        Ok((py, clean)) => {
            if !clean && py.failed == 0 {
                step_failures.push(
                    "pytest exited non-zero without a failed test (collection error?)".into(),
                );
            }
            tally.passed += py.passed;
            tally.failed += py.failed;
            tally.skipped += py.skipped;
            python_failures = py.failed_tests;
        }
        Err(e) => step_failures.push(format!("python wheel: {e}")),
    }

    // After the tests, so they reuse the test build's dependency artifacts.
    let incremental = crate::prerequisites::in_ci().then_some(("CARGO_INCREMENTAL", "0"));
    let mut clippy = workspace::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    let mut doc = workspace::cargo();
    doc.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    for (name, cmd) in [("clippy", &mut clippy), ("doc", &mut doc)] {
        if let Some((k, v)) = incremental {
            cmd.env(k, v);
        }
        prereq.apply(cmd);
        if let Err(e) = command::run(cmd) {
            step_failures.push(format!("{name}: {e}"));
        }
    }

    for f in &step_failures {
        println!("step failed: {f}");
    }
    for s in &tally.skipped_at_run_time {
        println!("skipped at run time: {s}");
    }
    for name in &tally.failed_tests {
        let why = panics.of(name).unwrap_or("no panic message seen on stderr");
        println!("failed test: {name}: {why}");
    }
    for failure in &python_failures {
        println!("failed test: {failure}");
    }
    println!("{}", tally.closing_line());
    if tally.failed > 0 || !step_failures.is_empty() {
        return Err(XtaskError::TestsFailed {
            passed: tally.passed,
            failed: tally.failed,
            build_failed: !step_failures.is_empty(),
        });
    }
    Ok(())
}

fn layering_check() -> Result<usize> {
    let json = command::capture(workspace::cargo().args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
    ]))?;
    layering::check(&json)
}

/// Runs `cmd`, copying its stdout to `out` line by line while counting
/// libtest summaries, and its stderr (cargo's build output, the panic hook's
/// messages) to this stderr while noting panics; returns the tally, the
/// panics and the status.
fn tee_and_tally(
    cmd: &mut Command,
    out: &mut impl Write,
) -> Result<(Tally, PanicLog, std::process::ExitStatus)> {
    eprintln!("$ {}", command::describe(cmd));
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| XtaskError::Spawn {
            program: "cargo".into(),
            source,
        })?;
    let stderr = child.stderr.take().expect("stderr was piped");
    // Read apart: a child blocked on a full stderr pipe would stall stdout.
    let panics = std::thread::spawn(move || {
        let mut log = PanicLog::default();
        let mut err = std::io::stderr();
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            log.add_line(&line);
            let _ = writeln!(err, "{line}");
        }
        log
    });
    let mut tally = Tally::default();
    let stdout = child.stdout.take().expect("stdout was piped");
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(XtaskError::io("<cargo test stdout>"))?;
        tally.add_line(&line);
        // A closed stdout (`| head`) must not abort the count.
        let _ = writeln!(out, "{line}");
    }
    let status = child.wait().map_err(XtaskError::io("<cargo test>"))?;
    let panics = panics.join().unwrap_or_default();
    Ok((tally, panics, status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_libtest_summaries_and_ignores_other_lines() {
        let mut t = Tally::default();
        assert!(t.add_line("test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s"));
        assert!(t.add_line("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.20s"));
        assert!(!t.add_line("test kv::x ... ok"));
        assert!(!t.add_line("   Doc-tests kv_descriptor"));
        assert!(!t.add_line("test result: garbage"));
        assert!(!t.add_line("test gpu_copy ... SKIP gpu test: libcuda not loadable"));
        assert_eq!(
            t,
            Tally {
                passed: 15,
                failed: 2,
                skipped: 1,
                skipped_at_run_time: vec!["SKIP gpu test: libcuda not loadable".into()],
                ..Tally::default()
            }
        );
        assert_eq!(
            t.closing_line(),
            "14 passed, 2 failed, 2 skipped (1 ignored, 1 at run time)"
        );
    }

    #[test]
    fn names_each_failed_test_with_its_panic_message() {
        let mut t = Tally::default();
        for line in [
            "test a::slow ... ok",
            "",
            "failures:",
            "    a::flaky",
            "    b::broken",
            "",
            "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s",
            "    indented output of a later test",
        ] {
            t.add_line(line);
        }
        assert_eq!(t.failed_tests, ["a::flaky", "b::broken"]);
        assert_eq!(t.failed, 2);
        // Another run (the loom models) adds its counts and names.
        let mut models = Tally::default();
        models.add_line("failures:");
        models.add_line("    twin::model_tests::model_x");
        models.add_line("test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 27 filtered out; finished in 7.00s");
        t.absorb(models);
        assert_eq!((t.passed, t.failed), (3, 3));
        assert_eq!(
            t.failed_tests,
            ["a::flaky", "b::broken", "twin::model_tests::model_x"]
        );
        let mut p = PanicLog::default();
        for line in [
            "thread 'a::flaky' (123) panicked at src/a.rs:10:5:",
            "assertion `left == right` failed: counts",
            "  left: 1",
            " right: 2",
            "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
            "thread 'b::broken' (124) panicked at src/b.rs:3:9:",
            "called `Option::unwrap()` on a `None` value",
            "stack backtrace:",
            "   0: frame",
            // A later panic: no `note:` line follows, another test's
            // output does, and is not part of the message.
            "thread 'c::later' (125) panicked at src/c.rs:7:1:",
            "boom",
            "SKIP gpu test: libcuda not loadable",
            "  indented output of another test",
        ] {
            p.add_line(line);
        }
        assert_eq!(
            p.of("a::flaky"),
            Some("panicked at src/a.rs:10:5: assertion `left == right` failed: counts | left: 1 | right: 2")
        );
        assert_eq!(
            p.of("b::broken"),
            Some("panicked at src/b.rs:3:9: called `Option::unwrap()` on a `None` value")
        );
        assert_eq!(p.of("c::later"), Some("panicked at src/c.rs:7:1: boom"));
        assert_eq!(p.of("c::passed"), None);
    }

    /// libtest's stdout for a failed doctest (name with spaces) and for a
    /// binary whose failures carry captured output (`cargo test --
    /// --nocapture --no-fail-fast`, rustc 1.95): every failed test is
    /// named once, and nothing from the captured output is taken as a name.
    #[test]
    fn names_failed_doctests_and_skips_captured_output() {
        let mut t = Tally::default();
        for line in [
            "running 1 test",
            "src/lib.rs - two (line 1) --- FAILED",
            "",
            "failures:",
            "",
            "failures:",
            "    src/lib.rs - two (line 1)",
            "",
            "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
            "running 2 tests",
            "",
            "failures:",
            "",
            "---- c::should_panic stdout ----",
            "    |",
            "    = note: captured output of a test",
            "",
            "failures:",
            "    c::should_panic",
            "    c::same_name",
            "",
            "test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
            "running 1 test",
            "failures:",
            "    c::same_name",
            "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
        ] {
            t.add_line(line);
        }
        assert_eq!(
            t.failed_tests,
            [
                "src/lib.rs - two (line 1)",
                "c::should_panic",
                "c::same_name",
                "c::same_name"
            ]
        );
        assert_eq!(t.failed, t.failed_tests.len() as u64);
    }

    #[test]
    fn tee_counts_a_real_child_and_reports_its_status() {
        let mut c = Command::new("sh");
        c.args([
            "-c",
            "echo 'test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0s'; exit 1",
        ]);
        // Into a buffer: a summary line on the real stdout would be counted
        // by the `cargo xtask test` run that executes this test.
        let mut copy = Vec::new();
        let (t, _, status) = tee_and_tally(&mut c, &mut copy).unwrap();
        assert_eq!((t.passed, t.failed), (4, 0));
        assert!(String::from_utf8(copy)
            .unwrap()
            .starts_with("test result: ok. 4 passed"));
        assert!(!status.success());
    }
}
