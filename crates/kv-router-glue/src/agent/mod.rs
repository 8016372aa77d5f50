//! Worker agents: the few calls a vLLM or SGLang worker makes to take part
//! in decode-to-prefill reuse across processes (see `docs/agents.md`).
//!
//! - [`DonorAgent`] (decode side): opens the retained bank, serves pins on
//!   its endpoint, publishes its [`crate::DonorRecord`] to a
//!   [`crate::DirectoryPlane`] (on open, re-put before the record's lease
//!   lapses, deleted on close), its KV events (with slots) and its
//!   [`crate::WorkerAnnouncement`] on the event plane.
//! - [`TargetAgent`] (prefill side): resolves a hint's donor from a
//!   [`crate::DonorCache`] fed by the directory watch, maps the donor's
//!   memory (host shm, or CUDA IPC on the destination GPU), checks the hint
//!   against the prompt and runs the [`crate::FetchExecutor`].
//!
//! The donor agent also answers inventory snapshot requests
//! ([`DonorAgent::serve_inventory`]) so that a restarted router rebuilds
//! what it holds. Pins travel over a Unix socket or, with a
//! [`crate::PinAuthKey`], over TCP to a target on another host.
//!
//! Every refusal is an [`AgentError`]; for the target each one means "recompute".

mod donor;
mod inventory;
#[cfg(all(test, feature = "nats"))]
mod nats_tests;
mod target;

pub use donor::{DonorAgent, DonorAgentConfig, DonorCloseReport};
pub use target::TargetAgent;

use kv_bank::BankError;

use crate::{
    AnnouncementError, DonorRecordError, FetchError, InventoryError, PinServiceError, PlaneError,
    RemoteDonorError, ResolveError,
};

/// Why an agent call was refused. For a [`TargetAgent`] fetch every variant
/// is a fallback: the request recomputes its prompt.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A configuration field is out of range.
    #[error("invalid agent config `{field}`: {reason}")]
    InvalidConfig {
        /// The field (`record_ttl`, `gpus`, `destination_gpus`, ...).
        field: &'static str,
        /// What is wrong, with the value seen.
        reason: String,
    },
    /// The donor bank refused (open, store, ack, close).
    #[error("bank: {0}")]
    Bank(#[from] BankError),
    /// The pin service could not bind its endpoint.
    #[error("pin service: {0}")]
    PinService(#[from] PinServiceError),
    /// The donor record could not be built.
    #[error("donor record: {0}")]
    Record(#[from] DonorRecordError),
    /// The announcement could not be built.
    #[error("announcement: {0}")]
    Announcement(#[from] AnnouncementError),
    /// The event plane or the directory refused a publish, put or watch.
    #[error("plane: {0}")]
    Plane(#[from] PlaneError),
    /// The hint's donor is not usable: unknown, lease lapsed, stale generation.
    #[error("donor resolution: {0}")]
    Resolve(#[from] ResolveError),
    /// The donor's memory could not be mapped here.
    #[error("opening the donor: {0}")]
    OpenDonor(#[from] RemoteDonorError),
    /// Serving inventory snapshots failed (subject, transport).
    #[error("inventory: {0}")]
    Inventory(#[from] InventoryError),
    /// The fetch executor refused the hint or fell back.
    #[error("fetch: {0}")]
    Fetch(#[from] FetchError),
    /// The donor's record carries no NIXL agent (`nixl_agent_name` /
    /// `nixl_agent_metadata` absent): it serves no NIXL reads.
    #[error("donor {donor} publishes no NIXL agent")]
    NoNixlAgent {
        /// The donor engine.
        donor: kv_descriptor::EngineId,
    },
    /// The donor's record names a NIXL agent but not the memory it
    /// registered (`nixl_rank_regions` absent: a donor that predates the
    /// field): a target cannot address a READ.
    #[error("donor {donor} publishes no NIXL rank regions")]
    NoNixlRegions {
        /// The donor engine.
        donor: kv_descriptor::EngineId,
    },
    /// The NIXL runtime refused the donor's agent metadata (`load_remote_md`).
    #[error("loading the donor's NIXL agent: {0}")]
    Nixl(kv_transfer::TransferError),
    /// The metadata loaded as another agent than the record names (a record
    /// whose fields do not belong together is not used).
    #[error("the donor's NIXL metadata is agent `{loaded}`, the record names `{published}`")]
    NixlAgentMismatch {
        /// `nixl_agent_name` of the record.
        published: String,
        /// The name `load_remote` returned.
        loaded: String,
    },
}
