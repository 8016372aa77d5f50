//! The NATS event plane (`async-nats`), for several processes or hosts.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc::error::TrySendError;

use super::{AbortOnDrop, EventPlane, PlaneFuture, PlaneMessage, Subject, Subscription};
use crate::log_throttle::LogThrottle;
use crate::PlaneError;

mod permission_refusals;
mod server_url;
pub(crate) use permission_refusals::{PermissionRefusals, Refusal};
pub(crate) use server_url::connect_addrs;
use server_url::url_auth;
pub use server_url::{nats_server_addrs, redact_url};

/// Connection options of a [`NatsPlane`].
#[derive(Debug, Clone, PartialEq)]
pub struct NatsOptions {
    /// Client name shown by the server (`connz`).
    pub name: String,
    /// Upper bound of the reconnect back-off; attempt `k` waits `min(k x 50 ms, this)`.
    pub max_reconnect_delay: Duration,
    /// Timeout of one connection attempt.
    pub connect_timeout: Duration,
    /// How the client authenticates (default: not at all).
    pub auth: NatsAuth,
    /// TLS settings (default: plain TCP unless the server demands TLS).
    pub tls: NatsTls,
    /// Prefix of this client's reply subjects (async-nats'
    /// `custom_inbox_prefix`; default `_INBOX`). Give each role its own
    /// (`_INBOX_router`, ...) and let each subscribe only to its own
    /// (docs/nats-permissions.conf), so that no role can subscribe to the
    /// replies meant for another. One or more subject tokens, no wildcards.
    pub inbox_prefix: Option<String>,
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            name: "kv-router-glue".into(),
            max_reconnect_delay: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
            auth: NatsAuth::None,
            tls: NatsTls::default(),
            inbox_prefix: None,
        }
    }
}

/// Why `prefix` cannot be an inbox prefix: the reason, or None when it can
/// (non-empty dot-separated tokens without whitespace or the `*` / `>`
/// wildcards, as NATS subjects are).
///
/// ```
/// use kv_router_glue::inbox_prefix_problem;
/// assert_eq!(inbox_prefix_problem("_INBOX_router"), None);
/// assert!(inbox_prefix_problem("_INBOX.>").unwrap().contains("wildcard"));
/// assert!(inbox_prefix_problem("a..b").is_some());
/// ```
pub fn inbox_prefix_problem(prefix: &str) -> Option<&'static str> {
    if prefix.is_empty() {
        Some("is empty")
    } else if prefix.split('.').any(str::is_empty) {
        Some("has an empty token (a leading, trailing or doubled `.`)")
    } else if prefix.contains(char::is_whitespace) {
        Some("contains whitespace")
    } else if prefix.contains(['*', '>']) {
        Some("contains a wildcard (`*` or `>`)")
    } else {
        None
    }
}

/// How a NATS client proves who it is (the server's `authorization` /
/// `accounts` configuration decides which one it wants).
///
/// ```
/// use kv_router_glue::{NatsAuth, NatsOptions};
/// let opts = NatsOptions {
///     auth: NatsAuth::CredentialsFile("/etc/kv/router.creds".into()),
///     ..NatsOptions::default()
/// };
/// assert!(!format!("{:?}", opts.auth).is_empty());
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// User and password (`--user` / `--pass`, or `authorization.users`).
    UserPassword {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
    /// A bearer token (`--auth`, `authorization.token`).
    Token(String),
    /// A `.creds` file (user JWT and NKey seed, as `nsc` writes it), read at connect.
    CredentialsFile(std::path::PathBuf),
}

impl std::fmt::Debug for NatsAuth {
    /// Secrets are never printed: logs and errors show only the kind (and a
    /// user name or file path).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => write!(f, "None"),
            NatsAuth::UserPassword { user, .. } => {
                write!(f, "UserPassword {{ user: {user:?}, password: <redacted> }}")
            }
            NatsAuth::Token(_) => write!(f, "Token(<redacted>)"),
            NatsAuth::CredentialsFile(p) => write!(f, "CredentialsFile({p:?})"),
        }
    }
}

