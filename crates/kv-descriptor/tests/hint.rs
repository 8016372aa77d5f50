//! kv.fetch_gpu@1.0: validate() rules, the Dynamo envelope, unknown actions.

mod common;

use std::collections::BTreeMap;

use common::{assert_field, field_of};
use dynamo_kv_router::kv_hints::{KvHint, KvHintAction};
use kv_descriptor::*;
use uuid::Uuid;

const RBB: u64 = 16_384;

fn hint(tp: u32) -> FetchGpuHint {
    FetchGpuHint {
        donor_engine_id: EngineId(Uuid::from_u128(0xD0)),
        bank_generation: 3,
        layout_fingerprint: LayoutFingerprint(0x1234_5678_9abc_def0),
        tp_size: tp,
        sequence_hashes: (0..5).map(|i| SequenceHash(1000 + i)).collect(),
        fetch_from: 2,
        parts: (0..tp)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: vec![7, 3, 12],
                expected_bytes: 3 * RBB,
            })
            .collect(),
        donor_control_endpoint: "kv.decode.d0.control".into(),
    }
}

#[test]
fn valid_hint() {
    for tp in [1, 2, 4, 8] {
        hint(tp).validate(RBB).unwrap();
    }
    assert_eq!(hint(2).fetch_blocks(), 3);
    let h = hint(2);
    assert_eq!(FetchGpuHint::from_wire(&h.to_wire().unwrap()).unwrap(), h);
}

#[test]
fn validate_rules_name_the_field() {
    type Edit = Box<dyn Fn(&mut FetchGpuHint)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("hint.bank_generation", Box::new(|h| h.bank_generation = 0)),
        ("hint.parts", Box::new(|h| h.tp_size = 0)),
        ("hint.parts", Box::new(|h| h.tp_size = 4)),
        (
            "hint.parts",
            Box::new(|h| {
                h.parts.pop();
            }),
        ),
        (
            "hint.sequence_hashes",
            Box::new(|h| {
                h.sequence_hashes.clear();
                h.fetch_from = 0;
            }),
        ),
        (
            "hint.sequence_hashes",
            Box::new(|h| h.sequence_hashes = vec![SequenceHash(1); MAX_HINT_BLOCKS + 1]),
        ),
        ("hint.fetch_from", Box::new(|h| h.fetch_from = 5)),
        ("hint.fetch_from", Box::new(|h| h.fetch_from = u32::MAX)),
        ("hint.parts.tp_rank", Box::new(|h| h.parts.swap(0, 1))),
        ("hint.parts.tp_rank", Box::new(|h| h.parts[1].tp_rank = 0)),
        (
            "hint.parts.slot_ids",
            Box::new(|h| h.parts[1].slot_ids.push(40)),
        ),
        (
            "hint.parts.slot_ids",
            Box::new(|h| h.parts[0].slot_ids.clear()),
        ),
        (
            "hint.parts.slot_ids",
            Box::new(|h| h.parts[1].slot_ids[2] = 7),
        ),
        (
            "hint.parts.slot_ids",
            Box::new(|h| h.parts[0].slot_ids[0] = MAX_SLOTS),
        ),
        (
            "hint.parts.expected_bytes",
            Box::new(|h| h.parts[1].expected_bytes += 1),
        ),
        (
            "hint.parts.expected_bytes",
            Box::new(|h| h.parts[0].expected_bytes = 0),
        ),
        (
            "hint.donor_control_endpoint",
            Box::new(|h| h.donor_control_endpoint.clear()),
        ),
    ];
    for (field, edit) in cases {
        let mut h = hint(2);
        edit(&mut h);
        assert_field(h.validate(RBB), field);
    }
}

#[test]
fn validate_error_details() {
    let mut h = hint(2);
    h.parts[1].slot_ids = vec![4, 9, 4];
    let e = h.validate(RBB).unwrap_err();
    assert!(e.to_string().contains("rank 1 names slot 4 twice"), "{e}");
    // An absurd block size overflows the byte count: refused, not wrapped.
    let e = hint(1).validate(u64::MAX).unwrap_err();
    assert_eq!(field_of(&e), "hint.parts.expected_bytes");
    assert!(e.to_string().contains("overflow"), "{e}");
    // Geometry disagreement shows both numbers.
    let e = hint(1).validate(RBB * 2).unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "expects {} bytes, geometry gives {}",
            3 * RBB,
            6 * RBB
        )),
        "{e}"
    );
}

