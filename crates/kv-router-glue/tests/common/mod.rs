//! The donor fixture the pin and transfer-path tests share: a TP-2 host-shm
//! bank of a small block-major layout, rank-distinct block bytes, ready
//! stores and the hint a router would send for them.
//!
//! Each test binary uses a different subset, hence `dead_code` allowed.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use kv_bank::{
    sealed_blocks, BankConfig, BankError, BankManager, BankMemory, DestinationPool, StoreStatus,
};
use kv_descriptor::*;
use kv_router_glue::FetchExecutor;
use kv_transfer::{HostBuffer, HostCopyBackend};

/// TP size of the fixture bank.
pub const TP: u32 = 2;
/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 4;

/// One lock per test binary: leak snapshots, thread listings, host shm names
/// and pin counts are process-wide.
pub fn lock() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// 2 layers, 4 KV heads, head_dim 8, f32, 4 tokens a block, block-major, TP 2.
pub fn layout() -> KvLayout {
    KvLayout::new(
        2,
        4,
        8,
        DType::F32,
        BLOCK_TOKENS as u32,
        TensorOrder::BlockMajor,
        TP,
    )
    .unwrap()
}

/// Bytes of one rank's part of a block.
pub fn rbb() -> usize {
    layout().rank_block_bytes()
}

/// A host-shm donor bank of `slots` blocks, its segment names under `prefix`.
pub fn bank(slots: u64, prefix: &str) -> Arc<BankManager> {
    let cfg = BankConfig::new(
        layout(),
        OwnerLease::fresh(Role::Decode),
        slots * u64::from(TP) * rbb() as u64,
    );
    Arc::new(BankManager::new_host_shm(cfg, prefix).unwrap())
}

/// Byte `i` of rank `rank`'s part of the block with hash `h` (distinct per
/// rank, so a mapping read for the wrong rank shows).
pub fn pattern(h: SequenceHash, rank: u32, i: usize) -> u8 {
    (h.0 as usize).wrapping_add(rank as usize * 31 + i) as u8
}

/// Stores `blocks` ready blocks of chain `chain` (distinct tokens per chain,
/// bytes by [`pattern`]) and returns (hash, slot) of each, in chain order.
///
/// # Errors
/// The bank's refusal of the store (e.g. bank full).
pub fn store_chain(
    bank: &BankManager,
    chain: u32,
    blocks: usize,
) -> Result<Vec<(SequenceHash, u32)>, BankError> {
    let tokens: Vec<u32> = (0..(blocks * BLOCK_TOKENS) as u32)
        .map(|t| chain * 100_000 + t)
        .collect();
    let sealed = sealed_blocks(None, &tokens, BLOCK_TOKENS);
    let st = bank.store(None, &sealed)?;
    for rank in 0..TP {
        for (index, (h, _)) in st.entries.iter().enumerate() {
            let bytes: Vec<u8> = (0..rbb()).map(|i| pattern(*h, rank, i)).collect();
            bank.write_pending(st.store_id, rank, index, &bytes)?;
        }
    }
    let mut status = StoreStatus::Waiting { missing: vec![] };
    for rank in 0..TP {
        status = bank.ack(st.store_id, rank)?;
    }
    assert_eq!(status, StoreStatus::Ready);
    Ok(sealed
        .iter()
        .map(|b| (b.sequence_hash, bank.lookup(&b.sequence_hash).unwrap()))
        .collect())
}

/// [`store_chain`] of chain 0, which must succeed.
pub fn store(bank: &BankManager, blocks: usize) -> Vec<(SequenceHash, u32)> {
    store_chain(bank, 0, blocks).unwrap()
}

/// The hint a router would send for `entries` (the retained prefix, in
/// order) of `bank`: every rank reads the same slots.
pub fn hint(bank: &BankManager, entries: &[(SequenceHash, u32)], endpoint: &str) -> FetchGpuHint {
    let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
    FetchGpuHint {
        donor_engine_id: bank.owner().engine_id,
        bank_generation: bank.owner().generation,
        layout_fingerprint: layout().fingerprint(),
        tp_size: TP,
        sequence_hashes: entries.iter().map(|e| e.0).collect(),
        fetch_from: 0,
        parts: (0..TP)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: (slots.len() * rbb()) as u64,
            })
            .collect(),
        donor_control_endpoint: endpoint.to_string(),
    }
}

/// One zeroed host region of `rows` rank-block rows per TP rank.
pub fn regions(rows: u32) -> Vec<Arc<HostBuffer>> {
    (0..TP)
        .map(|_| Arc::new(HostBuffer::zeroed(rows as usize * rbb()).unwrap()))
        .collect()
}

/// `regions` as the executor takes them.
pub fn dyn_regions(r: &[Arc<HostBuffer>]) -> Vec<Arc<dyn BankMemory>> {
    r.iter().map(|b| b.clone() as Arc<dyn BankMemory>).collect()
}

/// A host-copy fetch executor over fresh [`regions`] of `rows` rows, and
/// those regions (to read what a fetch landed).
pub fn host_executor(rows: u32) -> (Vec<Arc<HostBuffer>>, FetchExecutor) {
    let regions = regions(rows);
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(rows),
        dyn_regions(&regions),
        rows,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    (regions, exec)
}

/// Reads one framed pin-protocol message from the donor (header, then
/// body) off `s`, a Unix or TCP stream; panics on a short read or a body
/// that does not decode (a test failure).
pub fn read_pin_reply(s: &mut impl std::io::Read) -> kv_descriptor::PinDonorMessage {
    use kv_descriptor::Wire;
    let mut header = [0u8; kv_descriptor::PIN_FRAME_HEADER_BYTES];
    s.read_exact(&mut header).unwrap();
    let mut body = vec![0u8; kv_descriptor::pin_frame_len(header).unwrap()];
    s.read_exact(&mut body).unwrap();
    kv_descriptor::PinDonorMessage::from_wire(&body).unwrap()
}
