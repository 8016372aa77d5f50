//! `cargo xtask gpu-bundle`: everything a GPU machine without a Rust
//! toolchain needs to run the GPU qualification, in `.bundle/` (git-ignored,
//! carried to the device machine; at most [`CARRY_LIMIT`] bytes). The bundle
//! is self-contained: copied anywhere, outside any checkout, `run.sh` runs
//! from any working directory.
//!
//! Layout: `exe.tar.gz` with `kvq` and `kv-reuse-router` (release, debug info stripped; kvq's
//! `cluster` section runs the router from its own folder), optionally `tests.tar.gz` (unpacked to `tests/`: release
//! test binaries of the crates with GPU tests), `nixl-libs.tar.gz` (the part
//! of the NIXL wheel's two library folders that the UCX backend loads),
//! `data.tar.gz` (the workspace's `data/` files kvq reads, [`BUNDLED_DATA`]),
//! `nats-server.tar.gz` (the `nats-server` binary of the prerequisites, for
//! the fault `nats_server_restart`; absent when none was found),
//! `build-info.json` (provenance kvq records), `python.tar.gz` (the
//! `gpu_serving` harness package, [`PYTHON_PACKAGE`]), the `kv_reuse` wheel
//! (abi3, release: `cargo xtask wheel --release`'s), `pytests.tar.gz` and
//! `pytest-wheels/` (`run.sh pytest-gpu`, see `bundle/python.rs`) and `run.sh`, which unpacks the archives next
//! to itself once (the wheel into `python/` with the interpreter's own
//! `zipfile`, no pip) and runs kvq with `LD_LIBRARY_PATH`, `KVQ_DATA_DIR`,
//! `KV_NATS_SERVER` and `KVQ_GPU_SERVING_DIR` pointing into the bundle.
//!
//! The NIXL wheel unpacks to ~130 MiB, over the limit; only the `DT_NEEDED`
//! closure of `libnixl_capi.so`, the UCX and POSIX plugins and UCX's transport
//! modules is kept. UCX's InfiniBand modules (`libuct_ib*`) are left out: they
//! drag in ~22 MiB of rdma-core, and the device machines are single hosts
//! whose GPUs talk over NVLink / CUDA IPC. Compressed, the rest is ~11 MiB;
//! the trace adds ~0.8 MiB and nats-server ~7 MiB.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Result, XtaskError};
use crate::kvq::{self, BuildProfile};
use crate::nixl::{NixlRuntime, CORE_LIBS, VENDORED_LIBS, WHEEL_SPEC};
use crate::prerequisites::Prerequisites;
use crate::workspace::{self, Provenance};
use crate::{command, elf};

mod python;
use python::{pack_pytest_wheels, pack_pytests, pack_python};

/// Carry limit of the device machine for all carried paths together, in bytes.
pub const CARRY_LIMIT: u64 = 64 << 20;
/// Crates whose release test binaries `--with-tests` adds (the ones with GPU tests).
pub const GPU_TEST_CRATES: [&str; 2] = ["kv-bank", "kv-transfer"];
/// Features the GPU test build turns on: every `required-features` of the
/// GPU integration tests of [`GPU_TEST_CRATES`] (checked by a test below).
pub const GPU_TEST_FEATURES: [&str; 2] = ["kv-bank/qualify", "kv-transfer/qualify"];
/// Files of the workspace's `data/` folder that kvq reads (relative to
/// `data/`), packed into `data.tar.gz`; `run.sh` unpacks them to `data/`
/// next to itself and exports that folder as `KVQ_DATA_DIR` (kv-testkit's
/// `trace::DATA_DIR_ENV`). The trace's README goes along for its provenance
/// and licence. A test fails when kv-testkit names a data file missing here.
pub const BUNDLED_DATA: [&str; 2] = [
    "traces/mooncake_conversation_trace.jsonl",
    "traces/README.md",
];

