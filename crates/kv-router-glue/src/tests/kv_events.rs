use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::*;
use parking_lot::Mutex;

use crate::*;

/// An in-process plane that loses chosen KV events the first time they are sent.
struct LossyPlane {
    inner: InProcessPlane,
    drop_once: Mutex<HashSet<u64>>,
}

impl EventPlane for LossyPlane {
    fn name(&self) -> &'static str {
        "lossy"
    }
    fn publish<'a>(&'a self, subject: &'a Subject, payload: Vec<u8>) -> PlaneFuture<'a, ()> {
        if let Ok(e) = KvEvent::from_wire(&payload) {
            if self.drop_once.lock().remove(&e.event_id) {
                return Box::pin(async { Ok(()) });
            }
        }
        self.inner.publish(subject, payload)
    }
    fn subscribe<'a>(&'a self, subject: &'a Subject) -> PlaneFuture<'a, Subscription> {
        self.inner.subscribe(subject)
    }
    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a Subject,
        n: usize,
        timeout: Duration,
    ) -> PlaneFuture<'a, usize> {
        self.inner.wait_for_subscribers(subject, n, timeout)
    }
}

fn header() -> PublisherHeader {
    PublisherHeader {
        publisher: EngineId::fresh(),
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(42),
        tp_size: 1,
    }
}

fn stored(i: u64) -> KvEventData {
    KvEventData::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            sequence_hash: SequenceHash(i),
            token_hash: TokenBlockHash(i),
        }],
    }
}

async fn setup(
    drop: &[u64],
    ring: usize,
) -> (
    Arc<KvEventPublisher>,
    KvEventReceiver,
    tokio::task::JoinHandle<()>,
) {
    let plane: Arc<dyn EventPlane> = Arc::new(LossyPlane {
        inner: InProcessPlane::new(),
        drop_once: Mutex::new(drop.iter().copied().collect()),
    });
    let subject = Subject::new("test", "decode", "kv_events").unwrap();
    let rx = KvEventReceiver::subscribe(plane.clone(), &subject, Duration::from_millis(100))
        .await
        .unwrap();
    let publisher = Arc::new(KvEventPublisher::new(plane, subject, header(), ring));
    let server = publisher.serve_resync().await.unwrap();
    (publisher, rx, server)
}

fn ids(items: &[KvStreamItem]) -> Vec<String> {
    items
        .iter()
        .map(|i| match i {
            KvStreamItem::Event(e) => e.event_id.to_string(),
            KvStreamItem::Lost {
                from_event_id,
                to_event_id,
                ..
            } => format!("lost {from_event_id}-{to_event_id}"),
        })
        .collect()
}

#[tokio::test]
async fn in_order_stream_is_delivered_unchanged() {
    let (p, mut rx, server) = setup(&[], 16).await;
    for i in 1..=5 {
        assert_eq!(
            p.publish(StorageTier::RetainedGpuDirect, stored(i))
                .await
                .unwrap(),
            i
        );
    }
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(rx.next_timeout(Duration::from_secs(2)).await.unwrap());
    }
    assert_eq!(ids(&got), ["1", "2", "3", "4", "5"]);
    if let KvStreamItem::Event(e) = &got[2] {
        assert_eq!(e.data, stored(3));
        assert_eq!(e.tier, StorageTier::RetainedGpuDirect);
    }
    assert_eq!(
        rx.stats(),
        ReceiverStats {
            delivered: 5,
            ..Default::default()
        }
    );
    server.abort();
}

#[tokio::test]
async fn a_lost_event_is_replayed_on_resync_and_order_is_kept() {
    let (p, mut rx, server) = setup(&[3], 16).await;
    for i in 1..=5 {
        p.publish(StorageTier::RetainedGpuDirect, stored(i))
            .await
            .unwrap();
    }
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(rx.next_timeout(Duration::from_secs(2)).await.unwrap());
    }
    assert_eq!(ids(&got), ["1", "2", "3", "4", "5"]);
    let st = rx.stats();
    assert_eq!((st.delivered, st.gaps, st.lost), (5, 1, 0));
    // The replay resends 3, 4, 5; 4 and 5 were held already.
    let extra = rx.next_timeout(Duration::from_millis(50)).await;
    assert_eq!(extra, None);
    assert_eq!(rx.stats().duplicates, 2);
    server.abort();
}

#[tokio::test]
async fn an_unrecoverable_gap_is_reported_lost_then_the_stream_continues() {
    // Ring of 1: by the time the receiver asks for 2, it is gone.
    let (p, mut rx, server) = setup(&[2], 1).await;
    for i in 1..=4 {
        p.publish(StorageTier::RetainedGpuDirect, stored(i))
            .await
            .unwrap();
    }
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(rx.next_timeout(Duration::from_secs(2)).await.unwrap());
    }
    assert_eq!(ids(&got), ["1", "lost 2-2", "3", "4"]);
    assert_eq!(rx.stats().lost, 1);
    let req = ResyncRequest {
        publisher: EngineId::fresh(),
        from_event_id: 1,
    };
    assert_eq!(p.handle_resync(&req).await.unwrap(), ResyncOutcome::NotMine);
    server.abort();
}
