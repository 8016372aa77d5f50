//! [`RouterInventory`] drops the subscription of an event subject that no
//! registered worker names any more (helper-20 finding 24: with worker keys
//! that change at every restart, subscriptions of dead workers piled up).

use kv_descriptor::Role;

use super::reopen::eventually;
use super::*;
use crate::announce_subject;

const P0: &str = "kv.t.p0.kv_events";
const SHARED: &str = "kv.t.shared.kv_events";

async fn subjects(inv: &RouterInventory) -> Vec<String> {
    let mut s: Vec<String> = inv.state.lock().await.subjects.keys().cloned().collect();
    s.sort();
    s
}

#[tokio::test]
async fn a_subject_no_registered_worker_names_is_released() {
    let (inv, _) = inventory();
    let e = |n: u128| EngineId(uuid::Uuid::from_u128(n));
    let fresh = |s: Option<Subject>| s.map(|s| s.as_str().to_string());
    // p0 alone on its subject; d1 and d2 share one.
    assert_eq!(
        fresh(
            inv.on_announcement(&announcement("p0", e(1), Role::Prefill, P0), 0)
                .await
        ),
        Some(P0.to_string())
    );
    assert_eq!(
        fresh(
            inv.on_announcement(&announcement("d1", e(2), Role::Decode, SHARED), 0)
                .await
        ),
        Some(SHARED.to_string())
    );
    assert_eq!(
        inv.on_announcement(&announcement("d2", e(3), Role::Decode, SHARED), 0)
            .await,
        None,
        "a subject already followed is not subscribed twice"
    );
    // d2 stays; p0 and d1 fall silent (limit 3 x 1000 ms).
    inv.on_announcement(&announcement("d2", e(3), Role::Decode, SHARED), 2_500)
        .await;
    assert_eq!(inv.tick(3_500).await, 2);
    assert_eq!(
        subjects(&inv).await,
        [SHARED],
        "d2 still names the shared subject"
    );
    let st = inv.stats();
    assert_eq!(
        (st.event_subjects_followed, st.event_subjects_released),
        (2, 1)
    );

    // p0 comes back as a new incarnation: its subject is followed afresh.
    assert_eq!(
        fresh(
            inv.on_announcement(&announcement("p0", e(4), Role::Prefill, P0), 3_600)
                .await
        ),
        Some(P0.to_string())
    );
    // d2 moves to another subject: the shared one has nobody left.
    let moved = "kv.t.moved.kv_events";
    assert_eq!(
        fresh(
            inv.on_announcement(&announcement("d2", e(3), Role::Decode, moved), 3_700)
                .await
        ),
        Some(moved.to_string())
    );
    assert_eq!(subjects(&inv).await, [moved, P0]);
    // p0's next incarnation announces another subject: its old one goes.
    let p0b = "kv.t.p0b.kv_events";
    inv.on_announcement(&announcement("p0", e(5), Role::Prefill, p0b), 3_800)
        .await;
    assert_eq!(subjects(&inv).await, [moved, p0b]);
    let st = inv.stats();
    assert_eq!(
        (st.event_subjects_followed, st.event_subjects_released),
        (5, 3)
    );
    // A late announcement of a retired incarnation changes nothing.
    inv.on_announcement(&announcement("p0", e(4), Role::Prefill, P0), 3_900)
        .await;
    assert_eq!(subjects(&inv).await, [moved, p0b]);
    assert_eq!(inv.stats().event_subjects_released, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_subject_is_unsubscribed_and_followed_again_when_named() {
    use crate::{InProcessDirectory, InProcessPlane};

    let plane = InProcessPlane::new();
    let inv = inventory_on(crate::InProcessInventory::new(), Duration::from_secs(1));
    let (_followers, stop) = follow_in_process(
        &inv,
        Arc::new(plane.clone()),
        Arc::new(InProcessDirectory::new()),
    )
    .await;
    let announce = announce_subject("t").unwrap();
    // d0's incarnation `engine` announces `to`: `to` gets subscribed and
    // `from` (when given) unsubscribed.
    let moves_to = |engine: u128, to: &'static str, from: Option<&'static str>| {
        let (plane, announce) = (plane.clone(), announce.clone());
        async move {
            let id = EngineId(uuid::Uuid::from_u128(engine));
            let a = announcement("d0", id, Role::Decode, to);
            plane.publish(&announce, a).await.unwrap();
            let to = parse_subject(to).unwrap();
            plane
                .wait_for_subscribers(&to, 1, Duration::from_secs(2))
                .await
                .unwrap();
            if let Some(from) = from {
                eventually(2, "left subject unsubscribed", || {
                    plane.subscriber_count(from) == 0
                })
                .await;
            }
        }
    };
    let old = "kv.t.d0.kv_events";
    let new = "kv.t.d0b.kv_events";
    plane
        .wait_for_subscribers(&announce, 1, Duration::from_secs(2))
        .await
        .unwrap();
    moves_to(1, old, None).await;
    // A new incarnation on another subject: the old subscription goes, the
    // new subject is subscribed.
    moves_to(2, new, Some(old)).await;
    assert_eq!(inv.stats().event_subjects_released, 1);
    // Named again (a third incarnation back on it): followed again, once.
    moves_to(3, old, Some(new)).await;
    assert_eq!(plane.subscriber_count(old), 1);
    let st = inv.stats();
    assert_eq!(
        (st.event_subjects_followed, st.event_subjects_released),
        (3, 2)
    );
    stop.cancel();
}

/// An in-process plane whose `subscribe` to a gated subject waits until the
/// gate opens, and to a failing subject fails (once each).
#[derive(Clone)]
struct GatedPlane {
    inner: crate::InProcessPlane,
    gated: Arc<parking_lot::Mutex<HashSet<String>>>,
    fail_once: Arc<parking_lot::Mutex<HashSet<String>>>,
    gate: Arc<tokio::sync::watch::Sender<bool>>,
}

impl GatedPlane {
    fn new() -> Self {
        Self {
            inner: crate::InProcessPlane::new(),
            gated: Arc::default(),
            fail_once: Arc::default(),
            gate: Arc::new(tokio::sync::watch::channel(false).0),
        }
    }
}

impl EventPlane for GatedPlane {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn publish<'a>(
        &'a self,
        subject: &'a Subject,
        payload: Vec<u8>,
    ) -> crate::plane::event_plane::PlaneFuture<'a, ()> {
        self.inner.publish(subject, payload)
    }
    fn subscribe<'a>(
        &'a self,
        subject: &'a Subject,
    ) -> crate::plane::event_plane::PlaneFuture<'a, crate::Subscription> {
        Box::pin(async move {
            if self.fail_once.lock().remove(subject.as_str()) {
                return Err(PlaneError::Subscribe {
                    subject: subject.to_string(),
                    reason: "test: refused once".into(),
                });
            }
            if self.gated.lock().contains(subject.as_str()) {
                let mut rx = self.gate.subscribe();
                rx.wait_for(|open| *open).await.unwrap();
            }
            self.inner.subscribe(subject).await
        })
    }
    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a Subject,
        n: usize,
        timeout: Duration,
    ) -> crate::plane::event_plane::PlaneFuture<'a, usize> {
        self.inner.wait_for_subscribers(subject, n, timeout)
    }
}

