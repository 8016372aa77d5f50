use super::*;
use kv_descriptor::DType;
use proptest::prelude::*;
use std::collections::HashSet;

fn layout(tp: u32) -> KvLayout {
    KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, tp).unwrap()
}
fn mv(k: u64, s: Option<u32>, d: u32) -> BlockMove {
    BlockMove {
        key: SequenceHash(k),
        src_slot: s,
        dst_block: d,
    }
}

#[test]
fn coalesces_adjacent_pairs_only() {
    let l = layout(1);
    let bb = l.rank_block_bytes() as u64;
    let g = [RegionGeometry::dense(&l, 32)];
    // 5,6,7 -> 10,11,12 merge; 8 -> 20 breaks on the target side.
    let moves = [
        mv(1, Some(5), 10),
        mv(2, Some(6), 11),
        mv(3, Some(7), 12),
        mv(4, Some(8), 20),
    ];
    let p = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
    let runs = p.parts()[0].runs();
    assert_eq!(runs.len(), 2);
    assert_eq!(
        runs[0],
        CopyRun {
            src_block: 5,
            dst_block: 10,
            blocks: 3,
            src_offset: 5 * bb,
            dst_offset: 10 * bb,
            len: 3 * bb
        }
    );
    assert_eq!(
        (runs[1].src_offset, runs[1].dst_offset, runs[1].len),
        (8 * bb, 20 * bb, bb)
    );
}

#[test]
fn padded_stride_never_merges() {
    let l = layout(1);
    let bb = l.rank_block_bytes() as u64;
    let src = [RegionGeometry {
        stride_bytes: bb + 64,
        blocks: 8,
    }];
    let dst = [RegionGeometry::dense(&l, 8)];
    let p = TransferPlan::new(&l, &l, &[mv(1, Some(0), 0), mv(2, Some(1), 1)], &src, &dst).unwrap();
    assert_eq!(p.parts()[0].runs().len(), 2);
    assert_eq!(p.parts()[0].runs()[1].src_offset, bb + 64);
}

#[test]
fn rejects_geometry_mismatch_before_anything() {
    let a = layout(2);
    let b = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    let g = [RegionGeometry::dense(&a, 4); 2];
    let e = TransferPlan::new(&a, &b, &[mv(1, Some(0), 0)], &g, &g).unwrap_err();
    assert!(matches!(e, TransferError::LayoutMismatch { .. }), "{e}");
    let e = TransferPlan::new(&a, &a, &[mv(1, Some(0), 0)], &g[..1], &g).unwrap_err();
    assert!(e.to_string().contains("`donor`"), "{e}");
}

#[test]
fn rejects_bad_moves_naming_the_field() {
    let l = layout(1);
    let g = [RegionGeometry::dense(&l, 4)];
    let cases: [(&[BlockMove], &str); 5] = [
        (&[], "`moves`"),
        (&[mv(1, Some(4), 0)], "moves.src_slot"),
        (&[mv(1, Some(0), 4)], "moves.dst_block"),
        (&[mv(1, Some(0), 0), mv(2, Some(1), 0)], "written twice"),
        (&[mv(1, Some(0), 0), mv(1, Some(1), 1)], "moves.key"),
    ];
    for (moves, want) in cases {
        let e = TransferPlan::new(&l, &l, moves, &g, &g)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e} should mention {want}");
    }
}

fn regions(g: KvLayout, blocks: u32) -> Vec<KvRegionLayout> {
    let bb = g.rank_block_bytes() as u64;
    (0..g.tp_size())
        .map(|r| KvRegionLayout::block_major(g, r, 0, blocks, u64::from(blocks) * bb).unwrap())
        .collect()
}

#[test]
fn converting_between_bank_rows_is_the_row_plan() {
    let l = layout(2);
    let moves = [mv(1, Some(5), 10), mv(2, Some(6), 11), mv(3, None, 2)];
    let p = TransferPlan::converting(&regions(l, 16), &regions(l, 32), &moves).unwrap();
    let g = (
        [RegionGeometry::dense(&l, 16); 2],
        [RegionGeometry::dense(&l, 32); 2],
    );
    assert_eq!(p, TransferPlan::new(&l, &l, &moves, &g.0, &g.1).unwrap());
    assert!(p.parts().iter().all(|p| p.conversion().is_none()));
}

