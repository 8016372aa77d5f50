//! Pure-Rust mirror of the converting gather's per-thread index math, and a
//! host reference built from [`KvRegionLayout::run_offset`] per element.
//!
//! [`run_kernel`] executes every thread of every CTA of a [`LaunchGeometry`]
//! with the same integer arithmetic as [`super::CONVERT_KERNEL_SRC`] (group,
//! lane, work item, block / piece split, the eight-wide step of the `_w`
//! entry points, the four-wide unrolled loop and its tail), on a byte array standing in for device memory. The proptest below
//! runs it for every pair of region orders and checks the target bytes
//! against the reference, so an indexing bug is caught without a GPU.

use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
use proptest::prelude::*;

use super::{reference_convert, ConvertPlan, GatherTuning, LaunchGeometry, INLINE_LARGE_ENTRIES};

/// The block table as the entry point reads it.
pub(super) enum Table<'a> {
    /// `kv_convert_*`, `_s*`, `_l*`: `2n` addresses (`KV_TABLE_*`, `KV_PARAM_*`).
    Addrs(&'a [u64]),
    /// `kv_convert_p*`: packed ids, bases and strides (`KV_PACKED_*`).
    Packed {
        words: &'a [u32],
        bases: (u64, u64),
        strides: (u64, u64),
    },
}

impl Table<'_> {
    /// `SRC(i)` and `DST(i)` of `KV_LOOP` for a launch of `n` blocks.
    fn bases(&self, n: u32, i: u32) -> (u64, u64) {
        match self {
            Table::Addrs(b) => (b[i as usize], b[(n + i) as usize]),
            Table::Packed {
                words,
                bases,
                strides,
            } => {
                let w = words[i as usize];
                (
                    bases.0 + u64::from(w >> 16) * strides.0,
                    bases.1 + u64::from(w & 0xFFFF) * strides.1,
                )
            }
        }
    }
}

/// Runs the kernel of `g` over `mem` (addresses are indices into it).
/// `writes[a]` counts the stores to byte `a`. Panics on a misaligned access,
/// where the GPU would fault.
pub(super) fn run_kernel(
    g: &LaunchGeometry,
    blocks: &Table<'_>,
    pieces: &[u64],
    mem: &mut [u8],
    writes: &mut [u8],
) {
    let (n, np, pe, w) = (g.n, g.num_pieces, g.piece_elems, g.width as usize);
    let gsz = 1u32 << g.group_shift;
    let total = n * np;
    let ngroups = (g.grid_x * g.threads) >> g.group_shift;
    let mut copy = |s: u64, d: u64, e: u32| {
        let (s, d) = (s as usize + e as usize * w, d as usize + e as usize * w);
        assert!(s % w == 0 && d % w == 0, "misaligned {w}-byte access");
        for b in 0..w {
            mem[d + b] = mem[s + b];
            writes[d + b] += 1;
        }
    };
    for cta in 0..g.grid_x {
        for tid in 0..g.threads {
            let lane = tid & (gsz - 1);
            let mut r = (cta * g.threads + tid) >> g.group_shift;
            while r < total {
                let i = if g.piece_shift == u32::MAX {
                    r / np
                } else {
                    r >> g.piece_shift
                };
                let p = r - i * np;
                let (sb, db) = blocks.bases(n, i);
                let sp = sb + pieces[p as usize];
                let dp = db + pieces[(np + p) as usize];
                let mut e = lane;
                // KV_STEP8: compiled into the `_w` entry points only.
                while g.wide && e + 7 * gsz < pe {
                    for k in 0..8 {
                        copy(sp, dp, e + k * gsz);
                    }
                    e += 8 * gsz;
                }
                while e + 3 * gsz < pe {
                    for k in 0..4 {
                        copy(sp, dp, e + k * gsz);
                    }
                    e += 4 * gsz;
                }
                while e < pe {
                    copy(sp, dp, e);
                    e += gsz;
                }
                r += ngroups;
            }
        }
    }
}

