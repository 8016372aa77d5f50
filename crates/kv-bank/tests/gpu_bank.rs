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
    for i in 0..p.entries.len() {
        bank.write_pending(
            p.store_id,
            0,
            i,
            &vec![i as u8 + 1; layout.rank_block_bytes()],
        )
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

/// A source allocation on `ordinal` filled with row `i` = bytes `i + 1`.
fn device_rows(ordinal: u32, rows: usize, row_bytes: usize) -> kv_bank::CudaDeviceMemory {
    use kv_bank::BankMemory;
    let src = kv_bank::CudaDeviceMemory::new(ordinal, rows * row_bytes).unwrap();
    for i in 0..rows {
        src.write_bytes(i * row_bytes, &vec![i as u8 + 1; row_bytes])
            .unwrap();
    }
    src
}

/// Stores 8 blocks from device rows on `src_ordinal` into a bank on GPU 0
/// and reads every slot back.
fn device_source_round_trip(src_ordinal: u32) {
    use kv_bank::{BankMemory, DeviceRows};
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let rbb = layout.rank_block_bytes();
    let cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        16 * layout.block_bytes() as u64,
    );
    let bank = BankManager::new_cuda(cfg, "gpu-host", &[0]).unwrap();
    let src = device_rows(src_ordinal, 8, rbb);
    let blocks = sealed_blocks(None, &(0..16 * 8).collect::<Vec<u32>>(), 16);
    let p = bank.store(None, &blocks).unwrap();
    let rows = DeviceRows {
        ordinal: src_ordinal,
        addr: src.base_addr(),
        row_bytes: rbb,
        rows: 8,
    };
    bank.write_pending_from_device(p.store_id, 0, 0, rows)
        .unwrap();
    assert_eq!(bank.ack(p.store_id, 0).unwrap(), StoreStatus::Ready);
    let rb = bank.rank(0).unwrap();
    let mut out = vec![0u8; rbb];
    for (i, (_, slot)) in p.entries.iter().enumerate() {
        rb.read_slot(*slot, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == i as u8 + 1), "block {i}");
    }
    let stats = bank.stats();
    assert_eq!(stats.store_bytes_from_device, 8 * rbb as u64);
    assert_eq!(stats.store_bytes_from_host, 0);
    drop(rb);
    bank.close(Duration::from_secs(1)).unwrap();
}

#[test]
fn device_rows_store_device_to_device_with_no_host_payload() {
    if !gpu() {
        return;
    }
    device_source_round_trip(0);
}

#[test]
fn device_rows_on_a_peer_gpu_store_by_peer_copy() {
    if !gpu() {
        return;
    }
    let count = kv_bank::cuda_probe(0).unwrap().device_count;
    if count < 2 {
        println!("SKIP peer device-source store: {count} CUDA device(s), needs 2");
        return;
    }
    device_source_round_trip(1);
}

#[test]
fn a_host_pointer_or_a_range_past_its_allocation_is_refused_as_source() {
    use kv_bank::{BankMemory, DeviceRows};
    if !gpu() {
        return;
    }
    let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    let rbb = layout.rank_block_bytes();
    let cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        8 * layout.block_bytes() as u64,
    );
    let bank = BankManager::new_cuda(cfg, "gpu-host", &[0]).unwrap();
    let blocks = sealed_blocks(None, &(0..8).collect::<Vec<u32>>(), 4);
    let p = bank.store(None, &blocks).unwrap();
    let host = vec![0u8; 2 * rbb];
    let src = device_rows(0, 1, rbb);
    for (addr, what) in [
        // "not memory CUDA knows", or with HMM "not device memory".
        (host.as_ptr() as u64, "memory"),
        (src.base_addr(), "runs past its allocation"),
    ] {
        let rows = DeviceRows {
            ordinal: 0,
            addr,
            row_bytes: rbb,
            rows: 2,
        };
        match bank.write_pending_from_device(p.store_id, 0, 0, rows) {
            Err(BankError::InvalidArgument {
                field: "source",
                reason,
            }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(bank.stats().store_bytes_from_device, 0);
    bank.close(Duration::from_secs(1)).unwrap();
}
