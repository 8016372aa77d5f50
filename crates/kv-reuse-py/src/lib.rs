//! `kv_reuse`: the Python wheel for the donor, router and target roles of
//! decode-to-prefill KV reuse (PyO3, abi3 for CPython >= 3.9).
//!
//! The module loads without CUDA or NIXL: the Rust crates below resolve both
//! at run time. Python classes: `Layout` (module `layout`), `Settings`
//! (`settings`), `DonorBank`, `PendingStore`, `PinServer` (`donor`), `Router`
//! (`router`), `Advice` and `CostTerms` (`advice`), `RouterClient` (`router_client`, advise over NATS), `WorkerPublisher`
//! (`publisher`, registration, KV events and the manifest on NATS), `Target` (`target`), `FetchJob`
//! (`fetch_job`), `FetchOutcome` (`fetch_outcome`),
//! `StreamGate` (`stream_gate`: an engine stream released as soon as a fetch's copies are issued); exceptions in
//! `errors`. Engine tensors cross zero-copy through `__array_interface__`,
//! DLPack and `__cuda_array_interface__` (module `array`). Unsafe code: `array`
//! (foreign tensor memory) and `stream_gate` (a foreign CUDA stream handle).
//! Module `exit_unlink`: the `atexit` hook (registered at import) that
//! removes the `/dev/shm` names of every bank still alive at interpreter exit.
//! Module `reprs`: the `__repr__` forms (values `Name(...)`, objects owning
//! a resource `<kv_reuse.Name ...>`, never a secret).
//! API and examples: docs/python.md.

mod advice;
mod array;
mod directory;
mod donor;
mod donor_imports;
mod engine_layout;
mod errors;
mod events;
mod exit_unlink;
mod fetch_job;
mod fetch_outcome;
mod layout;
mod nats_auth;
mod nats_runtime;
mod process_bound;
mod publisher;
mod reprs;
mod router;
mod router_client;
mod settings;
mod stream_gate;
mod target;

use std::collections::HashMap;

use pyo3::prelude::*;

/// Sequence hashes (u64) of the whole blocks of `tokens`, chained from the
/// root: equal to `kv_descriptor::sequence_hashes`. A partial tail block has
/// no hash.
///
/// Raises `BadArgument` naming `tokens_per_block` (0, negative) or
/// `tokens[i]` (a negative id or one past u32), `TypeError` naming `tokens`
/// when it is not a sequence of ints (a str: the prompt's text).
#[pyfunction]
fn sequence_hashes(
    tokens: &Bound<'_, PyAny>,
    tokens_per_block: &Bound<'_, PyAny>,
) -> PyResult<Vec<u64>> {
    let tokens: Vec<u32> = errors::uints("tokens", tokens)?;
    let tokens_per_block: usize =
        errors::uint_in("tokens_per_block", tokens_per_block, 1..=usize::MAX as u64)?;
    Ok(kv_descriptor::sequence_hashes(&tokens, tokens_per_block)
        .into_iter()
        .map(|h| h.0)
        .collect())
}

/// This process's resource counters (kv_bank leak snapshot): `open_fds`,
/// `shm_entries` (count), `shm_mappings`, `ipc_mappings`, `pins`,
/// `reserved_blocks`, `lease_holders`, `background_threads`, ...
#[pyfunction]
fn leak_counters() -> HashMap<&'static str, u64> {
    let s = kv_bank::leaks::snapshot();
    HashMap::from([
        ("open_fds", s.open_fds),
        ("shm_entries", s.shm_entries.len() as u64),
        ("shm_mappings", s.shm_mappings),
        ("ipc_mappings", s.ipc_mappings),
        ("device_allocations", s.device_allocations),
        ("pins", s.pins),
        ("reserved_blocks", s.reserved_blocks),
        ("lease_holders", s.lease_holders),
        ("background_threads", s.background_threads),
    ])
}

/// Removes the host shm banks of owners that stopped renewing their lease
/// (a donor process that died) whose names start with `prefix`
/// (kv_bank::reclaim_stale; live leases are never touched). Returns the
/// names unlinked (`/name`). Releases the GIL while it scans.
///
/// Raises `BadArgument` naming `prefix` when it is empty or contains `/`
/// or a control character (`kv_bank::reclaim::check_prefix`).
#[pyfunction]
#[pyo3(signature = (prefix = "kvbank"))]
fn reclaim_stale(py: Python<'_>, prefix: &str) -> PyResult<Vec<String>> {
    kv_bank::reclaim::check_prefix(prefix).map_err(|e| match e {
        kv_bank::BankError::InvalidArgument { reason, .. } => {
            errors::bad_argument("prefix", reason)
        }
        other => errors::bank(other),
    })?;
    py.allow_threads(|| kv_bank::reclaim_stale(prefix, kv_bank::reclaim::ScanTime::now()))
        .map(|r| r.removed_names())
        .map_err(errors::bank)
}

#[pymodule]
#[pyo3(name = "_native")]
fn kv_reuse(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    exit_unlink::register_hook(m)?;
    m.add_function(wrap_pyfunction!(sequence_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(leak_counters, m)?)?;
    m.add_function(wrap_pyfunction!(reclaim_stale, m)?)?;
    m.add_function(wrap_pyfunction!(events::encode_kv_event, m)?)?;
    m.add_function(wrap_pyfunction!(events::decode_kv_event, m)?)?;
    m.add_class::<layout::Layout>()?;
    m.add_class::<settings::Settings>()?;
    m.add_class::<donor::DonorBank>()?;
    m.add_class::<donor::PendingStore>()?;
    m.add_class::<donor::PinServer>()?;
    m.add_class::<router::Router>()?;
    m.add_class::<advice::Advice>()?;
    m.add_class::<advice::CostTerms>()?;
    m.add_class::<router_client::RouterClient>()?;
    m.add_class::<publisher::WorkerPublisher>()?;
    m.add_class::<directory::DonorDirectory>()?;
    m.add_class::<target::Target>()?;
    m.add_class::<fetch_outcome::FetchOutcome>()?;
    m.add_class::<fetch_job::FetchJob>()?;
    m.add_class::<stream_gate::StreamGate>()?;
    m.add_function(wrap_pyfunction!(stream_gate::layer_group_ranges, m)?)?;
    Ok(())
}
