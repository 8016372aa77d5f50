//! Rules of the donor record, the in-process directory, the reader cache
//! and [`crate::RemoteDonorDirectory`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kv_bank::{sealed_blocks, BankConfig, BankManager, StoreStatus};
use kv_descriptor::*;
use proptest::prelude::*;

use super::*;
use crate::{DonorDirectory, LocalDonorDirectory, RemoteDonorDirectory, ResolveError};

use super::tests_support::{manifest, parts, record};

fn field_of(e: &DonorRecordError) -> &'static str {
    match e {
        DonorRecordError::InvalidField { field, .. } => field,
        other => panic!("expected a field refusal, got {other:?}"),
    }
}

#[test]
fn record_round_trips_and_carries_the_manifest_owner() {
    let owner = OwnerLease::fresh(Role::Decode).next_generation();
    let r = record(owner, 5_000);
    assert_eq!(r.engine_id(), owner.engine_id);
    assert_eq!(r.generation(), 2);
    let bytes = r.to_wire().unwrap();
    assert_eq!(DonorRecord::decode(&bytes).unwrap(), r);
    // NIXL metadata travels as MessagePack bin (0xc4 <len>), not an array of ints.
    assert!(bytes.windows(2).any(|w| w == [0xc4, 64]));
    let none = DonorRecord::new(DonorRecordParts {
        nixl_agent_name: None,
        nixl_agent_metadata: None,
        nixl_rank_regions: None,
        ..parts(manifest(owner), 5_000)
    })
    .unwrap();
    assert_eq!(DonorRecord::decode(&none.to_wire().unwrap()).unwrap(), none);
}

/// `parts` whose NIXL rank regions (valid for `m`) went through `change`.
fn with_regions(
    m: &BankManifest,
    change: impl FnOnce(&mut Vec<NixlRankRegion>),
) -> DonorRecordParts {
    let mut p = parts(m.clone(), 5_000);
    let mut regions: Vec<NixlRankRegion> = m
        .parts()
        .iter()
        .enumerate()
        .map(|(r, d)| NixlRankRegion {
            base_addr: 0x1000 * (r as u64 + 1),
            len: d.region_bytes(),
            mem: NixlMemKind::Dram,
            device_id: 0,
        })
        .collect();
    assert!(DonorRecord::new(DonorRecordParts {
        nixl_rank_regions: Some(regions.clone()),
        ..p.clone()
    })
    .is_ok());
    change(&mut regions);
    p.nixl_rank_regions = Some(regions);
    p
}

