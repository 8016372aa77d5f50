//! Transports of the source-pin protocol (`kv.pin@1.0` frames): a Unix
//! socket for a donor on the same host, TCP for a donor on another host.
//!
//! Endpoints are `unix:<absolute path>` (a plain absolute path is read as
//! `unix:`) or `tcp:<host>:<port>`. A TCP connection is authenticated by
//! [`auth`]'s HMAC-SHA256 challenge-response before the donor reads a single
//! pin frame; a Unix socket relies on its file mode (0600, set by the donor
//! at bind) and its directory's. The frames that follow are the same on
//! both transports (`kv_descriptor::split_pin_frame`, bounded length).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use kv_descriptor::{PinDonorMessage, Wire};

use crate::PinError;

pub(crate) mod auth;

/// Scheme prefix of a Unix-socket control endpoint: `unix:<absolute path>`.
pub const UNIX_ENDPOINT_PREFIX: &str = "unix:";

/// Scheme prefix of a TCP control endpoint: `tcp:<host>:<port>`.
pub const TCP_ENDPOINT_PREFIX: &str = "tcp:";

/// Longest socket path `bind` accepts (Linux `sun_path` is 108 bytes with
/// its terminating NUL).
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// Why a control endpoint string is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PinEndpointError {
    /// The scheme is neither `unix:` nor `tcp:`, and the string is not an
    /// absolute path.
    #[error("endpoint {endpoint:?}: scheme must be `unix:<path>` or `tcp:<host>:<port>`")]
    Scheme {
        /// The endpoint as given.
        endpoint: String,
    },
    /// The `unix:` path is empty or longer than [`MAX_SOCKET_PATH_BYTES`].
    #[error("endpoint {endpoint:?}: socket path must hold 1..={max} bytes", max = MAX_SOCKET_PATH_BYTES)]
    PathLength {
        /// The endpoint as given.
        endpoint: String,
    },
    /// The Unix socket path is relative. The endpoint travels (in a hint,
    /// the donor's directory record) to processes that would resolve it
    /// against their own working directories: another socket, or none.
    #[error(
        "endpoint {endpoint:?}: socket path {path:?} is relative (each process would resolve it \
         against its own working directory); give an absolute path"
    )]
    RelativePath {
        /// The endpoint as given.
        endpoint: String,
        /// Its socket path.
        path: String,
    },
    /// The Unix socket path holds a NUL byte, which no socket path can
    /// (the kernel reads the path as a C string: it would name another
    /// socket, or bind would fail late as an I/O error).
    #[error("endpoint {endpoint:?}: socket path holds a NUL byte")]
    NulInPath {
        /// The endpoint as given.
        endpoint: String,
    },
    /// The `tcp:` address has no `host:port` with a numeric port.
    #[error("endpoint {endpoint:?}: `tcp:` needs `<host>:<port>` with a port in 0..=65535")]
    TcpAddress {
        /// The endpoint as given.
        endpoint: String,
    },
}

/// A parsed control endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinEndpoint {
    /// A Unix socket at this path.
    Unix(PathBuf),
    /// A TCP address `host:port` (host a name, an IPv4 address or a
    /// bracketed IPv6 address), resolved at connect or bind.
    Tcp(String),
}

