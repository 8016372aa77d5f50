//! The one child-process harness of the multi-process checks (feature
//! `qualify`): every check that runs a second process (a lease owner, a
//! CUDA IPC importer, a NIXL donor, a pinning donor of the fault matrix)
//! starts it through [`ChildProcess`] and talks to it in one protocol.
//!
//! The protocol: the parent starts `exe <args>` with stdout piped; the child
//! prints JSON objects, one per line, on stdout (a *hello* once it is ready,
//! or a *report* before it exits). A line may carry other text before its
//! `{` (a test harness prints `test name ... ` first), and non-JSON lines are
//! skipped. Stdin is closed, or, for a child that must live until the parent
//! is done with it, a *lifeline*: the child exits when it reads end of file
//! (the parent called [`ChildProcess::close_lifeline`], dropped the value, or
//! died). Everything else (SIGTERM, SIGKILL, exit status) is signals and
//! `wait`.
//!
//! Invariants:
//! - No child outlives its [`ChildProcess`]: drop kills and reaps it, and the
//!   kernel SIGKILLs it when the parent process dies (`PR_SET_PDEATHSIG`,
//!   prctl(2), set between fork and exec), so an interrupted test run leaves
//!   no process (and, through the bank's leases, no memory) behind.
//! - The pid a [`ChildProcess`] reports is never reused while it exists: the
//!   child is reaped only by this value, so signals go to the right process.
//!
//! PDEATHSIG follows the *thread* that spawned the child: spawn from the
//! thread that outlives it (every check here spawns and reaps in one call).
//!
//! Deliberately absent: any argv convention (each check owns its
//! subcommand and arguments) and input on stdin (children take everything in
//! argv; stdin only signals the end).

use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// What went wrong with a child process.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    /// The program could not be started.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program path as given.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// No JSON line of the expected shape arrived within `waited`.
    #[error("no {what} line from {program} within {} ms (last line: {last:?})", waited.as_millis())]
    NoLine {
        /// `hello` or `report`.
        what: &'static str,
        /// The program.
        program: String,
        /// How long the parent waited.
        waited: Duration,
        /// The last line seen that did not parse, if any.
        last: Option<String>,
    },
    /// The child exited before printing the expected line.
    #[error("{program} exited ({status}) before its {what} line (last line: {last:?})")]
    Exited {
        /// `hello` or `report`.
        what: &'static str,
        /// The program.
        program: String,
        /// Its exit status.
        status: ExitStatus,
        /// The last line seen that did not parse, if any.
        last: Option<String>,
    },
    /// A signal could not be sent (the child is gone).
    #[error("cannot signal {program} (pid {pid}): {source}")]
    Signal {
        /// The program.
        program: String,
        /// Its pid.
        pid: u32,
        /// The OS error (`ESRCH`: already exited).
        source: std::io::Error,
    },
}

impl From<ChildError> for crate::BankError {
    fn from(e: ChildError) -> Self {
        crate::BankError::Child(e.to_string())
    }
}

/// How the child's stderr is wired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildStderr {
    /// Into the parent's stderr (the child's diagnostics show in test logs).
    Inherit,
    /// Discarded.
    Null,
    /// Read on a thread; the last [`STDERR_TAIL_BYTES`] are kept for error
    /// messages ([`ChildProcess::stderr_tail`]).
    Capture,
}

/// Bytes of a captured stderr that [`ChildProcess::stderr_tail`] keeps.
pub const STDERR_TAIL_BYTES: usize = 8 << 10;

/// How the child's stdin is wired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildStdin {
    /// `/dev/null`: the child reads end of file at once.
    Closed,
    /// A pipe the parent holds open until [`ChildProcess::close_lifeline`] or
    /// drop; the child treats end of file as "exit now".
    Lifeline,
}

/// A running child process that prints JSON lines (module docs).
///
/// ```no_run
/// use kv_bank::child_process::{ChildProcess, ChildStderr};
/// use std::time::Duration;
/// #[derive(serde::Deserialize)]
/// struct Hello { pid: u32 }
/// let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
/// cmd.arg("my-child-subcommand");
/// let mut child = ChildProcess::spawn(cmd, ChildStderr::Inherit).unwrap();
/// let hello: Hello = child.next_json("hello", Duration::from_secs(30)).unwrap();
/// assert_eq!(hello.pid, child.pid());
/// child.terminate().unwrap(); // SIGTERM; drop kills and reaps in any case
/// ```
pub struct ChildProcess {
    program: String,
    child: Arc<Mutex<Child>>,
    pid: u32,
    lines: mpsc::Receiver<String>,
    stderr: Option<Arc<Mutex<String>>>,
    lifeline: Option<std::process::ChildStdin>,
}

impl std::fmt::Debug for ChildProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildProcess")
            .field("program", &self.program)
            .field("pid", &self.pid)
            .finish()
    }
}

