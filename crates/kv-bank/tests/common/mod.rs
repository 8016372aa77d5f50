//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use kv_bank::{BankConfig, BankManager, PendingStore, StoreStatus};
use kv_descriptor::{DType, KvLayout, OwnerLease, Role, SequenceHash, StoredBlock, TensorOrder};

/// Tiny geometry: 2 layers, 4 KV heads of 8, f32, 4 tokens per block, TP `tp`
/// (rank block = 2*2*4*(4/tp)*8*4 bytes).
pub fn layout(tp: u32) -> KvLayout {
    KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, tp).unwrap()
}

/// A host-shm manager with `slots` slots per rank.
pub fn bank(tp: u32, slots: u64) -> BankManager {
    let l = layout(tp);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        slots * l.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_secs(30);
    BankManager::new_host_shm(cfg, "test-host").unwrap()
}

/// Deterministic bytes of `hash`'s part on `rank`.
pub fn pattern(hash: SequenceHash, rank: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (hash.0 >> ((i % 8) * 8)) as u8
                ^ (rank as u8).wrapping_mul(131)
                ^ (i as u8).wrapping_mul(7)
        })
        .collect()
}

/// Writes rank `rank`'s pattern into every entry of `p` (`write_pending`),
/// then acks.
pub fn write_and_ack(bank: &BankManager, p: &PendingStore, rank: u32) -> StoreStatus {
    let n = bank.manifest().parts()[rank as usize].slot_bytes() as usize;
    for (i, (h, _)) in p.entries.iter().enumerate() {
        bank.write_pending(p.store_id, rank, i, &pattern(*h, rank, n))
            .unwrap();
    }
    bank.ack(p.store_id, rank).unwrap()
}

/// Stores `blocks` and acks on every rank.
pub fn store_ready(
    bank: &BankManager,
    parent: Option<SequenceHash>,
    blocks: &[StoredBlock],
) -> PendingStore {
    let p = bank.store(parent, blocks).unwrap();
    if !p.is_empty() {
        for r in 0..bank.manifest().tp_size() {
            write_and_ack(bank, &p, r);
        }
    }
    p
}

/// Sequence hashes of blocks.
pub fn hashes(b: &[StoredBlock]) -> Vec<SequenceHash> {
    b.iter().map(|b| b.sequence_hash).collect()
}

/// Sealed blocks of `n` blocks of tokens starting at `start`.
pub fn chain(start: u32, n: u32) -> Vec<StoredBlock> {
    kv_bank::sealed_blocks(None, &(start..start + 4 * n).collect::<Vec<u32>>(), 4)
}
