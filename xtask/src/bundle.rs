//! `cargo xtask gpu-bundle`: everything a GPU machine without a Rust
//! toolchain needs to run the GPU qualification, in `.bundle/` (git-ignored,
//! carried to the device machine; at most [`CARRY_LIMIT`] bytes).
//!
//! Layout: `kvq` (release, debug info stripped), optionally `tests/*` (release
//! test binaries of the crates with GPU tests), `nixl-libs.tar.gz` (the part
//! of the NIXL wheel's two library folders that the UCX backend loads),
//! `build-info.json` (provenance kvq records) and `run.sh`, which unpacks the
//! libraries next to itself once and runs kvq with `LD_LIBRARY_PATH` set.
//!
//! The NIXL wheel unpacks to ~130 MiB, over the limit; only the `DT_NEEDED`
//! closure of `libnixl_capi.so`, the UCX and POSIX plugins and UCX's transport
//! modules is kept. UCX's InfiniBand modules (`libuct_ib*`) are left out: they
//! drag in ~22 MiB of rdma-core, and the device machines are single hosts
//! whose GPUs talk over NVLink / CUDA IPC. Compressed, the rest is ~11 MiB.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Result, XtaskError};
use crate::kvq::{self, BuildProfile};
use crate::nixl::{NixlRuntime, CORE_LIBS, VENDORED_LIBS, WHEEL_SPEC};
use crate::prerequisites::Prerequisites;
use crate::workspace::{self, Provenance};
use crate::{command, elf};

/// Carry limit of the device machine for all carried paths together, in bytes.
pub const CARRY_LIMIT: u64 = 64 << 20;
/// Crates whose release test binaries `--with-tests` adds (the ones with GPU tests).
pub const GPU_TEST_CRATES: [&str; 2] = ["kv-bank", "kv-transfer"];

/// Builds `.bundle/` and prints the device command that runs it.
///
/// # Errors
/// NIXL runtime unavailable, a failed build, I/O errors, or
/// [`XtaskError::BundleTooLarge`] (the bundle is left for inspection).
pub fn run(with_tests: bool) -> Result<()> {
    let prereq = Prerequisites::ensure()?;
    let nixl = prereq
        .nixl
        .clone()
        .ok_or_else(|| XtaskError::Prerequisite {
            what: "nixl",
            reason:
                "the bundle ships the NIXL libraries; install them first (`cargo xtask install`)"
                    .into(),
        })?;
    let (exe, build_line) = kvq::build(BuildProfile::Release)?;
    let tests = if with_tests {
        build_gpu_tests()?
    } else {
        Vec::new()
    };

    let dir = workspace::root().join(".bundle");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(XtaskError::io(&dir))?;
    }
    std::fs::create_dir_all(dir.join("tests")).map_err(XtaskError::io(&dir))?;
    copy_stripped(&exe, &dir.join("kvq"))?;
    for t in &tests {
        let name = t.file_name().expect("test executables have names");
        copy_stripped(t, &dir.join("tests").join(name))?;
    }
    pack_nixl(&nixl, &dir.join("nixl-libs.tar.gz"))?;
    write_build_info(&dir, &build_line)?;
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(XtaskError::io(&script))?;

    let size = dir_size(&dir)?;
    if size > CARRY_LIMIT {
        return Err(XtaskError::BundleTooLarge {
            path: dir,
            size,
            limit: CARRY_LIMIT,
        });
    }
    println!(
        "bundle: {} ({:.1} MiB, {} test binaries)",
        dir.display(),
        size as f64 / (1 << 20) as f64,
        tests.len()
    );
    println!("carry:  [\".bundle\"]");
    println!("device command: bash .bundle/run.sh qualify --profile gpu --out $OUT");
    // `--json` is the output flag `kvq bench --help` documents.
    println!(
        "nixl two-process: bash .bundle/run.sh bench nixl-two-process --donor-gpu 0 --target-gpu 0 --quick --json $OUT/nixl_two_process.json"
    );
    if with_tests {
        println!("device tests:   bash .bundle/run.sh tests");
    }
    Ok(())
}

/// Release test binaries of [`GPU_TEST_CRATES`], from cargo's JSON messages.
fn build_gpu_tests() -> Result<Vec<PathBuf>> {
    let mut c = workspace::cargo();
    c.args(["test", "--release", "--no-run", "--message-format=json"]);
    for k in GPU_TEST_CRATES {
        c.args(["-p", k]);
    }
    eprintln!("$ {}", command::describe(&c));
    let json = command::capture(&mut c)?;
    Ok(test_executables(&json))
}

/// Executables of test targets in cargo's `--message-format=json` output.
fn test_executables(messages: &str) -> Vec<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| m["executable"].as_str().map(PathBuf::from))
        .collect()
}

/// Copies `from` to `to` and strips debug info when `strip` exists (the
/// release profile keeps line tables, which triple the size).
fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).map_err(XtaskError::io(from))?;
    if let Err(e) = command::run(Command::new("strip").arg("--strip-debug").arg(to)) {
        eprintln!("warning: {e}; {} keeps its debug info", to.display());
    }
    Ok(())
}

