//! KV events: round trips, and the new tier fails old readers instead of being misfiled.

use dynamo_kv_router::protocols::StorageTier as DynamoTier;
use kv_descriptor::*;
use uuid::Uuid;

const TIERS: [StorageTier; 5] = [
    StorageTier::Device,
    StorageTier::HostPinned,
    StorageTier::Disk,
    StorageTier::External,
    StorageTier::RetainedGpuDirect,
];

fn event(tier: StorageTier, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher: EngineId(Uuid::from_u128(0xDEC0)),
        event_id: 17,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0xF1F1),
        tp_size: 2,
        tier,
        data,
    }
}

fn datas() -> Vec<KvEventData> {
    let t: Vec<u32> = (0..48).collect();
    let seq = sequence_hashes(&t, 16);
    let tok = token_block_hashes(&t, 16);
    vec![
        KvEventData::Stored {
            parent: None,
            blocks: seq
                .iter()
                .zip(&tok)
                .map(|(&sequence_hash, &token_hash)| StoredBlock {
                    sequence_hash,
                    token_hash,
                    slot: None,
                })
                .collect(),
        },
        KvEventData::Stored {
            parent: Some(seq[0]),
            blocks: vec![StoredBlock {
                sequence_hash: seq[1],
                token_hash: tok[1],
                slot: None,
            }],
        },
        KvEventData::Removed {
            sequence_hashes: seq,
        },
        KvEventData::Cleared,
    ]
}

#[test]
fn every_tier_and_kind_round_trips() {
    for tier in TIERS {
        for data in datas() {
            let e = event(tier, data);
            assert_eq!(KvEvent::from_wire(&e.to_wire().unwrap()).unwrap(), e);
        }
    }
}

#[test]
fn tier_wire_names() {
    let names: Vec<String> = TIERS
        .iter()
        .map(|t| rmp_serde::from_slice::<String>(&rmp_serde::to_vec_named(t).unwrap()).unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "device",
            "host_pinned",
            "disk",
            "external",
            "retained_gpu_direct"
        ]
    );
}

#[test]
fn dynamo_reads_the_tiers_it_knows_identically() {
    let known = [
        (StorageTier::Device, DynamoTier::Device),
        (StorageTier::HostPinned, DynamoTier::HostPinned),
        (StorageTier::Disk, DynamoTier::Disk),
        (StorageTier::External, DynamoTier::External),
    ];
    for (ours, theirs) in known {
        let decoded: DynamoTier =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&ours).unwrap()).unwrap();
        assert_eq!(decoded, theirs);
        // And back: their encoding is ours.
        let back: StorageTier =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&theirs).unwrap()).unwrap();
        assert_eq!(back, ours);
    }
}

/// An event as decoded by a reader whose tier enum predates `RetainedGpuDirect`.
#[derive(Debug, serde::Deserialize)]
#[allow(dead_code)]
struct OldReaderEvent {
    publisher: EngineId,
    event_id: u64,
    role: Role,
    layout_fingerprint: LayoutFingerprint,
    tp_size: u32,
    tier: DynamoTier,
    data: KvEventData,
}