/// Folder (relative to the workspace root) of the `gpu_serving` Python
/// package kvq's `gpu_serving` section runs; its `*.py` files go into
/// `python.tar.gz` as `gpu_serving/*.py`.
pub const PYTHON_PACKAGE: &str = "crates/kv-testkit/python/gpu_serving";
/// Folder (relative to the workspace root) of the `kv_reuse` wheel's pytest
/// files; its `*.py` files go into `pytests.tar.gz` (unpacked to `pytests/`),
/// which `run.sh pytest-gpu` runs.
pub const WHEEL_TESTS: &str = "crates/kv-reuse-py/tests";
/// pytest and its pure-Python dependencies, downloaded here as wheels for
/// [`DEVICE_PYTHON`] into `pytest-wheels/` (the device machine has no
/// network and no pytest; `run.sh` unpacks them with `zipfile`, no pip).
/// pip resolves the rest from `pytest`'s own requirements; `exceptiongroup`
/// and `tomli` are only required below Python 3.11, so not named here (named,
/// pip fetches tomli's compiled cp312 wheel, which `zipfile` cannot install
/// for another interpreter).
pub const PYTEST_WHEELS: [&str; 5] = ["pytest", "iniconfig", "packaging", "pluggy", "pygments"];
/// The device machine's CPython (`X.Y`), which the pytest wheels are chosen for.
pub const DEVICE_PYTHON: &str = "3.12";

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
    // kvq and the router travel gzipped (`exe.tar.gz`, unpacked to `exe/`):
    // 32 MB of binaries compress to 12, and the carry limit counts the
    // checkout too. kvq's `cluster` section runs the router from kvq's folder.
    std::fs::create_dir_all(dir.join("exe")).map_err(XtaskError::io(&dir))?;
    copy_stripped(&exe, &dir.join("exe/kvq"))?;
    let router = exe.with_file_name(kvq::ROUTER_BIN);
    copy_stripped(&router, &dir.join("exe").join(kvq::ROUTER_BIN))?;
    pack_folder(&dir, "exe")?;
    for t in &tests {
        let name = t.file_name().expect("test executables have names");
        copy_stripped(t, &dir.join("tests").join(name))?;
    }
    pack_folder(&dir, "tests")?;
    pack_nixl(&nixl, &dir.join("nixl-libs.tar.gz"))?;
    pack_data(&workspace::root().join("data"), &dir.join("data.tar.gz"))?;
    pack_python(&workspace::root(), &dir.join("python.tar.gz"))?;
    pack_pytests(&workspace::root(), &dir.join("pytests.tar.gz"))?;
    pack_pytest_wheels(&dir.join("pytest-wheels"))?;
    // A release wheel: the serving harness runs the wheel's code per
    // request; kvq's release build above shares its dependencies.
    let (wheel, took) = crate::wheel::build(crate::wheel::WheelProfile::Release)?;
    eprintln!(
        "bundle: release wheel {} (maturin {:.0} s)",
        wheel.display(),
        took.as_secs_f64()
    );
    let wheel_name = wheel.file_name().expect("a wheel path has a file name");
    std::fs::copy(&wheel, dir.join(wheel_name)).map_err(XtaskError::io(&wheel))?;
    match &prereq.nats_server {
        Some(bin) => pack_nats_server(bin, &dir.join("nats-server.tar.gz"))?,
        // Not an error outside CI (there `Prerequisites::ensure` already
        // failed): the GPU machine then skips that one fault with its reason.
        None => eprintln!(
            "warning: no nats-server to bundle; `nats_server_restart` will skip on the GPU machine"
        ),
    }
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
    carry_hint(size);
    println!("device command: bash .bundle/run.sh qualify --profile gpu --out $OUT");
    println!(
        "gpu_serving only: bash .bundle/run.sh qualify --profile gpu --only gpu_serving --out $OUT"
    );
    // `--json` is the output flag `kvq bench --help` documents.
    println!(
        "nixl two-process: bash .bundle/run.sh bench nixl-two-process --donor-gpu 0 --target-gpu 0 --quick --json $OUT/nixl_two_process.json"
    );
    if with_tests {
        println!("device tests:   bash .bundle/run.sh tests");
    }
    println!("wheel on the GPU (torch): bash .bundle/run.sh pytest-gpu");
    Ok(())
}

