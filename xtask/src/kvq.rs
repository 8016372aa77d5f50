//! The `kvq` binary of kv-testkit, which does the heavy work (qualification
//! sections, oracle, benchmarks) so that xtask stays free of nixl-sys:
//! building it, and running it with the prerequisites' environment.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command;
use crate::error::Result;
use crate::prerequisites::Prerequisites;
use crate::workspace::{self, Provenance};

/// How to build kvq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildProfile {
    /// `--release` (the default: replay and oracle are compute-heavy).
    Release,
    /// The dev profile, reusing a debug build of the tests (dependencies are
    /// still optimized: `[profile.dev.package."*"] opt-level = 2`).
    Dev,
}

/// File name of the router service binary (kv-router-glue), built with kvq:
/// kvq's `cluster` section runs it from kvq's own folder.
pub const ROUTER_BIN: &str = "kv-reuse-router";

/// Builds kvq and the router binary [`ROUTER_BIN`] (same folder); returns
/// kvq's path and the build command line.
///
/// # Errors
/// The failed cargo command.
pub fn build(profile: BuildProfile) -> Result<(PathBuf, String)> {
    let mut c = workspace::cargo();
    c.args(["build", "-p", "kv-testkit", "--bin", "kvq"]);
    c.args(["-p", "kv-router-glue", "--bin", ROUTER_BIN]);
    let dir = match profile {
        BuildProfile::Release => {
            c.arg("--release");
            "release"
        }
        BuildProfile::Dev => "debug",
    };
    let line = command::describe(&c);
    command::run(&mut c)?;
    Ok((workspace::target_dir().join(dir).join("kvq"), line))
}

/// A command running the kvq at `exe` with the prerequisites' environment,
/// provenance (`KVQ_GIT_SHA`, `KVQ_GIT_DIRTY`, `KVQ_RUSTC`) and the build
/// command (`KVQ_BUILD_COMMAND`), all of which kvq writes into its record.
pub fn command(exe: &Path, build_line: &str, prereq: &Prerequisites) -> Command {
    let mut c = Command::new(exe);
    c.current_dir(workspace::root());
    prereq.apply(&mut c);
    for (k, v) in Provenance::probe().env() {
        c.env(k, v);
    }
    c.env("KVQ_BUILD_COMMAND", build_line);
    c
}
