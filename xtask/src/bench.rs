//! `cargo xtask bench {transfer|lookup|advise}`: dispatch to the benchmark each
//! crate owns. Both print ratios against a baseline measured in the same run.

use std::path::Path;

use crate::error::Result;
use crate::kvq::{self, BuildProfile};
use crate::prerequisites::Prerequisites;
use crate::qualify::Profile;
use crate::{command, workspace};

/// Which benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Bench {
    /// `kv_transfer::bench::run` through `kvq bench transfer`.
    Transfer,
    /// The kv-lookup criterion-free bench target `lookup`.
    Lookup,
    /// The router service's advise round trip over NATS beside the
    /// in-process advise, through `kvq bench advise`.
    Advise,
}

/// Runs one benchmark, writing its JSON result to `json` when given.
///
/// # Errors
/// A failed build or a failed benchmark run.
pub fn run(which: Bench, json: Option<&Path>) -> Result<()> {
    let prereq = Prerequisites::ensure()?;
    match which {
        Bench::Transfer => {
            let (exe, line) = kvq::build(BuildProfile::Release)?;
            let mut c = kvq::command(&exe, &line, &prereq);
            // GPU cases where a GPU exists, as `qualify --profile auto` does.
            c.args([
                "bench",
                "transfer",
                "--profile",
                Profile::Auto.resolve().as_str(),
            ]);
            if let Some(j) = json {
                c.arg("--json").arg(absolute_from_caller(j));
            }
            command::run(&mut c)
        }
        Bench::Advise => {
            let (exe, line) = kvq::build(BuildProfile::Release)?;
            let mut c = kvq::command(&exe, &line, &prereq);
            c.args(["bench", "advise"]);
            if let Some(j) = json {
                c.arg("--json").arg(absolute_from_caller(j));
            }
            command::run(&mut c)
        }
        Bench::Lookup => {
            let mut c = workspace::cargo();
            c.args(["bench", "-p", "kv-lookup", "--bench", "lookup", "--"]);
            if let Some(j) = json {
                c.arg("--json").arg(absolute_from_caller(j));
            }
            prereq.apply(&mut c);
            command::run(&mut c)
        }
    }
}

/// Children run in the workspace root (or deeper, for cargo bench): make a
/// relative path given by the user absolute against the caller's directory.
fn absolute_from_caller(p: &Path) -> std::path::PathBuf {
    std::env::current_dir()
        .map(|d| d.join(p))
        .unwrap_or_else(|_| p.to_path_buf())
}
