//! The `kv_reuse` Python wheel (crates/kv-reuse-py): a virtual environment
//! under `target/py-venv` with maturin, numpy and pytest from PyPI, the abi3
//! wheel built into `target/wheels/` with cargo's own target directory, and
//! its pytest run. `cargo xtask test` reuses the workspace build's units for
//! everything but pyo3 (`extension-module`) and kv-reuse-py: same profile,
//! no RUSTFLAGS (maturin's `--strip` is `-C strip=symbols` for the final
//! crate only), and the same features ([`DEV_FEATURES`] and the alignment
//! block of kv-reuse-py's Cargo.toml; maturin builds that package alone, so
//! cargo's feature unification would otherwise differ from the workspace's).
//!
//! The tests' wheel is built with the dev profile: its dependencies are
//! optimized (`[profile.dev.package."*"] opt-level = 2`), and a release build
//! of the whole graph on a 2-core CI machine costs minutes more for no test
//! benefit. The GPU bundle's wheel is a release build
//! ([`WheelProfile::Release`], `target/wheels-release/`): the serving harness
//! runs the wheel's own code (the advisor, the fetch path) on every request,
//! at opt-level 0 in a dev build; `cargo xtask gpu-bundle` builds kvq in
//! release already, so the wheel shares that build's dependencies.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command;
use crate::error::{Result, XtaskError};
use crate::test_suite::Tally;
use crate::workspace;

/// PyPI packages the venv needs: the wheel builder and the test tools.
const VENV_PACKAGES: [&str; 3] = ["maturin>=1.5,<2", "numpy", "pytest"];

/// The venv directory (`<target>/py-venv`).
pub fn venv_dir() -> PathBuf {
    workspace::target_dir().join("py-venv")
}

fn venv_bin(name: &str) -> PathBuf {
    venv_dir().join("bin").join(name)
}

/// Creates the venv when missing and installs [`VENV_PACKAGES`] when any of
/// them is absent.
///
/// # Errors
/// `python3 -m venv` or pip failing.
pub fn ensure_venv() -> Result<()> {
    let python = venv_bin("python");
    if !python.exists() {
        command::run(Command::new("python3").args(["-m", "venv"]).arg(venv_dir()))?;
    }
    let mut probe = Command::new(&python);
    probe.args(["-c", "import numpy, pytest"]);
    if !venv_bin("maturin").exists() || !command::succeeds(&mut probe) {
        let mut pip = Command::new(&python);
        pip.args([
            "-m",
            "pip",
            "--disable-pip-version-check",
            "--no-input",
            "install",
            "-q",
        ])
        .args(VENV_PACKAGES);
        command::run(&mut pip)?;
    }
    Ok(())
}

/// Cargo features of the tests' wheel build. maturin builds kv-reuse-py
/// alone, so cargo unifies features over its graph only; `cargo test
/// --workspace` turns on the members' `qualify` features (kv-testkit needs
/// them), so without these the wheel recompiled kv-bank, kv-transfer and
/// kv-router-glue under new hashes. External crates are aligned in
/// kv-reuse-py's Cargo.toml. `pyo3/extension-module` is pyproject.toml's
/// feature, repeated because a `--features` argument replaces it; pyo3 then
/// differs from the test build by that feature alone. The release (GPU
/// bundle) wheel keeps pyproject.toml's features only.
pub const DEV_FEATURES: &str = "pyo3/extension-module,kv-bank/default,kv-bank/qualify,\
kv-transfer/default,kv-transfer/qualify,kv-router-glue/qualify";

/// The cargo profile a wheel is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WheelProfile {
    /// `--profile dev` into `<target>/wheels`: the tests' wheel.
    Dev,
    /// `--release` into `<target>/wheels-release`: the GPU bundle's wheel.
    Release,
}

impl WheelProfile {
    /// The cargo profile name maturin is given.
    pub fn cargo_profile(self) -> &'static str {
        match self {
            Self::Dev => "dev",
            Self::Release => "release",
        }
    }
    /// Where maturin writes the wheel: one folder per profile, so a release
    /// build never replaces the wheel `cargo xtask test` installed.
    pub fn out_dir(self) -> PathBuf {
        workspace::target_dir().join(match self {
            Self::Dev => "wheels",
            Self::Release => "wheels-release",
        })
    }
}

