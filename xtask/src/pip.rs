//! PyPI packages installed with pip into a private directory (`--target`),
//! never into the user's Python environment.

use std::path::Path;
use std::process::Command;

use crate::command;
use crate::error::{Result, XtaskError};

/// The first working pip: `python3 -m pip`, `pip3`, then `pip`.
///
/// # Errors
/// [`XtaskError::Prerequisite`] when none of them runs.
fn pip() -> Result<Command> {
    let candidates: [(&str, &[&str]); 3] =
        [("python3", &["-m", "pip"]), ("pip3", &[]), ("pip", &[])];
    for (program, prefix) in candidates {
        let mut probe = Command::new(program);
        probe.args(prefix).arg("--version");
        if command::succeeds(&mut probe) {
            let mut c = Command::new(program);
            c.args(prefix)
                .args(["--disable-pip-version-check", "--no-input"]);
            return Ok(c);
        }
    }
    Err(XtaskError::Prerequisite {
        what: "pip",
        reason: "none of `python3 -m pip`, `pip3`, `pip` runs".into(),
    })
}

/// `pip install --no-deps --target DEST SPEC` published atomically: pip
/// writes into `DEST.partial`, which is renamed to `DEST` only after pip
/// succeeded and `complete` accepts the result, so an interrupted download
/// never leaves a half-populated `DEST` that a later run would trust.
///
/// `spec` is a requirement (`nixl-cu13==1.5.1`) or a local wheel path.
///
/// # Errors
/// pip's failure, an I/O error on the directories, or
/// [`XtaskError::Prerequisite`] when `complete` rejects what pip installed.
pub fn install_target(spec: &str, dest: &Path, complete: impl Fn(&Path) -> bool) -> Result<()> {
    let partial = dest.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(XtaskError::io(&partial))?;
    }
    let mut c = pip()?;
    c.args(["install", "--no-deps", "--target"])
        .arg(&partial)
        .arg(spec);
    command::run(&mut c)?;
    if !complete(&partial) {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(XtaskError::Prerequisite {
            what: "pip",
            reason: format!("`{spec}` installed but the expected files are missing"),
        });
    }
    if dest.exists() {
        std::fs::remove_dir_all(dest).map_err(XtaskError::io(dest))?;
    }
    std::fs::rename(&partial, dest).map_err(XtaskError::io(dest))
}

/// Downloads `specs` and their dependencies as wheels for CPython
/// `python_version` (`3.12`) into `dest` (`pip download --only-binary :all:`),
/// published atomically as [`install_target`] does: pip writes into
/// `DEST.partial`, renamed to `DEST` once it succeeded and holds at least
/// one `.whl`. A `dest` that already holds wheels is kept (no network).
///
/// Only pure-Python wheels (`py3-none-any`) are accepted: the folder is
/// unpacked on the device machine by `zipfile`, with no pip and no network
/// there, and a platform wheel for the wrong interpreter would import-fail.
///
/// # Errors
/// pip's failure, an I/O error, or [`XtaskError::Prerequisite`] when pip
/// downloaded nothing or a wheel that is not pure Python.
pub fn download_wheels(specs: &[&str], python_version: &str, dest: &Path) -> Result<()> {
    if wheels_in(dest).is_ok_and(|w| !w.is_empty()) {
        return Ok(());
    }
    let partial = dest.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(XtaskError::io(&partial))?;
    }
    let mut c = pip()?;
    c.args(["download", "--only-binary", ":all:", "--python-version"])
        .arg(python_version)
        .arg("-d")
        .arg(&partial)
        .args(specs);
    command::run(&mut c)?;
    let wheels = wheels_in(&partial)?;
    let impure: Vec<&String> = wheels
        .iter()
        .filter(|w| !w.ends_with("-none-any.whl"))
        .collect();
    if wheels.is_empty() || !impure.is_empty() {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(XtaskError::Prerequisite {
            what: "pip",
            reason: format!(
                "`pip download {}` gave {} wheels, not pure Python: {impure:?}",
                specs.join(" "),
                wheels.len()
            ),
        });
    }
    if dest.exists() {
        std::fs::remove_dir_all(dest).map_err(XtaskError::io(dest))?;
    }
    std::fs::rename(&partial, dest).map_err(XtaskError::io(dest))
}

/// File names of the `.whl` files in `dir`, sorted.
///
/// # Errors
/// [`XtaskError::Io`] when `dir` cannot be read.
pub fn wheels_in(dir: &Path) -> Result<Vec<String>> {
    let mut w: Vec<String> = std::fs::read_dir(dir)
        .map_err(XtaskError::io(dir))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".whl"))
        .collect();
    w.sort();
    Ok(w)
}
