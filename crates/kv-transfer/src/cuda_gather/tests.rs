use super::*;
use kv_descriptor::{DType, KvLayout, TensorOrder};

fn geom_8b() -> KvLayout {
    KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap()
}

#[test]
fn block_major_to_block_major_is_one_piece_per_block() {
    let g = geom_8b();
    let bb = g.rank_block_bytes() as u64;
    let a = KvRegionLayout::block_major(g, 0, 0, 8, 8 * bb).unwrap();
    let t = PieceTable::convert(&a, &a).unwrap();
    assert_eq!(bb, 2 << 20);
    assert_eq!((t.piece_bytes, t.src, t.dst), (bb, vec![0], vec![0]));
}

#[test]
fn vllm_and_hf_pieces_have_the_expected_sizes() {
    let g = geom_8b();
    let bb = g.rank_block_bytes() as u64;
    let donor = KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap();
    let slab = 16 * 8 * 128 * 2; // [block_size, heads, head_dim] bf16
    let layer = 2 * 4 * slab;
    let v = KvRegionLayout::vllm_kv_first(g, 0, 0, layer, 4, 32 * layer).unwrap();
    let t = PieceTable::convert(&donor, &v).unwrap();
    assert_eq!((t.piece_bytes, t.len()), (slab, 64));
    // Layer 1, V: donor at one layer + one slab; target at layer + 4 slabs.
    assert_eq!((t.src[3], t.dst[3]), (layer / 4 + slab, layer + 4 * slab));
    let hf_layer = 2 * 8 * 256 * 128 * 2;
    let hf = KvRegionLayout::hf_tokens(g, 0, 0, hf_layer, 1, 0, 256, 64, 4, 32 * hf_layer).unwrap();
    let t = PieceTable::convert(&donor, &hf).unwrap();
    assert_eq!((t.piece_bytes, t.len()), (256, 32 * 2 * 16 * 8));
    // Token 1 of head 0, K, layer 0: donor one token row on, target token 65.
    assert_eq!((t.src[8], t.dst[8]), (8 * 256, 65 * 256));
}

#[test]
fn splitting_keeps_bytes_and_caps_pieces() {
    let t = PieceTable::contiguous(2 << 20).split_for(1024, MAX_PIECE_BYTES);
    assert_eq!(t.piece_bytes, MAX_PIECE_BYTES);
    assert_eq!(t.len(), 32);
    assert_eq!(t.src[31], 31 * MAX_PIECE_BYTES);
    // A small fetch is cut to 4 KiB pieces so it spreads over SMs.
    let t = PieceTable::contiguous(32 << 10).split_for(7, MAX_PIECE_BYTES);
    assert_eq!((t.piece_bytes, t.len()), (4096, 8));
    // An odd length is never cut.
    let t = PieceTable::contiguous(3 * 65536 + 1).split_for(1, MAX_PIECE_BYTES);
    assert_eq!(t.len(), 1);
}