#[test]
fn envelope_round_trip() {
    let h = hint(2);
    let env = HintEnvelope::fetch_gpu("req-42", "a0", &h).unwrap();
    assert_eq!(env.protocol_version, HINT_PROTOCOL_VERSION);
    assert_eq!(env.actions[0].action_type, FETCH_GPU_ACTION_TYPE);
    assert_eq!(env.actions[0].action_version, FETCH_GPU_ACTION_VERSION);
    let back = HintEnvelope::from_wire(&env.to_wire().unwrap()).unwrap();
    assert_eq!(back, env);
    assert_eq!(back.fetch_gpu_actions().unwrap(), vec![h]);
}

#[test]
fn dynamo_reads_our_envelope() {
    let h = hint(2);
    let bytes = HintEnvelope::fetch_gpu("req-42", "a0", &h)
        .unwrap()
        .to_wire()
        .unwrap();
    let theirs: KvHint = rmp_serde::from_slice(&bytes).unwrap();
    assert_eq!(theirs.protocol_version, "0.1");
    assert_eq!(theirs.message_id, "req-42");
    assert_eq!(theirs.actions.len(), 1);
    let a = &theirs.actions[0];
    assert_eq!(
        (
            a.action_id.as_str(),
            a.action_type.as_str(),
            a.action_version.as_str()
        ),
        ("a0", "kv.fetch_gpu", "1.0")
    );
    let p = &a.payload;
    assert_eq!(
        p["donor_engine_id"],
        serde_json::json!(Uuid::from_u128(0xD0).to_string())
    );
    assert_eq!(p["bank_generation"], serde_json::json!(3));
    assert_eq!(
        p["layout_fingerprint"],
        serde_json::json!(0x1234_5678_9abc_def0u64)
    );
    assert_eq!(
        p["sequence_hashes"],
        serde_json::json!([1000, 1001, 1002, 1003, 1004])
    );
    assert_eq!(p["fetch_from"], serde_json::json!(2));
    assert_eq!(
        p["parts"][1],
        serde_json::json!({"tp_rank": 1, "slot_ids": [7, 3, 12], "expected_bytes": 3 * RBB})
    );
    assert_eq!(
        p["donor_control_endpoint"],
        serde_json::json!("kv.decode.d0.control")
    );
    assert_eq!(p.len(), 8);
}

fn dynamo_envelope(
    action_type: &str,
    action_version: &str,
    payload: BTreeMap<String, serde_json::Value>,
) -> Vec<u8> {
    let hint = KvHint::new(
        "req-7",
        vec![KvHintAction::new("x", action_type, action_version, payload)],
    );
    rmp_serde::to_vec_named(&hint).unwrap()
}

#[test]
fn we_read_dynamo_envelopes_and_refuse_their_actions() {
    let payload = BTreeMap::from([
        (
            "source_control_endpoint".to_owned(),
            serde_json::json!("tcp://x"),
        ),
        ("block_hashes".to_owned(), serde_json::json!([1, 2, 3])),
    ]);
    let env = HintEnvelope::from_wire(&dynamo_envelope("kv.fetch", "1.0", payload)).unwrap();
    assert_eq!(env.message_id, "req-7");
    let e = env.fetch_gpu_actions().unwrap_err();
    assert_eq!(
        e,
        DescriptorError::UnsupportedAction {
            action_type: "kv.fetch".into(),
            action_version: "1.0".into(),
            known: "kv.fetch_gpu@1.0"
        }
    );
    assert!(e.to_string().contains("`kv.fetch@1.0`"), "{e}");
}

