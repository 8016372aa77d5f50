//! Two NIXL agents in one process, UCX over DRAM: a TP2 fetch with coalesced,
//! prepared and naive descriptor lists, a missing key, and an unreachable donor.
//!
//! Skips (printing why) when `libnixl_capi.so` is not loadable, except under
//! `CI=true`, where a missing runtime fails the test.

use std::sync::Arc;

use kv_bank::BankMemory;
use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
use kv_transfer::nixl::{runtime_status, NixlAgent, NixlBackend, NixlMode};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{
    deliver, DeliveryControl, DeliveryStatus, HostBuffer, NixlRemoteRegion, RankIo, SourceRegion,
    TransferError,
};

fn runtime_or_skip() -> bool {
    match runtime_status() {
        Ok(()) => true,
        Err(e) if kv_transfer::ci_requires() => panic!("CI=true and {e}"),
        Err(e) => {
            println!("SKIP nixl test: {e}");
            false
        }
    }
}

const POISON: u8 = 0xA5;

fn pattern(rank: u32, slot: u32, i: usize) -> u8 {
    (i as u32)
        .wrapping_mul(31)
        .wrapping_add(slot * 7 + rank * 101) as u8
}

#[test]
fn nixl_dram_tp2_fetch_in_all_modes() {
    if !runtime_or_skip() {
        return;
    }
    let layout = KvLayout::new(2, 4, 16, DType::Bf16, 8, TensorOrder::BlockMajor, 2).unwrap();
    let bb = layout.rank_block_bytes();
    let g = RegionGeometry::dense(&layout, 32);
    let donor_agent = NixlAgent::new("kvx-test-donor").unwrap();
    let target_agent = Arc::new(NixlAgent::new("kvx-test-target").unwrap());
    let mut donor_mem = Vec::new();
    let mut target_mem = Vec::new();
    for r in 0..2u32 {
        let mut d = HostBuffer::zeroed(g.region_bytes() as usize).unwrap();
        for (i, b) in d.as_mut_slice().iter_mut().enumerate() {
            *b = pattern(r, (i / bb) as u32, i % bb);
        }
        donor_agent.register(&d).unwrap();
        let mut t = HostBuffer::zeroed(g.region_bytes() as usize).unwrap();
        t.as_mut_slice().fill(POISON);
        target_agent.register(&t).unwrap();
        donor_mem.push(d);
        target_mem.push(t);
    }
    let remote_name = target_agent
        .load_remote(&donor_agent.metadata().unwrap())
        .unwrap();
    assert_eq!(remote_name, "kvx-test-donor");
    let remotes: Vec<NixlRemoteRegion> = donor_mem
        .iter()
        .map(|d| NixlRemoteRegion {
            agent_name: remote_name.clone(),
            base_addr: d.base_addr(),
            len: d.len() as u64,
            kind: d.kind(),
        })
        .collect();
    // Slots 3,4,5 -> blocks 0,1,2 (one run); slot 9 -> 7; slot 20 -> 3; key 6 missing -> block 12.
    let m = |k, s, d| BlockMove {
        key: SequenceHash(k),
        src_slot: s,
        dst_block: d,
    };
    let moves = [
        m(1, Some(3), 0),
        m(2, Some(4), 1),
        m(3, Some(5), 2),
        m(4, Some(20), 3),
        m(5, Some(9), 7),
        m(6, None, 12),
    ];
    let plan = TransferPlan::new(&layout, &layout, &moves, &[g; 2], &[g; 2]).unwrap();
    for (mode, want_copies) in [
        (NixlMode::Runs, 3),
        (NixlMode::Prepared, 5),
        (NixlMode::PerBlock, 5),
        (NixlMode::Prepared, 5),
    ] {
        for t in &mut target_mem {
            t.as_mut_slice().fill(POISON);
        }
        let backend = NixlBackend::new(target_agent.clone(), mode);
        let io: Vec<RankIo> = (0..2)
            .map(|r| RankIo {
                src: SourceRegion::Nixl(&remotes[r]),
                dst: &target_mem[r],
            })
            .collect();
        let rep = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap();
        assert!(
            !rep.is_complete(),
            "a missing key must never report completion"
        );
        assert!(
            matches!(&rep.status, DeliveryStatus::Incomplete { missing } if missing[0].dst_block == 12)
        );
        assert_eq!(rep.counters.bytes, 2 * 5 * bb as u64);
        assert_eq!(rep.counters.copies, 2 * want_copies, "{mode:?}");
        assert_eq!(rep.counters.host_payload_bytes, rep.counters.bytes);
        assert_eq!(rep.counters.transport, "unknown");
        for r in 0..2u32 {
            let t = &target_mem[r as usize]
                .read_vec(0, g.region_bytes() as usize)
                .unwrap();
            for mv in &moves {
                let row = &t[mv.dst_block as usize * bb..][..bb];
                match mv.src_slot {
                    Some(s) => assert!(
                        row.iter().enumerate().all(|(i, &b)| b == pattern(r, s, i)),
                        "{mode:?} rank {r} block {} differs from donor slot {s}",
                        mv.dst_block
                    ),
                    None => assert!(
                        row.iter().all(|&b| b == POISON),
                        "missing key row was written"
                    ),
                }
            }
            // Rows outside the plan stay untouched too.
            assert!(t[20 * bb..21 * bb].iter().all(|&b| b == POISON));
        }
    }
    assert_eq!(
        target_agent.prepared_pairs(),
        2,
        "one prepared pair per rank, reused by the second prepared fetch"
    );
    // The donor hears about finished reads (notifications are asynchronous).
    let mut got = 0;
    for _ in 0..200 {
        got += donor_agent
            .take_notifications()
            .unwrap()
            .get("kvx-test-target")
            .map_or(0, |v| v.len());
        if got >= 8 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(got, 8, "one notification per part per fetch");

    // Donor gone: the target forgets it, and the next fetch fails before completion.
    target_agent.forget_remote(&remote_name).unwrap();
    let backend = NixlBackend::new(target_agent.clone(), NixlMode::Runs);
    let io: Vec<RankIo> = (0..2)
        .map(|r| RankIo {
            src: SourceRegion::Nixl(&remotes[r]),
            dst: &target_mem[r],
        })
        .collect();
    let e = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap_err();
    match e {
        TransferError::PartFailed { source, .. } => {
            assert!(
                matches!(*source, TransferError::DonorUnreachable { .. }),
                "{source}"
            )
        }
        other => panic!("expected an unreachable donor, got {other}"),
    }
}

// The oracle is harness code (feature `qualify`).
#[cfg(feature = "qualify")]
#[test]
fn nixl_oracle_cpu_passes() {
    if !runtime_or_skip() {
        return;
    }
    use kv_transfer::oracle::{run_backend, OracleBackend, Profile};
    let r = run_backend(Profile::Cpu, OracleBackend::Nixl).unwrap();
    assert!(r.passed(), "{r:#?}");
    assert_eq!(r.backend, "nixl");
    assert_eq!(r.transport, "unknown");
    assert_eq!(r.bytes, 2 * 7 * 65_536);
}
