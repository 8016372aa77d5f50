//! The `--vllm-events` streams of the router: started before anything
//! touches NATS, so that an endpoint that does not answer fails the start
//! with no connection, subscription or snapshot behind it; stopped after
//! the drain with one line of structured fields each.

use std::sync::Arc;

use kv_descriptor::Role;
use kv_lookup::InventoryIndex;
use kv_router_glue::service::{RouterService, VllmEndpointSpec};
use kv_router_glue::vllm_events::{
    IngestStats, SkipReason, SubscriberStats, VllmIngest, VllmSubscriber,
};

use super::RouterError;

/// Refuses two `--vllm-events` of one endpoint (every batch ingested twice
/// into one engine) or of one worker name (two engines under one derived
/// engine id, their blocks mixed and each one's restart resetting both):
/// a copied flag with only the ports changed (trial h42, 4).
///
/// # Errors
/// [`RouterError::Config`] (exit 2) naming both occurrences, counted from 1.
pub(super) fn check_distinct(specs: &[VllmEndpointSpec]) -> Result<(), RouterError> {
    for (i, later) in specs.iter().enumerate() {
        for (j, earlier) in specs[..i].iter().enumerate() {
            let clash = if later.endpoint == earlier.endpoint {
                format!("subscribe to the same endpoint {}", later.endpoint)
            } else if later.replay.is_some() && later.replay == earlier.replay {
                // One engine's replay serving the other's gaps: its blocks
                // taken in as the other's (trial h44, 1).
                format!(
                    "name the same replay endpoint {}",
                    later.replay.as_deref().unwrap_or_default()
                )
            } else if later.worker_name == earlier.worker_name {
                format!(
                    "name the same worker `{}` (one derived engine id for two engines: give each its own `worker=`)",
                    later.worker_name
                )
            } else {
                continue;
            };
            return Err(RouterError::Config {
                flag: "--vllm-events",
                reason: format!("occurrences {} and {} {clash}", j + 1, i + 1),
            });
        }
    }
    Ok(())
}

/// Registers each of `specs` with `index`, subscribes to it and catches up
/// through its replay endpoint; a prefill engine becomes an advise target
/// of `service`. One after the other, each within its connect timeout.
///
/// # Errors
/// [`RouterError::Config`] from [`check_distinct`], before any stream
/// starts; [`RouterError::Vllm`] naming the first endpoint that the index
/// refuses or that does not answer (the streams started before it are
/// stopped by their drop).
pub(super) async fn start(
    specs: &[VllmEndpointSpec],
    index: &Arc<InventoryIndex>,
    service: &RouterService,
) -> Result<Vec<VllmSubscriber>, RouterError> {
    check_distinct(specs)?;
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

/// Adds to `followers` one task per stream of `specs` (same order as
/// [`start`] returned them) that ends when the stream's task does: before
/// the stop only by a panic, which then ends the serving phase as any
/// follower's end does (`stop.rs`, exit 1), after an error line naming the
/// endpoint. Swallowed, it left that engine's blocks unfollowed while
/// `/healthz` stayed 200. Dropping `followers` before [`stop`] aborts
/// these first, so a stop is never reported as an end.
pub(super) fn supervise(
    specs: &[VllmEndpointSpec],
    subscribers: &[VllmSubscriber],
    followers: &mut tokio::task::JoinSet<()>,
) {
    for (spec, sub) in specs.iter().zip(subscribers) {
        let ended = sub.ended();
        let endpoint = spec.endpoint.clone();
        followers.spawn(async move {
            ended.await;
            tracing::error!(%endpoint, "the vLLM stream's task ended while serving (a panic, reported above)");
        });
    }
}

/// Stops each subscriber of `specs` (same order as [`start`] returned
/// them) and logs its counters.
pub(super) async fn stop(specs: &[VllmEndpointSpec], subscribers: Vec<VllmSubscriber>) {
    for (spec, sub) in specs.iter().zip(subscribers) {
        let (_, stats) = sub.stop().await;
        log_stopped(spec, &stats);
    }
}

/// Logs one stream's counters as fields of their own: a log pipeline reads
/// each as a field, where the Debug dump of the stats
/// (`SubscriberStats { next_seq: 3, ... }`) was one opaque string.
fn log_stopped(spec: &VllmEndpointSpec, stats: &SubscriberStats) {
    // Destructured whole, so a counter added to either struct fails to
    // compile here until it is logged too.
    let SubscriberStats {
        next_seq,
        live_batches,
        replayed_batches,
        duplicates,
        replay_requests,
        replay_failures,
        disconnects,
        reconnects,
        lost_batches,
        undecodable,
        malformed_frames,
        restarts,
        implausible_seq,
        ingest:
            IngestStats {
                batches,
                events,
                stored_blocks,
                removed_blocks,
                clears,
                unknown_removals,
                skipped,
                refused_by_index,
                resets,
                replacements,
                marked_for_resync,
            },
    } = stats;
    tracing::info!(
        endpoint = %spec.endpoint,
        worker = %spec.worker_name,
        engine = %spec.worker.engine,
        next_seq,
        live_batches,
        replayed_batches,
        duplicates,
        replay_requests,
        replay_failures,
        disconnects,
        reconnects,
        lost_batches,
        undecodable,
        malformed_frames,
        restarts,
        implausible_seq,
        batches,
        events,
        stored_blocks,
        removed_blocks,
        clears,
        unknown_removals,
        refused_by_index,
        resets,
        replacements,
        marked_for_resync,
        skipped = skipped.iter().sum::<u64>(),
        skipped_by_reason = %skipped_pairs(&stats.ingest),
        "vLLM KV events stopped"
    );
}

/// The skipped events per reason as [`super::field_pairs`] (reasons with
/// none left out).
fn skipped_pairs(ingest: &IngestStats) -> String {
    super::field_pairs(SkipReason::ALL.iter().filter_map(|&r| {
        let n = ingest.skipped(r);
        (n > 0).then(|| (r.as_str().to_string(), n.to_string()))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_events_are_named_by_reason() {
        let mut ingest = IngestStats::default();
        assert_eq!(skipped_pairs(&ingest), "none");
        ingest.skipped[SkipReason::Lora as usize] = 2;
        ingest.skipped[SkipReason::UnknownMedium as usize] = 1;
        assert_eq!(skipped_pairs(&ingest), "unknown_medium:1,lora:2");
    }
}
