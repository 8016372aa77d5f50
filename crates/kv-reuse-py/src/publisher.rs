//! `WorkerPublisher`: what a Python worker publishes on NATS so that the
//! router service (`kv-reuse-router`, a separate process) knows it.
//!
//! - donor role (decode worker): a kv_router_glue [`DonorAgent`] opened on a
//!   NATS event plane ([`NatsPlane`]) and the JetStream donor directory
//!   ([`NatsDirectory`]): it owns the bank (exposed as a `DonorBank`), serves
//!   pins and inventory snapshots, puts its `DonorRecord` (the bank manifest)
//!   in the directory, publishes its KV events and its `WorkerAnnouncement`.
//!   A background task calls `DonorAgent::tick` every `announce_period_s`,
//!   or every third of the record TTL when that is shorter (events, record
//!   renewal before its TTL lapses, announcement); `close`
//!   deletes the record and publishes the bank's `Cleared`.
//! - target role (prefill worker): its `WorkerAnnouncement` (role prefill)
//!   every `announce_period_s`, so that the service accepts advise requests
//!   routed to that engine (otherwise: `unknown target engine`), and the KV
//!   events of its own prefix cache (`publish_prefix_stored` /
//!   `publish_prefix_removed`, tier `device`, on the announced event
//!   subject), so that the cost model counts what it already holds.
//!
//! Everything NATS goes through kv-router-glue (no second implementation of
//! the wire forms). The extension owns one small tokio runtime per publisher;
//! every blocking call releases the GIL.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kv_bank::{sealed_blocks, BankConfig, LeaseConfig};
use kv_descriptor::{
    EngineId, GpuIdentity, KvEventData, OwnerLease, Role, SequenceHash, StorageTier, Wire,
};
use kv_router_glue::{
    announce_subject, redact_url, AgentError, DirectoryPlane, DonorAgent, DonorAgentConfig,
    EventPlane, KvEventPublisher, NatsDirectory, NatsInventory, NatsPlane, PinServiceConfig,
    PlaneError, PublisherHeader, Subject, WorkerAnnouncement,
};

use crate::donor::DonorBank;
use crate::errors::{bad_argument, bank, uints, PinServiceFailed, PublishFailed};
use crate::layout::Layout;
use crate::nats_auth::NatsCredentials;
use crate::nats_runtime::{
    check_bucket, check_nats_url, not_below_nats_floor, runtime, seconds_in, within,
    NATS_MAX_AGE_FLOOR_S,
};
use crate::process_bound::ProcessBound;
use crate::reprs::Repr;

/// An agent refusal as the Python exception of its cause.
fn agent_error(e: AgentError) -> PyErr {
    match e {
        AgentError::InvalidConfig { field, reason } => bad_argument(field, reason),
        AgentError::Announcement(a) => bad_argument("announcement", a),
        AgentError::Bank(b) => bank(b),
        AgentError::PinService(p) => PinServiceFailed::new_err(p.to_string()),
        other => PublishFailed::new_err(other.to_string()),
    }
}

/// `gpu_uuids[i]`, `s`, as a UUID: `GPU-` (optional) and the UUID. A
/// refusal names `gpu_uuids[i]` and the whole value, and a bad character's
/// index in it: the uuid crate counts from after the prefix it never saw
/// (`GPU-x` said `found 'x' at 0`).
fn gpu_uuid(i: usize, s: &str) -> PyResult<uuid::Uuid> {
    let body = s.strip_prefix("GPU-").unwrap_or(s);
    uuid::Uuid::parse_str(body).map_err(|e| {
        let skipped = s.len() - body.len();
        let why = match body
            .char_indices()
            .find(|(_, c)| !(c.is_ascii_hexdigit() || *c == '-'))
        {
            Some((at, c)) => format!("{c:?} at index {} is not a hex digit or `-`", skipped + at),
            None => e.to_string(),
        };
        bad_argument(
            &format!("gpu_uuids[{i}]"),
            format!(
                "{s:?} is not a GPU UUID (`GPU-` and 32 hex digits, as \
                 torch.cuda.get_device_properties(i).uuid or nvidia-smi -L give): {why}"
            ),
        )
    })
}

