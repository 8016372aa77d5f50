//! The `--vllm-events` streams of the router: started before anything
//! touches NATS, so that an endpoint that does not answer fails the start
//! with no connection, subscription or snapshot behind it; stopped after
//! the drain with one log line each.

use std::sync::Arc;

use kv_descriptor::Role;
use kv_lookup::InventoryIndex;
use kv_router_glue::service::{RouterService, VllmEndpointSpec};
use kv_router_glue::vllm_events::{VllmIngest, VllmSubscriber};

use super::RouterError;

/// Registers each of `specs` with `index`, subscribes to it and catches up
/// through its replay endpoint; a prefill engine becomes an advise target
/// of `service`. One after the other, each within its connect timeout.
///
/// # Errors
/// [`RouterError::Vllm`] naming the first endpoint that the index refuses
/// or that does not answer (the streams started before it are stopped by
/// their drop).
pub(super) async fn start(
    specs: &[VllmEndpointSpec],
    index: &Arc<InventoryIndex>,
    service: &RouterService,
) -> Result<Vec<VllmSubscriber>, RouterError> {
    let mut subscribers = Vec::with_capacity(specs.len());
    for spec in specs {
        let vllm_err = |source| RouterError::Vllm {
            endpoint: spec.endpoint.clone(),
            source,
        };
        let ingest = VllmIngest::new(index.clone(), spec.worker).map_err(vllm_err)?;
        let sub = VllmSubscriber::start(spec.subscriber_config(), ingest)
            .await
            .map_err(vllm_err)?;
        if spec.worker.role == Role::Prefill {
            service.add_target(spec.worker.engine);
        }
        tracing::info!(endpoint = %spec.endpoint, worker = %spec.worker_name, engine = %spec.worker.engine, "ingesting vLLM KV events");
        subscribers.push(sub);
    }
    Ok(subscribers)
}

/// Stops each subscriber of `specs` (same order as [`start`] returned
/// them) and logs its counters.
pub(super) async fn stop(specs: &[VllmEndpointSpec], subscribers: Vec<VllmSubscriber>) {
    for (spec, sub) in specs.iter().zip(subscribers) {
        let (_, stats) = sub.stop().await;
        tracing::info!(endpoint = %spec.endpoint, stats = ?stats, "vLLM KV events stopped");
    }
}
