//! Unit tests of `holder_table.rs` (kept beside it so that file holds only what it owns).

use super::*;
use std::collections::HashMap;

/// Reference walk step built on `after` + `locate`, as the lookup uses them.
#[derive(Default)]
struct Cursor(Option<Loc>);

impl HolderTable {
    fn step(&self, c: &mut Cursor, hash: SequenceHash) -> [u64; 2] {
        if let Some(loc) = c.0 {
            if let Some(e) = self.after(loc).first() {
                if e.key == hash.0 && e.bits != [0; 2] {
                    c.0 = Some(loc.advanced(1));
                    return e.bits;
                }
            }
        }
        match self.locate(hash) {
            Some((loc, hot)) => {
                c.0 = Some(loc);
                hot
            }
            None => {
                c.0 = None;
                [0; 2]
            }
        }
    }
}

/// An event's run is allocated once for the hashes it has left, and
/// trimmed when most of them existed already.
#[test]
fn a_run_reserves_the_events_room_once_and_is_trimmed_to_what_it_got() {
    let mut t = HolderTable::with_capacity(0);
    let fresh: Vec<SequenceHash> = (1..=100).map(SequenceHash).collect();
    for (i, &h) in fresh.iter().enumerate() {
        assert!(t.set_room(h, 4, 0, true, fresh.len() - i));
    }
    t.close_run();
    fn run(t: &HolderTable, h: SequenceHash) -> &Run {
        &t.runs[t.locate(h).unwrap().0.run as usize]
    }
    // By doubling the run would hold 128 entries' room.
    assert_eq!(run(&t, fresh[0]).hot.capacity(), 100);
    assert_eq!(run(&t, fresh[0]).sums.capacity(), 4);
    // 90 of 100 exist already (another worker's bit), 10 are new.
    let mixed: Vec<SequenceHash> = fresh[..90]
        .iter()
        .copied()
        .chain((101..=110).map(SequenceHash))
        .collect();
    for (i, &h) in mixed.iter().enumerate() {
        assert!(t.set_room(h, 4, 1, true, mixed.len() - i));
    }
    t.close_run();
    let r = run(&t, SequenceHash(101));
    assert_eq!(r.hot.len(), 10);
    assert!(r.hot.capacity() <= 10 + 10 / 4 + 4, "{}", r.hot.capacity());
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
}

#[test]
fn set_get_clear_round_trip_with_colliding_keys() {
    let mut t = HolderTable::with_capacity(0);
    // Keys spaced by the table size collide on the home slot often
    // enough to exercise probe runs and backward shifts.
    let keys: Vec<u64> = (0..3000u64).map(|k| k * 1024).collect();
    for (n, &k) in keys.iter().enumerate() {
        assert!(t.set(SequenceHash(k), n % TIERS, (n % 64) as u32, false));
        assert!(!t.set(SequenceHash(k), n % TIERS, (n % 64) as u32, false));
    }
    t.close_run();
    assert_eq!(t.len(), 3000);
    assert!(t.test_map.capacity() >= 4000, "grew to keep load <= 3/4");
    for (n, &k) in keys.iter().enumerate() {
        let mut want = [0u64; TIERS];
        want[n % TIERS] = 1 << (n % 64);
        assert_eq!(t.bits_of(SequenceHash(k)), want);
    }
    for (n, &k) in keys.iter().enumerate().filter(|(n, _)| n % 3 == 0) {
        assert!(t.clear(SequenceHash(k), n % TIERS, (n % 64) as u32));
        assert!(!t.clear(SequenceHash(k), n % TIERS, (n % 64) as u32));
    }
    assert_eq!(t.len(), 2000);
    for (n, &k) in keys.iter().enumerate() {
        let got = t.bits_of(SequenceHash(k));
        if n % 3 == 0 {
            assert_eq!(got, [0; TIERS]);
        } else {
            assert_eq!(got[n % TIERS], 1 << (n % 64));
        }
    }
}