impl PinEndpoint {
    /// Parses `unix:<absolute path>`, `tcp:<host>:<port>` or a plain
    /// absolute path (read as `unix:`, as endpoints were written before TCP
    /// existed).
    ///
    /// ```
    /// use kv_router_glue::PinEndpoint;
    /// assert_eq!(PinEndpoint::parse("/run/kv/d0.sock").unwrap(), PinEndpoint::Unix("/run/kv/d0.sock".into()));
    /// assert_eq!(PinEndpoint::parse("tcp:10.0.0.7:7301").unwrap(), PinEndpoint::Tcp("10.0.0.7:7301".into()));
    /// assert!(PinEndpoint::parse("tcp:10.0.0.7").is_err());
    /// // Every process that reads it would resolve a relative path in its own directory.
    /// assert!(matches!(
    ///     PinEndpoint::parse("unix:run/d0.sock"),
    ///     Err(kv_router_glue::PinEndpointError::RelativePath { .. })
    /// ));
    /// ```
    ///
    /// # Errors
    /// [`PinEndpointError`] naming what is wrong.
    pub fn parse(endpoint: &str) -> Result<Self, PinEndpointError> {
        if let Some(addr) = endpoint.strip_prefix(TCP_ENDPOINT_PREFIX) {
            let port_ok = addr
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok {
                return Err(PinEndpointError::TcpAddress {
                    endpoint: endpoint.to_owned(),
                });
            }
            return Ok(Self::Tcp(addr.to_owned()));
        }
        let path = match endpoint.strip_prefix(UNIX_ENDPOINT_PREFIX) {
            Some(p) => p,
            None if endpoint.starts_with('/') => endpoint,
            None => {
                return Err(PinEndpointError::Scheme {
                    endpoint: endpoint.to_owned(),
                })
            }
        };
        if path.is_empty() || path.len() > MAX_SOCKET_PATH_BYTES {
            return Err(PinEndpointError::PathLength {
                endpoint: endpoint.to_owned(),
            });
        }
        if !path.starts_with('/') {
            return Err(PinEndpointError::RelativePath {
                endpoint: endpoint.to_owned(),
                path: path.to_owned(),
            });
        }
        if path.contains('\0') {
            return Err(PinEndpointError::NulInPath {
                endpoint: endpoint.to_owned(),
            });
        }
        Ok(Self::Unix(PathBuf::from(path)))
    }

    /// Whether connections to this endpoint must authenticate (TCP).
    pub fn requires_auth(&self) -> bool {
        matches!(self, Self::Tcp(_))
    }
}

/// The socket path of a `unix:<path>` endpoint (or a plain absolute path).
///
/// ```
/// use kv_router_glue::unix_endpoint_path;
/// assert_eq!(unix_endpoint_path("unix:/run/kv/d0.sock").unwrap().to_str(), Some("/run/kv/d0.sock"));
/// assert!(unix_endpoint_path("pid:42").is_err());
/// assert!(unix_endpoint_path("tcp:127.0.0.1:7301").is_err());
/// ```
///
/// # Errors
/// [`PinEndpointError`] when the endpoint is not a usable Unix socket path
/// (a `tcp:` endpoint is [`PinEndpointError::Scheme`]).
pub fn unix_endpoint_path(endpoint: &str) -> Result<PathBuf, PinEndpointError> {
    match PinEndpoint::parse(endpoint)? {
        PinEndpoint::Unix(p) => Ok(p),
        PinEndpoint::Tcp(_) => Err(PinEndpointError::Scheme {
            endpoint: endpoint.to_owned(),
        }),
    }
}

/// One pin connection, on either transport.
#[derive(Debug)]
pub(crate) enum PinStream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl PinStream {
    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Self::Unix(s) => s.set_read_timeout(t),
            Self::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            Self::Unix(s) => s.set_write_timeout(t),
            Self::Tcp(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            Self::Unix(s) => Self::Unix(s.try_clone()?),
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
        })
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> std::io::Result<()> {
        match self {
            Self::Unix(s) => s.shutdown(how),
            Self::Tcp(s) => s.shutdown(how),
        }
    }

    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, Self::Tcp(_))
    }
}

impl Read for PinStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Unix(s) => s.read(buf),
            Self::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for PinStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Unix(s) => s.write(buf),
            Self::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Unix(s) => s.flush(),
            Self::Tcp(s) => s.flush(),
        }
    }
}

