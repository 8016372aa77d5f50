//! A TP1 bank in CUDA device memory: store, byte round trip, allocation
//! failure leaves nothing behind. Skips, saying why, without a CUDA driver.

use std::time::Duration;

use kv_bank::{sealed_blocks, BankConfig, BankError, BankManager, StoreStatus};
use kv_descriptor::{DType, KvLayout, OwnerLease, Role, TensorOrder};

fn gpu() -> bool {
    // SAFETY: only a dlopen probe.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("SKIP gpu bank test: no CUDA driver (libcuda) on this machine");
        return false;
    }
    match kv_bank::cuda_probe(0) {
        Ok(i) => {
            eprintln!(
                "device: {} {} fabric_supported={}",
                i.name, i.uuid, i.fabric_supported
            );
            true
        }
        Err(e) => {
            println!("SKIP gpu bank test: {e}");
            false
        }
    }
}

#[test]
fn device_bank_stores_and_reads_back() {
    if !gpu() {
        return;
    }
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        64 * layout.block_bytes() as u64,
    );
    let bank = BankManager::new_cuda(cfg, "gpu-host", &[0]).unwrap();
    assert!(bank.manifest().parts()[0].location().is_gpu());
    let blocks = sealed_blocks(None, &(0..16 * 8).collect::<Vec<u32>>(), 16);
    let p = bank.store(None, &blocks).unwrap();
    let rb = bank.rank(0).unwrap();
    for (i, (_, slot)) in p.entries.iter().enumerate() {
        rb.write_slot(*slot, &vec![i as u8 + 1; layout.rank_block_bytes()])
            .unwrap();
    }
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);
    let mut out = vec![0u8; layout.rank_block_bytes()];
    rb.read_slot(p.entries[5].1, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 6));
    drop(rb);
    bank.close(Duration::from_secs(1)).unwrap();
}

#[test]
fn impossible_device_allocation_is_an_error_and_registers_nothing() {
    if !gpu() {
        return;
    }
    // 4 TiB per rank cannot be allocated on any current GPU.
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 4 << 40);
    let e = BankManager::new_cuda(cfg, "gpu-host", &[0]).unwrap_err();
    assert!(
        matches!(
            e,
            BankError::Cuda {
                op: "cuMemAlloc",
                ..
            }
        ),
        "{e}"
    );
    let (free, _) = cudarc::driver::result::mem_get_info().unwrap();
    assert!(free > 0);
}

#[test]
fn fabric_allocation_round_trips_or_says_why_not() {
    if !gpu() {
        return;
    }
    match kv_bank::CudaDeviceMemory::new_fabric(0, 3 << 20) {
        Ok(m) => {
            use kv_bank::BankMemory;
            assert!(m.is_fabric());
            assert!(matches!(
                m.export_handle(),
                Some(kv_descriptor::ExportHandle::CudaFabric { .. })
            ));
            let data: Vec<u8> = (0..3 << 20).map(|i: usize| (i % 253) as u8).collect();
            m.write_bytes(0, &data).unwrap();
            let mut back = vec![0u8; data.len()];
            m.read_bytes(0, &mut back).unwrap();
            assert_eq!(back, data);
            eprintln!("fabric allocation: ok");
        }
        Err(e) => {
            // Without an IMEX channel the driver refuses fabric allocations.
            assert!(
                matches!(
                    e,
                    BankError::Cuda { .. } | BankError::CudaUnavailable { .. }
                ),
                "{e}"
            );
            eprintln!("skipped: fabric handles unavailable here: {e}");
        }
    }
}

#[test]
fn device_bank_publishes_a_lease_and_is_refused_once_closed() {
    if !gpu() {
        return;
    }
    let layout = KvLayout::new(4, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        16 * layout.block_bytes() as u64,
    );
    let bank = BankManager::new_cuda(cfg, "gpu-host", &[0]).unwrap();
    let d = bank.manifest().parts()[0].clone();
    let rec = kv_bank::check_descriptor_lease(&d, kv_bank::LeaseInstant::now()).unwrap();
    assert!(rec.name.starts_with("/kvbank-cuda-"), "{}", rec.name);
    assert_eq!(rec.engine_id, bank.owner().engine_id);
    let held = kv_bank::leaks::snapshot();
    assert!(held.device_allocations >= 1);
    assert!(held.device_bytes >= d.region_bytes(), "{held:?}");
    bank.close(Duration::from_secs(1)).unwrap();
    // Refused by the lease check before any cuIpcOpenMemHandle.
    let e = kv_bank::CudaIpcImport::open_descriptor(&d, 0).unwrap_err();
    assert!(matches!(e, BankError::LeaseMissing { .. }), "{e}");
    println!("device bank lease {} refused after close: {e}", rec.name);
}
