//! [`DonorAgent`]: the decode worker's side of reuse across processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_bank::{BankConfig, BankManager, PendingStore, StoreStatus};
use kv_descriptor::{GpuIdentity, SequenceHash, StorageTier, StoredBlock, Wire};

use super::inventory::Mirror;
use super::AgentError;
use crate::event_plane::AbortOnDrop;
use crate::{
    announce_subject, inventory_subject, unix_now_ms, DirectoryPlane, DonorRecord,
    DonorRecordParts, EventPlane, InventoryPlane, InventoryRefusal, InventoryReply,
    InventoryRequest, KvEventPublisher, PinAuthKey, PinService, PinServiceConfig, PinServiceStats,
    PublisherHeader, Subject, WorkerAnnouncement,
};

/// What a [`DonorAgent`] is opened with.
#[derive(Debug, Clone)]
pub struct DonorAgentConfig {
    /// Stable name of the worker across incarnations (1..=256 bytes).
    pub worker_key: String,
    /// The bank: layout, owner (engine id, role `Decode`, generation),
    /// byte budget, bank lease (renewed by the bank's own background thread
    /// under the default [`kv_bank::LeaseConfig`]).
    pub bank: BankConfig,
    /// Host id the bank's memory is published under.
    pub host_id: String,
    /// `None`: host shared memory (CPU). `Some(ordinals)`: CUDA device
    /// memory, rank `r` on ordinal `ordinals[r]`.
    pub cuda_ordinals: Option<Vec<u32>>,
    /// The GPU of each TP rank, announced in the [`WorkerAnnouncement`].
    pub gpus: Vec<GpuIdentity>,
    /// The pin service's endpoint, published in the record and the
    /// announcement: `unix:<path>` (same host), or `tcp:<host>:<port>` (a
    /// target on another host; needs `pin_auth_key`). Port 0 binds a free
    /// port and the bound `tcp:<ip>:<port>` is what gets published.
    pub pin_endpoint: String,
    /// Key every TCP pin connection must prove (HMAC-SHA256
    /// challenge-response, docs/security.md). Required for `tcp:`; not used
    /// on a Unix socket (its file mode guards it).
    pub pin_auth_key: Option<PinAuthKey>,
    /// Limits of the pin service.
    pub pin_config: PinServiceConfig,
    /// Namespace of the announce subject (`kv.<namespace>.workers.announce`).
    pub namespace: String,
    /// Subject the KV events are published on (also announced).
    pub event_subject: Subject,
    /// Events kept for resync replay: the agent answers a receiver's resync
    /// request (`<event topic>_resync`) from this ring; a gap older than it
    /// ends in `Lost` at the receiver (a router then rebuilds from the
    /// inventory snapshot).
    pub event_ring: usize,
    /// How long one put of the record is valid (its `lease_expires_unix_ms`
    /// = publish time + this). [`DonorAgent::tick`] re-puts once a third of
    /// it has passed, so two missed ticks still leave a live record. At
    /// most the bank lease's duration: a record must not outlive the lease
    /// an importer checks.
    pub record_ttl: Duration,
}

/// The NIXL agent a [`DonorAgent`] publishes in its record.
#[derive(Debug, Clone)]
struct PublishedNixl {
    name: String,
    metadata: Vec<u8>,
    /// Rank `r`'s bank memory, as registered with that agent.
    regions: Vec<crate::NixlRankRegion>,
}

/// What [`DonorAgent::close`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DonorCloseReport {
    /// Counters of the pin service at shutdown.
    pub pin_stats: PinServiceStats,
    /// KV events published by the close (the bank's `Cleared`, and any left).
    pub events_published: usize,
}