#[test]
fn bad_records_are_refused_naming_the_field() {
    let owner = OwnerLease::fresh(Role::Decode);
    let m = manifest(owner);
    let cases: Vec<(DonorRecordParts, &str)> = vec![
        (
            DonorRecordParts {
                worker_key: String::new(),
                ..parts(m.clone(), 5_000)
            },
            "worker_key",
        ),
        (
            DonorRecordParts {
                worker_key: "k".repeat(257),
                ..parts(m.clone(), 5_000)
            },
            "worker_key",
        ),
        (
            DonorRecordParts {
                pin_endpoint: String::new(),
                ..parts(m.clone(), 5_000)
            },
            "pin_endpoint",
        ),
        (
            DonorRecordParts {
                nixl_agent_metadata: Some(vec![0; MAX_NIXL_METADATA_BYTES + 1]),
                ..parts(m.clone(), 5_000)
            },
            "nixl_agent_metadata",
        ),
        (
            DonorRecordParts {
                nixl_agent_name: Some(String::new()),
                ..parts(m.clone(), 5_000)
            },
            "nixl_agent_name",
        ),
        (
            DonorRecordParts {
                nixl_agent_name: Some("n".repeat(MAX_NIXL_AGENT_NAME_BYTES + 1)),
                ..parts(m.clone(), 5_000)
            },
            "nixl_agent_name",
        ),
        (
            DonorRecordParts {
                nixl_agent_name: None,
                ..parts(m.clone(), 5_000)
            },
            "nixl_agent_name",
        ),
        (
            DonorRecordParts {
                nixl_agent_metadata: None,
                ..parts(m.clone(), 5_000)
            },
            "nixl_agent_metadata",
        ),
        (parts(m.clone(), 1_000), "lease_expires_unix_ms"),
        (
            DonorRecordParts {
                nixl_agent_name: None,
                nixl_agent_metadata: None,
                ..parts(m.clone(), 5_000)
            },
            "nixl_rank_regions",
        ),
        (
            with_regions(&m, |r| {
                r.pop();
            }),
            "nixl_rank_regions",
        ),
        (
            with_regions(&m, |r| r[1].base_addr = 0),
            "nixl_rank_regions.base_addr",
        ),
        (
            with_regions(&m, |r| r[0].len = m.parts()[0].region_bytes() - 1),
            "nixl_rank_regions.len",
        ),
        (
            with_regions(&m, |r| r[1].mem = NixlMemKind::Vram),
            "nixl_rank_regions.mem",
        ),
        (
            with_regions(&m, |r| r[0].device_id = 1),
            "nixl_rank_regions.device_id",
        ),
    ];
    for (p, want) in cases {
        assert_eq!(field_of(&DonorRecord::new(p).unwrap_err()), want);
    }
    // On the wire: an engine id that is not the manifest owner's, and a
    // generation that is not the manifest's, are refused by name.
    let r = record(owner, 5_000);
    let mut v: rmpv::Value = rmp_serde::from_slice(&r.to_wire().unwrap()).unwrap();
    let rmpv::Value::Map(map) = &mut v else {
        panic!("a record encodes as a map")
    };
    for (k, val) in map.iter_mut() {
        if k.as_str() == Some("generation") {
            *val = rmpv::Value::from(9u64);
        }
    }
    let bytes = rmp_serde::to_vec(&v).unwrap();
    let e = DonorRecord::decode(&bytes).unwrap_err();
    assert!(
        matches!(&e, DonorRecordError::Decode(d) if d.to_string().contains("donor_record.generation")),
        "{e}"
    );
    // Oversized input is refused before it is decoded.
    let big = vec![0u8; MAX_DONOR_RECORD_BYTES + 1];
    assert_eq!(
        DonorRecord::decode(&big).unwrap_err(),
        DonorRecordError::TooLarge {
            size: MAX_DONOR_RECORD_BYTES + 1,
            limit: MAX_DONOR_RECORD_BYTES
        }
    );
}

