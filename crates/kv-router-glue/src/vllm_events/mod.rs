//! vLLM KV events: decode vLLM's ZMQ event stream and feed the inventory index.
//!
//! vLLM engines started with `--kv-events-config '{"enable_kv_cache_events":
//! true, "publisher": "zmq", "endpoint": ..., "replay_endpoint": ...}'`
//! publish `BlockStored` / `BlockRemoved` / `AllBlocksCleared` batches on a
//! ZMQ PUB socket and keep recent batches for replay on a ROUTER socket.
//! This module owns:
//! - the wire format ([`decode_batch`], [`encode_batch`]; exact shapes in
//!   `docs/wire-formats.md` and [`wire`](self#wire-format));
//! - the mapping onto our [`kv_descriptor::KvEvent`]s ([`VllmIngest`]):
//!   sequence hashes recomputed from token ids (vLLM's block hashes are not
//!   Dynamo's), vLLM `medium` mapped to a [`kv_descriptor::StorageTier`]
//!   ([`tier_of_medium`]), blocks that token ids alone do not name skipped;
//! - the subscriber ([`VllmSubscriber`]): ready before it returns, gaps
//!   repaired through the replay socket, unrecoverable loss answered by an
//!   inventory reset;
//! - a publisher of the same protocol ([`VllmZmqPublisher`]) for test engines.
//!
//! # Invariants
//! - Batches are applied in `seq` order, each at most once.
//! - A block enters the index only under the sequence hash its token ids and
//!   its parent's sequence hash determine.
//! - Lost or undecodable batches never leave stale inventory: the engine's
//!   entries are dropped and rebuilt from later events.
//!
//! # Wire format
//! See [`decode_batch`] and the `wire` module documentation: array-like and
//! map-shaped batches and events, integer or byte-string block hashes.

mod error;
mod ingest;
mod publisher;
mod subscriber;
mod wire;

pub use error::VllmEventError;
pub use ingest::{
    tier_of_medium, BatchOutcome, IngestStats, SkipReason, VllmIngest, VllmWorker,
    MAX_RETIRED_NAMES,
};
pub use publisher::{VllmZmqPublisher, REPLAY_END_SEQ};
pub use subscriber::{SubscriberStats, VllmSubscriber, VllmSubscriberConfig};
pub use wire::{
    decode_batch, encode_batch, VllmEncoding, VllmEvent, VllmEventBatch, MAX_VLLM_PAYLOAD_BYTES,
};
