//! Compiles the converting gather kernel with NVRTC, no GPU needed: only
//! libnvrtc (e.g. the `nvidia-cuda-nvrtc-cu12` wheel's `lib` folder on
//! `LD_LIBRARY_PATH`). Skips with a printed reason when libnvrtc is absent.

use kv_transfer::cuda_gather::{TablePlacement, CONVERT_KERNEL_SRC, KERNEL_NAMES};

/// PTX of entry point `name`: from its `.entry` to the next one.
fn entry_body<'a>(text: &'a str, name: &str) -> &'a str {
    let start = text
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("no entry point {name} in the PTX"));
    let rest = &text[start + 1..];
    &rest[..rest.find(".entry ").unwrap_or(rest.len())]
}

/// The `_w` entry of `placement` holds the eight-wide step (more 16-byte
/// loads than its four-wide twin, which must keep the loop HF rows ran at
/// 0.890 of the raw copy before 7d474c0).
fn wide_twin_has_more_loads(text: &str, placement: TablePlacement) {
    let count = |name: &str| {
        entry_body(text, name)
            .matches("ld.global.nc.v4.u32")
            .count()
    };
    let (four, wide) = (placement.names()[0].1, placement.wide_name());
    let (f, w) = (count(four), count(wide));
    println!("{four}: {f} 16-byte loads, {wide}: {w}");
    assert!(
        w >= f + 8,
        "{wide} ({w} loads) lacks the eight-wide step over {four} ({f})"
    );
}

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
    wide_twin_has_more_loads(&text, TablePlacement::Device);
    // Seven parameters per entry point (two tables, five u32 scalars).
    assert!(text.contains("kv_convert_16_param_6"), "{text}");
    assert!(!text.contains("kv_convert_16_param_7"));
}

#[test]
fn inline_table_entry_points_compile_with_the_table_as_a_parameter() {
    use kv_transfer::cuda_gather::{
        INLINE_LARGE_ENTRIES, INLINE_LARGE_NAMES, INLINE_PACKED_ENTRIES, INLINE_PACKED_NAMES,
        INLINE_SMALL_ENTRIES, INLINE_SMALL_NAMES, PACKED_TIER_NAMES,
    };
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("SKIP inline kernel compile: libnvrtc not loadable (set LD_LIBRARY_PATH)");
        return;
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        CONVERT_KERNEL_SRC,
        // H100 / H200: accepted by NVRTC 12.x and 13.x alike.
        kv_transfer::cuda::inline_compile_options(9, 0),
    )
    .expect("NVRTC compiles the inline entry points");
    let text = ptx.to_src();
    if std::env::var_os("KV_DUMP_PTX").is_some() {
        println!("{text}");
    }
    for (names, entries) in [
        (INLINE_SMALL_NAMES, INLINE_SMALL_ENTRIES),
        (INLINE_LARGE_NAMES, INLINE_LARGE_ENTRIES),
    ] {
        for (_, name) in names {
            // The table is parameter 0, passed by value with its full size.
            let decl = format!(".param .align 8 .b8 {name}_param_0[{}]", entries * 8);
            assert!(text.contains(&decl), "no `{decl}` in the PTX");
            assert!(text.contains(&format!("{name}_param_6")), "{name}");
            assert!(!text.contains(&format!("{name}_param_7")), "{name}");
        }
    }
    // Packed ids: a u32 table, then two bases and two strides (u64), the
    // piece-table pointer and the five u32 scalars.
    // Every packed tier: its table is exactly its ids x 4 bytes, so a
    // 1024-block fetch sends 4 KiB of parameters, not 32 KiB.
    let tiers = PACKED_TIER_NAMES
        .iter()
        .map(|(ids, names)| (*ids, *names))
        .chain([(INLINE_PACKED_ENTRIES, INLINE_PACKED_NAMES)]);
    for (ids, name) in tiers.flat_map(|(ids, names)| names.map(|(_, n)| (ids, n))) {
        let decl = format!(".param .align 4 .b8 {name}_param_0[{}]", ids * 4);
        assert!(text.contains(&decl), "no `{decl}` in the PTX");
        assert!(
            text.contains(&format!(".param .u64 {name}_param_4")),
            "{name}"
        );
        assert!(text.contains(&format!("{name}_param_10")), "{name}");
        assert!(!text.contains(&format!("{name}_param_11")), "{name}");
    }
    for p in [
        TablePlacement::InlineSmall,
        TablePlacement::InlineLarge,
        TablePlacement::InlinePacked,
        TablePlacement::InlinePacked1024,
        TablePlacement::InlinePacked2048,
        TablePlacement::InlinePacked4096,
    ] {
        wide_twin_has_more_loads(&text, p);
    }
    assert!(
        text.contains("ld.param.u32"),
        "no packed-id parameter loads"
    );
    // The table-pointer entry points are not in the inline module.
    assert!(!text.contains(".entry kv_convert_16("));
    // `__grid_constant__`: the table is read from the parameter space, not
    // copied to a local frame (`.local` would mean a per-thread copy).
    assert!(text.contains("ld.param.u64"), "no parameter loads");
    assert!(
        !text.contains(".local"),
        "the inline table was copied to local memory"
    );
}
