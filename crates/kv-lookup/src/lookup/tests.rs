//! Unit tests of `lookup.rs` (kept beside it so that file holds only what it owns).

use super::*;
use crate::worker::WorkerKey;
use kv_descriptor::LayoutFingerprint;

#[test]
fn a_lookup_completes_while_a_writer_is_inside_a_write() {
    let index = InventoryIndex::new();
    let info = crate::WorkerInfo {
        engine: EngineId::fresh(),
        role: Role::Prefill,
        layout_fingerprint: LayoutFingerprint(1),
        tp_size: 1,
    };
    index.register_worker(WorkerKey(1), info).unwrap();
    // Inside a write (the writer lock held, the standby copy mutable),
    // a lookup reads the published copy at once.
    let out = index.state.write(|_| {
        index.lookup(
            &[SequenceHash(1)],
            info.engine,
            LookupBudget::new(2_000, 100),
        )
    });
    assert_eq!(out.donor, Err(NoDonorReason::NoCompatibleDonor));
    assert_eq!((out.budget_exhausted, out.probes), (false, 1));
    assert!(
        out.elapsed < Duration::from_micros(2_000),
        "{:?}",
        out.elapsed
    );
}

/// A meter with all the time in the world and `max_probes`.
fn meter(max_probes: u32) -> Meter<'static> {
    Meter {
        probes: 0,
        max_probes,
        deadline: Instant::now() + Duration::from_secs(3600),
        units: 0,
        next_check: CLOCK_CHECK_INTERVAL,
        exhausted: false,
        cancelled: &|| false,
        was_cancelled: false,
    }
}

/// The walk without runs or chunks: every block through `get`, one
/// probe each. Returns the result, probes and whether the budget ran out.
fn per_block(
    table: &HolderTable,
    hashes: &[SequenceHash],
    donors: u64,
    target: u64,
    max_probes: u32,
) -> (GroupWalk, u32, bool) {
    let mut w = Walk {
        active: donors,
        native: target,
        retained: target,
        out: GroupWalk::default(),
    };
    let (mut i, mut probes, mut alive) = (0, 0, (donors | target) != 0);
    while i < hashes.len() && alive {
        if probes >= max_probes {
            return (w.finish(i), probes, true);
        }
        let b = table.bits_of(hashes[i]);
        probes += 1;
        alive = w.block(i, [b[0], b[4]]);
        i += 1;
    }
    (w.finish(i), probes, false)
}

/// True chains: `chains[0]` of `len` blocks, the others branching off
/// it at random blocks with their own tokens.
fn chains(rng: &mut crate::reference::SplitMix, len: usize) -> Vec<Vec<SequenceHash>> {
    use kv_descriptor::{chain_sequence_hash, TokenBlockHash};
    let grow = |rng: &mut crate::reference::SplitMix, mut c: Vec<SequenceHash>, n| {
        for _ in 0..n {
            let token = TokenBlockHash(rng.next());
            c.push(chain_sequence_hash(c.last().copied(), token));
        }
        c
    };
    let base = grow(rng, Vec::new(), len);
    let mut out = vec![base.clone()];
    for _ in 0..4 {
        let at = rng.below(len as u64 + 1) as usize;
        let extra = len - at + rng.below(80) as usize;
        out.push(grow(rng, base[..at].to_vec(), extra));
    }
    out
}

