//! A donor agent's NIXL agent, from its directory record to the target's
//! NIXL agent: published name + metadata (bounded, refused naming the field
//! when over), resolved through the target's directory cache and loaded with
//! the real NIXL runtime (`load_remote_md`), a record naming another agent
//! refused.
//!
//! Skips (printing why) when `libnixl_capi.so` is not loadable (run with the
//! environment of `cargo xtask install`), except under `CI=true`, where a
//! missing runtime fails the test.

mod agents_common;

use std::sync::Arc;
use std::time::Duration;

use agents_common::*;
use kv_descriptor::MAX_NIXL_METADATA_BYTES;
use kv_router_glue::*;
use kv_transfer::nixl::{runtime_status, NixlAgent};
use kv_transfer::DeliveryControl;

fn runtime_or_skip() -> bool {
    match runtime_status() {
        Ok(()) => true,
        Err(e) if kv_transfer::ci_requires() => panic!("CI and {e}"),
        Err(e) => {
            println!("SKIP a_donor_publishes_its_nixl_agent_and_the_target_loads_it: {e}");
            false
        }
    }
}

#[test]
fn a_donor_publishes_its_nixl_agent_and_the_target_loads_it() {
    if !runtime_or_skip() {
        return;
    }
    serial(|| async {
        let p = Planes::new();
        let (ep, dir) = (p.endpoint("d0"), &p.dir);
        let donor = p.donor("decode-0", &ep).await;
        let engine = donor.bank().owner().engine_id;
        let (target, _rows) = target(dir.clone()).await;
        let target_nixl = NixlAgent::new("kv-agents-nixl-target").unwrap();

        // No NIXL agent published yet: a typed refusal (recompute).
        match target.load_donor_nixl(engine, &target_nixl) {
            Err(AgentError::NoNixlAgent { donor: d }) => assert_eq!(d, engine),
            other => panic!("expected NoNixlAgent, got {other:?}"),
        }

        // The donor's NIXL agent registers every rank of the bank.
        let donor_nixl = NixlAgent::new("kv-agents-nixl-donor").unwrap();
        register_ranks(&donor_nixl, &donor);
        let metadata = donor_nixl.metadata().unwrap();
        assert!(!metadata.is_empty() && metadata.len() <= MAX_NIXL_METADATA_BYTES);

        // Oversized metadata or an empty name: refused naming the field, the
        // record keeps publishing none.
        for (name, md, field) in [
            (
                donor_nixl.name().to_string(),
                vec![0u8; MAX_NIXL_METADATA_BYTES + 1],
                "nixl_agent_metadata",
            ),
            (String::new(), metadata.clone(), "nixl_agent_name"),
        ] {
            match donor.publish_nixl_agent(name, md).await {
                Err(AgentError::Record(DonorRecordError::InvalidField { field: f, .. })) => {
                    assert_eq!(f, field)
                }
                other => panic!("expected a refusal naming {field}, got {other:?}"),
            }
            let r = donor.record(unix_now_ms()).unwrap();
            assert_eq!((r.nixl_agent_name(), r.nixl_agent_metadata()), (None, None));
            assert_eq!(r.nixl_rank_regions(), None);
        }

        // Published: the record carries both; the target resolves the donor
        // from its directory cache and its NIXL agent loads the metadata.
        donor
            .publish_nixl_agent(donor_nixl.name().to_string(), metadata.clone())
            .await
            .unwrap();
        let r = donor.record(unix_now_ms()).unwrap();
        assert_eq!(r.nixl_agent_name(), Some("kv-agents-nixl-donor"));
        assert_eq!(r.nixl_agent_metadata(), Some(metadata.as_slice()));
        // With the memory that agent registered, rank by rank.
        let want: Vec<NixlRankRegion> = (0..TP)
            .map(|r| {
                let m = donor.bank().rank(r).unwrap().memory().clone();
                NixlRankRegion {
                    base_addr: m.base_addr(),
                    len: m.len() as u64,
                    mem: NixlMemKind::Dram,
                    device_id: 0,
                }
            })
            .collect();
        assert!(want.iter().all(|w| w.base_addr != 0));
        assert_eq!(r.nixl_rank_regions(), Some(want.as_slice()));
        assert_eq!(
            target.load_donor_nixl(engine, &target_nixl).unwrap(),
            "kv-agents-nixl-donor"
        );

        // A record whose name is not the metadata's agent is not used.
        donor
            .publish_nixl_agent("kv-agents-nixl-other".into(), metadata)
            .await
            .unwrap();
        match target.load_donor_nixl(engine, &target_nixl) {
            Err(AgentError::NixlAgentMismatch { published, loaded }) => {
                assert_eq!(
                    (published.as_str(), loaded.as_str()),
                    ("kv-agents-nixl-other", "kv-agents-nixl-donor")
                );
            }
            other => panic!("expected NixlAgentMismatch, got {other:?}"),
        }
        donor.close(Duration::ZERO).await.unwrap();
    });
}

