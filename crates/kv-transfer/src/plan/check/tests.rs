//! The moves check against the one it replaced (three SipHash `HashSet`s and
//! a sort), kept here as the reference: the same plan, or the same error
//! (variant, field and reason) for the same input.

use std::collections::HashSet;

use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
use proptest::prelude::*;

use super::super::{packed_words, row_part, RegionGeometry, TransferPlan};
use super::*;

/// The check as it was before bitmaps and [`Buckets`] (verbatim but for the
/// sort, which `TransferPlan::new` did after it).
fn reference_check_moves(
    moves: &[BlockMove],
    src_limit: u32,
    dst_limit: u32,
) -> Result<(Vec<SlotToBlock>, Vec<MissingKey>), TransferError> {
    if moves.is_empty() {
        return Err(TransferError::input(
            "moves",
            "at least one block must be requested",
        ));
    }
    let (mut keys, mut dsts, mut srcs) = (HashSet::new(), HashSet::new(), HashSet::new());
    let mut present = Vec::with_capacity(moves.len());
    let mut missing = Vec::new();
    for (i, m) in moves.iter().enumerate() {
        if !keys.insert(m.key) {
            return Err(TransferError::input(
                "moves.key",
                format!("move {i}: key {:?} listed twice", m.key),
            ));
        }
        if m.dst_block >= dst_limit {
            return Err(TransferError::input(
                "moves.dst_block",
                format!(
                    "move {i}: block {} is not below the target's {dst_limit} blocks",
                    m.dst_block
                ),
            ));
        }
        if !dsts.insert(m.dst_block) {
            return Err(TransferError::input(
                "moves.dst_block",
                format!("move {i}: block {} is written twice", m.dst_block),
            ));
        }
        match m.src_slot {
            None => missing.push(MissingKey {
                index: i,
                key: m.key,
                dst_block: m.dst_block,
            }),
            Some(s) => {
                if s >= src_limit {
                    return Err(TransferError::input(
                        "moves.src_slot",
                        format!("move {i}: slot {s} is not below the donor's {src_limit} slots"),
                    ));
                }
                if !srcs.insert(s) {
                    return Err(TransferError::input(
                        "moves.src_slot",
                        format!("move {i}: slot {s} listed twice"),
                    ));
                }
                present.push((s, m.dst_block));
            }
        }
    }
    present.sort_unstable();
    Ok((present, missing))
}

/// `TransferPlan::new` as it was, for inputs whose geometry passes (the
/// geometry checks before the moves are unchanged).
fn reference_plan(
    l: &KvLayout,
    moves: &[BlockMove],
    donor: &[RegionGeometry],
    target: &[RegionGeometry],
) -> Result<TransferPlan, TransferError> {
    let bb = l.rank_block_bytes() as u64;
    let src_limit = donor.iter().map(|g| g.blocks).min().unwrap_or(0);
    let dst_limit = target.iter().map(|g| g.blocks).min().unwrap_or(0);
    let (present, missing) = reference_check_moves(moves, src_limit, dst_limit)?;
    let words = packed_words(&present, src_limit, dst_limit);
    let parts = (0..donor.len())
        .map(|r| row_part(r as u32, &present, bb, donor[r], target[r], words.as_ref()))
        .collect();
    Ok(TransferPlan {
        parts,
        missing,
        rank_block_bytes: bb,
        present_blocks: present.len(),
    })
}

/// Equal results; errors compared whole (variant, field, reason).
fn same<T: PartialEq + std::fmt::Debug>(
    got: Result<T, TransferError>,
    want: Result<T, TransferError>,
) -> Result<(), TestCaseError> {
    match (got, want) {
        (Ok(g), Ok(w)) => prop_assert_eq!(g, w),
        (Err(g), Err(w)) => prop_assert_eq!(format!("{g:?}"), format!("{w:?}")),
        (g, w) => prop_assert!(false, "got {:?}, want {:?}", g, w),
    }
    Ok(())
}

/// Every way the check can run: bitmaps (a slot table or ranks), hashing
/// every set, and hashing into a `BTreeSet` at the first bucket overflow.
const MODES: [Sets; 3] = [
    Sets::AUTO,
    Sets {
        bitmaps: false,
        probes_per_bucket: 4,
    },
    Sets {
        bitmaps: false,
        probes_per_bucket: 0,
    },
];

