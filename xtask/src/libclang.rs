//! libclang, which nixl-sys's build script needs for bindgen. It must exist
//! before cargo compiles nixl-sys, which is why xtask itself never depends on it.

use std::path::Path;

use crate::apt;
use crate::error::{Result, XtaskError};

/// Ensures bindgen can find libclang: `LIBCLANG_PATH` set, the Debian package
/// `libclang-dev` installed, or an LLVM install in `/usr/lib/llvm-*`; else
/// `apt-get install -y libclang-dev`.
///
/// # Errors
/// [`XtaskError::Prerequisite`] when none is present and apt-get fails.
pub fn ensure() -> Result<()> {
    if std::env::var_os("LIBCLANG_PATH").is_some()
        || apt::is_installed("libclang-dev")
        || llvm_libclang_present()
    {
        return Ok(());
    }
    apt::install("libclang-dev").map_err(|e| XtaskError::Prerequisite {
        what: "libclang",
        reason: format!(
            "no LIBCLANG_PATH, no libclang-dev package, no /usr/lib/llvm-*/lib/libclang*.so; {e}"
        ),
    })
}

fn llvm_libclang_present() -> bool {
    let Ok(entries) = std::fs::read_dir("/usr/lib") else {
        return false;
    };
    entries.flatten().any(|e| {
        e.file_name().to_string_lossy().starts_with("llvm-") && has_libclang(&e.path().join("lib"))
    })
}

fn has_libclang(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|es| {
        es.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("libclang") && n.contains(".so")
        })
    })
}