/// Builds the wheel with `profile` into [`WheelProfile::out_dir`]; returns
/// its path and how long maturin took.
///
/// # Errors
/// The venv or maturin failing; [`XtaskError::Prerequisite`] when maturin
/// wrote no `kv_reuse-*.whl`.
pub fn build(profile: WheelProfile) -> Result<(PathBuf, std::time::Duration)> {
    ensure_venv()?;
    let out = profile.out_dir();
    let root = workspace::root();
    let mut maturin = Command::new(venv_bin("maturin"));
    maturin
        .current_dir(&root)
        .args(maturin_args(profile))
        .arg("--manifest-path")
        .arg(root.join("crates/kv-reuse-py/Cargo.toml"))
        .arg("--out")
        .arg(&out)
        // Cargo's own target directory: the build reuses the workspace's.
        .env("CARGO_TARGET_DIR", workspace::target_dir());
    let started = std::time::Instant::now();
    command::run(&mut maturin)?;
    let took = started.elapsed();
    Ok((newest_wheel(&out)?, took))
}

/// maturin's subcommand and build options for `profile`, in the order
/// maturin's CLI takes them: `build` first, then its options (an option
/// before the subcommand is refused: "unexpected argument '--features'").
fn maturin_args(profile: WheelProfile) -> Vec<&'static str> {
    // `--strip`: the extension's symbols and line tables are 3/4 of its
    // 34 MB, and the wheel travels in the GPU bundle (64 MiB carry limit).
    let mut args = vec!["build", "--profile", profile.cargo_profile(), "--strip"];
    if profile == WheelProfile::Dev {
        // The workspace crates' features of `cargo test --workspace`, so
        // that they are the same units and reused (see [`DEV_FEATURES`]).
        args.extend(["--features", DEV_FEATURES]);
    }
    args
}

/// Builds the dev-profile wheel into `<target>/wheels` and installs it into
/// the venv; returns the wheel's path.
///
/// # Errors
/// As [`build`]; pip failing.
pub fn build_and_install() -> Result<PathBuf> {
    let (wheel, _) = build(WheelProfile::Dev)?;
    let mut pip = Command::new(venv_bin("python"));
    pip.args([
        "-m",
        "pip",
        "--disable-pip-version-check",
        "--no-input",
        "install",
        "-q",
    ])
    .args(["--force-reinstall", "--no-deps"])
    .arg(&wheel);
    command::run(&mut pip)?;
    Ok(wheel)
}

fn newest_wheel(dir: &Path) -> Result<PathBuf> {
    let mut wheels: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .map_err(XtaskError::io(dir))?
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("kv_reuse-") && n.ends_with(".whl")
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    wheels.sort();
    wheels
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| XtaskError::Prerequisite {
            what: "maturin",
            reason: format!("no kv_reuse-*.whl in {}", dir.display()),
        })
}

