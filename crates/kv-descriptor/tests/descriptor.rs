//! BankDescriptor: every rejection names its field, on the constructor and on
//! the wire; the checksum catches tampering.

mod common;

use common::*;
use kv_descriptor::*;
use uuid::Uuid;

fn valid() -> BankParts {
    gpu_parts(layout(2), 1)
}

/// Encodes `parts` with a correct checksum but without validation, the way a
/// buggy or hostile peer could, by editing a valid encoding.
fn encode_unvalidated(edit: impl FnOnce(&mut rmpv::Value)) -> Vec<u8> {
    let d = BankDescriptor::new(valid()).unwrap();
    let mut v = to_value(&d.to_wire().unwrap());
    edit(entry(&mut v, "parts"));
    // Recompute the checksum the documented way so only validation can refuse it.
    let parts_bytes = from_value(entry(&mut v, "parts"));
    *entry(&mut v, "checksum") =
        rmpv::Value::from(xxhash_rust::xxh3::xxh3_64_with_seed(&parts_bytes, 1337));
    from_value(&v)
}

#[test]
fn valid_gpu_descriptor_accessors() {
    let d = BankDescriptor::new(valid()).unwrap();
    assert_eq!(d.tp_rank(), 1);
    assert_eq!(d.slot_count(), 32);
    // 2 x 4 layers x 16 tokens x 4 heads x 16 dims x 2 bytes
    assert_eq!(d.slot_bytes(), 16_384);
    assert_eq!(d.region_bytes(), 32 * 16_384);
    assert_eq!(d.layout(), &layout(2));
    assert_eq!(d.owner(), &owner());
    assert!(d.location().is_gpu());
    assert_eq!(d.location().host_id(), "node-a");
    assert_eq!(d.parts(), &valid());
    // The checksum is the documented XXH3 of the named-field parts encoding.
    let expect =
        xxhash_rust::xxh3::xxh3_64_with_seed(&rmp_serde::to_vec_named(&valid()).unwrap(), 1337);
    assert_eq!(d.checksum(), expect);
}

#[test]
fn every_export_kind_round_trips() {
    let l = layout(1);
    let mut fabric = gpu_parts(l, 0);
    fabric.export = ExportHandle::CudaFabric {
        handle: vec![9; 64],
    };
    let mut nixl = gpu_parts(l, 0);
    nixl.export = ExportHandle::NixlAgent {
        agent_name: "decode-0".into(),
        metadata: vec![1, 2, 3],
    };
    let mut nixl_host = host_parts(l, 0);
    nixl_host.export = ExportHandle::NixlAgent {
        agent_name: "decode-0".into(),
        metadata: vec![0; MAX_NIXL_METADATA_BYTES],
    };
    for parts in [gpu_parts(l, 0), host_parts(l, 0), fabric, nixl, nixl_host] {
        let d = BankDescriptor::new(parts.clone()).unwrap();
        let back = BankDescriptor::from_wire(&d.to_wire().unwrap()).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.parts(), &parts);
    }
}

