//! `cargo xtask qualify`: prerequisites, a kvq build, and one kvq run that
//! executes the qualification sections and writes `record.json` and
//! `REPORT.md` (see the kvq binary in kv-testkit for what the sections check).

use std::path::PathBuf;
use std::process::Command;

use crate::error::{Result, XtaskError};
use crate::kvq::{self, BuildProfile};
use crate::prerequisites::Prerequisites;
use crate::{command, workspace};

/// Qualification profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// `gpu` when `nvidia-smi -L` lists a GPU, else `cpu`.
    Auto,
    /// Host memory and shared memory only.
    Cpu,
    /// CUDA device memory, CUDA IPC and NIXL VRAM paths; fails without a GPU.
    Gpu,
}

impl Profile {
    /// Resolves `Auto` on this machine.
    pub fn resolve(self) -> Profile {
        match self {
            Profile::Auto if gpu_present() => Profile::Gpu,
            Profile::Auto => Profile::Cpu,
            p => p,
        }
    }

    /// Name passed to `kvq --profile`.
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Auto => "auto",
            Profile::Cpu => "cpu",
            Profile::Gpu => "gpu",
        }
    }
}

fn gpu_present() -> bool {
    command::capture(Command::new("nvidia-smi").arg("-L")).is_ok_and(|s| s.contains("GPU"))
}

/// Default output directory of a profile: `<root>/target/qualify/<profile>`.
pub fn default_out(profile: Profile) -> PathBuf {
    workspace::tools_dir()
        .join("qualify")
        .join(profile.as_str())
}

/// Builds kvq and runs `kvq qualify --profile P --out DIR [extra]`.
///
/// # Errors
/// Prerequisites, the build, or kvq's non-zero exit (any failed check).
pub fn run(
    profile: Profile,
    out: Option<PathBuf>,
    build: BuildProfile,
    extra: &[String],
) -> Result<()> {
    let profile = profile.resolve();
    // Before the prerequisites and the kvq build (minutes on a fresh
    // clone): kvq refuses this too, but only once it was built.
    if profile == Profile::Gpu && !gpu_present() {
        return Err(XtaskError::Usage {
            flag: "--profile",
            reason: "gpu, but `nvidia-smi -L` lists no GPU (use --profile cpu, or auto)".into(),
        });
    }
    let prereq = Prerequisites::ensure()?;
    let out = match out {
        Some(o) => std::env::current_dir().map(|d| d.join(&o)).unwrap_or(o),
        None => default_out(profile),
    };
    let (exe, line) = kvq::build(build)?;
    let mut c = kvq::command(&exe, &line, &prereq);
    c.args(["qualify", "--profile", profile.as_str(), "--out"])
        .arg(&out)
        .args(extra);
    command::run(&mut c)
}
