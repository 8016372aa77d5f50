//! Valid encodings of every wire type: the fuzzers' seed corpus and the
//! starting points of the mutation property tests. Fixed ids, so the seeds are
//! reproducible byte for byte.

use kv_descriptor::*;
use uuid::Uuid;

fn owner() -> OwnerLease {
    OwnerLease {
        engine_id: EngineId(Uuid::from_u128(0xE1E1)),
        role: Role::Decode,
        generation: 1,
    }
}

fn gpu_descriptor(layout: KvLayout, rank: u32, export: ExportHandle) -> BankDescriptor {
    let mut gpu = GpuIdentity::new(
        Uuid::from_u128(0x6000 + u128::from(rank) + 1),
        rank,
        "node-a",
    )
    .unwrap();
    if matches!(export, ExportHandle::CudaFabric { .. }) {
        gpu.fabric = Some(NvlinkFabric {
            cluster_uuid: Uuid::from_u128(0xFAB),
            clique_id: 1,
        });
    }
    BankDescriptor::new(BankParts {
        layout,
        tp_rank: rank,
        location: MemoryLocation::Gpu(gpu),
        owner: owner(),
        export,
        slot_count: 32,
        slot_bytes: layout.rank_block_bytes() as u64,
    })
    .unwrap()
}

fn host_descriptor(layout: KvLayout, rank: u32) -> BankDescriptor {
    BankDescriptor::new(BankParts {
        layout,
        tp_rank: rank,
        location: MemoryLocation::Host {
            host_id: "node-a".into(),
        },
        owner: owner(),
        export: ExportHandle::HostShm {
            name: format!("/kvbank-r{rank}"),
        },
        slot_count: 8,
        slot_bytes: layout.rank_block_bytes() as u64,
    })
    .unwrap()
}

fn layout(tp: u32) -> KvLayout {
    KvLayout::new(4, 8, 16, DType::Bf16, 16, TensorOrder::BlockMajor, tp).unwrap()
}

fn ipc(rank: u32) -> ExportHandle {
    ExportHandle::CudaIpc {
        handle: vec![rank as u8 + 1; CUDA_HANDLE_BYTES],
    }
}

/// Valid descriptor encodings (IPC, fabric, NIXL, host shm).
pub fn descriptors() -> Vec<Vec<u8>> {
    let l = layout(2);
    [
        gpu_descriptor(l, 0, ipc(0)),
        gpu_descriptor(
            l,
            1,
            ExportHandle::CudaFabric {
                handle: vec![7; CUDA_HANDLE_BYTES],
            },
        ),
        gpu_descriptor(
            l,
            1,
            ExportHandle::NixlAgent {
                agent_name: "decode-r1".into(),
                metadata: vec![1, 2, 3, 4],
            },
        ),
        host_descriptor(l, 1),
    ]
    .iter()
    .map(|d| d.to_wire().unwrap())
    .collect()
}

/// Valid manifest encodings (TP1, TP2 GPU, TP4 GPU, TP2 host).
pub fn manifests() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for tp in [1u32, 2, 4] {
        let parts = (0..tp)
            .map(|r| gpu_descriptor(layout(tp), r, ipc(r)))
            .collect();
        out.push(BankManifest::new(parts).unwrap().to_wire().unwrap());
    }
    let host = (0..2).map(|r| host_descriptor(layout(2), r)).collect();
    out.push(BankManifest::new(host).unwrap().to_wire().unwrap());
    out
}

/// A valid TP2 fetch hint.
pub fn fetch_hint() -> FetchGpuHint {
    FetchGpuHint {
        donor_engine_id: owner().engine_id,
        bank_generation: 1,
        layout_fingerprint: layout(2).fingerprint(),
        tp_size: 2,
        sequence_hashes: sequence_hashes(&(0..64).collect::<Vec<u32>>(), 16),
        fetch_from: 1,
        parts: (0..2)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: vec![5, 6, 9],
                expected_bytes: 3 * layout(2).rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: "kv.decode.e1e1.control".into(),
    }
}

