//! kv-bank built without its `cuda` feature (a router, a CPU-only worker):
//! a device bank is refused with the typed error a machine without a driver
//! gives, never a panic, and host banks work as before.
//!
//! Runs only in that build: `cargo test -p kv-bank --no-default-features
//! --test without_cuda` (the default build compiles it to nothing).
#![cfg(not(feature = "cuda"))]

mod common;

use kv_bank::{BankConfig, BankError, BankManager};
use kv_descriptor::{
    BankDescriptor, BankParts, ExportHandle, GpuIdentity, MemoryLocation, OwnerLease, Role,
    CUDA_HANDLE_BYTES,
};

#[test]
fn device_bank_is_refused_as_cuda_unavailable() {
    let l = common::layout(2);
    let cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        8 * l.block_bytes() as u64,
    );
    match BankManager::new_cuda(cfg, "no-cuda-host", &[0, 1]) {
        Err(BankError::CudaUnavailable { reason }) => {
            assert!(reason.contains("`cuda` feature"), "reason: {reason}")
        }
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
        Ok(_) => panic!("a device bank was created without the `cuda` feature"),
    }
}

#[test]
fn wrong_rank_count_is_still_refused_first() {
    // The argument check does not depend on the feature: a caller learns of
    // a bad `ordinals` list in every build.
    let l = common::layout(2);
    let cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        8 * l.block_bytes() as u64,
    );
    match BankManager::new_cuda(cfg, "no-cuda-host", &[0]) {
        Err(BankError::InvalidArgument { field, .. }) => assert_eq!(field, "ordinals"),
        Err(e) => panic!("expected InvalidArgument(ordinals), got {e}"),
        Ok(_) => panic!("one ordinal for two ranks was accepted"),
    }
}

#[test]
fn host_bank_and_leak_snapshot_work_without_cuda() {
    let before = kv_bank::leaks::snapshot();
    let bank = common::bank(2, 4);
    assert_eq!(bank.manifest().parts().len(), 2);
    let during = kv_bank::leaks::snapshot();
    assert_eq!(during.ipc_mappings, 0);
    assert_eq!(during.device_allocations, 0);
    assert!(during.shm_mappings > before.shm_mappings);
    drop(bank);
}

#[test]
fn device_bank_import_is_refused_as_cuda_unavailable() {
    // A donor's device bank part, as a CPU-only worker would receive it.
    let layout = common::layout(1);
    let gpu = GpuIdentity::new(uuid_of(5), 0, "donor-host").unwrap();
    let d = BankDescriptor::new(BankParts {
        layout,
        tp_rank: 0,
        location: MemoryLocation::Gpu(gpu),
        owner: OwnerLease::fresh(Role::Decode),
        export: ExportHandle::CudaIpc {
            handle: vec![7; CUDA_HANDLE_BYTES],
        },
        slot_count: 4,
        slot_bytes: layout.rank_block_bytes() as u64,
    })
    .unwrap();
    match kv_bank::open_device_descriptor(&d, 0) {
        Err(BankError::CudaUnavailable { reason }) => {
            assert!(reason.contains("`cuda` feature"), "reason: {reason}")
        }
        Err(e) => panic!("expected CudaUnavailable, got {e}"),
        Ok(_) => panic!("a device bank was imported without the `cuda` feature"),
    }
}

fn uuid_of(n: u128) -> uuid::Uuid {
    uuid::Uuid::from_u128(n)
}
