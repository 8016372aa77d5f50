//! A publisher's running state ([`Running`]) and how calls reach it: the
//! lock around it is held for a clone or a take only, never across a
//! blocking call or a GIL release (see [`WorkerPublisher`]).

use super::*;

/// What a publisher runs: its runtime, the periodic task, and the agent
/// (donor role) or the announcement (target role).
pub(super) struct Running {
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) ticker: tokio::task::JoinHandle<()>,
    pub(super) agent: Option<Arc<DonorAgent>>,
    /// A target's publisher of its own prefix-cache events (None for a donor).
    pub(super) prefix: Option<(Arc<KvEventPublisher>, u32)>,
}

impl WorkerPublisher {
    /// The running state, cloned under a lock held for the clone only;
    /// `PublishFailed` naming `what` after `close()`.
    pub(super) fn running(&self, what: &str) -> PyResult<Arc<Running>> {
        self.home.check(what, PublishFailed::new_err)?;
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| PublishFailed::new_err(format!("{what}: the publisher is closed")))
    }

    /// A target's prefix-cache event publisher and its tokens per block;
    /// `PublishFailed` naming `what` for a donor or after `close()`.
    pub(super) fn prefix_publisher(&self, what: &str) -> PyResult<(Arc<KvEventPublisher>, u32)> {
        self.running(what)?.prefix.clone().ok_or_else(|| {
            PublishFailed::new_err(format!(
                "{what}: a donor's KV events come from its bank (publish_events)"
            ))
        })
    }

    /// Publishes `data` (tier `device`) from the target's prefix publisher
    /// and flushes, bounded by the publisher's timeout, without the GIL.
    pub(super) fn publish_prefix(&self, py: Python<'_>, data: KvEventData) -> PyResult<()> {
        let r = self.running("publish_prefix")?;
        if r.prefix.is_none() {
            return Err(PublishFailed::new_err(
                "publish_prefix: a donor's KV events come from its bank (publish_events)",
            ));
        }
        let (timeout, url) = (self.timeout, self.shown_url.clone());
        // `r` moves in: if `close()` gave up waiting for this call, the last
        // reference (the runtime) drops here, without the GIL.
        py.allow_threads(move || {
            let (publisher, _) = r.prefix.as_ref().expect("checked above");
            r.runtime.block_on(within(&url, timeout, async {
                publisher
                    .publish(StorageTier::Device, data)
                    .await
                    .map(|_| ())
            }))
        })
    }

    pub(super) fn with_agent<R>(&self, f: impl FnOnce(&DonorAgent) -> R) -> Option<R> {
        let guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref()?.agent.as_deref().map(f)
    }

    /// Runs `f(agent)` on the runtime without the GIL, bounded by the
    /// publisher's timeout; `Ok(None)` for a target. `call` names the Python
    /// method in a refusal.
    pub(super) fn on_agent<T, F, Fut>(
        &self,
        py: Python<'_>,
        call: &str,
        f: F,
    ) -> PyResult<Option<T>>
    where
        T: Send,
        F: FnOnce(Arc<DonorAgent>) -> Fut + Send,
        Fut: std::future::Future<Output = PyResult<T>> + Send,
    {
        let r = self.running(call)?;
        let Some(agent) = r.agent.clone() else {
            return Ok(None);
        };
        let (timeout, url) = (self.timeout, self.shown_url.clone());
        py.allow_threads(move || {
            r.runtime.block_on(async {
                match tokio::time::timeout(timeout, f(agent)).await {
                    Ok(v) => v.map(Some),
                    Err(_) => Err(PublishFailed::new_err(format!(
                        "nats_url {url}: no answer within {timeout:?}"
                    ))),
                }
            })
        })
    }
}

/// `shared` once no other reference is left, waiting up to `limit` for the
/// calls that hold one to return; `None` past it (the caller's reference
/// dropped, the last call's drop then stops the runtime).
pub(super) fn wait_for_sole<T>(mut shared: Arc<T>, limit: Duration) -> Option<T> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        match Arc::try_unwrap(shared) {
            Ok(t) => return Some(t),
            Err(back) if std::time::Instant::now() < deadline => {
                shared = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => return None,
        }
    }
}

impl Drop for WorkerPublisher {
    fn drop(&mut self) {
        // Not closed: stop the ticker and runtime without blocking; the
        // agent's bank closes when its last reference drops, and the record
        // lapses with its TTL. No call is in flight (each borrows `self`),
        // so this is the last reference. In a forked child the runtime's
        // worker does not exist and the record is the parent's: forgotten.
        let home = self.home;
        if let Some(r) = self
            .running
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .and_then(|r| home.keep_here(r))
            .and_then(|r| Arc::try_unwrap(r).ok())
        {
            r.ticker.abort();
            r.runtime.shutdown_background();
        }
    }
}
