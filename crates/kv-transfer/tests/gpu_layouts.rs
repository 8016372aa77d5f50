//! The layout oracle on the GPU profile: skips with a printed reason when no
//! CUDA device is visible. Every target layout must either land every byte
//! with zero host payload or, while the CUDA backend does not convert
//! (`CopyBackend::converts` false), be refused before a byte moved with the
//! target untouched and nothing completed.

use kv_transfer::layout_oracle::{self, Profile};

#[test]
fn gpu_layout_oracle_lands_or_refuses_every_layout_with_zero_host_payload() {
    if !kv_transfer::cuda::driver_present() {
        println!("SKIP gpu layout oracle: libcuda not loadable");
        return;
    }
    if kv_transfer::cuda::device_count() == 0 {
        println!("SKIP gpu layout oracle: no CUDA device visible");
        return;
    }
    let r = layout_oracle::run(Profile::Gpu).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    assert!(r.passed(), "{r:#?}");
    for c in &r.cases {
        assert_eq!(c.host_payload_bytes, 0, "{c:?}");
        if c.refused.is_some() {
            println!(
                "REFUSED {:?}: {}",
                c.kind,
                c.refused.as_deref().unwrap_or("")
            );
        }
    }
}
