//! What the index tests share: chains of true sequence hashes, workers,
//! events and a budget no test reaches.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use kv_descriptor::{
    sequence_hashes, token_block_hashes, EngineId, KvEvent, KvEventData, LayoutFingerprint, Role,
    SequenceHash, StorageTier, StoredBlock, TokenBlockHash,
};
use kv_lookup::{InventoryIndex, LookupBudget, Registration, WorkerInfo, WorkerKey};

pub(crate) const FP: LayoutFingerprint = LayoutFingerprint(0xABCD);
pub(crate) const RET: StorageTier = StorageTier::RetainedGpuDirect;
pub(crate) const DEV: StorageTier = StorageTier::Device;

/// Token hash of every sequence hash [`chain`] made, so that [`stored`]
/// sends true chains.
pub(crate) fn token_hashes() -> &'static Mutex<HashMap<SequenceHash, TokenBlockHash>> {
    static MAP: OnceLock<Mutex<HashMap<SequenceHash, TokenBlockHash>>> = OnceLock::new();
    MAP.get_or_init(Default::default)
}

pub(crate) fn chain(seed: u32, blocks: usize) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..blocks as u32 * 16)
        .map(|t| t.wrapping_mul(2654435761).wrapping_add(seed))
        .collect();
    let hashes = sequence_hashes(&tokens, 16);
    let mut map = token_hashes().lock().unwrap();
    for (h, t) in hashes.iter().zip(token_block_hashes(&tokens, 16)) {
        map.insert(*h, t);
    }
    hashes
}

pub(crate) fn info(role: Role) -> WorkerInfo {
    WorkerInfo {
        engine: EngineId::fresh(),
        role,
        layout_fingerprint: FP,
        tp_size: 1,
    }
}

pub(crate) fn event(w: &WorkerInfo, id: u64, tier: StorageTier, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher: w.engine,
        event_id: id,
        role: w.role,
        layout_fingerprint: w.layout_fingerprint,
        tp_size: w.tp_size,
        tier,
        data,
    }
}

/// Stored event of `hashes` (made by [`chain`]), `parent: None`.
pub(crate) fn stored(hashes: &[SequenceHash]) -> KvEventData {
    stored_after(None, hashes)
}

pub(crate) fn stored_after(parent: Option<SequenceHash>, hashes: &[SequenceHash]) -> KvEventData {
    let map = token_hashes().lock().unwrap();
    KvEventData::Stored {
        parent,
        blocks: hashes
            .iter()
            .map(|&h| StoredBlock {
                sequence_hash: h,
                token_hash: map.get(&h).copied().unwrap_or(TokenBlockHash(h.0 ^ 1)),
                slot: None,
            })
            .collect(),
    }
}

pub(crate) fn removed(hashes: &[SequenceHash]) -> KvEventData {
    KvEventData::Removed {
        sequence_hashes: hashes.to_vec(),
    }
}

pub(crate) fn registered(index: &InventoryIndex, key: u64, role: Role) -> WorkerInfo {
    let w = info(role);
    assert_eq!(
        index.register_worker(WorkerKey(key), w).unwrap(),
        Registration::Registered
    );
    w
}

pub(crate) const BIG: LookupBudget = LookupBudget::new(1_000_000, u32::MAX);