fn mv(k: u64, s: Option<u32>, d: u32) -> BlockMove {
    BlockMove {
        key: SequenceHash(k),
        src_slot: s,
        dst_block: d,
    }
}

/// Ids from a small pool (duplicates) and anywhere up to `u32::MAX`.
fn id() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0u32..40, 1 => any::<u32>(), 1 => (u32::MAX - 2)..=u32::MAX]
}

/// Limits small (bitmaps), around the bitmap threshold, and past it.
fn limit() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 0u32..48, 1 => 65_000u32..70_000, 1 => Just(u32::MAX), 1 => any::<u32>()]
}

fn moves_any() -> impl Strategy<Value = Vec<BlockMove>> {
    proptest::collection::vec(
        (
            prop_oneof![4 => 0u64..48, 1 => any::<u64>()],
            proptest::option::weighted(0.8, id()),
            id(),
        ),
        0..48,
    )
    .prop_map(|v| v.into_iter().map(|(k, s, d)| mv(k, s, d)).collect())
}

/// `n` distinct ids below `limit` (`n <= limit`), in a seeded order.
fn distinct(n: usize, limit: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..limit).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v.truncate(n);
    v
}

/// What a corruption of a valid list does at `at` (from move `from`).
#[derive(Debug, Clone, Copy)]
enum Bad {
    KeyOf,
    SlotOf,
    BlockOf,
    SlotPast(u32),
    BlockPast(u32),
    Missing,
}

/// A valid list of up to 300 moves (limits up to 600 more: bitmaps and a
/// slot table; or 60,000-200,000 more: ranks, or hashing past the bitmap
/// limit), then up to three corruptions.
fn moves_mostly_valid() -> impl Strategy<Value = (Vec<BlockMove>, u32, u32)> {
    let extra = || prop_oneof![3 => 0u32..600, 1 => 60_000u32..200_000];
    (1usize..300, extra(), extra(), any::<u64>()).prop_flat_map(|(n, sx, dx, seed)| {
        let bad = prop_oneof![
            Just(Bad::KeyOf),
            Just(Bad::SlotOf),
            Just(Bad::BlockOf),
            (0u32..3).prop_map(Bad::SlotPast),
            (0u32..3).prop_map(Bad::BlockPast),
            Just(Bad::Missing),
        ];
        (
            Just((n, sx, dx, seed)),
            proptest::collection::vec((bad, 0..n, 0..n), 0..4),
        )
            .prop_map(|((n, sx, dx, seed), bads)| {
                let (sl, dl) = (n as u32 + sx, n as u32 + dx);
                let (s, d) = (distinct(n, sl, seed), distinct(n, dl, seed ^ 0x5a5a));
                let mut moves: Vec<BlockMove> = (0..n)
                    .map(|i| {
                        let k = (i as u64 + 1).wrapping_mul(seed | 1);
                        mv(k, Some(s[i]), d[i])
                    })
                    .collect();
                for (b, at, from) in bads {
                    let f = moves[from];
                    let m = &mut moves[at];
                    match b {
                        Bad::KeyOf => m.key = f.key,
                        Bad::SlotOf => m.src_slot = f.src_slot,
                        Bad::BlockOf => m.dst_block = f.dst_block,
                        Bad::SlotPast(x) => m.src_slot = Some(sl + x),
                        Bad::BlockPast(x) => m.dst_block = dl + x,
                        Bad::Missing => m.src_slot = None,
                    }
                }
                (moves, sl, dl)
            })
    })
}

