//! [`NatsInventory`]: inventory request/reply over NATS (core request/reply:
//! the request carries a reply inbox, the worker publishes its answer there).

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};

use super::{IncomingRequest, InventoryError, InventoryFuture, InventoryPlane, InventoryRequests};
use crate::event_plane::AbortOnDrop;
use crate::Subject;

/// Inventory plane over a NATS connection.
#[derive(Debug, Clone)]
pub struct NatsInventory {
    client: async_nats::Client,
}

impl NatsInventory {
    /// Connects to `url` with the default [`crate::NatsOptions`]: no
    /// credentials but those written in `url` (for others, or TLS, build
    /// the client yourself: [`NatsInventory::from_client`]).
    ///
    /// # Errors
    /// [`InventoryError::Transport`] when `url` is refused or the server is
    /// unreachable.
    pub async fn connect(url: &str) -> Result<Self, InventoryError> {
        let plane = crate::NatsPlane::connect(url, crate::NatsOptions::default())
            .await
            .map_err(|e| InventoryError::Transport {
                subject: format!("<connect {}>", crate::redact_url(url)),
                reason: e.to_string(),
            })?;
        Ok(Self {
            client: plane.client().clone(),
        })
    }

    /// Uses an existing connection (its credentials, TLS and reconnect policy).
    pub fn from_client(client: async_nats::Client) -> Self {
        Self { client }
    }
}

impl InventoryPlane for NatsInventory {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn request<'a>(
        &'a self,
        subject: &'a Subject,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> InventoryFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let request = async_nats::Request::new()
                .payload(payload.into())
                .timeout(Some(timeout));
            match self
                .client
                .send_request(subject.as_str().to_string(), request)
                .await
            {
                Ok(m) => Ok(m.payload.to_vec()),
                Err(e) => Err(match e.kind() {
                    async_nats::RequestErrorKind::NoResponders => InventoryError::NoResponder {
                        subject: subject.to_string(),
                    },
                    async_nats::RequestErrorKind::TimedOut => InventoryError::Timeout {
                        subject: subject.to_string(),
                        waited_ms: timeout.as_millis() as u64,
                    },
                    _ => InventoryError::Transport {
                        subject: subject.to_string(),
                        reason: e.to_string(),
                    },
                }),
            }
        })
    }

    fn serve<'a>(&'a self, subject: &'a Subject) -> InventoryFuture<'a, InventoryRequests> {
        Box::pin(async move {
            let transport = |reason: String| InventoryError::Transport {
                subject: subject.to_string(),
                reason,
            };
            let mut sub = self
                .client
                .subscribe(subject.as_str().to_string())
                .await
                .map_err(|e| transport(e.to_string()))?;
            // Ready on return: a request the server itself answers (no
            // responders) proves it processed the SUB sent before it.
            let ping = format!("_kvping.{}", uuid::Uuid::new_v4().simple());
            let probe = async_nats::Request::new().timeout(Some(Duration::from_secs(5)));
            match self.client.send_request(ping, probe).await {
                Ok(_) => {}
                Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {}
                Err(e) => return Err(transport(format!("no round trip with the server: {e}"))),
            }
            let (tx, rx) = mpsc::unbounded_channel();
            let client = self.client.clone();
            let task = tokio::spawn(async move {
                while let Some(m) = sub.next().await {
                    let Some(reply_to) = m.reply else {
                        continue;
                    };
                    let (reply, answer) = oneshot::channel();
                    let req = IncomingRequest {
                        payload: m.payload.to_vec(),
                        reply,
                    };
                    if tx.send(req).is_err() {
                        break;
                    }
                    let client = client.clone();
                    // Answered apart, so a slow page does not hold the next request.
                    tokio::spawn(async move {
                        if let Ok(bytes) = answer.await {
                            let _ = client.publish(reply_to, bytes.into()).await;
                        }
                    });
                }
            });
            Ok(InventoryRequests {
                subject: subject.as_str().to_string(),
                rx,
                _guard: Some(AbortOnDrop(task)),
            })
        })
    }
}
