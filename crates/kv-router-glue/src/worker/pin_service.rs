//! Donor side of the cross-process source-pin protocol: a server on a Unix
//! socket (same host) or TCP (another host) that pins a [`BankManager`]'s
//! slots for targets in other processes.
//!
//! A target connects to the donor's control endpoint (`unix:<path>` or
//! `tcp:<host>:<port>`; over TCP it first passes the pre-shared-key
//! challenge of [`crate::PinAuthKey`], see `pin_transport::auth`), sends
//! [`PinClientMessage::Pin`] frames and gets [`PinDonorMessage::Granted`] or
//! [`PinDonorMessage::Refused`] back; while granted, the service holds a real
//! [`kv_bank::ManagerPin`] from [`BankManager::pin_hint`], so the bank never
//! evicts, reuses or frees those slots. A pin ends at the first of:
//! - the target's [`PinClientMessage::Release`] (answered by
//!   [`PinDonorMessage::Released`]);
//! - the connection closing, for any reason (a target that dies never leaves
//!   a pin behind: the kernel closes its socket, the read returns, the
//!   connection's pins drop);
//! - [`PinServiceConfig::max_hold`] after the grant (the release then reports
//!   `expired: true`, so the target knows the slots were not protected
//!   throughout and must not trust what it read);
//! - [`PinService::shutdown`].
//!
//! A connection serves any number of pins, one after another or at once: a
//! target keeps its connection after a release for its next pin (saving the
//! connect, this service's thread start and, over TCP, the key exchange).
//! At the connection limit, a connection that served a frame, holds no pin
//! and waits for the next is closed to admit the new one, so kept
//! connections never cost a target a refusal (one that never sent a whole
//! frame is not closed so: it is not a kept connection). Over TCP the
//! eviction waits until the newcomer proved the key: an over-limit TCP
//! connection is admitted *provisionally* when an idle one exists (at most
//! [`MAX_PROVISIONAL`] at once), does the key exchange, and only then
//! closes an idle connection, or gets `too_many_pins` when none is idle
//! any more; so a peer without the key cannot close targets' kept
//! connections.
//!
//! Threads: one accept thread, one thread per connection, at most
//! [`PinServiceConfig::max_connections`] with a pin or a frame in progress,
//! and one refuser thread: a
//! connection over the limit gets one `too_many_pins` refusal, written by
//! the refuser (never by the accept thread, which does no socket I/O beyond
//! `accept`, so one target that does not read cannot stall every other
//! target's connect), and is closed; when more of them wait than the
//! refuser's queue holds, the excess is closed without a frame (the target
//! reads end-of-stream, which it treats as a refusal). Nothing polls: a connection thread
//! blocks in `read` with a timeout equal to its earliest pin deadline, and
//! shutdown wakes it by shutting its socket down. [`PinService::shutdown`]
//! (also run on drop) joins every thread, closes every socket and removes the
//! socket file.
//!
//! A Unix socket file is made 0600 right after bind, and whatever connected
//! in between is closed unserved, so only the donor's user (and root) can
//! pin. A TCP endpoint cannot be bound without a key, and a connection that
//! does not prove the key within `io_timeout` is closed before any pin
//! frame is read; over-limit TCP connections are closed without a frame
//! (nothing is written to a peer that has not authenticated).
//!
//! Deciding whether to pin reads only the slot table (`pin_hint`), never
//! bank memory: a stale, reused or closed request is refused without a
//! byte of the bank being touched.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_bank::{BankManager, ManagerPin};
use kv_descriptor::{
    encode_pin_frame, split_pin_frame, PinClientMessage, PinDonorMessage, PinGrant, PinRefusal,
    PinRefusalReason, PinReleased, PinRequest, Wire,
};
use parking_lot::{Condvar, Mutex};

use crate::pin_transport::auth::{donor_handshake, PinAuthKey};
use crate::pin_transport::{PinEndpointError, PinListener, PinStream, WakeAddr};

mod connection;
mod listen;
mod refusals;

use connection::{claim_for_eviction, refusal, send, serve_connection};

/// Mode of a donor's Unix socket file: owner read/write only (connecting
/// needs write permission), so other users cannot pin.
pub const UNIX_SOCKET_MODE: u32 = 0o600;

