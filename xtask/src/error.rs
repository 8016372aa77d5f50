//! The one error type of xtask: every variant names what failed and where.

use std::path::PathBuf;
use std::process::ExitStatus;

/// Why an xtask command failed.
#[derive(Debug, thiserror::Error)]
pub enum XtaskError {
    /// A child program could not be started at all (not installed, not executable).
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        /// Program name as given to the OS.
        program: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A child program ran and exited unsuccessfully.
    #[error("`{command}` failed ({status})")]
    CommandFailed {
        /// The command line, as echoed before it ran.
        command: String,
        /// Its exit status.
        status: ExitStatus,
    },
    /// A prerequisite (NIXL runtime, nats-server, libclang) could not be provided.
    #[error("prerequisite `{what}` unavailable: {reason}")]
    Prerequisite {
        /// `nixl`, `nats-server` or `libclang`.
        what: &'static str,
        /// Every way that was tried and why each failed.
        reason: String,
    },
    /// `cargo metadata` output that does not have the expected shape.
    #[error("cargo metadata: field `{field}`: {reason}")]
    Metadata {
        /// JSON path of the offending field, e.g. `packages[3].dependencies`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Workspace crates that depend on crates later in the layering order.
    #[error("dependency order violated ({} edge(s)):\n{}", .0.len(), .0.join("\n"))]
    Layering(Vec<String>),
    /// A file or directory could not be read or written.
    #[error("I/O on {path}: {source}")]
    Io {
        /// Path involved.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The workspace test run finished with failures.
    #[error("tests failed: {passed} passed, {failed} failed{}", if *.build_failed { " (a build or doc step failed too)" } else { "" })]
    TestsFailed {
        /// Tests that passed.
        passed: u64,
        /// Tests that failed.
        failed: u64,
        /// True when a compile, doc or harness step failed besides test results.
        build_failed: bool,
    },
    /// A bundle would exceed the device machine's carry limit.
    #[error("bundle {path} is {size} bytes, above the {limit}-byte carry limit")]
    BundleTooLarge {
        /// Bundle directory.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// Limit in bytes.
        limit: u64,
    },
    /// A command-line argument that is out of range or names nothing;
    /// reported before anything runs (exit status 2).
    #[error("invalid `{flag}`: {reason}")]
    Usage {
        /// The flag, e.g. `--seconds`.
        flag: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// Fuzzing left new crash artifacts.
    #[error("fuzzing found crash(es): {}; `{replay}` now replays them as regression tests (failing until fixed)", .artifacts.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    FuzzCrash {
        /// New files under `fuzz/artifacts/<target>/`.
        artifacts: Vec<PathBuf>,
        /// The stable test command that replays them.
        replay: &'static str,
    },
    /// A fuzz run failed without leaving a crash artifact (build error, ...).
    #[error("fuzz run failed without a crash artifact: {0}")]
    FuzzRunFailed(String),
}

/// Result alias of this crate.
pub type Result<T, E = XtaskError> = std::result::Result<T, E>;

impl XtaskError {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
