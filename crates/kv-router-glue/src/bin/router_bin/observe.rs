//! The router's state copied into `/metrics` once a second: the followers'
//! (workers registered, streams open, counters), how many incarnations the
//! worker registry remembers, and the NATS client's slow-consumer drops.

use std::sync::Arc;
use std::time::Duration;

use kv_router_glue::metrics::ReuseMetrics;
use kv_router_glue::service::RouterInventory;
use tokio_util::sync::CancellationToken;

/// Copies `inventory`'s state into `metrics` once a second until `stop`
/// is cancelled (when the followers stop).
pub(crate) fn spawn(
    metrics: Arc<ReuseMetrics>,
    inventory: Arc<RouterInventory>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {
                    let workers = inventory.workers().await;
                    metrics.observe_router(workers, &inventory.followers_up(), &inventory.stats());
                    let (replaced, silenced) = inventory.remembered().await;
                    metrics.observe_remembered_incarnations(replaced, silenced);
                    metrics.observe_nats_slow_consumer_drops(
                        kv_router_glue::nats_slow_consumer_drops(),
                    );
                }
            }
        }
    })
}
