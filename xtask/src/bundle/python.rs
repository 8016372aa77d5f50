//! What the GPU bundle carries for Python: the `gpu_serving` harness
//! (`python.tar.gz`), the `kv_reuse` wheel's pytest files (`pytests.tar.gz`)
//! and pytest itself as pure-Python wheels (`pytest-wheels/`), so that
//! `run.sh pytest-gpu` runs the wheel's torch CUDA tests on a device machine
//! with no network and no pytest.

use std::path::{Path, PathBuf};

use super::{tar_gz, DEVICE_PYTHON, PYTEST_WHEELS, PYTHON_PACKAGE, WHEEL_TESTS};
use crate::error::{Result, XtaskError};
use crate::workspace;

/// Packs the `*.py` files of [`PYTHON_PACKAGE`] under `root` into `archive`
/// as `gpu_serving/<file>` (no caches, no tests: the device runs the harness only).
///
/// # Errors
/// [`XtaskError::Io`] when the package folder cannot be read or holds no
/// `harness.py`, or the failed `tar`.
pub(super) fn pack_python(root: &Path, archive: &Path) -> Result<()> {
    let pkg = root.join(PYTHON_PACKAGE);
    let base = pkg.parent().expect("the package has a parent folder");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&pkg)
        .map_err(XtaskError::io(&pkg))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .map(|p| PathBuf::from("gpu_serving").join(p.file_name().expect("listed files have names")))
        .collect();
    files.sort();
    if !files.iter().any(|f| f.ends_with("harness.py")) {
        let missing = pkg.join("harness.py");
        return Err(XtaskError::io(&missing)(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the gpu_serving package has no harness.py",
        )));
    }
    tar_gz(archive, base, &files)
}

/// Packs the `*.py` files of [`WHEEL_TESTS`] under `root` into `archive`
/// (flat: `conftest.py`, `test_gpu.py`, the donor process and helpers;
/// not `test_docs.py`, which needs the checkout's docs).
///
/// # Errors
/// [`XtaskError::Io`] when the folder cannot be read or holds no
/// `test_gpu.py`, or the failed `tar`.
pub(super) fn pack_pytests(root: &Path, archive: &Path) -> Result<()> {
    let dir = root.join(WHEEL_TESTS);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(XtaskError::io(&dir))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .map(|p| PathBuf::from(p.file_name().expect("listed files have names")))
        // It reads docs/python.md of a checkout, which the bundle is not.
        .filter(|f| f != Path::new("test_docs.py"))
        .collect();
    files.sort();
    if !files.iter().any(|f| f.ends_with("test_gpu.py")) {
        let missing = dir.join("test_gpu.py");
        return Err(XtaskError::io(&missing)(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "the wheel's tests have no test_gpu.py",
        )));
    }
    tar_gz(archive, &dir, &files)
}

