//! vLLM's KV event wire format: the exact bytes vLLM sends, both msgspec
//! shapes, and agreement with Dynamo's own vLLM decoder.

use dynamo_kv_router::protocols::StorageTier as DynamoTier;
use dynamo_kv_router::zmq_wire::{decode_event_batch, RawKvEvent};
use kv_descriptor::StorageTier;
use kv_router_glue::vllm_events::*;
use proptest::prelude::*;
use rmpv::Value;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn msgpack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// `KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[7],
/// parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
/// medium="GPU")], data_parallel_rank=0)` as msgspec writes it with
/// `array_like=True, tag=True`, byte for byte.
const ARRAY_LIKE_STORED: &str =
    "93 cb3ff8000000000000 91 97 ab426c6f636b53746f726564 9107 c0 9401020304 04 c0 a3475055 00";

#[test]
fn decodes_msgspec_array_like_bytes() {
    let batch = decode_batch(&hex(ARRAY_LIKE_STORED)).unwrap();
    assert_eq!(
        batch,
        VllmEventBatch {
            ts: 1.5,
            data_parallel_rank: Some(0),
            events: vec![VllmEvent::BlockStored {
                block_hashes: vec![7],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: vec![],
                group_idx: None,
            }],
        }
    );
    // Our encoder adds the newer positional fields (lora_name, extra_keys)
    // as nil; the result reads back the same.
    assert_eq!(
        decode_batch(&encode_batch(&batch, VllmEncoding::ArrayLike)).unwrap(),
        batch
    );
}

#[test]
fn decodes_map_shape_with_newer_fields_and_byte_hashes() {
    // Newer vLLM: msgspec maps, `type` tag, fields added after `medium`
    // (lora_name, extra_keys, group_idx, kv_cache_spec_kind), hashes as the
    // full 32-byte digest when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
    let mut digest = vec![0xAAu8; 24];
    digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let event = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(vec![Value::Binary(digest)]),
        ),
        ("parent_block_hash".into(), Value::from(-5i64)),
        (
            "token_ids".into(),
            Value::Array((0..4u32).map(Value::from).collect()),
        ),
        ("block_size".into(), 4u32.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "CPU".into()),
        ("lora_name".into(), Value::Nil),
        ("extra_keys".into(), Value::Array(vec![Value::Nil])),
        ("group_idx".into(), 0u32.into()),
        ("kv_cache_spec_kind".into(), "full_attention".into()),
    ]);
    let removed = Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        (
            "block_hashes".into(),
            Value::Array(vec![Value::from(u64::MAX)]),
        ),
        ("medium".into(), Value::Nil),
    ]);
    let cleared = Value::Map(vec![("type".into(), "AllBlocksCleared".into())]);
    let batch = Value::Map(vec![
        ("ts".into(), 2.0f64.into()),
        ("events".into(), Value::Array(vec![event, removed, cleared])),
    ]);
    let got = decode_batch(&msgpack(&batch)).unwrap();
    assert_eq!(got.ts, 2.0);
    assert_eq!(got.data_parallel_rank, None);
    assert_eq!(
        got.events,
        vec![
            VllmEvent::BlockStored {
                block_hashes: vec![0x0102_0304_0506_0708],
                parent_block_hash: Some((-5i64) as u64),
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                lora_id: None,
                medium: Some("CPU".into()),
                lora_name: None,
                // One block, no keys; group 0 of a hybrid model.
                extra_keys: vec![None],
                group_idx: Some(0),
            },
            VllmEvent::BlockRemoved {
                block_hashes: vec![u64::MAX],
                medium: None,
                group_idx: None,
            },
            VllmEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn positional_trailing_fields_are_ignored_and_extra_keys_detected() {
    let ev = Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![1u64.into()]),
        Value::Nil,
        Value::Array((0..4u32).map(Value::from).collect()),
        4u32.into(),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Array(vec![Value::Array(vec!["mm-hash".into()])]),
        Value::Nil,
        7u32.into(),
        "full_attention".into(),
    ]);
    let b = Value::Array(vec![0.5f64.into(), Value::Array(vec![ev])]);
    let got = decode_batch(&msgpack(&b)).unwrap();
    let VllmEvent::BlockStored {
        extra_keys,
        medium,
        group_idx,
        ..
    } = &got.events[0]
    else {
        panic!("not a store: {got:?}")
    };
    assert_eq!(
        *extra_keys,
        vec![Some(vec![VllmExtraKey::Text("mm-hash".into())])]
    );
    assert_eq!(*group_idx, None);
    assert_eq!(*medium, None);
}

#[test]
fn bad_payloads_name_the_field() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0x93, 0xcb], "payload"),
        ([hex(ARRAY_LIKE_STORED), vec![0]].concat(), "payload"),
        (msgpack(&Value::from(3)), "batch"),
        (
            msgpack(&Value::Array(vec!["x".into(), Value::Array(vec![])])),
            "batch.ts",
        ),
        (
            msgpack(&Value::Array(vec![1.0f64.into(), 5.into()])),
            "batch.events",
        ),
        (
            msgpack(&Value::Array(vec![
                1.0f64.into(),
                Value::Array(vec![Value::Array(vec!["BlockEaten".into()])]),
            ])),
            "event.type",
        ),
        (
            msgpack(&Value::Array(vec![
                1.0f64.into(),
                Value::Array(vec![Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![1.into()]),
                    Value::Nil,
                    Value::Array(vec![(-1).into()]),
                    4.into(),
                ])]),
            ])),
            "token_ids",
        ),
        (
            msgpack(&Value::Array(vec![
                1.0f64.into(),
                Value::Array(vec![Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(vec![1.into()]),
                    Value::Nil,
                    Value::Array(vec![]),
                    0.into(),
                ])]),
            ])),
            "block_size",
        ),
        (
            msgpack(&Value::Array(vec![
                1.0f64.into(),
                Value::Array(vec![Value::Array(vec![
                    "BlockRemoved".into(),
                    Value::Array(vec![Value::Binary(vec![1, 2, 3])]),
                ])]),
            ])),
            "block_hashes",
        ),
    ];
    for (bytes, field) in cases {
        match decode_batch(&bytes) {
            Err(VllmEventError::Payload { field: f, .. }) => assert_eq!(f, field, "{bytes:02x?}"),
            other => panic!("{bytes:02x?}: expected a payload error on {field}, got {other:?}"),
        }
    }
    // Deep nesting is refused, not recursed into.
    let mut deep = vec![0x91u8; 10_000];
    deep.push(0xc0);
    assert!(decode_batch(&deep).is_err());
}