impl NatsAuth {
    /// The kind of credentials, for messages that must not show them.
    fn kind(&self) -> &'static str {
        match self {
            NatsAuth::None => "none",
            NatsAuth::UserPassword { .. } => "user and password",
            NatsAuth::Token(_) => "token",
            NatsAuth::CredentialsFile(_) => "credentials file",
        }
    }
}

/// TLS settings of a NATS connection (PEM files).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Refuse to connect without TLS (also when the server does not ask for
    /// it). Implied by either file below: a CA or client certificate that
    /// was configured but silently unused over plain TCP would leave an
    /// operator believing the connection is encrypted.
    pub require: bool,
    /// CA certificates that sign the server's certificate. When set they
    /// *replace* the system roots (async-nats 0.51 loads the system roots
    /// only when no CA file is given).
    pub root_certificates: Option<std::path::PathBuf>,
    /// Client certificate and its private key, for servers that verify clients.
    pub client_certificate: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

impl NatsTls {
    /// True when TLS is required: `require`, or either file set (a CA or
    /// client certificate configured but unused over plain TCP would leave
    /// an operator believing the connection is encrypted).
    pub fn in_force(&self) -> bool {
        self.require || self.root_certificates.is_some() || self.client_certificate.is_some()
    }
}

/// A [`NatsOptions`] setting that cannot be used, named by its field
/// (`auth`, `inbox_prefix`, `tls.root_certificates`,
/// `tls.client_certificate`, `tls.client_key`), or the NATS URL's
/// credentials (`nats_url`). Never carries a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {reason}")]
pub struct NatsOptionsError {
    /// The field, as named above.
    pub field: &'static str,
    /// Why, with the path or value seen.
    pub reason: String,
}

impl NatsOptions {
    /// These settings as async-nats connect options for the servers of
    /// `url` ([`nats_server_addrs`]): name, connect timeout, unbounded
    /// reconnects with the bounded back-off, credentials (a `.creds` file is
    /// read and parsed here), inbox prefix and TLS. The one mapping every
    /// connection of this project uses ([`NatsPlane::connect`], the router
    /// service's advise client). It also sets the client's event callback,
    /// which logs connection changes and counts slow-consumer drops
    /// ([`nats_slow_consumer_drops`]): a caller that sets its own
    /// `event_callback` on the result replaces it, and loses both. (A
    /// [`NatsPlane`] also reads the server's permission violations from
    /// it, so that a request the server dropped for want of a permission
    /// fails naming it instead of timing out.)
    ///
    /// Credentials in `url` (`nats://user:password@host`, `nats://user:@host`
    /// for an empty password, `nats://token@host`; read as
    /// [`NatsOptions::with_url_credentials`] says) are used as if given in
    /// `auth` (async-nats itself ignores them): the
    /// same user info on every server of the list, and `auth` left at
    /// [`NatsAuth::None`]. Credentials given both ways are refused, even
    /// equal ones, as any other two kinds of credentials are: give them in
    /// one place.
    ///
    /// ```
    /// use kv_router_glue::{NatsAuth, NatsOptions, NatsTls};
    /// let url = "nats://n1:4222";
    /// let o = NatsOptions { inbox_prefix: Some("_INBOX.>".into()), ..NatsOptions::default() };
    /// assert_eq!(o.connect_options(url).unwrap_err().field, "inbox_prefix");
    /// let o = NatsOptions {
    ///     tls: NatsTls { root_certificates: Some("/no/such/ca.pem".into()), ..NatsTls::default() },
    ///     ..NatsOptions::default()
    /// };
    /// assert_eq!(o.connect_options(url).unwrap_err().field, "tls.root_certificates");
    /// // Credentials in the URL: fine alone, refused next to `auth`.
    /// assert!(NatsOptions::default().connect_options("nats://u:s3cr3t@n1:4222").is_ok());
    /// let o = NatsOptions { auth: NatsAuth::Token("t0k3n".into()), ..NatsOptions::default() };
    /// let e = o.connect_options("nats://u:s3cr3t@n1:4222").unwrap_err();
    /// assert_eq!(e.field, "nats_url");
    /// assert!(!e.to_string().contains("s3cr3t") && !e.to_string().contains("t0k3n"));
    /// ```
    ///
    /// # Errors
    /// [`NatsOptionsError`] for an unreadable or malformed credentials file
    /// (`auth`), a bad inbox prefix, a TLS file that cannot be read (a
    /// missing file would otherwise surface as a handshake error that names
    /// no file), or `url` (`nats_url`): not a server list, servers with
    /// different credentials, or credentials both in it and in `auth`.
    pub fn connect_options(
        self,
        url: &str,
    ) -> Result<async_nats::ConnectOptions, NatsOptionsError> {
        self.connect_options_reporting(url, PermissionRefusals::new())
    }

