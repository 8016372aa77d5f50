//! Prometheus metrics of decode-to-prefill reuse, and a `/metrics` HTTP endpoint.
//!
//! [`ReuseMetrics`] owns a `prometheus-client` registry with these families
//! (OpenMetrics text; units in the names):
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `kv_reuse_decisions_total` | counter | `verdict` | advisor decisions: `admit` or the refusal reason |
//! | `kv_reuse_fetches_total` | counter | `outcome` | fetches executed: `completed` or `fallback` |
//! | `kv_reuse_fallbacks_total` | counter | `stage`, `cause` | fetches that fell back to recompute, by stage ([`FetchError::stage`]) and cause ([`FetchError::cause_label`]) |
//! | `kv_reuse_fetched_bytes_total` | counter | | payload bytes of completed fetches |
//! | `kv_reuse_host_payload_bytes_total` | counter | | of those, bytes staged through host memory |
//! | `kv_reuse_transfer_latency_seconds` | histogram | | delivery wall time of completed fetches |
//! | `kv_reuse_lookup_latency_seconds` | histogram | | donor lookup wall time |
//! | `kv_reuse_retained_bytes` | gauge | `engine`, `rank` | bytes of ready blocks in a retained bank |
//! | `kv_reuse_advise_requests_total` | counter | `outcome` | advise requests the router service answered: `decided` or the refusal kind (`AdviseRefusal::label`) |
//! | `kv_reuse_advise_latency_seconds` | histogram | | router service time of one advise request, payload in to reply out |
//! | `kv_reuse_router_workers` | gauge | | workers the router has registered (announced, not dropped) |
//! | `kv_reuse_router_follower_up` | gauge | `stream` | 1 while the router's `directory` watch / `announcements` subscription is open, 0 while it is opened again |
//! | `kv_reuse_router_incarnations_remembered` | gauge | `kind` | incarnations the router's worker registry remembers now: `replaced` ones and `silenced` ones (dropped for silence, not back yet); each kind is capped at `kv_reuse_router_incarnations_remembered_limit` |
//! | `kv_reuse_router_incarnations_remembered_limit` | gauge | | most incarnations of each kind the registry remembers ([`crate::MAX_REMEMBERED`]); past it the one heard of longest ago is forgotten |
//! | `kv_reuse_router_follow_total` | counter | `item` | what the router's followers took in, one `item` per `FollowStats` field (`announcements`, `events_applied`, `events_refused`, `snapshots_failed`, `directory_watch_reopened`, ...) |
//! | `kv_reuse_nats_slow_consumer_drops_total` | counter | | messages the process's NATS client dropped because a subscriber fell behind its buffer (`nats_slow_consumer_drops`) |
//!
//! [`MetricsServer`] serves the registry on `GET /metrics` over HTTP/1.1 (one
//! response per connection, `Connection: close`), for the worker and the
//! router processes alike. Anything else gets 404 (other paths) or 405
//! (other methods); requests larger than 8 KiB or slower than 5 s are dropped,
//! and at most [`MAX_CONNECTIONS`] are served at once (a connection beyond
//! that is closed at accept, so slow or idle clients cannot pile up tasks).
//! A host with its own HTTP server mounts [`ReuseMetrics::encode`] instead.

mod server;
pub mod spans;

pub use server::{Health, HealthProbe, MetricsServer, MAX_CONNECTIONS};

use std::time::Duration;

use kv_bank::BankManager;
use kv_descriptor::EngineId;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[cfg(feature = "worker")]
use crate::FetchOutcome;
use crate::{AdmissionDecision, FetchError, RefuseReason, Verdict};

type Labels = Vec<(String, String)>;

