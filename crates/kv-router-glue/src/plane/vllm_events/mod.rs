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
//!   ([`tier_of_medium`]), LoRA / cache-salt / multimodal extra keys mapped
//!   to a [`kv_descriptor::HashNamespace`], KV cache groups tracked;
//! - the subscriber ([`VllmSubscriber`]): ready before it returns, gaps
//!   repaired through the replay socket, unrecoverable loss answered by an
//!   inventory reset;
//! - a publisher of the same protocol ([`VllmZmqPublisher`]) for test engines.
//!
//! # Invariants
//! - Batches are applied in `seq` order, each at most once.
//! - A block enters the index only under the sequence hash its token ids and
//!   its parent's sequence hash determine.
//! - Lost batches never leave stale inventory: the engine's entries are
//!   dropped and rebuilt from later events. An undecodable batch is refetched
//!   through replay; one that cannot be marks the worker as needing resync
//!   (inventory kept, no donor role) until a clear or restart makes it exact.
//! - One frame never moves the stream's position: restarts and far `seq`
//!   jumps are confirmed (replay buffer or the next batch) first.
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
    mm_hash_of_identifier, tier_of_medium, BatchOutcome, IngestStats, SkipReason, VllmIngest,
    VllmWorker, MAX_KV_GROUPS, MAX_RETIRED_NAMES,
};
pub use publisher::{VllmZmqPublisher, REPLAY_END_SEQ};
pub use subscriber::{
    parse_replay_reply, SubscriberStats, VllmSubscriber, VllmSubscriberConfig, RECENT_DIGESTS,
};
pub use wire::{
    decode_batch, encode_batch, VllmEncoding, VllmEvent, VllmEventBatch, VllmExtraKey,
    MAX_VLLM_PAYLOAD_BYTES,
};