/// A decode worker's reuse agent: bank, pin service, directory record, KV
/// events and announcements. Async calls publish on the planes; call
/// [`DonorAgent::tick`] periodically (e.g. every second) from the engine's
/// runtime.
pub struct DonorAgent {
    bank: Arc<BankManager>,
    pins: Option<PinService>,
    directory: Arc<dyn DirectoryPlane>,
    plane: Arc<dyn EventPlane>,
    events: Arc<EventsOut>,
    namespace: String,
    inventory_server: parking_lot::Mutex<Option<AbortOnDrop>>,
    resync_server: Option<AbortOnDrop>,
    announcement: WorkerAnnouncement,
    announce_subject: Subject,
    worker_key: String,
    record_ttl_ms: u64,
    last_put_ms: AtomicU64,
    /// The NIXL agent published in the record.
    nixl: parking_lot::Mutex<Option<PublishedNixl>>,
}

impl std::fmt::Debug for DonorAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DonorAgent")
            .field("worker_key", &self.worker_key)
            .field("engine", &self.bank.owner().engine_id)
            .field("generation", &self.bank.owner().generation)
            .finish()
    }
}

impl DonorAgent {
    /// Opens the bank, binds the pin service, puts the record and announces.
    ///
    /// # Errors
    /// [`AgentError::InvalidConfig`] naming `record_ttl` (zero, or longer
    /// than the bank lease); [`AgentError::Announcement`] naming the bad
    /// field (e.g. `gpus` not one per rank); [`AgentError::Bank`] when the
    /// bank cannot open; [`AgentError::PinService`]; [`AgentError::Record`]
    /// or [`AgentError::Plane`] for the first put. On error everything
    /// opened so far is closed again.
    pub async fn open(
        config: DonorAgentConfig,
        directory: Arc<dyn DirectoryPlane>,
        plane: Arc<dyn EventPlane>,
    ) -> Result<Self, AgentError> {
        let lease = config.bank.lease.duration;
        if config.record_ttl.is_zero() || config.record_ttl > lease {
            return Err(AgentError::InvalidConfig {
                field: "record_ttl",
                reason: format!(
                    "{:?} must be above zero and at most the bank lease {lease:?}",
                    config.record_ttl
                ),
            });
        }
        let layout = config.bank.layout;
        let owner = config.bank.owner;
        let announcement = WorkerAnnouncement {
            worker_key: config.worker_key.clone(),
            engine_id: owner.engine_id,
            role: owner.role,
            layout_fingerprint: layout.fingerprint(),
            tp_size: layout.tp_size(),
            gpus: config.gpus.clone(),
            pin_endpoint: config.pin_endpoint.clone(),
            event_subject: config.event_subject.as_str().to_string(),
        };
        // Checked before anything is allocated: a bad announcement opens nothing.
        announcement.validate()?;
        let announce_subject = announce_subject(&config.namespace)?;
        let bank = Arc::new(match &config.cuda_ordinals {
            None => BankManager::new_host_shm(config.bank.clone(), &config.host_id)?,
            Some(o) => BankManager::new_cuda(config.bank.clone(), &config.host_id, o)?,
        });
        let close_bank = |bank: &BankManager| {
            let _ = bank.close(Duration::ZERO);
        };
        let bound = match config.pin_auth_key.clone() {
            Some(key) => PinService::bind_authenticated(
                bank.clone(),
                &config.pin_endpoint,
                config.pin_config,
                key,
            ),
            None => PinService::bind(bank.clone(), &config.pin_endpoint, config.pin_config),
        };
        let pins = match bound {
            Ok(p) => p,
            Err(e) => {
                close_bank(&bank);
                return Err(e.into());
            }
        };
        // `tcp:...:0` bound a free port: publish the one targets can dial.
        let mut announcement = announcement;
        announcement.pin_endpoint = pins.endpoint().to_string();
        let publisher = Arc::new(KvEventPublisher::new(
            plane.clone(),
            config.event_subject.clone(),
            PublisherHeader {
                publisher: owner.engine_id,
                role: owner.role,
                layout_fingerprint: layout.fingerprint(),
                tp_size: layout.tp_size(),
            },
            config.event_ring,
        ));
        let events = Arc::new(EventsOut {
            bank: bank.clone(),
            publisher: publisher.clone(),
            mirror: tokio::sync::Mutex::new(Mirror::default()),
        });
        let agent = Self {
            bank,
            pins: Some(pins),
            directory,
            plane,
            events,
            namespace: config.namespace,
            inventory_server: parking_lot::Mutex::new(None),
            resync_server: None,
            announcement,
            announce_subject,
            worker_key: config.worker_key,
            record_ttl_ms: config.record_ttl.as_millis() as u64,
            last_put_ms: AtomicU64::new(0),
            nixl: parking_lot::Mutex::new(None),
        };
        let mut agent = agent;
        let opened = async {
            // Before any event goes out: a gap is repaired from the ring.
            agent.resync_server = Some(AbortOnDrop(publisher.serve_resync().await?));
            agent.put_record().await?;
            agent.announce().await
        }
        .await;
        if let Err(e) = opened {
            let _ = agent.close(Duration::ZERO).await;
            return Err(e);
        }
        Ok(agent)
    }