/// The donor's listening socket.
#[derive(Debug)]
pub(crate) enum PinListener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl PinListener {
    pub(crate) fn accept(&self) -> std::io::Result<PinStream> {
        match self {
            Self::Unix(l) => l.accept().map(|(s, _)| PinStream::Unix(s)),
            Self::Tcp(l) => l.accept().map(|(s, _)| {
                // Frames are small request/reply pairs: Nagle would add up
                // to 40 ms (delayed ACK) to every pin.
                let _ = s.set_nodelay(true);
                PinStream::Tcp(s)
            }),
        }
    }
}

/// Where the accept thread is woken from at shutdown: the socket path, or a
/// TCP address that reaches the listener (loopback when it is bound to the
/// unspecified address).
#[derive(Debug, Clone)]
pub(crate) enum WakeAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl WakeAddr {
    /// Connects once and drops the connection (the accept thread then sees
    /// its stop flag).
    pub(crate) fn poke(&self) {
        match self {
            Self::Unix(p) => drop(UnixStream::connect(p)),
            Self::Tcp(a) => drop(TcpStream::connect_timeout(a, Duration::from_secs(1))),
        }
    }
}

/// The loopback address that reaches a TCP listener bound to `local`.
pub(crate) fn tcp_wake_addr(local: SocketAddr) -> SocketAddr {
    let mut a = local;
    if a.ip().is_unspecified() {
        a.set_ip(match a {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    a
}

/// Connects to `addr` (`host:port`), trying each resolved address with
/// `timeout` per attempt; returns the last error when none answers.
pub(crate) fn tcp_connect(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(
        std::io::ErrorKind::AddrNotAvailable,
        format!("{addr} resolves to no address"),
    );
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Connects to a pin endpoint with `timeout` on every read and write; over
/// TCP, runs the target side of the key exchange with `key` first.
///
/// # Errors
/// [`PinError::Endpoint`] for a bad endpoint; [`PinError::Auth`] for a TCP
/// endpoint without `key` (nothing is sent) or a failed exchange;
/// [`PinError::Io`] / [`PinError::Timeout`] (`connect`).
pub(crate) fn connect(
    endpoint: &str,
    timeout: Duration,
    key: Option<&auth::PinAuthKey>,
) -> Result<PinStream, PinError> {
    let parsed = PinEndpoint::parse(endpoint).map_err(|e| PinError::Endpoint {
        endpoint: endpoint.to_string(),
        reason: e.to_string(),
    })?;
    let mut stream = match &parsed {
        PinEndpoint::Unix(path) => PinStream::Unix(
            UnixStream::connect(path).map_err(|e| PinError::io("connect", e, timeout))?,
        ),
        PinEndpoint::Tcp(addr) => {
            if key.is_none() {
                return Err(PinError::Auth(auth::PinAuthError::KeyMissing {
                    endpoint: endpoint.to_string(),
                }));
            }
            PinStream::Tcp(
                tcp_connect(addr, timeout).map_err(|e| PinError::io("connect", e, timeout))?,
            )
        }
    };
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| PinError::io("connect", e, timeout))?;
    if let (PinEndpoint::Tcp(_), Some(k)) = (&parsed, key) {
        auth::target_handshake(&mut stream, k, timeout).map_err(PinError::Auth)?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| PinError::io("connect", e, timeout))?;
    }
    Ok(stream)
}

/// Reads one donor frame (the client's side of
/// [`kv_descriptor::split_pin_frame`]); `timeout` is the stream's read
/// timeout, reported when it elapses.
pub(crate) fn read_donor_message(
    stream: &mut PinStream,
    timeout: Duration,
) -> Result<PinDonorMessage, PinError> {
    let mut header = [0u8; kv_descriptor::PIN_FRAME_HEADER_BYTES];
    stream
        .read_exact(&mut header)
        .map_err(|e| PinError::io("receive", e, timeout))?;
    let len = kv_descriptor::pin_frame_len(header).map_err(|e| PinError::Protocol {
        detail: e.to_string(),
    })?;
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| PinError::io("receive", e, timeout))?;
    PinDonorMessage::from_wire(&body).map_err(|e| PinError::Protocol {
        detail: e.to_string(),
    })
}
