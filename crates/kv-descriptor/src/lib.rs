//! The vocabulary and the wire of decode-to-prefill KV reuse.
//!
//! This crate owns every type that crosses a process boundary: KV layout
//! geometry ([`KvLayout`]), GPU identity ([`GpuIdentity`]), owner lifetime
//! ([`OwnerLease`]), one rank's retained bank ([`BankDescriptor`]), a TP group's
//! banks ([`BankManifest`]), block identity ([`SequenceHash`], Dynamo-compatible),
//! the fetch hint `kv.fetch_gpu@1.0` ([`FetchGpuHint`] in a [`HintEnvelope`])
//! KV events ([`KvEvent`]) and the donor control endpoint's source-pin
//! messages ([`PinClientMessage`], [`PinDonorMessage`], framed by
//! [`encode_pin_frame`] / [`split_pin_frame`]). All of them encode as
//! MessagePack ([`Wire`]).
//!
//! # Invariants
//! - A value of a validated type ([`KvLayout`], [`BankDescriptor`],
//!   [`BankManifest`]) is valid: the only ways to get one are its checking
//!   constructor and the wire decoder, which runs the same checks. Nothing is
//!   published half-built.
//! - Decoders never panic, whatever the bytes: nesting is bounded
//!   ([`MAX_WIRE_DEPTH`]), declared lengths never allocate beyond the input,
//!   trailing bytes are refused, and a manifest input above
//!   [`MAX_MANIFEST_BYTES`] is refused before decoding.
//! - Block hashes equal Dynamo's for the same tokens and block size.
//! - Unknown hint actions and unknown storage tiers are errors, never ignored.
//!
//! # Wire format
//! MessagePack maps with field names (`rmp_serde::to_vec_named`); enums are
//! `snake_case` strings (unit variants) or one-entry maps (data variants);
//! UUIDs are hyphenated strings; byte fields (CUDA handles, NIXL metadata) are
//! `bin`. The exact bytes of every type are pinned by the snapshots in
//! `tests/snapshots/`. Compatibility rules:
//! - [`BankDescriptor`] is `{parts, checksum}`; `checksum` is XXH3-64 (seed
//!   1337) of the named-field encoding of `parts`, recomputed on decode.
//! - [`BankManifest`] is `{parts: [descriptor; tp_size]}`, at most
//!   [`MAX_MANIFEST_BYTES`].
//! - Hints evolve by action version: a reader refuses any
//!   `action_type@action_version` it does not know, so a new payload shape
//!   needs a new version, never a silent field change.
//! - [`StorageTier::RetainedGpuDirect`] is unknown to readers built before it
//!   and makes them fail the event: upgrade event readers before writers.
//! - Unknown map keys are ignored (forward-compatible additions are optional
//!   fields), except inside a descriptor's `parts`: the checksum covers only
//!   the fields this reader knows, so an added field fails the checksum and a
//!   descriptor change is always a format change. A missing required key is
//!   an error naming it.
//! - Pin control messages travel in frames of a 4-byte big-endian length and
//!   a body of at most [`MAX_PIN_FRAME_BYTES`]; a longer or empty frame is
//!   refused from its header (`pin_frame.length`). The protocol evolves by
//!   adding message variants: a reader refuses a variant it does not know.
//!
//! Deliberately absent: any I/O, memory mapping, CUDA or NIXL. This crate is
//! pure data so that every other crate (and fuzzers) can depend on it.

#![deny(missing_docs)]

mod bank;
mod block_hash;
mod error;
mod event;
mod hint;
mod identity;
mod layout;
mod manifest;
mod pin_control;
mod region_layout;
mod wire;

pub use bank::{
    BankDescriptor, BankParts, ExportHandle, MemoryLocation, CUDA_HANDLE_BYTES,
    MAX_NIXL_METADATA_BYTES, MAX_SLOTS,
};
pub use block_hash::{
    chain_sequence_hash, chain_stored_blocks, sequence_hashes, sequence_hashes_keyed,
    token_block_hash, token_block_hash_keyed, token_block_hashes, HashNamespace, SequenceHash,
    TokenBlockHash,
};
pub use error::DescriptorError;
pub use event::{KvEvent, KvEventData, StorageTier, StoredBlock};
pub use hint::{
    FetchGpuHint, FetchPart, HintAction, HintEnvelope, FETCH_GPU_ACTION_TYPE,
    FETCH_GPU_ACTION_VERSION, HINT_PROTOCOL_VERSION, MAX_HINT_BLOCKS,
};
pub use identity::{
    host_id_refusal, EngineId, GpuIdentity, NvlinkFabric, OwnerLease, Role, MAX_HOST_ID_BYTES,
};
pub use layout::{DType, KvLayout, LayoutFingerprint, TensorOrder, MAX_RANK_BLOCK_BYTES};
pub use manifest::{BankManifest, MAX_MANIFEST_BYTES};
pub use pin_control::{
    encode_pin_frame, pin_frame_len, split_pin_frame, PinClientMessage, PinDonorMessage, PinGrant,
    PinPart, PinRefusal, PinRefusalReason, PinRelease, PinReleased, PinRequest,
    MAX_PIN_FRAME_BYTES, PIN_FRAME_HEADER_BYTES,
};
pub use region_layout::{ElementStrides, KvRegionLayout, RegionLayoutError, RegionOrder};
pub use wire::{Wire, MAX_WIRE_DEPTH};

/// XXH3 seed of block hashes and fingerprints; Dynamo's `XXH3_SEED`.
pub const XXH3_SEED: u64 = 1337;