/// Over-limit TCP connections admitted at once to prove the key before
/// they may close an idle connection (see the module docs); more are closed
/// at once, as when no connection is idle. Each costs one thread for at most
/// [`PinServiceConfig::io_timeout`].
pub const MAX_PROVISIONAL: usize = 4;

/// Limits of a [`PinService`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinServiceConfig {
    /// Connections served at once (each is one thread). Default 64.
    pub max_connections: usize,
    /// Pins held at once over all connections; more are refused with
    /// `too_many_pins`. Default 1024.
    pub max_pins: usize,
    /// Longest time one pin is held after its grant. Default 30 s: two
    /// orders of magnitude above a fetch (a 2 GiB prefix at the gather
    /// kernel's ~300 GB/s takes ~7 ms; over NIXL/TCP at 1 GB/s, ~2 s), and
    /// short enough that a wedged target cannot keep donor slots forever.
    pub max_hold: Duration,
    /// How long a connection waits for the rest of a started frame, and for
    /// a reply to be written, before it is dropped. Default 5 s.
    pub io_timeout: Duration,
}

impl Default for PinServiceConfig {
    fn default() -> Self {
        Self {
            max_connections: 64,
            max_pins: 1024,
            max_hold: Duration::from_secs(30),
            io_timeout: Duration::from_secs(5),
        }
    }
}

/// Counters of a [`PinService`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinServiceStats {
    /// Pins granted.
    pub granted: u64,
    /// Requests refused (any reason).
    pub refused: u64,
    /// Pins released by the target.
    pub released: u64,
    /// Pins dropped at `max_hold`.
    pub expired: u64,
    /// Pins dropped because their connection closed.
    pub dropped_on_disconnect: u64,
    /// Connections accepted (including refused ones).
    pub connections: u64,
    /// Connections refused at the limit.
    pub connections_refused: u64,
    /// Frames refused as malformed (bad length or body).
    pub malformed: u64,
    /// TCP connections closed because they did not prove the key (wrong
    /// key, no key, or no proof within `io_timeout`).
    pub auth_refused: u64,
    /// Idle connections (no pin held, kept by their target for its next
    /// pin) closed at the connection limit to admit a new one.
    pub idle_closed: u64,
}

/// Why a [`PinService`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum PinServiceError {
    /// The endpoint is not a usable `unix:<path>` or `tcp:<host>:<port>`.
    #[error("pin service endpoint: {0}")]
    Endpoint(#[from] PinEndpointError),
    /// Another pin service accepts on this Unix socket path.
    #[error("pin service endpoint {endpoint}: another service is listening there")]
    InUse {
        /// The endpoint.
        endpoint: String,
    },
    /// Something other than a socket (a regular file, directory, symlink,
    /// ...) is at the Unix endpoint's path. It is left untouched: only a
    /// stale socket is ever replaced.
    #[error(
        "pin service endpoint {endpoint}: {path} is a {found}, not a socket; \
         refusing to replace it (choose another path)"
    )]
    NotASocket {
        /// The endpoint.
        endpoint: String,
        /// The path the endpoint names.
        path: PathBuf,
        /// What is there (`regular file`, `directory`, `symbolic link`, ...).
        found: &'static str,
    },
    /// A `tcp:` endpoint was given no key ([`PinService::bind_authenticated`]).
    #[error("pin service endpoint {endpoint}: TCP requires a pre-shared key (`auth_key`)")]
    AuthRequired {
        /// The endpoint.
        endpoint: String,
    },
    /// Binding or configuring the socket failed.
    #[error("pin service socket {path}: {op}: {source}")]
    Socket {
        /// Socket path, or the TCP address.
        path: PathBuf,
        /// What failed (`bind`, `spawn`, ...).
        op: &'static str,
        /// OS error.
        source: std::io::Error,
    },
}

#[derive(Default)]
struct Counters {
    granted: AtomicU64,
    refused: AtomicU64,
    released: AtomicU64,
    expired: AtomicU64,
    dropped_on_disconnect: AtomicU64,
    connections: AtomicU64,
    connections_refused: AtomicU64,
    malformed: AtomicU64,
    auth_refused: AtomicU64,
    idle_closed: AtomicU64,
}

