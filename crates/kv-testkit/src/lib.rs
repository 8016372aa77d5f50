//! Everything needed to prove decode-to-prefill KV reuse: real request traces,
//! a reference model with real K/V, virtual-time replay and serving smoke.
//!
//! This crate owns:
//! - [`trace`]: the Mooncake conversation trace (load, validate, synthetic tokens).
//! - [`model`]: a tiny deterministic transformer whose K/V lives in a
//!   [`kv_descriptor::KvLayout`] (block-major f32, TP1..TPn), so an imported
//!   prefix can be checked bit for bit against recompute.
//! - [`replay`]: discrete-event, virtual-time replay of P prefill and D decode
//!   workers with native caches, retained banks and the real `kv_lookup`
//!   index, OFF vs ON.
//! - [`sessions`]: the multi-turn session generator (lengths from the trace).
//! - [`cluster`]: a local cluster of separate processes (nats-server,
//!   router, 2 decode and 2 prefill workers) serving conversations with
//!   reuse, and faults across those processes.
//! - [`qualify`]: the entry points `kvq` / `cargo xtask qualify` call, with
//!   serde results whose field names are the `record.json` keys.
//!
//! # Invariants
//! - Everything is deterministic given its inputs and seeds: two runs of the
//!   same function with the same options give identical results (engine ids
//!   are random but never influence a decision).
//! - Nothing here is a mock presented as a measurement: replay times come
//!   from a documented timing model ([`replay::TimingModel`]), never from a
//!   clock; model outputs are computed, never stored.
//!
//! Deliberately absent: GPU kernels for the reference model (it runs on the
//! CPU; its K/V bytes are what the GPU paths move).

#![deny(missing_docs)]

pub mod cluster;
pub mod engines;
pub mod faults;
pub mod model;
pub mod netns;
pub mod qualify;
pub mod replay;
pub mod sessions;
pub mod smoke;
pub mod trace;
