//! Worker-log compaction: a worker's per-tier log of stored hashes shrunk
//! back to the hashes it still holds, computed once per mutation and
//! carried to the replay on the other copy (in the mutation's memo).
//!
//! Invariant relied on: as multisets, a worker's `logs[t]` minus its
//! `removed[t]` is its live set in tier `t` (a hash is logged each time its
//! bit is set and listed in `removed` each time a removal clears it; a
//! whole-tier clear empties both). Debug builds check every result against
//! the table.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use kv_descriptor::SequenceHash;

use crate::holder_table::{HolderTable, LocIndex};
use crate::worker::WorkerRecord;

/// Drops log entries the worker no longer holds, and duplicates; takes the
/// result from `memo` when the other copy left it there, else computes it
/// (and leaves a copy in `memo` for the replay). Either way the log keeps
/// its buffer: it grows back to its next compaction without reallocating.
///
/// `memo` is the mutation's [`super::MutationMemo::compacted`]. Both copies
/// are equal before a mutation and apply it alike, so they compact the
/// same log against the same table and keep the same hashes: the replay
/// takes the first copy's result instead of computing it again (a pass
/// over about twice the worker's live hashes and a count of its removals,
/// see `compact_in_place`; when both copies probed the table for every
/// logged hash it was ~30% of an event thread's time in the churn bench,
/// `--threads 0+1`). Debug builds (the tests) recompute the compaction on
/// the replay and check that it equals the memo.
///
/// `map`: the writer's full map on a first application (debug builds check
/// the result against the table through it), `None` on a replay.
pub(super) fn compact_log(
    table: &HolderTable,
    map: Option<&LocIndex>,
    rec: &mut WorkerRecord,
    tier: usize,
    bit: u32,
    memo: &mut Option<Vec<SequenceHash>>,
) {
    let (log, removed, live) = (&mut rec.logs[tier], &mut rec.removed[tier], rec.live[tier]);
    if let Some(kept) = memo.take() {
        #[cfg(debug_assertions)]
        {
            let (mut mine, mut gone) = (log.clone(), removed.clone());
            compact_in_place(table, map, &mut mine, &mut gone, live, tier, bit);
            assert_eq!(
                kept, mine,
                "the other copy compacted the same log against the same table"
            );
        }
        // A release build trusts the memo only as far as one compare: it
        // must keep exactly the `live` hashes this copy counts. One that
        // does not (the copies disagree, a bug elsewhere) is dropped and
        // this copy compacts its own log.
        if kept.len() as u64 == live {
            log.clear();
            log.extend_from_slice(&kept);
            removed.clear();
            return;
        }
    }
    compact_in_place(table, map, log, removed, live, tier, bit);
    *memo = Some(log.clone());
}

/// Keeps the hashes of `log` that bit `bit` of `tier` still holds in
/// `table`, each once (`live` of them), in place and in log order, and
/// empties `removed`.
///
/// The table is not read: as multisets, `log` minus `removed` is the live
/// set (see [`WorkerRecord::removed`]), so each removal cancels the earliest
/// logged copy of its hash that is not cancelled yet, and what is left is
/// the live set once. Counting the removals takes a map as large as
/// `removed`, which fits in cache; probing the table for every log entry
/// instead (the method before) cost one or two DRAM and TLB misses per
/// entry, ~12% of the event thread in the churn bench (`--threads 0+1`).
/// Debug builds check the result against the table (through `map`, when
/// given).
fn compact_in_place(
    table: &HolderTable,
    map: Option<&LocIndex>,
    log: &mut Vec<SequenceHash>,
    removed: &mut Vec<SequenceHash>,
    live: u64,
    tier: usize,
    bit: u32,
) {
    let mut gone: HashMap<u64, u32, BuildHasherDefault<SpreadHasher>> =
        HashMap::with_capacity_and_hasher(removed.len(), Default::default());
    for h in removed.drain(..) {
        *gone.entry(h.0).or_default() += 1;
    }
    log.retain(|h| match gone.get_mut(&h.0) {
        Some(n) if *n > 0 => {
            *n -= 1;
            false
        }
        _ => true,
    });
    #[cfg(debug_assertions)]
    {
        assert_eq!(log.len() as u64, live, "the log keeps the live hashes");
        assert!(gone.values().all(|&n| n == 0), "each removal was logged");
        if let Some(map) = map {
            for &h in log.iter() {
                assert_eq!(
                    table.get_in(map, h)[tier] >> bit & 1,
                    1,
                    "a kept hash is held"
                );
            }
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = (table, map, live, tier, bit);
}

/// Hasher of the compaction's removal counts: keys are sequence hashes
/// (already XXH3 outputs; tests also use small integers), so one multiply
/// and a fold spread them; SipHash would cost more than the map's probes.
#[derive(Default)]
struct SpreadHasher(u64);

impl std::hash::Hasher for SpreadHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        let m = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = m ^ (m >> 32);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}
