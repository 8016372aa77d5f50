//! The router side of decode-to-prefill KV reuse, and what a worker calls.
//!
//! This crate owns:
//! - **settings** ([`ReuseSettings`]): the eight reuse settings, registered
//!   once in [`SETTINGS`] and loaded from CLI flags, `KV_REUSE_*` environment
//!   (captured once, [`EnvSnapshot`]) and TOML, with a JSON round trip;
//! - **the cost model and admission** ([`CostModel`]): estimated TTFT saving =
//!   reused tokens x prefill µs/token − blocks x block µs − lookup µs; every
//!   decision keeps its terms ([`AdmissionDecision`], [`DecisionLog`]);
//! - **calibration** ([`calibrate`]): least squares of measured savings with
//!   standard errors, enabling reuse only when the saving is positive with
//!   95% confidence;
//! - **hint validation** ([`validate_hint`]): a `kv.fetch_gpu@1.0` hint is
//!   checked against the donor's [`kv_descriptor::BankManifest`] and the
//!   target's layout before any memory is touched, and against the prompt
//!   the worker runs ([`check_prompt_prefix`]: a hint for another prompt is
//!   refused);
//! - **the advisor** ([`Advisor`]): after the router picked a prefill
//!   target, a bounded donor lookup (kv-lookup), admission, and the hint
//!   attached, or none with the reason;
//! - **the fetch executor** ([`FetchExecutor`], prefill side): validate,
//!   reserve destination rows (kv-bank), pin donor slots, transfer
//!   (kv-transfer), verify, commit or fall back;
//! - **the source-pin protocol** on the donor control endpoint: the donor
//!   serves pins on a Unix socket ([`PinService`], backed by real
//!   [`kv_bank::ManagerPin`]s) and a target in another process pins through
//!   it ([`RemoteDonor`], a [`DonorSource`]); pins end on release, on
//!   disconnect (a dead target leaks nothing) or at a hold bound;
//! - **worker agents** ([`DonorAgent`], [`TargetAgent`]): the calls a
//!   decode or prefill worker makes to serve and fetch across processes
//!   (bank, pin service, directory record, events, announcements; donor
//!   resolution and the fetch);
//! - **event planes** ([`EventPlane`]): in-process ([`InProcessPlane`], the
//!   default) and NATS ([`NatsPlane`]), with a subscriber readiness barrier,
//!   and KV event streams with per-publisher ids, gap detection and resync
//!   ([`KvEventPublisher`], [`KvEventReceiver`]).
//! - **the donor directory across processes** ([`DirectoryPlane`]): a donor
//!   puts its [`DonorRecord`] (manifest, pin endpoint, NIXL agent metadata,
//!   lease) in-process ([`InProcessDirectory`]) or in a NATS JetStream
//!   key-value bucket ([`NatsDirectory`]); readers keep a [`DonorCache`]
//!   that never uses a lapsed lease or an older generation, bounded in time
//!   by a [`HeardCache`] (an engine quiet for 5 min without a usable record
//!   is forgotten for good), and the router
//!   resolves hints through [`RemoteDonorDirectory`] (slots from the donor's
//!   `Stored` events);
//! - **worker registration** ([`WorkerAnnouncement`], [`WorkerRegistry`]): a
//!   new incarnation under a known worker key replaces the old one, a silent
//!   worker is removed;
//! - **inventory snapshots** ([`InventoryPlane`], [`InventorySync`]): a
//!   (re)started router asks each worker for its ready blocks, consistent
//!   with its event stream, and resumes the stream after them.
//!
//! # Invariants
//! - Off by default: [`ReuseSettings::default`] admits nothing.
//! - Settings are validated whole: a loader or a live retune either yields a
//!   complete valid configuration or an error naming the key; a retune the
//!   cost model cannot use leaves the previous model in force.
//! - Calibration never enables reuse silently: only a positive lower
//!   confidence bound yields [`CalibrationVerdict::Enable`].
//! - A forged, stale or out-of-range hint is rejected by [`validate_hint`]
//!   before any reservation or transfer.
//! - A subscriber that [`EventPlane::subscribe`] returned is ready: events
//!   published afterwards reach it.
//!
//! - A fetch that fails after validation cancels its destination reservation
//!   and releases its donor pin; the request recomputes. A fetch completes
//!   only if its pin held from grant to release ([`DonorPin::release`]).
//! - While a [`PinService`] grant is held, the donor bank cannot evict, reuse
//!   or free the pinned slots; a pin request is decided from the slot table
//!   alone, so a stale, reused or closed request touches no memory.
//!
//! Deliberately absent: routing itself (the router picks the prefill target
//! and calls in here), the inventory index (kv-lookup), memory and copies
//! (kv-bank, kv-transfer), pins across hosts (the pin service listens on a
//! host-local Unix socket only), and any unsafe code.

#![deny(missing_docs)]

#[cfg(feature = "worker")]
mod agent;
mod error;
#[cfg(any(feature = "nats", feature = "vllm"))]
mod log_throttle;
pub mod metrics;
mod plane;
// The harness scenario is also what this crate's own worker tests run.
#[cfg(any(feature = "qualify", all(test, feature = "worker")))]
mod qualify;
mod router;
#[cfg(feature = "service")]
pub mod service;
#[cfg(all(test, feature = "worker", feature = "nats"))]
mod tests;
mod worker;

// Public module paths as before the split by role (`kv_router_glue::spans`,
// `::dynamo_events`, `::vllm_events`, `::nats_server`).
pub use metrics::spans;
#[cfg(feature = "vllm")]
pub use plane::vllm_events;
#[cfg(feature = "qualify")]
pub use qualify::nats_server;
#[cfg(all(feature = "qualify", feature = "nats"))]
pub use qualify::test_pki;
pub use router::dynamo_events;

