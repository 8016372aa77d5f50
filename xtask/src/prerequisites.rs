//! Everything the build and the tests need from outside cargo, and the
//! environment that hands it to child processes.
//!
//! Policy: libclang is always required (nixl-sys does not build without it).
//! A missing NIXL runtime or nats-server is a failure in CI (`CI=true`) and a
//! printed warning elsewhere; the tests that need them then skip with a reason.
//! iproute2 (network namespaces for one fault) is installed when missing and
//! never fatal.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use crate::error::{Result, XtaskError};
use crate::nixl::NixlRuntime;
use crate::{libclang, nats, workspace};

/// Variable naming the nats-server binary for tests.
pub const NATS_ENV: &str = "KV_NATS_SERVER";
/// Variable naming the NIXL core library folder (holds `libnixl_capi.so`).
pub const NIXL_LIB_ENV: &str = "KV_NIXL_LIB_DIR";

/// What [`Prerequisites::ensure`] found or installed.
#[derive(Debug, Clone, Default)]
pub struct Prerequisites {
    /// NIXL runtime, when available.
    pub nixl: Option<NixlRuntime>,
    /// nats-server binary, when available.
    pub nats_server: Option<PathBuf>,
}

/// True when running under CI: `CI` is `true`, `1` or `yes`, any case.
/// The crates' tests use the same rule (`kv_transfer::ci_requires`); xtask
/// repeats it rather than linking kv-transfer (CUDA, NIXL bindings) into
/// the task runner.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| ci_value(&v))
}

fn ci_value(v: &str) -> bool {
    let v = v.trim();
    ["true", "1", "yes"]
        .iter()
        .any(|a| v.eq_ignore_ascii_case(a))
}

impl Prerequisites {
    /// Ensures libclang, the NIXL runtime and nats-server, installing what is missing.
    ///
    /// # Errors
    /// libclang unavailable; NIXL or nats-server unavailable under CI.
    pub fn ensure() -> Result<Self> {
        libclang::ensure()?;
        let strict = in_ci();
        let tools = workspace::tools_dir();
        let nixl = tolerate(
            strict,
            "NIXL runtime",
            NixlRuntime::ensure(&tools.join("nixl")),
        )?;
        let nats_server = tolerate(strict, "nats-server", nats::ensure(&tools))?;
        ensure_iproute2();
        // Not fatal here: only the wheel step needs it, and that step reports
        // its own failure after every Rust test has run.
        if let Err(e) = ensure_python_venv() {
            eprintln!("warning: {e}");
        }
        let me = Self { nixl, nats_server };
        me.print();
        Ok(me)
    }

    /// Sets `LD_LIBRARY_PATH` (NIXL folders prepended), `NIXL_PLUGIN_DIR`,
    /// `KV_NIXL_LIB_DIR` and `KV_NATS_SERVER` on `cmd` for what is available.
    pub fn apply(&self, cmd: &mut Command) {
        for (k, v) in self.env() {
            cmd.env(k, v);
        }
    }

    /// The variables [`Prerequisites::apply`] sets, in order.
    pub fn env(&self) -> Vec<(String, OsString)> {
        let mut env = Vec::new();
        if let Some(rt) = &self.nixl {
            let old = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
            let dirs = rt.lib_dirs().into_iter().chain(std::env::split_paths(&old));
            let joined = std::env::join_paths(dirs).expect("library paths hold no ':'");
            env.push(("LD_LIBRARY_PATH".into(), joined));
            env.push(("NIXL_PLUGIN_DIR".into(), rt.plugin_dir().into()));
            env.push((NIXL_LIB_ENV.into(), rt.lib_dirs()[0].clone().into()));
        }
        if let Some(n) = &self.nats_server {
            env.push((NATS_ENV.into(), n.clone().into()));
        }
        env
    }