/// A region of `order` (0 block-major, 1 vLLM kv-first, 2 vLLM block-first,
/// 3 HF at a token offset) with `base` bytes before layer 0 and `pad` bytes
/// of padding per layer.
fn region(g: &KvLayout, order: u8, blocks: u32, base: u64, pad: u64) -> KvRegionLayout {
    let e = g.dtype().size_bytes() as u64;
    let (t, h, d) = (
        u64::from(g.tokens_per_block()),
        u64::from(g.heads_per_rank()),
        u64::from(g.head_dim()),
    );
    let layers = u64::from(g.num_layers());
    let nb = u64::from(blocks);
    match order {
        0 => {
            let bytes = base + nb * g.rank_block_bytes() as u64;
            KvRegionLayout::block_major(*g, 0, base, blocks, bytes).unwrap()
        }
        1 | 2 => {
            let stride = 2 * nb * t * h * d * e + pad;
            let bytes = base + layers * stride;
            if order == 1 {
                KvRegionLayout::vllm_kv_first(*g, 0, base, stride, blocks, bytes).unwrap()
            } else {
                KvRegionLayout::vllm_block_first(*g, 0, base, stride, blocks, bytes).unwrap()
            }
        }
        _ => {
            let (batch, max_tokens) = (2u32, (nb + 2) * t);
            let stride = 2 * u64::from(batch) * h * max_tokens * d * e + pad;
            let bytes = base + layers * stride;
            KvRegionLayout::hf_tokens(
                *g,
                0,
                base,
                stride,
                batch,
                1,
                max_tokens,
                t + 1,
                blocks,
                bytes,
            )
            .unwrap()
        }
    }
}

/// Runs plan `moves` between `donor` and `target` through the mirror with the
/// regions at byte addresses `src_at` / `dst_at`, and checks every target byte
/// against the reference and that none was stored twice.
fn check(
    donor: &KvRegionLayout,
    target: &KvRegionLayout,
    moves: &[(u32, u32)],
    src_at: u64,
    dst_at: u64,
    sms: u32,
    tuning: &GatherTuning,
) -> Result<LaunchGeometry, TestCaseError> {
    let plan = ConvertPlan::new_tuned(donor, target, moves, tuning).unwrap();
    let (sl, dl) = (donor.region_bytes(), target.region_bytes());
    prop_assert!(src_at + sl <= dst_at);
    let size = (dst_at + dl) as usize;
    let mut mem: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8 | 1).collect();
    // Target starts zeroed; the donor pattern never has a zero byte.
    mem[dst_at as usize..].fill(0);
    let src = mem[src_at as usize..(src_at + sl) as usize].to_vec();
    let mut want = vec![0u8; dl as usize];
    reference_convert(donor, target, moves, &src, &mut want).unwrap();
    let g = plan.geometry_tuned(src_at, dst_at, sms, tuning);
    prop_assert_eq!(g.threads, tuning.geometry_for(plan.pieces().piece_bytes).0);
    let mut writes = vec![0u8; size];
    // As the launch fills it: the inline parameter image (or the staging
    // buffer), whose entries past `2n` are stale from earlier fetches; a
    // read of one would address far outside `mem` and panic.
    let mut table = vec![u64::MAX / 2; INLINE_LARGE_ENTRIES.max(2 * plan.blocks())];
    plan.write_block_table(src_at, dst_at, &mut table);
    // Fetches of 2,033..=8,128 blocks launch with packed ids.
    let packed = plan.packed().map(|p| Table::Packed {
        words: &p.words,
        bases: (src_at, dst_at),
        strides: (p.src_stride, p.dst_stride),
    });
    let t = packed.unwrap_or(Table::Addrs(&table));
    run_kernel(&g, &t, &plan.piece_table(), &mut mem, &mut writes);
    prop_assert!(
        writes[..dst_at as usize].iter().all(|&c| c == 0),
        "donor written"
    );
    prop_assert!(writes.iter().all(|&c| c <= 1), "a byte stored twice");
    let written = writes[dst_at as usize..]
        .iter()
        .filter(|&&c| c == 1)
        .count() as u64;
    prop_assert_eq!(written, plan.bytes());
    prop_assert_eq!(
        plan.bytes(),
        moves.len() as u64 * donor.geometry().rank_block_bytes() as u64
    );
    prop_assert!(
        mem[dst_at as usize..] == want[..],
        "target differs from reference"
    );
    Ok(g)
}