struct Conn {
    /// A clone of the connection's socket, to wake its thread on shutdown;
    /// taken (closed) by the thread when it ends.
    wake: Option<PinStream>,
    handle: Option<JoinHandle<()>>,
    /// Set by the connection's thread while it waits for a frame holding
    /// no pin after serving one (a target keeping the connection for its
    /// next pin); the
    /// accept thread may then close it to admit a new connection
    /// ([`evict_idle`]).
    idle: Arc<AtomicBool>,
}

struct Shared {
    bank: Arc<BankManager>,
    config: PinServiceConfig,
    endpoint: String,
    /// The socket file (Unix endpoints), removed at shutdown.
    path: Option<PathBuf>,
    wake_addr: WakeAddr,
    /// The pre-shared key every TCP connection must prove.
    auth: Option<PinAuthKey>,
    stopping: AtomicBool,
    draining: AtomicBool,
    pins: AtomicUsize,
    pins_changed: Condvar,
    pins_lock: Mutex<()>,
    live_connections: AtomicUsize,
    /// Over-limit TCP connections doing the key exchange before they may
    /// evict an idle one (at most [`MAX_PROVISIONAL`]).
    provisional: AtomicUsize,
    next_pin: AtomicU64,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, Conn>>,
    counters: Counters,
    /// Writes an over-limit refusal (on the refuser thread); `send` except
    /// in tests, which stall it.
    refusal_writer: refusals::RefusalWriter,
}

/// A running donor pin service on a Unix socket or a TCP port.
///
/// Each granted [`PinClientMessage::Pin`] holds a real [`kv_bank::ManagerPin`]
/// (the bank cannot evict, reuse or free those slots) until the first of:
/// the target's release, its connection closing (a dead target leaks no
/// pin), [`PinServiceConfig::max_hold`] after the grant (the release then
/// reports `expired`), or [`PinService::shutdown`]. Requests are decided by
/// [`BankManager::pin_hint`] from the slot table alone; refusals carry a
/// [`PinRefusalReason`]. One accept thread plus one thread per connection
/// (at most [`PinServiceConfig::max_connections`]); shutdown (also on drop)
/// joins them all, closes every socket and removes the socket file. Over
/// TCP ([`PinService::bind_authenticated`]) every connection must first
/// prove the pre-shared key.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use kv_router_glue::{PinService, PinServiceConfig};
/// # fn bank() -> Arc<kv_bank::BankManager> { unimplemented!() }
/// let service = PinService::bind(bank(), "unix:/tmp/kv-d0.sock", PinServiceConfig::default()).unwrap();
/// // Publish `service.endpoint()` as the hint's `donor_control_endpoint`.
/// assert_eq!(service.endpoint(), "unix:/tmp/kv-d0.sock");
/// service.shutdown(Duration::from_millis(500)); // drains, joins, removes the socket
/// ```
pub struct PinService {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    refuser: Option<JoinHandle<()>>,
    /// The process that bound the endpoint and started the threads: a
    /// forked child inherits this value but neither the threads nor the
    /// socket file, so there stopping only forgets them
    /// ([`PinService::shutdown`]).
    creator: kv_bank::CreatorProcess,
}

impl std::fmt::Debug for PinService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinService")
            .field("endpoint", &self.shared.endpoint)
            .field("active_pins", &self.active_pins())
            .finish()
    }
}

impl PinService {
    /// Binds `endpoint` (`unix:<path>`, or a plain absolute path) and starts
    /// serving pins on `bank`. The socket file is mode
    /// [`UNIX_SOCKET_MODE`] (0600).
    ///
    /// A stale socket file at the path (one nobody accepts on) is replaced;
    /// a live one is an error, so two donors never share an endpoint. Any
    /// other file at the path (regular file, directory, symlink) is left
    /// alone and refused.
    ///
    /// # Errors
    /// [`PinServiceError::Endpoint`] for a bad endpoint;
    /// [`PinServiceError::InUse`] for a path another service listens on;
    /// [`PinServiceError::NotASocket`] for a path holding anything but a
    /// socket;
    /// [`PinServiceError::AuthRequired`] for a `tcp:` endpoint (use
    /// [`PinService::bind_authenticated`]); [`PinServiceError::Socket`] when
    /// bind, chmod or the accept thread fails.
    pub fn bind(
        bank: Arc<BankManager>,
        endpoint: &str,
        config: PinServiceConfig,
    ) -> Result<Self, PinServiceError> {
        Self::bind_with_refusal_writer(bank, endpoint, config, None, send)
    }