/// Valid envelope and bare hint encodings.
pub fn hints() -> Vec<Vec<u8>> {
    let h = fetch_hint();
    vec![
        HintEnvelope::fetch_gpu("req-1", "a0", &h)
            .unwrap()
            .to_wire()
            .unwrap(),
        h.to_wire().unwrap(),
    ]
}

/// Valid event encodings (stored with and without parent, removed, cleared).
pub fn events() -> Vec<Vec<u8>> {
    let t: Vec<u32> = (0..48).collect();
    let seq = sequence_hashes(&t, 16);
    let tok = token_block_hashes(&t, 16);
    let blocks: Vec<StoredBlock> = seq
        .iter()
        .zip(&tok)
        .map(|(&sequence_hash, &token_hash)| StoredBlock {
            sequence_hash,
            token_hash,
            slot: None,
        })
        .collect();
    let datas = [
        (
            StorageTier::RetainedGpuDirect,
            KvEventData::Stored {
                parent: None,
                blocks: blocks.clone(),
            },
        ),
        (
            StorageTier::Device,
            KvEventData::Stored {
                parent: Some(seq[0]),
                blocks: blocks[1..].to_vec(),
            },
        ),
        (
            StorageTier::HostPinned,
            KvEventData::Removed {
                sequence_hashes: seq.clone(),
            },
        ),
        (StorageTier::RetainedGpuDirect, KvEventData::Cleared),
    ];
    datas
        .into_iter()
        .enumerate()
        .map(|(i, (tier, data))| {
            KvEvent {
                publisher: owner().engine_id,
                event_id: i as u64 + 1,
                role: Role::Decode,
                layout_fingerprint: layout(2).fingerprint(),
                tp_size: 2,
                tier,
                data,
            }
            .to_wire()
            .unwrap()
        })
        .collect()
}

/// Valid pin control messages, both directions.
pub fn pin_messages() -> (Vec<PinClientMessage>, Vec<PinDonorMessage>) {
    let client = vec![
        PinClientMessage::Pin(PinRequest::for_hint(1, &fetch_hint())),
        PinClientMessage::Release(PinRelease { pin_id: 1 }),
    ];
    let donor = vec![
        PinDonorMessage::Granted(PinGrant {
            request_id: 1,
            pin_id: 1,
            max_hold_ms: 30_000,
            block_checksums: vec![],
        }),
        PinDonorMessage::Refused(PinRefusal {
            request_id: 1,
            reason: PinRefusalReason::SlotReused,
            detail: "`parts[0].slot_ids[0]` = 5 does not hold block".into(),
        }),
        PinDonorMessage::Released(PinReleased {
            pin_id: 1,
            held_us: 1_250,
            expired: false,
        }),
    ];
    (client, donor)
}

/// Valid pin control streams: each client message and each donor message
/// as one frame, then a whole pin/grant/release/released exchange as one
/// stream of frames.
pub fn pin_streams() -> Vec<Vec<u8>> {
    let (client, donor) = pin_messages();
    let mut out: Vec<Vec<u8>> = client
        .iter()
        .map(|m| encode_pin_frame(m).unwrap())
        .chain(donor.iter().map(|m| encode_pin_frame(m).unwrap()))
        .collect();
    out.push(
        [
            encode_pin_frame(&client[0]).unwrap(),
            encode_pin_frame(&donor[0]).unwrap(),
            encode_pin_frame(&client[1]).unwrap(),
            encode_pin_frame(&donor[2]).unwrap(),
        ]
        .concat(),
    );
    out
}

/// Seeds per fuzz target name (`descriptor`, `manifest`, `hint`, `event`,
/// `pin_control`).
pub fn by_target() -> Vec<(&'static str, Vec<Vec<u8>>)> {
    vec![
        ("descriptor", descriptors()),
        ("manifest", manifests()),
        ("hint", hints()),
        ("event", events()),
        ("pin_control", pin_streams()),
    ]
}
