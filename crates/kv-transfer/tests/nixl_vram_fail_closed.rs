//! The NIXL GPU path fails closed: two agents of one process on GPU 0 read
//! device memory into device memory. Between two agents of one process UCX
//! has no device lane (`cuda_ipc` connects processes only) and was measured
//! emulating the read over `tcp/lo`; the delivery must then refuse
//! (`TransportUnverified` when UCX did not report the transport, `HostStaged`
//! when its protocol log shows the host-staged one), and never complete with
//! transport `unknown`. Run it with the default environment and with
//! `UCX_TLS=^cuda_ipc` (and, to see the logged case, `UCX_PROTO_INFO=y
//! UCX_LOG_FILE=/tmp/ucx-%p.log`): every variant must pass.
//!
//! One test per binary: UCX reads its environment process-wide. Skips with a
//! printed reason without the NIXL runtime or a CUDA device.

use std::sync::Arc;

use kv_bank::{BankMemory, CudaDeviceMemory};
use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
use kv_transfer::nixl::{runtime_status, NixlAgent, NixlBackend, NixlMode};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{
    deliver, DeliveryControl, NixlRemoteRegion, RankIo, SourceRegion, TransferError,
};

#[test]
fn one_process_vram_fetch_is_refused_unless_the_transport_is_device_direct() {
    if let Err(e) = runtime_status() {
        println!("SKIP nixl vram test: {e}");
        return;
    }
    if !kv_transfer::cuda::driver_present() || kv_transfer::cuda::device_count() == 0 {
        println!("SKIP nixl vram test: no CUDA device visible");
        return;
    }
    let layout = KvLayout::new(2, 4, 16, DType::Bf16, 8, TensorOrder::BlockMajor, 1).unwrap();
    let bb = layout.rank_block_bytes();
    let g = RegionGeometry::dense(&layout, 8);
    let src = CudaDeviceMemory::new(0, g.region_bytes() as usize).unwrap();
    let pattern: Vec<u8> = (0..g.region_bytes() as usize)
        .map(|i| (i % 251) as u8)
        .collect();
    src.write_bytes(0, &pattern).unwrap();
    let dst = CudaDeviceMemory::new(0, g.region_bytes() as usize).unwrap();
    dst.write_bytes(0, &vec![0x5A; g.region_bytes() as usize])
        .unwrap();
    let donor = NixlAgent::new("kvx-vram-donor").unwrap();
    let target = Arc::new(NixlAgent::new("kvx-vram-target").unwrap());
    donor.register(&src).unwrap();
    target.register(&dst).unwrap();
    let name = target.load_remote(&donor.metadata().unwrap()).unwrap();
    let remote = NixlRemoteRegion {
        agent_name: name,
        base_addr: src.base_addr(),
        len: src.len() as u64,
        kind: src.kind(),
    };
    let moves: Vec<BlockMove> = (0..4)
        .map(|i| BlockMove {
            key: SequenceHash(i + 1),
            src_slot: Some(i as u32 + 2),
            dst_block: i as u32,
        })
        .collect();
    let plan = TransferPlan::new(&layout, &layout, &moves, &[g], &[g]).unwrap();
    let io = [RankIo {
        src: SourceRegion::Nixl(&remote),
        dst: &dst,
    }];
    let backend = NixlBackend::new(target.clone(), NixlMode::Runs);
    match deliver(&plan, &backend, &io, &DeliveryControl::new()) {
        Ok(rep) => {
            // Only a verified device-direct transport may complete.
            println!("completed over {:?}", rep.counters.transport);
            assert_ne!(rep.counters.transport, "unknown", "{rep:?}");
            assert_eq!(rep.counters.host_payload_bytes, 0, "{rep:?}");
            let mut back = vec![0u8; 4 * bb];
            dst.read_bytes(0, &mut back).unwrap();
            assert_eq!(back, pattern[2 * bb..6 * bb]);
        }
        Err(e) => {
            println!("refused as expected: {e}");
            let inner = match &e {
                TransferError::PartFailed { source, .. } => source.as_ref(),
                other => other,
            };
            assert!(
                matches!(
                    inner,
                    TransferError::TransportUnverified { .. } | TransferError::HostStaged { .. }
                ),
                "refused for another reason: {e}"
            );
            assert!(!e.may_still_write(), "the read ended before the refusal");
        }
    }
}