    /// The bank (for the engine's reads, lookups, `exclude`, stats).
    pub fn bank(&self) -> &Arc<BankManager> {
        &self.bank
    }

    /// The pin endpoint published in the record.
    pub fn pin_endpoint(&self) -> &str {
        &self.announcement.pin_endpoint
    }

    /// The announcement this agent publishes.
    pub fn announcement(&self) -> &WorkerAnnouncement {
        &self.announcement
    }

    /// The record as put now: the bank's manifest, the pin endpoint, lease
    /// expiry `now + record_ttl`.
    ///
    /// # Errors
    /// [`AgentError::Record`] naming the field.
    pub fn record(&self, now_unix_ms: u64) -> Result<DonorRecord, AgentError> {
        let nixl = self.nixl.lock().clone();
        Ok(DonorRecord::new(DonorRecordParts {
            worker_key: self.worker_key.clone(),
            manifest: self.bank.manifest().clone(),
            pin_endpoint: self.announcement.pin_endpoint.clone(),
            nixl_agent_name: nixl.as_ref().map(|n| n.name.clone()),
            nixl_agent_metadata: nixl.as_ref().map(|n| n.metadata.clone()),
            nixl_rank_regions: nixl.map(|n| n.regions),
            lease_expires_unix_ms: now_unix_ms + self.record_ttl_ms,
            published_unix_ms: now_unix_ms,
        })?)
    }