/// Each case: how to break valid parts, and the field the error must name.
/// A field name and an edit of valid parts that must be refused naming it.
type Case = (&'static str, Box<dyn Fn(&mut BankParts)>);

fn rejection_cases() -> Vec<Case> {
    vec![
        ("tp_rank", Box::new(|p| p.tp_rank = 2)),
        ("slot_count", Box::new(|p| p.slot_count = 0)),
        ("slot_count", Box::new(|p| p.slot_count = MAX_SLOTS + 1)),
        ("slot_bytes", Box::new(|p| p.slot_bytes += 1)),
        (
            "gpu.host_id",
            Box::new(|p| {
                p.location = MemoryLocation::Gpu(GpuIdentity {
                    host_id: String::new(),
                    ..gpu(1)
                })
            }),
        ),
        (
            "gpu.host_id",
            Box::new(|p| {
                p.location = MemoryLocation::Gpu(GpuIdentity {
                    host_id: "h".repeat(256),
                    ..gpu(1)
                })
            }),
        ),
        (
            "gpu.host_id",
            Box::new(|p| {
                p.location = MemoryLocation::Gpu(GpuIdentity {
                    host_id: "node\na".into(),
                    ..gpu(1)
                })
            }),
        ),
        (
            "gpu.uuid",
            Box::new(|p| {
                p.location = MemoryLocation::Gpu(GpuIdentity {
                    uuid: Uuid::nil(),
                    ..gpu(1)
                })
            }),
        ),
        (
            "owner.engine_id",
            Box::new(|p| p.owner.engine_id = EngineId(Uuid::nil())),
        ),
        ("owner.generation", Box::new(|p| p.owner.generation = 0)),
        (
            "export.handle",
            Box::new(|p| {
                p.export = ExportHandle::CudaIpc {
                    handle: vec![1; 63],
                }
            }),
        ),
        (
            "export.handle",
            Box::new(|p| {
                p.export = ExportHandle::CudaFabric {
                    handle: vec![1; 65],
                }
            }),
        ),
        (
            "export.agent_name",
            Box::new(|p| {
                p.export = ExportHandle::NixlAgent {
                    agent_name: String::new(),
                    metadata: vec![],
                }
            }),
        ),
        (
            "export.metadata",
            Box::new(|p| {
                p.export = ExportHandle::NixlAgent {
                    agent_name: "a".into(),
                    metadata: vec![0; MAX_NIXL_METADATA_BYTES + 1],
                }
            }),
        ),
        // A shm name on GPU memory cannot be opened as that memory.
        (
            "export",
            Box::new(|p| p.export = ExportHandle::HostShm { name: "/x".into() }),
        ),
    ]
}

fn host_rejection_cases() -> Vec<Case> {
    vec![
        (
            "location.host_id",
            Box::new(|p| {
                p.location = MemoryLocation::Host {
                    host_id: String::new(),
                }
            }),
        ),
        (
            "location.host_id",
            Box::new(|p| {
                p.location = MemoryLocation::Host {
                    host_id: "node\0a".into(),
                }
            }),
        ),
        (
            "export",
            Box::new(|p| {
                p.export = ExportHandle::CudaIpc {
                    handle: vec![1; 64],
                }
            }),
        ),
        (
            "export",
            Box::new(|p| {
                p.export = ExportHandle::CudaFabric {
                    handle: vec![1; 64],
                }
            }),
        ),
        (
            "export.name",
            Box::new(|p| {
                p.export = ExportHandle::HostShm {
                    name: "kvbank".into(),
                }
            }),
        ),
        (
            "export.name",
            Box::new(|p| p.export = ExportHandle::HostShm { name: "/".into() }),
        ),
        (
            "export.name",
            Box::new(|p| {
                p.export = ExportHandle::HostShm {
                    name: "/a/b".into(),
                }
            }),
        ),
        (
            "export.name",
            Box::new(|p| {
                p.export = ExportHandle::HostShm {
                    name: format!("/{}", "n".repeat(255)),
                }
            }),
        ),
    ]
}

#[test]
fn constructor_rejections_name_the_field() {
    for (field, edit) in rejection_cases() {
        let mut p = valid();
        edit(&mut p);
        assert_field(BankDescriptor::new(p), field);
    }
    for (field, edit) in host_rejection_cases() {
        let mut p = host_parts(layout(2), 1);
        edit(&mut p);
        assert_field(BankDescriptor::new(p), field);
    }
}

#[test]
fn longest_shm_name_is_accepted() {
    let mut p = host_parts(layout(2), 1);
    p.export = ExportHandle::HostShm {
        name: format!("/{}", "n".repeat(254)),
    };
    assert!(BankDescriptor::new(p).is_ok());
}

#[test]
fn decoder_rejections_name_the_field() {
    // Same rejections, but arriving as bytes with a matching checksum: the
    // decoder must run the constructor's checks, not trust the checksum.
    for (field, edit) in rejection_cases() {
        let mut p = valid();
        edit(&mut p);
        let bytes = encode_unvalidated(|v| *v = to_value(&rmp_serde::to_vec_named(&p).unwrap()));
        assert_decode_names(BankDescriptor::from_wire(&bytes), &format!("`{field}`"));
    }
    // A layout that breaks the head-partition rule, edited into the bytes.
    let bytes =
        encode_unvalidated(|v| *entry(entry(v, "layout"), "tp_size") = rmpv::Value::from(3u32));
    assert_decode_names(BankDescriptor::from_wire(&bytes), "`layout.tp_size`");
}

#[test]
fn checksum_detects_tampering() {
    let d = BankDescriptor::new(valid()).unwrap();
    let good = d.to_wire().unwrap();

    // A still-valid edit (more slots) without a new checksum.
    let mut v = to_value(&good);
    *entry(entry(&mut v, "parts"), "slot_count") = rmpv::Value::from(33u32);
    let e = assert_decode_names(
        BankDescriptor::from_wire(&from_value(&v)),
        "checksum mismatch in `bank_descriptor`",
    );
    assert!(
        e.to_string().contains(&format!("{:#018x}", d.checksum())),
        "{e}"
    );

    // A different owner generation: the stale-incarnation attack.
    let mut v = to_value(&good);
    *entry(entry(entry(&mut v, "parts"), "owner"), "generation") = rmpv::Value::from(2u64);
    assert_decode_names(
        BankDescriptor::from_wire(&from_value(&v)),
        "checksum mismatch",
    );

    // One flipped bit inside the IPC handle bytes.
    let mut v = to_value(&good);
    let handle = entry(entry(entry(&mut v, "parts"), "export"), "cuda_ipc");
    let rmpv::Value::Binary(bytes) = entry(handle, "handle") else {
        panic!("handle is not bin")
    };
    bytes[0] ^= 1;
    assert_decode_names(
        BankDescriptor::from_wire(&from_value(&v)),
        "checksum mismatch",
    );

    // The checksum itself edited.
    let mut v = to_value(&good);
    *entry(&mut v, "checksum") = rmpv::Value::from(d.checksum() ^ 1);
    assert_decode_names(
        BankDescriptor::from_wire(&from_value(&v)),
        "checksum mismatch",
    );

    // Untouched bytes still decode.
    assert_eq!(BankDescriptor::from_wire(&good).unwrap(), d);
}

#[test]
fn unknown_keys_are_ignored_outside_parts_and_fail_inside() {
    let d = BankDescriptor::new(valid()).unwrap();
    let mut v = to_value(&d.to_wire().unwrap());
    let rmpv::Value::Map(top) = &mut v else {
        panic!("not a map")
    };
    top.push(("future_top".into(), rmpv::Value::from(1)));
    assert_eq!(BankDescriptor::from_wire(&from_value(&v)).unwrap(), d);

    // A newer writer's extra field inside `parts`, checksummed by that writer.
    let bytes = encode_unvalidated(|parts| {
        let rmpv::Value::Map(m) = parts else {
            panic!("not a map")
        };
        m.push(("future_field".into(), rmpv::Value::from(7)));
    });
    assert_decode_names(BankDescriptor::from_wire(&bytes), "checksum mismatch");
}

#[test]
fn checksum_is_deterministic_and_content_bound() {
    let a = BankDescriptor::new(valid()).unwrap();
    let b = BankDescriptor::new(valid()).unwrap();
    assert_eq!(a.checksum(), b.checksum());
    let mut p = valid();
    p.owner = p.owner.next_generation();
    assert_ne!(BankDescriptor::new(p).unwrap().checksum(), a.checksum());
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = BankDescriptor::new(valid()).unwrap().to_wire().unwrap();
    bytes.push(0xc0);
    assert_decode_names(BankDescriptor::from_wire(&bytes), "1 trailing bytes");
}

#[test]
fn owner_lease_lifecycle() {
    let a = OwnerLease::fresh(Role::Decode);
    assert_eq!(a.generation, 1);
    let b = a.next_generation().next_generation();
    assert_eq!(b.generation, 3);
    assert_eq!(b.engine_id, a.engine_id);
    assert_ne!(OwnerLease::fresh(Role::Decode).engine_id, a.engine_id);
}