#[test]
fn converting_refuses_another_geometry_naming_the_field() {
    let l = layout(1);
    let donor = regions(l, 8);
    let cases = [
        (
            KvLayout::new(2, 4, 8, DType::Bf16, 4, TensorOrder::BlockMajor, 1).unwrap(),
            "geometry.dtype",
        ),
        (
            KvLayout::new(2, 4, 16, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap(),
            "geometry.head_dim",
        ),
        (
            KvLayout::new(2, 4, 8, DType::F32, 8, TensorOrder::BlockMajor, 1).unwrap(),
            "geometry.tokens_per_block",
        ),
    ];
    for (g, field) in cases {
        let bb = g.rank_block_bytes() as u64;
        let t = KvRegionLayout::vllm_kv_first(g, 0, 0, 8 * bb / 2, 8, 8 * bb).unwrap();
        let e = TransferPlan::converting(&donor, &[t], &[mv(1, Some(0), 0)]).unwrap_err();
        match &e {
            TransferError::RegionLayout {
                field: "target",
                rank: 0,
                source: kv_descriptor::RegionLayoutError::Incompatible { field: f, .. },
            } => assert_eq!(*f, field),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn converting_checks_engine_block_ids_against_the_target_layout() {
    let l = layout(1);
    let bb = l.rank_block_bytes() as u64;
    let t = [KvRegionLayout::vllm_block_first(l, 0, 0, 4 * bb / 2, 4, 4 * bb).unwrap()];
    let donor = regions(l, 8);
    for (moves, want) in [
        (vec![mv(1, Some(0), 4)], "moves.dst_block"),
        (vec![mv(1, Some(0), 1), mv(2, Some(1), 1)], "written twice"),
        (vec![mv(1, Some(8), 1)], "moves.src_slot"),
    ] {
        let e = TransferPlan::converting(&donor, &t, &moves)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e} should mention {want}");
    }
    let p = TransferPlan::converting(&donor, &t, &[mv(1, Some(7), 3)]).unwrap();
    let c = p.parts()[0].conversion().unwrap();
    assert!(p.parts()[0].runs().is_empty());
    assert_eq!(c.bytes(), bb);
}

/// Every row of `part.runs()`, in order, as `(slot, block)`.
fn rows_of(part: &PartPlan) -> Vec<(u32, u32)> {
    part.runs()
        .iter()
        .flat_map(|r| (0..r.blocks).map(move |k| (r.src_block + k, r.dst_block + k)))
        .collect()
}

#[test]
fn parts_past_128_blocks_with_16_bit_ids_carry_packed_rows() {
    let l = layout(2);
    let bb = l.rank_block_bytes() as u64;
    // Rank 0 dense (runs of 3 merge), rank 1 with a padded donor stride
    // (nothing merges): both pack the same ids, each with its strides.
    let donor = [
        RegionGeometry::dense(&l, 1000),
        RegionGeometry {
            stride_bytes: bb + 64,
            blocks: 1000,
        },
    ];
    let target = [RegionGeometry::dense(&l, 300); 2];
    let moves: Vec<BlockMove> = (0..300u32)
        .map(|i| mv(u64::from(i), Some(999 - (i / 3) * 3 - (2 - i % 3)), i))
        .collect();
    let p = TransferPlan::new(&l, &l, &moves, &donor, &target).unwrap();
    let (a, b) = (&p.parts()[0], &p.parts()[1]);
    assert_eq!((a.runs().len(), b.runs().len()), (100, 300));
    let (ra, rb) = (a.packed_rows().unwrap(), b.packed_rows().unwrap());
    for (part, rows, ss) in [(a, ra, bb), (b, rb, bb + 64)] {
        let want: Vec<u32> = rows_of(part).iter().map(|&(s, d)| s << 16 | d).collect();
        assert_eq!(rows.words(), &want[..]);
        assert_eq!(rows.strides(), (ss, bb));
        assert_eq!(rows.block_bytes(), bb);
        assert_eq!(rows.region_bytes(), part.region_ends());
        assert_eq!(part.region_ends(), (999 * ss + bb, 300 * bb));
    }
    assert!(std::ptr::eq(ra.words(), rb.words()), "ranks share the ids");
    // 128 blocks: the small inline table is written from the runs.
    let p = TransferPlan::new(&l, &l, &moves[..128], &donor, &target).unwrap();
    assert!(p.parts()[0].packed_rows().is_none());
    let p = TransferPlan::new(&l, &l, &moves[..129], &donor, &target).unwrap();
    assert_eq!(p.parts()[0].packed_rows().unwrap().blocks(), 129);
    // An id past 16 bits (regions larger than 65,536 rows): none, but a
    // larger region whose used ids all fit still packs.
    let big = [RegionGeometry::dense(&l, 70_000); 2];
    let mut far = moves.clone();
    far[7].src_slot = Some(65_536);
    let p = TransferPlan::new(&l, &l, &far, &big, &target).unwrap();
    assert!(p.parts().iter().all(|p| p.packed_rows().is_none()));
    far[7].src_slot = Some(65_535);
    let p = TransferPlan::new(&l, &l, &far, &big, &target).unwrap();
    assert!(p.parts().iter().all(|p| p.packed_rows().is_some()));
    // Missing keys are not rows.
    let mut gone = moves.clone();
    gone[5].src_slot = None;
    let p = TransferPlan::new(&l, &l, &gone, &donor, &target).unwrap();
    assert_eq!(p.parts()[0].packed_rows().unwrap().blocks(), 299);
}

#[test]
fn a_converting_part_needs_its_layouts_regions_and_has_no_rows() {
    let l = layout(1);
    let bb = l.rank_block_bytes() as u64;
    let t = [KvRegionLayout::vllm_block_first(l, 0, 0, 200 * bb / 2, 200, 200 * bb).unwrap()];
    let donor = regions(l, 400);
    let moves: Vec<BlockMove> = (0..200).map(|i| mv(u64::from(i), Some(2 * i), i)).collect();
    let p = TransferPlan::converting(&donor, &t, &moves).unwrap();
    let part = &p.parts()[0];
    assert!(part.packed_rows().is_none());
    assert_eq!(part.region_ends(), (400 * bb, 200 * bb));
    // Bank rows on both sides are the row plan, with its packed rows.
    let p = TransferPlan::converting(&donor, &regions(l, 200), &moves).unwrap();
    assert_eq!(p.parts()[0].packed_rows().unwrap().blocks(), 200);
    assert_eq!(p.parts()[0].region_ends(), (399 * bb, 200 * bb));
}

proptest! {
    /// Runs cover exactly the present moves, never overlap on the target,
    /// and stay inside both regions.
    #[test]
    fn runs_cover_present_moves(
        pairs in proptest::collection::btree_map(0u32..64, 0u32..64, 1..40),
        drop_mask in any::<u64>(),
    ) {
        let l = layout(2);
        let bb = l.rank_block_bytes() as u64;
        let g = [RegionGeometry::dense(&l, 64); 2];
        let mut used_dst = HashSet::new();
        let moves: Vec<_> = pairs
            .iter()
            .filter(|(_, d)| used_dst.insert(**d))
            .enumerate()
            .map(|(i, (s, d))| mv(i as u64, (drop_mask >> (i % 64) & 1 == 0).then_some(*s), *d))
            .collect();
        let p = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
        let present: Vec<_> = moves.iter().filter(|m| m.src_slot.is_some()).collect();
        prop_assert_eq!(p.missing().len(), moves.len() - present.len());
        for part in p.parts() {
            let mut covered = Vec::new();
            for r in part.runs() {
                prop_assert_eq!(r.len, u64::from(r.blocks) * bb);
                prop_assert!(r.src_offset + r.len <= part.src().region_bytes());
                prop_assert!(r.dst_offset + r.len <= part.dst().region_bytes());
                for k in 0..r.blocks {
                    covered.push((r.src_block + k, r.dst_block + k));
                }
            }
            // The ends found with the plan are the furthest run ends.
            let ends = part.runs().iter().fold((0, 0), |(s, d), r| {
                (s.max(r.src_offset + r.len), d.max(r.dst_offset + r.len))
            });
            prop_assert_eq!(part.region_ends(), ends);
            covered.sort_unstable();
            let mut want: Vec<_> = present.iter().map(|m| (m.src_slot.unwrap(), m.dst_block)).collect();
            want.sort_unstable();
            prop_assert_eq!(covered, want);
            prop_assert_eq!(part.expected_bytes(), present.len() as u64 * bb);
        }
    }

    /// The packed rows a backend launches from are the part's `runs()`,
    /// row for row and in order, over the part's own strides and ends:
    /// present exactly past [`INLINE_SMALL_BLOCKS`] rows whose ids all
    /// fit [`PACKED_MAX_BLOCK_ID`], on every rank (padded or dense), and
    /// a clone carries the same pair.
    #[test]
    fn packed_rows_are_the_runs(
        pairs in proptest::collection::btree_map(0u32..1200, 0u32..1200, 100..400),
        drop_mask in any::<u64>(),
        pads in (0u64..3, 0u64..3, 0u64..3, 0u64..3),
        far in proptest::option::of((any::<prop::sample::Index>(), 0u32..2)),
        big in any::<bool>(),
    ) {
        let l = layout(2);
        let bb = l.rank_block_bytes() as u64;
        let mut used_dst = HashSet::new();
        let mut moves: Vec<_> = pairs
            .iter()
            .filter(|(_, d)| used_dst.insert(**d))
            .enumerate()
            .map(|(i, (s, d))| mv(i as u64, (drop_mask >> (i % 64) & 1 == 0).then_some(*s), *d))
            .collect();
        // At times one id past 16 bits (a slot or a block), so no rank packs.
        if let Some((at, side)) = far {
            let i = at.index(moves.len());
            let m = &mut moves[i];
            if side == 0 && m.src_slot.is_some() {
                m.src_slot = Some(PACKED_MAX_BLOCK_ID + 1 + m.key.0 as u32);
            } else if side == 1 {
                m.dst_block = PACKED_MAX_BLOCK_ID + 1 + m.key.0 as u32;
            }
        }
        // Strides of 0, 64 or 128 bytes past the block on each side and
        // rank; regions past 65,536 rows (ids then checked one by one) or
        // not.
        let blocks = if big || far.is_some() { 70_000 } else { 1200 };
        let g = |pad: u64| RegionGeometry { stride_bytes: bb + 64 * pad, blocks };
        let donor = [g(pads.0), g(pads.1)];
        let target = [g(pads.2), g(pads.3)];
        let p = TransferPlan::new(&l, &l, &moves, &donor, &target).unwrap();
        for part in p.parts() {
            let rows = rows_of(part);
            prop_assert_eq!(rows.len(), p.present_blocks());
            prop_assert_eq!(part.expected_bytes(), rows.len() as u64 * bb);
            let fits = rows.iter().all(|&(s, d)| s.max(d) <= PACKED_MAX_BLOCK_ID);
            let packs = rows.len() > INLINE_SMALL_BLOCKS && fits;
            prop_assert_eq!(part.packed_rows().is_some(), packs);
            if let Some(packed) = part.packed_rows() {
                let want: Vec<u32> = rows.iter().map(|&(s, d)| s << 16 | d).collect();
                prop_assert_eq!(packed.words(), &want[..]);
                prop_assert_eq!(packed.blocks(), rows.len());
                prop_assert_eq!(
                    packed.strides(),
                    (part.src().stride_bytes, part.dst().stride_bytes)
                );
                prop_assert_eq!(packed.block_bytes(), bb);
                prop_assert_eq!(packed.region_bytes(), part.region_ends());
            }
            let copy = part.clone();
            prop_assert_eq!(copy.runs(), part.runs());
            prop_assert_eq!(copy.packed_rows(), part.packed_rows());
            prop_assert_eq!(copy.region_ends(), part.region_ends());
        }
    }
}