/// An undecodable record names its type once (the decoder's message
/// already starts with "cannot decode `donor_record`").
#[test]
fn undecodable_records_name_the_type_once() {
    for bytes in [&b"\xff\xfe garbage"[..], b""] {
        let text = DonorRecord::decode(bytes).unwrap_err().to_string();
        assert_eq!(text.matches("donor_record").count(), 1, "{text}");
        assert!(text.starts_with("cannot decode `donor_record`: "), "{text}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// The decoder never panics on arbitrary bytes.
    #[test]
    fn record_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = DonorRecord::decode(&bytes);
    }

    /// Nor on a valid record with bytes changed or cut: it decodes to a
    /// valid record or is refused.
    #[test]
    fn record_decoder_survives_mutations(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = record(OwnerLease::fresh(Role::Decode), 5_000).to_wire().unwrap();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        let n = cut.index(bytes.len() + 1);
        if let Ok(r) = DonorRecord::decode(&bytes[..n]) {
            prop_assert_eq!(directory_key(r.engine_id()), directory_key(r.manifest().owner().engine_id));
        }
    }
}

#[test]
fn cache_never_uses_a_lapsed_lease_or_an_older_generation() {
    let g1 = OwnerLease::fresh(Role::Decode);
    let g2 = g1.next_generation();
    let mut c = DonorCache::new();
    assert_eq!(
        c.apply(DirectoryChange::Put(record(g1, 5_000))),
        CacheUpdate::NewGeneration {
            engine: g1.engine_id,
            generation: 1
        }
    );
    assert_eq!(c.get(g1.engine_id, 4_999).unwrap().generation(), 1);
    // `live` counts what `get` resolves: the lapsed record is held, not live.
    assert_eq!((c.len(), c.live(4_999), c.live(5_000)), (1, 1, 0));
    assert_eq!(
        c.get(g1.engine_id, 5_000).unwrap_err(),
        ResolveError::LeaseLapsed {
            donor: g1.engine_id,
            expired_unix_ms: 5_000,
            now_unix_ms: 5_000
        }
    );
    // Renewal of the same generation extends the lease.
    assert_eq!(
        c.apply(DirectoryChange::Put(record(g1, 9_000))),
        CacheUpdate::Renewed(g1.engine_id)
    );
    assert!(c.get(g1.engine_id, 5_000).is_ok());
    assert_eq!(
        c.apply(DirectoryChange::Put(record(g2, 9_000))),
        CacheUpdate::NewGeneration {
            engine: g1.engine_id,
            generation: 2
        }
    );
    // A late put of generation 1 is refused and changes nothing, also after a delete.
    let stale = ResolveError::StaleGeneration {
        donor: g1.engine_id,
        generation: 1,
        newest_seen: 2,
    };
    assert_eq!(
        c.apply(DirectoryChange::Put(record(g1, 20_000))),
        CacheUpdate::Ignored(stale.clone())
    );
    assert_eq!(c.get(g1.engine_id, 6_000).unwrap().generation(), 2);
    assert_eq!(
        c.apply(DirectoryChange::Delete(g1.engine_id)),
        CacheUpdate::Deleted(g1.engine_id)
    );
    assert_eq!(
        c.get(g1.engine_id, 6_000).unwrap_err(),
        ResolveError::UnknownDonor {
            donor: g1.engine_id
        }
    );
    assert_eq!(
        c.apply(DirectoryChange::Put(record(g1, 20_000))),
        CacheUpdate::Ignored(stale)
    );
    assert!(c.is_empty());
}

#[tokio::test]
async fn in_process_directory_serves_current_entries_then_changes_to_every_watcher() {
    let d = InProcessDirectory::new();
    let owner = OwnerLease::fresh(Role::Decode);
    let r = record(owner, 5_000);
    d.put(&r).await.unwrap();
    let mut early = d.watch().await.unwrap();
    let mut late = d.watch().await.unwrap();
    assert_eq!(early.try_next(), Some(DirectoryChange::Put(r.clone())));
    assert_eq!(late.try_next(), Some(DirectoryChange::Put(r.clone())));
    d.delete(owner.engine_id).await.unwrap();
    assert_eq!(
        early.try_next(),
        Some(DirectoryChange::Delete(owner.engine_id))
    );
    assert_eq!(
        late.try_next(),
        Some(DirectoryChange::Delete(owner.engine_id))
    );
    // Garbage, or a record under another engine's key, is refused by name.
    d.put_raw("not-a-record", vec![0xc1]);
    assert!(
        matches!(early.try_next(), Some(DirectoryChange::Refused { key, .. }) if key == "not-a-record")
    );
    d.put_raw(&directory_key(EngineId::fresh()), r.to_wire().unwrap());
    match early.try_next() {
        Some(DirectoryChange::Refused { error, .. }) => assert_eq!(field_of(&error), "engine_id"),
        other => panic!("{other:?}"),
    }
    assert_eq!(early.try_next(), None);
}

/// A TP2 host bank holding `blocks` 4-token blocks, and its drained events.
fn donor_bank(name: &str, blocks: usize) -> (Arc<BankManager>, Vec<KvEvent>, Vec<SequenceHash>) {
    let layout = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
    let rbb = layout.rank_block_bytes();
    let config = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 16 * 2 * rbb as u64);
    let bank = Arc::new(BankManager::new_host_shm(config, name).unwrap());
    let tokens: Vec<u32> = (0..(blocks * 4) as u32).collect();
    let b = sealed_blocks(None, &tokens, 4);
    let store = bank.store(None, &b).unwrap();
    for rank in 0..2 {
        for index in 0..store.entries.len() {
            bank.write_pending(store.store_id, rank, index, &vec![rank as u8; rbb])
                .unwrap();
        }
    }
    bank.ack(store.store_id, 0).unwrap();
    assert_eq!(bank.ack(store.store_id, 1).unwrap(), StoreStatus::Ready);
    let events = bank.drain_events();
    (bank, events, b.iter().map(|x| x.sequence_hash).collect())
}