/// One identity per TP rank: parsed from `gpu_uuids` (torch's
/// `get_device_properties(i).uuid`, with or without the `GPU-` prefix), or
/// made up from `host_id` and the rank where none are given (the router
/// only checks their count; the CPU path has no GPU).
fn gpu_identities(
    tp: u32,
    host_id: &str,
    gpu_uuids: Option<Vec<String>>,
    ordinals: Option<&[u32]>,
) -> PyResult<Vec<GpuIdentity>> {
    let uuids: Vec<uuid::Uuid> = match gpu_uuids {
        Some(list) => {
            if list.len() != tp as usize {
                return Err(bad_argument(
                    "gpu_uuids",
                    format!("{} uuids, expected one per TP rank ({tp})", list.len()),
                ));
            }
            list.iter()
                .enumerate()
                .map(|(i, s)| gpu_uuid(i, s))
                .collect::<PyResult<_>>()?
        }
        None => {
            // FNV-1a of the host id: stable per host, never nil (rank + 1).
            let h = host_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
            (0..tp)
                .map(|r| uuid::Uuid::from_u64_pair(h, u64::from(r) + 1))
                .collect()
        }
    };
    uuids
        .into_iter()
        .enumerate()
        .map(|(r, u)| {
            let ordinal = ordinals.map_or(r as u32, |o| o[r]);
            GpuIdentity::new(u, ordinal, host_id)
                .map_err(|e| bad_argument("gpu_uuids", format!("rank {r}: {e}")))
        })
        .collect()
}

/// A `worker_key` the event subject cannot hold, named as the Python
/// argument: kv-router-glue names the subject's token (`component`), which
/// a Python caller never passed.
fn worker_key_refusal(e: PlaneError) -> PyErr {
    match e {
        PlaneError::InvalidSubject { value, .. } => bad_argument(
            "worker_key",
            format!(
                "{value:?} is not one NATS subject token (empty, or it holds '.', '*', '>' or \
                 whitespace)"
            ),
        ),
        other => bad_argument("worker_key", other),
    }
}

/// A worker's presence on NATS for the router service (see docs/python.md,
/// "Publishing a worker on NATS"). Calls from several Python threads run
/// concurrently.
// `running`'s lock is only ever held for a clone or a take, never across a
// blocking call or a GIL release: a thread that held it through
// `allow_threads` while another waited for it holding the GIL deadlocked
// both (a review finding of session 22).
#[pyclass(frozen, module = "kv_reuse")]
pub(crate) struct WorkerPublisher {
    running: Mutex<Option<Arc<Running>>>,
    /// The process that connected: in a forked child every call that
    /// reaches `running` is refused, and close and drop forget it
    /// (crate::process_bound).
    home: ProcessBound,
    role: Role,
    engine_id: EngineId,
    /// The worker's key (its event subject's token), for the repr.
    worker_key: String,
    /// `nats_url` with any password or token as `***` (`redact_url`): the
    /// only form kept, since it is only ever printed (error messages, the
    /// repr), and a secret in the URL must not reach them.
    shown_url: String,
    timeout: Duration,
    /// The donor's bank view (None for a target), released by `close()`:
    /// it holds the bank manager, and with it the bank's lease files
    /// (`lease_holders`, one per TP rank) until its last reference goes.
    /// No `__traverse__` shows it to the garbage collector: a `DonorBank`
    /// holds no Python object, so no reference cycle passes through it.
    bank: Mutex<Option<Py<DonorBank>>>,
}

