//! Pin control messages: shape validation naming the field, frame bounds,
//! and incremental framing.

mod common;

use common::*;
use kv_descriptor::*;

fn request(tp: u32, slots: &[u32]) -> PinRequest {
    let l = layout(tp);
    PinRequest {
        request_id: 9,
        donor_engine_id: owner().engine_id,
        bank_generation: 1,
        layout_fingerprint: l.fingerprint(),
        tp_size: tp,
        sequence_hashes: sequence_hashes(&(0..16 * slots.len() as u32).collect::<Vec<_>>(), 16),
        parts: (0..tp)
            .map(|r| PinPart {
                tp_rank: r,
                slot_ids: slots.to_vec(),
            })
            .collect(),
        want_block_checksums: false,
    }
}

/// Encodes without validation (the encoder writes whatever it is given), so
/// the decoder's own checks are what refuses it.
fn decode_err(m: &PinClientMessage) -> String {
    let bytes = rmp_serde::to_vec_named(m).unwrap();
    PinClientMessage::from_wire(&bytes).unwrap_err().to_string()
}

#[test]
fn malformed_requests_are_refused_naming_the_field() {
    let ok = request(2, &[1, 2, 3]);
    PinClientMessage::from_wire(&PinClientMessage::Pin(ok.clone()).to_wire().unwrap()).unwrap();
    type Edit = Box<dyn Fn(&mut PinRequest)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "pin_request.bank_generation",
            Box::new(|r| r.bank_generation = 0),
        ),
        (
            "pin_request.sequence_hashes",
            Box::new(|r| r.sequence_hashes.clear()),
        ),
        ("pin_request.parts", Box::new(|r| r.tp_size = 3)),
        ("pin_request.parts", Box::new(|r| r.tp_size = 0)),
        (
            "pin_request.parts.tp_rank",
            Box::new(|r| r.parts.swap(0, 1)),
        ),
        (
            "pin_request.parts.slot_ids",
            Box::new(|r| {
                r.parts[1].slot_ids.pop();
            }),
        ),
        (
            "pin_request.parts.slot_ids",
            Box::new(|r| r.parts[0].slot_ids[2] = MAX_SLOTS),
        ),
    ];
    for (field, edit) in cases {
        let mut r = ok.clone();
        edit(&mut r);
        let e = decode_err(&PinClientMessage::Pin(r));
        assert!(e.contains(field), "expected `{field}` in {e}");
    }
    let e = decode_err(&PinClientMessage::Release(PinRelease { pin_id: 0 }));
    assert!(e.contains("pin_release.pin_id"), "{e}");
}

#[test]
fn donor_messages_refuse_pin_id_zero() {
    let bytes = rmp_serde::to_vec_named(&PinDonorMessage::Granted(PinGrant {
        request_id: 1,
        pin_id: 0,
        max_hold_ms: 1,
        block_checksums: vec![],
    }))
    .unwrap();
    let e = PinDonorMessage::from_wire(&bytes).unwrap_err().to_string();
    assert!(e.contains("pin_grant.pin_id"), "{e}");
}

#[test]
fn an_unknown_refusal_reason_or_message_kind_is_an_error() {
    // A reader refuses a variant it does not know instead of misfiling it.
    let refusal = PinDonorMessage::Refused(PinRefusal {
        request_id: 1,
        reason: PinRefusalReason::BankClosed,
        detail: String::new(),
    });
    let original = rmpv::decode::read_value(&mut &refusal.to_wire().unwrap()[..]).unwrap();
    let encode = |v: &rmpv::Value| {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, v).unwrap();
        bytes
    };
    // The edit tools below must see the untouched value decode first.
    assert_eq!(
        PinDonorMessage::from_wire(&encode(&original)).unwrap(),
        refusal
    );

    let mut v = original.clone();
    if let rmpv::Value::Map(outer) = &mut v {
        if let rmpv::Value::Map(inner) = &mut outer[0].1 {
            for (k, val) in inner.iter_mut() {
                if k.as_str() == Some("reason") {
                    *val = "evicted_by_aliens".into();
                }
            }
        }
    }
    assert_ne!(v, original);
    let e = PinDonorMessage::from_wire(&encode(&v))
        .unwrap_err()
        .to_string();
    assert!(e.contains("evicted_by_aliens"), "{e}");

    let mut v = original.clone();
    if let rmpv::Value::Map(outer) = &mut v {
        outer[0].0 = "teleport".into();
    }
    assert_ne!(v, original);
    let e = PinDonorMessage::from_wire(&encode(&v))
        .unwrap_err()
        .to_string();
    assert!(e.contains("teleport"), "{e}");
}

#[test]
fn frame_headers_beyond_the_limit_or_empty_are_refused_before_the_body() {
    let over = (MAX_PIN_FRAME_BYTES as u32 + 1).to_be_bytes();
    let e = split_pin_frame(&over).unwrap_err().to_string();
    assert!(
        e.contains("pin_frame.length") && e.contains("above the limit"),
        "{e}"
    );
    let e = pin_frame_len([0; 4]).unwrap_err().to_string();
    assert!(e.contains("pin_frame.length"), "{e}");
    assert_eq!(
        pin_frame_len((MAX_PIN_FRAME_BYTES as u32).to_be_bytes()).unwrap(),
        MAX_PIN_FRAME_BYTES
    );
}