/// Random holders on true chains: Stored events of random segments in
/// random tiers (chained, as the index stores them), removals of single
/// blocks and ranges, whole-tier drops, and unchained resync stores.
fn random_table(rng: &mut crate::reference::SplitMix, cs: &[Vec<SequenceHash>]) -> HolderTable {
    let mut t = HolderTable::with_capacity(0);
    let tiers = [4, 4, 4, 0, 0, 1, 3];
    for _ in 0..40 {
        let c = &cs[rng.below(cs.len() as u64) as usize];
        let bit = rng.below(8) as u32;
        let tier = tiers[rng.below(tiers.len() as u64) as usize];
        let lo = if rng.below(2) == 0 {
            0
        } else {
            rng.below(c.len() as u64) as usize
        };
        let hi = lo + rng.below((c.len() - lo) as u64 + 1) as usize;
        match rng.below(10) {
            0..=4 => {
                for &h in &c[lo..hi] {
                    t.set(h, tier, bit, true);
                }
                t.close_run();
            }
            5..=6 => {
                // A single block (half the time), or a short range.
                let hi = (lo + 1 + rng.below(2) as usize * rng.below(40) as usize).min(c.len());
                for &h in &c[lo..hi] {
                    t.clear(h, tier, bit);
                }
            }
            7 => {
                for c in cs {
                    for &h in c {
                        t.clear(h, tier, bit);
                    }
                }
            }
            _ => {
                // An unchecked list (a resync): in chain order but with
                // one block of another chain in place of its own, so
                // its neighbours are no chain; or reversed.
                let mut list = c[lo..hi].to_vec();
                if !list.is_empty() {
                    let other = &cs[rng.below(cs.len() as u64) as usize];
                    let k = rng.below(list.len() as u64) as usize;
                    list[k] = other[rng.below(other.len() as u64) as usize];
                }
                if rng.below(4) == 0 {
                    list.reverse();
                }
                for h in list {
                    t.set(h, tier, bit, false);
                }
                t.close_run();
            }
        }
    }
    t.assert_summaries_exact();
    t.assert_entry_points_exact();
    t
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]
    /// The chunk-skipping walk gives the per-block walk's result, probe
    /// count and exhaustion on random tables over long true chains,
    /// for requests that end mid-chunk or diverge inside a chunk.
    #[test]
    fn skipping_walk_equals_the_per_block_walk(seed in proptest::prelude::any::<u64>()) {
        let mut rng = crate::reference::SplitMix(seed);
        let len = [40, 300, 2_100][rng.below(3) as usize] + rng.below(64) as usize;
        let cs = chains(&mut rng, len);
        let t = random_table(&mut rng, &cs);
        for _ in 0..24 {
            let c = &cs[rng.below(cs.len() as u64) as usize];
            let n = if rng.below(2) == 0 { c.len() } else { 1 + rng.below(c.len() as u64) as usize };
            let target_bit = rng.below(9);
            let target = if target_bit < 8 { 1u64 << target_bit } else { 0 };
            let donors = if rng.below(2) == 0 { 0xFF } else { rng.next() & 0xFF } & !target;
            let max_probes = if rng.below(3) == 0 { rng.below(n as u64 + 1) as u32 } else { u32::MAX };
            let mut m = meter(max_probes);
            let got = walk_group(&t, &c[..n], donors, target, &mut m);
            let want = per_block(&t, &c[..n], donors, target, max_probes);
            proptest::prop_assert_eq!((got, m.probes, m.exhausted), want);
        }
    }
}

#[test]
fn a_long_shared_run_is_skipped_chunk_by_chunk() {
    let mut rng = crate::reference::SplitMix(5);
    let c = chains(&mut rng, 2_048).swap_remove(0);
    let mut t = HolderTable::with_capacity(0);
    // Worker 0 stores the chain; worker 1 re-stores it (bits set on
    // existing entries: their chunk summaries are recomputed).
    for bit in [0, 1] {
        for &h in &c {
            t.set(h, 4, bit, true);
        }
        t.close_run();
    }
    let mut m = meter(u32::MAX);
    let got = walk_group(&t, &c, 0b10, 0, &mut m);
    assert_eq!((got.best, got.best_blocks, m.probes), (0b10, 2_048, 2_048));
    // One index probe, 31 blocks to the first chunk start, then 63
    // skips: 8 + 31 + 63 * 8 units instead of 8 + 2_047.
    assert_eq!(m.units, 8 + 31 + 63 * 8);
    // Worker 1 drops block 1_000 (mid-chunk): the walk stops exactly there.
    assert!(t.clear(c[1_000], 4, 1));
    let mut m = meter(u32::MAX);
    let got = walk_group(&t, &c, 0b11, 0, &mut m);
    assert_eq!((got.best, got.best_blocks), (0b01, 2_048));
    let mut m = meter(u32::MAX);
    let got = walk_group(&t, &c, 0b10, 0, &mut m);
    assert_eq!((got.best, got.best_blocks, m.probes), (0b10, 1_000, 1_001));
    // A probe budget that ends mid-chunk is spent exactly.
    let mut m = meter(777);
    let got = walk_group(&t, &c, 0b01, 0, &mut m);
    assert_eq!((got.best_blocks, m.probes, m.exhausted), (777, 777, true));
}

#[test]
fn nth_set_bit_walks_set_bits_in_order() {
    let m = 0b1011_0100u64;
    let got: Vec<u32> = (0..m.count_ones()).map(|n| nth_set_bit(m, n)).collect();
    assert_eq!(got, vec![2, 4, 5, 7]);
}
