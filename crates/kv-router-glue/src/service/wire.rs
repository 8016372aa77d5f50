//! Advise request/reply schema (MessagePack, named fields).

use kv_descriptor::{DescriptorError, EngineId, HintEnvelope, SequenceHash, Wire};
use serde::{Deserialize, Serialize};

use crate::AdmissionDecision;

/// NATS subject the router replicas serve advise requests on.
pub const ADVISE_SUBJECT: &str = "kv_reuse.advise";
/// Queue group of the advise subscription: each request reaches one replica.
pub const ADVISE_QUEUE_GROUP: &str = "kv_reuse_router";
/// Most sequence hashes one request may carry (a 128k-token prompt at 16
/// tokens per block is 8192 blocks).
pub const MAX_ADVISE_BLOCKS: usize = 8192;
/// Most token ids one request may carry.
pub const MAX_ADVISE_TOKENS: usize = 131_072;
/// Most bytes of a request id.
pub const MAX_REQUEST_ID_BYTES: usize = 256;
/// Most bytes of an encoded request; larger payloads are refused before
/// decoding (token ids are at most 5 bytes each in MessagePack).
pub const MAX_ADVISE_REQUEST_BYTES: usize = MAX_ADVISE_TOKENS * 5 + 4096;

/// The prompt's identity: exactly one of token ids or root-aligned sequence
/// hashes (the enum makes "both" and "neither" unrepresentable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdviseKeys {
    /// Prompt token ids; the service hashes them per
    /// [`kv_descriptor::sequence_hashes`] with `tokens_per_block` tokens a block
    /// (a trailing partial block is ignored).
    Tokens {
        /// Token ids of the prompt (at most [`MAX_ADVISE_TOKENS`]).
        token_ids: Vec<u32>,
        /// Tokens per KV block of the target's layout (> 0).
        tokens_per_block: u32,
    },
    /// Root-aligned sequence hashes (at most [`MAX_ADVISE_BLOCKS`]).
    SequenceHashes(Vec<SequenceHash>),
}

/// One advise request: the router picked `target` as the prefill worker for
/// `request_id`; may a donor's KV blocks be fetched instead of recomputed?
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdviseRequest {
    /// Caller's request id (1..=[`MAX_REQUEST_ID_BYTES`] bytes); echoed in the
    /// reply and used as the hint's `message_id`.
    pub request_id: String,
    /// Engine id of the prefill target.
    pub target: EngineId,
    /// Prompt identity.
    pub keys: AdviseKeys,
}

impl Wire for AdviseRequest {
    const WHAT: &'static str = "advise_request";
}

/// Why an advise request was refused before any lookup (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum AdviseRefusal {
    /// The payload did not decode as an [`AdviseRequest`] (decoder message).
    #[error("malformed advise request: {0}")]
    Malformed(String),
    /// A field is over its bound.
    #[error("advise request field `{field}` has {len}, more than {max}")]
    Oversized {
        /// Field name (`payload`, `request_id`, `token_ids`, `sequence_hashes`).
        field: String,
        /// Its length (bytes or entries).
        len: u64,
        /// The bound.
        max: u64,
    },
    /// A field is empty or zero where a value is required.
    #[error("advise request field `{field}` is empty or zero")]
    Empty {
        /// Field name (`request_id`, `tokens_per_block`).
        field: String,
    },
    /// The target engine is not a prefill worker this router knows. The
    /// message says where to look: most often the target announces in
    /// another namespace than the router's (the router then never sees it),
    /// or this router answered a request meant for another namespace's
    /// router on a shared advise subject (trial h44, 11).
    #[error(
        "unknown target engine {0} (no prefill announcement of it reached the router: is the \
         target announcing, on `kv.<namespace>.workers.announce` of the router's --namespace? \
         Or does a router of another namespace share this advise subject (each namespace needs \
         its own `--advise-subject`, and its clients the same `RouterClient(subject=)`)?)"
    )]
    UnknownTarget(EngineId),
    /// The router is draining and takes no new requests.
    #[error("router is draining")]
    Draining,
}

impl AdviseRefusal {
    /// Stable `snake_case` label of the refusal's kind, without its detail
    /// (the `outcome` label of `kv_reuse_advise_requests_total`).
    pub fn label(&self) -> &'static str {
        match self {
            AdviseRefusal::Malformed(_) => "malformed",
            AdviseRefusal::Oversized { .. } => "oversized",
            AdviseRefusal::Empty { .. } => "empty",
            AdviseRefusal::UnknownTarget(_) => "unknown_target",
            AdviseRefusal::Draining => "draining",
        }
    }
}

/// The result half of a reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdviseResult {
    /// The advisor ran: its decision with every cost term, and the
    /// `kv.fetch_gpu@1.0` envelope when admitted.
    Decided {
        /// The decision (terms, verdict).
        decision: AdmissionDecision,
        /// Present exactly when `decision` admits.
        hint: Option<HintEnvelope>,
    },
    /// Refused before the advisor ran.
    Refused(AdviseRefusal),
}

/// One advise reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdviseReply {
    /// The request's id; empty when the request was too malformed to read it.
    pub request_id: String,
    /// Decision or refusal.
    pub result: AdviseResult,
}

impl Wire for AdviseReply {
    const WHAT: &'static str = "advise_reply";
}

impl AdviseRequest {
    /// Checks the bounds and non-empty fields.
    ///
    /// # Errors
    /// [`AdviseRefusal::Oversized`] or [`AdviseRefusal::Empty`] naming the field.
    pub fn check(&self) -> Result<(), AdviseRefusal> {
        let over = |field: &str, len: usize, max: usize| AdviseRefusal::Oversized {
            field: field.to_string(),
            len: len as u64,
            max: max as u64,
        };
        if self.request_id.is_empty() {
            return Err(AdviseRefusal::Empty {
                field: "request_id".into(),
            });
        }
        if self.request_id.len() > MAX_REQUEST_ID_BYTES {
            return Err(over(
                "request_id",
                self.request_id.len(),
                MAX_REQUEST_ID_BYTES,
            ));
        }
        match &self.keys {
            AdviseKeys::Tokens {
                token_ids,
                tokens_per_block,
            } => {
                if token_ids.len() > MAX_ADVISE_TOKENS {
                    return Err(over("token_ids", token_ids.len(), MAX_ADVISE_TOKENS));
                }
                if *tokens_per_block == 0 {
                    return Err(AdviseRefusal::Empty {
                        field: "tokens_per_block".into(),
                    });
                }
            }
            AdviseKeys::SequenceHashes(h) => {
                if h.len() > MAX_ADVISE_BLOCKS {
                    return Err(over("sequence_hashes", h.len(), MAX_ADVISE_BLOCKS));
                }
            }
        }
        Ok(())
    }

    /// Decodes a request payload, bounded by [`MAX_ADVISE_REQUEST_BYTES`].
    ///
    /// # Errors
    /// [`AdviseRefusal::Oversized`] (`payload`) before decoding,
    /// [`AdviseRefusal::Malformed`] with the decoder's message.
    pub fn decode(bytes: &[u8]) -> Result<Self, AdviseRefusal> {
        if bytes.len() > MAX_ADVISE_REQUEST_BYTES {
            return Err(AdviseRefusal::Oversized {
                field: "payload".into(),
                len: bytes.len() as u64,
                max: MAX_ADVISE_REQUEST_BYTES as u64,
            });
        }
        Self::from_wire(bytes).map_err(|e: DescriptorError| AdviseRefusal::Malformed(e.to_string()))
    }
}