#[test]
fn refusals_name_the_field() {
    let g = geom_8b();
    let bb = g.rank_block_bytes() as u64;
    let a = KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap();
    let other = KvLayout::new(32, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let b = KvRegionLayout::block_major(other, 0, 0, 4, 4 * bb).unwrap();
    let e = ConvertPlan::new(&a, &b, &[(0, 0)]).unwrap_err();
    assert!(e.to_string().contains("geometry.head_dim"), "{e}");
    assert_eq!(
        ConvertPlan::new(&a, &a, &[(4, 0)]).unwrap_err(),
        ConvertError::BlockOutOfRange {
            field: "moves.src_block",
            index: 0,
            block: 4,
            limit: 4
        }
    );
    assert_eq!(
        ConvertPlan::new(&a, &a, &[(0, 1), (2, 1)]).unwrap_err(),
        ConvertError::DuplicateTarget { index: 1, block: 1 }
    );
    assert_eq!(
        ConvertPlan::new(&a, &a, &[]).unwrap_err(),
        ConvertError::Empty
    );
}

#[test]
fn work_items_past_31_bits_are_refused() {
    let pieces = PieceTable {
        piece_bytes: 16,
        src: vec![0; MAX_PIECES],
        dst: vec![0; MAX_PIECES],
    };
    let ok = ConvertPlan::checked(
        pieces.clone(),
        Blocks::Offsets {
            src: vec![0; 2047],
            dst: vec![0; 2047],
        },
        16,
        16,
        &GatherTuning::default(),
    );
    assert!(ok.is_ok());
    let e = ConvertPlan::checked(
        pieces,
        Blocks::Offsets {
            src: vec![0; 2048],
            dst: vec![0; 2048],
        },
        16,
        16,
        &GatherTuning::default(),
    )
    .unwrap_err();
    assert_eq!(
        e,
        ConvertError::TooLarge {
            field: "moves",
            got: 1 << 31,
            limit: MAX_WORK_ITEMS
        }
    );
}

#[test]
fn geometry_picks_width_from_alignment_and_small_grids_for_small_fetches() {
    let runs = |n: u32, bb: u64| -> Vec<CopyRun> {
        (0..n)
            .map(|i| CopyRun {
                src_block: 2 * i + 1,
                dst_block: i,
                blocks: 1,
                src_offset: u64::from(2 * i + 1) * bb,
                dst_offset: u64::from(i) * bb,
                len: bb,
            })
            .collect()
    };
    let p = ConvertPlan::from_runs(&runs(1024, 65536), 65536, 1 << 28, 1 << 28).unwrap();
    let g = p.geometry(0x7f00_0000_0000, 0x7e00_0000_0000, 132);
    assert_eq!((g.width, g.piece_elems, g.group_shift), (16, 4096, 8));
    assert_eq!((g.grid_x, g.kernel_name()), (1024, "kv_convert_16_w"));
    assert!(g.wide);
    // A base 4 bytes off 16 drops to 4-byte elements.
    assert_eq!(p.geometry(0x7f00_0000_0004, 0, 132).width, 4);
    // 7 x 32 KiB: 56 pieces of 4 KiB, 64 lanes each, 4 groups per CTA.
    let p = ConvertPlan::from_runs(&runs(7, 32768), 32768, 1 << 22, 1 << 22).unwrap();
    let g = p.geometry(0, 0, 132);
    assert_eq!((g.num_pieces, g.piece_shift, g.group_shift), (8, 3, 6));
    assert_eq!(g.grid_x, 14);
    // 4096 x 16 KiB: eight elements a lane, so 128 lanes a row and two rows
    // per 256-thread CTA (the grid capped at 8 CTAs per SM).
    let p = ConvertPlan::from_runs(&runs(4096, 16384), 16384, 1 << 28, 1 << 28).unwrap();
    let g = p.geometry(0, 0, 132);
    assert_eq!((g.width, g.piece_elems, g.group_shift), (16, 1024, 7));
    assert_eq!((g.grid_x, g.threads), (1056, 256));
    assert_eq!(g.kernel_name(), "kv_convert_16_w");
    // The same rows 8 bytes off 16: four-wide entry, a quarter per lane.
    let g = p.geometry(8, 0, 132);
    assert_eq!((g.width, g.wide, g.group_shift), (8, false, 8));
}

/// The line of [`CONVERT_KERNEL_SRC`] that defines entry point `name`.
fn entry_line(name: &str) -> &'static str {
    let needle = format!("({name},");
    CONVERT_KERNEL_SRC
        .lines()
        .find(|l| l.starts_with("KV_CONVERT") && l.contains(&needle))
        .unwrap_or_else(|| panic!("no entry point {name}"))
}