#[test]
fn medium_table_agrees_with_dynamo() {
    let dynamo = |m: &str| DynamoTier::from_kv_medium(m);
    for m in [
        "GPU",
        "DEVICE",
        "CPU",
        "CPU_PINNED",
        "CPU_TIER1",
        "CPU_TIER2",
        "DISK",
        "NVME",
        "STORAGE",
        "EXTERNAL",
        "NETWORK",
        "REMOTE",
        "SHARED",
        "TAPE",
        "gpu",
    ] {
        let ours = tier_of_medium(Some(m));
        let theirs = dynamo(m).map(|t| {
            let bytes = rmp_serde::to_vec_named(&t).unwrap();
            rmp_serde::from_slice::<StorageTier>(&bytes).unwrap()
        });
        assert_eq!(ours, theirs, "medium {m}");
    }
    assert_eq!(tier_of_medium(None), Some(StorageTier::Device));
    assert_eq!(
        tier_of_medium(Some("RETAINED_GPU_DIRECT")),
        Some(StorageTier::RetainedGpuDirect)
    );
    assert_eq!(
        dynamo("RETAINED_GPU_DIRECT"),
        None,
        "Dynamo has no retained tier"
    );
}

fn arb_event() -> impl Strategy<Value = VllmEvent> {
    prop_oneof![
        (
            proptest::collection::vec(any::<u64>(), 0..4),
            proptest::option::of(any::<u64>()),
            1u32..8,
            proptest::option::of(prop_oneof![Just("GPU"), Just("CPU"), Just("DISK")]),
        )
            .prop_flat_map(|(hashes, parent, bs, medium)| {
                let n = hashes.len() * bs as usize;
                proptest::collection::vec(any::<u32>(), n).prop_map(move |tokens| {
                    VllmEvent::BlockStored {
                        block_hashes: hashes.clone(),
                        parent_block_hash: parent,
                        token_ids: tokens,
                        block_size: bs,
                        lora_id: None,
                        medium: medium.map(str::to_owned),
                        lora_name: None,
                        extra_keys: vec![],
                        group_idx: None,
                    }
                })
            }),
        (
            proptest::collection::vec(any::<u64>(), 0..4),
            proptest::option::of(Just("CPU".to_owned()))
        )
            .prop_map(|(block_hashes, medium)| VllmEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx: None,
            }),
        Just(VllmEvent::AllBlocksCleared),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Whatever we decode, Dynamo's own vLLM decoder (zmq_wire 1.6.1) reads
    /// the same bytes to the same hashes, tokens, block size and medium.
    #[test]
    fn dynamo_decodes_the_same_batches(
        events in proptest::collection::vec(arb_event(), 0..6),
        ts in 0.0f64..2e9,
        dp in proptest::option::of(0i64..4),
    ) {
        let batch = VllmEventBatch { ts, events, data_parallel_rank: dp };
        let bytes = encode_batch(&batch, VllmEncoding::ArrayLike);
        prop_assert_eq!(&decode_batch(&bytes).unwrap(), &batch);
        prop_assert_eq!(&decode_batch(&encode_batch(&batch, VllmEncoding::Map)).unwrap(), &batch);
        let theirs = decode_event_batch(&bytes).unwrap();
        prop_assert_eq!(theirs.ts, ts);
        prop_assert_eq!(theirs.data_parallel_rank.map(i64::from), dp);
        prop_assert_eq!(theirs.events.len(), batch.events.len());
        for (ours, theirs) in batch.events.iter().zip(&theirs.events) {
            match (ours, theirs) {
                (
                    VllmEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, .. },
                    RawKvEvent::BlockStored { block_hashes: h, parent_block_hash: p, token_ids: t, block_size: bs, medium: m, .. },
                ) => {
                    prop_assert_eq!(block_hashes, &h.iter().map(|x| x.into_u64()).collect::<Vec<_>>());
                    prop_assert_eq!(*parent_block_hash, p.map(|x| x.into_u64()));
                    prop_assert_eq!(token_ids, t);
                    prop_assert_eq!(*block_size as usize, *bs);
                    prop_assert_eq!(medium, m);
                }
                (
                    VllmEvent::BlockRemoved { block_hashes, medium, .. },
                    RawKvEvent::BlockRemoved { block_hashes: h, medium: m, .. },
                ) => {
                    prop_assert_eq!(block_hashes, &h.iter().map(|x| x.into_u64()).collect::<Vec<_>>());
                    prop_assert_eq!(medium, m);
                }
                (VllmEvent::AllBlocksCleared, RawKvEvent::AllBlocksCleared { .. }) => {}
                (a, b) => prop_assert!(false, "ours {:?} theirs {:?}", a, b),
            }
        }
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }
}
