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
    let apt = |args: &[&str]| {
        let mut c = if is_root() {
            Command::new("apt-get")
        } else {
            let mut s = Command::new("sudo");
            s.args(["-n", "apt-get"]);
            s
        };
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
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

fn is_root() -> bool {
    command::capture(Command::new("id").arg("-u")).is_ok_and(|uid| uid == "0")
}
