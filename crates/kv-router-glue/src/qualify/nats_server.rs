//! A throwaway `nats-server` on a free loopback port, for tests and `qualify`.
//!
//! The server picks its own port (`-p -1`) and reports it in a ports file
//! (`--ports_file_dir`): a port chosen here and handed over would be free
//! only until released, and two tests starting servers at once (or an
//! outgoing connection taking it as its local port) could be given the same
//! one, leaving one test talking to the other's server.
//!
//! The binary is `$KV_NATS_SERVER`, else `nats-server` on `PATH`, else
//! `/usr/sbin/nats-server`; it must be executable and report version >=
//! 2.10.0 from `--version` ([`find_nats_server`], [`NatsServerError`]). When
//! none is usable, [`NatsServer::start_or_skip`] returns `None` with a printed
//! reason, except under CI ([`kv_transfer::ci_requires`]: `CI` is
//! `true`/`1`/`yes`), where it is a failure (the NATS tests must run in CI).
//!
//! The server runs with JetStream (`-js`, the donor directory's key-value
//! bucket needs it), its store in a directory under the system temp dir
//! that lives as long as the [`NatsServer`] (kept across restarts, so
//! JetStream state survives [`NatsServer::restart`]) and is removed on drop.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `nats-server` child process; dropping it kills and reaps it.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    child: Option<Child>,
    /// Extra server arguments (authentication, TLS), kept across restarts.
    extra: Vec<String>,
    /// JetStream store directory (`-sd`), removed on drop.
    store_dir: PathBuf,
}

/// Oldest `nats-server` the tests accept: JetStream key-value semantics the
/// donor directory relies on (per-key TTL-free history, `kv` API) are those
/// of the 2.10 line; older servers fail the tests in confusing ways instead
/// of skipping.
pub const MIN_NATS_SERVER_VERSION: (u32, u32, u32) = (2, 10, 0);

/// Why no usable `nats-server` binary was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NatsServerError {
    /// No candidate: `$KV_NATS_SERVER` unset, no executable `nats-server`
    /// on `PATH`, no `/usr/sbin/nats-server`.
    #[error("nats-server not found (set KV_NATS_SERVER or add it to PATH)")]
    NotFound,
    /// The candidate (`$KV_NATS_SERVER` or `/usr/sbin/nats-server`) is a
    /// file without any executable bit, or not a regular file.
    #[error("nats-server at {path} is not an executable file")]
    NotExecutable {
        /// The rejected candidate.
        path: PathBuf,
    },
    /// `<path> --version` failed to run, exited non-zero, or printed no
    /// `v<major>.<minor>.<patch>`.
    #[error("nats-server at {path}: cannot read its version from `--version`: {reason}")]
    VersionUnreadable {
        /// The binary asked.
        path: PathBuf,
        /// What went wrong, with the output when there was one.
        reason: String,
    },
    /// The binary is older than [`MIN_NATS_SERVER_VERSION`].
    #[error("nats-server at {path} is version {version}, need >= 2.10.0")]
    TooOld {
        /// The binary asked.
        path: PathBuf,
        /// The version it reported, as `major.minor.patch`.
        version: String,
    },
}

/// Finds the server binary (see the module docs) and checks it: an
/// executable file whose `--version` reports at least
/// [`MIN_NATS_SERVER_VERSION`]. Non-executable `nats-server` files on
/// `PATH` are passed over, as a shell would.
///
/// # Errors
/// [`NatsServerError`]: nothing found, the chosen candidate not executable,
/// its version unreadable or too old.
pub fn find_nats_server() -> Result<PathBuf, NatsServerError> {
    find_in(
        std::env::var_os("KV_NATS_SERVER"),
        std::env::var_os("PATH"),
        std::path::Path::new("/usr/sbin/nats-server"),
    )
}

/// [`find_nats_server`] with its inputs given, so tests need not change the
/// process environment other NATS tests read concurrently.
fn find_in(
    explicit: Option<std::ffi::OsString>,
    path_var: Option<std::ffi::OsString>,
    fallback: &std::path::Path,
) -> Result<PathBuf, NatsServerError> {
    let path = locate(explicit, path_var, fallback)?;
    check_version(&path)?;
    Ok(path)
}

fn locate(
    explicit: Option<std::ffi::OsString>,
    path_var: Option<std::ffi::OsString>,
    fallback: &std::path::Path,
) -> Result<PathBuf, NatsServerError> {
    if let Some(p) = explicit {
        return executable(PathBuf::from(p));
    }
    let on_path = path_var.and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nats-server"))
            .find(|p| is_executable(p))
    });
    if let Some(p) = on_path {
        return Ok(p);
    }
    executable(fallback.to_path_buf())
}

fn executable(p: PathBuf) -> Result<PathBuf, NatsServerError> {
    if is_executable(&p) {
        Ok(p)
    } else if p.exists() {
        Err(NatsServerError::NotExecutable { path: p })
    } else {
        Err(NatsServerError::NotFound)
    }
}

fn is_executable(p: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn check_version(path: &std::path::Path) -> Result<(), NatsServerError> {
    let unreadable = |reason: String| NatsServerError::VersionUnreadable {
        path: path.to_path_buf(),
        reason,
    };
    let out = Command::new(path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| unreadable(e.to_string()))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(unreadable(format!("{}: {}", out.status, text.trim())));
    }
    let version = parse_version(&text)
        .ok_or_else(|| unreadable(format!("no vX.Y.Z in {:?}", text.trim())))?;
    if version < MIN_NATS_SERVER_VERSION {
        let (a, b, c) = version;
        return Err(NatsServerError::TooOld {
            path: path.to_path_buf(),
            version: format!("{a}.{b}.{c}"),
        });
    }
    Ok(())
}