    /// [`NatsOptions::connect_options`], its event callback also passing
    /// the server's errors to `refusals`.
    fn connect_options_reporting(
        self,
        url: &str,
        refusals: PermissionRefusals,
    ) -> Result<async_nats::ConnectOptions, NatsOptionsError> {
        let this = self.with_url_credentials(url)?;
        let max = this.max_reconnect_delay;
        // The servers (without credentials) for the log lines: async-nats'
        // own events name none.
        let servers: Arc<str> = redact_url(url).into();
        let mut connect = async_nats::ConnectOptions::new()
            .event_callback(move |event| {
                let servers = servers.clone();
                let refusals = refusals.clone();
                async move {
                    if let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) =
                        &event
                    {
                        refusals.note(text);
                    }
                    log_client_event(&event, &servers)
                }
            })
            .name(this.name)
            .connection_timeout(this.connect_timeout)
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempt| {
                (Duration::from_millis(50) * attempt as u32).min(max)
            });
        connect = match this.auth {
            NatsAuth::None => connect,
            NatsAuth::UserPassword { user, password } => connect.user_and_password(user, password),
            NatsAuth::Token(t) => connect.token(t),
            NatsAuth::CredentialsFile(path) => {
                let auth = |e: std::io::Error| NatsOptionsError {
                    field: "auth",
                    reason: format!("credentials file {}: {e}", path.display()),
                };
                let text = std::fs::read_to_string(&path).map_err(auth)?;
                connect.credentials(&text).map_err(auth)?
            }
        };
        if let Some(prefix) = this.inbox_prefix {
            if let Some(why) = inbox_prefix_problem(&prefix) {
                return Err(NatsOptionsError {
                    field: "inbox_prefix",
                    reason: format!("{prefix:?} {why}"),
                });
            }
            connect = connect.custom_inbox_prefix(prefix);
        }
        let tls = this.tls;
        for (field, path) in [("tls.root_certificates", tls.root_certificates.as_ref())]
            .into_iter()
            .chain(tls.client_certificate.iter().flat_map(|(c, k)| {
                [
                    ("tls.client_certificate", Some(c)),
                    ("tls.client_key", Some(k)),
                ]
            }))
        {
            if let Some(p) = path {
                let readable = std::fs::File::open(p).and_then(|f| {
                    if f.metadata()?.is_file() {
                        Ok(())
                    } else {
                        Err(std::io::Error::other("not a regular file"))
                    }
                });
                if let Err(e) = readable {
                    return Err(NatsOptionsError {
                        field,
                        reason: format!("{}: {e}", p.display()),
                    });
                }
            }
        }
        if tls.in_force() {
            connect = connect.require_tls(true);
        }
        if let Some(roots) = tls.root_certificates {
            connect = connect.add_root_certificates(roots);
        }
        if let Some((cert, key)) = tls.client_certificate {
            connect = connect.add_client_certificate(cert, key);
        }
        Ok(connect)
    }

    /// These options with the credentials written in `url`'s user info
    /// (`nats://user:password@host` is [`NatsAuth::UserPassword`], and so is
    /// `nats://user:@host`, with an empty password, as nats.go reads it;
    /// `nats://token@host` a [`NatsAuth::Token`]; both parts
    /// percent-decoded, and only a literal `:` separates them, so
    /// `nats://a%3Ab@host` is the token `a:b`) as `auth`; unchanged when it
    /// has none (`nats://:@host`, an empty user and password, counts as none). [`NatsOptions::connect_options`]
    /// applies it: call it only to check options early (applied twice it
    /// refuses, as below).
    ///
    /// ```
    /// use kv_router_glue::{NatsAuth, NatsOptions};
    /// let o = NatsOptions::default().with_url_credentials("nats://kv:p%40ss@n1,nats://kv:p%40ss@n2").unwrap();
    /// assert_eq!(o.auth, NatsAuth::UserPassword { user: "kv".into(), password: "p@ss".into() });
    /// let o = NatsOptions::default().with_url_credentials("nats://t0k3n@n1").unwrap();
    /// assert_eq!(o.auth, NatsAuth::Token("t0k3n".into()));
    /// let o = NatsOptions::default().with_url_credentials("nats://kv:@n1").unwrap();
    /// assert_eq!(o.auth, NatsAuth::UserPassword { user: "kv".into(), password: "".into() });
    /// let e = NatsOptions::default().with_url_credentials("nats://kv:s3cr3t@n1,nats://n2").unwrap_err();
    /// assert_eq!(e.field, "nats_url");
    /// assert!(!e.to_string().contains("s3cr3t"));
    /// ```
    ///
    /// # Errors
    /// [`NatsOptionsError`] with field `nats_url` when `url` is not a
    /// server list ([`nats_server_addrs`]); its servers carry different
    /// user info (one set of credentials serves every server of the list,
    /// and those the client learns from the cluster: a server without any
    /// differs too); a password comes without a user; a part is not UTF-8
    /// once decoded; or `url` carries credentials while `auth` is not
    /// [`NatsAuth::None`]: two sets are refused, even equal ones, as two
    /// kinds of credentials are anywhere else. No message shows a secret.
    pub fn with_url_credentials(mut self, url: &str) -> Result<Self, NatsOptionsError> {
        match url_auth(url)? {
            NatsAuth::None => {}
            from_url if self.auth == NatsAuth::None => self.auth = from_url,
            from_url => {
                return Err(NatsOptionsError {
                    field: "nats_url",
                    reason: format!(
                        "carries credentials ({}) and credentials are given separately \
                         too ({}): give them in one place, not both",
                        from_url.kind(),
                        self.auth.kind()
                    ),
                })
            }
        }
        Ok(self)
    }
}