#[pymethods]
impl WorkerPublisher {
    /// Opens a decode worker's donor agent: a bank of `slots` KV blocks per
    /// TP rank (host shm, or with `gpus` one CUDA ordinal per TP rank in
    /// device memory exported over CUDA IPC, as `DonorBank`), pins served on
    /// `pin_endpoint` (`unix:/path`), its record (bank manifest + pin
    /// endpoint) put in the JetStream KV bucket `bucket`, its KV events on
    /// `kv.<namespace>.<worker_key>.kv_events`, its announcement on
    /// `kv.<namespace>.workers.announce` every `announce_period_s` seconds
    /// (every third of `record_ttl_s` when that is shorter, so that the
    /// record never lapses between renewals), and inventory snapshots
    /// answered for a router that starts later.
    ///
    /// `lease_s` is the bank's owner lease (renewed every fifth of it; 0.1
    /// to 86,400 s); `record_ttl_s` (default `lease_s`, 0.1 s to `lease_s`)
    /// bounds one put of the record (it is re-put after a third of it) and is
    /// the directory bucket's `max_age` when this creates it: neither may be
    /// below nats-server's 100 ms `max_age` floor. `timeout_s` bounds connecting and each
    /// publish call. Releases the GIL while it connects and publishes.
    /// The NATS keywords (`**nats`): `user` + `password`, `token` or
    /// `creds` (a `.creds` file) authenticate its one NATS connection,
    /// `tls_ca` (PEM CA file) turns TLS on, `tls_cert` + `tls_key` present a
    /// client certificate: the decode role of docs/nats-permissions.conf.
    /// `gpu_uuids` (one per TP rank, `GPU-<uuid>` as `nvidia-smi -L` or
    /// torch's `get_device_properties(i).uuid` give, the prefix optional)
    /// are the announcement's GPU identities; without them each rank's is
    /// made up from `host_id` and the rank.
    ///
    /// Raises `BadArgument` naming `pin_endpoint` (it does not parse, or its
    /// socket path is relative: targets resolve it in other working
    /// directories), `slots`, `lease_s`, `record_ttl_s`,
    /// `store_timeout_s`, `announce_period_s`, `timeout_s`, `gpus`,
    /// `gpu_uuids` (count) or `gpu_uuids[i]` (not a UUID, naming the value
    /// and where it is wrong), `worker_key`, `namespace`, `nats_url` (not a NATS URL),
    /// `bucket` (not a key-value bucket name), `event_ring` (the ints
    /// also when negative or past u64 / u32), `user`, `password`, `token`
    /// or `creds` (incomplete or mixed credentials); `BankFailed` when the bank
    /// cannot open; `PinServiceFailed` when `pin_endpoint` cannot be bound;
    /// `PublishFailed` when NATS (or JetStream) is unreachable or refuses.
    #[staticmethod]
    #[pyo3(signature = (nats_url, worker_key, layout, slots, pin_endpoint, *, host_id = "kv-reuse-py", gpus = None, gpu_uuids = None, namespace = "default", bucket = "kv_donors", lease_s = 15.0, record_ttl_s = None, store_timeout_s = 5.0, announce_period_s = 1.0, event_ring = 4096, timeout_s = 5.0, **nats))]
    #[allow(clippy::too_many_arguments)]
    fn donor(
        py: Python<'_>,
        nats_url: &str,
        worker_key: &str,
        layout: Layout,
        slots: &Bound<'_, PyAny>,
        pin_endpoint: &str,
        host_id: &str,
        gpus: Option<&Bound<'_, PyAny>>,
        gpu_uuids: Option<Vec<String>>,
        namespace: &str,
        bucket: &str,
        #[pyo3(from_py_with = "crate::errors::seconds")] lease_s: f64,
        #[pyo3(from_py_with = "crate::errors::seconds_or_none")] record_ttl_s: Option<f64>,
        #[pyo3(from_py_with = "crate::errors::seconds")] store_timeout_s: f64,
        #[pyo3(from_py_with = "crate::errors::seconds")] announce_period_s: f64,
        #[pyo3(from_py_with = "event_ring_arg")] event_ring: usize,
        #[pyo3(from_py_with = "crate::errors::seconds")] timeout_s: f64,
        nats: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        check_nats_url(nats_url)?;
        check_bucket(bucket)?;
        let slots = crate::donor::slot_count(slots)?;
        crate::donor::check_host_id(host_id)?;
        // Published in the donor's record for targets in other processes:
        // refused here, before connecting, not at the first fetch.
        crate::donor::served_pin_endpoint("pin_endpoint", pin_endpoint)?;
        let gpus: Option<Vec<u32>> = gpus.map(|g| uints("gpus", g)).transpose()?;
        // The record's TTL is the directory bucket's `max_age` when this
        // creates it, and `record_ttl_s` defaults to (and may not exceed)
        // `lease_s`: neither may go below nats-server's floor, which would
        // otherwise refuse the bucket as an unexplained `PublishFailed`.
        not_below_nats_floor("lease_s", lease_s)?;
        let lease = seconds_in("lease_s", lease_s, NATS_MAX_AGE_FLOOR_S..=86_400.0)?;
        let record_ttl = match record_ttl_s {
            Some(s) => {
                not_below_nats_floor("record_ttl_s", s)?;
                seconds_in("record_ttl_s", s, NATS_MAX_AGE_FLOOR_S..=lease_s)?
            }
            None => lease,
        };
        let store_timeout = seconds_in("store_timeout_s", store_timeout_s, 0.001..=3_600.0)?;
        let period = seconds_in("announce_period_s", announce_period_s, 0.01..=60.0)?;
        let timeout = seconds_in("timeout_s", timeout_s, 0.01..=3_600.0)?;
        let options =
            NatsCredentials::from_kwargs(nats)?.options(nats_url, "kv-reuse-py-donor", timeout)?;
        let tp = layout.inner.tp_size();
        if let Some(g) = &gpus {
            if g.len() != tp as usize {
                return Err(bad_argument(
                    "gpus",
                    format!("{} ordinals, expected one per TP rank ({tp})", g.len()),
                ));
            }
        }
        let identities = gpu_identities(tp, host_id, gpu_uuids, gpus.as_deref())?;
        // The namespace first: the event subject holds both, and a bad
        // namespace must not be reported as a bad `worker_key`.
        announce_subject(namespace).map_err(|e| bad_argument("namespace", e))?;
        let event_subject =
            Subject::new(namespace, worker_key, "kv_events").map_err(worker_key_refusal)?;
        let bytes = slots
            .checked_mul(u64::from(tp) * layout.inner.rank_block_bytes() as u64)
            .ok_or_else(|| bad_argument("slots", format!("{slots} slots overflow u64 bytes")))?;
        let mut bank_cfg = BankConfig::new(layout.inner, OwnerLease::fresh(Role::Decode), bytes);
        bank_cfg.lease = LeaseConfig::background(lease, lease / 5);
        bank_cfg.store_timeout = store_timeout;
        let config = DonorAgentConfig {
            worker_key: worker_key.to_owned(),
            bank: bank_cfg,
            host_id: host_id.to_owned(),
            cuda_ordinals: gpus,
            gpus: identities,
            pin_endpoint: pin_endpoint.to_owned(),
            pin_auth_key: None,
            pin_config: PinServiceConfig::default(),
            namespace: namespace.to_owned(),
            event_subject,
            event_ring,
            record_ttl,
        };
        let url = nats_url.to_owned();
        let bucket = bucket.to_owned();
        let (rt, agent) = py.allow_threads(|| {
            let rt = runtime("publisher")?;
            let agent = rt.block_on(async {
                // One connection, under the role's credentials, for the KV
                // events, the directory record and the inventory answers
                // (a server enforcing permissions refuses an anonymous one).
                let nats = within(&url, timeout, NatsPlane::connect(&url, options)).await?;
                let dir: Arc<dyn DirectoryPlane> = Arc::new(
                    within(
                        &url,
                        timeout,
                        // The plane's, so that a creation refused for want of
                        // a permission names it instead of timing out.
                        NatsDirectory::from_plane(&nats, &url, &bucket, record_ttl),
                    )
                    .await?,
                );
                let inventory = Arc::new(NatsInventory::from_client(nats.client().clone()));
                let plane: Arc<dyn EventPlane> = Arc::new(nats);
                let agent = DonorAgent::open(config, dir, plane)
                    .await
                    .map_err(agent_error)?;
                if let Err(e) = agent.serve_inventory(inventory).await {
                    let _ = agent.close(Duration::ZERO).await;
                    return Err(agent_error(e));
                }
                Ok::<_, PyErr>(Arc::new(agent))
            })?;
            Ok::<_, PyErr>((rt, agent))
        })?;
        let ticking = agent.clone();
        // The record is re-put only by a tick, once a third of its TTL has
        // passed: ticking every `announce_period_s` alone let a record TTL
        // shorter than the period (`lease_s=0.3`, the default 1 s period)
        // lapse between ticks, the donor missing from the directory most of
        // the time. A third of the TTL at most keeps the "3 periods of slack".
        let tick_period = period.min(record_ttl / 3);
        let ticker = rt.spawn(async move {
            let mut every = tokio::time::interval(tick_period);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                // A failed tick is retried next period; the agent's own
                // record TTL (3 periods of slack) covers a short outage.
                let _ = ticking.tick().await;
            }
        });
        let bank = Py::new(py, DonorBank::from_manager(agent.bank().clone(), layout))?;
        Ok(Self {
            engine_id: agent.bank().owner().engine_id,
            running: Mutex::new(Some(Arc::new(Running {
                runtime: rt,
                ticker,
                agent: Some(agent),
                prefix: None,
            }))),
            home: ProcessBound::here("WorkerPublisher"),
            role: Role::Decode,
            worker_key: worker_key.to_owned(),
            shown_url: redact_url(nats_url),
            timeout,
            bank: Mutex::new(Some(bank)),
        })
    }

    /// Announces a prefill worker (role prefill) whose target engine id is
    /// `engine_id` (`Target.engine_id`) with KV `layout`, on
    /// `kv.<namespace>.workers.announce` every `announce_period_s` seconds,
    /// so that the router service accepts advise requests routed to it.
    /// `gpus` are the CUDA ordinals of its TP ranks and `gpu_uuids` their
    /// UUIDs, as for `donor` (announced only). Credentials and TLS as for
    /// `donor` (the prefill role).
    ///
    /// Raises `BadArgument` naming `engine_id`, `worker_key`, `namespace`,
    /// `nats_url`, `gpus`, `gpu_uuids`, `announce_period_s`, `timeout_s` or a
    /// credentials argument;
    /// `PublishFailed` when NATS is unreachable or the first announcement
    /// is not sent.
    #[staticmethod]
    #[pyo3(signature = (nats_url, worker_key, layout, engine_id, *, host_id = "kv-reuse-py", gpus = None, gpu_uuids = None, namespace = "default", announce_period_s = 1.0, timeout_s = 5.0, **nats))]
    #[allow(clippy::too_many_arguments)]
    fn target(
        py: Python<'_>,
        nats_url: &str,
        worker_key: &str,
        layout: Layout,
        engine_id: &str,
        host_id: &str,
        gpus: Option<&Bound<'_, PyAny>>,
        gpu_uuids: Option<Vec<String>>,
        namespace: &str,
        #[pyo3(from_py_with = "crate::errors::seconds")] announce_period_s: f64,
        #[pyo3(from_py_with = "crate::errors::seconds")] timeout_s: f64,
        nats: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        check_nats_url(nats_url)?;
        crate::donor::check_host_id(host_id)?;
        let gpus: Option<Vec<u32>> = gpus.map(|g| uints("gpus", g)).transpose()?;
        let engine = crate::layout::engine_id(engine_id, "engine_id")?;
        let period = seconds_in("announce_period_s", announce_period_s, 0.01..=60.0)?;
        let timeout = seconds_in("timeout_s", timeout_s, 0.01..=3_600.0)?;
        let options =
            NatsCredentials::from_kwargs(nats)?.options(nats_url, "kv-reuse-py-target", timeout)?;
        let tp = layout.inner.tp_size();
        if let Some(g) = &gpus {
            if g.len() != tp as usize {
                return Err(bad_argument(
                    "gpus",
                    format!("{} ordinals, expected one per TP rank ({tp})", g.len()),
                ));
            }
        }
        let subject = announce_subject(namespace).map_err(|e| bad_argument("namespace", e))?;
        // A prefill worker serves no pins and this one publishes no KV
        // events; the announcement still names a well-formed subject (its
        // own, where an engine's prefix-cache events would go).
        let event_subject =
            Subject::new(namespace, worker_key, "kv_events").map_err(worker_key_refusal)?;
        let announcement = WorkerAnnouncement {
            worker_key: worker_key.to_owned(),
            engine_id: engine,
            role: Role::Prefill,
            layout_fingerprint: layout.inner.fingerprint(),
            tp_size: tp,
            gpus: gpu_identities(tp, host_id, gpu_uuids, gpus.as_deref())?,
            pin_endpoint: "none".to_owned(),
            event_subject: event_subject.as_str().to_owned(),
        };
        announcement
            .validate()
            .map_err(|e| bad_argument("worker_key", e))?;
        let bytes = announcement
            .to_wire()
            .map_err(|e| PublishFailed::new_err(format!("announcement: {e}")))?;
        let url = nats_url.to_owned();
        let (rt, ticker, plane) = py.allow_threads(|| {
            let rt = runtime("publisher")?;
            let plane = rt.block_on(async {
                let plane =
                    Arc::new(within(&url, timeout, NatsPlane::connect(&url, options)).await?);
                // The first announcement is sent (and flushed) before the
                // constructor returns: an advise right after it finds the
                // target once the router processed it.
                within(&url, timeout, async {
                    plane.publish(&subject, bytes.clone()).await?;
                    plane.flush().await
                })
                .await?;
                Ok::<_, PyErr>(plane)
            })?;
            let announcer = plane.clone();
            let ticker = rt.spawn(async move {
                let mut every = tokio::time::interval(period);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                every.tick().await;
                loop {
                    every.tick().await;
                    let _ = announcer.publish(&subject, bytes.clone()).await;
                }
            });
            Ok::<_, PyErr>((rt, ticker, plane))
        })?;
        let prefix = KvEventPublisher::new(
            plane,
            event_subject,
            PublisherHeader {
                publisher: engine,
                role: Role::Prefill,
                layout_fingerprint: layout.inner.fingerprint(),
                tp_size: tp,
            },
            EVENT_RING,
        );
        Ok(Self {
            running: Mutex::new(Some(Arc::new(Running {
                runtime: rt,
                ticker,
                agent: None,
                prefix: Some((Arc::new(prefix), layout.inner.tokens_per_block())),
            }))),
            home: ProcessBound::here("WorkerPublisher"),
            role: Role::Prefill,
            engine_id: engine,
            worker_key: worker_key.to_owned(),
            shown_url: redact_url(nats_url),
            timeout,
            bank: Mutex::new(None),
        })
    }

    /// `"decode"` (a donor) or `"prefill"` (a target).
    #[getter]
    fn role(&self) -> &'static str {
        match self.role {
            Role::Decode => "decode",
            Role::Prefill => "prefill",
        }
    }

    /// The engine id published (UUID string): the donor bank's, or the
    /// target's.
    #[getter]
    fn engine_id(&self) -> String {
        self.engine_id.to_string()
    }

    /// The donor's bank (store blocks through it), None for a target and
    /// after `close()`. Do not call its `drain_events`: the publisher
    /// publishes those events. A reference kept past `close()` (this
    /// `DonorBank`, or one of its `PendingStore`s) keeps the closed bank's
    /// lease files mapped until it is dropped.
    #[getter]
    fn bank(&self, py: Python<'_>) -> Option<Py<DonorBank>> {
        self.bank
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|b| b.clone_ref(py))
    }

    /// The pin endpoint published in the donor's record, None for a target.
    #[getter]
    fn pin_endpoint(&self) -> Option<String> {
        self.with_agent(|a| a.pin_endpoint().to_owned())
    }

    /// True until `close()`; false in a forked child, where every call that
    /// publishes is refused.
    #[getter]
    fn open(&self) -> bool {
        self.home.is_home()
            && self
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
    }

    /// Publishes the donor bank's queued KV events now (a completed store's
    /// `Stored`, evictions) instead of at the next period; returns how many.
    /// 0 for a target. Releases the GIL.
    ///
    /// Raises `PublishFailed` when a publish failed (the event ids are
    /// consumed: the router sees a gap and resyncs) or after `close()`.
    fn publish_events(&self, py: Python<'_>) -> PyResult<usize> {
        self.on_agent(py, "publish_events", |agent| async move {
            agent.publish_events().await.map_err(agent_error)
        })
        .map(|n| n.unwrap_or(0))
    }

    /// One period's work now: events, the record's renewal when a third of
    /// its TTL passed, the announcement. Releases the GIL.
    ///
    /// Raises `PublishFailed` (the first failing step) or after `close()`.
    fn tick(&self, py: Python<'_>) -> PyResult<()> {
        self.on_agent(py, "tick", |agent| async move {
            agent.tick().await.map_err(agent_error)
        })
        .map(|_| ())
    }

    /// A prefill target's own prefix cache now holds the sealed blocks of
    /// `tokens` (token ids); blocks `first_block ..` of them are new.
    /// Publishes one `Stored` KV event (tier `device`, role prefill, on the
    /// announced event subject) naming those blocks, the first a child of
    /// block `first_block - 1` (hashes as `sequence_hashes(tokens, T)`; a
    /// partial tail block is not named), so that the router service's cost
    /// model counts them as held by this target: a fetch advised for it then
    /// starts past them (`fetch_from`). Returns the blocks named; 0 (no
    /// event) when there is none past `first_block`. Releases the GIL.
    ///
    /// Raises `BadArgument` naming `first_block` when it is past the
    /// sealed blocks or negative, `tokens[i]` for an id that is negative or
    /// past u32; `PublishFailed` for a donor (its events come from its
    /// bank), when the publish fails, or after `close()`.
    #[pyo3(signature = (tokens, first_block = 0))]
    fn publish_prefix_stored(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = "first_block_arg")] first_block: usize,
    ) -> PyResult<usize> {
        let (_, tpb) = self.prefix_publisher("publish_prefix_stored")?;
        let tokens: Vec<u32> = uints("tokens", tokens)?;
        // The bank's own sealing (hashes as `sequence_hashes(tokens, T)`).
        let mut blocks = sealed_blocks(None, &tokens, tpb as usize);
        if first_block > blocks.len() {
            return Err(bad_argument(
                "first_block",
                format!(
                    "{first_block} is past the {} sealed blocks of tokens",
                    blocks.len()
                ),
            ));
        }
        if first_block == blocks.len() {
            return Ok(0);
        }
        let parent = first_block.checked_sub(1).map(|i| blocks[i].sequence_hash);
        blocks.drain(..first_block);
        let n = blocks.len();
        self.publish_prefix(py, KvEventData::Stored { parent, blocks })?;
        Ok(n)
    }

    /// A prefill target's own prefix cache dropped the blocks
    /// `sequence_hashes`: one `Removed` KV event (tier `device`). Returns
    /// how many were named; 0 (no event) for none. Releases the GIL.
    ///
    /// Raises `BadArgument` naming `sequence_hashes[i]` for a hash that is
    /// negative or past u64; `PublishFailed` for a donor, when the publish
    /// fails, or after `close()`.
    fn publish_prefix_removed(
        &self,
        py: Python<'_>,
        sequence_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        self.prefix_publisher("publish_prefix_removed")?;
        let sequence_hashes: Vec<u64> = uints("sequence_hashes", sequence_hashes)?;
        if sequence_hashes.is_empty() {
            return Ok(0);
        }
        let n = sequence_hashes.len();
        let sequence_hashes = sequence_hashes.into_iter().map(SequenceHash).collect();
        self.publish_prefix(py, KvEventData::Removed { sequence_hashes })?;
        Ok(n)
    }

    /// Publishes the NIXL agent that registered the donor bank's memory
    /// (`name`, and its `metadata` blob) in the directory record, for a
    /// target on another host. Releases the GIL.
    ///
    /// Raises `BadArgument` naming `name` / `metadata` (empty, too large),
    /// `PublishFailed` when the put fails or for a target.
    fn publish_nixl_agent(
        &self,
        py: Python<'_>,
        name: String,
        metadata: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let metadata: Vec<u8> = uints("metadata", metadata)?;
        if self.role != Role::Decode {
            return Err(PublishFailed::new_err(
                "publish_nixl_agent: a target publishes no NIXL agent",
            ));
        }
        self.on_agent(py, "publish_nixl_agent", |agent| async move {
            agent
                .publish_nixl_agent(name, metadata)
                .await
                .map_err(|e| match e {
                    AgentError::Record(r) => bad_argument("name", r),
                    other => agent_error(other),
                })
        })
        .map(|_| ())
    }

    /// Stops publishing. A donor deletes its directory record, stops its pin
    /// service (waiting up to `drain_s` seconds for held pins), closes the
    /// bank, publishes its `Cleared` event and lets go of its bank: its
    /// lease files are unmapped now (`leak_counters()["lease_holders"]`
    /// drops by the TP size), unless the caller still holds the `bank` or
    /// one of its stores. Idempotent. Releases the GIL.
    ///
    /// Raises `BankFailed` when pins outlived `drain_s`, `PublishFailed`
    /// when the record could not be deleted (it then lapses with its TTL).
    ///
    /// In a forked child it only lets go of what the child inherited: the
    /// record, pins, bank and connection stay the parent's.
    #[pyo3(signature = (drain_s = 1.0))]
    fn close(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = "crate::errors::seconds")] drain_s: f64,
    ) -> PyResult<()> {
        let drain = seconds_in("drain_s", drain_s, 0.0..=3_600.0)?;
        let running = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(shared) = running.and_then(|r| self.home.keep_here(r)) else {
            return Ok(());
        };
        let timeout = self.timeout + drain;
        let url = self.shown_url.clone();
        // Taken now and dropped (with the GIL) when this call returns, after
        // the agent closed the bank, whatever the outcome: a closed
        // publisher has no use for it, and this reference alone kept the
        // closed bank's lease files mapped until the publisher was dropped.
        let _bank = self.bank.lock().unwrap_or_else(|e| e.into_inner()).take();
        let in_flight = self.timeout;
        py.allow_threads(move || {
            // Calls that started before the take hold their own reference
            // for at most the publisher's timeout each.
            let r = wait_for_sole(shared, in_flight + Duration::from_secs(1)).ok_or_else(|| {
                PublishFailed::new_err("close: a call on another thread is still running")
            })?;
            r.ticker.abort();
            let closed = r.runtime.block_on(async {
                // The aborted ticker's clone of the agent is dropped once
                // the task observed the abort.
                let _ = (&mut { r.ticker }).await;
                let Some(agent) = r.agent else {
                    return Ok(());
                };
                let agent = Arc::try_unwrap(agent).map_err(|_| {
                    PublishFailed::new_err("close: the donor agent is still in use")
                })?;
                match tokio::time::timeout(timeout, agent.close(drain)).await {
                    Ok(Ok(_report)) => Ok(()),
                    Ok(Err(e)) => Err(agent_error(e)),
                    Err(_) => Err(PublishFailed::new_err(format!(
                        "nats_url {url}: close took over {timeout:?}"
                    ))),
                }
            });
            r.runtime.shutdown_timeout(Duration::from_secs(1));
            closed
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py, 1.0)?;
        Ok(false)
    }

    /// `<kv_reuse.WorkerPublisher role='decode' worker_key='decode-0'
    /// engine_id='...' nats_url='nats://user:***@host:4222' open=True>`: no
    /// password or token (the URL is redacted, the credential keywords are
    /// not kept).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(Repr::object(py, "WorkerPublisher")
            .field("role", self.role())?
            .field("worker_key", self.worker_key.as_str())?
            .field("engine_id", self.engine_id())?
            .field("nats_url", self.shown_url.as_str())?
            .field("open", self.open())?
            .finish())
    }
}

/// Events a publisher keeps for a router's resync: a donor's default
/// `event_ring`, and a target's prefix-cache publisher.
const EVENT_RING: usize = 4096;
// The literal of `WorkerPublisher.donor`'s signature (`inspect.signature`
// shows it).
const _: () = assert!(EVENT_RING == 4096);

/// `event_ring` as given: an int in 1..=usize::MAX, or None for the default.
fn event_ring_arg(v: &Bound<'_, PyAny>) -> PyResult<usize> {
    crate::errors::uint_in_or("event_ring", v, 1..=usize::MAX as u64, EVENT_RING)
}

/// `first_block` as given: an int, or None for 0.
fn first_block_arg(v: &Bound<'_, PyAny>) -> PyResult<usize> {
    // Its whole type's range: the refusal is `uint`'s, word for word.
    crate::errors::uint_in_or("first_block", v, 0..=usize::MAX as u64, 0)
}

mod running;
use running::{wait_for_sole, Running};