/// Release test binaries of [`GPU_TEST_CRATES`], from cargo's JSON messages.
fn build_gpu_tests() -> Result<Vec<PathBuf>> {
    let mut c = workspace::cargo();
    c.args(["test", "--release", "--no-run", "--message-format=json"]);
    for k in GPU_TEST_CRATES {
        c.args(["-p", k]);
    }
    // The GPU integration tests of both crates (`tests/gpu.rs`,
    // `gpu_layouts.rs`, ...) need their `qualify` harness; without it cargo
    // skips them silently and the bundle carries only the unit tests.
    c.args(["--features", &GPU_TEST_FEATURES.join(",")]);
    eprintln!("$ {}", command::describe(&c));
    let json = command::capture(&mut c)?;
    Ok(test_executables(&json))
}

/// True for a test target that exercises a GPU: the crates' unit tests
/// (`lib`) and integration tests named `gpu*` or `*vram*`. The other
/// integration tests are host-only, run in CI, and would push the bundle
/// past the 64 MiB carry limit (72 MiB with all of them).
fn is_gpu_test_target(kind: &str, name: &str) -> bool {
    kind == "lib" || name.starts_with("gpu") || name.contains("vram")
}

/// Executables of GPU test targets ([`is_gpu_test_target`]) in cargo's
/// `--message-format=json` output.
fn test_executables(messages: &str) -> Vec<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter(|m| {
            let kind = m["target"]["kind"][0].as_str().unwrap_or("");
            let name = m["target"]["name"].as_str().unwrap_or("");
            is_gpu_test_target(kind, name)
        })
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
    let files: Vec<PathBuf> = nixl_closure(rt)?.into_iter().collect();
    tar_gz(archive, &rt.root, &files)?;
    eprintln!("bundle: {} NIXL library files packed", files.len());
    Ok(())
}

/// Packs [`BUNDLED_DATA`] from `data_dir` (the workspace's `data/`) into
/// `archive`, paths relative to `data_dir`.
///
/// # Errors
/// [`XtaskError::Io`] naming the first listed file that is missing, or the
/// failed `tar`.
fn pack_data(data_dir: &Path, archive: &Path) -> Result<()> {
    let files: Vec<PathBuf> = BUNDLED_DATA.iter().map(PathBuf::from).collect();
    for f in &files {
        let abs = data_dir.join(f);
        std::fs::metadata(&abs).map_err(XtaskError::io(&abs))?;
    }
    tar_gz(archive, data_dir, &files)
}

/// Packs the `nats-server` binary at `bin` into `archive` as `nats-server`
/// (a symlink, e.g. `/usr/sbin/nats-server`, is followed).
///
/// # Errors
/// [`XtaskError::Io`] when `bin` has no parent folder or file name, or the
/// failed `tar`.
fn pack_nats_server(bin: &Path, archive: &Path) -> Result<()> {
    let bad = || {
        XtaskError::io(bin)(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file path",
        ))
    };
    let (dir, name) = (
        bin.parent().ok_or_else(bad)?,
        bin.file_name().ok_or_else(bad)?,
    );
    // Renamed on the way in, so run.sh always finds `bin/nats-server`.
    let mut c = Command::new("tar");
    c.arg("czhf").arg(archive).arg("-C").arg(dir);
    if name != "nats-server" {
        c.arg("--transform")
            .arg(format!("s|^{}$|nats-server|", name.to_string_lossy()));
    }
    c.arg(name);
    command::run(&mut c)?;
    eprintln!("bundle: nats-server packed from {}", bin.display());
    Ok(())
}

/// Packs `dir/<name>/` into `dir/<name>.tar.gz` and removes the folder
/// (binaries compress to about a third, which keeps a `--with-tests` bundle
/// under the carry limit); `run.sh` unpacks it to `<name>/` once.
fn pack_folder(dir: &Path, name: &str) -> Result<()> {
    let folder = dir.join(name);
    let mut c = Command::new("tar");
    c.arg("czf")
        .arg(dir.join(format!("{name}.tar.gz")))
        .arg("-C")
        .arg(&folder)
        .arg(".");
    command::run(&mut c)?;
    std::fs::remove_dir_all(&folder).map_err(XtaskError::io(&folder))
}