/// Content type of the exposition (OpenMetrics text 1.0.0).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The metric families of one process (router or worker).
///
/// ```
/// use std::time::Duration;
/// use kv_router_glue::metrics::ReuseMetrics;
/// let m = ReuseMetrics::new();
/// m.observe_lookup(Duration::from_micros(40));
/// let text = m.encode();
/// assert!(text.contains("kv_reuse_lookup_latency_seconds_count 1"));
/// assert!(text.ends_with("# EOF\n"));
/// ```
// The fetch families stay registered without `worker` (only `record_fetch`
// writes them) so that every process exposes the same families.
#[cfg_attr(not(feature = "worker"), allow(dead_code))]
pub struct ReuseMetrics {
    registry: Registry,
    decisions: Family<Labels, Counter>,
    fetches: Family<Labels, Counter>,
    fallbacks: Family<Labels, Counter>,
    fetched_bytes: Counter,
    host_payload_bytes: Counter,
    transfer_latency: Histogram,
    lookup_latency: Histogram,
    retained_bytes: Family<Labels, Gauge>,
    advise_requests: Family<Labels, Counter>,
    router_workers: Gauge,
    follower_up: Family<Labels, Gauge>,
    incarnations_remembered: Family<Labels, Gauge>,
    follow: Family<Labels, Counter>,
    nats_slow_consumer_drops: Counter,
    advise_latency: Histogram,
}

impl std::fmt::Debug for ReuseMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReuseMetrics").finish_non_exhaustive()
    }
}

impl Default for ReuseMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn label(k: &str, v: impl Into<String>) -> Labels {
    vec![(k.to_owned(), v.into())]
}

/// Label value of a refusal: its kind, without free-text detail (the
/// detail is in the decision log; a label must have few values).
pub fn refuse_label(reason: &RefuseReason) -> &'static str {
    match reason {
        RefuseReason::ReuseDisabled => "reuse_disabled",
        RefuseReason::GpuPathDisabled => "gpu_path_disabled",
        RefuseReason::TooFewBlocks => "too_few_blocks",
        RefuseReason::SavingBelowMinimum => "saving_below_minimum",
        RefuseReason::NoDonor(_) => "no_donor",
        RefuseReason::HintUnavailable(_) => "hint_unavailable",
        RefuseReason::Cancelled => "cancelled",
    }
}

/// Labels of a fetch fallback in `kv_reuse_fallbacks_total`: `stage`
/// ([`FetchError::stage`]: `hint` for a hint refused before anything was
/// touched, else `reserve`, `pin`, `plan`, `transfer` or `verify`; a commit
/// cannot fail) and `cause` ([`FetchError::cause_label`], one stable
/// `snake_case` value per cause, no free text).
///
/// ```
/// use kv_router_glue::{metrics::fallback_labels, FallbackCause, FetchError};
/// let e = FetchError::Fallback { stage: "pin", cause: FallbackCause::MissingRankMemory { rank: 1 } };
/// assert_eq!(fallback_labels(&e), ("pin", "missing_rank_memory"));
/// ```
pub fn fallback_labels(e: &FetchError) -> (&'static str, &'static str) {
    (e.stage(), e.cause_label())
}