/// Registers every rank of `donor`'s bank with `agent` (what a donor does
/// before it publishes its NIXL agent).
fn register_ranks(agent: &NixlAgent, donor: &DonorAgent) {
    for r in 0..TP {
        agent
            .register(donor.bank().rank(r).unwrap().memory().as_ref())
            .unwrap();
    }
}

/// A target executor on a NIXL backend over `agent`: TP host rows, each
/// registered with `agent` (NIXL READs land only in registered memory).
async fn nixl_target(
    dir: Arc<dyn DirectoryPlane>,
    agent: &Arc<NixlAgent>,
) -> (TargetAgent, Vec<Arc<kv_transfer::HostBuffer>>) {
    use kv_bank::{BankMemory, DestinationPool};
    let rows: Vec<Arc<kv_transfer::HostBuffer>> = (0..TP)
        .map(|_| Arc::new(kv_transfer::HostBuffer::zeroed(ROWS as usize * rbb()).unwrap()))
        .collect();
    for r in &rows {
        agent.register(r.as_ref()).unwrap();
    }
    let backend =
        kv_transfer::nixl::NixlBackend::new(agent.clone(), kv_transfer::nixl::NixlMode::Runs);
    let exec = FetchExecutor::new(
        layout(),
        DestinationPool::new(ROWS),
        rows.iter()
            .map(|b| b.clone() as Arc<dyn BankMemory>)
            .collect(),
        ROWS,
        Arc::new(backend),
    )
    .unwrap();
    (TargetAgent::connect(exec, dir, None).await.unwrap(), rows)
}