    /// [`PinService::bind`] that also accepts `tcp:<host>:<port>`: every TCP
    /// connection must prove `key` (HMAC-SHA256 challenge-response, see
    /// [`PinAuthKey`]) before a pin frame is read. Port 0 picks a free port;
    /// [`PinService::endpoint`] then names the bound one (`tcp:<ip>:<port>`).
    /// On a Unix endpoint the key is not used (the socket's file mode is
    /// the control there). Bind the address targets reach (the host's
    /// private-network IP): bound to `0.0.0.0` the endpoint reads
    /// `tcp:0.0.0.0:<port>`, and the deployment must publish the host's
    /// address in its place.
    ///
    /// # Errors
    /// As [`PinService::bind`], without `AuthRequired`.
    pub fn bind_authenticated(
        bank: Arc<BankManager>,
        endpoint: &str,
        config: PinServiceConfig,
        key: PinAuthKey,
    ) -> Result<Self, PinServiceError> {
        Self::bind_with_refusal_writer(bank, endpoint, config, Some(key), send)
    }

    /// [`PinService::bind`] with the over-limit refusal written by `writer`
    /// (tests stall it to show the accept loop does not wait for it).
    pub(crate) fn bind_with_refusal_writer(
        bank: Arc<BankManager>,
        endpoint: &str,
        config: PinServiceConfig,
        auth: Option<PinAuthKey>,
        writer: refusals::RefusalWriter,
    ) -> Result<Self, PinServiceError> {
        let (listener, endpoint, path, wake_addr) = listen::listen(endpoint, auth.is_some())?;
        let path_for_err = path.clone().unwrap_or_else(|| PathBuf::from(&endpoint));
        let sock_err = |op, source| PinServiceError::Socket {
            path: path_for_err.clone(),
            op,
            source,
        };
        let remove_file = {
            let p = path.clone();
            move || {
                if let Some(p) = &p {
                    let _ = std::fs::remove_file(p);
                }
            }
        };
        let shared = Arc::new(Shared {
            bank,
            config,
            endpoint,
            path,
            wake_addr,
            auth,
            stopping: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            pins: AtomicUsize::new(0),
            pins_changed: Condvar::new(),
            pins_lock: Mutex::new(()),
            live_connections: AtomicUsize::new(0),
            provisional: AtomicUsize::new(0),
            next_pin: AtomicU64::new(1),
            next_conn: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            refusal_writer: writer,
        });
        let (refusals, refuser) = refusals::start(shared.clone()).map_err(|e| {
            remove_file();
            sock_err("spawn refuser thread", e)
        })?;
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kv-pin-accept".into())
            .spawn(move || accept_loop(&s, &listener, &refusals))
            .map_err(|e| {
                remove_file();
                sock_err("spawn accept thread", e)
            })?;
        Ok(Self {
            shared,
            accept: Some(accept),
            refuser: Some(refuser),
            creator: kv_bank::CreatorProcess::current(),
        })
    }

    /// The endpoint to publish in hints (`unix:<path>` as given, or
    /// `tcp:<ip>:<port>` of the bound socket).
    pub fn endpoint(&self) -> &str {
        &self.shared.endpoint
    }

    /// Pins held now over all connections.
    pub fn active_pins(&self) -> usize {
        self.shared.pins.load(Ordering::SeqCst)
    }

    /// Connections being served now.
    pub fn active_connections(&self) -> usize {
        self.shared.live_connections.load(Ordering::SeqCst)
    }

    /// Of [`PinService::active_connections`], those holding no pin and
    /// waiting for a frame (kept by their targets for the next pin; closed
    /// at the connection limit to admit a new one).
    pub fn idle_connections(&self) -> usize {
        let conns = self.shared.conns.lock();
        conns
            .values()
            .filter(|c| c.wake.is_some() && c.idle.load(Ordering::SeqCst))
            .count()
    }

