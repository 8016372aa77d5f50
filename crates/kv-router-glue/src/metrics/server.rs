//! [`MetricsServer`]: the `GET /metrics` (and optional `GET /healthz`)
//! HTTP/1.1 endpoint of a router or worker process, capped in request size,
//! time and connections (module docs of `metrics`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use super::{ReuseMetrics, METRICS_CONTENT_TYPE};

/// Largest request head the endpoint reads, bytes.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Connections [`MetricsServer`] serves at once; one more is closed at accept.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a client gets to send its request head.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What `GET /healthz` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// `200 ok`.
    Serving,
    /// `503` with this reason as the body (`draining`, `nats disconnected`).
    Unavailable(&'static str),
}

/// The health question `GET /healthz` asks on each request.
pub type HealthProbe = Arc<dyn Fn() -> Health + Send + Sync>;

/// A tiny HTTP/1.1 server of `GET /metrics` (and `GET /healthz` when bound
/// with [`MetricsServer::bind_with_health`]).
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Listens on `addr` (port 0 picks one; see [`MetricsServer::local_addr`])
    /// and serves `metrics` until [`MetricsServer::shutdown`] or drop. Must
    /// run inside a tokio runtime.
    ///
    /// # Errors
    /// The listener's I/O error (address in use, permission).
    pub async fn bind(addr: SocketAddr, metrics: Arc<ReuseMetrics>) -> std::io::Result<Self> {
        Self::bind_inner(addr, metrics, None).await
    }

    /// [`MetricsServer::bind`], also serving `GET /healthz`: `200 ok` while
    /// `health` returns [`Health::Serving`], else `503` with the reason as
    /// the body. The router binary's probe.
    ///
    /// # Errors
    /// As [`MetricsServer::bind`].
    pub async fn bind_with_health(
        addr: SocketAddr,
        metrics: Arc<ReuseMetrics>,
        health: HealthProbe,
    ) -> std::io::Result<Self> {
        Self::bind_inner(addr, metrics, Some(health)).await
    }

    /// [`MetricsServer::bind_with_health`] on a listener the caller bound
    /// earlier: the router binary binds its `--metrics-addr` before it
    /// connects to anything, so an address that cannot be bound is a flag
    /// error, and serves it once the probe's inputs exist (connections made
    /// meanwhile wait in the listener's backlog). Must run inside a tokio
    /// runtime.
    ///
    /// # Errors
    /// The listener's `local_addr` error.
    pub fn serve_with_health(
        listener: TcpListener,
        metrics: Arc<ReuseMetrics>,
        health: HealthProbe,
    ) -> std::io::Result<Self> {
        Self::serve(listener, metrics, Some(health))
    }

    async fn bind_inner(
        addr: SocketAddr,
        metrics: Arc<ReuseMetrics>,
        health: Option<HealthProbe>,
    ) -> std::io::Result<Self> {
        Self::serve(TcpListener::bind(addr).await?, metrics, health)
    }

    fn serve(
        listener: TcpListener,
        metrics: Arc<ReuseMetrics>,
        health: Option<HealthProbe>,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let (stop_tx, mut stop_rx) = oneshot::channel();
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stop_rx => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, peer)) => {
                            // Over the cap: dropping the stream closes it at once.
                            let Ok(slot) = slots.clone().try_acquire_owned() else {
                                tracing::debug!(%peer, "metrics endpoint at its connection cap");
                                continue;
                            };
                            let metrics = metrics.clone();
                            let health = health.clone();
                            tokio::spawn(async move {
                                serve_one(stream, metrics, health).await;
                                drop(slot);
                            });
                        }
                        Err(e) => tracing::warn!(error = %e, "metrics endpoint accept failed"),
                    },
                }
            }
        });
        Ok(Self {
            addr,
            stop: Some(stop_tx),
            task,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits for the accept loop to end.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_one(mut stream: TcpStream, metrics: Arc<ReuseMetrics>, health: Option<HealthProbe>) {
    let Ok(Some(head)) = tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream)).await else {
        return;
    };
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    // HEAD is GET without the body (RFC 9110): some load balancers' health
    // checks send it, and a 404 for it read as a wrong path.
    let head = method == "HEAD";
    let known = path == "/metrics" || (path == "/healthz" && health.is_some());
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => ("200 OK", METRICS_CONTENT_TYPE, metrics.encode()),
        ("GET" | "HEAD", "/healthz") if health.is_some() => match health.as_ref().map(|h| h()) {
            Some(Health::Unavailable(reason)) => (
                "503 Service Unavailable",
                "text/plain",
                format!("{reason}\n"),
            ),
            _ => ("200 OK", "text/plain", "ok\n".to_owned()),
        },
        _ if known => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET or HEAD\n".to_owned(),
        ),
        _ => ("404 Not Found", "text/plain", "try /metrics\n".to_owned()),
    };
    let allow = if status.starts_with("405") {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n{}",
        body.len(),
        if head { "" } else { body.as_str() }
    );
    if let Err(e) = stream.write_all(response.as_bytes()).await {
        tracing::debug!(error = %e, "metrics response not written");
    }
    let _ = stream.shutdown().await;
}

/// Reads up to the blank line ending the request head; `None` when the
/// client closes early or sends more than [`MAX_REQUEST_BYTES`].
async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() + n > MAX_REQUEST_BYTES {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8(buf).ok()
}