#[test]
fn a_target_reads_the_pinned_slots_over_nixl_and_refuses_a_stale_or_unknown_donor() {
    if !runtime_or_skip() {
        return;
    }
    serial(|| async {
        let p = Planes::new();
        let (ep, plane, dir) = (p.endpoint("d0"), &p.plane, &p.dir);
        let target_nixl = Arc::new(NixlAgent::new("kv-nixl-fetch-target").unwrap());
        let (tgt, rows) = nixl_target(dir.clone(), &target_nixl).await;
        let target_id = kv_descriptor::EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;

        let donor = p.donor("decode-0", &ep).await;
        let (h, env) = store_and_advise(&mut router, &donor, target_id).await;
        let hint = env.fetch_gpu_actions().unwrap().remove(0);

        // No NIXL agent in the record yet: refused before anything is pinned.
        match tgt.fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new()) {
            Err(AgentError::NoNixlAgent { donor: d }) => assert_eq!(d, hint.donor_engine_id),
            other => panic!("expected NoNixlAgent, got {other:?}"),
        }

        let donor_nixl = NixlAgent::new("kv-nixl-fetch-donor").unwrap();
        register_ranks(&donor_nixl, &donor);
        donor
            .publish_nixl_agent(donor_nixl.name().into(), donor_nixl.metadata().unwrap())
            .await
            .unwrap();

        // A record naming the agent but not its rank regions (a donor
        // from before `nixl_rank_regions`): refused typed before the agent
        // is loaded or anything pinned.
        let published = donor.record(unix_now_ms()).unwrap();
        let old = DonorRecord::new(DonorRecordParts {
            nixl_rank_regions: None,
            ..published.to_parts()
        })
        .unwrap();
        dir.put(&old).await.unwrap();
        match tgt.fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new()) {
            Err(AgentError::NoNixlRegions { donor: d }) => assert_eq!(d, hint.donor_engine_id),
            other => panic!("expected NoNixlRegions, got {other:?}"),
        }
        dir.put(&published).await.unwrap();

        // The read, addressed from the record alone: every fetched row
        // holds the donor's bytes, by NIXL.
        let out = tgt
            .fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new())
            .unwrap();
        assert_eq!(out.fetched, h[hint.fetch_from as usize..].to_vec());
        assert_eq!(out.fetched.len(), BLOCKS);
        assert_eq!(out.report.counters.backend, "nixl");
        assert_eq!(
            out.report.counters.bytes,
            (BLOCKS * TP as usize * rbb()) as u64
        );
        assert_rows_hold(&rows, &out);
        drop(out);

        // A hint of another bank generation (a stale manifest) is refused
        // before the donor is pinned or read.
        let mut stale = hint.clone();
        stale.bank_generation += 1;
        let stale_env = kv_descriptor::HintEnvelope::fetch_gpu("m-stale", "a0", &stale).unwrap();
        match tgt.fetch_nixl(&stale_env, &h, &target_nixl, &DeliveryControl::new()) {
            Err(AgentError::Fetch(FetchError::StaleGeneration { hint: g, manifest })) => {
                assert_eq!(
                    (g, manifest),
                    (hint.bank_generation + 1, hint.bank_generation)
                )
            }
            other => panic!("expected StaleGeneration, got {other:?}"),
        }

        let report = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(report.pin_stats.granted, 1, "one NIXL fetch, one pin");
        assert_eq!(report.pin_stats.released, 1);
        assert_eq!(tgt.executor().backend_in_flight(), 0);
        // A closed donor's record is gone: unknown, recompute.
        match tgt.fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new()) {
            Err(AgentError::Resolve(_)) => {}
            other => panic!("expected a Resolve refusal, got {other:?}"),
        }
    });
}

/// A record whose rank regions are registered with the donor's agent but
/// swapped (rank 0 reads rank 1's memory: same agent, kind and length, so
/// nothing before the READ can tell) must not complete with those bytes:
/// the target checks every block against the checksums the donor's pin
/// grant carries and falls back at `verify`, no row taken.
#[test]
fn a_registered_but_wrong_nixl_address_falls_back_at_verify() {
    if !runtime_or_skip() {
        return;
    }
    serial(|| async {
        let p = Planes::new();
        let (ep, plane, dir) = (p.endpoint("d0"), &p.plane, &p.dir);
        let target_nixl = Arc::new(NixlAgent::new("kv-nixl-wrong-target").unwrap());
        let (tgt, rows) = nixl_target(dir.clone(), &target_nixl).await;
        let target_id = kv_descriptor::EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let donor = p.donor("decode-0", &ep).await;
        let (h, env) = store_and_advise(&mut router, &donor, target_id).await;
        let donor_nixl = NixlAgent::new("kv-nixl-wrong-donor").unwrap();
        register_ranks(&donor_nixl, &donor);
        donor
            .publish_nixl_agent(donor_nixl.name().into(), donor_nixl.metadata().unwrap())
            .await
            .unwrap();
        let good = donor.record(unix_now_ms()).unwrap();
        let mut swapped = good.nixl_rank_regions().unwrap().to_vec();
        swapped.swap(0, 1);
        let wrong = DonorRecord::new(DonorRecordParts {
            nixl_rank_regions: Some(swapped),
            ..good.to_parts()
        })
        .unwrap();
        dir.put(&wrong).await.unwrap();

        match tgt.fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new()) {
            Err(AgentError::Fetch(FetchError::Fallback {
                stage: "verify",
                cause,
            })) => {
                assert_eq!(cause.label(), "block_checksum", "{cause}");
                match cause {
                    FallbackCause::BlockChecksum(BlockChecksumError::Mismatch {
                        rank,
                        block,
                        ..
                    }) => assert_eq!((rank, block), (0, 0)),
                    other => panic!("expected a rank 0 block 0 mismatch, got {other:?}"),
                }
            }
            Ok(out) => panic!("wrong bytes completed as a fetch: {:?}", out.target_blocks),
            Err(e) => panic!("expected a fallback at verify, got {e:?}"),
        }
        assert_eq!(
            tgt.executor().pool().free_blocks(),
            ROWS as usize,
            "no row taken"
        );
        assert_eq!(tgt.executor().backend_in_flight(), 0);

        // The donor's own record: the same fetch completes, bytes checked.
        dir.put(&good).await.unwrap();
        let out = tgt
            .fetch_nixl(&env, &h, &target_nixl, &DeliveryControl::new())
            .unwrap();
        assert_rows_hold(&rows, &out);
        drop(out);
        let report = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            (report.pin_stats.granted, report.pin_stats.released),
            (2, 2)
        );
    });
}

