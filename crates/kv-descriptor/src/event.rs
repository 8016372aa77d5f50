//! KV events: what a worker stored, removed or cleared, in which storage tier.

use serde::{Deserialize, Serialize};

use crate::{EngineId, LayoutFingerprint, Role, SequenceHash, TokenBlockHash};

/// Storage tier of the blocks an event names.
///
/// The first four values and their wire names are Dynamo's
/// (`dynamo-kv-router` 1.6.1 `protocols::StorageTier`). [`StorageTier::RetainedGpuDirect`]
/// is new: blocks a decode worker retains in GPU memory for direct fetch. A
/// reader built without it fails to decode such an event (an unknown enum
/// variant is a decode error), so it can never misfile retained blocks as
/// ordinary device-cache blocks. Upgrade readers before writers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    /// The engine's native GPU prefix cache.
    Device,
    /// Pinned host memory (CPU offload).
    HostPinned,
    /// Local disk.
    Disk,
    /// Remote or shared storage.
    External,
    /// A retained bank that other workers may fetch from directly.
    RetainedGpuDirect,
}

/// One stored block: its chained sequence hash, its own token hash and,
/// for a retained bank's events, the logical slot holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    /// Chained hash naming the block and its whole prefix.
    pub sequence_hash: SequenceHash,
    /// Hash of the block's tokens alone.
    pub token_hash: TokenBlockHash,
    /// Logical slot of the block in the donor's retained bank (tier
    /// `RetainedGpuDirect` events of kv-bank), so a router in another
    /// process can write a hint without asking the donor. `None` for every
    /// other source (Dynamo, vLLM). Absent on the wire when `None`: older
    /// encodings decode, and events without slots encode byte-identically
    /// to the encoding before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventData {
    /// Blocks became available, in prefix order, the first one a child of `parent`
    /// (`None`: the first block is a root block).
    Stored {
        /// Parent of the first block.
        parent: Option<SequenceHash>,
        /// Blocks, root first.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks stopped being available.
    Removed {
        /// Sequence hashes removed.
        sequence_hashes: Vec<SequenceHash>,
    },
    /// Every block of this tier on this publisher is gone.
    Cleared,
}

/// One KV event from one publisher.
///
/// `event_id` increases by exactly one per event of a publisher incarnation,
/// starting at 1: a reader that sees a jump knows it missed events and must
/// resync; a repeat is a duplicate to ignore.
///
/// ```
/// use kv_descriptor::*;
/// let e = KvEvent {
///     publisher: EngineId(uuid::Uuid::from_u128(5)),
///     event_id: 1,
///     role: Role::Decode,
///     layout_fingerprint: LayoutFingerprint(7),
///     tp_size: 1,
///     tier: StorageTier::RetainedGpuDirect,
///     data: KvEventData::Cleared,
/// };
/// assert_eq!(KvEvent::from_wire(&e.to_wire().unwrap()).unwrap(), e);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Publishing engine incarnation.
    pub publisher: EngineId,
    /// Per-publisher sequence number, from 1, +1 per event.
    pub event_id: u64,
    /// Publisher's role.
    pub role: Role,
    /// Publisher's layout fingerprint.
    pub layout_fingerprint: LayoutFingerprint,
    /// Publisher's TP size.
    pub tp_size: u32,
    /// Tier of the named blocks.
    pub tier: StorageTier,
    /// The change.
    pub data: KvEventData,
}
