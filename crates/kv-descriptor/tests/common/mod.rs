//! Fixed, deterministic builders shared by the integration tests.
//!
//! Every id is a fixed UUID so that encodings (and snapshots) are reproducible.
#![allow(dead_code)]

use kv_descriptor::*;
use uuid::Uuid;

/// Small model geometry: 4 layers, 8 KV heads of 16, bf16, 16-token blocks.
pub fn layout(tp: u32) -> KvLayout {
    KvLayout::new(4, 8, 16, DType::Bf16, 16, TensorOrder::BlockMajor, tp).unwrap()
}

/// Fixed decode lease, generation 1.
pub fn owner() -> OwnerLease {
    OwnerLease {
        engine_id: EngineId(Uuid::from_u128(0xE1E1)),
        role: Role::Decode,
        generation: 1,
    }
}

/// GPU `rank` of host `node-a`, with a distinct UUID per rank.
pub fn gpu(rank: u32) -> GpuIdentity {
    GpuIdentity::new(
        Uuid::from_u128(0x6000 + u128::from(rank) + 1),
        rank,
        "node-a",
    )
    .unwrap()
}

/// A 64-byte CUDA IPC handle distinct per rank.
pub fn ipc_handle(rank: u32) -> Vec<u8> {
    (0..CUDA_HANDLE_BYTES as u32)
        .map(|i| (i * 3 + rank * 7) as u8)
        .collect()
}

/// Valid parts of rank `rank`'s GPU bank with 32 slots, CUDA IPC export.
pub fn gpu_parts(layout: KvLayout, rank: u32) -> BankParts {
    BankParts {
        layout,
        tp_rank: rank,
        location: MemoryLocation::Gpu(gpu(rank)),
        owner: owner(),
        export: ExportHandle::CudaIpc {
            handle: ipc_handle(rank),
        },
        slot_count: 32,
        slot_bytes: layout.rank_block_bytes() as u64,
    }
}

/// Valid parts of rank `rank`'s host bank with 32 slots, shm export.
pub fn host_parts(layout: KvLayout, rank: u32) -> BankParts {
    BankParts {
        layout,
        tp_rank: rank,
        location: MemoryLocation::Host {
            host_id: "node-a".into(),
        },
        owner: owner(),
        export: ExportHandle::HostShm {
            name: format!("/kvbank-e1e1-g1-r{rank}"),
        },
        slot_count: 32,
        slot_bytes: layout.rank_block_bytes() as u64,
    }
}

/// One valid GPU descriptor per rank of a TP-`tp` group, distinct GPUs.
pub fn gpu_group(tp: u32) -> Vec<BankDescriptor> {
    let l = layout(tp);
    (0..tp)
        .map(|r| BankDescriptor::new(gpu_parts(l, r)).unwrap())
        .collect()
}

/// The field an `InvalidField` error names; panics on any other variant.
pub fn field_of(e: &DescriptorError) -> &'static str {
    match e {
        DescriptorError::InvalidField { field, .. } => field,
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

/// Asserts `r` failed with `InvalidField` naming exactly `field`, and that the
/// message shows the field too.
#[track_caller]
pub fn assert_field<T: std::fmt::Debug>(
    r: Result<T, DescriptorError>,
    field: &str,
) -> DescriptorError {
    let e = r.expect_err("expected a rejection");
    assert_eq!(field_of(&e), field, "wrong field in {e}");
    assert!(
        e.to_string().contains(&format!("`{field}`")),
        "message lacks field: {e}"
    );
    e
}

/// Asserts a decode failed and its message names `needle` (a field path).
#[track_caller]
pub fn assert_decode_names<T: std::fmt::Debug>(
    r: Result<T, DescriptorError>,
    needle: &str,
) -> DescriptorError {
    let e = r.expect_err("expected a decode rejection");
    assert!(
        matches!(e, DescriptorError::Decode { .. }),
        "expected Decode, got {e:?}"
    );
    assert!(
        e.to_string().contains(needle),
        "message lacks {needle:?}: {e}"
    );
    e
}

/// Decodes MessagePack into a generic value (for surgical edits of encodings).
pub fn to_value(bytes: &[u8]) -> rmpv::Value {
    rmpv::decode::read_value(&mut &bytes[..]).unwrap()
}

/// Encodes a generic value back to MessagePack.
pub fn from_value(v: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// Mutable access to map entry `key` of a value that must be a map.
pub fn entry<'a>(v: &'a mut rmpv::Value, key: &str) -> &'a mut rmpv::Value {
    let rmpv::Value::Map(entries) = v else {
        panic!("not a map: {v}")
    };
    entries
        .iter_mut()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no key {key}"))
}
