//! What every decoder must satisfy on arbitrary bytes; shared by the
//! cargo-fuzz targets and the stable corpus replay in
//! `crates/kv-descriptor/tests/decoder_robustness.rs` (included by path, so
//! there is one definition of the properties).
//!
//! Each function panics only when a property is broken: a decoder that
//! panics, a decoded value that its own constructor would refuse, or a value
//! that does not survive re-encoding.

use kv_descriptor::{
    encode_pin_frame, split_pin_frame, BankDescriptor, BankManifest, FetchGpuHint, HintEnvelope,
    KvEvent, PinClientMessage, PinDonorMessage, Wire, MAX_MANIFEST_BYTES, MAX_PIN_FRAME_BYTES,
    PIN_FRAME_HEADER_BYTES,
};

/// `BankDescriptor::from_wire`: an accepted value is valid and round-trips.
pub fn descriptor(data: &[u8]) {
    if let Ok(d) = BankDescriptor::from_wire(data) {
        let rebuilt =
            BankDescriptor::new(d.parts().clone()).expect("decoded descriptor must be valid");
        assert_eq!(
            rebuilt, d,
            "decoded descriptor differs from its validated rebuild"
        );
        let again = BankDescriptor::from_wire(&d.to_wire().expect("encode")).expect("re-decode");
        assert_eq!(again, d);
    }
}

/// `BankManifest::from_wire`: an accepted manifest is valid, within its size
/// bound, and round-trips.
pub fn manifest(data: &[u8]) {
    if let Ok(m) = BankManifest::from_wire(data) {
        let rebuilt =
            BankManifest::new(m.parts().to_vec()).expect("decoded manifest must be valid");
        assert_eq!(rebuilt, m);
        let bytes = m.to_wire().expect("encode");
        assert!(bytes.len() <= MAX_MANIFEST_BYTES, "{} bytes", bytes.len());
        assert_eq!(BankManifest::from_wire(&bytes).expect("re-decode"), m);
    }
}

/// `HintEnvelope::from_wire`, `fetch_gpu_actions`, `FetchGpuHint::validate`
/// and `FetchGpuHint::from_wire`: no panic whatever the payload, and accepted
/// hints round-trip.
pub fn hint(data: &[u8]) {
    if let Ok(env) = HintEnvelope::from_wire(data) {
        // The payload may hold floats (NaN != NaN), so check re-decoding, not equality.
        HintEnvelope::from_wire(&env.to_wire().expect("encode")).expect("re-decode");
        if let Ok(hints) = env.fetch_gpu_actions() {
            for h in hints {
                check_fetch_hint(&h);
            }
        }
    }
    if let Ok(h) = FetchGpuHint::from_wire(data) {
        check_fetch_hint(&h);
    }
}

fn check_fetch_hint(h: &FetchGpuHint) {
    for rank_block_bytes in [0, 1, 16_384, u64::MAX] {
        let _ = h.validate(rank_block_bytes);
    }
    let _ = h.fetch_blocks();
    let again = FetchGpuHint::from_wire(&h.to_wire().expect("encode")).expect("re-decode");
    assert_eq!(&again, h);
}

/// `KvEvent::from_wire`: accepted events round-trip.
pub fn event(data: &[u8]) {
    if let Ok(e) = KvEvent::from_wire(data) {
        let again = KvEvent::from_wire(&e.to_wire().expect("encode")).expect("re-decode");
        assert_eq!(again, e);
    }
}

/// The pin control stream: `data` is cut into frames with
/// `split_pin_frame` (a refused header ends the stream, as it ends a
/// connection) and every body, and `data` itself, is decoded as both
/// message directions. Accepted messages are valid and round-trip, framed.
pub fn pin_control(data: &[u8]) {
    pin_message(data);
    let mut rest = data;
    while let Ok(Some((body, used))) = split_pin_frame(rest) {
        assert!(
            (1..=MAX_PIN_FRAME_BYTES).contains(&body.len()),
            "{} body bytes",
            body.len()
        );
        assert_eq!(used, PIN_FRAME_HEADER_BYTES + body.len());
        pin_message(body);
        rest = &rest[used..];
    }
}

fn pin_message(body: &[u8]) {
    if let Ok(m) = PinClientMessage::from_wire(body) {
        m.validate().expect("decoded client message must be valid");
        let frame = encode_pin_frame(&m).expect("encode");
        let (again, _) = split_pin_frame(&frame).expect("frame").expect("whole");
        assert_eq!(PinClientMessage::from_wire(again).expect("re-decode"), m);
    }
    if let Ok(m) = PinDonorMessage::from_wire(body) {
        m.validate().expect("decoded donor message must be valid");
        let frame = encode_pin_frame(&m).expect("encode");
        let (again, _) = split_pin_frame(&frame).expect("frame").expect("whole");
        assert_eq!(PinDonorMessage::from_wire(again).expect("re-decode"), m);
    }
}

/// Every check above, for one input.
pub fn all(data: &[u8]) {
    descriptor(data);
    manifest(data);
    hint(data);
    event(data);
    pin_control(data);
}
