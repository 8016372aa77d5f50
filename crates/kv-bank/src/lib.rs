//! Retained KV banks: memory a decode worker keeps its finished KV blocks in,
//! so that a later prefill can fetch them instead of recomputing.
//!
//! This crate owns:
//! - **memory behind one trait** ([`BankMemory`]): host memory shareable
//!   between processes ([`HostShmMemory`], POSIX shared memory mapped by
//!   name) and CUDA device memory ([`CudaDeviceMemory`], exported by CUDA IPC
//!   handle; [`CudaIpcImport`] maps it in another process through a
//!   process-wide cache, so each donor allocation is opened once per process);
//! - **bank managers** ([`BankManager`]): one role's retained bank, TP1 or one
//!   rank-local [`RankBank`] per TP rank sharing logical slot ids, with the
//!   byte budget divided across ranks;
//! - **destination reservations** ([`DestinationPool`]) on the fetching side;
//! - **owner leases** ([`lease`]): one lease file per bank rank in
//!   [`SHM_DIR`], renewed by the owner (background thread or
//!   [`BankManager::renew_lease`]); importers ([`HostShmMemory::open_descriptor`],
//!   [`CudaIpcImport::open_descriptor`], and [`HostShmMemory::open`] for any
//!   segment that has a lease) refuse a bank whose lease is missing, lapsed,
//!   revoked or names another engine id, generation, role or rank;
//! - **stale-bank reclamation** ([`reclaim`]): [`reclaim_stale`] and the
//!   background [`Reclaimer`] remove banks whose lease lapsed, and orphan
//!   segments of dead creators, without an operator;
//! - **leak accounting** ([`leaks`]): [`leaks::snapshot`] of fds, this
//!   process's shm entries, mappings, device memory, pins, reservations,
//!   leases and threads, compared by [`LeakSnapshot::leaks_since`];
//! - **checks runnable elsewhere** (feature `qualify`, for kv-testkit only):
//!   `gpu_check` (two-process CUDA IPC check for a GPU machine),
//!   `qualify_section` (CPU bank lifecycle for `cargo xtask qualify`) and
//!   `qualify_faults` (the bank rows of the fault table: owner killed, owner
//!   stalled, forged hints, stale generation, allocation failure).
//!
//! # Features
//! - `cuda` (default): CUDA device banks through cudarc: [`CudaDeviceMemory`],
//!   [`CudaIpcImport`] and its process-wide mapping cache, [`cuda_probe`],
//!   [`device_memory_info`], [`gpu_location`], [`ipc_cache_stats`]. Without
//!   it (a router, a CPU-only worker) those items do not exist,
//!   [`BankManager::new_cuda`] returns [`BankError::CudaUnavailable`] and the
//!   leak snapshot counts no IPC mappings; [`open_device_descriptor`] (the
//!   device import every build has) returns `CudaUnavailable`; host banks
//!   are unchanged.
//! - `qualify` (implies `cuda`): the qualification harness modules `faults`,
//!   `gpu_check` and the `qualify_section` section. Not product API: only
//!   kv-testkit (and this crate's own harness tests) turns it on.
//!
//! # Invariants
//! - A slot holds one rank's part of one sealed (full) block. A store is
//!   *ready* (visible to lookups, pins, inventory and events) only after
//!   every rank wrote and acknowledged its part; a failed or timed-out rank
//!   rolls it back on all ranks, with no event.
//! - A rank's ack is checked, not trusted: it is refused
//!   ([`BankError::Unwritten`], the store stays pending) until every entry
//!   of that rank was written by a successful
//!   [`BankManager::write_pending`] / [`BankManager::write_pending_from_device`]
//!   (the only writers a store counts), so a block never becomes ready
//!   holding an evicted block's bytes. Once acked, the rank's part is sealed:
//!   its writes are refused ([`BankError::RankAcked`]).
//! - Eviction is LRU over ready, unpinned slots and never touches a pinned or
//!   pending slot. Pins are RAII guards ([`ManagerPin`]).
//! - Retained blocks are copies, independent of the engine's native cache; the
//!   inventory ([`BankManager::inventory`]) and the events say exactly what is
//!   retained.
//! - Blocks in the [`ExclusionLineage`] (multimodal-dependent) are never
//!   stored or pinned for export; the lineage outlives native clears and bank
//!   generations.
//! - A closed generation is dead: pins, stores and descriptors naming it are
//!   refused; memory is freed once pins drained.
//! - Every failing operation leaves nothing half-registered.
//! - Host segments reserve their pages when they are created, so a bank that
//!   does not fit in [`SHM_DIR`] is refused ([`BankError::ShmNoSpace`])
//!   instead of killing the process with `SIGBUS` at a later write.
//! - A bank belongs to the process that created it ([`CreatorProcess`]): a
//!   forked child that inherits it cannot store into it or renew its leases
//!   ([`BankError::NotCreator`]), and dropping the child's copy only unmaps:
//!   the creator's segments, leases and renewal thread are left alone.
//! - A bank is importable only while its owner lease is live and names the
//!   importer's engine id and generation. A lapsed lease is never renewed:
//!   the owner's generation dies with it (as by close), and a reclaimer
//!   revokes it before unlinking, segment first, so no consumer imports a
//!   reclaimed bank. `pin_hint` refuses forged, out-of-range and
//!   wrong-incarnation hints from the slot table alone, never reading memory.
//!
//! Deliberately absent: moving bytes between banks (kv-transfer), deciding
//! what to fetch (kv-lookup, kv-router-glue) and NIXL registration. Leases
//! are host-local (`CLOCK_BOOTTIME`, shared-memory directory): a remote importer
//! (multi-node NVLink) relies on the descriptor generation and the donor's
//! `pin_hint` checks, not on reading the lease. The
//! fabric-handle path ([`CudaDeviceMemory::new_fabric`]) needs an IMEX
//! channel; without one it fails with a clear error and callers use IPC.