/// `RemoteDonor::open_nixl` binds each rank's NIXL region to its manifest
/// part before anything is pinned (no NIXL runtime needed).
#[test]
fn open_nixl_refuses_regions_that_are_not_the_manifest_parts() {
    serial(|| async {
        let p = Planes::new();
        let ep = p.endpoint("d0");
        let donor = p.donor("decode-0", &ep).await;
        let manifest = donor.bank().manifest().clone();
        let region = |agent: &str, len: u64, kind| kv_transfer::NixlRemoteRegion {
            agent_name: agent.into(),
            base_addr: 0x1000,
            len,
            kind,
        };
        let full = manifest.parts()[0].region_bytes();
        let host = kv_bank::MemoryKind::Host;
        let ok = || vec![region("d", full, host); TP as usize];
        assert!(RemoteDonor::open_nixl(manifest.clone(), ok(), &ep).is_ok());
        let cases: [(Vec<kv_transfer::NixlRemoteRegion>, u32, &str); 3] = [
            (
                vec![region("d", full, host), region("e", full, host)],
                1,
                "agent_name",
            ),
            (
                vec![
                    region("d", full, host),
                    region("d", full, kv_bank::MemoryKind::Cuda { ordinal: 0 }),
                ],
                1,
                "kind",
            ),
            (
                vec![region("d", full - 1, host), region("d", full, host)],
                0,
                "len",
            ),
        ];
        for (regions, want_rank, want_field) in cases {
            match RemoteDonor::open_nixl(manifest.clone(), regions, &ep) {
                Err(RemoteDonorError::MappingMismatch { rank, field, .. }) => {
                    assert_eq!((rank, field), (want_rank, want_field))
                }
                other => panic!("expected a {want_field} mismatch, got {other:?}"),
            }
        }
        match RemoteDonor::open_nixl(manifest.clone(), ok()[..1].to_vec(), &ep) {
            Err(RemoteDonorError::MapCount { got: 1, .. }) => {}
            other => panic!("expected MapCount, got {other:?}"),
        }
        assert!(matches!(
            RemoteDonor::open_nixl(manifest, ok(), "ftp:x"),
            Err(RemoteDonorError::Endpoint(_))
        ));
        donor.close(Duration::ZERO).await.unwrap();
    });
}

