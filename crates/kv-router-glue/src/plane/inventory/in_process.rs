//! [`InProcessInventory`]: inventory request/reply inside one process.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use super::{IncomingRequest, InventoryError, InventoryFuture, InventoryPlane, InventoryRequests};
use crate::Subject;

/// In-process inventory plane: one server per subject (the latest `serve`
/// wins), requests through channels. Clones share the same servers.
#[derive(Debug, Clone, Default)]
pub struct InProcessInventory {
    servers: Arc<Mutex<HashMap<String, mpsc::UnboundedSender<IncomingRequest>>>>,
}

impl InProcessInventory {
    /// A plane with no server.
    pub fn new() -> Self {
        Self::default()
    }
}

impl InventoryPlane for InProcessInventory {
    fn name(&self) -> &'static str {
        "in_process"
    }

    fn request<'a>(
        &'a self,
        subject: &'a Subject,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> InventoryFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let no_responder = || InventoryError::NoResponder {
                subject: subject.to_string(),
            };
            let (tx, rx) = oneshot::channel();
            {
                let mut servers = self.servers.lock();
                let Some(server) = servers.get(subject.as_str()) else {
                    return Err(no_responder());
                };
                if server.send(IncomingRequest { payload, reply: tx }).is_err() {
                    // The server's stream was dropped: it serves no more.
                    servers.remove(subject.as_str());
                    return Err(no_responder());
                }
            }
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(answer)) => Ok(answer),
                // The server dropped the request without answering.
                Ok(Err(_)) => Err(no_responder()),
                Err(_) => Err(InventoryError::Timeout {
                    subject: subject.to_string(),
                    waited_ms: timeout.as_millis() as u64,
                }),
            }
        })
    }

    fn serve<'a>(&'a self, subject: &'a Subject) -> InventoryFuture<'a, InventoryRequests> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            self.servers.lock().insert(subject.as_str().to_string(), tx);
            Ok(InventoryRequests {
                subject: subject.as_str().to_string(),
                rx,
                _guard: None,
            })
        })
    }
}