#[test]
fn walk_follows_runs_and_never_trusts_a_dead_entry() {
    let mut t = HolderTable::with_capacity(0);
    let chain: Vec<SequenceHash> = (1..=6).map(SequenceHash).collect();
    for h in &chain {
        t.set(*h, 4, 0, false);
    }
    t.close_run();
    // Block 3 dies in run 0, then is stored again by worker 1 (new run).
    assert!(t.clear(chain[3], 4, 0));
    t.set(chain[3], 4, 1, false);
    t.close_run();
    let mut c = Cursor::default();
    let got: Vec<u64> = chain
        .iter()
        .map(|h| t.step(&mut c, *h)[HOT_RETAINED])
        .collect();
    assert_eq!(got, vec![1, 1, 1, 2, 1, 1]);
    // All of run 0 dying frees it for reuse.
    for h in chain.iter().filter(|h| **h != chain[3]) {
        t.clear(*h, 4, 0);
    }
    assert_eq!((t.free_runs.len(), t.len()), (1, 1));
    t.set(SequenceHash(99), 0, 5, false);
    assert_eq!(t.free_runs.len(), 0, "the freed run is reused");
    assert_eq!(t.bits_of(chain[3])[4], 2);
}

/// A removal that clears a whole run in order frees it without first
/// moving its last quarter into a fresh run; one that leaves it under a
/// quarter live compacts it once, at `finish_clears`.
#[test]
fn clears_of_one_removal_compact_a_run_only_if_it_stays_sparse() {
    let mut t = HolderTable::with_capacity(0);
    let chain: Vec<SequenceHash> = (1..=64).map(SequenceHash).collect();
    for h in &chain {
        t.set(*h, 4, 0, true);
    }
    t.close_run();
    for h in &chain {
        assert!(t.clear_deferred(*h, 4, 0));
    }
    t.finish();
    assert_eq!(t.len(), 0);
    // One run ever: the one the chain filled, now free (with a compaction
    // at the crossing there were two).
    assert_eq!((t.runs.len(), t.free_runs.len()), (1, 1));
    for h in &chain {
        t.set(*h, 4, 0, true);
    }
    t.close_run();
    for h in &chain[..50] {
        assert!(t.clear_deferred(*h, 4, 0));
    }
    // Noted, not compacted yet: the run still has its 64 positions, and
    // block 50 still follows its dead parent (not an entry point yet).
    assert_eq!(t.test_map.get(chain[50].0).unwrap().off, 50);
    assert!(t.locate(chain[50]).is_none());
    t.finish();
    // Its parent died: it is an entry point now, in the fresh run.
    let loc = t.locate(chain[50]).unwrap().0;
    assert_eq!(t.entry_points(), 1, "block 50 only: 51.. follow it");
    assert_eq!(loc.off, 0, "compacted: the 14 survivors start a fresh run");
    assert_eq!(t.runs[loc.run as usize].hot.len(), 14);
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
    let mut c = Cursor::default();
    for h in &chain[50..] {
        assert_eq!(t.step(&mut c, *h), [0, 1]);
    }
}

#[test]
fn a_mostly_dead_run_is_compacted_in_order() {
    let mut t = HolderTable::with_capacity(0);
    let chain: Vec<SequenceHash> = (1..=256).map(SequenceHash).collect();
    for h in &chain {
        t.set(*h, 4, 3, false);
    }
    t.close_run();
    // Keep every 5th block (52 of 256, under a quarter).
    for (n, h) in chain.iter().enumerate().filter(|(n, _)| n % 5 != 0) {
        assert!(t.clear(*h, 4, 3), "block {n}");
    }
    let kept: Vec<SequenceHash> = chain.iter().copied().step_by(5).collect();
    assert_eq!(t.len(), kept.len());
    // Compaction ran once, when 63 entries (< 256 / 4) were live; that
    // 63-entry run is below the compaction minimum and stays.
    let live_runs: Vec<usize> = t
        .runs
        .iter()
        .map(|r| r.hot.len())
        .filter(|&l| l > 0)
        .collect();
    assert_eq!(live_runs, vec![63]);
    assert_eq!(t.free_runs.len(), 1);
    for h in &kept {
        assert_eq!(t.bits_of(*h)[4], 1 << 3);
    }
    // Survivors keep their order, so walks over them stay sequential.
    let offs: Vec<u32> = kept.iter().map(|h| t.locate(*h).unwrap().0.off).collect();
    assert!(offs.windows(2).all(|w| w[0] < w[1]), "{offs:?}");
    let mut c = Cursor::default();
    for h in &kept {
        assert_eq!(t.step(&mut c, *h), [0, 1 << 3]);
    }
}

