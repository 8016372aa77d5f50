//! A throwaway `nats-server` on a free loopback port, for tests and `qualify`.
//!
//! The binary is `$KV_NATS_SERVER`, else `nats-server` on `PATH`, else
//! `/usr/sbin/nats-server`. When none is found, [`NatsServer::start_or_skip`]
//! returns `None` with a printed reason, except under `CI=true`, where a
//! missing server is a failure (the NATS tests must run in CI).
//!
//! The server runs with JetStream (`-js`, the donor directory's key-value
//! bucket needs it), its store in a directory under the system temp dir
//! that lives as long as the [`NatsServer`] (kept across restarts, so
//! JetStream state survives [`NatsServer::restart`]) and is removed on drop.

use std::net::{SocketAddr, TcpListener, TcpStream};
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

/// Finds the server binary (see the module docs).
pub fn find_nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KV_NATS_SERVER") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let p = PathBuf::from("/usr/sbin/nats-server");
        p.is_file().then_some(p)
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
        let binary = find_nats_server()
            .ok_or("nats-server not found (set KV_NATS_SERVER or add it to PATH)")?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free loopback port: {e}"))?
            .port();
        // Port and pid make the name unique among live servers on this host.
        let store_dir =
            std::env::temp_dir().join(format!("kv-nats-js-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&store_dir)
            .map_err(|e| format!("cannot create {}: {e}", store_dir.display()))?;
        let mut s = Self {
            binary,
            port,
            child: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            store_dir,
        };
        s.spawn()?;
        Ok(s)
    }

    /// [`NatsServer::start`], or `None` with a printed reason when the binary
    /// is missing and `CI` is not `true`.
    ///
    /// # Panics
    /// When the server cannot run and `CI=true`, or when the binary exists but fails.
    pub fn start_or_skip(test: &str) -> Option<Self> {
        if find_nats_server().is_none() {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{test}: nats-server not found and CI=true: NATS tests must run in CI");
            }
            println!("SKIP {test}: nats-server not found (set KV_NATS_SERVER or add it to PATH)");
            return None;
        }
        Some(Self::start().unwrap_or_else(|e| panic!("{test}: {e}")))
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
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
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok() {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!(
                    "nats-server exited early with {status} (port {} taken?)",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop();
        Err(format!(
            "nats-server did not listen on port {} within 10 s",
            self.port
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store_dir);
    }
}
