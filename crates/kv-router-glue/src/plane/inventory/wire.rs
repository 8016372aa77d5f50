//! Wire forms of the inventory snapshot: [`InventoryRequest`] (router to
//! worker) and [`InventoryReply`] (worker to router), MessagePack with named
//! fields, bounded before decoding and validated field by field
//! (docs/wire-formats.md, "Inventory snapshot").

use kv_descriptor::{
    DescriptorError, EngineId, LayoutFingerprint, SequenceHash, TokenBlockHash, Wire,
};
use serde::{Deserialize, Serialize};

/// Longest accepted encoded [`InventoryRequest`], in bytes.
pub const MAX_INVENTORY_REQUEST_BYTES: usize = 1024;
/// Longest accepted encoded [`InventoryReply`], in bytes: NATS's default
/// `max_payload` (1 MiB), so one page always fits one message.
pub const MAX_INVENTORY_REPLY_BYTES: usize = 1024 * 1024;
/// Most blocks one page may carry (a named-field block encodes to about 100
/// bytes, so a full page stays under [`MAX_INVENTORY_REPLY_BYTES`]).
pub const MAX_SNAPSHOT_PAGE_BLOCKS: u32 = 8192;
/// Most TP ranks a snapshot may name (the bits of `rank_acks`).
pub const MAX_SNAPSHOT_TP: u32 = 64;

/// Asks the worker `engine_id` for one page of its inventory: the ready
/// blocks in slot order from logical slot `from_slot` on, at most
/// `max_blocks` (1..=[`MAX_SNAPSHOT_PAGE_BLOCKS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireRequest")]
pub struct InventoryRequest {
    /// The incarnation asked (a worker answers only for itself).
    pub engine_id: EngineId,
    /// First logical slot of the page.
    pub from_slot: u32,
    /// Most blocks in the reply page.
    pub max_blocks: u32,
}

#[derive(Deserialize)]
struct WireRequest {
    engine_id: EngineId,
    from_slot: u32,
    max_blocks: u32,
}

impl TryFrom<WireRequest> for InventoryRequest {
    type Error = InventoryWireError;
    fn try_from(w: WireRequest) -> Result<Self, Self::Error> {
        if w.max_blocks == 0 || w.max_blocks > MAX_SNAPSHOT_PAGE_BLOCKS {
            return Err(bad(
                "inventory_request.max_blocks",
                format!(
                    "must be 1..={MAX_SNAPSHOT_PAGE_BLOCKS}, got {}",
                    w.max_blocks
                ),
            ));
        }
        Ok(Self {
            engine_id: w.engine_id,
            from_slot: w.from_slot,
            max_blocks: w.max_blocks,
        })
    }
}

impl Wire for InventoryRequest {
    const WHAT: &'static str = "inventory_request";
}

impl InventoryRequest {
    /// Decodes and validates, refusing oversized input before decoding.
    ///
    /// # Errors
    /// [`InventoryWireError::TooLarge`] or [`InventoryWireError::Decode`]
    /// (whose message names the field).
    pub fn decode(bytes: &[u8]) -> Result<Self, InventoryWireError> {
        check_size("inventory_request", bytes, MAX_INVENTORY_REQUEST_BYTES)?;
        Self::from_wire(bytes).map_err(InventoryWireError::Decode)
    }
}

/// One ready block of a snapshot page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SnapshotBlock {
    /// Chained hash naming the block and its prefix.
    pub sequence_hash: SequenceHash,
    /// Hash of the block's own tokens.
    pub token_hash: TokenBlockHash,
    /// The block before it in its prefix (`None`: a root block).
    pub parent: Option<SequenceHash>,
    /// Logical slot in the donor's bank (the same on every TP rank).
    pub slot: u32,
    /// Bit `r` set: TP rank `r` acknowledged its part. A snapshot lists
    /// ready blocks only, so every rank's bit is set.
    pub rank_acks: u64,
}

/// One page of a worker's inventory, consistent with its KV event stream:
/// it is the state after events `1..=last_event_id` and before any later one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireSnapshot")]
pub struct InventorySnapshot {
    /// The worker incarnation (its events' `publisher`).
    pub engine_id: EngineId,
    /// Generation of its bank.
    pub bank_generation: u64,
    /// Its layout fingerprint.
    pub layout_fingerprint: LayoutFingerprint,
    /// Its TP size (1..=[`MAX_SNAPSHOT_TP`]).
    pub tp_size: u32,
    /// Id of the last KV event this page reflects (0: none published yet).
    pub last_event_id: u64,
    /// Ready blocks, strictly increasing `slot`.
    pub blocks: Vec<SnapshotBlock>,
    /// Where the next page starts; `None` on the last page.
    pub next_slot: Option<u32>,
}