fn dtype(k: u8) -> DType {
    [DType::Fp8E4m3, DType::Bf16, DType::Fp16, DType::F32][k as usize % 4]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// Every donor order to every target order, random geometry, block ids,
    /// region padding and (mis)alignment of the region addresses.
    #[test]
    fn mirror_matches_reference_for_every_layout_pair(
        layers in 1u32..4, heads in 1u32..4, head_dim_pow in 0u32..5, dt in 0u8..4,
        tokens in 1u32..5, src_order in 0u8..4, dst_order in 0u8..4,
        pick in proptest::collection::vec((0u32..6, 0u32..5), 1..6),
        base in 0u64..3, pad in 0u64..3, src_mis in 0u64..17, dst_mis in 0u64..17,
        sms in 1u32..3, threads_pow in 5u32..11, ctas in 1u32..9, piece_pow in 10u32..22,
    ) {
        // Any tuning the benchmark sweep may pick must stay byte-exact.
        let tuning = GatherTuning::new(1 << threads_pow, ctas, 1 << piece_pow).unwrap();
        let g = KvLayout::new(layers, heads, 1 << head_dim_pow, dtype(dt), tokens,
                              TensorOrder::BlockMajor, 1).unwrap();
        let e = g.dtype().size_bytes() as u64;
        let donor = region(&g, src_order, 6, base * e, pad * 16 * e);
        let target = region(&g, dst_order, 5, base * 3 * e, pad * 8 * e);
        let mut seen = std::collections::HashSet::new();
        let moves: Vec<(u32, u32)> = pick.into_iter().filter(|m| seen.insert(m.1)).collect();
        // Region addresses: 4 KiB aligned plus a multiple of the element size.
        let src_at = 4096 + (src_mis * e) % 16;
        let dst_at = (src_at + donor.region_bytes()).next_multiple_of(4096) + (dst_mis * e) % 16;
        check(&donor, &target, &moves, src_at, dst_at, sms, &tuning)?;
    }
}