/// Messages a NATS subscription holds for a subscriber that has not taken
/// them yet. Its forwarding task takes every message off async-nats' own
/// buffer as it arrives (answering readiness probes on the way) and drops
/// one that finds these FORWARD_CAPACITY waiting, counting it
/// ([`nats_slow_consumer_drops`]): the newest go, as NATS drops a slow
/// consumer's overflow. async-nats' buffer (65,536 per subscription by
/// default) fills only while the forwarding task itself cannot run; its
/// overflow is dropped there and reported by async-nats.
pub const FORWARD_CAPACITY: usize = 65_536;

/// Messages dropped in this process because a subscriber fell behind
/// (slow consumer), since start.
static SLOW_CONSUMER_DROPS: AtomicU64 = AtomicU64::new(0);
/// The slow-consumer log line, at most once a second.
static SLOW_CONSUMER_LOG: LogThrottle = LogThrottle::new(Duration::from_secs(1));

/// Messages dropped in this process because a subscriber fell behind its
/// subscription's buffer (NATS calls it a slow consumer), since start:
/// each one a NATS subscription's forwarding task found
/// [`FORWARD_CAPACITY`] waiting for, plus those async-nats reports dropping
/// itself (only while a forwarding task cannot run; async-nats queues at
/// most 128 such reports and drops the rest, so those are a lower bound).
/// On a KV event subject each drop is a gap in a publisher's event ids,
/// which the receiver reports as lost and a snapshot repairs.
///
/// ```
/// assert_eq!(kv_router_glue::nats_slow_consumer_drops(), 0);
/// ```
pub fn nats_slow_consumer_drops() -> u64 {
    SLOW_CONSUMER_DROPS.load(Ordering::Relaxed)
}

