//! [`RouterInventory`]'s follower streams that end (a deleted directory
//! bucket, a closed subscription) and are opened again, and the throttle on
//! refused announcements' log lines.

use kv_descriptor::Role;

use super::*;

/// Polls `cond` every millisecond for up to `secs`; panics with `what`.
pub(super) async fn eventually(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits for `inv` to report `reason` (a follower stream ended), then for
/// `reopened` of its stats to count the stream open again, nothing down.
async fn down_then_open_again(
    inv: &RouterInventory,
    reason: &str,
    reopened: fn(&FollowStats) -> u64,
) {
    eventually(2, reason, || inv.follower_down() == Some(reason)).await;
    eventually(2, "open again", || reopened(&inv.stats()) == 1).await;
    assert_eq!(inv.follower_down(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_directory_watch_or_announcements_subscription_is_opened_again() {
    use crate::plane::directory::tests_support::record;
    use crate::{InProcessDirectory, InProcessPlane};

    let plane = InProcessPlane::new();
    let directory = Arc::new(InProcessDirectory::new());
    let inv = inventory_on(crate::InProcessInventory::new(), Duration::from_secs(1));
    let (_followers, stop) =
        follow_in_process(&inv, Arc::new(plane.clone()), directory.clone()).await;
    assert_eq!(inv.follower_down(), None);
    let first = kv_descriptor::OwnerLease::fresh(Role::Decode);
    directory.put(&record(first, u64::MAX - 1)).await.unwrap();
    eventually(2, "first record applied", || {
        inv.stats().directory_changes == 1
    })
    .await;

    // The watch ends (a deleted bucket): reported down, then opened again,
    // which delivers the current record once more.
    directory.end_watches();
    down_then_open_again(&inv, "donor directory watch down", |st| {
        st.directory_watch_reopened
    })
    .await;
    eventually(2, "current record delivered again", || {
        inv.stats().directory_changes == 2
    })
    .await;
    // A record put after the re-open is followed.
    let second = kv_descriptor::OwnerLease::fresh(Role::Decode);
    directory.put(&record(second, u64::MAX - 1)).await.unwrap();
    eventually(2, "later record applied", || {
        inv.stats().directory_changes == 3
    })
    .await;

    // The announcements subscription ends (a closed client): subscribed
    // again, and a later announcement registers its worker.
    let announce = crate::announce_subject("t").unwrap();
    plane.end_subscriptions(announce.as_str());
    down_then_open_again(&inv, "worker announcements down", |st| {
        st.announcements_resubscribed
    })
    .await;
    let a = announcement(
        "p0",
        EngineId::fresh(),
        Role::Prefill,
        "kv.t.prefill.kv_events",
    );
    plane.publish(&announce, a).await.unwrap();
    eventually(2, "announcement after the re-subscribe", || {
        inv.stats().announcements == 1
    })
    .await;
    let st = inv.stats();
    assert_eq!(
        (
            st.directory_watch_reopened,
            st.announcements_resubscribed,
            st.announcements_ignored
        ),
        (1, 1, 0),
        "{st:?}"
    );
    stop.cancel();
}
