//! A child process of this test binary, killed and reaped on drop.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Env variable that turns a re-executed test binary into a child role.
pub const CHILD_ENV: &str = "KV_INTEROP_CHILD";

pub struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl ChildProc {
    /// Re-executes this test binary running only the ignored test `test`,
    /// with `CHILD_ENV=role`.
    pub fn spawn(test: &str, role: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                test,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child test process");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        // A reader thread, so that waiting for a line can time out.
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The rest of the next stdout line containing `marker` (the harness
    /// prints `test NAME ... ` before the child's first line, and its own
    /// lines are skipped).
    pub fn expect(&mut self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find(marker) {
                        return line[at + marker.len()..].trim().to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!("child did not print {marker:?} in time"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("child exited before printing {marker:?}")
                }
            }
        }
    }

    /// Sends one command line and returns the rest of the child's `OK` line.
    pub fn command(&mut self, cmd: &str) -> String {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        self.expect("OK")
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        // EOF on stdin ends the child; kill it if it does not.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `cond` holds (polling), or panics with `what`.
pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