/// Library files (relative to the wheel root) that the UCX backend loads:
/// the `DT_NEEDED` closure of the roots, resolved by file name inside the wheel.
pub fn nixl_closure(rt: &NixlRuntime) -> Result<BTreeSet<PathBuf>> {
    let folders = [
        PathBuf::from(CORE_LIBS),
        Path::new(CORE_LIBS).join("plugins"),
        PathBuf::from(VENDORED_LIBS),
        Path::new(VENDORED_LIBS).join("ucx"),
    ];
    let mut by_name: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut roots = Vec::new();
    for folder in &folders {
        let abs = rt.root.join(folder);
        let entries = std::fs::read_dir(&abs).map_err(XtaskError::io(&abs))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.contains(".so") || !e.path().is_file() {
                continue;
            }
            let rel = folder.join(&name);
            let is_root = match folder.file_name().and_then(|f| f.to_str()) {
                Some("plugins") => name == "libplugin_UCX.so" || name == "libplugin_POSIX.so",
                Some("ucx") => {
                    name.ends_with(".so.0.0.0")
                        && !name.contains("_ib")
                        && !name.contains("perftest")
                }
                _ => name == "libnixl_capi.so" || name == "libnixl.so",
            };
            if is_root {
                roots.push(rel.clone());
            }
            by_name.entry(name).or_insert(rel);
        }
    }
    let mut keep = BTreeSet::new();
    while let Some(rel) = roots.pop() {
        if !keep.insert(rel.clone()) {
            continue;
        }
        for soname in elf::needed_libraries(&rt.root.join(&rel))? {
            if let Some(dep) = by_name.get(&soname) {
                roots.push(dep.clone());
            }
        }
    }
    Ok(keep)
}

fn pack_nixl(rt: &NixlRuntime, archive: &Path) -> Result<()> {
    let files = nixl_closure(rt)?;
    let list = archive.with_extension("list");
    let text: String = files.iter().map(|p| format!("{}\n", p.display())).collect();
    std::fs::write(&list, text).map_err(XtaskError::io(&list))?;
    let r = command::run(
        Command::new("tar")
            .arg("czf")
            .arg(archive)
            .arg("-C")
            .arg(&rt.root)
            .arg("-T")
            .arg(&list),
    );
    std::fs::remove_file(&list).map_err(XtaskError::io(&list))?;
    eprintln!("bundle: {} NIXL library files packed", files.len());
    r
}

fn write_build_info(dir: &Path, build_line: &str) -> Result<()> {
    let p = Provenance::probe();
    let info = serde_json::json!({
        "git_sha": p.git_sha,
        "dirty": p.dirty,
        "rustc": p.rustc,
        "build_command": build_line,
        "nixl_wheel": WHEEL_SPEC,
    });
    let path = dir.join("build-info.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&info).expect("json"))
        .map_err(XtaskError::io(&path))
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)
        .map_err(XtaskError::io(dir))?
        .flatten()
    {
        let md = e.metadata().map_err(XtaskError::io(e.path()))?;
        total += if md.is_dir() {
            dir_size(&e.path())?
        } else {
            md.len()
        };
    }
    Ok(total)
}

/// The bundle's entry point. `run.sh tests [ARGS]` runs every bundled test
/// binary (with `--nocapture` so GPU checks print their numbers); any other
/// arguments go to kvq.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs this bundle's kvq (or its test binaries) without a Rust toolchain.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
libs="$here/nixl"
if [ ! -f "$libs/.complete" ]; then
  rm -rf "$libs" && mkdir -p "$libs"
  tar xzf "$here/nixl-libs.tar.gz" -C "$libs"
  touch "$libs/.complete"
fi
export LD_LIBRARY_PATH="$libs/.nixl_cu13.mesonpy.libs:$libs/nixl_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$libs/.nixl_cu13.mesonpy.libs/plugins"
export KV_NIXL_LIB_DIR="$libs/.nixl_cu13.mesonpy.libs"
export KVQ_BUILD_INFO="$here/build-info.json"
if [ "${1:-}" = "tests" ]; then
  shift
  rc=0
  for t in "$here"/tests/*; do
    [ -x "$t" ] || continue
    echo "=== $(basename "$t")"
    "$t" --nocapture --test-threads=1 "$@" || rc=1
  done
  exit $rc
fi
exec "$here/kvq" "$@"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_test_executables_from_cargo_messages() {
        let msgs = [
            r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":"/t/release/deps/kv_bank-1"}"#,
            r#"{"reason":"compiler-artifact","profile":{"test":false},"executable":"/t/release/kvq"}"#,
            r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":null}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "not json",
        ]
        .join("\n");
        assert_eq!(
            test_executables(&msgs),
            vec![PathBuf::from("/t/release/deps/kv_bank-1")]
        );
    }

    #[test]
    fn nixl_closure_of_the_installed_wheel_fits_and_skips_infiniband() {
        let Some(rt) = NixlRuntime::at(&workspace::tools_dir().join("nixl")) else {
            eprintln!("skipped: no NIXL runtime under target/nixl (run `cargo xtask install`)");
            return;
        };
        let files = nixl_closure(&rt).unwrap();
        let has = |s: &str| files.iter().any(|p| p.to_string_lossy().contains(s));
        assert!(
            has("libnixl_capi.so") && has("libplugin_UCX.so") && has("libucp-"),
            "{files:?}"
        );
        assert!(has("ucx/libuct_cuda") && has("ucx/libuct_cma"));
        assert!(
            !has("libuct_ib") && !has("libplugin_GDS") && !has("libaws"),
            "{files:?}"
        );
        let bytes: u64 = files
            .iter()
            .map(|p| rt.root.join(p).metadata().unwrap().len())
            .sum();
        assert!(bytes < 60 << 20, "closure is {bytes} bytes");
    }
}
