//! The cluster's router process (`kvq child cluster-router --nats URL
//! [--gpu]`): an inventory index, a [`RemoteDonorDirectory`] and a
//! [`WorkerRegistry`] built only from what NATS carries (announcements, the
//! JetStream directory, KV events), and advise served on
//! [`ADVISE_SUBJECT`] (queue group [`ADVISE_QUEUE_GROUP`]) by the product's
//! [`RouterService`]. Prints one line
//! `{"event":"ready","subject":"kv_reuse.advise","pid":N}` once serving.
//!
//! The harness runs the product binary `kv-reuse-router` when it finds it
//! ([`super::RouterProcess::find`]); this role is the stand-in where that binary
//! was not built (e.g. `cargo test` of kv-testkit alone). Its wiring is
//! the one `docs/agents.md` describes for a router. A restarted router learns
//! workers again from their announcements and donors from the directory
//! (replayed from JetStream), but not the blocks published before it
//! started: those conversations recompute until their donors store again.
//! A gap the stream cannot repair ([`KvStreamItem::Lost`]) resets that
//! donor's inventory to empty (a stale block is never advertised).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kv_descriptor::Role as KvRole;
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::service::{RouterService, ADVISE_QUEUE_GROUP, ADVISE_SUBJECT};
use kv_router_glue::{
    announce_subject, unix_now_ms, Advisor, CostModel, DecisionLog, DirectoryChange,
    DirectoryPlane, EventPlane, KvEventReceiver, KvStreamItem, LiveCostModel, NatsDirectory,
    NatsOptions, NatsPlane, Registration, RemoteDonorDirectory, WorkerAnnouncement, WorkerRegistry,
};

use super::worker::events_subject;
use super::{
    layout, required, settings, watch_lifeline, ClusterError, ANNOUNCE_PERIOD, DIRECTORY_BUCKET,
    NAMESPACE, RECORD_TTL,
};

/// Runs the router process until its lifeline closes or it is killed.
///
/// # Errors
/// [`ClusterError::Argument`] (`--nats`, `KV_REUSE_*`),
/// [`ClusterError::Process`] when NATS or the subscriptions fail at start.
pub fn main(args: &[String]) -> Result<(), ClusterError> {
    let url = required(args, "--nats")?.to_string();
    let gpu = args.iter().any(|a| a == "--gpu");
    watch_lifeline();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fail("runtime", e))?;
    rt.block_on(serve(&url, gpu))
}

fn fail(what: &str, e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Process {
        process: "router".into(),
        reason: format!("{what}: {e}"),
    }
}

struct Router {
    index: Arc<InventoryIndex>,
    remote: Arc<RemoteDonorDirectory>,
    service: Arc<RouterService>,
    registry: Mutex<WorkerRegistry>,
}

impl Router {
    fn announce(&self, a: WorkerAnnouncement) {
        let Ok(mut reg) = self.registry.lock() else {
            return;
        };
        let registration = reg.announce(a.clone(), unix_now_ms());
        self.forget(reg.take_forgotten());
        match registration {
            Registration::Retired
            | Registration::OtherKey { .. }
            | Registration::IdentityChanged { .. } => return,
            Registration::Replaced { dropped } => {
                self.index.remove_worker(dropped);
                self.remote.forget(dropped);
                self.service.remove_target(dropped);
            }
            Registration::New | Registration::Refreshed | Registration::Readmitted => {}
        }
        drop(reg);
        let key = WorkerKey(stable_key(a.worker_key.as_bytes()));
        let info = WorkerInfo {
            engine: a.engine_id,
            role: a.role,
            layout_fingerprint: a.layout_fingerprint,
            tp_size: a.tp_size,
        };
        // A worker dropped for silence comes back excluded as a donor until
        // a resync (its events while away were missed).
        let _ = if registration == Registration::Readmitted {
            self.index.readmit_worker(key, info)
        } else {
            self.index.register_worker(key, info)
        };
        if a.role == KvRole::Prefill {
            self.service.add_target(a.engine_id);
        }
    }

    fn retired(&self, engine: kv_descriptor::EngineId) -> bool {
        self.registry
            .lock()
            .map(|r| r.is_retired(engine))
            .unwrap_or(true)
    }

    /// Drops the workers silent too long; `connected`: whether the router's
    /// own NATS connection is up (while it is down nobody's silence counts,
    /// and once back every worker's is counted from then).
    fn silent(&self, connected: bool) {
        let (dead, forgotten) = match self.registry.lock() {
            Ok(mut r) if !connected => {
                r.pause();
                return;
            }
            Ok(mut r) => {
                if r.is_paused() {
                    r.resume(unix_now_ms());
                }
                (r.tick(unix_now_ms()), r.take_forgotten())
            }
            Err(_) => return,
        };
        for (_, engine) in dead {
            self.index.remove_worker(engine);
            self.remote.forget(engine);
            self.service.remove_target(engine);
        }
        // After the removals: what the registry forgot, the index removed.
        self.forget(forgotten);
    }