/// `tar czf archive -C base files...`, the file list handed over in a file
/// next to the archive (the NIXL closure is a long list).
fn tar_gz(archive: &Path, base: &Path, files: &[PathBuf]) -> Result<()> {
    let list = archive.with_extension("list");
    let text: String = files.iter().map(|p| format!("{}\n", p.display())).collect();
    std::fs::write(&list, text).map_err(XtaskError::io(&list))?;
    let r = command::run(
        Command::new("tar")
            .arg("czf")
            .arg(archive)
            .arg("-C")
            .arg(base)
            .arg("-T")
            .arg(&list),
    );
    std::fs::remove_file(&list).map_err(XtaskError::io(&list))?;
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

/// Warns when the bundle and the checkout's tracked files together exceed
/// [`CARRY_LIMIT`]: the device tool counts the whole working tree with the
/// carried paths, and refuses the call before starting any machine
/// (session 36: 40.6 MB of bundle with 26.2 MB of checkout). Names the
/// two slim copies (hard links, no extra disk) that fit: one without the
/// pytest files for `transfer` and `qualify`, one without nats-server for
/// `pytest-gpu`.
fn carry_hint(bundle: u64) {
    let Some(checkout) = workspace::tracked_bytes() else {
        return;
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let total = bundle + checkout;
    println!(
        "carry with the checkout's tracked files: {:.1} MiB of {:.0} MiB",
        mib(total),
        mib(CARRY_LIMIT)
    );
    if total > CARRY_LIMIT {
        println!(
            "warning: over the carry limit; carry slim copies instead:\n  \
             cp -al .bundle .bundle-q && rm -rf .bundle-q/pytest-wheels .bundle-q/pytests.tar.gz   \
             # transfer, qualify\n  \
             cp -al .bundle .bundle-p && rm -f .bundle-p/nats-server.tar.gz   # pytest-gpu"
        );
    }
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
/// binary (with `--nocapture` so GPU checks print their numbers);
/// `run.sh pytest-gpu [PYTEST ARGS]` runs the wheel's `test_gpu.py` (or the
/// given pytest arguments) with the bundled pytest; any other arguments go
/// to kvq. Everything it reads lies next to it: the archives
/// are unpacked there once (a `.complete` marker per folder), kvq's data
/// comes from `$KVQ_DATA_DIR` and nats-server from `$KV_NATS_SERVER` (a value
/// set by the caller wins), never from the working directory.
pub(crate) const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs this bundle's kvq (or its test binaries) without a Rust toolchain.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
unpack() {  # unpack ARCHIVE DIR: once per copy of the bundle
  if [ -f "$1" ] && [ ! -f "$2/.complete" ]; then
    rm -rf "$2" && mkdir -p "$2"
    tar xzf "$1" -C "$2"
    touch "$2/.complete"
  fi
}
unpack "$here/nixl-libs.tar.gz" "$here/nixl"
unpack "$here/data.tar.gz" "$here/data"
unpack "$here/nats-server.tar.gz" "$here/bin"
unpack "$here/python.tar.gz" "$here/python"
unpack "$here/tests.tar.gz" "$here/tests"
unpack "$here/exe.tar.gz" "$here/exe"
# The kv_reuse wheel (abi3) unpacked beside the harness: importable through
# KVQ_GPU_SERVING_DIR, which kvq's gpu_serving section puts on PYTHONPATH.
py="${KVQ_PYTHON:-python3}"
for whl in "$here"/kv_reuse-*.whl; do
  if [ -f "$whl" ] && [ ! -f "$here/python/.wheel-complete" ] && command -v "$py" >/dev/null; then
    "$py" -m zipfile -e "$whl" "$here/python" && touch "$here/python/.wheel-complete"
  fi
done
export KVQ_GPU_SERVING_DIR="$here/python"
libs="$here/nixl"
export LD_LIBRARY_PATH="$libs/.nixl_cu13.mesonpy.libs:$libs/nixl_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$libs/.nixl_cu13.mesonpy.libs/plugins"
export KV_NIXL_LIB_DIR="$libs/.nixl_cu13.mesonpy.libs"
export KVQ_BUILD_INFO="$here/build-info.json"
export KVQ_DATA_DIR="$here/data"
if [ -z "${KV_NATS_SERVER:-}" ] && [ -x "$here/bin/nats-server" ]; then
  export KV_NATS_SERVER="$here/bin/nats-server"
fi
# The router service binary for the wheel's test_publisher.py and the
# gpu_serving harness's router service (they look at $KVQ_ROUTER_BIN).
if [ -z "${KVQ_ROUTER_BIN:-}" ] && [ -x "$here/exe/kv-reuse-router" ]; then
  export KVQ_ROUTER_BIN="$here/exe/kv-reuse-router"
fi
if [ "${1:-}" = "pytest-gpu" ]; then
  # The kv_reuse wheel's pytest files (default: test_gpu.py, the torch CUDA
  # round trip) with the bundled pytest, unpacked once into pyvendor/ by
  # zipfile (the device has no network and no pip is needed). Other
  # arguments go to pytest; its closing line has the counts.
  shift
  vendor="$here/pyvendor"
  if [ ! -f "$vendor/.complete" ]; then
    rm -rf "$vendor" && mkdir -p "$vendor"
    for w in "$here"/pytest-wheels/*.whl; do
      [ -f "$w" ] && "$py" -m zipfile -e "$w" "$vendor"
    done
    touch "$vendor/.complete"
  fi
  unpack "$here/pytests.tar.gz" "$here/pytests"
  [ $# -gt 0 ] || set -- "$here/pytests/test_gpu.py"
  export PYTHONPATH="$vendor:$here/python:$here/pytests${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONDONTWRITEBYTECODE=1
  cd "$here/pytests"
  exec "$py" -m pytest -q -rs -p no:cacheprovider "$@"
fi
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
kvq="$here/kvq"
[ -x "$here/exe/kvq" ] && kvq="$here/exe/kvq"
exec "$kvq" "$@"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every GPU integration test of [`GPU_TEST_CRATES`] must be built by
    /// the bundle: its `required-features` (other than the crates' default
    /// `cuda` / `nixl`) must be among [`GPU_TEST_FEATURES`]. A `[[test]]`
    /// table is read line by line (name, then required-features).
    #[test]
    fn the_bundle_build_enables_every_gpu_test_target() {
        let mut checked = 0;
        for k in GPU_TEST_CRATES {
            let toml = std::fs::read_to_string(
                workspace::root().join("crates").join(k).join("Cargo.toml"),
            )
            .expect("crate manifest");
            let mut name = String::new();
            for line in toml.lines() {
                let line = line.trim();
                if let Some(v) = line.strip_prefix("name = ") {
                    name = v.trim_matches('"').to_string();
                }
                if let Some(v) = line.strip_prefix("required-features = ") {
                    if !is_gpu_test_target("test", &name) {
                        continue;
                    }
                    checked += 1;
                    for f in v.trim_matches(|c| c == '[' || c == ']').split(',') {
                        let f = f.trim().trim_matches('"');
                        let qualified = format!("{k}/{f}");
                        assert!(
                            ["cuda", "nixl"].contains(&f) || GPU_TEST_FEATURES.contains(&qualified.as_str()),
                            "GPU test `{name}` of {k} needs feature `{f}`, which the bundle build does not enable"
                        );
                    }
                }
            }
        }
        assert!(
            checked >= 4,
            "found only {checked} GPU test targets with required-features"
        );
    }

    #[test]
    fn picks_test_executables_from_cargo_messages() {
        let msgs = [
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"kv_bank"},"profile":{"test":true},"executable":"/t/release/deps/kv_bank-1"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"kvq"},"profile":{"test":false},"executable":"/t/release/kvq"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"kv_bank"},"profile":{"test":true},"executable":null}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"lifecycle"},"profile":{"test":true},"executable":"/t/release/deps/lifecycle-2"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"gpu_ipc"},"profile":{"test":true},"executable":"/t/release/deps/gpu_ipc-3"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"nixl_vram_fail_closed"},"profile":{"test":true},"executable":"/t/release/deps/nixl_vram_fail_closed-4"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "not json",
        ]
        .join("\n");
        assert_eq!(
            test_executables(&msgs),
            vec![
                PathBuf::from("/t/release/deps/kv_bank-1"),
                PathBuf::from("/t/release/deps/gpu_ipc-3"),
                PathBuf::from("/t/release/deps/nixl_vram_fail_closed-4"),
            ]
        );
    }

    /// Every file of the workspace's `data/` whose name kv-testkit's sources
    /// (kvq and the library code it runs) mention is bundled, and every
    /// bundled file exists: a bundle copied out of the checkout must not
    /// need the checkout's `data/`.
    #[test]
    fn bundle_carries_every_data_file_kvq_names() {
        let root = workspace::root();
        let mut sources = String::new();
        let mut dirs = vec![root.join("crates/kv-testkit/src")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    sources.push_str(&std::fs::read_to_string(&p).unwrap());
                }
            }
        }
        let data = root.join("data");
        let mut named = Vec::new();
        let mut dirs = vec![data.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                // README.md is mentioned everywhere; it is bundled on its own merits.
                if name != "README.md" && sources.contains(&name) {
                    named.push(p.strip_prefix(&data).unwrap().to_path_buf());
                }
            }
        }
        assert!(
            named.contains(&PathBuf::from("traces/mooncake_conversation_trace.jsonl")),
            "the scan must see the trace kvq reads: {named:?}"
        );
        for f in &named {
            assert!(
                BUNDLED_DATA.iter().any(|b| Path::new(b) == f),
                "kv-testkit names data/{} but BUNDLED_DATA lacks it",
                f.display()
            );
        }
        for b in BUNDLED_DATA {
            assert!(
                data.join(b).is_file(),
                "BUNDLED_DATA lists missing data/{b}"
            );
        }
    }

    /// A scratch folder under the system temp dir, removed on drop.
    pub(super) struct Scratch(pub(super) PathBuf);
    impl Scratch {
        pub(super) fn new(tag: &str) -> Self {
            let d = std::env::temp_dir().join(format!("xtask-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Self(d)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(super) fn write_executable(path: &Path, text: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// run.sh, copied with its archives to a folder outside the checkout and
    /// started from yet another folder, hands kvq the bundled trace and the
    /// bundled nats-server (a stand-in `kvq` prints what it was given).
    #[test]
    fn run_sh_points_kvq_at_bundled_data_and_nats_server() {
        let scratch = Scratch::new("bundle-run-sh");
        let (bundle, cwd, src) = (
            scratch.0.join("copy/.bundle"),
            scratch.0.join("cwd"),
            scratch.0.join("src"),
        );
        for d in [&bundle, &cwd, &src] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(src.join("libstub.so"), b"").unwrap();
        tar_gz(
            &bundle.join("nixl-libs.tar.gz"),
            &src,
            &[PathBuf::from("libstub.so")],
        )
        .unwrap();
        pack_data(&workspace::root().join("data"), &bundle.join("data.tar.gz")).unwrap();
        // Any name: the archive always holds `nats-server`.
        write_executable(&src.join("nats-server-2.10"), "#!/bin/sh\necho nats\n");
        pack_nats_server(
            &src.join("nats-server-2.10"),
            &bundle.join("nats-server.tar.gz"),
        )
        .unwrap();
        write_executable(
            &bundle.join("kvq"),
            "#!/bin/sh\necho \"data=$KVQ_DATA_DIR\"\necho \"nats=$KV_NATS_SERVER\"\n\
             echo \"router=$KVQ_ROUTER_BIN\"\n\
             test -s \"$KVQ_DATA_DIR/traces/mooncake_conversation_trace.jsonl\" && echo trace-ok\n\
             \"$KV_NATS_SERVER\"\necho \"args=$*\"\n",
        );
        write_executable(&src.join("kv-reuse-router"), "#!/bin/sh\n");
        tar_gz(
            &bundle.join("exe.tar.gz"),
            &src,
            &[PathBuf::from("kv-reuse-router")],
        )
        .unwrap();
        std::fs::write(bundle.join("run.sh"), RUN_SH).unwrap();
        let out = Command::new("bash")
            .arg(bundle.join("run.sh"))
            .args(["qualify", "--profile", "cpu"])
            .current_dir(&cwd)
            .env_remove("KVQ_ROUTER_BIN")
            .env_remove("KV_NATS_SERVER")
            .env_remove("KVQ_DATA_DIR")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bundle = bundle.canonicalize().unwrap();
        let want = format!(
            "data={b}/data\nnats={b}/bin/nats-server\nrouter={b}/exe/kv-reuse-router\ntrace-ok\nnats\nargs=qualify --profile cpu\n",
            b = bundle.display()
        );
        assert_eq!(stdout, want);
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
