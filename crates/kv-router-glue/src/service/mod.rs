//! The router service: advise requests over the event plane's request/reply
//! (NATS subject [`ADVISE_SUBJECT`] by default, another per namespace where
//! routers of several share one NATS server; queue group
//! [`ADVISE_QUEUE_GROUP`] so several router replicas share the requests), decided by [`RouterService`]
//! over the inventory index, a [`crate::DonorDirectory`] and the
//! [`crate::Advisor`].
//!
//! The wire schema ([`AdviseRequest`], [`AdviseReply`]) is MessagePack with
//! named fields through [`kv_descriptor::Wire`] and its bounded decoder; the
//! field-by-field description is in `docs/wire-formats.md` ("Advise").
//!
//! [`AdviseClient`] is the blocking caller's side (the `kv_reuse` wheel's
//! `RouterClient`).
//!
//! [`serve_advise`] / [`AdviseServer`] serve a [`RouterService`] on a NATS
//! connection (the `kv-reuse-router` binary runs it; `docs/router-service.md`).

#[cfg(feature = "qualify")]
pub mod bench;
mod client;
#[cfg(all(test, feature = "worker"))]
mod client_tests;
mod dedicated;
mod follow;
mod follow_stats;
mod router_service;
mod serve;
#[cfg(all(test, feature = "worker"))]
mod serve_tests;
#[cfg(feature = "vllm")]
mod vllm_spec;
mod wire;
#[cfg(all(test, feature = "worker"))]
mod wire_props;

pub use client::{
    check_advise_subject, AdviseClient, AdviseClientError, KEEPALIVE_INTERVAL,
    MAX_ADVISE_SUBJECT_BYTES,
};
pub use dedicated::{DedicatedAdviseServer, DedicatedOptions};
pub use follow::{
    parse_subject, FollowStats, RouterInventory, REFUSAL_LOG_EVERY, REOPEN_BACKOFF_MAX,
    REOPEN_BACKOFF_MIN,
};
pub use router_service::RouterService;
pub use serve::{serve_advise, AdviseServer, ServeReport, ServerStages, ServiceError, StageProbe};
#[cfg(feature = "vllm")]
pub use vllm_spec::{vllm_worker_key, VllmEndpointSpec, VllmSpecError, VLLM_WORKER_KEY_SEED};
pub use wire::{
    AdviseKeys, AdviseRefusal, AdviseReply, AdviseRequest, AdviseResult, ADVISE_QUEUE_GROUP,
    ADVISE_SUBJECT, MAX_ADVISE_BLOCKS, MAX_ADVISE_REQUEST_BYTES, MAX_ADVISE_TOKENS,
    MAX_REQUEST_ID_BYTES,
};
