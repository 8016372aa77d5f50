//! Our KV events as a Dynamo router reads them (`dynamo-kv-router` 1.6.1
//! `protocols::RouterEvent`).
//!
//! [`DynamoRouterEvent`] has Dynamo's field names and nesting, so its named
//! MessagePack (`rmp_serde::to_vec_named`) or JSON encoding is decoded by
//! Dynamo's own `RouterEvent`:
//!
//! ```text
//! { worker_id: u64, storage_tier: "device" | "host_pinned" | "disk" | "external" | "retained_gpu_direct",
//!   event: { event_id: u64, dp_rank: u32,
//!            data: { stored: { parent_hash: u64 | nil, start_position: nil,
//!                              blocks: [ { block_hash: u64, tokens_hash: u64, mm_extra_info: nil } ] } }
//!                | { removed: { block_hashes: [u64] } }
//!                | "cleared" } }
//! ```
//!
//! Tier mapping (ours → Dynamo's `StorageTier`): `Device` → `device`,
//! `HostPinned` → `host_pinned`, `Disk` → `disk`, `External` → `external`,
//! `RetainedGpuDirect` → `retained_gpu_direct`, a value Dynamo 1.6.1 does not
//! know: its `RouterEvent` decoder fails on it instead of filing retained
//! blocks as device-cache blocks. Upgrade readers before writers.
//!
//! What Dynamo's event has no room for (our role, layout fingerprint, TP
//! size, engine incarnation) stays on our own wire ([`kv_descriptor::KvEvent`]).

use kv_descriptor::{KvEvent, KvEventData, StorageTier};
use kv_lookup::WorkerKey;
use serde::{Deserialize, Serialize};

/// Dynamo's `RouterEvent`, field for field (the fields we never set are
/// omitted, as Dynamo omits them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoRouterEvent {
    /// Dynamo's worker id: our stable [`WorkerKey`].
    pub worker_id: u64,
    /// Tier of the named blocks (our names are Dynamo's for the four shared tiers).
    pub storage_tier: StorageTier,
    /// The cache event.
    pub event: DynamoKvCacheEvent,
}

/// Dynamo's `KvCacheEvent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoKvCacheEvent {
    /// Per-publisher event id (ours).
    pub event_id: u64,
    /// The change.
    pub data: DynamoEventData,
    /// Data-parallel rank (0: DP is 1 in this workspace).
    pub dp_rank: u32,
}

/// Dynamo's `KvCacheEventData`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DynamoEventData {
    /// Blocks stored.
    Stored(DynamoStoreData),
    /// Blocks removed.
    Removed(DynamoRemoveData),
    /// Everything of this publisher (in this tier) removed.
    Cleared,
}

/// Dynamo's `KvCacheStoreData`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoStoreData {
    /// Sequence hash of the parent of the first block.
    pub parent_hash: Option<u64>,
    /// Absolute position of the first block (we do not send it).
    pub start_position: Option<u32>,
    /// Stored blocks, root first.
    pub blocks: Vec<DynamoStoredBlock>,
}

/// Dynamo's `KvCacheStoredBlockData`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoStoredBlock {
    /// Chained sequence hash (Dynamo's `ExternalSequenceBlockHash`).
    pub block_hash: u64,
    /// Token hash of the block alone (Dynamo's `LocalBlockHash`).
    pub tokens_hash: u64,
    /// Multimodal info: always nil (multimodal blocks are never retained).
    pub mm_extra_info: Option<()>,
}

/// Dynamo's `KvCacheRemoveData`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamoRemoveData {
    /// Sequence hashes removed.
    pub block_hashes: Vec<u64>,
}

impl DynamoRouterEvent {
    /// Our event `e` of worker `worker` as Dynamo's router event.
    ///
    /// ```
    /// use kv_descriptor::*;
    /// use kv_lookup::WorkerKey;
    /// use kv_router_glue::dynamo_events::*;
    /// let e = KvEvent { publisher: EngineId::fresh(), event_id: 3, role: Role::Decode,
    ///     layout_fingerprint: LayoutFingerprint(1), tp_size: 1, tier: StorageTier::Device,
    ///     data: KvEventData::Removed { sequence_hashes: vec![SequenceHash(9)] } };
    /// let d = DynamoRouterEvent::from_kv_event(&e, WorkerKey(77));
    /// assert_eq!(d.worker_id, 77);
    /// assert_eq!(d.event.data, DynamoEventData::Removed(DynamoRemoveData { block_hashes: vec![9] }));
    /// ```
    pub fn from_kv_event(e: &KvEvent, worker: WorkerKey) -> Self {
        let data = match &e.data {
            KvEventData::Stored { parent, blocks } => DynamoEventData::Stored(DynamoStoreData {
                parent_hash: parent.map(|p| p.0),
                start_position: None,
                blocks: blocks
                    .iter()
                    .map(|b| DynamoStoredBlock {
                        block_hash: b.sequence_hash.0,
                        tokens_hash: b.token_hash.0,
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            KvEventData::Removed { sequence_hashes } => {
                DynamoEventData::Removed(DynamoRemoveData {
                    block_hashes: sequence_hashes.iter().map(|h| h.0).collect(),
                })
            }
            KvEventData::Cleared => DynamoEventData::Cleared,
        };
        Self {
            worker_id: worker.0,
            storage_tier: e.tier,
            event: DynamoKvCacheEvent {
                event_id: e.event_id,
                data,
                dp_rank: 0,
            },
        }
    }

    /// Named MessagePack, the encoding Dynamo's `RouterEvent` requires
    /// (it does not support positional encoding).
    ///
    /// # Errors
    /// The encoder's error (never for these types in practice).
    pub fn to_msgpack(&self) -> Result<Vec<u8>, rmp_serde::encode::Error> {
        rmp_serde::to_vec_named(self)
    }
}
