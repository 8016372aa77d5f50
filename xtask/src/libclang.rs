//! libclang, which nixl-sys's build script needs for bindgen. It must exist
//! before cargo compiles nixl-sys, which is why xtask itself never depends on
//! nixl-sys.
//!
//! Detection asks the loader bindgen itself uses: `clang-sys` with its
//! `runtime` feature (the same crate and search bindgen runs in nixl-sys's
//! build script), so what counts as "present" is exactly what bindgen will
//! load. A name-based scan took `/usr/lib/llvm-14/lib/libclang-cpp.so.14`
//! (the C++ library, package `libclang-cpp14`) for libclang and never
//! installed `libclang-dev`; bindgen then panicked "Unable to find libclang".

use crate::apt;
use crate::error::{Result, XtaskError};

/// Ensures bindgen can load libclang; when it cannot, runs
/// `apt-get install -y libclang-dev` and checks again.
///
/// # Errors
/// [`XtaskError::Prerequisite`] when apt-get fails or libclang still cannot
/// be loaded after it (the loader's own message and the fix are included).
pub fn ensure() -> Result<()> {
    ensure_with(loadable, apt::install)
}

/// What to do when xtask could not provide libclang itself: the two ways
/// bindgen finds one.
const FIX: &str = "to fix: install libclang-dev as root (`apt-get install libclang-dev`; \
     other distributions: their libclang package), or set LIBCLANG_PATH to the folder holding \
     libclang.so";

/// [`ensure`] with the probe and the installer passed in, so the failure
/// paths can be tested without removing libclang from the machine.
fn ensure_with(
    loadable: impl Fn() -> std::result::Result<(), String>,
    install: impl FnOnce(&str) -> Result<()>,
) -> Result<()> {
    let Err(first) = loadable() else {
        return Ok(());
    };
    eprintln!("xtask: bindgen cannot load libclang ({first}); installing libclang-dev");
    install("libclang-dev").map_err(|e| XtaskError::Prerequisite {
        what: "libclang",
        reason: format!("bindgen's loader found none ({first}); {e}; {FIX}"),
    })?;
    loadable().map_err(|after| XtaskError::Prerequisite {
        what: "libclang",
        reason: format!(
            "libclang-dev is installed but bindgen's loader still finds no libclang: {after} \
             (set LIBCLANG_PATH to the folder holding libclang.so)"
        ),
    })
}

/// Ok when clang-sys's run-time loader (bindgen's) finds and opens a
/// libclang shared library, honouring `LIBCLANG_PATH` as bindgen does.
///
/// # Errors
/// The loader's message (which folders it searched, what it rejected).
pub fn loadable() -> std::result::Result<(), String> {
    if clang_sys::is_loaded() {
        return Ok(());
    }
    clang_sys::load()?;
    // Unload so a later call (after an install) searches again.
    clang_sys::unload()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without root or sudo the apt-get install fails: the error must say
    /// how to get libclang, not only which command failed.
    #[test]
    fn a_failed_install_names_both_fixes() {
        let e = ensure_with(
            || Err("couldn't find any valid shared libraries".into()),
            |pkg| {
                assert_eq!(pkg, "libclang-dev");
                Err(XtaskError::Spawn {
                    program: "sudo".into(),
                    source: std::io::ErrorKind::NotFound.into(),
                })
            },
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("cannot start `sudo`"), "{text}");
        assert!(text.contains("apt-get install libclang-dev"), "{text}");
        assert!(text.contains("LIBCLANG_PATH"), "{text}");
        // Present: nothing is installed.
        ensure_with(|| Ok(()), |_| panic!("must not install")).unwrap();
    }

    /// One test, because it sets `LIBCLANG_PATH` and the loader reads it.
    ///
    /// 1. This binary is built by the same `cargo test` that built nixl-sys,
    ///    whose build script loaded libclang through bindgen: detection that
    ///    disagrees with bindgen fails here.
    /// 2. A folder holding only `libclang-cpp.so.14` (the C++ library that
    ///    the old name scan accepted) must never be what the loader takes.
    #[test]
    fn detection_is_bindgens_loader_and_rejects_libclang_cpp() {
        assert_eq!(loadable(), Ok(()));

        let dir = std::env::temp_dir().join(format!("xtask-libclang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libclang-cpp.so.14"), b"not an ELF").unwrap();
        let old = std::env::var_os("LIBCLANG_PATH");
        std::env::set_var("LIBCLANG_PATH", &dir);
        let taken = clang_sys::load().map(|()| {
            let path = clang_sys::get_library()
                .expect("loaded")
                .path()
                .to_path_buf();
            clang_sys::unload().unwrap();
            path
        });
        match old {
            Some(v) => std::env::set_var("LIBCLANG_PATH", v),
            None => std::env::remove_var("LIBCLANG_PATH"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
        if let Ok(path) = taken {
            assert!(
                !path.starts_with(&dir),
                "took {} for libclang",
                path.display()
            );
        }
    }
}
