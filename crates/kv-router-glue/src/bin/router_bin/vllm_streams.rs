//! The `--vllm-events` streams of the router: started before anything
//! touches NATS, so that an endpoint that does not answer fails the start
//! with no connection, subscription or snapshot behind it; stopped after
//! the drain with one line of structured fields each.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use kv_descriptor::Role;
use kv_lookup::InventoryIndex;
use kv_router_glue::service::{RouterService, VllmEndpointSpec};
use kv_router_glue::vllm_events::{
    IngestStats, SkipReason, SubscriberStats, VllmIngest, VllmSubscriber,
};

use super::RouterError;

/// What a ZeroMQ TCP endpoint connects to, for telling two endpoints apart
/// however they are written (trial h44, 1: `tcp://127.0.0.1:5557`,
/// `tcp://localhost:5557` and `tcp://127.0.0.1:05557` passed as three
/// engines, every block of the one engine indexed under each).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// The socket addresses it resolves to, as the subscriber's connect
    /// resolves them (an IP literal is its own; IPv4-mapped IPv6 addresses
    /// as IPv4), sorted.
    Addrs(Vec<SocketAddr>),
    /// A name that did not resolve within [`RESOLVE_TIMEOUT`]: lowercased,
    /// without a trailing dot, with its port.
    Name(String, u16),
}

/// Longest wait for one endpoint's name lookup at start; a name not
/// resolved by then is compared as written (its connect fails anyway).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

impl Target {
    /// `endpoint` parsed as the subscriber parses it (the port as a
    /// number, an IPv6 host with or without brackets), a name resolved
    /// with the lookup its connect makes (`tokio::net::TcpStream::connect`
    /// of host and port). `None` for what is not a TCP endpoint (refused
    /// earlier by the flag's parser).
    async fn of(endpoint: &str) -> Option<Target> {
        let zeromq::Endpoint::Tcp(host, port) = zeromq::Endpoint::from_str(endpoint).ok()? else {
            return None;
        };
        // A connect to the unspecified address reaches this host's
        // loopback (Linux): `tcp://0.0.0.0:P` and `tcp://127.0.0.1:P` are
        // one listener (trial h47, 6: both accepted, every block twice).
        let canonical = |a: SocketAddr| {
            let ip = match a.ip().to_canonical() {
                std::net::IpAddr::V4(v4) if v4.is_unspecified() => {
                    std::net::Ipv4Addr::LOCALHOST.into()
                }
                std::net::IpAddr::V6(v6) if v6.is_unspecified() => {
                    std::net::Ipv6Addr::LOCALHOST.into()
                }
                ip => ip,
            };
            SocketAddr::new(ip, a.port())
        };
        let name = match host {
            zeromq::Host::Ipv4(ip) => {
                return Some(Target::Addrs(vec![canonical((ip, port).into())]))
            }
            zeromq::Host::Ipv6(ip) => {
                return Some(Target::Addrs(vec![canonical((ip, port).into())]))
            }
            zeromq::Host::Domain(name) => name,
        };
        let lookup = tokio::net::lookup_host((name.as_str(), port));
        // A failed or slow lookup falls through to the name as written.
        if let Ok(Ok(addrs)) = tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
            let mut addrs: Vec<SocketAddr> = addrs.map(canonical).collect();
            addrs.sort();
            addrs.dedup();
            if !addrs.is_empty() {
                return Some(Target::Addrs(addrs));
            }
        }
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        Some(Target::Name(name, port))
    }

    /// Whether a connect to `self` may reach the listener a connect to
    /// `other` reaches: an address in common (the connect tries each in
    /// turn), or the same name and port.
    fn meets(&self, other: &Target) -> bool {
        match (self, other) {
            (Target::Addrs(a), Target::Addrs(b)) => a.iter().any(|x| b.contains(x)),
            (Target::Name(..), Target::Name(..)) => self == other,
            _ => false,
        }
    }
}

/// One stream's endpoint and replay endpoint, as [`Target`]s.
struct StreamTargets {
    endpoint: Option<Target>,
    replay: Option<Target>,
}

/// Whether `a` and `b`, written `a_text` and `b_text`, reach one listener;
/// text that does not parse is compared as written.
fn same(a: &Option<Target>, b: &Option<Target>, a_text: &str, b_text: &str) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.meets(b),
        _ => a_text == b_text,
    }
}

/// `text` as an error names it, with `other`'s spelling when it differs
/// (`tcp://localhost:5557 (the same address as tcp://127.0.0.1:5557)`).
fn spelled(text: &str, other: &str) -> String {
    if text == other {
        text.to_string()
    } else {
        format!("{text} (the same address as {other})")
    }
}

/// Refuses two `--vllm-events` of one endpoint (every batch ingested twice
/// into one engine) or of one worker name (two engines under one derived
/// engine id, their blocks mixed and each one's restart resetting both):
/// a copied flag with only the ports changed (trial h42, 4). Endpoints are
/// compared by what they connect to ([`Target`]), not as text; a `replay=`
/// naming any stream's PUB endpoint is refused too (ZeroMQ refused it at
/// connect, exit 1, as `Provided sockets combination is not compatible`).
///
/// # Errors
/// [`RouterError::Config`] (exit 2) naming both occurrences, counted from 1.
pub(super) async fn check_distinct(specs: &[VllmEndpointSpec]) -> Result<(), RouterError> {
    let mut targets = Vec::with_capacity(specs.len());
    for spec in specs {
        let replay = match &spec.replay {
            Some(r) => Target::of(r).await,
            None => None,
        };
        targets.push(StreamTargets {
            endpoint: Target::of(&spec.endpoint).await,
            replay,
        });
    }
    let config = |reason: String| RouterError::Config {
        flag: "--vllm-events",
        reason,
    };
    for (i, (later, lt)) in specs.iter().zip(&targets).enumerate() {
        for (j, (other, ot)) in specs.iter().zip(&targets).enumerate() {
            if let Some(replay) = &later.replay {
                if same(&lt.replay, &ot.endpoint, replay, &other.endpoint) {
                    let whose = if i == j {
                        format!("occurrence {}", i + 1)
                    } else {
                        format!("occurrences {} and {}", j + 1, i + 1)
                    };
                    return Err(config(format!(
                        "{whose}: `replay={}` is a PUB endpoint (`tcp://...` before the first comma), not the engine's ROUTER replay endpoint",
                        spelled(replay, &other.endpoint)
                    )));
                }
            }
        }
        for (j, (earlier, et)) in specs[..i].iter().zip(&targets).enumerate() {
            let replays = match (&later.replay, &earlier.replay) {
                (Some(lr), Some(er)) if same(&lt.replay, &et.replay, lr, er) => {
                    Some(spelled(lr, er))
                }
                _ => None,
            };
            let clash = if same(
                &lt.endpoint,
                &et.endpoint,
                &later.endpoint,
                &earlier.endpoint,
            ) {
                format!(
                    "subscribe to the same endpoint {}",
                    spelled(&later.endpoint, &earlier.endpoint)
                )
            } else if let Some(replay) = replays {
                // One engine's replay serving the other's gaps: its blocks
                // taken in as the other's (trial h44, 1).
                format!("name the same replay endpoint {replay}")
            } else if later.worker_name == earlier.worker_name {
                format!(
                    "name the same worker `{}` (one derived engine id for two engines: give each its own `worker=`)",
                    later.worker_name
                )
            } else {
                continue;
            };
            return Err(config(format!(
                "occurrences {} and {} {clash}",
                j + 1,
                i + 1
            )));
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
    check_distinct(specs).await?;
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