/// Runs the Python tests with the venv's pytest; returns their tally and
/// whether pytest exited cleanly.
///
/// # Errors
/// pytest not starting.
pub fn pytest() -> Result<(Tally, bool)> {
    let root = workspace::root();
    let mut c = Command::new(venv_bin("python"));
    c.current_dir(&root)
        // `-r` replaces pytest's default `fE`: list failures and errors
        // (`FAILED id - reason`) beside the skips, for the closing lines.
        .args(["-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"])
        .arg(root.join("crates/kv-reuse-py/tests"))
        // The gpu_serving harness's tests: those needing torch skip with the
        // reason in this venv (torch is never a CI dependency).
        .arg(root.join("crates/kv-testkit/python/tests"));
    let out = c.output().map_err(XtaskError::io(venv_bin("python")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let mut tally = Tally::default();
    if let Some(line) = text.lines().rev().find(|l| is_pytest_summary(l)) {
        add_pytest_summary(&mut tally, line);
    }
    tally
        .failed_tests
        .extend(text.lines().filter_map(pytest_failure));
    Ok((tally, out.status.success()))
}

/// A failed or erroring test of pytest's short summary (`-rfE`),
/// `FAILED tests/t.py::test_x - AssertionError: ...` or `ERROR ...`, as
/// `tests/t.py::test_x - AssertionError: ...`.
fn pytest_failure(line: &str) -> Option<String> {
    let rest = line
        .strip_prefix("FAILED ")
        .or_else(|| line.strip_prefix("ERROR "))?;
    let id = rest.split(" - ").next()?;
    (id.contains("::") || id.ends_with(".py")).then(|| rest.trim().to_string())
}

fn is_pytest_summary(line: &str) -> bool {
    let l = line.trim().trim_matches('=').trim();
    l.contains(" in ")
        && (l.contains("passed")
            || l.contains("failed")
            || l.contains("skipped")
            || l.contains("error"))
}

/// Adds pytest's closing line (`2 failed, 5 passed, 1 skipped in 0.31s`) to
/// `tally`: errors count as failed, skipped and xfailed as skipped.
pub fn add_pytest_summary(tally: &mut Tally, line: &str) {
    let l = line.trim().trim_matches('=').trim();
    let counts = l.rsplit_once(" in ").map_or(l, |(c, _)| c);
    for part in counts.split(", ") {
        let mut it = part.split_whitespace();
        let (Some(n), Some(what)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what {
            "passed" | "xpassed" => tally.passed += n,
            "failed" | "error" | "errors" => tally.failed += n,
            "skipped" | "xfailed" | "deselected" => tally.skipped += n,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytest_summary_counts_join_the_tally() {
        let mut t = Tally {
            passed: 10,
            failed: 0,
            skipped: 1,
            ..Tally::default()
        };
        let line = "==== 2 failed, 5 passed, 3 skipped, 1 error in 0.31s ====";
        assert!(is_pytest_summary(line));
        add_pytest_summary(&mut t, line);
        assert_eq!((t.passed, t.failed, t.skipped), (15, 3, 4));
        assert!(!is_pytest_summary("tests/test_roles.py ....s"));
    }

    /// pytest 9.2's `-rfEs` short summary: failures and errors are named
    /// with their reason, skips and other lines are not failures.
    #[test]
    fn pytest_failures_and_errors_are_named_with_their_reason() {
        assert_eq!(
            pytest_failure("FAILED pt/test_x.py::test_bad - AssertionError: one is not two"),
            Some("pt/test_x.py::test_bad - AssertionError: one is not two".into())
        );
        assert_eq!(
            pytest_failure("ERROR pt/test_y.py::test_err - RuntimeError: fixture broke"),
            Some("pt/test_y.py::test_err - RuntimeError: fixture broke".into())
        );
        assert_eq!(
            pytest_failure("ERROR tests/test_z.py - ImportError: no kv_reuse"),
            Some("tests/test_z.py - ImportError: no kv_reuse".into())
        );
        assert_eq!(pytest_failure("SKIPPED [1] pt/test_x.py:4: why"), None);
        assert_eq!(pytest_failure("E   AssertionError: one is not two"), None);
        assert_eq!(pytest_failure("FAILED to start something"), None);
    }

    /// `cargo tree` lines `name vX (path)|features` → package → feature sets.
    fn tree(args: &[&str]) -> std::collections::BTreeMap<String, Vec<String>> {
        let out = command::capture(workspace::cargo().arg("tree").args(args).args([
            "-f",
            "{p}|{f}",
            "--prefix",
            "none",
            "--no-dedupe",
        ]))
        .unwrap();
        let mut m = std::collections::BTreeMap::<String, Vec<String>>::new();
        for l in out.lines().filter_map(|l| l.split_once('|')) {
            m.entry(l.0.replace(" (*)", ""))
                .or_default()
                .push(l.1.into());
        }
        m
    }

    /// The dev wheel resolves every crate but pyo3's with features the
    /// workspace test build also resolves, so it reuses that build's units.
    #[test]
    fn maturin_gets_the_build_subcommand_before_its_options() {
        for profile in [WheelProfile::Dev, WheelProfile::Release] {
            let args = maturin_args(profile);
            assert_eq!(args[0], "build", "{args:?}");
            assert!(args.contains(&"--strip"), "{args:?}");
        }
        let dev = maturin_args(WheelProfile::Dev);
        let at = dev
            .iter()
            .position(|a| *a == "--features")
            .expect("dev wheel names its features");
        assert_eq!(dev[at + 1], DEV_FEATURES);
        assert!(!maturin_args(WheelProfile::Release).contains(&"--features"));
    }

    #[test]
    fn dev_wheel_features_match_the_workspace_test_build() {
        let ws = tree(&["--workspace", "-e", "normal,build,dev"]);
        let wheel = tree(&[
            "-p",
            "kv-reuse-py",
            "-e",
            "normal,build",
            "--features",
            DEV_FEATURES,
        ]);
        let differing: Vec<&String> = wheel
            .iter()
            .filter(|(pkg, feats)| {
                !pkg.starts_with("pyo3")
                    && !feats
                        .iter()
                        .all(|f| ws.get(*pkg).is_some_and(|w| w.contains(f)))
            })
            .map(|(pkg, _)| pkg)
            .collect();
        assert!(differing.is_empty(), "features differ: {differing:?}");
    }
}