impl ReuseMetrics {
    /// A registry with every family registered and zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kv_reuse");
        let decisions = Family::<Labels, Counter>::default();
        let fetches = Family::<Labels, Counter>::default();
        let fallbacks = Family::<Labels, Counter>::default();
        let fetched_bytes = Counter::default();
        let host_payload_bytes = Counter::default();
        // 10 µs .. ~5 s: a small fetch over NVLink to a large one through TCP.
        let transfer_latency = Histogram::new(exponential_buckets(1e-5, 2.0, 20));
        // 1 µs .. ~0.5 s: lookups are budgeted in ms.
        let lookup_latency = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        let retained_bytes = Family::<Labels, Gauge>::default();
        let advise_requests = Family::<Labels, Counter>::default();
        // 1 µs .. ~0.5 s, as lookups: an advise is a lookup plus decoding.
        let advise_latency = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        registry.register(
            "decisions",
            "Advisor decisions by verdict (admit or refusal reason)",
            decisions.clone(),
        );
        registry.register(
            "fetches",
            "Fetches executed by outcome (completed or fallback)",
            fetches.clone(),
        );
        registry.register(
            "fallbacks",
            "Fetches that fell back to recompute, by reason",
            fallbacks.clone(),
        );
        registry.register(
            "fetched_bytes",
            "Payload bytes moved by completed fetches",
            fetched_bytes.clone(),
        );
        registry.register(
            "host_payload_bytes",
            "Payload bytes of completed fetches staged through host memory",
            host_payload_bytes.clone(),
        );
        registry.register_with_unit(
            "transfer_latency",
            "Delivery wall time of completed fetches",
            prometheus_client::registry::Unit::Seconds,
            transfer_latency.clone(),
        );
        registry.register_with_unit(
            "lookup_latency",
            "Donor lookup wall time",
            prometheus_client::registry::Unit::Seconds,
            lookup_latency.clone(),
        );
        registry.register_with_unit(
            "retained",
            "Bytes of ready blocks in a retained bank, per engine and TP rank",
            prometheus_client::registry::Unit::Bytes,
            retained_bytes.clone(),
        );
        registry.register(
            "advise_requests",
            "Advise requests answered by the router service, by outcome (decided or refusal kind)",
            advise_requests.clone(),
        );
        registry.register_with_unit(
            "advise_latency",
            "Router service time of one advise request (decode, decide, encode)",
            prometheus_client::registry::Unit::Seconds,
            advise_latency.clone(),
        );
        let router_workers = Gauge::default();
        let follower_up = Family::<Labels, Gauge>::default();
        let follow = Family::<Labels, Counter>::default();
        let incarnations_remembered = Family::<Labels, Gauge>::default();
        let incarnations_remembered_limit: Gauge = Gauge::default();
        incarnations_remembered_limit.set(i64::try_from(crate::MAX_REMEMBERED).unwrap_or(i64::MAX));
        registry.register(
            "router_workers",
            "Workers the router has registered (announced and not dropped)",
            router_workers.clone(),
        );
        registry.register(
            "router_follower_up",
            "1 while the router's follower stream is open, 0 while it is opened again",
            follower_up.clone(),
        );
        registry.register(
            "router_incarnations_remembered",
            "Incarnations the router's worker registry remembers now, by kind (replaced, silenced)",
            incarnations_remembered.clone(),
        );
        registry.register(
            "router_incarnations_remembered_limit",
            "Most incarnations of each kind the worker registry remembers; past it the oldest is forgotten",
            incarnations_remembered_limit,
        );
        registry.register(
            "router_follow",
            "What the router's followers took in, by item (a FollowStats field)",
            follow.clone(),
        );
        let nats_slow_consumer_drops = Counter::default();
        registry.register(
            "nats_slow_consumer_drops",
            "Messages the NATS client dropped because a subscriber fell behind its buffer",
            nats_slow_consumer_drops.clone(),
        );
        Self {
            registry,
            nats_slow_consumer_drops,
            router_workers,
            follower_up,
            incarnations_remembered,
            follow,
            decisions,
            fetches,
            fallbacks,
            fetched_bytes,
            host_payload_bytes,
            transfer_latency,
            lookup_latency,
            retained_bytes,
            advise_requests,
            advise_latency,
        }
    }

    /// Counts one answered advise request: `outcome` is `decided` or a
    /// refusal label; `elapsed` is the service time (decode to encode).
    pub fn record_advise(&self, outcome: &'static str, elapsed: Duration) {
        self.advise_requests
            .get_or_create(&label("outcome", outcome))
            .inc();
        self.advise_latency.observe(elapsed.as_secs_f64());
    }

    /// Counts one advisor decision.
    pub fn record_decision(&self, d: &AdmissionDecision) {
        let verdict = match &d.verdict {
            Verdict::Admit => "admit",
            Verdict::Refuse(r) => refuse_label(r),
        };
        self.decisions
            .get_or_create(&label("verdict", verdict))
            .inc();
    }

    /// Observes one donor lookup's wall time.
    pub fn observe_lookup(&self, elapsed: Duration) {
        self.lookup_latency.observe(elapsed.as_secs_f64());
    }

    /// Records one executed fetch: completed (bytes, host bytes, delivery
    /// time from its report) or fallen back (by [`fallback_labels`]).
    #[cfg(feature = "worker")]
    pub fn record_fetch(&self, result: &Result<FetchOutcome, FetchError>) {
        match result {
            Ok(o) => {
                self.fetches
                    .get_or_create(&label("outcome", "completed"))
                    .inc();
                self.fetched_bytes.inc_by(o.report.counters.bytes);
                self.host_payload_bytes
                    .inc_by(o.report.counters.host_payload_bytes);
                self.transfer_latency
                    .observe(o.report.elapsed_us as f64 / 1e6);
            }
            Err(e) => {
                self.fetches
                    .get_or_create(&label("outcome", "fallback"))
                    .inc();
                let (stage, cause) = fallback_labels(e);
                self.fallbacks
                    .get_or_create(&vec![
                        ("stage".to_owned(), stage.to_owned()),
                        ("cause".to_owned(), cause.to_owned()),
                    ])
                    .inc();
            }
        }
    }

    /// Sets the retained bytes of `engine`'s bank on `rank`.
    pub fn set_retained_bytes(&self, engine: EngineId, rank: u32, bytes: u64) {
        let labels = vec![
            ("engine".to_owned(), engine.to_string()),
            ("rank".to_owned(), rank.to_string()),
        ];
        self.retained_bytes
            .get_or_create(&labels)
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets the retained bytes of every rank of `bank`: ready blocks x slot
    /// bytes (every rank holds the same logical slots).
    pub fn observe_bank(&self, bank: &BankManager) {
        let inv = bank.inventory();
        let bytes = inv.ready.len() as u64 * inv.slot_bytes;
        let engine = bank.owner().engine_id;
        for rank in 0..bank.manifest().layout().tp_size() {
            self.set_retained_bytes(engine, rank, bytes);
        }
    }

    /// Raises `kv_reuse_nats_slow_consumer_drops_total` to `total` (the
    /// process's count so far, `nats_slow_consumer_drops`; a smaller value
    /// changes nothing).
    ///
    /// ```
    /// use kv_router_glue::metrics::ReuseMetrics;
    /// let m = ReuseMetrics::new();
    /// m.observe_nats_slow_consumer_drops(5);
    /// m.observe_nats_slow_consumer_drops(3);
    /// assert!(m.encode().contains("kv_reuse_nats_slow_consumer_drops_total 5"));
    /// ```
    pub fn observe_nats_slow_consumer_drops(&self, total: u64) {
        let c = &self.nats_slow_consumer_drops;
        c.inc_by(total.saturating_sub(c.get()));
    }

    /// Copies a router's follower state in: `workers` registered, whether
    /// each follower stream is open (`RouterInventory::followers_up`: the
    /// `directory` watch, the `announcements` subscription), and every
    /// counter of `stats` (each raised to its new value; they only grow).
    /// The router binary calls it once a second, so `/metrics` lags by at
    /// most that.
    ///
    /// ```
    /// use kv_router_glue::metrics::ReuseMetrics;
    /// use kv_router_glue::service::FollowStats;
    /// let m = ReuseMetrics::new();
    /// let stats = FollowStats { events_applied: 7, ..FollowStats::default() };
    /// m.observe_router(3, &[("directory", false), ("announcements", true)], &stats);
    /// let text = m.encode();
    /// assert!(text.contains("kv_reuse_router_workers 3"));
    /// assert!(text.contains("kv_reuse_router_follower_up{stream=\"directory\"} 0"));
    /// assert!(text.contains("kv_reuse_router_follow_total{item=\"events_applied\"} 7"));
    /// ```
    #[cfg(feature = "service")]
    pub fn observe_router(
        &self,
        workers: usize,
        followers_up: &[(&'static str, bool)],
        stats: &crate::service::FollowStats,
    ) {
        self.router_workers
            .set(i64::try_from(workers).unwrap_or(i64::MAX));
        for &(stream, up) in followers_up {
            self.follower_up
                .get_or_create(&label("stream", stream))
                .set(i64::from(up));
        }
        // Every field, by name: a counter added to `FollowStats` shows up
        // here without a second list to keep in step.
        let serde_json::Value::Object(fields) =
            serde_json::to_value(stats).expect("FollowStats is plain counters")
        else {
            unreachable!("FollowStats serializes as a map")
        };
        for (item, v) in fields {
            let c = self.follow.get_or_create(&label("item", item));
            c.inc_by(v.as_u64().unwrap_or(0).saturating_sub(c.get()));
        }
    }

    /// Copies in how many incarnations a router's worker registry
    /// remembers now (`RouterInventory::remembered`, from
    /// [`crate::WorkerRegistry::remembered`]): `replaced` ones and
    /// `silenced` ones, each series of
    /// `kv_reuse_router_incarnations_remembered{kind}` set to its value.
    /// Each kind is capped at [`crate::MAX_REMEMBERED`], which
    /// `kv_reuse_router_incarnations_remembered_limit` shows, so that an
    /// operator sees how near the cap the router is. The router binary
    /// calls it once a second, with [`ReuseMetrics::observe_router`].
    ///
    /// ```
    /// use kv_router_glue::metrics::ReuseMetrics;
    /// let m = ReuseMetrics::new();
    /// m.observe_remembered_incarnations(2, 1);
    /// let text = m.encode();
    /// assert!(text.contains("kv_reuse_router_incarnations_remembered{kind=\"replaced\"} 2"));
    /// assert!(text.contains("kv_reuse_router_incarnations_remembered{kind=\"silenced\"} 1"));
    /// assert!(text.contains("kv_reuse_router_incarnations_remembered_limit 4096"));
    /// ```
    #[cfg(feature = "service")]
    pub fn observe_remembered_incarnations(&self, replaced: usize, silenced: usize) {
        for (kind, n) in [("replaced", replaced), ("silenced", silenced)] {
            self.incarnations_remembered
                .get_or_create(&label("kind", kind))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The exposition text (OpenMetrics, ends with `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

#[cfg(all(test, feature = "worker"))]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use kv_transfer::DeliveryControl;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::qualify::{Scenario, DONOR_BLOCKS, TARGET_BASELINE};
    use crate::spans::{ObservedAdvisor, ObservedExecutor};

    /// What one client connection got from the endpoint.
    #[derive(Debug, PartialEq, Eq)]
    enum Reply {
        /// Closed with no response byte: the server dropped the connection
        /// (over the cap). The client may see EOF, a reset, or a failed
        /// write, depending on when the close reaches it.
        Closed,
        /// The whole response, up to the server's close.
        Served(String),
    }

    /// Sends `request` on a new connection and reads to the server's close.
    /// Panics on any other failure (connect, or a reset after part of a
    /// response): those are defects, not the cap.
    async fn request(addr: SocketAddr, request: &str) -> Reply {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A connection the server already dropped may refuse the write.
        if let Err(e) = s.write_all(request.as_bytes()).await {
            assert!(
                matches!(e.kind(), BrokenPipe | ConnectionReset | ConnectionAborted),
                "write failed: {e}"
            );
            return Reply::Closed;
        }
        let mut out = Vec::new();
        match s.read_to_end(&mut out).await {
            Ok(_) if out.is_empty() => Reply::Closed,
            Ok(_) => Reply::Served(String::from_utf8(out).expect("an HTTP response in UTF-8")),
            Err(e) if out.is_empty() && matches!(e.kind(), ConnectionReset | ConnectionAborted) => {
                Reply::Closed
            }
            Err(e) => panic!("read failed after {} response bytes: {e}", out.len()),
        }
    }

    /// A request that must be served (the endpoint is below its cap).
    async fn http(addr: SocketAddr, req: &str) -> String {
        match request(addr, req).await {
            Reply::Served(text) => text,
            Reply::Closed => panic!("closed without a response: {req:?}"),
        }
    }

    /// Asserts `text` is a complete `200 OK` scrape: exact `Content-Length`,
    /// OpenMetrics body ending in `# EOF`.
    fn assert_scrape(text: &str) {
        let (head, body) = text
            .split_once("\r\n\r\n")
            .unwrap_or_else(|| panic!("no end of head in {text:?}"));
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{head}"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    /// The value of the sample line starting with `series ` (exact series).
    fn sample(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
            .parse()
            .unwrap()
    }

    /// Idle clients that never send a request hold at most MAX_CONNECTIONS
    /// slots: one more is closed at once (EOF or reset, no response byte),
    /// and a scrape is served again (a full 200) once the idle ones go away.
    ///
    /// It was flaky under load: the scrape after the idle clients left was
    /// sent after a fixed 200 ms and unwrapped, so when the server had not
    /// yet seen every idle close it was still at the cap, dropped the
    /// scrape, and the read failed (reset). Now a closed scrape is retried
    /// until the slots come back (a 10 s bound), and any served one must be
    /// a complete 200.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn healthz_follows_the_probe_and_is_absent_without_one() {
        let state = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe: HealthProbe = {
            let state = state.clone();
            Arc::new(move || {
                if state.load(std::sync::atomic::Ordering::SeqCst) {
                    Health::Unavailable("draining")
                } else {
                    Health::Serving
                }
            })
        };
        let m = Arc::new(ReuseMetrics::new());
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let server = MetricsServer::bind_with_health(any, m.clone(), probe)
            .await
            .unwrap();
        let get = "GET /healthz HTTP/1.1\r\n\r\n";
        let ok = http(server.local_addr(), get).await;
        assert!(
            ok.starts_with("HTTP/1.1 200 OK") && ok.ends_with("\r\n\r\nok\n"),
            "{ok}"
        );
        state.store(true, std::sync::atomic::Ordering::SeqCst);
        let draining = http(server.local_addr(), get).await;
        assert!(
            draining.starts_with("HTTP/1.1 503 Service Unavailable")
                && draining.ends_with("\r\n\r\ndraining\n"),
            "{draining}"
        );
        server.shutdown().await;
        let plain = MetricsServer::bind(any, m).await.unwrap();
        let none = http(plain.local_addr(), get).await;
        assert!(none.starts_with("HTTP/1.1 404"), "{none}");
    }

    /// `HEAD` (what some load balancers' health checks send) is answered
    /// as `GET` without the body, and another method on `/healthz` is 405
    /// as on `/metrics`: both used to get "404 Not Found, try /metrics",
    /// which reads as a wrong path.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn head_is_get_without_a_body_and_other_methods_are_405() {
        let probe: HealthProbe = Arc::new(|| Health::Unavailable("draining"));
        let m = Arc::new(ReuseMetrics::new());
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let server = MetricsServer::bind_with_health(any, m, probe)
            .await
            .unwrap();
        let addr = server.local_addr();
        let head = http(addr, "HEAD /healthz HTTP/1.1\r\n\r\n").await;
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable"),
            "{head}"
        );
        // The length of the body GET would send ("draining\n"), and none sent.
        assert!(head.contains("Content-Length: 9\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "{head}");
        let head = http(addr, "HEAD /metrics HTTP/1.1\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "{head}");
        for path in ["/healthz", "/metrics"] {
            let post = http(addr, &format!("POST {path} HTTP/1.1\r\n\r\n")).await;
            assert!(
                post.starts_with("HTTP/1.1 405 Method Not Allowed"),
                "{path}: {post}"
            );
            assert!(post.contains("Allow: GET, HEAD\r\n"), "{path}: {post}");
        }
        server.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_clients_beyond_the_cap_are_closed_and_slots_come_back() {
        let server = MetricsServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(ReuseMetrics::new()),
        )
        .await
        .unwrap();
        let addr = server.local_addr();
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Give the accept loop time to take every idle connection.
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Accepts are in connect order, so this one finds every slot taken
        // (the idle ones hold theirs for REQUEST_TIMEOUT, 5 s).
        let scrape = "GET /metrics HTTP/1.1\r\n\r\n";
        let extra = tokio::time::timeout(Duration::from_secs(10), request(addr, scrape))
            .await
            .expect("a connection over the cap is closed, not left waiting");
        assert_eq!(extra, Reply::Closed, "served over the cap");
        drop(idle);
        // The server frees a slot when it reads an idle client's EOF; until
        // it has, a scrape may still be closed. Served, it must be whole.
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut closed = 0;
        loop {
            match request(addr, scrape).await {
                Reply::Served(text) => {
                    assert_scrape(&text);
                    break;
                }
                Reply::Closed => closed += 1,
            }
            assert!(
                tokio::time::Instant::now() < until,
                "no slot came back within 10 s ({closed} scrapes closed)"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scraped_endpoint_reports_decisions_fetches_fallbacks_bytes_latency_and_banks() {
        let s = Scenario::new().unwrap();
        let metrics = Arc::new(ReuseMetrics::new());
        let settings = crate::qualify::admitting_settings();
        let advisor = ObservedAdvisor::new(s.advisor(settings).unwrap(), metrics.clone());
        let exec = ObservedExecutor::new(s.executor().unwrap(), metrics.clone());
        let ctl = DeliveryControl::new();

        let env = advisor.advise("r1", &s.hashes, s.target).hint.unwrap();
        let done = exec.execute(&env, s.donor.as_ref(), &ctl).unwrap();
        let (done_bytes, done_elapsed_us) = (done.report.counters.bytes, done.report.elapsed_us);
        // The completed rows go back to the pool, so the fallbacks below fail
        // at the stage under test, not at `reserve`.
        drop(done);
        // A refusal (too few blocks) and two fallbacks: a stale hint, and
        // slots that no longer hold the hinted blocks (the donor's pin refuses).
        let short = advisor.advise("r2", &s.hashes[..TARGET_BASELINE + 3], s.target);
        assert!(short.hint.is_none());
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        let mut stale = hint.clone();
        stale.bank_generation += 1;
        let mut swapped = hint.clone();
        for p in &mut swapped.parts {
            p.slot_ids.swap(0, 1);
        }
        for h in [&stale, &swapped] {
            let e = kv_descriptor::HintEnvelope::fetch_gpu("r-bad", "a0", h).unwrap();
            assert!(exec.execute(&e, s.donor.as_ref(), &ctl).is_err());
        }
        metrics.observe_bank(&s.donor);

        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), metrics.clone())
            .await
            .unwrap();
        let resp = http(
            server.local_addr(),
            "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .await;
        let (head, body) = resp.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head.contains(METRICS_CONTENT_TYPE), "{head}");
        assert!(head.contains(&format!("Content-Length: {}", body.len())));

        assert_eq!(
            sample(body, r#"kv_reuse_decisions_total{verdict="admit"}"#),
            1.0
        );
        assert_eq!(
            sample(
                body,
                r#"kv_reuse_decisions_total{verdict="too_few_blocks"}"#
            ),
            1.0
        );
        assert_eq!(
            sample(body, r#"kv_reuse_fetches_total{outcome="completed"}"#),
            1.0
        );
        assert_eq!(
            sample(body, r#"kv_reuse_fetches_total{outcome="fallback"}"#),
            2.0
        );
        assert_eq!(
            sample(
                body,
                r#"kv_reuse_fallbacks_total{stage="hint",cause="stale_generation"}"#
            ),
            1.0
        );
        assert_eq!(
            sample(
                body,
                r#"kv_reuse_fallbacks_total{stage="pin",cause="pin_refused"}"#
            ),
            1.0
        );
        let fetched = (DONOR_BLOCKS - TARGET_BASELINE) as u64;
        let bytes = fetched * 2 * s.layout.rank_block_bytes() as u64;
        assert_eq!(done_bytes, bytes);
        assert_eq!(sample(body, "kv_reuse_fetched_bytes_total"), bytes as f64);
        assert_eq!(
            sample(body, "kv_reuse_host_payload_bytes_total"),
            bytes as f64,
            "host memcpy backend"
        );
        assert_eq!(sample(body, "kv_reuse_transfer_latency_seconds_count"), 1.0);
        assert_eq!(
            sample(body, "kv_reuse_transfer_latency_seconds_sum"),
            done_elapsed_us as f64 / 1e6
        );
        assert_eq!(sample(body, "kv_reuse_lookup_latency_seconds_count"), 2.0);
        assert!(sample(body, "kv_reuse_lookup_latency_seconds_sum") > 0.0);
        let engine = s.donor.owner().engine_id;
        let inv = s.donor.inventory();
        for rank in 0..2 {
            assert_eq!(
                sample(
                    body,
                    &format!(r#"kv_reuse_retained_bytes{{engine="{engine}",rank="{rank}"}}"#)
                ),
                (DONOR_BLOCKS as u64 * inv.slot_bytes) as f64
            );
        }
        assert!(body.ends_with("# EOF\n"));

        let other = http(server.local_addr(), "GET / HTTP/1.1\r\n\r\n").await;
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");
        let post = http(server.local_addr(), "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        server.shutdown().await;
    }
}