/// Counts one message dropped for a slow consumer (`what`: the subject, or
/// async-nats' subscription id) and logs at most once a second with the
/// running total.
fn note_slow_consumer_drop(what: &dyn std::fmt::Display) {
    let total = SLOW_CONSUMER_DROPS.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(suppressed) = SLOW_CONSUMER_LOG.admit(std::time::Instant::now()) {
        tracing::warn!(
            subscription = %what,
            dropped_total = total,
            suppressed,
            "NATS slow consumer: messages dropped (the subscriber fell behind its buffer)"
        );
    }
}

/// Shortest time between two log lines of NATS client errors: while a
/// server is down every reconnect attempt fails with one (a few a second),
/// and each was logged twice (async-nats' info line and ours; trial h33,
/// nit 7).
pub const CLIENT_ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

static CLIENT_ERROR_LOG: LogThrottle = LogThrottle::new(CLIENT_ERROR_LOG_EVERY);

/// Logs a client event of the connection to `servers` (redacted). async-nats
/// logs every client event at info itself (`event: ...`, and `connected
/// successfully` with the server's port); the router's default log filter
/// leaves those out (`async_nats=warn`), so these lines are the record: a
/// connect at info, a disconnect as a warning (the process loses events and
/// requests until it is back), client errors (each failed reconnect attempt)
/// as a warning at most once per [`CLIENT_ERROR_LOG_EVERY`] with the cause and
/// how many were left out, other events (server errors) as warnings, and a
/// message async-nats dropped for a slow consumer (one event per dropped
/// message) counted and logged at most once a second with the running total
/// ([`note_slow_consumer_drop`]).
fn log_client_event(event: &async_nats::Event, servers: &str) {
    use async_nats::Event;
    match event {
        Event::Connected => tracing::info!(servers, "NATS connected"),
        Event::Closed | Event::Draining => {
            tracing::debug!(servers, event = %event, "NATS client event")
        }
        Event::Disconnected => tracing::warn!(servers, "NATS disconnected: reconnecting"),
        Event::SlowConsumer(sid) => note_slow_consumer_drop(&format!("sid {sid}")),
        Event::ClientError(cause) => {
            if let Some(suppressed) = CLIENT_ERROR_LOG.admit(std::time::Instant::now()) {
                tracing::warn!(servers, cause = %cause, suppressed, "NATS client error");
            }
        }
        other => tracing::warn!(servers, event = %other, "NATS client event"),
    }
}

/// NATS header that marks a readiness probe on a data subject; subscribers
/// answer it and never deliver it as data.
pub const PROBE_HEADER: &str = "Kv-Ready-Probe";

fn is_probe(m: &async_nats::Message) -> bool {
    m.headers
        .as_ref()
        .is_some_and(|h| h.get(PROBE_HEADER).is_some())
}

/// Event plane over a NATS server.
///
/// The client reconnects forever with bounded back-off and re-establishes
/// subscriptions itself; messages published while disconnected may be lost,
/// which the KV event ids detect (gap → resync request).
///
/// Readiness: [`EventPlane::wait_for_subscribers`] publishes probes *on the
/// data subject itself*, marked by the header `PROBE_HEADER` and carrying
/// a reply inbox; every subscription answers with its unique id (and does
/// not pass the probe on), and the barrier counts distinct answers. Because
/// the probe travels through the data subscription, an answer proves that
/// this very subscription is registered on the server. (A separate probe
/// subject could be re-established before the data subscription after a
/// reconnect, since the client re-sends its subscriptions in no fixed order:
/// a test saw the barrier pass and the next event lost.)
#[derive(Debug, Clone)]
pub struct NatsPlane {
    client: async_nats::Client,
    /// The permission violations the server sends this connection.
    refusals: PermissionRefusals,
}

