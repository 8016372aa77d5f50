//! BankManifest: TP-N groups, every rejection, the 64 KiB bound.

mod common;

use common::*;
use kv_descriptor::*;
use proptest::prelude::*;
use uuid::Uuid;

/// Lets a test put arbitrary (individually valid) descriptors on the wire.
#[derive(serde::Serialize)]
struct UncheckedManifest<'a> {
    parts: &'a [BankDescriptor],
}

fn encode_unchecked(parts: &[BankDescriptor]) -> Vec<u8> {
    rmp_serde::to_vec_named(&UncheckedManifest { parts }).unwrap()
}

/// Asserts both the constructor and the decoder refuse `parts`, naming `field`.
#[track_caller]
fn assert_refused(parts: Vec<BankDescriptor>, field: &str) -> DescriptorError {
    let bytes = encode_unchecked(&parts);
    assert_decode_names(BankManifest::from_wire(&bytes), &format!("`{field}`"));
    assert_field(BankManifest::new(parts), field)
}

fn with(l: KvLayout, rank: u32, edit: impl FnOnce(&mut BankParts)) -> BankDescriptor {
    let mut p = gpu_parts(l, rank);
    edit(&mut p);
    BankDescriptor::new(p).unwrap()
}

#[test]
fn tp_1_2_4_8_with_distinct_gpus() {
    for tp in [1u32, 2, 4, 8] {
        let m = BankManifest::new(gpu_group(tp)).unwrap();
        assert_eq!(m.tp_size(), tp);
        assert_eq!(m.slot_count(), 32);
        assert_eq!(m.owner(), &owner());
        assert_eq!(m.layout(), &layout(tp));
        let ranks: Vec<u32> = m.parts().iter().map(|p| p.tp_rank()).collect();
        assert_eq!(ranks, (0..tp).collect::<Vec<_>>());
        let bytes = m.to_wire().unwrap();
        assert!(bytes.len() <= MAX_MANIFEST_BYTES);
        assert_eq!(BankManifest::from_wire(&bytes).unwrap(), m);
    }
}

#[test]
fn host_tp2_manifest() {
    let l = layout(2);
    let parts = (0..2)
        .map(|r| BankDescriptor::new(host_parts(l, r)).unwrap())
        .collect();
    let m = BankManifest::new(parts).unwrap();
    assert!(!m.parts()[0].location().is_gpu());
    assert_eq!(BankManifest::from_wire(&m.to_wire().unwrap()).unwrap(), m);
}

#[test]
fn missing_and_extra_ranks() {
    let e = assert_refused(vec![], "manifest.parts");
    assert!(e.to_string().contains("got none"), "{e}");
    let mut g = gpu_group(4);
    g.pop();
    let e = assert_refused(g, "manifest.parts");
    assert!(e.to_string().contains("tp_size is 4 but 3 parts"), "{e}");
    let mut g = gpu_group(4);
    g.remove(1);
    assert_refused(g, "manifest.parts");
    let mut g = gpu_group(2);
    g.push(g[1].clone());
    assert_refused(g, "manifest.parts");
}

#[test]
fn duplicated_ranks() {
    let g = gpu_group(2);
    // Rank 0 twice (distinct GPUs so only the rank check can fire).
    let l = layout(2);
    let dup = with(l, 0, |p| {
        p.location = MemoryLocation::Gpu(gpu(5));
        p.export = ExportHandle::CudaIpc {
            handle: ipc_handle(5),
        };
    });
    let e = assert_refused(vec![g[0].clone(), dup], "manifest.parts.tp_rank");
    assert!(e.to_string().contains("rank 0 appears twice"), "{e}");
}

#[test]
fn permuted_ranks() {
    let g = gpu_group(2);
    let e = assert_refused(vec![g[1].clone(), g[0].clone()], "manifest.parts.tp_rank");
    assert!(e.to_string().contains("rank order"), "{e}");
    let g = gpu_group(4);
    assert_refused(
        vec![g[0].clone(), g[2].clone(), g[1].clone(), g[3].clone()],
        "manifest.parts.tp_rank",
    );
}

#[test]
fn two_ranks_on_one_gpu() {
    let l = layout(2);
    let g = gpu_group(2);
    let same = with(l, 1, |p| p.location = MemoryLocation::Gpu(gpu(0)));
    let e = assert_refused(vec![g[0].clone(), same], "manifest.parts.location.uuid");
    assert!(e.to_string().contains(&gpu(0).uuid.to_string()), "{e}");
    // Same UUID reported with another ordinal is still the same GPU.
    let renumbered = with(l, 1, |p| {
        p.location = MemoryLocation::Gpu(GpuIdentity {
            ordinal: 7,
            ..gpu(0)
        })
    });
    assert_refused(
        vec![g[0].clone(), renumbered],
        "manifest.parts.location.uuid",
    );
}

