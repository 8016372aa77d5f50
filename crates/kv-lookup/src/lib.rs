//! Inventory index of KV holders and bounded decode-donor lookup.
//!
//! This crate owns the router's view of *who holds which KV block where*:
//! an [`InventoryIndex`] fed by [`kv_descriptor::KvEvent`]s (stored / removed /
//! cleared, per storage tier), and [`InventoryIndex::lookup`], which for a
//! request already routed to a prefill target finds the decode worker whose
//! retained bank covers the longest prefix of the request from the root, plus
//! the target's own baseline.
//!
//! # Example
//! A decode worker retains the first 4 blocks of a conversation; a 6-block
//! request routed to a prefill worker finds it as donor of those 4; once the
//! decode worker evicts them, the request finds no donor.
//!
//! ```
//! use kv_descriptor::{
//!     sequence_hashes, token_block_hashes, EngineId, KvEvent, KvEventData, LayoutFingerprint,
//!     Role, StorageTier, StoredBlock,
//! };
//! use kv_lookup::{InventoryIndex, LookupBudget, NoDonorReason, WorkerInfo, WorkerKey};
//!
//! let index = InventoryIndex::new();
//! let layout = LayoutFingerprint(42); // both run the same model: same `KvLayout::fingerprint`
//! let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: layout, tp_size: 1 };
//! let (decode, prefill) = (worker(Role::Decode), worker(Role::Prefill));
//! index.register_worker(WorkerKey(1), decode)?;
//! index.register_worker(WorkerKey(2), prefill)?;
//!
//! // 96 tokens at 16 tokens per block: 6 chained block hashes, root first.
//! let tokens: Vec<u32> = (0..96).collect();
//! let hashes = sequence_hashes(&tokens, 16);
//! let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
//!     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None })
//!     .collect();
//! // The decode worker's event stream (ids from 1), in its retained tier.
//! let event = |event_id, data| KvEvent {
//!     publisher: decode.engine, event_id, role: Role::Decode, layout_fingerprint: layout,
//!     tp_size: 1, tier: StorageTier::RetainedGpuDirect, data,
//! };
//! index.apply_event(&event(1, KvEventData::Stored { parent: None, blocks: blocks[..4].to_vec() }))?;
//!
//! let out = index.lookup(&hashes, prefill.engine, LookupBudget::default());
//! let donor = out.donor.unwrap();
//! assert_eq!((donor.engine, donor.worker, donor.blocks), (decode.engine, WorkerKey(1), 4));
//! assert_eq!(out.baseline.blocks(), 0); // the prefill worker holds none of it
//!
//! index.apply_event(&event(2, KvEventData::Removed { sequence_hashes: hashes[..4].to_vec() }))?;
//! let out = index.lookup(&hashes, prefill.engine, LookupBudget::default());
//! assert_eq!(out.donor, Err(NoDonorReason::NoRootCoverage));
//! assert!(index.holds(decode.engine, hashes[0]).is_empty());
//! # Ok::<(), kv_lookup::LookupError>(())
//! ```
//!
//! Most item examples below hide this setup (`# ` lines): `index` (empty),
//! `worker(role)` (a fresh [`WorkerInfo`], one layout, TP 1), `hashes` (4
//! chained blocks of 16 tokens), `stored(n)` (a Stored event's data: the
//! first `n` of them from the root) and `event(&worker, event_id, tier, data)`.
//!
//! # Invariants
//! - Per publisher, events apply in `event_id` order: a repeated or older id
//!   is ignored ([`EventOutcome::Duplicate`]); a skipped id is applied but
//!   reported ([`EventOutcome::Gap`]) and the worker is never offered as a
//!   donor until [`InventoryIndex::resync_worker`] replaces its inventory.
//! - A worker's new incarnation (same [`WorkerKey`], new `EngineId`) drops
//!   every entry of the old one at once; the old one's late events are
//!   ignored, until [`InventoryIndex::forget_retired`] forgets it (then its
//!   id is unknown: it may register again, empty, and its first event after
//!   that is a gap).
//! - A Stored event must chain: its `parent` held by the publisher in that
//!   tier, each block's sequence hash chained from its parent's. One that
//!   does not is stored not at all ([`EventOutcome::Unchained`]), so it never
//!   creates entries a request could match from the root, and the worker
//!   needs a resync as after a gap.
//! - A refused event or registration changes nothing.
//! - A donor is a live decode worker with the target's layout fingerprint and
//!   TP size that holds blocks `0..k` in [`kv_descriptor::StorageTier::RetainedGpuDirect`];
//!   the target must be a prefill worker. The target's retained blocks are
//!   baseline only.
//! - A lookup never exceeds its probe budget, overruns its time budget by at
//!   most [`CLOCK_CHECK_INTERVAL`] work units (~2 µs), and reserves nothing.
//! - Event application and lookups may run concurrently from any threads.
//!   The state exists twice (left-right, [`InventoryIndex`]): a lookup
//!   reads the published copy without a lock and never waits for events;
//!   mutations are serialized, go to the other copy and are published
//!   whole (a batch is seen entirely or not at all) when the call returns.
//!   Concurrent [`InventoryIndex::apply_event`] calls are combined: one
//!   caller applies all of them and publishes once, each gets its own
//!   outcome, and one thread's events apply in its call order.
//!
//! # Deliberately absent
//! Cost decisions (kv-router-glue), choosing the prefill target, pinning or
//! fetching blocks (kv-bank, kv-transfer), any I/O. Stored events' `parent`
//! is only checked, never stored: chained sequence hashes already name their
//! whole prefix.
//!
//! # Data layout
//! Workers occupy slots; 64 slots form a group. Per group, block entries
//! (sequence hash + one `u64` holder bitset per tier) are stored in *runs*,
//! arrays filled in the order Stored events announced new blocks (chain
//! order). A donor walk reads the next entry of the current run while it
//! matches the next request block (sequential memory, one `AND`-and-test
//! per block) and asks an index only where a run ends. That index, one per
//! copy, holds only *entry points*: the entries a walk cannot reach by
//! reading on from their parent's entry (about one per stored turn, so it
//! stays in cache). The full map, hash -> entry for every held hash, is
//! what event application needs; both copies keep their runs in the same
//! layout, so it exists once, on the writer's side, and the replay on the
//! second copy takes the first application's answers instead of probing
//! any map.
//! Each run also keeps, per aligned chunk of 32 entries, the `AND` of the
//! chunk's holder bitsets, if the run was filled by one Stored event that
//! passed its chain check (then each entry is an ancestor of every later
//! one). At a chunk start a walk takes the whole chunk with one compare
//! when nobody it follows is missing from that `AND` and the chunk's last
//! sequence hash is the request's at that position: chained hashes name
//! their prefix, so the entries between are exactly the request's blocks
//! between (`walk_group` in `lookup.rs` gives the argument). A skipped
//! chunk counts 32 probes, as if walked block by block, so results, probe
//! counts and the probe budget are those of the per-block walk.
//! Benchmark against `dynamo-kv-router`'s indexers (single-threaded and
//! concurrent):
//! `cargo bench -p kv-lookup --bench lookup -- [--json FILE]`.

#![deny(missing_docs)]

mod chain;
mod error;
mod holder_table;
mod index;
mod lookup;
mod mutation;
mod prefetch;
pub mod reference;
mod report;
mod twin;
mod worker;

pub use chain::UnchainedStore;
pub use error::LookupError;
pub use index::{
    EventBatchReport, EventOutcome, IndexStats, InventoryIndex, Registration, HOLDS_LOCK_WAIT,
    MAX_WORKERS,
};
pub use lookup::{
    DonorMatch, LookupBudget, LookupOutcome, NoDonorReason, TargetBaseline, CLOCK_CHECK_INTERVAL,
    INDEX_PROBE_UNITS,
};
pub use worker::{WorkerInfo, WorkerKey};
