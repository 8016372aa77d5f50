//! `--only interference`: what one event thread costs an indexer's lookups
//! when it writes *another* index, against when it writes the index the
//! lookups read (synthetic workload only, where kv-lookup's `T1+E1` row is
//! below crtc-pool's; see `benches/RESULTS.md`, session 32).
//!
//! For each `T+E` of `--threads` (`E >= 1`), lookups run under these event
//! loads: ours per event on a second, freshly loaded copy of ours,
//! crtc-pool's on a freshly loaded tree, and the indexer's own events on the
//! index itself (the usual concurrent row), and two splits of that row:
//! publications per event that change no entry ([`Publish::NoChange`]: what
//! publishing alone costs the lookups) and the same events batched 64 per
//! publication (the writes, with 64 times fewer publications). The same for
//! crtc-pool's lookups, without the splits. A lookup that loses as much
//! under the other index's events as under its own loses it to the memory
//! traffic of event application (the shared caches and DRAM), not to
//! publication or locks in its index; the two event loads compare that
//! traffic. Every event target is fresh for its run, so each run applies the
//! same churn from the same state.
//!
//! Paired rounds (`--rounds R`, default 3): each row is `R` pairs of runs,
//! the same readers alone and then under the load, back to back, and its
//! loss is the median of the pairs' losses, with their range. One lone
//! baseline per table was not enough on a lent 16-vCPU VM, whose speed for
//! one thread drifted by more between rows than the effects looked for
//! (session 36: a load on an unrelated index moved the lookups by -32 % to
//! +32 %); a pair's two runs are seconds apart, so slow drift cancels in it.

use kv_lookup::LookupBudget;

use crate::concurrent::{churn_chains, drive, Crtc, Load, Ours, Publish};
use crate::{Block, Op};

/// `R` pairs of one row: the lone run and the loaded run of each pair.
struct Pairs(Vec<(Load, Load)>);

impl Pairs {
    /// Median of `f` over the pairs (the upper middle for an even count).
    fn median(&self, f: impl Fn(&(Load, Load)) -> f64) -> f64 {
        let mut v: Vec<f64> = self.0.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// Each pair's loss of lookups/s, percent (negative: the load costs),
    /// sorted.
    fn losses(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .0
            .iter()
            .map(|(alone, l)| 100.0 * (l.lookups_per_s / alone.lookups_per_s - 1.0))
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }
}

/// Prints, for each `T+E`, lookups/s and lookup p99 of ours and of
/// crtc-pool under each event load, the loss against the same readers
/// alone (median of `rounds` pairs, and the range), and the events/s of
/// that load.
pub(crate) fn interference_rows<'a, F, I>(
    prefix: &str,
    threads: &[(usize, usize)],
    secs: f64,
    rounds: usize,
    ops: F,
    capacity: usize,
    requests: &[(usize, Vec<Block>)],
) where
    F: Fn() -> I,
    I: Iterator<Item = Op<'a>>,
{
    let budget = LookupBudget::default();
    let rounds = rounds.max(1);
    for &(t, e) in threads.iter().filter(|(_, e)| *e > 0) {
        let chains = churn_chains(e, 7 + e as u64);
        let none = churn_chains(0, 0);
        let print = |reader: &str, load: &str, p: &Pairs| {
            let sorted = p.losses();
            let (lo, hi) = (sorted[0], sorted[sorted.len() - 1]);
            println!(
                "{prefix} T{t}+E{e} interference: {reader} lookups, {load}: {:.0} lookups/s \
                 ({:+.1} % against none, median of {rounds} pairs, {lo:+.1} to {hi:+.1} %), \
                 alone {:.0} lookups/s, lookup p99 {:.2} us, {:.0} events/s",
                p.median(|(_, l)| l.lookups_per_s),
                sorted[sorted.len() / 2],
                p.median(|(a, _)| a.lookups_per_s),
                p.median(|(_, l)| l.p99_us),
                p.median(|(_, l)| l.events_per_s),
            );
        };
        type Lookup<'l> = &'l (dyn Fn(usize) -> (bool, u32) + Sync);
        let alone =
            |n: usize, lookup: Lookup<'_>| drive(t, 0, secs, n, &none, |_| unreachable!(), lookup);
        // Events from a freshly loaded second index (ours, per event) or
        // tree (crtc-pool's) while `lookup` reads `n` requests elsewhere.
        let under_ours = |n: usize, lookup: Lookup<'_>| {
            let other = Ours::load(ops(), capacity, requests);
            drive(
                t,
                e,
                secs,
                n,
                &chains,
                other.writer(Publish::PerEvent),
                lookup,
            )
        };
        let under_crtc = |n: usize, lookup: Lookup<'_>| {
            let tree = Crtc::load(ops(), requests, e);
            drive(t, e.min(1), secs, n, &chains, tree.writer(), lookup)
        };
        let pairs = |mut pair: Box<dyn FnMut() -> (Load, Load) + '_>| {
            Pairs((0..rounds).map(|_| pair()).collect())
        };

        // Ours reading under the events of another index, ours or crtc's.
        let reader = Ours::load(ops(), capacity, requests);
        let (n, lookup) = (reader.requests(), reader.lookup(budget));
        let p = pairs(Box::new(|| (alone(n, &lookup), under_ours(n, &lookup))));
        print("ours", "ours per event on another index", &p);
        let p = pairs(Box::new(|| (alone(n, &lookup), under_crtc(n, &lookup))));
        print("ours", "crtc-pool's on its tree", &p);
        drop(lookup);
        drop(reader);
        // The same index under its own events, fresh for each pair: per
        // event, as many publications that change nothing, and the same
        // writes published 64 times less often.
        for (publish, load) in [
            (Publish::PerEvent, "ours per event on the same index"),
            (
                Publish::NoChange,
                "ours per event changing no entry, same index",
            ),
            (Publish::Batched, "ours batched on the same index"),
        ] {
            let p = pairs(Box::new(|| {
                let own = Ours::load(ops(), capacity, requests);
                let lookup = own.lookup(budget);
                let a = alone(n, &lookup);
                let l = drive(t, e, secs, n, &chains, own.writer(publish), &lookup);
                (a, l)
            }));
            print("ours", load, &p);
        }

        // crtc-pool reading: crtc elsewhere, ours elsewhere, crtc on it.
        let reader = Crtc::load(ops(), requests, e);
        let (n, lookup) = (reader.requests(), reader.lookup());
        let p = pairs(Box::new(|| (alone(n, &lookup), under_crtc(n, &lookup))));
        print("crtc-pool", "crtc-pool's on another tree", &p);
        let p = pairs(Box::new(|| (alone(n, &lookup), under_ours(n, &lookup))));
        print("crtc-pool", "ours per event on our index", &p);
        drop(lookup);
        drop(reader);
        let p = pairs(Box::new(|| {
            let own = Crtc::load(ops(), requests, e);
            let lookup = own.lookup();
            let a = alone(n, &lookup);
            let l = drive(t, e.min(1), secs, n, &chains, own.writer(), &lookup);
            (a, l)
        }));
        print("crtc-pool", "crtc-pool's on the same tree", &p);
    }
}
