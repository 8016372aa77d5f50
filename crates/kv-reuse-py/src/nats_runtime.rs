//! What the extension's NATS users share (`WorkerPublisher`, the directory
//! client): the small tokio runtime each owns, deadlines on NATS calls, and
//! the checks of the durations they are given.

use std::time::Duration;

use pyo3::prelude::*;

use kv_router_glue::PlaneError;

use crate::errors::{bad_argument, PublishFailed};

/// Seconds in `range` as a duration, naming `argument` otherwise.
pub(crate) fn seconds_in(
    argument: &str,
    s: f64,
    range: std::ops::RangeInclusive<f64>,
) -> PyResult<Duration> {
    if s.is_finite() && range.contains(&s) {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(bad_argument(
            argument,
            format!("{s} is not in [{}, {}] seconds", range.start(), range.end()),
        ))
    }
}

/// nats-server's floor for a key-value bucket's `max_age`
/// ([`kv_router_glue::NATS_MIN_MAX_AGE`], 100 ms), in seconds: a donor's
/// record TTL (and so its lease) may not be shorter.
pub(crate) const NATS_MAX_AGE_FLOOR_S: f64 = kv_router_glue::NATS_MIN_MAX_AGE.as_secs_f64();

/// `BadArgument` naming `argument` and the floor when `s` seconds is below
/// [`NATS_MAX_AGE_FLOOR_S`] (the range check that follows it refuses the
/// rest: NaN, infinities, past the maximum).
pub(crate) fn not_below_nats_floor(argument: &str, s: f64) -> PyResult<()> {
    if s < NATS_MAX_AGE_FLOOR_S {
        return Err(bad_argument(
            argument,
            format!(
                "{s} s is below nats-server's {NATS_MAX_AGE_FLOOR_S} s floor for a key-value \
                 max_age (the directory record's TTL)"
            ),
        ));
    }
    Ok(())
}

/// The runtime that drives a publisher's NATS connections.
pub(crate) fn runtime(what: &str) -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("kv-reuse-py-{what}"))
        .enable_all()
        .build()
        .map_err(|e| PublishFailed::new_err(format!("{what}: tokio runtime: {e}")))
}

/// `f` within `timeout`, else `PublishFailed` naming `nats_url`.
pub(crate) async fn within<T>(
    url: &str,
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, PlaneError>>,
) -> PyResult<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(PublishFailed::new_err(format!("nats_url {url}: {e}"))),
        Err(_) => Err(PublishFailed::new_err(format!(
            "nats_url {url}: no answer within {timeout:?}"
        ))),
    }
}