fn layout(tp: u32) -> KvLayout {
    KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, tp).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random lists (duplicates of every kind, ids and limits up to
    /// `u32::MAX`, missing keys): every way of remembering ids gives the
    /// reference's rows or its first error.
    #[test]
    fn check_is_the_reference_on_any_list(moves in moves_any(), sl in limit(), dl in limit()) {
        let want = || reference_check_moves(&moves, sl, dl);
        for sets in MODES {
            same(check_moves(&moves, sl, dl, sets), want())?;
        }
    }

    /// Valid lists with up to three corruptions.
    #[test]
    fn check_is_the_reference_on_corrupted_lists((moves, sl, dl) in moves_mostly_valid()) {
        let want = || reference_check_moves(&moves, sl, dl);
        for sets in MODES {
            same(check_moves(&moves, sl, dl, sets), want())?;
        }
    }

    /// `TransferPlan::new` over 1, 2 or 4 ranks whose regions differ (rows,
    /// padded strides): the reference's plan, or its error.
    #[test]
    fn plan_is_the_reference_over_ranks(
        tp in prop::sample::select(vec![1u32, 2, 4]),
        (moves, sl, dl) in moves_mostly_valid(),
        extra in proptest::collection::vec((0u32..4, 0u32..4, any::<bool>(), any::<bool>()), 4),
    ) {
        let l = layout(tp);
        let bb = l.rank_block_bytes() as u64;
        // Rank 0 has the smallest regions (the limits); the others more rows.
        let geo = |blocks: u32, pad: bool, r: usize, e: u32| RegionGeometry {
            stride_bytes: bb + if pad { 64 } else { 0 },
            blocks: if r == 0 { blocks } else { blocks + e },
        };
        let donor: Vec<_> = (0..tp as usize).map(|r| geo(sl, extra[r].2, r, extra[r].0)).collect();
        let target: Vec<_> = (0..tp as usize).map(|r| geo(dl, extra[r].3, r, extra[r].1)).collect();
        same(
            TransferPlan::new(&l, &l, &moves, &donor, &target),
            reference_plan(&l, &moves, &donor, &target),
        )?;
    }
}

/// `n` moves with keys `keys(i)`, slots `slots(i)` and blocks `i`.
fn listed(n: u32, keys: impl Fn(u32) -> u64, slots: impl Fn(u32) -> Option<u32>) -> Vec<BlockMove> {
    (0..n).map(|i| mv(keys(i), slots(i), i)).collect()
}

#[test]
fn a_range_of_65536_rows_is_a_bitmap_for_one_move_and_u32_max_is_hashed() {
    let one = listed(1, u64::from, Some);
    let bitmap = |moves: &[BlockMove], limit| {
        matches!(
            first_refused(moves, |m| m.src_slot, limit, Sets::AUTO).1,
            Ids::Bits(_)
        )
    };
    assert!(bitmap(&one, 65_536));
    assert!(!bitmap(&one, 65_536 + 64 * 5));
    assert!(bitmap(&listed(2, u64::from, Some), 65_536 + 64 * 5));
    assert!(!bitmap(&listed(4096, u64::from, Some), u32::MAX));
}

#[test]
fn rows_from_a_slot_table_or_by_rank_are_the_sorted_rows() {
    // 1,000 slots for 700 moves: a table by slot; 60,000: 938 bitmap words
    // (at most 4 x 700 + 1,024) but more ids than 16 x 700 + 4,096: ranks.
    for limit in [1000, 60_000] {
        let slots = distinct(700, 1000, 3);
        let moves = listed(700, u64::from, |i| {
            (i % 7 != 3).then_some(slots[i as usize] * (limit / 1000))
        });
        let (refused, ids) = first_refused(&moves, |m| m.src_slot, limit, Sets::AUTO);
        assert!(refused.is_none() && matches!(ids, Ids::Bits(_)), "{limit}");
        let got = ids.rows(&moves);
        assert_eq!(
            got,
            reference_check_moves(&moves, limit, 700).unwrap(),
            "{limit}"
        );
    }
}

#[test]
fn a_repeat_is_found_past_the_probe_budget() {
    // A budget of 0: the first collision moves the ids (0 among them) into
    // the tree; 500 ids in 1,024 entries collide.
    let key = |i: u32| u64::from(i) * 0x1_0000_0001;
    let mut moves = listed(500, key, Some);
    assert_eq!(first_repeat(&moves, |m| Some(m.key.0), 0), None);
    for (at, from) in [(499, 0), (499, 3), (300, 299), (1, 0)] {
        moves[at].key = moves[from].key;
        assert_eq!(first_repeat(&moves, |m| Some(m.key.0), 0), Some(at));
        assert_eq!(first_repeat(&moves, |m| Some(m.key.0), 4), Some(at));
        moves[at].key.0 = key(at as u32);
    }
    // The product's budget: 4,096 moves never reach the tree.
    let moves = listed(4096, |i| u64::from(i) << 40 | u64::from(i), Some);
    assert_eq!(first_repeat(&moves, |m| Some(m.key.0), 4), None);
}