/// `keys` stored as one chained Stored event by `bit`.
fn store_chained(t: &mut HolderTable, keys: &[u64], tier: usize, bit: u32) {
    for &k in keys {
        t.set(SequenceHash(k), tier, bit, true);
    }
    t.close_run();
}

#[test]
fn only_checked_stores_fill_ordered_runs() {
    let mut t = HolderTable::with_capacity(0);
    store_chained(&mut t, &(10..20).collect::<Vec<_>>(), 4, 0);
    // 0..40: 10..20 exist already and leave a hole; the run of the
    // other 30 is still ordered.
    store_chained(&mut t, &(0..40).collect::<Vec<_>>(), 4, 1);
    assert_eq!(t.run_of(SequenceHash(0)), (true, 30, vec![[0, 2]]));
    // An unchecked list (a resync) makes a run that is never skipped.
    for k in 100..140 {
        t.set(SequenceHash(k), 4, 2, false);
    }
    t.close_run();
    assert_eq!(t.run_of(SequenceHash(100)), (false, 40, vec![[0; 2]; 2]));
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
}

#[test]
fn summaries_follow_sets_clears_and_compaction() {
    let mut t = HolderTable::with_capacity(0);
    let keys: Vec<u64> = (1..=256).collect();
    store_chained(&mut t, &keys, 4, 0);
    let (loc, _) = t.locate(SequenceHash(1)).unwrap();
    let sums = |t: &HolderTable| t.runs[loc.run as usize].sums.clone();
    assert_eq!(sums(&t), vec![[0, 1]; 8]);
    // A second holder of keys 1..=40: chunk 0 gains its bit, chunk 1
    // (keys 33..=64) only when all of it is held.
    store_chained(&mut t, &keys[..40], 4, 1);
    assert_eq!(sums(&t)[..2], [[0, 3], [0, 1]]);
    store_chained(&mut t, &keys[32..64], 4, 1);
    assert_eq!(sums(&t)[..2], [[0, 3], [0, 3]]);
    // A device bit on every entry of chunk 2.
    store_chained(&mut t, &keys[64..96], 0, 5);
    assert_eq!(sums(&t)[2], [1 << 5, 1]);
    // A cold-tier bit changes no hot summary.
    store_chained(&mut t, &keys[96..128], 2, 7);
    assert_eq!(sums(&t)[3], [0, 1]);
    // One removal inside a chunk drops the bit from its summary at once.
    assert!(t.clear(SequenceHash(50), 4, 1));
    assert_eq!(sums(&t)[1], [0, 1]);
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
    // Thin the run out to 63 of 256 entries, so that the last death
    // compacts it.
    let kept: Vec<u64> = (1..=240u64)
        .filter(|k| k % 4 == 0)
        .chain(241..=243)
        .collect();
    assert_eq!(kept.len(), 63);
    for k in (1..=256u64).filter(|k| !kept.contains(k)) {
        t.clear(SequenceHash(k), 4, 0);
        t.clear(SequenceHash(k), 4, 1);
        t.clear(SequenceHash(k), 0, 5);
        t.clear(SequenceHash(k), 2, 7);
    }
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
    // Compacted: 63 entries, still ordered, only worker 0 on them all.
    let (ordered, len, sums) = t.run_of(SequenceHash(kept[0]));
    assert_eq!((ordered, len, sums), (true, 63, vec![[0, 1]; 2]));
}