#[test]
fn remote_directory_resolves_as_the_local_one_from_manifest_and_events() {
    let (bank, events, hashes) = donor_bank("glue-dir-eq", 5);
    let engine = bank.owner().engine_id;
    let endpoint = "unix:/tmp/kv-pin-eq.sock";
    let local = LocalDonorDirectory::new();
    local.insert(bank.clone(), endpoint);
    let now = Arc::new(AtomicU64::new(2_000));
    let clock = now.clone();
    let remote = RemoteDonorDirectory::with_clock(move || clock.load(Ordering::SeqCst));
    // Nothing known yet.
    assert_eq!(
        remote.resolve(engine, &hashes).unwrap_err(),
        ResolveError::UnknownDonor { donor: engine }
    );
    let rec = DonorRecord::new(DonorRecordParts {
        worker_key: "decode-eq".into(),
        manifest: bank.manifest().clone(),
        pin_endpoint: endpoint.into(),
        nixl_agent_name: None,
        nixl_agent_metadata: None,
        nixl_rank_regions: None,
        lease_expires_unix_ms: 10_000,
        published_unix_ms: 1_000,
    })
    .unwrap();
    remote.apply_directory(DirectoryChange::Put(rec.clone()));
    // Manifest known, slots not yet: the first block is missing.
    assert_eq!(
        remote.resolve(engine, &hashes).unwrap_err(),
        ResolveError::BlockGone {
            index: 0,
            hash: hashes[0]
        }
    );
    let changed: usize = events.iter().map(|e| remote.ingest_event(e)).sum();
    assert_eq!(changed, 5);
    assert_eq!(
        remote.resolve(engine, &hashes).unwrap(),
        local.resolve(engine, &hashes).unwrap()
    );
    assert_eq!(
        remote.resolve(engine, &hashes[1..3]).unwrap(),
        local.resolve(engine, &hashes[1..3]).unwrap()
    );
    // Removed drops one block.
    let removed = KvEvent {
        event_id: 99,
        data: KvEventData::Removed {
            sequence_hashes: vec![hashes[3]],
        },
        ..events[0].clone()
    };
    assert_eq!(remote.ingest_event(&removed), 1);
    assert_eq!(
        remote.resolve(engine, &hashes).unwrap_err(),
        ResolveError::BlockGone {
            index: 3,
            hash: hashes[3]
        }
    );
    // Lease lapse: never used.
    now.store(10_000, Ordering::SeqCst);
    assert!(matches!(
        remote.resolve(engine, &hashes[..1]),
        Err(ResolveError::LeaseLapsed { .. })
    ));
    now.store(2_000, Ordering::SeqCst);
    // Cleared resets the slot map.
    let cleared = KvEvent {
        data: KvEventData::Cleared,
        ..events[0].clone()
    };
    assert_eq!(remote.ingest_event(&cleared), 4);
    assert!(matches!(
        remote.resolve(engine, &hashes[..1]),
        Err(ResolveError::BlockGone { index: 0, .. })
    ));
    // Events of another tier, or blocks without a slot, teach nothing.
    let device = KvEvent {
        tier: StorageTier::Device,
        ..events[0].clone()
    };
    assert_eq!(remote.ingest_event(&device), 0);
}

#[test]
fn remote_directory_resets_slots_on_a_new_generation() {
    let g1 = OwnerLease::fresh(Role::Decode);
    let remote = RemoteDonorDirectory::with_clock(|| 2_000);
    remote.apply_directory(DirectoryChange::Put(record(g1, 10_000)));
    let h = SequenceHash(42);
    let stored = KvEvent {
        publisher: g1.engine_id,
        event_id: 1,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(1),
        tp_size: 2,
        tier: StorageTier::RetainedGpuDirect,
        data: KvEventData::Stored {
            parent: None,
            blocks: vec![StoredBlock {
                sequence_hash: h,
                token_hash: TokenBlockHash(1),
                slot: Some(3),
            }],
        },
    };
    assert_eq!(remote.ingest_event(&stored), 1);
    assert_eq!(
        remote.resolve(g1.engine_id, &[h]).unwrap().slot_ids,
        vec![3]
    );
    // A renewal keeps the slots; a new generation drops them.
    remote.apply_directory(DirectoryChange::Put(record(g1, 12_000)));
    assert_eq!(
        remote.resolve(g1.engine_id, &[h]).unwrap().slot_ids,
        vec![3]
    );
    remote.apply_directory(DirectoryChange::Put(record(g1.next_generation(), 12_000)));
    assert_eq!(
        remote.resolve(g1.engine_id, &[h]).unwrap_err(),
        ResolveError::BlockGone { index: 0, hash: h }
    );
    // A stale record afterwards is refused and does not bring generation 1 back.
    assert!(matches!(
        remote.apply_directory(DirectoryChange::Put(record(g1, 20_000))),
        CacheUpdate::Ignored(ResolveError::StaleGeneration {
            generation: 1,
            newest_seen: 2,
            ..
        })
    ));
    remote.forget(g1.engine_id);
    assert_eq!(
        remote.resolve(g1.engine_id, &[h]).unwrap_err(),
        ResolveError::UnknownDonor {
            donor: g1.engine_id
        }
    );
}

