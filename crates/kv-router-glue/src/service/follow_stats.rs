//! [`FollowStats`]: the counters of what a router's followers took in, and
//! the atomic counters behind them. One list of fields makes both (the
//! `follow_counters!` macro), so a counter added here shows up in the
//! snapshot, the stop line and `/metrics` (`kv_reuse_router_follow_total`,
//! which takes the fields by name) without a second list to keep in step.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! follow_counters {
    ($($(#[doc = $doc:literal])+ $field:ident,)+) => {
        /// Counters of what the followers took in (all since start).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
        pub struct FollowStats {
            $($(#[doc = $doc])+ pub $field: u64,)+
        }

        /// The live counters behind [`FollowStats`], bumped by the followers.
        #[derive(Debug, Default)]
        pub(super) struct Counters {
            $(pub(super) $field: AtomicU64,)+
        }

        impl Counters {
            /// Every counter now.
            pub(super) fn snapshot(&self) -> FollowStats {
                FollowStats { $($field: self.$field.load(Ordering::Relaxed),)+ }
            }
        }
    };
}

follow_counters! {
    /// Announcements accepted (new, refreshed or replacing).
    announcements,
    /// Announcements refused (undecodable, invalid) or of replaced
    /// incarnations (logged at most once per `RETIRED_LOG_EVERY`).
    announcements_ignored,
    /// Workers dropped (replaced or silent).
    workers_dropped,
    /// Workers dropped for silence that announced again and were taken
    /// back (each a donor again only after its inventory snapshot), and
    /// removed incarnations the index still knew as removed although the
    /// registry had forgotten them (none while the index forgets what the
    /// registry forgets).
    workers_readmitted,
    /// Times the router found its own NATS connection down: no worker's
    /// silence counts until it is back, and then every decode worker is
    /// resynced before it is a donor again.
    connection_losses,
    /// Replaced or silenced incarnations the worker registry forgot: not
    /// heard of for its retention (`FORGET_AFTER_SILENCE_WINDOWS` silence
    /// windows, at least `FORGET_AFTER_MIN_MS`), or the oldest past
    /// `MAX_REMEMBERED` of either kind. Each is forgotten by the index too
    /// (`InventoryIndex::forget_retired`); one that announces again
    /// registers as a new worker, empty, and its first event is a gap that
    /// keeps it from donor choice until its snapshot.
    incarnations_forgotten,
    /// KV events applied to the index (in order, or after a gap).
    events_applied,
    /// KV events at or below what the index already holds of the publisher
    /// (its snapshot, or a replay), ignored.
    events_duplicate,
    /// KV events of retired incarnations, ignored.
    late_events_ignored,
    /// Events the index refused (unknown worker, layout mismatch) or could
    /// not chain to what it holds of the publisher.
    events_refused,
    /// [`crate::KvStreamItem::Lost`] ranges seen (the inventory of that
    /// publisher is incomplete until it republishes or a snapshot rebuilds it).
    lost_ranges,
    /// Lost ranges an applied snapshot already covered (nothing asked).
    lost_covered,
    /// Inventory snapshots applied.
    snapshots_applied,
    /// Inventory snapshots that failed (asked again at the worker's next
    /// announcement).
    snapshots_failed,
    /// Directory changes applied.
    directory_changes,
    /// Directory puts of retired incarnations, ignored.
    directory_puts_ignored,
    /// Donor layouts (by fingerprint, each counted once) whose blocks are
    /// too small for the settings: no fetch of them could save time, so
    /// every decision about them refuses.
    donor_layouts_unprofitable,
    /// Donor layouts (each counted once) whose tokens per block differ from
    /// the router's `--tokens-per-block` (given at start).
    donor_layouts_block_size_mismatch,
    /// Times the directory watch ended and was opened again.
    directory_watch_reopened,
    /// Times the announcements subscription ended and was made again.
    announcements_resubscribed,
    /// Event subjects subscribed to (first named by an announcement).
    event_subjects_followed,
    /// Event subjects given up: unsubscribed because no registered worker
    /// names them any more, or not subscribed because the subscribe failed
    /// (the next announcement naming one follows it again); followed minus
    /// released is how many are subscribed (or subscribing) now.
    event_subjects_released,
}

/// Adds one to `c`.
pub(super) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_snapshot_reads_each_counter_into_its_own_field() {
        let c = Counters::default();
        bump(&c.events_applied);
        bump(&c.events_applied);
        bump(&c.event_subjects_released);
        let s = c.snapshot();
        assert_eq!(
            s,
            FollowStats {
                events_applied: 2,
                event_subjects_released: 1,
                ..FollowStats::default()
            }
        );
    }
}
