//! Where things are: the workspace root, cargo's target directory, and the
//! provenance (git commit, dirty flag, rustc) recorded with every qualification.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command;

/// Workspace root: the parent of this crate's manifest directory (xtask is
/// always built from the checkout it automates).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` when set (relative paths are
/// taken from the root, as cargo does), else `<root>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => root().join(d),
        _ => root().join("target"),
    }
}

/// Directory for prerequisites installed by xtask (`nixl/`, `nats/`):
/// always `<root>/target`, shared by every `CARGO_TARGET_DIR`, so a runtime is
/// downloaded once per checkout.
pub fn tools_dir() -> PathBuf {
    root().join("target")
}

/// The cargo that runs xtask (`$CARGO`), so children use the same toolchain.
pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root());
    c
}

/// Bytes of the files `git ls-files` lists under [`root`] (what a copy of
/// the working tree carries besides ignored paths); `None` outside a git
/// checkout or when git fails.
pub fn tracked_bytes() -> Option<u64> {
    let mut c = Command::new("git");
    c.current_dir(root()).args(["ls-files", "-z"]);
    let listed = command::capture(&mut c).ok()?;
    Some(
        listed
            .split('\0')
            .filter(|f| !f.is_empty())
            .filter_map(|f| std::fs::metadata(root().join(f)).ok())
            .map(|m| m.len())
            .sum(),
    )
}

/// Build provenance handed to `kvq` through `KVQ_*` variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// `git rev-parse HEAD`, or `unknown` outside a git checkout.
    pub git_sha: String,
    /// True when `git status --porcelain` lists any change (tracked or untracked).
    pub dirty: bool,
    /// `rustc -V` of the toolchain that builds.
    pub rustc: String,
}

impl Provenance {
    /// Reads provenance of the checkout at [`root`]; unknown values become `unknown`.
    pub fn probe() -> Self {
        let git = |args: &[&str]| {
            let mut c = Command::new("git");
            c.current_dir(root()).args(args);
            command::capture(&mut c).ok()
        };
        let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        Self {
            git_sha: git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into()),
            dirty: git(&["status", "--porcelain"]).is_some_and(|s| !s.is_empty()),
            rustc: command::capture(Command::new(rustc).arg("-V"))
                .unwrap_or_else(|_| "unknown".into()),
        }
    }

    /// The `KVQ_GIT_SHA`, `KVQ_GIT_DIRTY` and `KVQ_RUSTC` variables `kvq` records.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("KVQ_GIT_SHA".into(), self.git_sha.clone()),
            ("KVQ_GIT_DIRTY".into(), self.dirty.to_string()),
            ("KVQ_RUSTC".into(), self.rustc.clone()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tracked bytes count the workspace manifest and the lock file,
    /// and nothing git ignores (the target folder alone is larger).
    #[test]
    fn tracked_bytes_counts_tracked_files_only() {
        let Some(bytes) = tracked_bytes() else {
            eprintln!("skipped: not a git checkout");
            return;
        };
        let manifest = std::fs::metadata(root().join("Cargo.toml")).unwrap().len();
        let lock = std::fs::metadata(root().join("Cargo.lock")).unwrap().len();
        assert!(bytes > manifest + lock, "{bytes} bytes");
        // The checkout is tens of MiB; a count that took in target/ (GiB) or
        // .git would be far over this.
        assert!(bytes < 512 << 20, "{bytes} bytes");
    }
}