// Crate-internal short paths (`crate::cost`, `crate::pin_service`, ...), so
// that modules name each other by what they are, not by where they sit.
use plane::event_plane;
use router::{advisor, calibration, cost, kv_events, ols, settings};
use worker::{block_checksums, hint_validation};
#[cfg(feature = "worker")]
use worker::{fetch_executor, pin_service, pin_transport, remote_donor};

pub use advisor::{Advice, Advisor, DonorDirectory, LocalDonorDirectory, ResolvedDonor};
#[cfg(feature = "worker")]
pub use agent::{AgentError, DonorAgent, DonorAgentConfig, DonorCloseReport, TargetAgent};
pub use block_checksums::BlockChecksumError;
pub use calibration::{
    calibrate, Calibration, CalibrationModel, CalibrationSample, CalibrationVerdict,
};
pub use cost::{
    AdmissionDecision, CostInputs, CostModel, CostTerms, DecisionLog, LiveCostModel, RefuseReason,
    TransferPath, Verdict,
};
pub use error::{
    CalibrationError, FallbackCause, FetchError, PinError, PlaneError, RemoteDonorError,
    ResolveError, SettingsError,
};
#[cfg(feature = "nats")]
pub use event_plane::{
    inbox_prefix_problem, nats_server_addrs, nats_slow_consumer_drops, redact_url, NatsAuth,
    NatsOptions, NatsOptionsError, NatsPlane, NatsTls, FORWARD_CAPACITY,
};
pub use event_plane::{
    EventPlane, InProcessPlane, PlaneFuture, PlaneMessage, Subject, Subscription, SUBJECT_ROOT,
};
#[cfg(feature = "worker")]
pub use fetch_executor::{
    DonorPin, DonorSource, EngineRegion, FetchExecutor, FetchOutcome, FetchStages,
};
pub use hint_validation::{check_prompt_prefix, validate_hint, ValidatedFetch};
pub use kv_events::{
    resync_subject, KvEventPublisher, KvEventReceiver, KvStreamItem, KvStreamResume,
    PublisherHeader, ReceiverStats, ResyncOutcome, ResyncRequest, DEFAULT_MAX_EVENT_ID_JUMP,
    DEFAULT_PUBLISHER_IDLE_FORGET,
};
pub use ols::OlsFit;
#[cfg(feature = "worker")]
pub use pin_service::{
    PinService, PinServiceConfig, PinServiceError, PinServiceStats, MAX_PROVISIONAL,
    UNIX_SOCKET_MODE,
};
#[cfg(feature = "worker")]
pub use pin_transport::auth::{PinAuthError, PinAuthKey, AUTH_MAGIC, MIN_KEY_BYTES};
#[cfg(feature = "worker")]
pub use pin_transport::{
    unix_endpoint_path, PinEndpoint, PinEndpointError, MAX_SOCKET_PATH_BYTES, TCP_ENDPOINT_PREFIX,
    UNIX_ENDPOINT_PREFIX,
};
pub use plane::directory::{
    bucket_name_problem, directory_key, CacheUpdate, DirectoryChange, DirectoryPlane,
    DirectoryWatch, DonorCache, DonorRecord, DonorRecordError, DonorRecordParts, HeardCache,
    HeardUpdate, InProcessDirectory, NixlMemKind, NixlRankRegion, MAX_DONOR_RECORD_BYTES,
    MAX_NAME_BYTES, MAX_NIXL_AGENT_NAME_BYTES,
};
pub use plane::directory::{watch_reopening, REOPEN_MAX, REOPEN_MIN};
#[cfg(feature = "nats")]
pub use plane::directory::{NatsDirectory, NATS_MIN_MAX_AGE};
#[cfg(feature = "nats")]
pub use plane::inventory::NatsInventory;
pub use plane::inventory::{
    inventory_subject, InProcessInventory, IncomingRequest, InventoryError, InventoryFuture,
    InventoryPlane, InventoryRefusal, InventoryReply, InventoryRequest, InventoryRequests,
    InventorySnapshot, InventorySync, InventoryWireError, RebuildReport, SnapshotAsker,
    SnapshotBlock, SnapshotPages, SyncOutcome, DEFAULT_INVENTORY_TIMEOUT,
    MAX_INVENTORY_REPLY_BYTES, MAX_INVENTORY_REQUEST_BYTES, MAX_SNAPSHOT_PAGE_BLOCKS,
    MAX_SNAPSHOT_TP,
};
pub use plane::registry::{
    announce_subject, AnnouncementError, IdentityField, Registration, WorkerAnnouncement,
    WorkerRegistry, FORGET_AFTER_MIN_MS, FORGET_AFTER_SILENCE_WINDOWS, MAX_ANNOUNCED_GPUS,
    MAX_ANNOUNCEMENT_BYTES, MAX_REMEMBERED,
};
#[cfg(feature = "qualify")]
pub use qualify::{qualify_section, GlueQualifySection};
#[cfg(feature = "worker")]
pub use remote_donor::{RemoteDonor, RemotePin, DEFAULT_KEPT_IDLE_LIMIT, DEFAULT_PIN_TIMEOUT};
pub use router::remote_directory::{unix_now_ms, RemoteDonorDirectory};
pub use settings::{
    settings_markdown, spec, EnvSnapshot, LoadedSettings, ReuseArgs, ReuseSettings, SettingKind,
    SettingOrigin, SettingSpec, SettingValue, SettingsLoader, ENV_PREFIX, REMOVED_SETTINGS,
    SETTINGS,
};