    /// Forgets in the index the incarnations the registry forgot (each
    /// removed from it when dropped), so the index's memory of removed
    /// engines stays bounded as the registry's does.
    fn forget(&self, forgotten: Vec<kv_descriptor::EngineId>) {
        for engine in forgotten {
            self.index.forget_retired(engine);
        }
    }
}

/// FNV-1a: a stable worker key from the worker's name (any stable hash
/// does; the index only needs one key per worker across incarnations).
fn stable_key(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

async fn serve(url: &str, gpu: bool) -> Result<(), ClusterError> {
    // Every connection of this process is made from these options, through
    // kv-router-glue's one NATS connect path: credentials in the URL, TLS or
    // any setting added here apply to each alike; only the name differs.
    let nats = NatsOptions {
        name: "cluster-router".into(),
        ..NatsOptions::default()
    };
    let named = |suffix: &str| NatsOptions {
        name: format!("{}-{suffix}", nats.name),
        ..nats.clone()
    };
    let plane: Arc<dyn EventPlane> = Arc::new(
        NatsPlane::connect(url, nats.clone())
            .await
            .map_err(|e| fail("nats", e))?,
    );
    let directory =
        NatsDirectory::connect_with(url, named("directory"), DIRECTORY_BUCKET, RECORD_TTL * 4)
            .await
            .map_err(|e| fail("directory", e))?;
    let settings = settings(gpu)?;
    let bs = layout(1)?.tokens_per_block();
    let model = CostModel::new(settings, bs).map_err(|e| fail("cost model", e))?;
    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let advisor = Arc::new(Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(model),
        Arc::new(DecisionLog::new(256)),
        16_384,
    ));
    let router = Arc::new(Router {
        index,
        remote,
        service: Arc::new(RouterService::new(advisor)),
        // Eight missed periods: a worker silent for 2 s is removed.
        registry: Mutex::new(WorkerRegistry::new(ANNOUNCE_PERIOD.as_millis() as u64, 8)),
    });
    let mut events = KvEventReceiver::subscribe(
        plane.clone(),
        &events_subject()?,
        Duration::from_millis(500),
    )
    .await
    .map_err(|e| fail("events", e))?;
    let mut announcements = plane
        .subscribe(&announce_subject(NAMESPACE).map_err(|e| fail("announce subject", e))?)
        .await
        .map_err(|e| fail("announcements", e))?;
    let mut watch = directory.watch().await.map_err(|e| fail("watch", e))?;
    // Its own connection (as before), made as the plane's: NatsPlane::connect
    // (unbounded reconnects with the bounded back-off); only the client is kept.
    let client = NatsPlane::connect(url, named("advise"))
        .await
        .map_err(|e| fail("advise client", e))?
        .client()
        .clone();
    let mut advise = client
        .queue_subscribe(ADVISE_SUBJECT, ADVISE_QUEUE_GROUP.into())
        .await
        .map_err(|e| fail("advise subscribe", e))?;
    client.flush().await.map_err(|e| fail("flush", e))?;
    let serving = router.clone();
    tokio::spawn(async move {
        while let Some(msg) = advise.next().await {
            if let Some(reply) = msg.reply {
                let out = serving.service.handle(&msg.payload);
                let _ = client.publish(reply, out.into()).await;
            }
        }
    });
    println!(
        "{}",
        serde_json::json!({"event": "ready", "subject": ADVISE_SUBJECT, "pid": std::process::id()})
    );
    let mut tick = tokio::time::interval(ANNOUNCE_PERIOD);
    loop {
        tokio::select! {
            m = announcements.next() => {
                let Some(m) = m else { break };
                if let Ok(a) = WorkerAnnouncement::decode(&m.payload) {
                    router.announce(a);
                }
            }
            c = watch.next() => {
                let Some(c) = c else {
                    // The JetStream watch ended (server restarted): watch
                    // again; the history replays every live record.
                    tokio::time::sleep(ANNOUNCE_PERIOD).await;
                    if let Ok(w) = directory.watch().await {
                        watch = w;
                    }
                    continue;
                };
                // A retired incarnation's renewals must not bring it back.
                if let DirectoryChange::Put(r) = &c {
                    if router.retired(r.engine_id()) {
                        continue;
                    }
                }
                router.remote.apply_directory(c);
            }
            item = events.next() => {
                let Some(item) = item else { break };
                match item {
                    KvStreamItem::Event(e) => {
                        if router.retired(e.publisher) {
                            events.forget_publisher(e.publisher);
                            continue;
                        }
                        let _ = router.index.apply_event(&e);
                        router.remote.ingest_event(&e);
                    }
                    KvStreamItem::Lost { publisher, to_event_id, .. } => {
                        let _ = router.index.resync_worker(publisher, to_event_id, &[]);
                    }
                }
            }
            _ = tick.tick() => router.silent(plane.is_connected()),
        }
    }
    Ok(())
}