/// The pin service hashes the pinned blocks only when asked: a pin of a
/// NIXL-opened donor (addresses only) carries one XXH3-64 per block and
/// rank, rank-major, of exactly the bytes stored; a pin of a mapped donor
/// (bound by its export handle) carries none. No NIXL runtime needed: the
/// pin goes over the Unix socket, nothing is read.
#[test]
fn a_nixl_pin_grant_carries_the_checksums_of_the_pinned_blocks() {
    serial(|| async {
        let p = Planes::new();
        let (ep, plane, dir) = (p.endpoint("d0"), &p.plane, &p.dir);
        let target_id = kv_descriptor::EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let donor = p.donor("decode-0", &ep).await;
        let (h, env) = store_and_advise(&mut router, &donor, target_id).await;
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        let manifest = donor.bank().manifest().clone();
        let fetched = &h[hint.fetch_from as usize..];
        let want: Vec<u64> = (0..TP)
            .flat_map(|rank| {
                fetched.iter().map(move |&b| {
                    let bytes: Vec<u8> = (0..rbb()).map(|i| pattern(b, rank, i)).collect();
                    xxhash_rust::xxh3::xxh3_64(&bytes)
                })
            })
            .collect();
        assert_eq!(want.len(), fetched.len() * TP as usize);

        let regions = (0..TP)
            .map(|r| kv_transfer::NixlRemoteRegion {
                agent_name: "d".into(),
                base_addr: 0x1000,
                len: manifest.parts()[r as usize].region_bytes(),
                kind: kv_bank::MemoryKind::Host,
            })
            .collect();
        let nixl = RemoteDonor::open_nixl(manifest.clone(), regions, &ep).unwrap();
        let pin = nixl.pin_remote(&hint).unwrap();
        assert_eq!(pin.grant().block_checksums, want);
        assert_eq!(DonorPin::block_checksums(&pin), Some(want.as_slice()));
        drop(pin);

        let mapped = RemoteDonor::open_host_shm(manifest, &ep).unwrap();
        let pin = mapped.pin_remote(&hint).unwrap();
        assert!(pin.grant().block_checksums.is_empty());
        assert_eq!(DonorPin::block_checksums(&pin), None);
        drop(pin);
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}

/// A donor source whose pins carry `checksums` (what a NIXL pin grant
/// carries), reading the donor bank in process.
struct Checksummed<'a> {
    bank: &'a kv_bank::BankManager,
    checksums: Vec<u64>,
}

struct ChecksummedPin<'a> {
    inner: Box<dyn DonorPin + 'a>,
    checksums: &'a [u64],
}

impl DonorPin for ChecksummedPin<'_> {
    fn rank_memory(&self, rank: u32) -> Option<&dyn kv_bank::BankMemory> {
        self.inner.rank_memory(rank)
    }
    fn block_checksums(&self) -> Option<&[u64]> {
        Some(self.checksums)
    }
}

impl DonorSource for Checksummed<'_> {
    fn manifest(&self) -> &kv_descriptor::BankManifest {
        self.bank.manifest()
    }
    fn pin<'a>(
        &'a self,
        hint: &kv_descriptor::FetchGpuHint,
    ) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        Ok(Box::new(ChecksummedPin {
            inner: DonorSource::pin(self.bank, hint)?,
            checksums: &self.checksums,
        }))
    }
}