#[test]
fn mirror_covers_the_bench_shapes_at_16_bytes() {
    // The 8B shape cut down to 2 layers (same per-layer pieces): block-major
    // -> vLLM kv-first and -> HF, and block-major -> block-major, all 16-byte.
    let g = KvLayout::new(2, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let donor = region(&g, 0, 6, 0, 0);
    let moves = [(5, 0), (1, 3), (3, 1)];
    for order in [0, 1, 3] {
        let target = region(&g, order, 5, 0, 0);
        let geo = check(
            &donor,
            &target,
            &moves,
            4096,
            1 << 22,
            132,
            &GatherTuning::default(),
        )
        .unwrap();
        assert_eq!(geo.width, 16, "order {order}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// The `deliver` path: a `TransferPlan`'s coalesced or padded rows through
    /// `ConvertPlan::from_runs` land exactly like one memcpy per run.
    #[test]
    fn mirror_matches_memcpy_for_transfer_plan_runs(
        pairs in proptest::collection::btree_map(0u32..40, 0u32..40, 1..24),
        block_pow in 0u32..3, pad in 0u64..2, src_mis in 0u64..4, sms in 1u32..3,
    ) {
        use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
        use kv_descriptor::SequenceHash;
        // 1, 2 or 4 layers of 4 KiB... rank blocks of 2 KiB x 2^block_pow.
        let l = KvLayout::new(1 << block_pow, 2, 16, DType::Bf16, 16, TensorOrder::BlockMajor, 1)
            .unwrap();
        let bb = l.rank_block_bytes() as u64;
        let mut used = std::collections::HashSet::new();
        let moves: Vec<BlockMove> = pairs
            .iter()
            .filter(|(_, d)| used.insert(**d))
            .enumerate()
            .map(|(i, (&s, &d))| BlockMove { key: SequenceHash(i as u64), src_slot: Some(s), dst_block: d })
            .collect();
        let src_g = RegionGeometry { stride_bytes: bb + pad * 48, blocks: 40 };
        let dst_g = RegionGeometry::dense(&l, 40);
        let plan = TransferPlan::new(&l, &l, &moves, &[src_g], &[dst_g]).unwrap();
        let runs = plan.parts()[0].runs();
        let cp = ConvertPlan::from_runs(runs, bb, src_g.region_bytes(), dst_g.region_bytes())
            .unwrap();
        prop_assert_eq!(cp.bytes(), plan.expected_bytes());
        let src_at = 4096 + src_mis * 4;
        let dst_at = (src_at + src_g.region_bytes()).next_multiple_of(4096);
        let size = (dst_at + dst_g.region_bytes()) as usize;
        let mut mem: Vec<u8> = (0..size).map(|i| (i * 13 + i / 257) as u8 | 1).collect();
        mem[dst_at as usize..].fill(0);
        let mut want = mem.clone();
        for r in runs {
            let (s, d) = ((src_at + r.src_offset) as usize, (dst_at + r.dst_offset) as usize);
            want.copy_within(s..s + r.len as usize, d);
        }
        let g = cp.geometry(src_at, dst_at, sms);
        let mut writes = vec![0u8; size];
        run_kernel(&g, &Table::Addrs(&cp.block_table(src_at, dst_at)), &cp.piece_table(), &mut mem,
                   &mut writes);
        prop_assert!(writes.iter().all(|&c| c <= 1), "a byte stored twice");
        prop_assert!(mem == want, "target differs from one memcpy per run");
    }
}

/// Host and GPU agree: for a converting `TransferPlan` (the plan `deliver`
/// hands the CUDA backend), the kernel run over the `ConvertPlan` built from
/// the part's `Conversion` writes the same target bytes as copying
/// `Conversion::pieces` (what the host backend does).
#[test]
fn mirror_matches_the_host_pieces_of_a_converting_transfer_plan() {
    use crate::plan::{BlockMove, TransferPlan};
    use kv_descriptor::SequenceHash;
    let g = KvLayout::new(2, 2, 8, DType::Bf16, 4, TensorOrder::BlockMajor, 1).unwrap();
    let donor = region(&g, 0, 6, 0, 0);
    let moves: Vec<BlockMove> = [(4, 2), (0, 0), (5, 4), (2, 1)]
        .iter()
        .enumerate()
        .map(|(i, &(s, d))| BlockMove {
            key: SequenceHash(i as u64),
            src_slot: Some(s),
            dst_block: d,
        })
        .collect();
    for order in 1..4 {
        let target = region(&g, order, 5, 32, 16);
        let plan = TransferPlan::converting(
            std::slice::from_ref(&donor),
            std::slice::from_ref(&target),
            &moves,
        )
        .unwrap();
        let c = plan.parts()[0].conversion().expect("a converting part");
        let pairs: Vec<(u32, u32)> = c
            .pairs()
            .iter()
            .map(|p| (p.src_block, p.dst_block))
            .collect();
        let cp = ConvertPlan::new(c.src(), c.dst(), &pairs).unwrap();
        assert_eq!(cp.bytes(), c.bytes());
        let (src_at, dst_at) = (4096u64, 1u64 << 20);
        let size = (dst_at + target.region_bytes()) as usize;
        let mut mem: Vec<u8> = (0..size).map(|i| (i * 5 + i / 241) as u8 | 1).collect();
        mem[dst_at as usize..].fill(0);
        let mut host = mem.clone();
        for p in c.pieces() {
            let (s, d) = (
                (src_at + p.src_offset) as usize,
                (dst_at + p.dst_offset) as usize,
            );
            host.copy_within(s..s + p.len as usize, d);
        }
        let geo = cp.geometry(src_at, dst_at, 2);
        let mut writes = vec![0u8; size];
        run_kernel(
            &geo,
            &Table::Addrs(&cp.block_table(src_at, dst_at)),
            &cp.piece_table(),
            &mut mem,
            &mut writes,
        );
        assert!(mem == host, "order {order}: kernel and host pieces differ");
    }
}

/// Fetches of 2,033..=8,128 blocks launch with packed 16-bit ids
/// (`kv_convert_p*`): the mirror decodes them as the kernel does, for every
/// target order, and for a `deliver` part's single-block rows over a padded
/// donor stride.
#[test]
fn mirror_lands_packed_id_fetches_like_the_reference() {
    let g = KvLayout::new(1, 1, 8, DType::Bf16, 1, TensorOrder::BlockMajor, 1).unwrap();
    let n = 2100u32;
    let donor = region(&g, 0, 2 * n + 1, 0, 0);
    // Donor slots odd and reversed, target ids in order: both sides scattered.
    let moves: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - i) - 1, i)).collect();
    for order in 0..4 {
        let target = region(&g, order, n, 32, 16);
        let plan = ConvertPlan::new(&donor, &target, &moves).unwrap();
        let p = plan.packed().expect("2,100 blocks use packed ids");
        assert_eq!(p.words[0], (2 * n - 1) << 16);
        // Without the inline module the device table holds the addresses the
        // packed entry points would form.
        let e = g.dtype().size_bytes() as u64;
        let (ss, ds) = (donor.strides().block * e, target.strides().block * e);
        let t = plan.block_table(1 << 20, 1 << 30);
        for (i, &(s, d)) in moves.iter().enumerate() {
            assert_eq!(t[i], (1 << 20) + u64::from(s) * ss);
            assert_eq!(t[n as usize + i], (1 << 30) + u64::from(d) * ds);
        }
        let dst_at = (4096 + donor.region_bytes()).next_multiple_of(4096);
        check(
            &donor,
            &target,
            &moves,
            4096,
            dst_at,
            2,
            &GatherTuning::default(),
        )
        .unwrap();
    }
    // Rows of a TransferPlan part: donor stride 48 bytes (padded), target dense.
    let bb = g.rank_block_bytes() as u64;
    let runs: Vec<crate::plan::CopyRun> = (0..n)
        .map(|i| crate::plan::CopyRun {
            src_block: 2 * i + 1,
            dst_block: n - 1 - i,
            blocks: 1,
            src_offset: u64::from(2 * i + 1) * 48,
            dst_offset: u64::from(n - 1 - i) * bb,
            len: bb,
        })
        .collect();
    let (sl, dl) = (u64::from(2 * n + 2) * 48, u64::from(n) * bb);
    let cp = ConvertPlan::from_runs(&runs, bb, sl, dl).unwrap();
    let p = cp.packed().expect("packed rows");
    assert_eq!((p.src_stride, p.dst_stride), (48, bb));
    let (src_at, dst_at) = (4096u64, 4096 + sl.next_multiple_of(4096));
    let size = (dst_at + dl) as usize;
    let mut mem: Vec<u8> = (0..size).map(|i| (i * 11 + i / 253) as u8 | 1).collect();
    mem[dst_at as usize..].fill(0);
    let mut want = mem.clone();
    for r in &runs {
        let (s, d) = (
            (src_at + r.src_offset) as usize,
            (dst_at + r.dst_offset) as usize,
        );
        want.copy_within(s..s + r.len as usize, d);
    }
    let geo = cp.geometry(src_at, dst_at, 2);
    let t = Table::Packed {
        words: &p.words,
        bases: (src_at, dst_at),
        strides: (p.src_stride, p.dst_stride),
    };
    let mut writes = vec![0u8; size];
    run_kernel(&geo, &t, &cp.piece_table(), &mut mem, &mut writes);
    assert!(writes.iter().all(|&c| c <= 1), "a byte stored twice");
    assert!(mem == want, "packed rows differ from one memcpy per run");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A `deliver` part launched from its plan's packed rows, as
    /// `CudaCopyBackend::gather_rows` issues it: one launch, or chunks of
    /// `Pipeline::block_chunks` (cutting through merged runs too), each its
    /// own geometry, piece table from the kept tables and block table in
    /// the placement its size picks (small u64 image with stale entries, or
    /// packed ids). Every target byte equals one memcpy per run, no byte is
    /// stored twice, and nothing outside the moved rows is written.
    #[test]
    fn mirror_lands_a_part_from_its_packed_rows_chunk_by_chunk(
        bb_kind in 0u8..3, n in 140u32..700, merge in 0u32..4, src_pad in 0u64..3,
        dst_pad in 0u64..2, first_kib in prop_oneof![Just(64u64), Just(256), Just(8192)],
        growth in 2u64..5, pipelined in any::<bool>(), missing in 0u32..5,
    ) {
        use crate::cuda_gather::{BlockSource, ContiguousPieces, Pipeline, TablePlacement};
        use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
        use kv_descriptor::SequenceHash;
        let l = match bb_kind {
            0 => KvLayout::new(1, 1, 8, DType::Bf16, 2, TensorOrder::BlockMajor, 1),
            1 => KvLayout::new(1, 2, 16, DType::Bf16, 2, TensorOrder::BlockMajor, 1),
            _ => KvLayout::new(2, 1, 32, DType::Bf16, 16, TensorOrder::BlockMajor, 1),
        }
        .unwrap();
        let bb = l.rank_block_bytes() as u64;
        // Runs of `merge + 1` consecutive slots to consecutive blocks (they
        // merge over dense regions), shuffled target groups, a few keys gone.
        let group = merge + 1;
        let groups = n.div_ceil(group);
        let mut order: Vec<u32> = (0..groups).collect();
        let mut x = u64::from(n) | 1;
        for i in (1..order.len()).rev() {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        let moves: Vec<BlockMove> = (0..n)
            .map(|i| {
                let (gi, k) = (i / group, i % group);
                BlockMove {
                    key: SequenceHash(u64::from(i)),
                    src_slot: (missing == 0 || i % 97 != missing).then_some(
                        (2 * (groups - 1 - gi) + 1) * group + k),
                    dst_block: order[gi as usize] * group + k,
                }
            })
            .collect();
        let slots = (2 * groups + 1) * group;
        let (ss, ds) = (bb + src_pad * 16, bb + dst_pad * 32);
        let plan = TransferPlan::new(
            &l, &l, &moves,
            &[RegionGeometry { stride_bytes: ss, blocks: slots }],
            &[RegionGeometry { stride_bytes: ds, blocks: groups * group }],
        )
        .unwrap();
        let part = &plan.parts()[0];
        let rows = part.packed_rows().expect("more than 128 blocks, 16-bit ids");
        prop_assert_eq!(rows.blocks() as u64 * bb, part.expected_bytes());
        prop_assert_eq!(rows.region_bytes(), part.region_ends());
        let (sl, dl) = (u64::from(slots) * ss, u64::from(groups * group) * ds);
        prop_assert!(part.region_ends().0 <= sl && part.region_ends().1 <= dl);
        let (src_at, dst_at) = (4096u64, 4096 + sl.next_multiple_of(4096));
        let size = (dst_at + dl) as usize;
        let mut mem: Vec<u8> = (0..size).map(|i| (i * 13 + i / 241) as u8 | 1).collect();
        mem[dst_at as usize..].fill(0);
        let mut want = mem.clone();
        for r in part.runs() {
            let (s, d) = ((src_at + r.src_offset) as usize, (dst_at + r.dst_offset) as usize);
            want.copy_within(s..s + r.len as usize, d);
        }
        let tuning = GatherTuning::default();
        let pipeline = Pipeline::new(first_kib << 10, growth).unwrap();
        let ranges: Vec<(usize, usize)> = if pipelined {
            pipeline.block_chunks(rows.blocks(), bb).collect()
        } else {
            vec![(0, rows.blocks())]
        };
        let mut pieces = ContiguousPieces::default();
        let mut writes = vec![0u8; size];
        let mut image = vec![u64::MAX / 2; INLINE_LARGE_ENTRIES];
        let mut bytes = 0;
        for (start, len) in ranges {
            let g = rows.gather(start, len, pieces.get(bb, len, tuning.max_piece_bytes())).unwrap();
            let geo = g.geometry_tuned(src_at, dst_at, 2, &tuning);
            let placement = TablePlacement::for_blocks(len, true, true);
            let p = g.packed_ref().unwrap();
            let table = if placement == TablePlacement::InlineSmall {
                g.write_block_table(src_at, dst_at, &mut image);
                Table::Addrs(&image)
            } else {
                prop_assert!(placement.packed_capacity().is_some_and(|c| len <= c));
                Table::Packed { words: p.words, bases: (src_at, dst_at),
                                strides: (p.src_stride, p.dst_stride) }
            };
            let pt: Vec<u64> = g.pieces_arc().src.iter().chain(&g.pieces_arc().dst).copied().collect();
            run_kernel(&geo, &table, &pt, &mut mem, &mut writes);
            bytes += g.bytes();
        }
        prop_assert_eq!(bytes, part.expected_bytes());
        prop_assert!(writes.iter().all(|&c| c <= 1), "a byte stored twice");
        prop_assert_eq!(writes.iter().filter(|&&c| c == 1).count() as u64, part.expected_bytes());
        prop_assert!(mem == want, "target differs from one memcpy per run");
    }
}

/// Bytes of `layout`'s region that hold layers `layers` of any block.
fn layer_bytes(layout: &KvRegionLayout, layers: std::ops::Range<u32>) -> Vec<bool> {
    let g = layout.geometry();
    let e = g.dtype().size_bytes() as u64;
    let mut mask = vec![false; layout.region_bytes() as usize];
    for l in layers {
        for b in 0..layout.num_blocks() {
            for kv in 0..2 {
                for t in 0..g.tokens_per_block() {
                    for h in 0..g.heads_per_rank() {
                        let at = layout.run_offset(l, b, kv, t, h).unwrap();
                        for d in 0..u64::from(g.head_dim()) {
                            let o = (at + d * layout.strides().dim * e) as usize;
                            mask[o..o + e as usize].fill(true);
                        }
                    }
                }
            }
        }
    }
    mask
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// A fetch released layer group by layer group (`LayeredShape::plans`,
    /// one launch per group): after the launches of groups `0..=k` every
    /// target byte of their layers is the reference's and no byte of a
    /// later layer was written; all groups together land exactly the whole
    /// plan's bytes, each once.
    #[test]
    fn layer_group_plans_land_their_layers_only_and_together_the_whole_fetch(
        layers in 1u32..7, groups in 1u32..6, heads in 1u32..3, tokens in 1u32..4,
        dt in 0u8..4, src_order in 0u8..4, dst_order in 0u8..4,
        pick in proptest::collection::vec((0u32..6, 0u32..5), 1..6), sms in 1u32..3,
    ) {
        let g = KvLayout::new(layers, heads, 8, dtype(dt), tokens, TensorOrder::BlockMajor, 1)
            .unwrap();
        let donor = region(&g, src_order, 6, 0, 0);
        let target = region(&g, dst_order, 5, 0, 0);
        let mut seen = std::collections::HashSet::new();
        let moves: Vec<(u32, u32)> = pick.into_iter().filter(|m| seen.insert(m.1)).collect();
        let tuning = GatherTuning::default();
        let whole = std::sync::Arc::new(super::ConvertShape::new(&donor, &target, &tuning).unwrap());
        let layered = super::LayeredShape::new(whole, groups).unwrap();
        let plans = layered.plans(&moves).unwrap();
        let ranges: Vec<_> = plans.iter().map(|(r, _)| r.clone()).collect();
        prop_assert_eq!(ranges, crate::layer_group_ranges(layers, groups));
        let (sl, dl) = (donor.region_bytes(), target.region_bytes());
        let (src_at, dst_at) = (0u64, sl.next_multiple_of(4096));
        let size = (dst_at + dl) as usize;
        let mut mem: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8 | 1).collect();
        mem[dst_at as usize..].fill(0);
        let mut want = vec![0u8; dl as usize];
        reference_convert(&donor, &target, &moves, &mem[..sl as usize], &mut want).unwrap();
        let mut writes = vec![0u8; size];
        let mut bytes = 0;
        for (r, plan) in &plans {
            let geo = plan.geometry_tuned(src_at, dst_at, sms, &tuning);
            let mut table = vec![u64::MAX / 2; INLINE_LARGE_ENTRIES.max(2 * plan.blocks())];
            plan.write_block_table(src_at, dst_at, &mut table);
            run_kernel(&geo, &Table::Addrs(&table), &plan.piece_table(), &mut mem, &mut writes);
            bytes += plan.bytes();
            let done = layer_bytes(&target, 0..r.end);
            let t = &mem[dst_at as usize..];
            for (i, &d) in done.iter().enumerate() {
                if d {
                    prop_assert_eq!(t[i], want[i], "layer byte {} after layers ..{}", i, r.end);
                } else {
                    prop_assert_eq!(writes[dst_at as usize + i], 0, "byte {} of a later layer", i);
                }
            }
        }
        prop_assert!(writes.iter().all(|&c| c <= 1), "a byte stored twice");
        prop_assert_eq!(bytes, moves.len() as u64 * g.rank_block_bytes() as u64);
        prop_assert!(mem[dst_at as usize..] == want[..], "target differs from reference");
    }
}
