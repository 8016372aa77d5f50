//! Moving KV bytes from a donor's retained bank to a target's blocks.
//!
//! This crate owns the copy path of a decode-to-prefill fetch:
//! - [`plan`]: from donor slots per rank to target blocks per rank, identical
//!   geometry only (TP-N to TP-N; anything else is refused before a byte
//!   moves), adjacent rows coalesced into runs; or, between two
//!   [`kv_descriptor::KvRegionLayout`]s (engine-chosen blocks inside the
//!   engine's own tensors, any memory order), a [`convert::Conversion`] per
//!   rank whose byte pieces a converting backend copies in one pass;
//! - backends behind [`CopyBackend`]: [`HostCopyBackend`] (host shared memory,
//!   CPU profile), `cuda::CudaCopyBackend` (CUDA IPC-mapped memory: device
//!   copies for runs, an NVRTC gather kernel for scattered blocks) and
//!   `nixl::NixlBackend` (NIXL/UCX, DRAM and VRAM, prepared descriptor lists;
//!   `nixl_transport` decides whether its transport may carry a GPU fetch);
//! - [`cuda_gather`]: the converting gather kernel (CUDA C source, its block
//!   and piece tables, launch geometry; pure Rust, built without `cuda` too):
//!   one launch per rank per fetch reads donor blocks and writes them in the
//!   target's [`kv_descriptor::KvRegionLayout`];
//! - [`deliver`]: one part per rank, complete only when every part delivered
//!   exactly its expected bytes, with counters (bytes, copies, host-payload
//!   bytes, backend, transport);
//! - harness (feature `qualify`, for kv-testkit only): `oracle` and `bench`,
//!   the native oracle and the ratio benchmark that `kvq oracle` /
//!   `cargo xtask bench transfer` call; `layout_oracle`: the same checks for
//!   engine-chosen blocks in every target layout; `ipc_check`: the same GPU fetch
//!   between two processes over CUDA IPC; `nixl_two_process`: a NIXL fetch
//!   from a donor agent in another process (the production shape).
//!
//! # Features
//! - `cuda` (default, enables kv-bank's `cuda`): the `cuda` module
//!   (`CudaCopyBackend`, cudarc).
//! - `nixl` (default): the `nixl` module (`NixlBackend`, nixl-sys, whose
//!   bindgen needs libclang at build time) and `nixl_transport`.
//! - `qualify` (implies `cuda`, `nixl` and kv-bank's `qualify`): the harness
//!   modules above. Not product API.
//!
//! Without default features the crate keeps [`plan`], [`convert`], [`cuda_gather`], [`deliver`],
//! [`HostCopyBackend`], [`DeliveryControl`] and [`TransferError`], with no
//! cudarc, nixl-sys, bindgen or clang-sys in its dependency graph.
//!
//! # Invariants
//! - Never a false completion: [`DeliveryReport::is_complete`] is true only if
//!   no key was missing and every rank delivered its expected bytes, with no
//!   cancellation, deadline or donor loss observed after the last byte. Any
//!   failing part fails the whole delivery.
//! - Missing keys are reported and their destination rows are never written.
//! - Nothing in flight on return, with one reported exception: every
//!   backend waits for (or aborts and quiesces) its copies before returning,
//!   so the caller may release destination reservations and donor pins as
//!   soon as `deliver` returns, unless the error says
//!   [`TransferError::may_still_write`]: a NIXL read abandoned in flight
//!   (cancel, deadline) cannot be recalled, so its destination rows must stay
//!   unused until [`CopyBackend::in_flight`] returns 0 (the glue's fetch
//!   executor orphans them and reclaims them then).
//! - On a GPU destination, payload bytes never pass through host memory
//!   (`host_payload_bytes == 0`, enforced by [`deliver`]); a NIXL part between
//!   devices whose transport is not verified device-direct fails closed
//!   ([`TransferError::TransportUnverified`], `nixl_transport`).
//! - When parts fail differently, a part that may still write decides the
//!   delivery's error ([`TransferError::may_still_write`] is then true).
//!
//! Deliberately absent: pin and reservation bookkeeping (kv-bank), IPC handle
//! import and its mapping cache (kv-bank), deciding whether to fetch
//! (kv-router-glue), resharding between different TP sizes.

#![deny(missing_docs)]
// The crate docs link the feature-gated items; a build without a feature
// documents the rest, and those links have no target there.
#![cfg_attr(
    not(all(feature = "cuda", feature = "nixl", feature = "qualify")),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(feature = "qualify")]
pub mod bench;
#[cfg(feature = "qualify")]
mod bench_convert;
#[cfg(feature = "qualify")]
mod bench_plan;
#[cfg(feature = "qualify")]
pub mod bench_sweep;
pub mod block_readback;
pub mod ci;
mod control;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_gather;
mod delivery;
mod error;
mod host;
#[cfg(feature = "qualify")]
pub mod ipc_check;
#[cfg(feature = "qualify")]
pub mod layout_oracle;
#[cfg(feature = "nixl")]
pub mod nixl;
#[cfg(feature = "nixl")]
pub mod nixl_transport;
#[cfg(feature = "qualify")]
pub mod nixl_two_process;
#[cfg(feature = "qualify")]
pub mod oracle;
pub mod plan;
mod region;

pub use ci::ci_requires;
pub use control::{
    layer_group_ranges, CancelToken, ConsumerStream, DeliveryControl, EnqueuedNotice, GroupWait,
    LayerNotice, LayersReady, LivenessProbe,
};
pub use delivery::{
    deliver, CopyBackend, DeliveryCounters, DeliveryReport, DeliveryStatus, NixlRemoteRegion,
    PartOutcome, PartReport, RankIo, SourceRegion,
};
pub use error::TransferError;
pub use host::HostCopyBackend;
pub use region::{EngineMemory, HostBuffer};