#![deny(missing_docs)]
// The crate docs link the feature-gated items; a build without a feature
// documents the rest, and those links have no target there.
#![cfg_attr(
    not(all(feature = "cuda", feature = "qualify")),
    allow(rustdoc::broken_intra_doc_links)
)]

#[cfg(feature = "qualify")]
pub mod child_process;
mod creator;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
#[cfg(feature = "qualify")]
pub mod faults;
#[cfg(feature = "qualify")]
pub mod gpu_check;
#[cfg(feature = "cuda")]
mod ipc_cache;
pub mod leaks;
pub mod lease;
mod lease_clock;
mod lineage;
mod manager;
pub mod memory;
#[cfg(feature = "qualify")]
mod qualify;
mod rank;
pub mod reclaim;
mod reservation;
mod shm;
mod slots;

pub use creator::CreatorProcess;
#[cfg(feature = "cuda")]
pub use cuda::{
    cuda_driver_here, cuda_probe, cuda_usable_here, device_memory_info, gpu_location,
    ipc_cache_stats, CudaDeviceInfo, CudaDeviceMemory, CudaIpcImport, DeviceMemoryInfo,
    IpcCacheStats,
};
pub use error::BankError;
#[cfg(feature = "qualify")]
pub use faults::{qualify_faults, FaultRow};
pub use leaks::{Leak, LeakSnapshot};
pub use lease::{
    check_descriptor_lease, lease_name_for, read_lease, LeaseConfig, LeaseRecord, LeaseRenewal,
    SHM_DIR,
};
pub use lease_clock::LeaseInstant;
pub use lineage::ExclusionLineage;
pub use manager::{
    sealed_blocks, BankConfig, BankManager, BankStats, Inventory, LeaseStatus, ManagerPin,
    PendingStore, StoreStatus, DEFAULT_SHM_PREFIX,
};
pub use memory::{open_device_descriptor, BankMemory, DeviceRows, MemoryKind};
#[cfg(feature = "qualify")]
pub use qualify::{qualify_section, QualifyCheck, QualifySection};
pub use rank::{RankBank, RankMemory};
pub use reclaim::{
    reclaim_stale, reclaim_stale_with, ReclaimPolicy, ReclaimReport, ReclaimedBank, Reclaimer,
    ReclaimerTotals,
};
pub use reservation::{
    CancelledReservation, CompletedBlocks, DestinationPool, DestinationReservation,
};
pub use shm::HostShmMemory;
