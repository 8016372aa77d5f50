use std::time::Duration;

use crate::*;

#[tokio::test]
async fn in_process_delivers_to_every_ready_subscriber_only_on_its_subject() {
    let plane = InProcessPlane::new();
    let a = Subject::new("ns1", "decode", "kv_events").unwrap();
    let b = Subject::new("ns2", "decode", "kv_events").unwrap();
    let mut s1 = plane.subscribe(&a).await.unwrap();
    let mut s2 = plane.subscribe(&a).await.unwrap();
    let mut other = plane.subscribe(&b).await.unwrap();
    assert_eq!(
        plane
            .wait_for_subscribers(&a, 2, Duration::from_secs(1))
            .await
            .unwrap(),
        2
    );
    plane.publish(&a, vec![1, 2, 3]).await.unwrap();
    assert_eq!(s1.next().await.unwrap().payload, vec![1, 2, 3]);
    let m = s2.next().await.unwrap();
    assert_eq!(
        (m.subject.as_str(), m.payload.as_slice()),
        ("kv.ns1.decode.kv_events", &[1u8, 2, 3][..])
    );
    assert_eq!(other.next_timeout(Duration::from_millis(20)).await, None);
}

#[tokio::test]
async fn barrier_times_out_with_counts_and_dropped_subscribers_leave() {
    let plane = InProcessPlane::new();
    let s = Subject::new("ns", "c", "t").unwrap();
    let sub = plane.subscribe(&s).await.unwrap();
    let e = plane
        .wait_for_subscribers(&s, 2, Duration::from_millis(30))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            PlaneError::NotReady {
                ready: 1,
                wanted: 2,
                ..
            }
        ),
        "{e}"
    );
    drop(sub);
    let e = plane
        .wait_for_subscribers(&s, 1, Duration::from_millis(10))
        .await
        .unwrap_err();
    assert!(matches!(e, PlaneError::NotReady { ready: 0, .. }), "{e}");
}

#[test]
fn subjects_refuse_wildcards_and_separators() {
    for (ns, c, t, field) in [
        ("", "c", "t", "namespace"),
        ("a*", "c", "t", "namespace"),
        ("a", "b.c", "t", "component"),
        ("a", "b", ">", "topic"),
        ("a", "b", "x y", "topic"),
    ] {
        let e = Subject::new(ns, c, t).unwrap_err();
        assert!(
            matches!(&e, PlaneError::InvalidSubject { field: f, .. } if *f == field),
            "{e}"
        );
    }
    let s = Subject::new("a", "b", "events").unwrap();
    assert_eq!(s.topic(), "events");
    assert_eq!(resync_subject(&s).unwrap().as_str(), "kv.a.b.events_resync");
}
