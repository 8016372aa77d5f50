//! Records shared by the directory's unit and NATS tests.

use kv_descriptor::*;

use super::{DonorRecord, DonorRecordParts, NixlMemKind, NixlRankRegion};

pub(crate) fn manifest(owner: OwnerLease) -> BankManifest {
    let l = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
    let parts = (0..2)
        .map(|r| {
            BankDescriptor::new(BankParts {
                layout: l,
                tp_rank: r,
                location: MemoryLocation::Host {
                    host_id: "h".into(),
                },
                owner,
                export: ExportHandle::HostShm {
                    name: format!("/kvbank-dir-test-{r}"),
                },
                slot_count: 8,
                slot_bytes: l.rank_block_bytes() as u64,
            })
            .unwrap()
        })
        .collect();
    BankManifest::new(parts).unwrap()
}

pub(crate) fn parts(m: BankManifest, expires: u64) -> DonorRecordParts {
    DonorRecordParts {
        worker_key: "decode-0".into(),
        manifest: m,
        pin_endpoint: "unix:/tmp/kv-pin-decode-0.sock".into(),
        nixl_agent_name: Some("kv-nixl-decode-0".into()),
        nixl_agent_metadata: Some(vec![7u8; 64]),
        nixl_rank_regions: Some(
            (0..2)
                .map(|r| NixlRankRegion {
                    base_addr: 0x7f00_0000_0000 + r * 0x10_0000,
                    len: 0x10_0000,
                    mem: NixlMemKind::Dram,
                    device_id: 0,
                })
                .collect(),
        ),
        lease_expires_unix_ms: expires,
        published_unix_ms: 1_000,
    }
}

pub(crate) fn record(owner: OwnerLease, expires: u64) -> DonorRecord {
    DonorRecord::new(parts(manifest(owner), expires)).unwrap()
}
