//! What ends the serving phase: SIGTERM or SIGINT, or a follower task that
//! ends on its own. The followers (announcements with the silence tick,
//! the donor directory watch, and one watcher per `--vllm-events` stream)
//! run until the stop; one that ends before it panicked (a bug), and a
//! router that served on would answer advise requests from an index nobody
//! updates any more, with `/healthz` still 200 (trial h42, 1). So it exits
//! instead (1), for its supervisor to restart it. A panic in the task
//! following one announced event subject reaches here too: the
//! announcement follower that reaps those tasks panics with its payload
//! (`service/follow_tasks.rs`); a vLLM stream's task is watched through
//! `VllmSubscriber::ended` (`vllm_streams::supervise`).
//!
//! After the stop, the followers' counters are logged on a line of their own.

use tokio::signal::unix::Signal;
use tokio::task::{JoinError, JoinSet};

/// Waits for SIGTERM or SIGINT (returns its name) or for a task of
/// `followers` to end first (returns why, for the error).
pub(crate) async fn until_signal(
    term: &mut Signal,
    int: &mut Signal,
    followers: &mut JoinSet<()>,
) -> Result<&'static str, String> {
    tokio::select! {
        _ = term.recv() => Ok("SIGTERM"),
        _ = int.recv() => Ok("SIGINT"),
        Some(ended) = followers.join_next() => Err(match ended {
            Ok(()) => "it returned".to_string(),
            Err(e) => why(e),
        }),
    }
}

fn why(e: JoinError) -> String {
    if !e.is_panic() {
        return format!("it was cancelled ({e})");
    }
    let payload = e.into_panic();
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic payload".into());
    format!("it panicked: {message}")
}

/// Logs `stats` as one line of structured fields: the counters that
/// matter most by name, and every counter (new ones included) in
/// `follow` as [`super::field_pairs`].
pub(crate) fn log_follow_stats(stats: &kv_router_glue::service::FollowStats) {
    let all = match serde_json::to_value(stats) {
        Ok(serde_json::Value::Object(fields)) => {
            super::field_pairs(fields.iter().map(|(k, v)| (k.clone(), v.to_string())))
        }
        _ => super::field_pairs([]),
    };
    // The binary's own target, as when this lived in its main module.
    tracing::info!(
        target: "kv_reuse_router",
        announcements = stats.announcements,
        announcements_ignored = stats.announcements_ignored,
        workers_dropped = stats.workers_dropped,
        workers_readmitted = stats.workers_readmitted,
        events_applied = stats.events_applied,
        events_refused = stats.events_refused,
        lost_ranges = stats.lost_ranges,
        snapshots_applied = stats.snapshots_applied,
        snapshots_failed = stats.snapshots_failed,
        follow = %all,
        "follower counters at stop"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panicking follower is reported with its message, before any signal.
    #[tokio::test]
    async fn a_follower_that_panics_ends_the_wait_with_its_message() {
        use tokio::signal::unix::{signal, SignalKind};
        // Real handlers for signals this test never sends.
        let mut term = signal(SignalKind::user_defined1()).unwrap();
        let mut int = signal(SignalKind::user_defined2()).unwrap();
        let mut followers = JoinSet::new();
        followers.spawn(std::future::pending::<()>());
        followers.spawn(async { panic!("assertion failed: a free key") });
        let got = until_signal(&mut term, &mut int, &mut followers).await;
        assert_eq!(got, Err("it panicked: assertion failed: a free key".into()));
    }
}