impl NatsPlane {
    /// Connects to `url`: one server (e.g. `nats://127.0.0.1:4222`) or a
    /// comma-separated list of them ([`nats_server_addrs`]), of which the
    /// client reaches one and moves to another when it is lost. Credentials
    /// in `url` are used ([`NatsOptions::connect_options`]).
    ///
    /// # Errors
    /// [`PlaneError::Connect`] when `url` is not a server list, `options`
    /// cannot be used with it ([`NatsOptions::connect_options`]) or the
    /// first connection fails.
    pub async fn connect(url: &str, options: NatsOptions) -> Result<Self, PlaneError> {
        let err = |reason: String| PlaneError::Connect {
            url: redact_url(url),
            reason,
        };
        let servers = server_url::connect_addrs(url).map_err(err)?;
        let tls_in_force = options.tls.in_force();
        let refusals = PermissionRefusals::new();
        let connect = options
            .connect_options_reporting(url, refusals.clone())
            .map_err(|e| err(e.to_string()))?;
        let client = connect.connect(servers).await.map_err(|e| {
            // rustls' reasons (`received fatal alert: BadCertificate`,
            // `corrupt message`) do not say which side or setting is at fault.
            err(if tls_in_force {
                format!(
                    "{e} (TLS in force: the server must offer TLS, trust the \
                     client certificate if one is set, and present a certificate \
                     signed by `tls.root_certificates` or the system roots)"
                )
            } else {
                e.to_string()
            })
        })?;
        Ok(Self { client, refusals })
    }

    /// True while the client holds a live connection.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Waits until the server has processed everything this client sent
    /// before the call (publishes, `SUB`s), through a request the server
    /// itself answers (`server_round_trip`).
    ///
    /// # Errors
    /// [`PlaneError::Publish`] when the server does not answer within 5 s.
    pub async fn flush(&self) -> Result<(), PlaneError> {
        self.server_round_trip(ROUND_TRIP_TIMEOUT)
            .await
            .map_err(|reason| PlaneError::Publish {
                subject: "<flush>".into(),
                reason,
            })
    }

    /// One request to a subject nobody serves, answered by the server itself
    /// (status 503, "no responders"). The server handles one connection's
    /// commands in order, so the answer proves every earlier command of this
    /// client was processed. Why not `Client::flush`: in async-nats 0.51 it
    /// only writes the socket and waits for nothing, so a `SUB` could still
    /// be unprocessed when a publisher's event arrived (a fault run lost its
    /// event that way under load).
    async fn server_round_trip(&self, timeout: Duration) -> Result<(), String> {
        server_round_trip(&self.client, timeout).await
    }

    /// The underlying `async-nats` client (for request/reply services such
    /// as the router's advise subscription, which need queue groups and
    /// reply subjects that [`EventPlane`] does not model).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The permission violations the server sends this connection
    /// ([`PermissionRefusals`]).
    pub(crate) fn refusals(&self) -> &PermissionRefusals {
        &self.refusals
    }
}

/// [`NatsPlane::server_round_trip`] on any client: resolves once the server
/// has processed every command `client` sent before the call.
pub(crate) async fn server_round_trip(
    client: &async_nats::Client,
    timeout: Duration,
) -> Result<(), String> {
    let subject = format!("_kvping.{}", uuid::Uuid::new_v4().simple());
    let request = async_nats::Request::new().timeout(Some(timeout));
    match client.send_request(subject, request).await {
        // Somebody did answer: the server relayed it, which proves the same.
        Ok(_) => Ok(()),
        Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => Ok(()),
        Err(e) => Err(format!("no round trip with the server: {e}")),
    }
}

/// Longest wait for [`NatsPlane::server_round_trip`] in `subscribe` and `flush`.
const ROUND_TRIP_TIMEOUT: Duration = Duration::from_secs(5);

impl EventPlane for NatsPlane {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn is_connected(&self) -> bool {
        NatsPlane::is_connected(self)
    }