    /// Publishes the NIXL agent that registered this bank's memory (its
    /// `NixlAgent::name` and `NixlAgent::metadata`) in the record, with
    /// every TP rank's bank memory as that agent registered it
    /// (`nixl_rank_regions`: each rank memory's `base_addr`, length, kind
    /// and device), and puts the record now; every later put carries them.
    /// A target on another host loads the agent with
    /// [`crate::TargetAgent::load_donor_nixl`] and reads with
    /// [`crate::TargetAgent::fetch_nixl`] from the record alone.
    /// Registering each rank memory (`bank().rank(r)?.memory()`) with that
    /// agent is the caller's part, before this call.
    ///
    /// # Errors
    /// [`AgentError::Record`] naming `nixl_agent_name` (empty or over
    /// [`crate::MAX_NIXL_AGENT_NAME_BYTES`]) or `nixl_agent_metadata` (over
    /// [`kv_descriptor::MAX_NIXL_METADATA_BYTES`]), or `TooLarge`: nothing
    /// changes, the record keeps what it published before;
    /// [`AgentError::Bank`] when a rank's memory cannot be named (a closed
    /// bank); [`AgentError::Plane`] when the put fails (the next tick
    /// re-puts).
    pub async fn publish_nixl_agent(
        &self,
        agent_name: String,
        metadata: Vec<u8>,
    ) -> Result<(), AgentError> {
        // A bank's rank memories never move while it is open: taken once.
        let regions = (0..self.bank.config().layout.tp_size())
            .map(|r| {
                self.bank
                    .rank(r)
                    .map(|b| crate::NixlRankRegion::of_memory(b.memory().as_ref()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let before = self.nixl.lock().replace(PublishedNixl {
            name: agent_name,
            metadata,
            regions,
        });
        if let Err(e) = self.record(unix_now_ms()) {
            *self.nixl.lock() = before;
            return Err(e);
        }
        self.put_record().await
    }

    /// Puts (renews) the record in the directory.
    ///
    /// # Errors
    /// [`AgentError::Record`], [`AgentError::Plane`].
    pub async fn put_record(&self) -> Result<(), AgentError> {
        let now = unix_now_ms();
        let r = self.record(now)?;
        self.directory.put(&r).await?;
        self.last_put_ms.store(now, Ordering::SeqCst);
        Ok(())
    }

    /// Publishes the announcement once.
    ///
    /// # Errors
    /// [`AgentError::Plane`].
    pub async fn announce(&self) -> Result<(), AgentError> {
        let bytes = self
            .announcement
            .to_wire()
            .map_err(|e| crate::PlaneError::Codec {
                what: "worker_announcement",
                reason: e.to_string(),
            })?;
        self.plane.publish(&self.announce_subject, bytes).await?;
        Ok(())
    }

    /// Starts storing sealed `blocks` (prefix order, the first a child of
    /// `parent`): [`BankManager::store`]. Each rank then writes its part
    /// with [`BankManager::write_pending`] (through [`DonorAgent::bank`])
    /// and calls [`DonorAgent::ack`].
    ///
    /// # Errors
    /// [`AgentError::Bank`] (closed, broken chain, full, lease lapsed).
    pub fn store(
        &self,
        parent: Option<SequenceHash>,
        blocks: &[StoredBlock],
    ) -> Result<PendingStore, AgentError> {
        Ok(self.bank.store(parent, blocks)?)
    }

    /// Rank `rank` wrote its part of store `store_id`
    /// ([`BankManager::ack`]); when the store became ready its `Stored`
    /// events (with slots) are published at once.
    ///
    /// # Errors
    /// [`AgentError::Bank`]; [`AgentError::Plane`] when publishing failed
    /// (the ids are consumed: receivers see a gap and resync).
    pub async fn ack(&self, store_id: u64, rank: u32) -> Result<StoreStatus, AgentError> {
        let status = self.bank.ack(store_id, rank)?;
        if status == StoreStatus::Ready {
            self.publish_events().await?;
        }
        Ok(status)
    }

    /// Publishes every queued bank event (evictions, exclusions included);
    /// returns how many.
    ///
    /// # Errors
    /// [`AgentError::Plane`]: the first failed publish. The others are
    /// still sent; a failed one's id is consumed (receivers see a gap).
    pub async fn publish_events(&self) -> Result<usize, AgentError> {
        self.events.publish_queued().await
    }

    /// Answers inventory snapshot requests for this incarnation on
    /// `kv.<namespace>.inventory.<engine_id>` over `plane` until
    /// [`DonorAgent::close`] (a second call replaces the first server).
    /// Ready on return.
    ///
    /// # Errors
    /// [`AgentError::Inventory`] when the subject cannot be served.
    pub async fn serve_inventory(&self, plane: Arc<dyn InventoryPlane>) -> Result<(), AgentError> {
        let subject = inventory_subject(&self.namespace, self.bank.owner().engine_id)?;
        let mut requests = plane.serve(&subject).await?;
        let events = self.events.clone();
        let task = tokio::spawn(async move {
            while let Some(req) = requests.next().await {
                let reply = match InventoryRequest::decode(&req.payload) {
                    Ok(r) => events.answer(&r).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "malformed inventory request");
                        InventoryReply::Refused(InventoryRefusal::Malformed)
                    }
                };
                match reply.to_wire() {
                    Ok(bytes) => req.respond(bytes),
                    Err(e) => tracing::warn!(error = %e, "inventory reply not encoded"),
                }
            }
        });
        *self.inventory_server.lock() = Some(AbortOnDrop(task));
        Ok(())
    }

    /// What this agent answers to `req` (what [`DonorAgent::serve_inventory`]
    /// sends): queued events are published first, then the page is built
    /// under the lock that numbers events, so it is the state after exactly
    /// `last_event_id` events.
    pub async fn inventory_page(&self, req: &InventoryRequest) -> InventoryReply {
        self.events.answer(req).await
    }

    /// Periodic work: publishes queued events, re-puts the record once a
    /// third of its TTL has passed since the last put, and announces.
    ///
    /// # Errors
    /// The first failing step's error; the later steps still ran.
    pub async fn tick(&self) -> Result<(), AgentError> {
        let events = self.publish_events().await.map(|_| ());
        let since = unix_now_ms().saturating_sub(self.last_put_ms.load(Ordering::SeqCst));
        let put = if since >= self.record_ttl_ms / 3 {
            self.put_record().await
        } else {
            Ok(())
        };
        let ann = self.announce().await;
        events.and(put).and(ann)
    }

    /// Closes: stops the pin service (waiting up to `drain` for held pins),
    /// closes the bank (its `Cleared` event published), deletes the record.
    /// Every step runs even when an earlier one failed.
    ///
    /// # Errors
    /// The first failure; [`AgentError::Bank`] with
    /// [`kv_bank::BankError::CloseTimedOut`] when pins outlived `drain`.
    pub async fn close(mut self, drain: Duration) -> Result<DonorCloseReport, AgentError> {
        // No snapshot nor replay is answered once closing began.
        self.inventory_server.lock().take();
        self.resync_server.take();
        // The record goes first: no reader resolves this donor any more.
        let deleted = self
            .directory
            .delete(self.bank.owner().engine_id)
            .await
            .map_err(AgentError::from);
        let pin_stats = match self.pins.take() {
            Some(p) => p.shutdown(drain),
            None => PinServiceStats::default(),
        };
        let closed = self.bank.close(drain).map_err(AgentError::from);
        let published = self.publish_events().await;
        deleted?;
        closed?;
        Ok(DonorCloseReport {
            pin_stats,
            events_published: published?,
        })
    }
}

/// The agent's outgoing KV events: the bank's queue, the publisher, and the
/// mirror of what they published (shared with the inventory server task).
struct EventsOut {
    bank: Arc<BankManager>,
    publisher: Arc<KvEventPublisher>,
    // Held across publishing so that ids, wire order and the mirror agree.
    mirror: tokio::sync::Mutex<Mirror>,
}

impl EventsOut {
    /// Publishes every queued bank event; returns how many.
    async fn publish_queued(&self) -> Result<usize, AgentError> {
        let mut mirror = self.mirror.lock().await;
        let events = self.bank.drain_events();
        let n = events.len();
        let tp = self.bank.config().layout.tp_size();
        let mut first_err = None;
        for e in events {
            // The publisher consumes an id even when sending fails, so the
            // mirror follows every event, sent or not.
            mirror.apply(&e.data, tp);
            if let Err(err) = self
                .publisher
                .publish(StorageTier::RetainedGpuDirect, e.data)
                .await
            {
                first_err.get_or_insert(err);
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(n),
        }
    }

    async fn answer(&self, req: &InventoryRequest) -> InventoryReply {
        let owner = self.bank.owner();
        if req.engine_id != owner.engine_id {
            return InventoryReply::Refused(InventoryRefusal::OtherEngine {
                actual: owner.engine_id,
            });
        }
        if self.bank.is_closed() {
            return InventoryReply::Refused(InventoryRefusal::Closed);
        }
        if let Err(e) = self.publish_queued().await {
            // The ids are consumed and mirrored: the page stays consistent.
            tracing::warn!(error = %e, "publishing before a snapshot failed");
        }
        let mirror = self.mirror.lock().await;
        InventoryReply::Snapshot(mirror.page(req, &self.bank))
    }
}