#[test]
fn two_ranks_one_export_handle() {
    let l = layout(2);
    let g = gpu_group(2);
    let shared = with(l, 1, |p| {
        p.export = ExportHandle::CudaIpc {
            handle: ipc_handle(0),
        }
    });
    assert_refused(vec![g[0].clone(), shared], "manifest.parts.export");
    let h0 = BankDescriptor::new(host_parts(l, 0)).unwrap();
    let mut p1 = host_parts(l, 1);
    p1.export = h0.export().clone();
    assert_refused(
        vec![h0, BankDescriptor::new(p1).unwrap()],
        "manifest.parts.export",
    );
}

#[test]
fn mixed_domains() {
    let l = layout(2);
    let g = gpu_group(2);
    let host1 = BankDescriptor::new(host_parts(l, 1)).unwrap();
    let e = assert_refused(vec![g[0].clone(), host1], "manifest.parts.location");
    assert!(e.to_string().contains("mixed domains"), "{e}");

    let fabric = |clique| NvlinkFabric {
        cluster_uuid: Uuid::from_u128(0xFAB),
        clique_id: clique,
    };
    let in_fabric = |rank, clique| {
        with(l, rank, |p| {
            p.location = MemoryLocation::Gpu(GpuIdentity {
                fabric: Some(fabric(clique)),
                ..gpu(rank)
            })
        })
    };
    assert!(BankManifest::new(vec![in_fabric(0, 1), in_fabric(1, 1)]).is_ok());
    assert_refused(
        vec![in_fabric(0, 1), in_fabric(1, 2)],
        "manifest.parts.location.fabric",
    );
    assert_refused(
        vec![in_fabric(0, 1), g[1].clone()],
        "manifest.parts.location.fabric",
    );
}

#[test]
fn mixed_export_kinds() {
    let l = layout(2);
    let g = gpu_group(2);
    let nixl = with(l, 1, |p| {
        p.export = ExportHandle::NixlAgent {
            agent_name: "d1".into(),
            metadata: vec![],
        }
    });
    assert_refused(vec![g[0].clone(), nixl], "manifest.parts.export");
}

#[test]
fn layouts_that_differ_beyond_rank() {
    let g = gpu_group(2);
    let fp16 = KvLayout::new(4, 8, 16, DType::Fp16, 16, TensorOrder::BlockMajor, 2).unwrap();
    assert_refused(
        vec![g[0].clone(), with(fp16, 1, |_| {})],
        "manifest.parts.layout",
    );
    let per_layer = KvLayout::new(4, 8, 16, DType::Bf16, 16, TensorOrder::VllmPerLayer, 2).unwrap();
    assert_refused(
        vec![g[0].clone(), with(per_layer, 1, |_| {})],
        "manifest.parts.layout",
    );
    // A part of a TP4 group with rank 3 in a TP2 manifest: must be refused as a
    // layout mismatch, not index past the rank table.
    let tp4_rank3 = gpu_group(4).pop().unwrap();
    assert_refused(vec![g[0].clone(), tp4_rank3], "manifest.parts.layout");
}

#[test]
fn owners_and_slot_counts_must_agree() {
    let l = layout(2);
    let g = gpu_group(2);
    assert_refused(
        vec![g[0].clone(), with(l, 1, |p| p.owner.generation = 2)],
        "manifest.parts.owner",
    );
    assert_refused(
        vec![
            g[0].clone(),
            with(l, 1, |p| {
                p.owner.engine_id = EngineId(Uuid::from_u128(0xE2))
            }),
        ],
        "manifest.parts.owner",
    );
    assert_refused(
        vec![g[0].clone(), with(l, 1, |p| p.owner.role = Role::Prefill)],
        "manifest.parts.owner",
    );
    let e = assert_refused(
        vec![g[0].clone(), with(l, 1, |p| p.slot_count = 31)],
        "manifest.parts.slot_count",
    );
    assert!(e.to_string().contains("31 slots, rank 0 has 32"), "{e}");
}

fn nixl_tp8(metadata_bytes: usize) -> Vec<BankDescriptor> {
    let l = layout(8);
    (0..8)
        .map(|r| {
            with(l, r, |p| {
                p.export = ExportHandle::NixlAgent {
                    agent_name: format!("decode-r{r}"),
                    metadata: vec![0xA5; metadata_bytes],
                }
            })
        })
        .collect()
}