#[test]
fn hf_rows_launch_an_entry_point_without_the_eight_wide_step() {
    // H200 bisect: compiling the eight-wide step into every entry point
    // (7d474c0) took 8B -> HF at token 48 from 0.890 to 0.722 of the raw
    // copy, though for 256-byte rows it never runs; vLLM (32 KiB pieces)
    // and block-major (64 KiB) rows gained from it.
    let g = geom_8b();
    let bb = g.rank_block_bytes() as u64;
    let donor = KvRegionLayout::block_major(g, 0, 0, 1024, 1024 * bb).unwrap();
    let max_tokens = 48 + 512 * 16;
    let hf_layer = 2 * 8 * max_tokens * 128 * 2;
    let hf = KvRegionLayout::hf_tokens(g, 0, 0, hf_layer, 1, 0, max_tokens, 48, 512, 32 * hf_layer)
        .unwrap();
    let moves: Vec<(u32, u32)> = (0..512).map(|i| (2 * i + 1, i)).collect();
    let p = ConvertPlan::new(&donor, &hf, &moves).unwrap();
    let geo = p.geometry(0, 1 << 40, 132);
    // Swept geometry: 16 elements of 16 bytes, 4 lanes of 4, four-wide.
    assert_eq!((geo.width, geo.piece_elems, geo.group_shift), (16, 16, 2));
    assert!(!geo.wide);
    assert_eq!(geo.kernel_name(), "kv_convert_16");
    // 512 blocks with 16-bit ids: the 4 KiB packed tier's 16-byte entry.
    let placement = TablePlacement::for_blocks(512, true, p.packed().is_some());
    assert_eq!(placement, TablePlacement::InlinePacked1024);
    let name = placement.names()[0].1;
    assert_eq!(name, "kv_convert_p1024_16");
    assert!(entry_line(name).ends_with(", KV_NO_STEP8)"), "{name}");
    // The shared loop itself holds no eight-wide step.
    let lp = CONVERT_KERNEL_SRC.split("#define KV_LOOP(").nth(1).unwrap();
    let lp = &lp[..lp.find("\n\n").unwrap()];
    assert!(!lp.contains("7u * G"), "KV_LOOP steps eight wide");
    assert!(entry_line(placement.wide_name()).ends_with(", KV_STEP8)"));
    // vLLM per-layer: 32 KiB pieces take the eight-wide entry.
    let slab = 16 * 8 * 128 * 2;
    let layer = 2 * 512 * slab;
    let v = KvRegionLayout::vllm_kv_first(g, 0, 0, layer, 512, 32 * layer).unwrap();
    let geo = ConvertPlan::new(&donor, &v, &moves)
        .unwrap()
        .geometry(0, 1 << 40, 132);
    assert_eq!((geo.piece_elems, geo.wide), (2048, true));
}

#[test]
fn tuning_refusals_name_the_knob() {
    for (t, c, p, field) in [
        (48, 8, 64 << 10, "threads"),
        (2048, 1, 64 << 10, "threads"),
        (1024, 9, 64 << 10, "ctas_per_sm"),
        (256, 0, 64 << 10, "ctas_per_sm"),
        (256, 8, 3 << 10, "max_piece_bytes"),
        (256, 8, 512, "max_piece_bytes"),
    ] {
        assert_eq!(
            GatherTuning::new(t, c, p),
            Err(ConvertError::Tuning {
                field,
                got: match field {
                    "threads" => u64::from(t),
                    "ctas_per_sm" => u64::from(c),
                    _ => p,
                },
            })
        );
    }
    // The default's large-piece knobs; `new` applies one geometry to every
    // piece size, the default switches small pieces to the sweep's best.
    let t = GatherTuning::new(THREADS, CTAS_PER_SM, MAX_PIECE_BYTES).unwrap();
    let d = GatherTuning::default();
    assert_eq!(
        (t.threads(), t.ctas_per_sm(), t.max_piece_bytes()),
        (d.threads(), d.ctas_per_sm(), d.max_piece_bytes())
    );
    assert_eq!(t.geometry_for(256), (THREADS, CTAS_PER_SM));
    assert_eq!(d.geometry_for(256), (128, 4));
    assert_eq!(d.geometry_for(SMALL_PIECE_BYTES + 1), (256, 8));
}