async fn say(plane: &GatedPlane, key: &str, engine: u128, subject: &str) {
    let a = announcement(
        key,
        EngineId(uuid::Uuid::from_u128(engine)),
        Role::Decode,
        subject,
    );
    plane
        .publish(&announce_subject("t").unwrap(), a)
        .await
        .unwrap();
}

/// `FollowStats` says "followed minus released is how many are subscribed
/// now". A follower whose subscribe failed removed its subject (so a later
/// announcement follows it again) without counting it released: after one
/// failure and one success the stats said 2 subscribed, with 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followed_minus_released_is_how_many_are_subscribed_after_a_failed_subscribe() {
    use crate::InProcessDirectory;
    let plane = GatedPlane::new();
    let s = "kv.t.s.kv_events";
    plane.fail_once.lock().insert(s.to_string());
    let inv = inventory_on(crate::InProcessInventory::new(), Duration::from_secs(1));
    let (_f, stop) = follow_in_process(
        &inv,
        Arc::new(plane.clone()),
        Arc::new(InProcessDirectory::new()),
    )
    .await;
    let subscribed = || {
        let st = inv.stats();
        st.event_subjects_followed - st.event_subjects_released
    };
    say(&plane, "d0", 1, s).await;
    eventually(2, "subscribe failed", || plane.fail_once.lock().is_empty()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(plane.inner.subscriber_count(s), 0);
    assert_eq!(subscribed(), 0, "nothing is subscribed after the failure");
    // The next announcement follows it again.
    say(&plane, "d0", 1, s).await;
    eventually(2, "subscribed", || plane.inner.subscriber_count(s) == 1).await;
    assert_eq!(subscribed(), 1);
    stop.cancel();
}
