//! Everything needed to prove decode-to-prefill KV reuse: real request traces,
//! a reference model with real K/V, virtual-time replay and serving smoke.
//!
//! This crate owns:
//! - [`trace`]: the Mooncake conversation trace (load, validate, synthetic tokens).
//!
//! # Invariants
//! - Everything is deterministic given its inputs and seeds: two runs of the
//!   same function with the same options give identical results.
//! - Nothing here is a mock presented as a measurement: simulated times come
//!   from a documented timing model, never from a clock.

#![deny(missing_docs)]

pub mod model;
pub mod replay;
pub mod trace;