#[test]
fn hf_pieces_launch_with_the_sweeps_best_geometry_by_default() {
    // H200 sweep: 8B -> HF at t128_c4 0.884 of raw, at 256 x 8 0.834.
    let g = geom_8b();
    let bb = g.rank_block_bytes() as u64;
    let donor = KvRegionLayout::block_major(g, 0, 0, 1024, 1024 * bb).unwrap();
    let max_tokens = 48 + 512 * 16;
    let hf_layer = 2 * 8 * max_tokens * 128 * 2;
    let hf = KvRegionLayout::hf_tokens(g, 0, 0, hf_layer, 1, 0, max_tokens, 48, 512, 32 * hf_layer)
        .unwrap();
    let moves: Vec<(u32, u32)> = (0..512).map(|i| (2 * i + 1, i)).collect();
    let p = ConvertPlan::new(&donor, &hf, &moves).unwrap();
    assert_eq!(p.pieces().piece_bytes, 256);
    let geo = p.geometry(0, 1 << 40, 132);
    assert_eq!((geo.threads, geo.grid_x), (128, 132 * 4));
    // Block-major rows keep 256 x 8.
    let bm = ConvertPlan::new(&donor, &donor, &[(0, 1)]).unwrap();
    let geo = bm.geometry(0, 0, 132);
    assert_eq!(geo.threads, 256);
    // An explicit tuning applies as given (the sweep, `KV_GATHER_*`).
    let t = GatherTuning::new(256, 8, 64 << 10).unwrap();
    let geo = p.geometry_tuned(0, 1 << 40, 132, &t);
    assert_eq!((geo.threads, geo.grid_x), (256, 132 * 8));
}

#[test]
fn tuning_sets_cta_size_grid_cap_and_piece_split() {
    let runs: Vec<CopyRun> = (0..1024u64)
        .map(|i| CopyRun {
            src_block: (2 * i + 1) as u32,
            dst_block: i as u32,
            src_offset: (2 * i + 1) << 16,
            dst_offset: i << 16,
            len: 1 << 16,
            blocks: 1,
        })
        .collect();
    let t = GatherTuning::new(512, 4, 16 << 10).unwrap();
    let p = ConvertPlan::from_runs_tuned(&runs, 1 << 16, 1 << 27, 1 << 26, &t).unwrap();
    assert_eq!(p.pieces().piece_bytes, 16 << 10);
    assert_eq!(p.pieces().len(), 4);
    let g = p.geometry_tuned(1 << 40, 1 << 41, 132, &t);
    assert_eq!((g.threads, g.grid_x, g.width), (512, 132 * 4, 16));
    // Default: 64 KiB pieces, 256 threads, 8 CTAs per SM.
    let d = ConvertPlan::from_runs(&runs, 1 << 16, 1 << 27, 1 << 26).unwrap();
    assert_eq!(d.pieces().len(), 1);
    let g = d.geometry(1 << 40, 1 << 41, 132);
    // One 64 KiB item per 256-thread CTA: 1024 CTAs, under the 132 x 8 cap.
    assert_eq!((g.threads, g.grid_x), (256, 1024));
    // A misaligned block offset still lowers the width (kept at construction).
    let mut odd = runs.clone();
    odd[700].dst_offset += (4 << 20) + 8;
    let o = ConvertPlan::from_runs(&odd, 1 << 16, 1 << 27, 1 << 27).unwrap();
    assert_eq!(o.geometry(1 << 40, 1 << 41, 132).width, 8);
}

#[test]
fn gpu_placement_shapes_with_16_kib_pieces_launch_wide() {
    // The shapes `every_table_placement_lands_every_byte_on_the_gpu` runs
    // to reach each placement's `_w` entry point.
    for (heads, n) in [(8, 128u32), (8, 129), (1, 1025), (1, 9000)] {
        let g = KvLayout::new(2, heads, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
        let bb = g.rank_block_bytes() as u64;
        let slots = 2 * n + 1;
        let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).unwrap();
        let target = KvRegionLayout::block_major(g, 0, 0, n, u64::from(n) * bb).unwrap();
        let moves: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - i) - 1, i)).collect();
        let p = ConvertPlan::new(&donor, &target, &moves).unwrap();
        let geo = p.geometry(0, 0, 132);
        assert_eq!((p.pieces().piece_bytes, geo.wide), (16 << 10, true), "{n}");
    }
}