#[tokio::test]
async fn remote_directory_follows_a_watch() {
    let d = InProcessDirectory::new();
    let owner = OwnerLease::fresh(Role::Decode);
    let remote = Arc::new(RemoteDonorDirectory::with_clock(|| 2_000));
    let task = remote.follow(d.watch().await.unwrap());
    d.put(&record(owner, 10_000)).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    // Known once followed: resolving no block succeeds with the manifest.
    loop {
        match remote.resolve(owner.engine_id, &[]) {
            Ok(r) => {
                assert_eq!(r.manifest.owner(), &owner);
                assert_eq!(r.control_endpoint, "unix:/tmp/kv-pin-decode-0.sock");
                break;
            }
            Err(ResolveError::UnknownDonor { .. }) if std::time::Instant::now() < deadline => {
                tokio::task::yield_now().await
            }
            Err(e) => panic!("{e}"),
        }
    }
    task.abort();
}

/// A record without a NIXL agent encodes byte for byte as before the
/// `nixl_agent_name` field existed (the xxh3 of its bytes, taken from the
/// encoder before that change): readers of either version agree.
#[test]
fn a_record_without_nixl_keeps_its_encoding() {
    let owner = OwnerLease {
        engine_id: EngineId(uuid::Uuid::from_u128(0x0123_4567_89ab_cdef)),
        role: Role::Decode,
        generation: 3,
    };
    let r = DonorRecord::new(DonorRecordParts {
        nixl_agent_name: None,
        nixl_agent_metadata: None,
        nixl_rank_regions: None,
        ..parts(manifest(owner), 5_000)
    })
    .unwrap();
    let bytes = r.to_wire().unwrap();
    assert_eq!(
        (bytes.len(), xxhash_rust::xxh3::xxh3_64(&bytes)),
        (816, 0x6a23_3bf0_59bf_93ba),
        "snapshot"
    );
}

/// A record a donor published before `nixl_rank_regions` existed (NIXL
/// agent name and metadata, no regions; bytes written by that encoder)
/// still decodes, with no regions; the same record encodes to the same
/// bytes today, so readers of either version agree.
#[test]
fn a_record_from_before_nixl_rank_regions_still_decodes() {
    let old: &[u8] = include_bytes!("snapshots/donor_record_nixl_agent_only.msgpack");
    let r = DonorRecord::decode(old).unwrap();
    assert_eq!(r.nixl_agent_name(), Some("kv-nixl-decode-0"));
    assert_eq!(r.nixl_agent_metadata(), Some([7u8; 64].as_slice()));
    assert_eq!(r.nixl_rank_regions(), None);
    assert_eq!(r.generation(), 3);
    assert_eq!(r.to_wire().unwrap(), old);
    // With regions: they travel, rank by rank.
    let p = r.to_parts();
    let regions: Vec<NixlRankRegion> = r
        .manifest()
        .parts()
        .iter()
        .map(|d| NixlRankRegion {
            base_addr: 0x7f00_0000_0000 + u64::from(d.tp_rank()) * 0x10_0000,
            len: d.region_bytes(),
            mem: NixlMemKind::Dram,
            device_id: 0,
        })
        .collect();
    let with = DonorRecord::new(DonorRecordParts {
        nixl_rank_regions: Some(regions.clone()),
        ..p
    })
    .unwrap();
    let decoded = DonorRecord::decode(&with.to_wire().unwrap()).unwrap();
    assert_eq!(decoded.nixl_rank_regions(), Some(regions.as_slice()));
    assert_eq!(decoded, with);
}
