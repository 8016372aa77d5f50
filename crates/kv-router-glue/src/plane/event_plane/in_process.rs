//! The embedded event plane: one process, one map of subject to subscribers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

use super::{EventPlane, PlaneFuture, PlaneMessage, Subject, Subscription};
use crate::PlaneError;

/// In-process event plane (the default when everything runs in one process).
///
/// A subscription is registered synchronously inside `subscribe`, so it is
/// ready when `subscribe` returns. Channels are unbounded: a slow subscriber
/// costs memory, never a lost event. Clones share the same bus.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use kv_router_glue::*;
/// use std::time::Duration;
/// let plane = InProcessPlane::new();
/// let s = Subject::new("ns", "router", "kv_events").unwrap();
/// let mut sub = plane.subscribe(&s).await.unwrap();
/// plane.wait_for_subscribers(&s, 1, Duration::from_secs(1)).await.unwrap();
/// plane.publish(&s, b"hello".to_vec()).await.unwrap();
/// assert_eq!(sub.next().await.unwrap().payload, b"hello");
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct InProcessPlane {
    subscribers: Arc<Mutex<HashMap<String, Vec<UnboundedSender<PlaneMessage>>>>>,
}

impl InProcessPlane {
    /// A new, empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Ends every subscription to `subject`, as a closed client's do
    /// (tests of a follower that subscribes again).
    #[cfg(test)]
    pub(crate) fn end_subscriptions(&self, subject: &str) {
        self.subscribers.lock().remove(subject);
    }

    /// Live subscriptions to `subject` (tests of a follower that
    /// unsubscribes).
    #[cfg(test)]
    pub(crate) fn subscriber_count(&self, subject: &str) -> usize {
        self.live_count(subject)
    }

    fn live_count(&self, subject: &str) -> usize {
        let mut map = self.subscribers.lock();
        match map.get_mut(subject) {
            Some(list) => {
                list.retain(|tx| !tx.is_closed());
                list.len()
            }
            None => 0,
        }
    }
}

impl EventPlane for InProcessPlane {
    fn name(&self) -> &'static str {
        "in_process"
    }

    fn publish<'a>(&'a self, subject: &'a Subject, payload: Vec<u8>) -> PlaneFuture<'a, ()> {
        Box::pin(async move {
            let mut map = self.subscribers.lock();
            if let Some(list) = map.get_mut(subject.as_str()) {
                list.retain(|tx| {
                    tx.send(PlaneMessage {
                        subject: subject.as_str().to_string(),
                        payload: payload.clone(),
                    })
                    .is_ok()
                });
            }
            Ok(())
        })
    }

    fn subscribe<'a>(&'a self, subject: &'a Subject) -> PlaneFuture<'a, Subscription> {
        Box::pin(async move {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            self.subscribers
                .lock()
                .entry(subject.as_str().to_string())
                .or_default()
                .push(tx);
            let rx = super::Inbox::Unbounded(rx);
            Ok(Subscription::new(subject.as_str().to_string(), rx, None))
        })
    }

    fn wait_for_subscribers<'a>(
        &'a self,
        subject: &'a Subject,
        n: usize,
        timeout: Duration,
    ) -> PlaneFuture<'a, usize> {
        Box::pin(async move {
            let start = tokio::time::Instant::now();
            loop {
                let ready = self.live_count(subject.as_str());
                if ready >= n {
                    return Ok(ready);
                }
                if start.elapsed() >= timeout {
                    return Err(PlaneError::NotReady {
                        subject: subject.to_string(),
                        ready,
                        wanted: n,
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    }
}
