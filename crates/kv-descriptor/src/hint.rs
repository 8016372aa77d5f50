//! The typed fetch hint `kv.fetch_gpu@1.0`, carried in Dynamo's `KvHint` envelope.
//!
//! Envelope fields follow `dynamo-kv-router` 1.6.1 `kv_hints::KvHint`:
//! `{protocol_version, message_id, actions: [{action_id, action_type,
//! action_version, payload}]}` with `payload` a string-keyed map. Our payload
//! uses only maps, strings, integers and arrays, so a Dynamo reader decodes the
//! envelope (its payload type is a JSON-value map) without knowing our action.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{DescriptorError, EngineId, LayoutFingerprint, SequenceHash};

/// Envelope protocol version, equal to Dynamo's `KV_HINT_PROTOCOL_VERSION`.
pub const HINT_PROTOCOL_VERSION: &str = "0.1";
/// Action type of a decode-to-prefill GPU fetch.
pub const FETCH_GPU_ACTION_TYPE: &str = "kv.fetch_gpu";
/// Action version this crate reads and writes.
pub const FETCH_GPU_ACTION_VERSION: &str = "1.0";

/// One rank's part of a fetch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchPart {
    /// TP rank, equal to the part's index in [`FetchGpuHint::parts`].
    pub tp_rank: u32,
    /// Donor logical slot ids, one per fetched block, in block order.
    pub slot_ids: Vec<u32>,
    /// Bytes this part must deliver: `slot_ids.len() x rank_block_bytes`.
    pub expected_bytes: u64,
}

/// Payload of `kv.fetch_gpu@1.0`: which donor bank holds which blocks.
///
/// `sequence_hashes` is root-aligned: `sequence_hashes[i]` names request block
/// `i`, and the donor covers all of them. The fetch moves blocks
/// `fetch_from..sequence_hashes.len()`; the target already holds the blocks
/// before `fetch_from`. Every part lists one slot per fetched block.
///
/// ```
/// use kv_descriptor::*;
/// let h = FetchGpuHint {
///     donor_engine_id: EngineId(uuid::Uuid::from_u128(1)),
///     bank_generation: 1,
///     layout_fingerprint: LayoutFingerprint(9),
///     tp_size: 1,
///     sequence_hashes: vec![SequenceHash(10), SequenceHash(11)],
///     fetch_from: 0,
///     parts: vec![FetchPart { tp_rank: 0, slot_ids: vec![3, 4], expected_bytes: 2 * 512 }],
///     donor_control_endpoint: "nats://kv.decode.0".into(),
/// };
/// h.validate(512).unwrap();
/// let env = HintEnvelope::fetch_gpu("msg-1", "a0", &h).unwrap();
/// use kv_descriptor::Wire;
/// let back = HintEnvelope::from_wire(&env.to_wire().unwrap()).unwrap();
/// assert_eq!(back.fetch_gpu_actions().unwrap(), vec![h]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchGpuHint {
    /// Donor engine incarnation.
    pub donor_engine_id: EngineId,
    /// Donor bank generation; a fetch against another generation is refused.
    pub bank_generation: u64,
    /// Fingerprint of the donor layout; must equal the target's.
    pub layout_fingerprint: LayoutFingerprint,
    /// TP size of donor and target (no resharding).
    pub tp_size: u32,
    /// Root-aligned sequence hashes covered by the donor.
    pub sequence_hashes: Vec<SequenceHash>,
    /// Index of the first block to fetch.
    pub fetch_from: u32,
    /// One part per rank, in rank order.
    pub parts: Vec<FetchPart>,
    /// Where to reach the donor's control plane (subject or address).
    pub donor_control_endpoint: String,
}

/// Largest number of blocks one hint may name (2^20 blocks = 16M tokens at 16/block).
pub const MAX_HINT_BLOCKS: usize = 1 << 20;

impl FetchGpuHint {
    /// Number of blocks the fetch moves.
    pub fn fetch_blocks(&self) -> usize {
        self.sequence_hashes
            .len()
            .saturating_sub(self.fetch_from as usize)
    }