/// The executor completes a pin that carries block checksums only when
/// every received block hashes to the donor's: one flipped checksum names
/// its rank and block, a short list is `Missing`; engine regions in vLLM
/// and HF per-layer layouts are gathered back into block-major order and
/// checked the same way; each falls back at `verify` with every row back
/// in the pool. No NIXL runtime needed.
#[test]
fn checksummed_pins_complete_only_when_every_block_matches() {
    serial(|| async {
        let p = Planes::new();
        let (ep, plane, dir) = (p.endpoint("d0"), &p.plane, &p.dir);
        let target_id = kv_descriptor::EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let donor = p.donor("decode-0", &ep).await;
        let (h, env) = store_and_advise(&mut router, &donor, target_id).await;
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        let fetched = &h[hint.fetch_from as usize..];
        let good: Vec<u64> = (0..TP)
            .flat_map(|rank| {
                fetched.iter().map(move |&b| {
                    let bytes: Vec<u8> = (0..rbb()).map(|i| pattern(b, rank, i)).collect();
                    xxhash_rust::xxh3::xxh3_64(&bytes)
                })
            })
            .collect();
        let (tgt, rows) = target(dir.clone()).await;
        let exec = tgt.executor();
        let run = |checksums: Vec<u64>, exec: &FetchExecutor| {
            let src = Checksummed {
                bank: donor.bank(),
                checksums,
            };
            exec.execute_for_prompt(&env, &h, &src, &DeliveryControl::new())
        };

        let out = run(good.clone(), exec).unwrap();
        assert_rows_hold(&rows, &out);
        drop(out);

        let n = fetched.len();
        let mut flipped = good.clone();
        flipped[n + 3] ^= 1;
        match run(flipped, exec) {
            Err(FetchError::Fallback {
                stage: "verify",
                cause:
                    FallbackCause::BlockChecksum(BlockChecksumError::Mismatch { rank, block, .. }),
            }) => assert_eq!((rank, block), (1, 3)),
            other => panic!("expected a rank 1 block 3 mismatch, got {other:?}"),
        }
        match run(good[..n].to_vec(), exec) {
            Err(FetchError::Fallback {
                stage: "verify",
                cause: FallbackCause::BlockChecksum(BlockChecksumError::Missing { expected, got }),
            }) => assert_eq!((expected, got), (2 * n, n)),
            other => panic!("expected Missing, got {other:?}"),
        }
        assert_eq!(exec.pool().free_blocks(), ROWS as usize, "no row taken");

        // Engine regions in engine layouts (vLLM and HF per layer): the
        // received blocks are gathered back into the donor's block-major
        // order and checked like pool rows.
        for (name, engine_layout) in engine_layouts() {
            let engine: Vec<EngineRegion> = (0..TP)
                .map(|r| {
                    let layout = engine_layout(r);
                    EngineRegion {
                        memory: Arc::new(
                            kv_transfer::HostBuffer::zeroed(layout.region_bytes() as usize)
                                .unwrap(),
                        ),
                        layout,
                    }
                })
                .collect();
            let engine_exec = FetchExecutor::with_engine_regions(
                layout(),
                kv_bank::DestinationPool::new(ROWS),
                engine,
                Arc::new(kv_transfer::HostCopyBackend),
            )
            .unwrap();
            let out = run(good.clone(), &engine_exec)
                .unwrap_or_else(|e| panic!("{name}: correct checksums must complete: {e:?}"));
            assert_eq!(out.target_blocks.len(), n, "{name}");
            drop(out);
            let mut flipped = good.clone();
            flipped[n + 3] ^= 1;
            match run(flipped, &engine_exec) {
                Err(FetchError::Fallback {
                    stage: "verify",
                    cause:
                        FallbackCause::BlockChecksum(BlockChecksumError::Mismatch {
                            rank,
                            block,
                            expected,
                            got,
                            ..
                        }),
                }) => assert_eq!(
                    (rank, block, expected ^ 1),
                    (1, 3, got),
                    "{name}: the received block hashes to the donor's unflipped checksum"
                ),
                other => panic!("{name}: expected a rank 1 block 3 mismatch, got {other:?}"),
            }
            assert_eq!(engine_exec.pool().free_blocks(), ROWS as usize, "{name}");
        }
        donor.close(Duration::from_secs(1)).await.unwrap();
    });
}

/// TP rank `r`'s engine region layouts the checksum test lands into, by
/// name: vLLM `[2, num_blocks, block_size, heads, head_dim]` per layer, and
/// HF `[2, batch 2, heads, max_tokens, head_dim]` per layer landing
/// sequence 1 from token 16 (so neither is the bank's row order).
#[allow(clippy::type_complexity)]
fn engine_layouts() -> Vec<(
    &'static str,
    Box<dyn Fn(u32) -> kv_descriptor::KvRegionLayout>,
)> {
    let g = layout();
    let vllm_layer = u64::from(ROWS) * rbb() as u64 / u64::from(g.num_layers());
    let max_tokens = u64::from(ROWS + 1) * TOKENS as u64;
    let hf_layer = 2
        * 2
        * u64::from(g.heads_per_rank())
        * max_tokens
        * u64::from(g.head_dim())
        * g.dtype().size_bytes() as u64;
    let layers = u64::from(g.num_layers());
    vec![
        (
            "vllm",
            Box::new(move |r| {
                kv_descriptor::KvRegionLayout::vllm_kv_first(
                    g,
                    r,
                    0,
                    vllm_layer,
                    ROWS,
                    layers * vllm_layer,
                )
                .unwrap()
            }),
        ),
        (
            "hf",
            Box::new(move |r| {
                kv_descriptor::KvRegionLayout::hf_tokens(
                    g,
                    r,
                    0,
                    hf_layer,
                    2,
                    1,
                    max_tokens,
                    TOKENS as u64,
                    ROWS,
                    layers * hf_layer,
                )
                .unwrap()
            }),
        ),
    ]
}
