//! Every wire type round-trips and has its exact bytes pinned.
//!
//! Each snapshot holds the MessagePack bytes as hex (32 bytes a line) and a
//! JSON rendering of those same bytes (decoded generically, so it shows the
//! field names and values a foreign reader sees). A change to either means the
//! wire format changed: that needs a version bump, not a snapshot update.

mod common;

use common::*;
use kv_descriptor::*;
use uuid::Uuid;

fn render<T: Wire + PartialEq + std::fmt::Debug>(value: &T) -> String {
    let bytes = value.to_wire().unwrap();
    assert_eq!(&T::from_wire(&bytes).unwrap(), value, "round trip");
    let hex: Vec<String> = bytes
        .chunks(32)
        .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .collect();
    let json = json_of(&rmpv::decode::read_value(&mut &bytes[..]).unwrap());
    format!(
        "bytes: {}\nhex:\n{}\njson:\n{}",
        bytes.len(),
        hex.join("\n"),
        serde_json::to_string_pretty(&json).unwrap()
    )
}

/// JSON view of a MessagePack value; `bin` shows as `"bin:<hex>"`.
fn json_of(v: &rmpv::Value) -> serde_json::Value {
    use rmpv::Value as V;
    match v {
        V::Nil => serde_json::Value::Null,
        V::Boolean(b) => (*b).into(),
        V::Integer(i) => i
            .as_u64()
            .map_or_else(|| i.as_i64().unwrap().into(), Into::into),
        V::F32(f) => (*f).into(),
        V::F64(f) => (*f).into(),
        V::String(s) => s.as_str().unwrap().into(),
        V::Binary(b) => format!(
            "bin:{}",
            b.iter().map(|x| format!("{x:02x}")).collect::<String>()
        )
        .into(),
        V::Array(a) => a.iter().map(json_of).collect(),
        V::Map(m) => m
            .iter()
            .map(|(k, v)| (k.as_str().expect("string keys").to_owned(), json_of(v)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
        V::Ext(t, b) => serde_json::json!({ "ext": t, "data": b }),
    }
}

fn fetch_hint() -> FetchGpuHint {
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

#[test]
fn bank_descriptor_gpu_ipc() {
    insta::assert_snapshot!(render(
        &BankDescriptor::new(gpu_parts(layout(2), 1)).unwrap()
    ));
}

#[test]
fn bank_descriptor_host_shm() {
    insta::assert_snapshot!(render(
        &BankDescriptor::new(host_parts(layout(1), 0)).unwrap()
    ));
}

#[test]
fn bank_descriptor_fabric_nixl() {
    let mut p = gpu_parts(layout(1), 0);
    p.location = MemoryLocation::Gpu(GpuIdentity {
        fabric: Some(NvlinkFabric {
            cluster_uuid: Uuid::from_u128(0xFAB),
            clique_id: 3,
        }),
        ..gpu(0)
    });
    p.export = ExportHandle::CudaFabric {
        handle: ipc_handle(9),
    };
    insta::assert_snapshot!(
        "bank_descriptor_fabric",
        render(&BankDescriptor::new(p.clone()).unwrap())
    );
    p.export = ExportHandle::NixlAgent {
        agent_name: "decode-e1e1-r0".into(),
        metadata: b"nixl-md".to_vec(),
    };
    insta::assert_snapshot!(
        "bank_descriptor_nixl",
        render(&BankDescriptor::new(p).unwrap())
    );
}

#[test]
fn bank_manifest_tp2() {
    insta::assert_snapshot!(render(&BankManifest::new(gpu_group(2)).unwrap()));
}

#[test]
fn fetch_gpu_hint() {
    insta::assert_snapshot!(render(&fetch_hint()));
}

#[test]
fn hint_envelope() {
    insta::assert_snapshot!(render(
        &HintEnvelope::fetch_gpu("req-1", "a0", &fetch_hint()).unwrap()
    ));
}

#[test]
fn kv_events() {
    let t: Vec<u32> = (0..32).collect();
    let seq = sequence_hashes(&t, 16);
    let tok = token_block_hashes(&t, 16);
    let base = |tier, data| KvEvent {
        publisher: owner().engine_id,
        event_id: 1,
        role: Role::Decode,
        layout_fingerprint: layout(2).fingerprint(),
        tp_size: 2,
        tier,
        data,
    };
    let stored = base(
        StorageTier::RetainedGpuDirect,
        KvEventData::Stored {
            parent: None,
            blocks: vec![
                StoredBlock {
                    sequence_hash: seq[0],
                    token_hash: tok[0],
                    slot: None,
                },
                StoredBlock {
                    sequence_hash: seq[1],
                    token_hash: tok[1],
                    slot: None,
                },
            ],
        },
    );
    insta::assert_snapshot!("kv_event_stored", render(&stored));
    let removed = base(
        StorageTier::Device,
        KvEventData::Removed {
            sequence_hashes: vec![seq[1]],
        },
    );
    insta::assert_snapshot!("kv_event_removed", render(&removed));
    let cleared = base(StorageTier::HostPinned, KvEventData::Cleared);
    insta::assert_snapshot!("kv_event_cleared", render(&cleared));
}

fn pin_request() -> PinRequest {
    PinRequest::for_hint(42, &fetch_hint())
}

#[test]
fn pin_client_messages() {
    insta::assert_snapshot!("pin_request", render(&PinClientMessage::Pin(pin_request())));
    insta::assert_snapshot!(
        "pin_release",
        render(&PinClientMessage::Release(PinRelease { pin_id: 3 }))
    );
}

#[test]
fn pin_donor_messages() {
    insta::assert_snapshot!(
        "pin_grant",
        render(&PinDonorMessage::Granted(PinGrant {
            request_id: 42,
            pin_id: 3,
            max_hold_ms: 30_000,
            block_checksums: vec![],
        }))
    );
    insta::assert_snapshot!(
        "pin_refusal",
        render(&PinDonorMessage::Refused(PinRefusal {
            request_id: 42,
            reason: PinRefusalReason::StaleGeneration,
            detail: "`bank_generation` mismatch: request names 1, bank is 2".into(),
        }))
    );
    insta::assert_snapshot!(
        "pin_released",
        render(&PinDonorMessage::Released(PinReleased {
            pin_id: 3,
            held_us: 1_250,
            expired: false,
        }))
    );
}

#[test]
fn pin_frame_is_big_endian_length_then_body() {
    let msg = PinClientMessage::Release(PinRelease { pin_id: 3 });
    let body = msg.to_wire().unwrap();
    let frame = encode_pin_frame(&msg).unwrap();
    assert_eq!(frame[..4], (body.len() as u32).to_be_bytes());
    assert_eq!(frame[4..], body[..]);
}
