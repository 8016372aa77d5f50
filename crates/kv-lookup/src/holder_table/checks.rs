//! Test-only access to a holder table: a table used on its own with its
//! own full map, and checks of the table's invariants.

use super::*;

/// A table used on its own, with its own full map ([`HolderTable::test_map`]):
/// what the index does through the writer's map, for unit tests.
impl HolderTable {
    fn with_own_map<R>(&mut self, f: impl FnOnce(&mut Self, &mut Locator<'_>) -> R) -> R {
        let mut map = std::mem::replace(&mut self.test_map, LocIndex::with_capacity(0));
        let out = f(
            self,
            &mut Locator::Map {
                map: &mut map,
                log: None,
            },
        );
        self.test_map = map;
        out
    }

    /// [`Self::set_with_room`] without room: a run it opens grows as
    /// needed; `follows` when `chained`.
    pub(crate) fn set(&mut self, hash: SequenceHash, tier: usize, bit: u32, chained: bool) -> bool {
        self.with_own_map(|t, l| t.set_with_room(l, hash, tier, bit, chained, chained, 0))
    }

    /// [`Self::set_with_room`] with room, through the own map.
    pub(crate) fn set_room(
        &mut self,
        hash: SequenceHash,
        tier: usize,
        bit: u32,
        chained: bool,
        room: usize,
    ) -> bool {
        self.with_own_map(|t, l| t.set_with_room(l, hash, tier, bit, chained, chained, room))
    }

    /// Clears and finishes at once.
    pub(crate) fn clear(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        self.with_own_map(|t, l| {
            let was_set = t.clear_deferring(l, hash, tier, bit);
            t.finish_clears(l);
            was_set
        })
    }

    /// [`Self::clear_deferring`] through the own map.
    pub(crate) fn clear_deferred(&mut self, hash: SequenceHash, tier: usize, bit: u32) -> bool {
        self.with_own_map(|t, l| t.clear_deferring(l, hash, tier, bit))
    }

    /// [`Self::finish_clears`] through the own map.
    pub(crate) fn finish(&mut self) {
        self.with_own_map(|t, l| t.finish_clears(l))
    }

    /// Bits through the own map.
    pub(crate) fn bits_of(&self, hash: SequenceHash) -> TierBits {
        self.get_in(&self.test_map, hash)
    }
}

/// Test-only checks of the chunk invariants (see the module docs).
impl HolderTable {
    /// Asserts that every chunk summary is exactly what its entries give:
    /// the state after every `close_run` and `clear`.
    pub(crate) fn assert_summaries_exact(&self) {
        for (r, run) in self.runs.iter().enumerate() {
            assert_eq!(run.sums.len(), run.hot.len().div_ceil(CHUNK), "run {r}");
            let mut fresh = Run {
                hot: run.hot.clone(),
                ordered: run.ordered,
                sums: run.sums.clone(),
                ..Run::default()
            };
            for c in 0..run.sums.len() {
                fresh.resum(c);
                assert_eq!(run.sums[c], fresh.sums[c], "run {r} chunk {c}");
            }
        }
    }

    /// Asserts that the entry-point index holds exactly the live entries
    /// marked as entry points, at their places, and that every other live
    /// entry sits right after a live entry (its parent's, by construction).
    pub(crate) fn assert_entry_points_exact(&self) {
        let mut points = 0;
        for (r, run) in self.runs.iter().enumerate() {
            for off in 0..run.hot.len() {
                let here = Loc {
                    run: r as u32,
                    off: off as u32,
                };
                let key = run.hot[off].key;
                if !run.is_live(off) {
                    assert!(!run.is_point(off), "dead {here:?} is no entry point");
                    continue;
                }
                if run.is_point(off) {
                    points += 1;
                    assert_eq!(self.entry_points.get(key), Some(here), "{key:#x}");
                } else {
                    assert!(
                        off > 0 && run.is_live(off - 1),
                        "{here:?} follows a live entry"
                    );
                    assert_eq!(self.entry_points.get(key), None, "{key:#x}");
                }
            }
        }
        assert_eq!(self.entry_points.len(), points);
    }

    /// Whether the run that holds `hash` is ordered, its length and its
    /// chunk summaries.
    pub(crate) fn run_of(&self, hash: SequenceHash) -> (bool, usize, Vec<[u64; 2]>) {
        let loc = self.test_map.get(hash.0).expect("held");
        let run = &self.runs[loc.run as usize];
        (run.ordered, run.hot.len(), run.sums.clone())
    }

    /// Asserts that `map` (the writer's full map) points every live entry's
    /// hash at that entry and holds nothing else.
    pub(crate) fn assert_map_exact(&self, map: &LocIndex) {
        let mut live = 0;
        for (r, run) in self.runs.iter().enumerate() {
            for (off, e) in run.hot.iter().enumerate() {
                if run.is_live(off) {
                    live += 1;
                    let here = Loc {
                        run: r as u32,
                        off: off as u32,
                    };
                    assert_eq!(map.get(e.key), Some(here), "map of {:#x}", e.key);
                }
            }
        }
        assert_eq!(live, self.len, "live entries counted");
        assert_eq!(map.len(), live, "the map holds only live entries");
    }

    /// Everything of the table's layout a walk or a mutation reads (runs,
    /// bits, entry-point marks, summaries, free runs, entry-point count),
    /// for comparing the two copies of the index.
    pub(crate) fn layout_digest(&self) -> String {
        let mut out = format!(
            "len {} free {:?} open {:?} points {}\n",
            self.len,
            self.free_runs,
            self.open_run,
            self.entry_points.len()
        );
        for (r, run) in self.runs.iter().enumerate() {
            out += &format!(
                "run {r} ordered {} live {} hot {:?} cold {:?} sums {:?} points {:?}\n",
                run.ordered, run.live, run.hot, run.cold, run.sums, run.points
            );
        }
        out
    }
}
