//! The NIXL runtime: the PyPI wheel `nixl-cu13==1.5.1` unpacked under
//! `target/nixl`, whose shared libraries nixl-sys (built with `stub-api`)
//! `dlopen`s at run time as `libnixl_capi.so`.
//!
//! The wheel has two library folders: `.nixl_cu13.mesonpy.libs` (libnixl,
//! libnixl_capi, `plugins/` with the UCX backend) and `nixl_cu13.libs`
//! (auditwheel-vendored dependencies: UCX, gRPC, etcd client, ...; UCX's own
//! transport modules in `ucx/`). Both go on `LD_LIBRARY_PATH`.

use std::path::{Path, PathBuf};

use crate::error::{Result, XtaskError};
use crate::pip;

/// The wheel this workspace pins (nixl-sys is pinned to the same 1.5.1).
pub const WHEEL_SPEC: &str = "nixl-cu13==1.5.1";
/// Library folder holding `libnixl_capi.so` and `plugins/`.
pub const CORE_LIBS: &str = ".nixl_cu13.mesonpy.libs";
/// Library folder holding vendored dependencies (UCX, gRPC, ...).
pub const VENDORED_LIBS: &str = "nixl_cu13.libs";
/// Environment variable naming a local wheel to install instead of downloading.
pub const WHEEL_OVERRIDE_ENV: &str = "KV_NIXL_WHEEL";

/// An unpacked NIXL runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlRuntime {
    /// Directory pip installed into (`target/nixl`).
    pub root: PathBuf,
}

impl NixlRuntime {
    /// The runtime at `root` if it is complete (both library folders and
    /// `libnixl_capi.so` present), else `None`.
    pub fn at(root: &Path) -> Option<Self> {
        is_complete(root).then(|| Self {
            root: root.to_path_buf(),
        })
    }

    /// Installs the wheel into `root` unless a complete runtime is already
    /// there. Uses the wheel file named by `KV_NIXL_WHEEL` when set (offline
    /// tries), else downloads [`WHEEL_SPEC`] from PyPI.
    ///
    /// # Errors
    /// pip's failure or an incomplete unpack (nothing is left at `root` then).
    pub fn ensure(root: &Path) -> Result<Self> {
        if let Some(rt) = Self::at(root) {
            return Ok(rt);
        }
        let spec = std::env::var(WHEEL_OVERRIDE_ENV).unwrap_or_else(|_| WHEEL_SPEC.to_owned());
        Self::install(root, &spec)
    }

    /// Installs `spec` (a requirement or a wheel path) into `root`.
    ///
    /// # Errors
    /// [`XtaskError::Prerequisite`] naming what to do when pip fails.
    fn install(root: &Path, spec: &str) -> Result<Self> {
        pip::install_target(spec, root, is_complete).map_err(|e| install_failed(spec, e))?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    /// Library directories for `LD_LIBRARY_PATH`, core first.
    pub fn lib_dirs(&self) -> [PathBuf; 2] {
        [self.root.join(CORE_LIBS), self.root.join(VENDORED_LIBS)]
    }

    /// Plugin directory for `NIXL_PLUGIN_DIR` (`.nixl_cu13.mesonpy.libs/plugins`).
    pub fn plugin_dir(&self) -> PathBuf {
        self.root.join(CORE_LIBS).join("plugins")
    }
}

/// pip's failure as a [`XtaskError::Prerequisite`] that says what to do:
/// pip's own message is about pip, not about how to get a NIXL runtime here.
fn install_failed(spec: &str, e: XtaskError) -> XtaskError {
    XtaskError::Prerequisite {
        what: "NIXL runtime",
        reason: format!(
            "installing `{spec}` with pip failed ({e}); without PyPI, fetch the wheel where \
             there is network (`pip download --no-deps {WHEEL_SPEC}`, for this machine's \
             Python) and set {WHEEL_OVERRIDE_ENV}=/path/to/that.whl"
        ),
    }
}

fn is_complete(root: &Path) -> bool {
    root.join(CORE_LIBS).join("libnixl_capi.so").is_file()
        && root
            .join(CORE_LIBS)
            .join("plugins")
            .join("libplugin_UCX.so")
            .is_file()
        && root.join(VENDORED_LIBS).is_dir()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under CI=true a failed install is the run's error: it must name the
    /// fix (the offline variable), not only pip's command line.
    #[test]
    fn a_failed_install_names_the_offline_fix() {
        let dir = std::env::temp_dir().join(format!("xtask-nixl-fail-{}", std::process::id()));
        let missing = dir.join("no-such-nixl.whl");
        let e = NixlRuntime::install(&dir.join("nixl"), &missing.to_string_lossy()).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("NIXL runtime"), "{text}");
        assert!(text.contains("KV_NIXL_WHEEL=/path/to/that.whl"), "{text}");
        assert!(text.contains("no-such-nixl.whl"), "{text}");
        assert!(
            !dir.join("nixl").exists(),
            "nothing left at the destination"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn incomplete_runtime_is_not_accepted() {
        let dir = std::env::temp_dir().join(format!("xtask-nixl-test-{}", std::process::id()));
        let core = dir.join(CORE_LIBS);
        std::fs::create_dir_all(core.join("plugins")).unwrap();
        std::fs::write(core.join("libnixl_capi.so"), b"").unwrap();
        assert_eq!(
            NixlRuntime::at(&dir),
            None,
            "missing UCX plugin and vendored libs"
        );
        std::fs::write(core.join("plugins/libplugin_UCX.so"), b"").unwrap();
        std::fs::create_dir_all(dir.join(VENDORED_LIBS)).unwrap();
        let rt = NixlRuntime::at(&dir).expect("complete now");
        assert_eq!(rt.lib_dirs()[0], core);
        assert_eq!(rt.plugin_dir(), core.join("plugins"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
