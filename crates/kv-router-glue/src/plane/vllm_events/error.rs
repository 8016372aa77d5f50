//! Why a vLLM event payload, a worker configuration or the ZMQ link failed.

/// Errors of vLLM event ingestion.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VllmEventError {
    /// A payload is not a vLLM `KVEventBatch` of an accepted shape; `field`
    /// names the offending field and `event` its index in the batch.
    #[error("vLLM event payload{}: `{field}` {reason}", event_suffix(.event))]
    Payload {
        /// Offending field (`payload`, `batch.ts`, `block_hashes`, `token_ids`, ...).
        field: &'static str,
        /// Index of the event in the batch, when the fault is inside one.
        event: Option<usize>,
        /// What is wrong.
        reason: String,
    },
    /// A multipart message is not `[topic, seq, payload]` or a replay reply
    /// is not `[empty, seq, payload]`.
    #[error("vLLM ZMQ message: `{field}` {reason}")]
    Frame {
        /// `frames`, `seq` or `delimiter`.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The worker description or subscriber configuration is unusable.
    #[error("vLLM ingest configuration: `{field}` {reason}")]
    Config {
        /// Offending setting.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The inventory index refused the worker.
    #[error("inventory index refused the vLLM worker: {0}")]
    Index(#[from] kv_lookup::LookupError),
    /// Connecting, subscribing or talking to the publisher failed.
    #[error("vLLM ZMQ endpoint `{endpoint}`: {reason}")]
    Transport {
        /// Endpoint involved.
        endpoint: String,
        /// Cause.
        reason: String,
    },
}

fn event_suffix(event: &Option<usize>) -> String {
    event.map_or_else(String::new, |i| format!(" (event {i})"))
}

impl VllmEventError {
    /// The same error located at event `i` of its batch.
    pub(crate) fn at_event(self, i: usize) -> Self {
        match self {
            Self::Payload { field, reason, .. } => Self::Payload {
                field,
                event: Some(i),
                reason,
            },
            other => other,
        }
    }
}