    /// Checks internal consistency given one rank's block bytes.
    ///
    /// # Errors
    /// Names the field: `tp_size` 0 or not equal to the part count, parts out of
    /// rank order, `fetch_from` not below the block count, a part whose slot
    /// count differs from the fetched blocks, that names a slot twice or a slot
    /// at or above [`crate::MAX_SLOTS`], or whose `expected_bytes` is not
    /// `slots x rank_block_bytes` (bytes), too many blocks, empty endpoint,
    /// generation 0. Slot ids are not checked against a bank's `slot_count`
    /// here: the fetch executor does that against the donor's manifest.
    pub fn validate(&self, rank_block_bytes: u64) -> Result<(), DescriptorError> {
        if self.bank_generation == 0 {
            return Err(DescriptorError::field(
                "hint.bank_generation",
                "must be at least 1",
            ));
        }
        if self.tp_size == 0 || self.parts.len() != self.tp_size as usize {
            return Err(DescriptorError::field(
                "hint.parts",
                format!("tp_size {} but {} parts", self.tp_size, self.parts.len()),
            ));
        }
        if self.sequence_hashes.is_empty() || self.sequence_hashes.len() > MAX_HINT_BLOCKS {
            return Err(DescriptorError::field(
                "hint.sequence_hashes",
                format!(
                    "must hold 1..={MAX_HINT_BLOCKS} hashes, got {}",
                    self.sequence_hashes.len()
                ),
            ));
        }
        if self.fetch_from as usize >= self.sequence_hashes.len() {
            return Err(DescriptorError::field(
                "hint.fetch_from",
                format!(
                    "{} is not below the {} covered blocks",
                    self.fetch_from,
                    self.sequence_hashes.len()
                ),
            ));
        }
        let n = self.fetch_blocks();
        for (i, p) in self.parts.iter().enumerate() {
            if p.tp_rank as usize != i {
                return Err(DescriptorError::field(
                    "hint.parts.tp_rank",
                    format!("part {i} is rank {}", p.tp_rank),
                ));
            }
            if p.slot_ids.len() != n {
                return Err(DescriptorError::field(
                    "hint.parts.slot_ids",
                    format!(
                        "rank {i} lists {} slots for {n} fetched blocks",
                        p.slot_ids.len()
                    ),
                ));
            }
            if let Some(&bad) = p.slot_ids.iter().find(|&&s| s >= crate::MAX_SLOTS) {
                return Err(DescriptorError::field(
                    "hint.parts.slot_ids",
                    format!(
                        "rank {i} names slot {bad}, not below MAX_SLOTS {}",
                        crate::MAX_SLOTS
                    ),
                ));
            }
            // One slot holds one block: a repeated slot would copy one block into
            // two positions and silently corrupt the prefix.
            let mut sorted = p.slot_ids.clone();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(DescriptorError::field(
                    "hint.parts.slot_ids",
                    format!("rank {i} names slot {} twice", w[0]),
                ));
            }
            // Checked: `rank_block_bytes` is caller input and may be absurd.
            let want = (n as u64).checked_mul(rank_block_bytes);
            if want != Some(p.expected_bytes) {
                return Err(DescriptorError::field(
                    "hint.parts.expected_bytes",
                    format!(
                        "rank {i} expects {} bytes, geometry gives {}",
                        p.expected_bytes,
                        want.map_or_else(|| "an overflowing u64".to_owned(), |w| w.to_string())
                    ),
                ));
            }
        }
        if self.donor_control_endpoint.is_empty() {
            return Err(DescriptorError::field(
                "hint.donor_control_endpoint",
                "must not be empty",
            ));
        }
        Ok(())
    }
}

/// One action of an envelope, payload kept as a MessagePack value until its
/// type and version are known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HintAction {
    /// Id unique inside the envelope.
    pub action_id: String,
    /// `kv.fetch_gpu` for ours; others are refused by [`HintEnvelope::fetch_gpu_actions`].
    pub action_type: String,
    /// `1.0` for ours.
    pub action_version: String,
    /// String-keyed map.
    pub payload: BTreeMap<String, rmpv::Value>,
}

/// Dynamo-compatible hint envelope (`kv_hints::KvHint` of dynamo-kv-router 1.6.1).
///
/// Decoding the envelope accepts any action; [`HintEnvelope::fetch_gpu_actions`]
/// then refuses every action that is not `kv.fetch_gpu@1.0`:
///
/// ```
/// use kv_descriptor::{DescriptorError, HintAction, HintEnvelope, HINT_PROTOCOL_VERSION};
/// let env = HintEnvelope {
///     protocol_version: HINT_PROTOCOL_VERSION.into(),
///     message_id: "req-1".into(),
///     actions: vec![HintAction {
///         action_id: "a0".into(),
///         action_type: "kv.fetch_gpu".into(),
///         action_version: "2.0".into(),
///         payload: Default::default(),
///     }],
/// };
/// let err = env.fetch_gpu_actions().unwrap_err();
/// assert!(matches!(err, DescriptorError::UnsupportedAction { .. }));
/// assert!(err.to_string().contains("kv.fetch_gpu@2.0"));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HintEnvelope {
    /// Always [`HINT_PROTOCOL_VERSION`] when written here.
    pub protocol_version: String,
    /// Message id (request id of the routed request).
    pub message_id: String,
    /// Actions in order.
    pub actions: Vec<HintAction>,
}