    fn publish<'a>(&'a self, subject: &'a Subject, payload: Vec<u8>) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            self.client
                .publish(subject.as_str().to_string(), payload.into())
                .await
                .map_err(|e| PlaneError::Publish {
                    subject: subject.to_string(),
                    reason: e.to_string(),
                })
        })
    }

    fn subscribe<'a>(&'a self, subject: &'a Subject) -> PlaneFuture<'a, Subscription> {
        Box::pin(async move {
            let sub_err = |e: String| PlaneError::Subscribe {
                subject: subject.to_string(),
                reason: e,
            };
            let mut data = self
                .client
                .subscribe(subject.as_str().to_string())
                .await
                .map_err(|e| sub_err(e.to_string()))?;
            // "Ready on return": the server has processed the SUB.
            self.server_round_trip(ROUND_TRIP_TIMEOUT)
                .await
                .map_err(sub_err)?;
            // Bounded, and this task never waits on it: a subscriber that
            // falls behind loses the newest messages here, each counted
            // (`nats_slow_consumer_drops`), while probes keep being answered
            // (waiting in `send` left them unread behind the backlog, so a
            // barrier timed out on a registered subscription, and
            // async-nats' 128-slot event queue lost most drop reports). KV
            // event ids turn a drop into a gap that a snapshot repairs.
            let (tx, rx) = tokio::sync::mpsc::channel(FORWARD_CAPACITY);
            let name = subject.as_str().to_string();
            let id = uuid::Uuid::new_v4().to_string();
            let client = self.client.clone();
            let task = tokio::spawn(async move {
                loop {
                    tokio::select! {
                        m = data.next() => match m {
                            Some(m) if is_probe(&m) => {
                                if let Some(reply) = m.reply {
                                    // A lost answer only delays the barrier: it probes again.
                                    let _ = client.publish(reply, id.clone().into_bytes().into()).await;
                                }
                            }
                            Some(m) => {
                                let msg = PlaneMessage { subject: m.subject.to_string(), payload: m.payload.to_vec() };
                                match tx.try_send(msg) {
                                    Ok(()) => {}
                                    Err(TrySendError::Full(_)) => note_slow_consumer_drop(&name),
                                    Err(TrySendError::Closed(_)) => break,
                                }
                            }
                            None => break,
                        },
                        _ = tx.closed() => break,
                    }
                }
            });
            Ok(Subscription::new(
                subject.as_str().to_string(),
                super::Inbox::Bounded(rx),
                Some(AbortOnDrop(task)),
            ))
        })
    }

    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a Subject,
        n: usize,
        timeout: Duration,
    ) -> PlaneFuture<'a, usize> {
        Box::pin(async move {
            if n == 0 {
                return Ok(0);
            }
            let start = tokio::time::Instant::now();
            let deadline = start + timeout;
            let not_ready = |ready: usize| PlaneError::NotReady {
                subject: subject.to_string(),
                ready,
                wanted: n,
                waited_ms: start.elapsed().as_millis() as u64,
            };
            let inbox = self.client.new_inbox();
            let mut replies =
                self.client
                    .subscribe(inbox.clone())
                    .await
                    .map_err(|e| PlaneError::Subscribe {
                        subject: inbox.clone(),
                        reason: e.to_string(),
                    })?;
            let mut seen: HashSet<Vec<u8>> = HashSet::new();
            loop {
                // Errors here are transient (reconnecting): keep probing until the deadline.
                let _ = self.client.flush().await;
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(PROBE_HEADER, "1");
                let _ = self
                    .client
                    .publish_with_reply_and_headers(
                        subject.as_str().to_string(),
                        inbox.clone(),
                        headers,
                        Vec::new().into(),
                    )
                    .await;
                let round_end =
                    (tokio::time::Instant::now() + Duration::from_millis(100)).min(deadline);
                while let Ok(Some(m)) = tokio::time::timeout_at(round_end, replies.next()).await {
                    // With no subscription at all the server itself answers
                    // the probe (status 503, no responders, empty payload);
                    // counting that as a subscriber let a one-shot event go
                    // out to nobody.
                    if m.status.is_some() || m.payload.is_empty() {
                        continue;
                    }
                    seen.insert(m.payload.to_vec());
                    if seen.len() >= n {
                        return Ok(seen.len());
                    }
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(not_ready(seen.len()));
                }
            }
        })
    }
}
