//! Our KV events as Dynamo's router reads them: `dynamo-kv-router` 1.6.1
//! `RouterEvent` decodes `DynamoRouterEvent` (named MessagePack and JSON) to
//! the same worker, tier, event id and hashes; the retained tier is refused.

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEventData, LocalBlockHash, RouterEvent,
    StorageTier as DynamoTier,
};
use kv_descriptor::*;
use kv_lookup::WorkerKey;
use kv_router_glue::dynamo_events::DynamoRouterEvent;

fn event(tier: StorageTier, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher: EngineId(uuid::Uuid::from_u128(0xE1E1)),
        event_id: 41,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(5),
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
            parent: Some(seq[0]),
            blocks: (1..3)
                .map(|i| StoredBlock {
                    sequence_hash: seq[i],
                    token_hash: tok[i],
                    slot: None,
                })
                .collect(),
        },
        KvEventData::Removed {
            sequence_hashes: vec![seq[2], seq[1]],
        },
        KvEventData::Cleared,
    ]
}

fn check(ours: &KvEvent, theirs: &RouterEvent, tier: DynamoTier) {
    assert_eq!(theirs.worker_id, 9001);
    assert_eq!(theirs.storage_tier, tier);
    assert_eq!(theirs.event.event_id, ours.event_id);
    assert_eq!(theirs.event.dp_rank, 0);
    match (&ours.data, &theirs.event.data) {
        (KvEventData::Stored { parent, blocks }, KvCacheEventData::Stored(s)) => {
            assert_eq!(
                s.parent_hash,
                parent.map(|p| ExternalSequenceBlockHash(p.0))
            );
            assert_eq!(s.blocks.len(), blocks.len());
            for (a, b) in blocks.iter().zip(&s.blocks) {
                assert_eq!(b.block_hash, ExternalSequenceBlockHash(a.sequence_hash.0));
                assert_eq!(b.tokens_hash, LocalBlockHash(a.token_hash.0));
                assert_eq!(b.mm_extra_info, None);
            }
        }
        (KvEventData::Removed { sequence_hashes }, KvCacheEventData::Removed(r)) => {
            let want: Vec<_> = sequence_hashes
                .iter()
                .map(|h| ExternalSequenceBlockHash(h.0))
                .collect();
            assert_eq!(r.block_hashes, want);
        }
        (KvEventData::Cleared, KvCacheEventData::Cleared) => {}
        (a, b) => panic!("ours {a:?} read as {b:?}"),
    }
}

#[test]
fn dynamo_router_reads_our_events_in_the_tiers_it_knows() {
    let tiers = [
        (StorageTier::Device, DynamoTier::Device),
        (StorageTier::HostPinned, DynamoTier::HostPinned),
        (StorageTier::Disk, DynamoTier::Disk),
        (StorageTier::External, DynamoTier::External),
    ];
    for (ours_tier, theirs_tier) in tiers {
        for data in datas() {
            let ours = event(ours_tier, data);
            let d = DynamoRouterEvent::from_kv_event(&ours, WorkerKey(9001));
            let msgpack: RouterEvent = rmp_serde::from_slice(&d.to_msgpack().unwrap()).unwrap();
            check(&ours, &msgpack, theirs_tier);
            let json: RouterEvent =
                serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
            check(&ours, &json, theirs_tier);
            // And Dynamo's own encoding reads back as ours.
            let back: DynamoRouterEvent =
                rmp_serde::from_slice(&rmp_serde::to_vec_named(&msgpack).unwrap()).unwrap();
            assert_eq!(back, d);
        }
    }
}

#[test]
fn dynamo_1_6_1_refuses_the_retained_tier_instead_of_misfiling_it() {
    for data in datas() {
        let ours = event(StorageTier::RetainedGpuDirect, data);
        let d = DynamoRouterEvent::from_kv_event(&ours, WorkerKey(9001));
        let bytes = d.to_msgpack().unwrap();
        let err = rmp_serde::from_slice::<RouterEvent>(&bytes).unwrap_err();
        assert!(err.to_string().contains("retained_gpu_direct"), "{err}");
        let json = serde_json::to_string(&d).unwrap();
        assert!(serde_json::from_str::<RouterEvent>(&json).is_err());
        // Our own readers know it.
        assert_eq!(
            rmp_serde::from_slice::<DynamoRouterEvent>(&bytes).unwrap(),
            d
        );
    }
}