impl HintEnvelope {
    /// Envelope with a single `kv.fetch_gpu@1.0` action.
    ///
    /// # Errors
    /// [`DescriptorError::Encode`] if the payload cannot be encoded.
    pub fn fetch_gpu(
        message_id: impl Into<String>,
        action_id: impl Into<String>,
        hint: &FetchGpuHint,
    ) -> Result<Self, DescriptorError> {
        // A named-field encoding read back as a value gives a string-keyed map,
        // the shape Dynamo's `KvHintAction::payload` expects. (`rmpv::ext::to_value`
        // would write structs as arrays, which a Dynamo reader cannot take.)
        let named = rmp_serde::to_vec_named(hint).map_err(|e| DescriptorError::Encode {
            what: "fetch_gpu_hint",
            reason: e.to_string(),
        })?;
        let value = rmpv::decode::read_value(&mut named.as_slice()).map_err(|e| {
            DescriptorError::Encode {
                what: "fetch_gpu_hint",
                reason: e.to_string(),
            }
        })?;
        let rmpv::Value::Map(entries) = value else {
            return Err(DescriptorError::Encode {
                what: "fetch_gpu_hint",
                reason: "payload did not encode as a map".into(),
            });
        };
        let payload = entries
            .into_iter()
            .filter_map(|(k, v)| k.as_str().map(|k| (k.to_owned(), v)))
            .collect();
        Ok(Self {
            protocol_version: HINT_PROTOCOL_VERSION.into(),
            message_id: message_id.into(),
            actions: vec![HintAction {
                action_id: action_id.into(),
                action_type: FETCH_GPU_ACTION_TYPE.into(),
                action_version: FETCH_GPU_ACTION_VERSION.into(),
                payload,
            }],
        })
    }

    /// Decodes every action as `kv.fetch_gpu@1.0`.
    ///
    /// Only the shape is checked here; the caller runs
    /// [`FetchGpuHint::validate`] with the donor's rank block bytes (and
    /// checks slot ids against the donor's manifest) before acting on a hint.
    ///
    /// # Errors
    /// [`DescriptorError::UnsupportedAction`] for any other type or version
    /// (nothing is half-accepted), [`DescriptorError::InvalidField`] for an
    /// unknown protocol version, [`DescriptorError::Decode`] for a malformed payload.
    pub fn fetch_gpu_actions(&self) -> Result<Vec<FetchGpuHint>, DescriptorError> {
        if self.protocol_version != HINT_PROTOCOL_VERSION {
            return Err(DescriptorError::field(
                "hint.protocol_version",
                format!(
                    "{:?} is not {HINT_PROTOCOL_VERSION:?}",
                    self.protocol_version
                ),
            ));
        }
        self.actions
            .iter()
            .map(|a| {
                if a.action_type != FETCH_GPU_ACTION_TYPE
                    || a.action_version != FETCH_GPU_ACTION_VERSION
                {
                    return Err(DescriptorError::UnsupportedAction {
                        action_type: a.action_type.clone(),
                        action_version: a.action_version.clone(),
                        known: "kv.fetch_gpu@1.0",
                    });
                }
                let map = rmpv::Value::Map(
                    a.payload
                        .iter()
                        .map(|(k, v)| (rmpv::Value::from(k.as_str()), v.clone()))
                        .collect(),
                );
                // Re-encode and go through the crate's one bounded decoder, so the
                // payload is read exactly like a top-level wire value.
                let mut bytes = Vec::new();
                rmpv::encode::write_value(&mut bytes, &map).map_err(|e| {
                    DescriptorError::Decode {
                        what: "fetch_gpu_hint",
                        field: None,
                        reason: e.to_string(),
                    }
                })?;
                crate::wire::decode_bounded("fetch_gpu_hint", &bytes)
            })
            .collect()
    }
}
