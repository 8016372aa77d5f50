//! Per-agent UCX settings ([`NixlAgentOptions`]): two agents limited to
//! `TLS=tcp` move a fetch over TCP (UCX's own protocol table says so),
//! although the default choice between two agents of one process is `cma`.
//!
//! One test per binary: it sets `UCX_PROTO_INFO` / `UCX_LOG_FILE`, which UCX
//! reads process-wide. Skips like `nixl_dram.rs` without the runtime.

use std::sync::Arc;

use kv_bank::BankMemory;
use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
use kv_transfer::nixl::{runtime_status, NixlAgent, NixlAgentOptions, NixlBackend, NixlMode};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{deliver, DeliveryControl, HostBuffer, NixlRemoteRegion, RankIo, SourceRegion};

#[test]
fn tcp_only_agents_move_the_fetch_over_tcp() {
    match runtime_status() {
        Ok(()) => {}
        Err(e) if kv_transfer::ci_requires() => panic!("CI=true and {e}"),
        Err(e) => {
            println!("SKIP nixl test: {e}");
            return;
        }
    }
    let log = std::env::temp_dir().join(format!("kvx-ucx-{}.log", std::process::id()));
    // SAFETY: set before any thread of this test binary reads the environment
    // (one test in this binary; UCX reads it when the first agent starts).
    unsafe {
        std::env::set_var("UCX_PROTO_INFO", "y");
        std::env::set_var("UCX_LOG_FILE", &log);
    }
    let tcp = NixlAgentOptions {
        ucx_config: vec![
            ("TLS".into(), "tcp".into()),
            ("NET_DEVICES".into(), "lo".into()),
        ],
    };
    let layout = KvLayout::new(2, 4, 16, DType::Bf16, 8, TensorOrder::BlockMajor, 1).unwrap();
    let bb = layout.rank_block_bytes();
    let g = RegionGeometry::dense(&layout, 8);
    let donor = NixlAgent::with_options("kvx-opt-donor", &tcp).unwrap();
    let target = Arc::new(NixlAgent::with_options("kvx-opt-target", &tcp).unwrap());
    let mut src = HostBuffer::zeroed(g.region_bytes() as usize).unwrap();
    for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let dst = HostBuffer::zeroed(g.region_bytes() as usize).unwrap();
    donor.register(&src).unwrap();
    target.register(&dst).unwrap();
    let name = target.load_remote(&donor.metadata().unwrap()).unwrap();
    let remote = NixlRemoteRegion {
        agent_name: name,
        base_addr: src.base_addr(),
        len: src.len() as u64,
        kind: src.kind(),
    };
    let moves: Vec<BlockMove> = (0..4)
        .map(|i| BlockMove {
            key: SequenceHash(i + 1),
            src_slot: Some(i as u32 + 2),
            dst_block: i as u32,
        })
        .collect();
    let plan = TransferPlan::new(&layout, &layout, &moves, &[g], &[g]).unwrap();
    let io = [RankIo {
        src: SourceRegion::Nixl(&remote),
        dst: &dst,
    }];
    let backend = NixlBackend::new(target.clone(), NixlMode::Runs);
    let rep = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(rep.is_complete(), "{rep:?}");
    assert_eq!(rep.counters.bytes, 4 * bb as u64);
    assert_eq!(
        dst.read_vec(0, 4 * bb).unwrap(),
        src.read_vec(2 * bb, 4 * bb).unwrap()
    );
    assert!(
        rep.counters.transport == "tcp/lo",
        "TLS=tcp, NET_DEVICES=lo must select TCP over lo, UCX selected {:?}",
        rep.counters.transport
    );
}