#[test]
fn old_reader_fails_on_the_new_tier_instead_of_misfiling() {
    let old_tier = event(StorageTier::Device, KvEventData::Cleared)
        .to_wire()
        .unwrap();
    let decoded: OldReaderEvent = rmp_serde::from_slice(&old_tier).unwrap();
    assert_eq!(decoded.tier, DynamoTier::Device);

    for data in datas() {
        let bytes = event(StorageTier::RetainedGpuDirect, data)
            .to_wire()
            .unwrap();
        let err = rmp_serde::from_slice::<OldReaderEvent>(&bytes)
            .unwrap_err()
            .to_string();
        assert!(err.contains("retained_gpu_direct"), "{err}");
        let err = rmp_serde::from_slice::<DynamoTier>(
            &rmp_serde::to_vec_named(&StorageTier::RetainedGpuDirect).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown variant"), "{err}");
    }
}

#[test]
fn our_reader_refuses_tiers_it_does_not_know() {
    let mut v = rmpv::decode::read_value(
        &mut &event(StorageTier::Device, KvEventData::Cleared)
            .to_wire()
            .unwrap()[..],
    )
    .unwrap();
    let rmpv::Value::Map(entries) = &mut v else {
        panic!()
    };
    for (k, val) in entries.iter_mut() {
        if k.as_str() == Some("tier") {
            *val = rmpv::Value::from("retained_cpu_direct");
        }
    }
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    let e = KvEvent::from_wire(&bytes).unwrap_err();
    assert!(
        matches!(
            e,
            DescriptorError::Decode {
                what: "kv_event",
                field: Some(ref f),
                ..
            } if f == "tier"
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("unknown variant `retained_cpu_direct`"),
        "{e}"
    );
}

/// The shape of `StoredBlock` before it carried a slot (the wire of older
/// publishers and of Dynamo-shaped conversions).
#[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
struct StoredBlockWithoutSlot {
    sequence_hash: SequenceHash,
    token_hash: TokenBlockHash,
}

#[test]
fn stored_block_slot_is_optional_on_the_wire() {
    let old = StoredBlockWithoutSlot {
        sequence_hash: SequenceHash(0xAB),
        token_hash: TokenBlockHash(0xCD),
    };
    let old_bytes = rmp_serde::to_vec_named(&old).unwrap();
    // An older encoding decodes, with no slot.
    let decoded: StoredBlock = rmp_serde::from_slice(&old_bytes).unwrap();
    assert_eq!(
        decoded,
        StoredBlock {
            sequence_hash: SequenceHash(0xAB),
            token_hash: TokenBlockHash(0xCD),
            slot: None,
        }
    );
    // Without a slot the encoding is byte-identical to the older one.
    assert_eq!(rmp_serde::to_vec_named(&decoded).unwrap(), old_bytes);
    // With a slot it round-trips through a whole event, and an old reader
    // (which ignores unknown keys) still reads the hashes.
    let with_slot = StoredBlock {
        slot: Some(7),
        ..decoded
    };
    let ev = event(
        StorageTier::RetainedGpuDirect,
        KvEventData::Stored {
            parent: None,
            blocks: vec![with_slot],
        },
    );
    let bytes = ev.to_wire().unwrap();
    assert_eq!(KvEvent::from_wire(&bytes).unwrap(), ev);
    let new_bytes = rmp_serde::to_vec_named(&with_slot).unwrap();
    assert!(new_bytes.len() > old_bytes.len());
    let as_old: StoredBlockWithoutSlot = rmp_serde::from_slice(&new_bytes).unwrap();
    assert_eq!(as_old, old);
}

#[test]
fn a_bad_nested_field_is_named_by_its_path() {
    let blocks = (0..3u64)
        .map(|i| StoredBlock {
            sequence_hash: SequenceHash(10 + i),
            token_hash: TokenBlockHash(20 + i),
            slot: Some(i as u32),
        })
        .collect();
    let good = event(
        StorageTier::RetainedGpuDirect,
        KvEventData::Stored {
            parent: None,
            blocks,
        },
    )
    .to_wire()
    .unwrap();
    let mut v = rmpv::decode::read_value(&mut &good[..]).unwrap();
    // The third block's slot becomes a string.
    fn edit(v: &mut rmpv::Value, path: &[&str], to: rmpv::Value) {
        let Some((head, rest)) = path.split_first() else {
            *v = to;
            return;
        };
        match v {
            rmpv::Value::Map(m) => {
                let (_, val) = m
                    .iter_mut()
                    .find(|(k, _)| k.as_str() == Some(head))
                    .unwrap_or_else(|| panic!("no key {head}"));
                edit(val, rest, to)
            }
            rmpv::Value::Array(a) => edit(&mut a[head.parse::<usize>().unwrap()], rest, to),
            other => panic!("{other:?} at {head}"),
        }
    }
    edit(
        &mut v,
        &["data", "stored", "blocks", "2", "slot"],
        rmpv::Value::from("seven"),
    );
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    let e = KvEvent::from_wire(&bytes).unwrap_err();
    let DescriptorError::Decode { what, field, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(
        (*what, field.as_deref()),
        ("kv_event", Some("data.stored.blocks[2].slot")),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with("cannot decode `kv_event` at `data.stored.blocks[2].slot`: "),
        "{e}"
    );
    // The value itself wrong (not a map): no field.
    let e = KvEvent::from_wire(&[0x07]).unwrap_err();
    assert!(
        matches!(e, DescriptorError::Decode { field: None, .. }),
        "{e:?}"
    );
}