impl ChildProcess {
    /// Starts `cmd` (stdin closed, stdout piped and read line by line on a
    /// thread, stderr as `stderr`), with SIGKILL as its parent-death signal.
    ///
    /// # Errors
    /// [`ChildError::Spawn`] when the program cannot be started.
    pub fn spawn(cmd: Command, stderr: ChildStderr) -> Result<Self, ChildError> {
        Self::spawn_with(cmd, ChildStdin::Closed, stderr)
    }

    /// [`ChildProcess::spawn`] with the stdin wiring chosen.
    ///
    /// # Errors
    /// [`ChildError::Spawn`] when the program cannot be started.
    pub fn spawn_with(
        mut cmd: Command,
        stdin: ChildStdin,
        stderr: ChildStderr,
    ) -> Result<Self, ChildError> {
        let program = cmd.get_program().to_string_lossy().into_owned();
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: the closure runs in the forked child before exec and
            // only makes the prctl(2) system call (rustix: no allocation, no
            // lock), which is async-signal-safe and touches no memory shared
            // with the parent. The setting survives exec (also the exec of
            // `ip netns exec` into the real child).
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::set_parent_process_death_signal(Some(
                        rustix::process::Signal::KILL,
                    ))
                    .map_err(std::io::Error::from)
                });
            }
        }
        let mut proc = cmd
            .stdin(match stdin {
                ChildStdin::Closed => Stdio::null(),
                ChildStdin::Lifeline => Stdio::piped(),
            })
            .stdout(Stdio::piped())
            .stderr(match stderr {
                ChildStderr::Inherit => Stdio::inherit(),
                ChildStderr::Null => Stdio::null(),
                ChildStderr::Capture => Stdio::piped(),
            })
            .spawn()
            .map_err(|source| ChildError::Spawn {
                program: program.clone(),
                source,
            })?;
        let pid = proc.id();
        let (tx, lines) = mpsc::channel();
        if let Some(out) = proc.stdout.take() {
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let stderr = proc.stderr.take().map(|err| {
            let tail = Arc::new(Mutex::new(String::new()));
            let sink = Arc::clone(&tail);
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                    let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
                    s.push_str(&line);
                    s.push('\n');
                    if s.len() > 2 * STDERR_TAIL_BYTES {
                        let cut = s.len() - STDERR_TAIL_BYTES;
                        let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                        s.drain(..cut);
                    }
                }
            });
            tail
        });
        let lifeline = proc.stdin.take();
        Ok(Self {
            program,
            child: Arc::new(Mutex::new(proc)),
            pid,
            lines,
            stderr,
            lifeline,
        })
    }

    /// Closes the lifeline ([`ChildStdin::Lifeline`]): the child reads end
    /// of file and exits. No-op for a closed stdin or a second call.
    pub fn close_lifeline(&mut self) {
        self.lifeline = None;
    }

    /// The last [`STDERR_TAIL_BYTES`] (up to twice that) of a captured
    /// stderr ([`ChildStderr::Capture`]), `"(no stderr)"` when empty or not
    /// captured.
    pub fn stderr_tail(&self) -> String {
        let s = self
            .stderr
            .as_ref()
            .map(|t| t.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default();
        if s.trim().is_empty() {
            "(no stderr)".into()
        } else {
            s
        }
    }

    /// The child's pid (not reused while `self` exists: module docs).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process, shared, for actions that must kill or wait on it from
    /// another thread (a fault injected mid-transfer).
    pub fn handle(&self) -> Arc<Mutex<Child>> {
        Arc::clone(&self.child)
    }

    /// The next stdout line that parses (from its first `{`) as `T`, skipping
    /// other lines, within `within`. `what` names the line in errors
    /// (`"hello"`, `"report"`).
    ///
    /// # Errors
    /// [`ChildError::Exited`] when the child exits first (its stdout closed),
    /// [`ChildError::NoLine`] after `within`.
    pub fn next_json<T: serde::de::DeserializeOwned>(
        &mut self,
        what: &'static str,
        within: Duration,
    ) -> Result<T, ChildError> {
        let start = Instant::now();
        let mut last = None;
        loop {
            let left = within.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find('{') {
                        if let Ok(v) = serde_json::from_str::<T>(line[at..].trim()) {
                            return Ok(v);
                        }
                    }
                    last = Some(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(ChildError::NoLine {
                        what,
                        program: self.program.clone(),
                        waited: start.elapsed(),
                        last,
                    })
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.wait_exit(within.saturating_sub(start.elapsed()));
                    return match status {
                        Some(status) => Err(ChildError::Exited {
                            what,
                            program: self.program.clone(),
                            status,
                            last,
                        }),
                        None => Err(ChildError::NoLine {
                            what,
                            program: self.program.clone(),
                            waited: start.elapsed(),
                            last,
                        }),
                    };
                }
            }
        }
    }

    /// Sends SIGTERM.
    ///
    /// # Errors
    /// [`ChildError::Signal`] when the child already exited.
    pub fn terminate(&self) -> Result<(), ChildError> {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        // Holding the lock: nobody reaps the child while the signal is sent,
        // and a child already reaped (its pid free for reuse) is never
        // signalled.
        let sent = match c.try_wait() {
            Ok(None) => i32::try_from(self.pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw)
                .ok_or(rustix::io::Errno::INVAL)
                .and_then(|pid| rustix::process::kill_process(pid, rustix::process::Signal::TERM)),
            _ => Err(rustix::io::Errno::SRCH),
        };
        drop(c);
        sent.map_err(|e| ChildError::Signal {
            program: self.program.clone(),
            pid: self.pid,
            source: e.into(),
        })
    }

    /// SIGKILLs and reaps the child now; its exit status.
    pub fn kill(&self) -> Option<ExitStatus> {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = c.kill();
        c.wait().ok()
    }

    /// Waits up to `timeout` for the child to exit on its own; kills it
    /// after that (then `None`).
    pub fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        wait_exit(&self.child, timeout)
    }
}

