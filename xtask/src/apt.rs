//! Debian packages through `apt-get`, the last resort of every installer here.

use std::process::Command;

use crate::command;
use crate::error::Result;

/// `apt-get install -y PACKAGE`, running `apt-get update` once and retrying
/// when the first attempt fails (a fresh machine has no package lists).
/// Not root: goes through `sudo -n` (never prompts).
///
/// # Errors
/// The failed `apt-get` command (or `Spawn` when apt-get is absent).
pub fn install(package: &str) -> Result<()> {
    let root = is_root();
    let apt = |args: &[&str]| apt_get(root, args);
    if command::run(&mut apt(&[
        "install",
        "-y",
        "--no-install-recommends",
        package,
    ]))
    .is_ok()
    {
        return Ok(());
    }
    command::run(&mut apt(&["update"]))?;
    command::run(&mut apt(&[
        "install",
        "-y",
        "--no-install-recommends",
        package,
    ]))
}

/// Seconds apt-get waits for the dpkg lock. A fresh cloud machine often runs
/// unattended-upgrades right after boot, and parallel jobs on one machine
/// install at the same time: without a wait, apt-get fails at once with
/// "Could not get lock /var/lib/dpkg/lock-frontend".
const DPKG_LOCK_TIMEOUT_S: u32 = 300;

/// `apt-get ARGS` (through `sudo -n` unless `root`), non-interactive, waiting
/// up to [`DPKG_LOCK_TIMEOUT_S`] for the dpkg lock (apt >= 1.9.11).
fn apt_get(root: bool, args: &[&str]) -> Command {
    let mut c = if root {
        Command::new("apt-get")
    } else {
        let mut s = Command::new("sudo");
        s.args(["-n", "apt-get"]);
        s
    };
    c.arg("-o")
        .arg(format!("DPkg::Lock::Timeout={DPKG_LOCK_TIMEOUT_S}"))
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive");
    c
}

fn is_root() -> bool {
    command::capture(Command::new("id").arg("-u")).is_ok_and(|uid| uid == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock wait is on every apt-get command line, in a form apt-get
    /// accepts (it refuses a malformed `-o` before doing anything;
    /// `--version` needs no root and changes nothing).
    #[test]
    fn apt_get_waits_for_the_dpkg_lock() {
        let c = apt_get(false, &["install", "-y", "x"]);
        assert_eq!(
            command::describe(&c),
            "sudo -n apt-get -o DPkg::Lock::Timeout=300 install -y x"
        );
        if command::succeeds(Command::new("apt-get").arg("--version")) {
            let mut v = apt_get(true, &["--version"]);
            assert!(command::succeeds(&mut v), "{}", command::describe(&v));
        }
    }
}
