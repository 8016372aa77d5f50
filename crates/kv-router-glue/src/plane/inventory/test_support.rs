//! Test fixture shared by the inventory-rebuild tests here and the router
//! service's follower tests: a decode worker whose replay ring (2 events) is
//! shorter than the 6 Stored events it published before any router listened,
//! so only an inventory snapshot can rebuild what a new router missed.

use std::sync::Arc;

use kv_descriptor::{
    EngineId, KvEventData, LayoutFingerprint, Role, SequenceHash, StorageTier, StoredBlock,
    TokenBlockHash,
};

use crate::{EventPlane, KvEventPublisher, PublisherHeader, Subject};

/// Replay ring of [`idle_worker_after_six_events`]'s publisher (events).
pub(crate) const RING: usize = 2;

/// A Stored event of one block at bank `slot`: sequence hash `5000 + slot`,
/// no parent (each block its own chain root, as the rebuild tests expect).
pub(crate) fn stored_at(slot: u32) -> KvEventData {
    KvEventData::Stored {
        parent: None,
        blocks: vec![StoredBlock {
            sequence_hash: SequenceHash(5000 + u64::from(slot)),
            token_hash: TokenBlockHash(7),
            slot: Some(slot),
        }],
    }
}

/// A decode publisher on `subject` (ring [`RING`], serving resync) that has
/// published events 1..=6, `stored_at(0..6)` in the retained GPU tier, and
/// gone idle. Returns it with its resync task (keep it alive).
pub(crate) async fn idle_worker_after_six_events(
    events: Arc<dyn EventPlane>,
    subject: &Subject,
    engine: EngineId,
    layout_fingerprint: LayoutFingerprint,
    tp_size: u32,
) -> (Arc<KvEventPublisher>, tokio::task::JoinHandle<()>) {
    let publisher = Arc::new(KvEventPublisher::new(
        events,
        subject.clone(),
        PublisherHeader {
            publisher: engine,
            role: Role::Decode,
            layout_fingerprint,
            tp_size,
        },
        RING,
    ));
    let resync = publisher.serve_resync().await.unwrap();
    for slot in 0..6 {
        publisher
            .publish(StorageTier::RetainedGpuDirect, stored_at(slot))
            .await
            .unwrap();
    }
    (publisher, resync)
}