#[test]
fn manifest_above_64_kib_is_refused_with_its_size() {
    let parts = nixl_tp8(9_000);
    // Expected size, derived from the MessagePack layout: fixmap(1) + "parts"
    // fixstr(6) + array header(1, 8 < 16 items) + each descriptor's encoding.
    let expect: usize = 8 + parts
        .iter()
        .map(|d| d.to_wire().unwrap().len())
        .sum::<usize>();
    assert!(expect > MAX_MANIFEST_BYTES, "fixture too small: {expect}");
    let bytes = encode_unchecked(&parts);
    assert_eq!(bytes.len(), expect);

    let e = BankManifest::new(parts).unwrap_err();
    assert_eq!(
        e,
        DescriptorError::TooLarge {
            what: "bank_manifest",
            size: expect,
            limit: MAX_MANIFEST_BYTES
        }
    );
    assert!(e.to_string().contains(&format!("{expect} bytes")), "{e}");
    assert!(e.to_string().contains("65536"), "{e}");

    // The decoder refuses the bytes before decoding them, with the same size.
    let e = BankManifest::from_wire(&bytes).unwrap_err();
    assert!(
        matches!(e, DescriptorError::TooLarge { size, .. } if size == expect),
        "{e:?}"
    );
}

#[test]
fn manifest_just_under_64_kib_is_accepted() {
    // 8 x 7,800 bytes of metadata stays under the bound.
    let m = BankManifest::new(nixl_tp8(7_800)).unwrap();
    let n = m.to_wire().unwrap().len();
    assert!(n > 62_400 && n <= MAX_MANIFEST_BYTES, "{n}");
    assert_eq!(BankManifest::from_wire(&m.to_wire().unwrap()).unwrap(), m);
}

#[test]
fn largest_nixl_metadata_fits_a_tp1_manifest() {
    // Byte fields travel as msgpack bin: 48 KiB of metadata costs 48 KiB on the
    // wire (as an integer array it would cost up to 96 KiB and never fit).
    let l = layout(1);
    let d = with(l, 0, |p| {
        p.export = ExportHandle::NixlAgent {
            agent_name: "decode-r0".into(),
            metadata: vec![0xFF; MAX_NIXL_METADATA_BYTES],
        }
    });
    let n = d.to_wire().unwrap().len();
    assert!(n < MAX_NIXL_METADATA_BYTES + 1024, "{n}");
    let m = BankManifest::new(vec![d]).unwrap();
    assert_eq!(BankManifest::from_wire(&m.to_wire().unwrap()).unwrap(), m);
}

#[test]
fn tampered_part_inside_a_manifest_is_refused() {
    let m = BankManifest::new(gpu_group(2)).unwrap();
    let mut v = to_value(&m.to_wire().unwrap());
    let rmpv::Value::Array(parts) = entry(&mut v, "parts") else {
        panic!("parts is not an array")
    };
    *entry(entry(&mut parts[1], "parts"), "slot_count") = rmpv::Value::from(64u32);
    assert_decode_names(
        BankManifest::from_wire(&from_value(&v)),
        "checksum mismatch",
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A group is accepted exactly when its parts are in rank order.
    #[test]
    fn accepted_iff_identity_permutation(tp_log in 0u32..4, seed in any::<u64>()) {
        let tp = 1u32 << tp_log;
        let mut order: Vec<u32> = (0..tp).collect();
        // Fisher-Yates with a tiny LCG so the case is reproducible from `seed`.
        let mut s = seed;
        for i in (1..order.len()).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let group = gpu_group(tp);
        let parts: Vec<BankDescriptor> = order.iter().map(|&r| group[r as usize].clone()).collect();
        let identity = order.iter().enumerate().all(|(i, &r)| i as u32 == r);
        let built = BankManifest::new(parts.clone());
        prop_assert_eq!(built.is_ok(), identity);
        if let Err(e) = built {
            prop_assert_eq!(common::field_of(&e), "manifest.parts.tp_rank");
        }
        prop_assert_eq!(BankManifest::from_wire(&encode_unchecked(&parts)).is_ok(), identity);
    }

    /// Dropping any non-empty set of ranks is refused as missing ranks.
    #[test]
    fn any_missing_rank_is_refused(tp_log in 1u32..4, mask in any::<u8>()) {
        let tp = 1u32 << tp_log;
        let keep: Vec<BankDescriptor> = gpu_group(tp)
            .into_iter()
            .filter(|d| mask & (1 << d.tp_rank()) != 0)
            .collect();
        prop_assume!(keep.len() < tp as usize);
        let e = BankManifest::new(keep).unwrap_err();
        prop_assert_eq!(common::field_of(&e), "manifest.parts");
    }
}
