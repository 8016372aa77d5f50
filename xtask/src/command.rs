//! Running child programs: every command is echoed before it runs so that a
//! log shows exactly what was executed, and a failure names the command line.

use std::process::{Command, Stdio};

use crate::error::{Result, XtaskError};

/// The command line of `cmd` as a shell would show it (env overrides omitted).
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| {
            let s = a.to_string_lossy();
            if s.is_empty() || s.contains(char::is_whitespace) {
                format!("'{s}'")
            } else {
                s.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` with inherited stdio; fails unless it exits 0.
///
/// # Errors
/// [`XtaskError::Spawn`] if it cannot start, [`XtaskError::CommandFailed`] on
/// a non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    let line = describe(cmd);
    eprintln!("$ {line}");
    let status = cmd.status().map_err(|source| XtaskError::Spawn {
        program: cmd.get_program().to_string_lossy().into_owned(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(XtaskError::CommandFailed {
            command: line,
            status,
        })
    }
}

/// Runs `cmd` quietly and returns its trimmed stdout; fails unless it exits 0.
///
/// # Errors
/// As [`run`].
pub fn capture(cmd: &mut Command) -> Result<String> {
    let line = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|source| XtaskError::Spawn {
            program: cmd.get_program().to_string_lossy().into_owned(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(XtaskError::CommandFailed {
            command: line,
            status: out.status,
        })
    }
}

/// True when `cmd` starts and exits 0 (output discarded). For probes such as
/// `dpkg -s libclang-dev`, where "cannot start" and "said no" mean the same.
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_quotes_args_with_spaces() {
        let mut c = Command::new("cargo");
        c.args(["test", "-p", "kv bank", ""]);
        assert_eq!(describe(&c), "cargo test -p 'kv bank' ''");
    }

    #[test]
    fn run_reports_exit_status_and_capture_returns_stdout() {
        assert_eq!(
            capture(Command::new("sh").args(["-c", "echo ' hi '"])).unwrap(),
            "hi"
        );
        let e = run(Command::new("sh").args(["-c", "exit 3"])).unwrap_err();
        assert!(e.to_string().contains("sh -c 'exit 3'"), "{e}");
        assert!(matches!(
            capture(&mut Command::new("/nonexistent/prog")).unwrap_err(),
            XtaskError::Spawn { .. }
        ));
        assert!(!succeeds(&mut Command::new("false")));
        assert!(succeeds(&mut Command::new("true")));
    }
}
