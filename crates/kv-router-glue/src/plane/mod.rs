//! Transports of events between the roles: the event plane (in-process, the
//! default, and NATS) and the vLLM ZMQ KV-event ingest.
//!
//! Who may use it: every role process; the router subscribes, workers
//! publish.

pub(crate) mod directory;
pub(crate) mod event_plane;
pub(crate) mod inventory;
pub(crate) mod registry;
#[cfg(feature = "vllm")]
pub mod vllm_events;
