//! What the extension's NATS users share (`WorkerPublisher`, the directory
//! client): the small tokio runtime each owns, deadlines on NATS calls, and
//! the checks of the durations they are given.

use std::time::Duration;

use pyo3::prelude::*;

use kv_router_glue::{redact_url, PlaneError};

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

/// `BadArgument` naming `nats_url` when it is not a NATS server URL or a
/// comma-separated list of them (empty, an `http://` scheme, no host):
/// refused before connecting, so a malformed URL does not read as an
/// unreachable server. Any password in it is shown as `***`.
pub(crate) fn check_nats_url(url: &str) -> PyResult<()> {
    kv_router_glue::nats_server_addrs(url)
        .map(|_| ())
        .map_err(|why| bad_argument("nats_url", format!("{:?}: {why}", redact_url(url))))
}

/// `BadArgument` naming `bucket` when NATS would refuse it as a key-value
/// bucket name; checked before connecting, so it is not reported as a
/// NATS failure.
pub(crate) fn check_bucket(bucket: &str) -> PyResult<()> {
    match kv_router_glue::bucket_name_problem(bucket) {
        None => Ok(()),
        Some(why) => Err(bad_argument("bucket", format!("{bucket:?}: {why}"))),
    }
}

/// A NATS plane error as the Python exception: the caller's bucket name
/// (refused, or absent where it may not be created) is `BadArgument`
/// naming `bucket`; anything else `PublishFailed` naming `nats_url`.
pub(crate) fn plane_error(url: &str, e: PlaneError) -> PyErr {
    match e {
        PlaneError::InvalidBucket { .. } => bad_argument("bucket", e),
        PlaneError::NoSuchBucket { bucket } => bad_argument(
            "bucket",
            format!(
                "key-value bucket {bucket:?} does not exist on the NATS server: no donor or \
                 router created it (check the name against the donors' `bucket` and the \
                 router's --directory-bucket, or pass create=True)"
            ),
        ),
        other => PublishFailed::new_err(format!("nats_url {}: {other}", redact_url(url))),
    }
}

/// `f` within `timeout`, else `PublishFailed` naming `nats_url` (errors
/// as [`plane_error`]).
pub(crate) async fn within<T>(
    url: &str,
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, PlaneError>>,
) -> PyResult<T> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(plane_error(url, e)),
        Err(_) => Err(PublishFailed::new_err(format!(
            "nats_url {}: no answer within {timeout:?}",
            redact_url(url)
        ))),
    }
}
