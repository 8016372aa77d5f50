//! Compiles the converting gather kernel with NVRTC, no GPU needed: only
//! libnvrtc (e.g. the `nvidia-cuda-nvrtc-cu12` wheel's `lib` folder on
//! `LD_LIBRARY_PATH`). Skips with a printed reason when libnvrtc is absent.

use kv_transfer::cuda_gather::{CONVERT_KERNEL_SRC, KERNEL_NAMES};

#[test]
fn convert_kernel_compiles_with_every_entry_point() {
    // SAFETY: only probes whether libnvrtc can be loaded (cudarc panics on
    // first use otherwise).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("SKIP convert kernel compile: libnvrtc not loadable (set LD_LIBRARY_PATH)");
        return;
    }
    let ptx = cudarc::nvrtc::compile_ptx(CONVERT_KERNEL_SRC).expect("NVRTC compiles the kernel");
    let text = ptx.to_src();
    if std::env::var_os("KV_DUMP_PTX").is_some() {
        println!("{text}");
    }
    for (width, name) in KERNEL_NAMES {
        assert!(
            text.contains(&format!(".entry {name}(")),
            "no entry point {name} in the PTX"
        );
        // The element width is the access width, in the global space (not
        // generic loads): 16-byte entry points move v4.u32.
        if width == 16 {
            assert!(
                text.contains("ld.global.nc.v4.u32"),
                "no 16-byte global loads"
            );
            assert!(
                text.contains("st.global.cg.v4.u32"),
                "no 16-byte global stores"
            );
        }
    }
    // Seven parameters per entry point (two tables, five u32 scalars).
    assert!(text.contains("kv_convert_16_param_6"), "{text}");
    assert!(!text.contains("kv_convert_16_param_7"));
}