    /// `export NAME=VALUE` lines for a POSIX shell (`eval "$(cargo xtask
    /// install | grep ^export)"`), one per variable of [`Prerequisites::env`],
    /// values single-quoted. `LD_LIBRARY_PATH` is the NIXL folders followed by
    /// the shell's own `$LD_LIBRARY_PATH` (expanded by the shell, not by
    /// xtask): xtask's own value is the one `cargo run` gave it, with
    /// `target/debug/deps` and the toolchain's `lib/` prepended.
    pub fn shell_exports(&self) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(rt) = &self.nixl {
            let dirs = std::env::join_paths(rt.lib_dirs()).expect("library paths hold no ':'");
            lines.push(format!(
                "export LD_LIBRARY_PATH={}\"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"",
                shell_quote(&dirs)
            ));
        }
        lines.extend(
            self.env()
                .into_iter()
                .filter(|(k, _)| k != "LD_LIBRARY_PATH")
                .map(|(k, v)| format!("export {k}={}", shell_quote(&v))),
        );
        lines
    }

    fn print(&self) {
        match &self.nixl {
            Some(rt) => eprintln!("prerequisite: NIXL runtime at {}", rt.root.display()),
            None => eprintln!("prerequisite: NIXL runtime MISSING (NIXL tests will skip)"),
        }
        match &self.nats_server {
            Some(p) => eprintln!("prerequisite: nats-server at {}", p.display()),
            None => eprintln!("prerequisite: nats-server MISSING (NATS tests will skip)"),
        }
    }
}

/// `ip` (Debian `iproute2`) for the network namespaces of the fault
/// `link_cut_mid_transfer`; installed when missing. Never fatal: without it,
/// or without the privileges namespaces need, that fault skips and says why.
fn ensure_iproute2() {
    let present = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        if let Err(e) = crate::apt::install("iproute2") {
            eprintln!("warning: iproute2 unavailable (link_cut_mid_transfer will skip): {e}");
        }
    }
}

/// Debian package that carries the default `python3`'s `ensurepip`, without
/// which `python3 -m venv` (the wheel's venv in `target/py-venv`) fails.
const PYTHON_VENV_PACKAGE: &str = "python3-venv";

/// Ensures `python3 -m venv` can create a venv with pip, which the `kv_reuse`
/// wheel's build and tests need: Debian and Ubuntu ship `ensurepip` apart
/// from `python3` (package `python3-venv`), so a machine with only
/// `python3-pip` cannot create one. Installs that package when missing.
///
/// # Errors
/// [`XtaskError::Prerequisite`] naming `python3 venv` when apt-get fails or
/// the module is still missing after it.
pub fn ensure_python_venv() -> Result<()> {
    if venv_capable("python3") {
        return Ok(());
    }
    eprintln!(
        "xtask: `python3 -m venv` would fail (no ensurepip); installing {PYTHON_VENV_PACKAGE}"
    );
    let unavailable = |reason: String| XtaskError::Prerequisite {
        what: "python3 venv",
        reason,
    };
    crate::apt::install(PYTHON_VENV_PACKAGE).map_err(|e| {
        unavailable(format!(
            "`python3` has no ensurepip and {PYTHON_VENV_PACKAGE} did not install ({e}); \
             install your Python's venv module, or put a python3 that has it first on PATH"
        ))
    })?;
    if venv_capable("python3") {
        Ok(())
    } else {
        Err(unavailable(format!(
            "{PYTHON_VENV_PACKAGE} is installed but the `python3` on PATH still has no \
             ensurepip (it is not the Debian python3; install its own venv module)"
        )))
    }
}

/// True when `python` imports `venv` and `ensurepip` (what `python -m venv`
/// needs to put pip into the new environment).
fn venv_capable(python: &str) -> bool {
    crate::command::succeeds(Command::new(python).args(["-c", "import ensurepip, venv"]))
}

/// `v` in single quotes for a POSIX shell (`'` itself as `'\\''`).
fn shell_quote(v: &std::ffi::OsStr) -> String {
    format!("'{}'", v.to_string_lossy().replace('\'', r"'\''"))
}

