//! GPU checks: skip with a printed reason when no CUDA device is visible
//! (`cudarc` is probed with `is_culib_present` before any call).
//! On a GPU machine these run the oracle's GPU profile and a quick GPU bench.

use kv_transfer::bench::{self, BenchOpts};
use kv_transfer::oracle::{self, Profile};

fn gpu_or_skip() -> bool {
    if !kv_transfer::cuda::driver_present() {
        println!("SKIP gpu test: libcuda not loadable");
        return false;
    }
    if kv_transfer::cuda::device_count() == 0 {
        println!("SKIP gpu test: no CUDA device visible");
        return false;
    }
    true
}

#[test]
fn gpu_oracle_passes_with_zero_host_payload() {
    if !gpu_or_skip() {
        return;
    }
    let r = oracle::run(Profile::Gpu).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    assert!(r.passed(), "{r:#?}");
    assert_eq!(r.host_payload_bytes, 0);
    assert_eq!(r.backend, "cuda_ipc");
}

#[test]
fn gpu_quick_bench_rows_verify_their_bytes() {
    if !gpu_or_skip() {
        return;
    }
    let rows = bench::run(&BenchOpts {
        profile: Profile::Gpu,
        repeats: 3,
        quick: true,
        nixl: false,
    })
    .unwrap();
    for r in &rows {
        println!("{}", serde_json::to_string(r).unwrap());
        assert!(r.gbps > 0.0 && r.raw_gbps > 0.0, "{}", r.name);
    }
    assert!(rows.iter().any(|r| r.name.contains("scattered")));
}