/// Waits up to `timeout` for `child` to exit; kills and reaps it after that
/// (then `None`). For a [`ChildProcess::handle`] held by another thread.
pub fn wait_exit(child: &Mutex<Child>, timeout: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + timeout;
    let mut c = child.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Ok(Some(s)) = c.try_wait() {
            return Some(s);
        }
        if Instant::now() >= end {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.lifeline = None;
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.args(["-c", script]);
        c
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Hello {
        n: u32,
    }

    #[test]
    fn reads_the_first_json_line_skipping_others() {
        let mut c = ChildProcess::spawn(
            sh("echo noise; echo 'test x ... {\"n\": 7}'; sleep 5"),
            ChildStderr::Null,
        )
        .unwrap();
        let h: Hello = c.next_json("hello", Duration::from_secs(5)).unwrap();
        assert_eq!(h, Hello { n: 7 });
    }

    #[test]
    fn an_exit_before_the_line_is_typed_with_the_last_line() {
        let mut c = ChildProcess::spawn(sh("echo not-json; exit 3"), ChildStderr::Null).unwrap();
        match c.next_json::<Hello>("hello", Duration::from_secs(5)) {
            Err(ChildError::Exited { status, last, .. }) => {
                assert_eq!(status.code(), Some(3));
                assert_eq!(last.as_deref(), Some("not-json"));
            }
            other => panic!("expected Exited, got {other:?}"),
        }
    }

    #[test]
    fn silence_times_out_and_drop_reaps_the_child() {
        let mut c = ChildProcess::spawn(sh("sleep 30"), ChildStderr::Null).unwrap();
        let pid = c.pid();
        assert!(matches!(
            c.next_json::<Hello>("hello", Duration::from_millis(100)),
            Err(ChildError::NoLine { .. })
        ));
        assert!(crate::reclaim::pid_alive(pid));
        drop(c);
        assert!(!crate::reclaim::pid_alive(pid));
    }

    #[test]
    fn terminate_sends_sigterm() {
        let c = ChildProcess::spawn(sh("sleep 30"), ChildStderr::Null).unwrap();
        c.terminate().unwrap();
        let status = c
            .wait_exit(Duration::from_secs(5))
            .expect("exited on SIGTERM");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(15));
        // Reaped: its pid may be reused, so it is never signalled again.
        assert!(matches!(c.terminate(), Err(ChildError::Signal { .. })));
    }

    #[test]
    fn closing_the_lifeline_ends_the_child_and_stderr_is_captured() {
        let mut c = ChildProcess::spawn_with(
            sh("echo oops >&2; echo '{\"n\": 1}'; cat >/dev/null; exit 4"),
            ChildStdin::Lifeline,
            ChildStderr::Capture,
        )
        .unwrap();
        let h: Hello = c.next_json("hello", Duration::from_secs(5)).unwrap();
        assert_eq!(h.n, 1);
        // Alive while its stdin is open (wait_exit kills it after the wait).
        assert!(c.wait_exit(Duration::from_millis(200)).is_none());
        let mut c = ChildProcess::spawn_with(
            sh("echo oops >&2; echo '{\"n\": 2}'; cat >/dev/null; exit 4"),
            ChildStdin::Lifeline,
            ChildStderr::Capture,
        )
        .unwrap();
        let _: Hello = c.next_json("hello", Duration::from_secs(5)).unwrap();
        c.close_lifeline();
        let status = c.wait_exit(Duration::from_secs(5)).expect("exits on EOF");
        assert_eq!(status.code(), Some(4));
        let t = Instant::now();
        while !c.stderr_tail().contains("oops") && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(c.stderr_tail().trim(), "oops");
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let e = ChildProcess::spawn(Command::new("/nonexistent/kv-child"), ChildStderr::Null)
            .unwrap_err();
        assert!(matches!(e, ChildError::Spawn { .. }), "{e}");
    }
}