#[test]
fn unknown_version_of_our_action_is_refused() {
    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    env.actions[0].action_version = "1.1".into();
    let e = env.fetch_gpu_actions().unwrap_err();
    assert!(
        matches!(e, DescriptorError::UnsupportedAction { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("kv.fetch_gpu@1.1"), "{e}");
    assert!(e.to_string().contains("knows kv.fetch_gpu@1.0"), "{e}");
}

#[test]
fn one_unknown_action_refuses_the_whole_envelope() {
    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    let mut other = env.actions[0].clone();
    other.action_type = "kv.prefetch".into();
    env.actions.push(other);
    assert!(matches!(
        env.fetch_gpu_actions(),
        Err(DescriptorError::UnsupportedAction { .. })
    ));
}

#[test]
fn unknown_protocol_version_is_refused() {
    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    env.protocol_version = "0.2".into();
    assert_field(env.fetch_gpu_actions(), "hint.protocol_version");
}

#[test]
fn malformed_payload_names_the_field() {
    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    env.actions[0].payload.remove("tp_size");
    let e = env.fetch_gpu_actions().unwrap_err();
    assert!(
        matches!(
            e,
            DescriptorError::Decode {
                what: "fetch_gpu_hint",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("tp_size"), "{e}");

    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    env.actions[0]
        .payload
        .insert("fetch_from".into(), rmpv::Value::from("two"));
    assert!(matches!(
        env.fetch_gpu_actions(),
        Err(DescriptorError::Decode { .. })
    ));

    let mut env = HintEnvelope::fetch_gpu("m", "a0", &hint(1)).unwrap();
    env.actions[0]
        .payload
        .insert("donor_engine_id".into(), rmpv::Value::from("not-a-uuid"));
    assert!(matches!(
        env.fetch_gpu_actions(),
        Err(DescriptorError::Decode { .. })
    ));
}

#[test]
fn empty_envelope_has_no_actions() {
    let env = HintEnvelope {
        protocol_version: HINT_PROTOCOL_VERSION.into(),
        message_id: "m".into(),
        actions: vec![],
    };
    assert_eq!(env.fetch_gpu_actions().unwrap(), vec![]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// Any internally consistent hint validates, and survives the envelope
    /// both through our reader and through Dynamo's `KvHint`.
    #[test]
    fn consistent_hints_validate_and_round_trip(
        tp_log in 0u32..4,
        covered in 1usize..200,
        from_frac in 0.0f64..1.0,
        rbb in 1u64..(1 << 30),
        gen in 1u64..u64::MAX,
        salt in proptest::prelude::any::<u64>(),
    ) {
        let tp = 1u32 << tp_log;
        let fetch_from = ((covered as f64 * from_frac) as usize).min(covered - 1);
        let n = covered - fetch_from;
        // Distinct slots: a salted stride permutation of 0..n.
        let slots: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).rotate_left((salt % 7) as u32) % (1 << 24)).collect();
        let mut uniq = slots.clone();
        uniq.sort_unstable();
        uniq.dedup();
        proptest::prop_assume!(uniq.len() == n);
        let h = FetchGpuHint {
            donor_engine_id: EngineId(Uuid::from_u64_pair(salt, 1)),
            bank_generation: gen,
            layout_fingerprint: LayoutFingerprint(salt),
            tp_size: tp,
            sequence_hashes: (0..covered as u64).map(|i| SequenceHash(salt ^ i)).collect(),
            fetch_from: fetch_from as u32,
            parts: (0..tp).map(|r| FetchPart { tp_rank: r, slot_ids: slots.clone(), expected_bytes: n as u64 * rbb }).collect(),
            donor_control_endpoint: format!("kv.decode.{salt:x}"),
        };
        proptest::prop_assert!(h.validate(rbb).is_ok(), "{:?}", h.validate(rbb));
        proptest::prop_assert_eq!(h.fetch_blocks(), n);
        let bytes = HintEnvelope::fetch_gpu("m", "a", &h).unwrap().to_wire().unwrap();
        proptest::prop_assert_eq!(HintEnvelope::from_wire(&bytes).unwrap().fetch_gpu_actions().unwrap(), vec![h.clone()]);
        let theirs: KvHint = rmp_serde::from_slice(&bytes).unwrap();
        proptest::prop_assert_eq!(theirs.actions[0].payload["bank_generation"].as_u64(), Some(gen));
        proptest::prop_assert_eq!(theirs.actions[0].payload["sequence_hashes"].as_array().map(Vec::len), Some(covered));
    }
}