/// Under `strict`, an error stays an error; otherwise it is printed and
/// becomes `None`.
fn tolerate<T>(strict: bool, what: &str, r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if strict => Err(e),
        Err(e) => {
            eprintln!("warning: {what} unavailable (fatal only with CI=true): {e}");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_nixl_folders_first_and_nats_server() {
        let p = Prerequisites {
            nixl: Some(NixlRuntime {
                root: "/x/nixl".into(),
            }),
            nats_server: Some("/x/nats-server".into()),
        };
        let env = p.env();
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.to_string_lossy().into_owned())
        };
        let ld = get("LD_LIBRARY_PATH").unwrap();
        assert!(
            ld.starts_with("/x/nixl/.nixl_cu13.mesonpy.libs:/x/nixl/nixl_cu13.libs"),
            "{ld}"
        );
        assert_eq!(
            get("NIXL_PLUGIN_DIR").unwrap(),
            "/x/nixl/.nixl_cu13.mesonpy.libs/plugins"
        );
        assert_eq!(get(NATS_ENV).unwrap(), "/x/nats-server");
        assert!(Prerequisites::default().env().is_empty());
    }

    /// The printed lines go through `eval` in the user's shell: values with
    /// spaces or quotes must survive, and `LD_LIBRARY_PATH` must be the NIXL
    /// folders in front of the shell's own value, not in front of the value
    /// cargo gave xtask (which adds `target/debug/deps` and the toolchain's
    /// `lib/`, stale as soon as the target directory or toolchain changes).
    #[test]
    fn shell_exports_survive_eval_and_keep_the_shells_library_path() {
        let p = Prerequisites {
            nixl: Some(NixlRuntime {
                root: "/x/it's here/nixl".into(),
            }),
            nats_server: Some("/x/it's here/nats-server".into()),
        };
        let script = p.shell_exports().join("\n");
        let eval = |old_ld: Option<&str>| {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg("eval \"$EXPORTS\"; printf '%s|%s|%s' \"$LD_LIBRARY_PATH\" \"$NIXL_PLUGIN_DIR\" \"$KV_NATS_SERVER\"")
                .env("EXPORTS", &script);
            match old_ld {
                Some(v) => c.env("LD_LIBRARY_PATH", v),
                None => c.env_remove("LD_LIBRARY_PATH"),
            };
            crate::command::capture(&mut c).unwrap()
        };
        let core = "/x/it's here/nixl/.nixl_cu13.mesonpy.libs";
        let vendored = "/x/it's here/nixl/nixl_cu13.libs";
        assert_eq!(
            eval(Some("/usr/local/cuda/lib64")),
            format!(
                "{core}:{vendored}:/usr/local/cuda/lib64|{core}/plugins|/x/it's here/nats-server"
            )
        );
        // No trailing ':' (an empty entry means the current directory).
        assert_eq!(
            eval(None),
            format!("{core}:{vendored}|{core}/plugins|/x/it's here/nats-server")
        );
    }

    /// A python without `ensurepip` (Debian's python3 without python3-venv)
    /// is told apart from one that can build the wheel's venv.
    #[test]
    fn venv_probe_rejects_a_python_without_ensurepip() {
        assert!(venv_capable("python3"), "this machine's python3 has venv");
        let dir = std::env::temp_dir().join(format!("xtask-venv-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A python3 whose stdlib lacks ensurepip, as Debian ships it without
        // python3-venv: the real interpreter with `ensurepip` made unimportable.
        let fake = dir.join("python3");
        std::fs::write(
            &fake,
            "#!/bin/sh\nexec python3 -c 'import sys; sys.modules[\"ensurepip\"] = None; exec(sys.argv[1])' \"$2\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        // The stand-in itself runs: only ensurepip is missing.
        assert!(crate::command::succeeds(
            Command::new(&fake).args(["-c", "import venv"])
        ));
        assert!(!venv_capable(&fake.to_string_lossy()));
        assert!(!venv_capable("/nonexistent/python3"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tolerate_keeps_errors_only_when_strict() {
        let err = || -> Result<u8> {
            Err(crate::error::XtaskError::Prerequisite {
                what: "nats-server",
                reason: "test".into(),
            })
        };
        assert!(tolerate(true, "x", err()).is_err());
        assert_eq!(tolerate(false, "x", err()).unwrap(), None);
        assert_eq!(tolerate(true, "x", Ok(3)).unwrap(), Some(3));
    }
}

#[cfg(test)]
mod ci_tests {
    #[test]
    fn ci_values_match_the_crates_rule() {
        for v in ["true", "TRUE", "1", "yes", "Yes"] {
            assert!(super::ci_value(v), "{v:?}");
        }
        for v in ["", "0", "false", "no"] {
            assert!(!super::ci_value(v), "{v:?}");
        }
    }
}