proptest::proptest! {
    /// One long run thinned out at random (compactions happen) and
    /// partly re-stored: every entry stays reachable, walks agree.
    #[test]
    fn thinning_a_long_run_keeps_entries_reachable(
        n in 64usize..300,
        ops in proptest::collection::vec((0usize..300, 0u8..10), 0..900),
    ) {
        let mut t = HolderTable::with_capacity(0);
        let mut m: HashMap<u64, u64> = HashMap::new();
        for k in 0..n as u64 {
            t.set(SequenceHash(k), 4, 0, false);
            m.insert(k, 1);
        }
        t.close_run();
        for (k, op) in ops {
            let k = (k % n) as u64;
            let held = m.get(&k).copied().unwrap_or(0);
            if op < 8 {
                proptest::prop_assert_eq!(t.clear(SequenceHash(k), 4, 0), held != 0);
                m.remove(&k);
            } else {
                proptest::prop_assert_eq!(t.set(SequenceHash(k), 4, 0, false), held == 0);
                t.close_run();
                m.insert(k, 1);
            }
        }
        proptest::prop_assert_eq!(t.len(), m.len());
        let mut c = Cursor::default();
        for k in 0..n as u64 {
            let want = m.get(&k).copied().unwrap_or(0);
            proptest::prop_assert_eq!(t.bits_of(SequenceHash(k))[4], want);
            proptest::prop_assert_eq!(t.step(&mut c, SequenceHash(k)), [0, want]);
        }
    }

    #[test]
    fn matches_a_hashmap(
        // Rare run closes make runs long enough (>= 64) for compaction.
        ops in proptest::collection::vec((0u64..300, 0usize..TIERS, 0u32..64, 0u8..100), 1..2000),
        order in proptest::collection::vec(0u64..300, 0..300),
    ) {
        let mut t = HolderTable::with_capacity(0);
        let mut m: HashMap<u64, TierBits> = HashMap::new();
        for (k, tier, bit, op) in ops {
            // Multiply so that keys cluster on few home slots.
            let key = k.wrapping_mul(1 << 54);
            let e = m.entry(key).or_default();
            let before = e[tier] & (1 << bit) != 0;
            match op {
                0..=44 => {
                    proptest::prop_assert_eq!(t.clear(SequenceHash(key), tier, bit), before);
                    e[tier] &= !(1 << bit);
                }
                45..=98 => {
                    proptest::prop_assert_eq!(t.set(SequenceHash(key), tier, bit, false), !before);
                    e[tier] |= 1 << bit;
                }
                _ => {
                    proptest::prop_assert_eq!(t.set(SequenceHash(key), tier, bit, false), !before);
                    e[tier] |= 1 << bit;
                    t.close_run();
                }
            }
            if e.iter().all(|&b| b == 0) {
                m.remove(&key);
            }
        }
        proptest::prop_assert_eq!(t.len(), m.len());
        for k in 0u64..300 {
            let key = k.wrapping_mul(1 << 54);
            proptest::prop_assert_eq!(t.bits_of(SequenceHash(key)), m.get(&key).copied().unwrap_or_default());
        }
        // A walk in any order sees the same bits as point lookups.
        let mut c = Cursor::default();
        for k in order {
            let key = k.wrapping_mul(1 << 54);
            let want = m.get(&key).copied().unwrap_or_default();
            proptest::prop_assert_eq!(t.step(&mut c, SequenceHash(key)), [want[0], want[4]]);
        }
    }

    /// Chained stores of random segments by random holders and tiers,
    /// random removals and unchained stores: after every step each
    /// chunk summary is exact.
    #[test]
    fn chunk_summaries_stay_exact(
        n in 1usize..400,
        ops in proptest::collection::vec(
            (0usize..400, 0usize..400, 0usize..TIERS, 0u32..6, 0u8..10), 0..60),
    ) {
        let mut t = HolderTable::with_capacity(0);
        let keys: Vec<u64> = (0..n as u64).map(|k| k * 7 + 1).collect();
        store_chained(&mut t, &keys, 4, 0);
        for (a, b, tier, bit, op) in ops {
            let (a, b) = (a % n, b % n);
            let (lo, hi) = (a.min(b), a.max(b) + 1);
            match op {
                0..=3 => store_chained(&mut t, &keys[lo..hi], tier, bit),
                4..=7 => {
                    for &k in &keys[lo..hi.min(lo + 1 + (op as usize - 4) * 20)] {
                        t.clear(SequenceHash(k), tier, bit);
                    }
                }
                _ => {
                    for &k in keys[lo..hi].iter().rev() {
                        t.set(SequenceHash(k), tier, bit, false);
                    }
                    t.close_run();
                }
            }
            t.assert_summaries_exact();
            t.assert_entry_points_exact();
        }
    }
}