#[test]
fn encoding_a_message_above_the_frame_limit_is_refused() {
    // 5 bytes per slot id at or above 2^16 pushes 8 ranks x 120k slots well
    // past 4 MiB; the hashes alone are ~1 MiB.
    let n = 120_000usize;
    let mut r = request(8, &[]);
    r.sequence_hashes = (0..n as u64).map(|i| SequenceHash(u64::MAX - i)).collect();
    for p in &mut r.parts {
        p.slot_ids = (0..n as u32).map(|i| 70_000 + i).collect();
    }
    let e = encode_pin_frame(&PinClientMessage::Pin(r))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pin_frame.length"), "{e}");
}

#[test]
fn frames_split_incrementally_at_every_byte_boundary() {
    let a = encode_pin_frame(&PinClientMessage::Pin(request(2, &[4, 5]))).unwrap();
    let b = encode_pin_frame(&PinClientMessage::Release(PinRelease { pin_id: 7 })).unwrap();
    let stream = [a.clone(), b.clone()].concat();
    for cut in 0..stream.len() {
        match split_pin_frame(&stream[..cut]).unwrap() {
            None => assert!(cut < a.len(), "cut {cut}"),
            Some((body, used)) => {
                assert!(cut >= a.len());
                assert_eq!(used, a.len());
                assert_eq!(body, &a[4..]);
            }
        }
    }
    let (_, used) = split_pin_frame(&stream).unwrap().unwrap();
    let (body, used2) = split_pin_frame(&stream[used..]).unwrap().unwrap();
    assert_eq!(used2, b.len());
    assert_eq!(
        PinClientMessage::from_wire(body).unwrap(),
        PinClientMessage::Release(PinRelease { pin_id: 7 })
    );
}

#[test]
fn a_request_carries_the_fetched_blocks_and_back_to_a_hint() {
    let l = layout(2);
    let h = FetchGpuHint {
        donor_engine_id: owner().engine_id,
        bank_generation: 3,
        layout_fingerprint: l.fingerprint(),
        tp_size: 2,
        sequence_hashes: sequence_hashes(&(0..64).collect::<Vec<u32>>(), 16),
        fetch_from: 1,
        parts: (0..2)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: vec![5, 6, 9],
                expected_bytes: 3 * l.rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: "unix:/tmp/x".into(),
    };
    let r = PinRequest::for_hint(5, &h);
    r.validate().unwrap();
    assert_eq!(r.sequence_hashes, h.sequence_hashes[1..]);
    let back = r.to_hint(l.rank_block_bytes() as u64, "unix:/tmp/x");
    back.validate(l.rank_block_bytes() as u64).unwrap();
    assert_eq!(back.fetch_from, 0);
    assert_eq!(back.parts, h.parts);
    assert_eq!(back.sequence_hashes, r.sequence_hashes);
}

/// Block checksums are opt-in on both sides: a request without the flag and
/// a grant without checksums encode exactly as before the fields existed
/// (no key; the `pin_request` / `pin_grant` wire snapshots are unchanged),
/// bytes of that older form decode with the flag off and no checksums, and
/// the new fields round-trip.
#[test]
fn block_checksums_are_opt_in_and_old_messages_still_decode() {
    let req = request(2, &[3, 4]);
    let bytes = rmp_serde::to_vec_named(&PinClientMessage::Pin(req.clone())).unwrap();
    assert!(!bytes
        .windows(b"want_block_checksums".len())
        .any(|w| w == b"want_block_checksums"));
    let asked = req.clone().with_block_checksums();
    assert!(asked.want_block_checksums);
    let back =
        PinClientMessage::from_wire(&PinClientMessage::Pin(asked.clone()).to_wire().unwrap())
            .unwrap();
    assert_eq!(back, PinClientMessage::Pin(asked));

    // A grant as an older donor writes it: three fields.
    #[derive(serde::Serialize)]
    struct OldGrant {
        request_id: u64,
        pin_id: u64,
        max_hold_ms: u64,
    }
    #[derive(serde::Serialize)]
    #[serde(rename_all = "snake_case")]
    enum OldDonorMessage {
        Granted(OldGrant),
    }
    let old = rmp_serde::to_vec_named(&OldDonorMessage::Granted(OldGrant {
        request_id: 9,
        pin_id: 2,
        max_hold_ms: 500,
    }))
    .unwrap();
    let plain = PinGrant {
        request_id: 9,
        pin_id: 2,
        max_hold_ms: 500,
        block_checksums: vec![],
    };
    assert_eq!(
        PinDonorMessage::from_wire(&old).unwrap(),
        PinDonorMessage::Granted(plain.clone())
    );
    assert_eq!(PinDonorMessage::Granted(plain).to_wire().unwrap(), old);
    let with = PinDonorMessage::Granted(PinGrant {
        request_id: 9,
        pin_id: 2,
        max_hold_ms: 500,
        block_checksums: vec![u64::MAX, 0, 7],
    });
    assert_eq!(
        PinDonorMessage::from_wire(&with.to_wire().unwrap()).unwrap(),
        with
    );
}