#[derive(Deserialize)]
struct WireSnapshot {
    engine_id: EngineId,
    bank_generation: u64,
    layout_fingerprint: LayoutFingerprint,
    tp_size: u32,
    last_event_id: u64,
    blocks: Vec<SnapshotBlock>,
    next_slot: Option<u32>,
}

/// The mask of every rank of TP `tp` (1..=64).
pub(crate) fn all_ranks(tp: u32) -> u64 {
    if tp >= 64 {
        u64::MAX
    } else {
        (1u64 << tp) - 1
    }
}

impl TryFrom<WireSnapshot> for InventorySnapshot {
    type Error = InventoryWireError;
    fn try_from(w: WireSnapshot) -> Result<Self, Self::Error> {
        if w.tp_size == 0 || w.tp_size > MAX_SNAPSHOT_TP {
            return Err(bad(
                "inventory_snapshot.tp_size",
                format!("must be 1..={MAX_SNAPSHOT_TP}, got {}", w.tp_size),
            ));
        }
        if w.blocks.len() > MAX_SNAPSHOT_PAGE_BLOCKS as usize {
            return Err(bad(
                "inventory_snapshot.blocks",
                format!(
                    "{} blocks, above {MAX_SNAPSHOT_PAGE_BLOCKS}",
                    w.blocks.len()
                ),
            ));
        }
        let mask = all_ranks(w.tp_size);
        let mut prev: Option<u32> = None;
        for b in &w.blocks {
            if prev.is_some_and(|p| b.slot <= p) {
                return Err(bad(
                    "inventory_snapshot.blocks.slot",
                    format!("slots must strictly increase: {} after {prev:?}", b.slot),
                ));
            }
            prev = Some(b.slot);
            if b.rank_acks != mask {
                return Err(bad(
                    "inventory_snapshot.blocks.rank_acks",
                    format!(
                        "{:#x} at slot {}: a ready block has every rank of TP{} ({mask:#x})",
                        b.rank_acks, b.slot, w.tp_size
                    ),
                ));
            }
            if b.parent == Some(b.sequence_hash) {
                return Err(bad(
                    "inventory_snapshot.blocks.parent",
                    format!("block {:?} names itself as parent", b.sequence_hash),
                ));
            }
        }
        if let (Some(next), Some(last)) = (w.next_slot, prev) {
            if next <= last {
                return Err(bad(
                    "inventory_snapshot.next_slot",
                    format!("{next} is not past the page's last slot {last}"),
                ));
            }
        }
        Ok(Self {
            engine_id: w.engine_id,
            bank_generation: w.bank_generation,
            layout_fingerprint: w.layout_fingerprint,
            tp_size: w.tp_size,
            last_event_id: w.last_event_id,
            blocks: w.blocks,
            next_slot: w.next_slot,
        })
    }
}

/// Why a worker did not answer with a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum InventoryRefusal {
    /// The request named another incarnation (a stale registration).
    #[error("this worker is {actual}, not the engine asked")]
    OtherEngine {
        /// The incarnation that answered.
        actual: EngineId,
    },
    /// The worker's bank is closed: it holds nothing.
    #[error("the bank is closed")]
    Closed,
    /// The request did not decode (bounds, fields).
    #[error("the request was malformed")]
    Malformed,
}

/// What a worker answers to an [`InventoryRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InventoryReply {
    /// One page of the inventory.
    Snapshot(InventorySnapshot),
    /// No snapshot, and why.
    Refused(InventoryRefusal),
}

impl Wire for InventoryReply {
    const WHAT: &'static str = "inventory_reply";
}

impl InventoryReply {
    /// Decodes and validates, refusing oversized input before decoding.
    ///
    /// # Errors
    /// [`InventoryWireError::TooLarge`] or [`InventoryWireError::Decode`]
    /// (whose message names the field).
    pub fn decode(bytes: &[u8]) -> Result<Self, InventoryWireError> {
        check_size("inventory_reply", bytes, MAX_INVENTORY_REPLY_BYTES)?;
        Self::from_wire(bytes).map_err(InventoryWireError::Decode)
    }
}

/// Why inventory bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryWireError {
    /// A field is out of range (named `inventory_snapshot.<field>` or
    /// `inventory_request.<field>`).
    #[error("invalid `{field}`: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong, with the value seen.
        reason: String,
    },
    /// Bytes over the message's bound.
    #[error("`{what}` is {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// `inventory_request` or `inventory_reply`.
        what: &'static str,
        /// Size in bytes.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Bytes that do not decode (the message names the field).
    #[error("cannot decode: {0}")]
    Decode(DescriptorError),
}

fn bad(field: &'static str, reason: String) -> InventoryWireError {
    InventoryWireError::InvalidField { field, reason }
}

fn check_size(what: &'static str, bytes: &[u8], limit: usize) -> Result<(), InventoryWireError> {
    if bytes.len() > limit {
        return Err(InventoryWireError::TooLarge {
            what,
            size: bytes.len(),
            limit,
        });
    }
    Ok(())
}
