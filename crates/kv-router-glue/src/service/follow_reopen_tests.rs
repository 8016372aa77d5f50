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

/// An [`EventPlane`] that panics when asked to subscribe to `panic_on` and
/// passes everything else to an in-process plane: a bug in one subject's
/// task, as seen by its follower.
struct PanicOnSubscribe {
    inner: crate::InProcessPlane,
    panic_on: &'static str,
}

impl EventPlane for PanicOnSubscribe {
    fn name(&self) -> &'static str {
        "panic_on_subscribe"
    }
    fn publish<'a>(
        &'a self,
        subject: &'a crate::Subject,
        payload: Vec<u8>,
    ) -> crate::PlaneFuture<'a, ()> {
        self.inner.publish(subject, payload)
    }
    fn subscribe<'a>(
        &'a self,
        subject: &'a crate::Subject,
    ) -> crate::PlaneFuture<'a, crate::Subscription> {
        assert_ne!(
            subject.as_str(),
            self.panic_on,
            "a bug in this subject's task"
        );
        self.inner.subscribe(subject)
    }
    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a crate::Subject,
        n: usize,
        timeout: Duration,
    ) -> crate::PlaneFuture<'a, usize> {
        self.inner.wait_for_subscribers(subject, n, timeout)
    }
}

/// A panic in the task following one announced event subject ends the
/// announcement follower with the same message (what the router binary
/// exits 1 on), where it used to be reaped silently and that subject went
/// unfollowed with the followers still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_subjects_task_ends_the_announcement_follower() {
    let plane = crate::InProcessPlane::new();
    let subject = "kv.t.prefill.kv_events";
    let faulty = PanicOnSubscribe {
        inner: plane.clone(),
        panic_on: subject,
    };
    let inv = inventory_on(crate::InProcessInventory::new(), Duration::from_secs(1));
    let directory = Arc::new(crate::InProcessDirectory::new());
    let (mut followers, stop) = follow_in_process(&inv, Arc::new(faulty), directory).await;
    let announce = crate::announce_subject("t").unwrap();
    let a = announcement("p0", EngineId::fresh(), Role::Prefill, subject);
    plane.publish(&announce, a).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), followers.join_next())
        .await
        .expect("a follower ends within 5 s")
        .expect("a follower task");
    let err = ended.expect_err("the follower panicked");
    assert!(err.is_panic(), "{err}");
    let payload = err.into_panic();
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        message.contains("a bug in this subject's task"),
        "{message}"
    );
    // The directory follower is still running: only the announcement one ended.
    assert_eq!(followers.len(), 1);
    stop.cancel();
}