/// Copies [`PYTEST_WHEELS`] for [`DEVICE_PYTHON`] into `dest`, downloading
/// them once into `target/pytest-wheels` (reused by later bundles).
///
/// # Errors
/// The download failing (no network, not pure Python), I/O errors.
pub(super) fn pack_pytest_wheels(dest: &Path) -> Result<()> {
    let cache = workspace::tools_dir().join("pytest-wheels");
    crate::pip::download_wheels(&PYTEST_WHEELS, DEVICE_PYTHON, &cache)?;
    std::fs::create_dir_all(dest).map_err(XtaskError::io(dest))?;
    let wheels = crate::pip::wheels_in(&cache)?;
    for w in &wheels {
        std::fs::copy(cache.join(w), dest.join(w)).map_err(XtaskError::io(cache.join(w)))?;
    }
    eprintln!(
        "bundle: {} pytest wheels: {}",
        wheels.len(),
        wheels.join(" ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::super::tests::{write_executable, Scratch};
    use super::super::RUN_SH;
    use super::*;

    /// run.sh unpacks the harness package and the kv_reuse wheel into
    /// `python/` and hands kvq that folder as `KVQ_GPU_SERVING_DIR`.
    #[test]
    fn run_sh_unpacks_the_harness_and_the_wheel() {
        let scratch = Scratch::new("bundle-python");
        let (bundle, src) = (scratch.0.join(".bundle"), scratch.0.join("src"));
        std::fs::create_dir_all(src.join("kv_reuse")).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        pack_python(&workspace::root(), &bundle.join("python.tar.gz")).unwrap();
        std::fs::write(src.join("kv_reuse/__init__.py"), "").unwrap();
        let whl = bundle.join("kv_reuse-0.1.0-cp39-abi3-linux_x86_64.whl");
        let zipped = Command::new("python3")
            .args(["-m", "zipfile", "-c"])
            .arg(&whl)
            .arg("kv_reuse")
            .current_dir(&src)
            .status()
            .unwrap();
        assert!(zipped.success());
        write_executable(
            &bundle.join("kvq"),
            "#!/bin/sh
test -f \"$KVQ_GPU_SERVING_DIR/gpu_serving/harness.py\" && echo harness-ok\n\
             test -f \"$KVQ_GPU_SERVING_DIR/kv_reuse/__init__.py\" && echo wheel-ok\n\
             test -e \"$KVQ_GPU_SERVING_DIR/gpu_serving/__pycache__\" || echo no-cache\n",
        );
        std::fs::write(bundle.join("run.sh"), RUN_SH).unwrap();
        let out = Command::new("bash")
            .arg(bundle.join("run.sh"))
            .env_remove("KVQ_GPU_SERVING_DIR")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout, "harness-ok\nwheel-ok\nno-cache\n");
    }

    /// `run.sh pytest-gpu` unpacks the bundled wheels into `pyvendor/` and
    /// the tests into `pytests/`, then runs `python -m pytest` on
    /// `test_gpu.py` from there with the wheel and the tests importable (a
    /// stand-in `pytest` wheel prints what it was given).
    #[test]
    fn run_sh_pytest_gpu_runs_test_gpu_with_the_bundled_pytest() {
        let scratch = Scratch::new("bundle-pytest");
        let (bundle, src) = (scratch.0.join(".bundle"), scratch.0.join("src"));
        std::fs::create_dir_all(src.join("pytest")).unwrap();
        std::fs::create_dir_all(bundle.join("pytest-wheels")).unwrap();
        pack_pytests(&workspace::root(), &bundle.join("pytests.tar.gz")).unwrap();
        std::fs::write(
            src.join("pytest/__main__.py"),
            "import os, sys\n\
             print('pytest', ' '.join(a.rsplit('/', 1)[-1] for a in sys.argv[1:]))\n\
             print('cwd', os.path.basename(os.getcwd()))\n\
             print('paths', ' '.join(p.rsplit('/', 1)[-1] for p in sys.path[1:4]))\n",
        )
        .unwrap();
        std::fs::write(src.join("pytest/__init__.py"), "").unwrap();
        let whl = bundle.join("pytest-wheels/pytest-9.0.0-py3-none-any.whl");
        let zipped = Command::new("python3")
            .args(["-m", "zipfile", "-c"])
            .arg(&whl)
            .arg("pytest")
            .current_dir(&src)
            .status()
            .unwrap();
        assert!(zipped.success());
        write_executable(&bundle.join("kvq"), "#!/bin/sh\necho not-kvq\n");
        std::fs::write(bundle.join("run.sh"), RUN_SH).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("bash")
                .arg(bundle.join("run.sh"))
                .args(args)
                .env_remove("PYTHONPATH")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "{stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            stdout
        };
        assert_eq!(
            run(&["pytest-gpu"]),
            "pytest -q -rs -p no:cacheprovider test_gpu.py\ncwd pytests\npaths pyvendor python pytests\n"
        );
        assert!(bundle.join("pytests/conftest.py").is_file());
        assert!(!bundle.join("pytests/test_docs.py").exists());
        assert!(bundle.join("pyvendor/.complete").is_file());
        // Arguments replace the default test file; the unpack is not redone.
        assert_eq!(
            run(&["pytest-gpu", "-k", "refusals"]),
            "pytest -q -rs -p no:cacheprovider -k refusals\ncwd pytests\npaths pyvendor python pytests\n"
        );
    }
}
