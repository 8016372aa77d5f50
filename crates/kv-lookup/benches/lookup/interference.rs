//! `--only interference`: what one event thread costs an indexer's lookups
//! when it writes *another* index, against when it writes the index the
//! lookups read (synthetic workload only, where kv-lookup's `T1+E1` row is
//! below crtc-pool's; see `benches/RESULTS.md`, session 32).
//!
//! For each `T+E` of `--threads` (`E >= 1`), lookups on an index loaded
//! once and never written run under four event loads: none (`T+0`), ours
//! per event on a second, freshly loaded copy of ours, crtc-pool's on a
//! freshly loaded tree, and the indexer's own events on the index itself
//! (the usual concurrent row), and two splits of that row: publications
//! per event that change no entry ([`Publish::NoChange`]: what publishing
//! alone costs the lookups) and the same events batched 64 per publication
//! (the writes, with 64 times fewer publications). The same for crtc-pool's
//! lookups, without the splits. A lookup
//! that loses as much under the other index's events as under its own
//! loses it to the memory traffic of event application (the shared caches
//! and DRAM), not to publication or locks in its index; the two event
//! loads compare that traffic. Every event target is fresh for its run, so
//! each run applies the same churn from the same state.

use kv_lookup::LookupBudget;

use crate::concurrent::{churn_chains, drive, Crtc, Load, Ours, Publish};
use crate::{Block, Op};

/// Prints, for each `T+E`, lookups/s and lookup p99 of ours and of
/// crtc-pool under each event load, and the events/s of that load.
pub(crate) fn interference_rows<'a, F, I>(
    prefix: &str,
    threads: &[(usize, usize)],
    secs: f64,
    ops: F,
    capacity: usize,
    requests: &[(usize, Vec<Block>)],
) where
    F: Fn() -> I,
    I: Iterator<Item = Op<'a>>,
{
    let budget = LookupBudget::default();
    for &(t, e) in threads.iter().filter(|(_, e)| *e > 0) {
        let chains = churn_chains(e, 7 + e as u64);
        let none = churn_chains(0, 0);
        let print = |reader: &str, load: &str, l: &Load, alone: f64| {
            println!(
                "{prefix} T{t}+E{e} interference: {reader} lookups, {load}: {:.0} lookups/s \
                 ({:+.1} % against none), lookup p99 {:.2} us, {:.0} events/s",
                l.lookups_per_s,
                100.0 * (l.lookups_per_s / alone - 1.0),
                l.p99_us,
                l.events_per_s
            );
        };
        // Events from a freshly loaded second index (ours, per event) or
        // tree (crtc-pool's) while `lookup` reads `n` requests elsewhere.
        type Lookup<'l> = &'l (dyn Fn(usize) -> (bool, u32) + Sync);
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
        let alone =
            |n: usize, lookup: Lookup<'_>| drive(t, 0, secs, n, &none, |_| unreachable!(), lookup);

        // Ours reading; events: none, ours elsewhere, crtc elsewhere, ours on it.
        let reader = Ours::load(ops(), capacity, requests);
        let (n, lookup) = (reader.requests(), reader.lookup(budget));
        let base = alone(n, &lookup);
        print("ours", "no events", &base, base.lookups_per_s);
        let l = under_ours(n, &lookup);
        print(
            "ours",
            "ours per event on another index",
            &l,
            base.lookups_per_s,
        );
        let l = under_crtc(n, &lookup);
        print("ours", "crtc-pool's on its tree", &l, base.lookups_per_s);
        drop(lookup);
        drop(reader);
        let own = Ours::load(ops(), capacity, requests);
        let l = drive(
            t,
            e,
            secs,
            n,
            &chains,
            own.writer(Publish::PerEvent),
            own.lookup(budget),
        );
        print(
            "ours",
            "ours per event on the same index",
            &l,
            base.lookups_per_s,
        );
        drop(own);
        // The same index under its own events, split: as many publications
        // that change nothing, then the same writes published 64 times
        // less often.
        for (publish, load) in [
            (
                Publish::NoChange,
                "ours per event changing no entry, same index",
            ),
            (Publish::Batched, "ours batched on the same index"),
        ] {
            let own = Ours::load(ops(), capacity, requests);
            let l = drive(
                t,
                e,
                secs,
                n,
                &chains,
                own.writer(publish),
                own.lookup(budget),
            );
            print("ours", load, &l, base.lookups_per_s);
        }

        // crtc-pool reading; events: none, crtc elsewhere, ours elsewhere, crtc on it.
        let reader = Crtc::load(ops(), requests, e);
        let (n, lookup) = (reader.requests(), reader.lookup());
        let base = alone(n, &lookup);
        print("crtc-pool", "no events", &base, base.lookups_per_s);
        let l = under_crtc(n, &lookup);
        print(
            "crtc-pool",
            "crtc-pool's on another tree",
            &l,
            base.lookups_per_s,
        );
        let l = under_ours(n, &lookup);
        print(
            "crtc-pool",
            "ours per event on our index",
            &l,
            base.lookups_per_s,
        );
        drop(lookup);
        drop(reader);
        let own = Crtc::load(ops(), requests, e);
        let l = drive(t, e.min(1), secs, n, &chains, own.writer(), own.lookup());
        print(
            "crtc-pool",
            "crtc-pool's on the same tree",
            &l,
            base.lookups_per_s,
        );
    }
}