/// The first `v<major>.<minor>.<patch>` in `nats-server --version`'s output
/// (`nats-server: v2.10.22`; a pre-release suffix such as `-RC.1` is ignored).
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    text.split_whitespace().find_map(|word| {
        let rest = word.strip_prefix('v')?;
        let core = rest.split(['-', '+']).next()?;
        let mut it = core.split('.').map(|n| n.parse::<u32>().ok());
        let v = (it.next()??, it.next()??, it.next()??);
        it.next().is_none().then_some(v)
    })
}

impl NatsServer {
    /// Starts a server on a free loopback port and waits until it accepts connections.
    ///
    /// # Errors
    /// A message when the binary is missing, fails to start, or does not
    /// listen within 10 s.
    pub fn start() -> Result<Self, String> {
        Self::start_with_args(&[])
    }

    /// [`NatsServer::start`] with extra `nats-server` arguments, e.g.
    /// `["--user", "kv", "--pass", "secret"]` or `--tls --tlscert ... --tlskey ...`.
    ///
    /// # Errors
    /// As [`NatsServer::start`].
    pub fn start_with_args(extra: &[&str]) -> Result<Self, String> {
        let binary = find_nats_server().map_err(|e| e.to_string())?;
        // Pid and a per-process counter make the name unique among live
        // servers on this host (the port is not known yet).
        static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let store_dir = std::env::temp_dir().join(format!("kv-nats-js-{}-{n}", std::process::id()));
        fresh_dir(&store_dir)?;
        let mut s = Self {
            binary,
            port: 0,
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            store_dir,
        };
        s.spawn()?;
        Ok(s)
    }

    /// [`NatsServer::start`], or `None` with a printed `SKIP` reason when no
    /// usable binary is found ([`find_nats_server`]) and this is not CI
    /// ([`kv_transfer::ci_requires`]).
    ///
    /// # Panics
    /// When no usable server is found under CI, or when the binary is usable
    /// but fails to start.
    pub fn start_or_skip(test: &str) -> Option<Self> {
        if let Err(e) = find_nats_server() {
            if kv_transfer::ci_requires() {
                panic!("{test}: {e}, under CI: NATS tests must run in CI");
            }
            println!("SKIP {test}: {e}");
            return None;
        }
        Some(Self::start().unwrap_or_else(|e| panic!("{test}: {e}")))
    }

    /// Starts the child: on the port of an earlier start (a restart), else
    /// on one the server picks and reports in its ports file.
    fn spawn(&mut self) -> Result<(), String> {
        // Empty: a ports file of the previous start names an old port.
        let ports_dir = self.store_dir.join("ports");
        fresh_dir(&ports_dir)?;
        let mut cmd = Command::new(&self.binary);
        let port = if self.port == 0 {
            "-1".to_string()
        } else {
            self.port.to_string()
        };
        cmd.args(["-a", "127.0.0.1", "-p", &port])
            .arg("--ports_file_dir")
            .arg(&ports_dir);
        // A configuration file (`-c`) brings its own `jetstream` block;
        // nats-server refuses a store dir given twice.
        if !self.extra.iter().any(|a| a == "-c" || a == "--config") {
            cmd.arg("-js").arg("-sd").arg(&self.store_dir);
        }
        let child = cmd
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            // The ports file is written once the client listener is bound.
            if let Some(port) = read_ports_file(&ports_dir) {
                let addr = SocketAddr::from(([127, 0, 0, 1], port));
                if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                    self.port = port;
                    return Ok(());
                }
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!(
                    "nats-server exited early with {status} (-p {port})"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        Err(format!(
            "nats-server did not report a listening port in {} within 10 s",
            ports_dir.display()
        ))
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (clients start reconnecting).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a stopped server again on the same port.
    ///
    /// # Errors
    /// As [`NatsServer::start`].
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        self.spawn()
    }
}

/// Creates `dir` empty. A directory of that name left by an earlier
/// process is removed first: a process killed before [`NatsServer`]'s drop
/// leaves its store behind, and a later process given the same pid (pids
/// are reused, and each process counts its servers from 0) would otherwise
/// start its server on that process's JetStream state (its buckets and
/// donor records).
fn fresh_dir(dir: &std::path::Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot remove stale {}: {e}", dir.display())),
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// The client port in the one `*.ports` file of `dir`, written by
/// `nats-server --ports_file_dir` as `{"nats":["nats://127.0.0.1:<port>"],...}`.
fn read_ports_file(dir: &std::path::Path) -> Option<u16> {
    let entry = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .find(|e| e.path().extension().is_some_and(|x| x == "ports"))?;
    let text = std::fs::read_to_string(entry.path()).ok()?;
    let doc: serde_json::Value = serde_json::from_str(&text).ok()?;
    let url = doc.get("nats")?.as_array()?.first()?.as_str()?;
    url.rsplit_once(':')?.1.parse().ok()
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store_dir);
    }
}

#[cfg(test)]
#[path = "nats_server_tests.rs"]
mod tests;