    /// Counters since start.
    pub fn stats(&self) -> PinServiceStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::SeqCst);
        PinServiceStats {
            granted: l(&c.granted),
            refused: l(&c.refused),
            released: l(&c.released),
            expired: l(&c.expired),
            dropped_on_disconnect: l(&c.dropped_on_disconnect),
            connections: l(&c.connections),
            connections_refused: l(&c.connections_refused),
            malformed: l(&c.malformed),
            auth_refused: l(&c.auth_refused),
            idle_closed: l(&c.idle_closed),
        }
    }

    /// Waits up to `timeout` until no pin is held (for tests and drains).
    /// Returns true when none is.
    pub fn wait_no_pins(&self, timeout: Duration) -> bool {
        self.shared.wait_no_pins(timeout)
    }

    /// Stops the service: new pin requests are refused (`bank_closed`) at
    /// once, pins still held get up to `drain` to be released by their
    /// targets, then every connection is closed (dropping its pins), every
    /// thread joined and the socket file removed. Returns the counters.
    ///
    /// In a process forked from the one that bound it (also when such a
    /// child drops it) nothing of that happens: the service, its threads and
    /// its socket file are the creator's, still serving there. The child
    /// only forgets the thread handles it inherited.
    pub fn shutdown(mut self, drain: Duration) -> PinServiceStats {
        self.stop(drain);
        self.stats()
    }

    fn stop(&mut self, drain: Duration) {
        if !self.creator.is_current() {
            self.forget_inherited();
            return;
        }
        let Some(accept) = self.accept.take() else {
            return;
        };
        let s = &self.shared;
        s.draining.store(true, Ordering::SeqCst);
        s.wait_no_pins(drain);
        s.stopping.store(true, Ordering::SeqCst);
        // Wakes the accept thread out of `accept`; it sees `stopping` and
        // exits, closing the listener.
        s.wake_addr.poke();
        let _ = accept.join();
        // The accept thread held the refusal queue's sender: the refuser
        // now skips what is queued (stopping) and ends.
        if let Some(r) = self.refuser.take() {
            let _ = r.join();
        }
        let conns: Vec<Conn> = s.conns.lock().drain().map(|(_, c)| c).collect();
        for c in &conns {
            if let Some(w) = &c.wake {
                let _ = w.shutdown(std::net::Shutdown::Both);
            }
        }
        for mut c in conns {
            if let Some(h) = c.handle.take() {
                let _ = h.join();
            }
        }
        if let Some(p) = &s.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl PinService {
    /// A forked child's stop: joining the creator's threads would panic
    /// (they do not exist here), waking them would poke the creator's
    /// listener, and removing the socket file would cut the creator's
    /// targets off. Their handles are forgotten instead, not dropped (a
    /// dropped handle detaches a thread id that means nothing here).
    fn forget_inherited(&mut self) {
        for handle in [self.accept.take(), self.refuser.take()]
            .into_iter()
            .flatten()
        {
            let _ = self.creator.join_or_forget(handle);
        }
        // The connection map's lock was copied with the process and may
        // have been held by a creator's thread then: only taken if free.
        // Otherwise `Shared` is never dropped here, so its connection
        // handles are not either.
        match self.shared.conns.try_lock() {
            Some(mut conns) => {
                for (_, mut c) in conns.drain() {
                    if let Some(h) = c.handle.take() {
                        let _ = self.creator.join_or_forget(h);
                    }
                }
            }
            None => std::mem::forget(self.shared.clone()),
        }
    }
}

impl Drop for PinService {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

impl Shared {
    fn wait_no_pins(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut g = self.pins_lock.lock();
        while self.pins.load(Ordering::SeqCst) > 0 {
            if self.pins_changed.wait_until(&mut g, end).timed_out() {
                return self.pins.load(Ordering::SeqCst) == 0;
            }
        }
        true
    }

    fn pins_dropped(&self, n: usize) {
        if n == 0 {
            return;
        }
        let _g = self.pins_lock.lock();
        self.pins.fetch_sub(n, Ordering::SeqCst);
        self.pins_changed.notify_all();
    }
}

fn accept_loop(
    s: &Arc<Shared>,
    listener: &PinListener,
    refusals: &std::sync::mpsc::SyncSender<PinStream>,
) {
    loop {
        let accepted = listener.accept();
        if s.stopping.load(Ordering::SeqCst) {
            return;
        }
        // Joins connection threads that ended, so finished handles do not pile up.
        s.conns.lock().retain(|_, c| {
            if c.handle.as_ref().is_some_and(|h| h.is_finished()) {
                if let Some(h) = c.handle.take() {
                    let _ = h.join();
                }
                return false;
            }
            true
        });
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!("pin service accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        s.counters.connections.fetch_add(1, Ordering::SeqCst);
        let _ = stream.set_write_timeout(Some(s.config.io_timeout));
        let over = s.live_connections.fetch_add(1, Ordering::SeqCst) >= s.config.max_connections;
        let admission = match (over, stream.is_tcp()) {
            (false, _) => Some(Admission::Within),
            // Not authenticated yet: it may close an idle connection only
            // after the key exchange (`serve_connection`).
            (true, true) => admit_provisionally(s).then_some(Admission::Provisional),
            (true, false) => evict_idle(s).then_some(Admission::Within),
        };
        let Some(admission) = admission else {
            s.live_connections.fetch_sub(1, Ordering::SeqCst);
            refusals::hand_over(s, refusals, stream);
            continue;
        };
        let Ok(wake) = stream.try_clone() else {
            s.live_connections.fetch_sub(1, Ordering::SeqCst);
            continue;
        };
        let id = s.next_conn.fetch_add(1, Ordering::SeqCst);
        let idle = Arc::new(AtomicBool::new(false));
        // Registered before the thread starts, so shutdown always sees it.
        s.conns.lock().insert(
            id,
            Conn {
                wake: Some(wake),
                handle: None,
                idle: idle.clone(),
            },
        );
        let sc = s.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kv-pin-conn-{id}"))
            .spawn(move || {
                serve_connection(&sc, stream, &idle, admission);
                if let Some(c) = sc.conns.lock().get_mut(&id) {
                    c.wake = None;
                }
                sc.live_connections.fetch_sub(1, Ordering::SeqCst);
            });
        match spawned {
            Ok(h) => {
                if let Some(c) = s.conns.lock().get_mut(&id) {
                    c.handle = Some(h);
                }
            }
            Err(e) => {
                tracing::warn!("pin service: cannot spawn a connection thread: {e}");
                s.conns.lock().remove(&id);
                s.live_connections.fetch_sub(1, Ordering::SeqCst);
                if admission == Admission::Provisional {
                    s.provisional.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// How an accepted connection was let in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Admission {
    /// Within the limit (or an idle connection was closed for it).
    Within,
    /// Over the limit, TCP: it must prove the key, then close an idle
    /// connection ([`evict_idle`]) or be refused; counted in
    /// `Shared::provisional` until then.
    Provisional,
}

/// Accept thread, at the limit, for a TCP connection: true (counted in
/// `provisional`) when some connection is idle now and fewer than
/// [`MAX_PROVISIONAL`] are provisional. Nothing is closed here.
fn admit_provisionally(s: &Shared) -> bool {
    let any_idle = s
        .conns
        .lock()
        .values()
        .any(|c| c.wake.is_some() && c.idle.load(Ordering::SeqCst));
    any_idle
        && s.provisional
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_PROVISIONAL).then_some(n + 1)
            })
            .is_ok()
}

/// Accept thread, at the connection limit: closes one connection that
/// served a frame, holds no pin and waits for its next frame (a target's kept connection,
/// see `remote_donor`), so kept connections never make a new target's pin
/// be refused. Returns whether one was closed; the new connection is then
/// admitted while the closed one's thread ends (its `read` returns at
/// once), so the limit is exceeded by at most the connections closed and
/// not yet ended.
///
/// A race with a target that sends its next pin on the connection just as
/// it is closed is safe: the eviction and the connection's thread, once its
/// read returns, both try to take the connection's `idle` flag
/// ([`connection::reclaim_after_read`]), and exactly one wins; when the eviction wins,
/// nothing the read returned is served, so no pin is granted on a
/// connection about to close. The target sees the connection end and pins
/// again on a new one.
fn evict_idle(s: &Shared) -> bool {
    let conns = s.conns.lock();
    for c in conns.values() {
        let Some(wake) = &c.wake else { continue };
        // Claimed here: a connection is closed by one eviction only.
        if claim_for_eviction(&c.idle) {
            let _ = wake.shutdown(std::net::Shutdown::Both);
            s.counters.idle_closed.fetch_add(1, Ordering::SeqCst);
            return true;
        }
    }
    false
}
