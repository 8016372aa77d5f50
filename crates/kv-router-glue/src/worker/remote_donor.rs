//! Target side of the cross-process source-pin protocol: a [`DonorSource`]
//! for a donor bank owned by another process, pinned through the donor's
//! [`PinService`](crate::PinService) on its control endpoint.
//!
//! [`RemoteDonor`] holds the donor's manifest and this process's mappings
//! of its rank memories; [`DonorSource::pin`] sends a [`PinRequest`] for the
//! hinted slots on a connection to the endpoint and returns a [`RemotePin`]
//! only on a grant. The connection is the pin's for as long as the pin
//! lives: if this process dies, the kernel closes it and the donor drops the
//! pin. [`RemotePin`] releases on [`DonorPin::release`] (which reports
//! whether the donor held the pin for the whole time) or on drop.
//!
//! Each pin has a connection of its own while it is held, so pins stay
//! independent: a failure on one never ends another, and no request/reply
//! matching across threads is needed. **Connection reuse**: a connection
//! whose pin was released cleanly is kept (one per donor) and carries the
//! next pin, which then costs one round trip instead of a connect, the
//! donor's thread start and, over TCP, the key exchange (the H200 runs
//! measured the pin stage at ~0.49 ms p50 with a new connection per pin,
//! `docs/qualification/h200-s13/`). A kept connection the donor has closed
//! meanwhile (restart, its idle eviction at the connection limit) fails on
//! its first exchange with an I/O error before any grant: the pin is then
//! asked once more on a new connection. Nothing is lost by that retry: a
//! grant the donor made on a connection that ended is dropped with it. A
//! connection idle for longer than [`DEFAULT_KEPT_IDLE_LIMIT`]
//! ([`RemoteDonor::with_kept_idle_limit`]) is not reused: a middlebox may
//! have dropped the flow silently, and a pin on it would only fail after the
//! whole reply timeout. A forked child never reuses its parent's connection.
//!
//! Over TCP (`tcp:<host>:<port>`, a donor on another host) each new
//! connection first passes the key exchange of [`PinAuthKey`] (one more
//! round trip), so a TCP endpoint needs [`RemoteDonor::with_auth_key`];
//! without it a pin fails with [`PinError::Auth`] before anything is sent.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_bank::{BankMemory, CudaIpcImport, HostShmMemory, MemoryKind};
use kv_descriptor::{
    encode_pin_frame, BankManifest, ExportHandle, FetchGpuHint, MemoryLocation, PinClientMessage,
    PinDonorMessage, PinGrant, PinRelease, PinRequest,
};

use kv_transfer::{NixlRemoteRegion, SourceRegion};

use crate::pin_transport::{connect, read_donor_message, PinEndpoint, PinStream};
use crate::{DonorPin, DonorSource, PinAuthKey, PinError, RemoteDonorError};

/// Where a remote donor's rank memories are read from.
#[derive(Debug)]
enum RankSources {
    /// Mapped into this process: host shm, or CUDA IPC imports.
    Mapped(Vec<Arc<dyn BankMemory>>),
    /// Registered with the donor's NIXL agent (another host): read by a
    /// NIXL READ, never mapped here.
    Nixl(Vec<NixlRemoteRegion>),
}

/// Default time to wait for the donor's reply to a pin or release (2 s).
pub const DEFAULT_PIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a kept connection may sit idle and still carry the next pin
/// (default of [`RemoteDonor::with_kept_idle_limit`]). A connection idle
/// for longer is closed and a new one made: a NAT, firewall or load
/// balancer between the hosts may have dropped an idle TCP flow without
/// telling either end, and a pin sent on it would wait for the whole
/// reply timeout before failing. 30 s is below the idle timeouts of common
/// cloud NAT gateways (350 s and up) and still carries every pin of a
/// session whose turns come seconds apart.
pub const DEFAULT_KEPT_IDLE_LIMIT: Duration = Duration::from_secs(30);

/// A donor bank in another process, pinned over its control endpoint.
///
/// ```no_run
/// use kv_router_glue::RemoteDonor;
/// # fn manifest() -> kv_descriptor::BankManifest { unimplemented!() }
/// // Maps every rank's host shm segment (under the donor's live lease).
/// let donor = RemoteDonor::open_host_shm(manifest(), "unix:/tmp/kv-d0.sock").unwrap();
/// // Pass `&donor` to `FetchExecutor::execute`; a refused pin falls back.
/// # let _ = donor;
/// ```
#[derive(Debug)]
pub struct RemoteDonor {
    manifest: BankManifest,
    source: RankSources,
    endpoint: String,
    timeout: Duration,
    /// The pre-shared key for `tcp:` endpoints.
    auth: Option<PinAuthKey>,
    next_request: AtomicU64,
    /// The connection of the last cleanly released pin, for the next pin
    /// (module docs, "Connection reuse"); at most one is kept, with the
    /// process that kept it: a forked child inherits the socket, and two
    /// processes interleaving frames on one connection would break its
    /// request/reply order, so a child never reuses it.
    kept: parking_lot::Mutex<Option<Kept>>,
    /// Longest idle time after which a kept connection is not reused.
    kept_idle_limit: Duration,
}

/// A kept connection: the process that kept it, when, and the stream.
#[derive(Debug)]
struct Kept {
    pid: u32,
    since: Instant,
    stream: PinStream,
}

impl RemoteDonor {
    /// A donor whose rank `r` memory is `maps[r]`, already mapped in this
    /// process (host shm, or a CUDA IPC import opened on the destination
    /// GPU), pinned through `endpoint`.
    ///
    /// Every mapping is bound to the manifest part it stands for before
    /// anything is pinned or read: `maps[r].mapped_export()` must be rank
    /// `r`'s `export()` (the shm name, or the IPC / fabric handle of the
    /// allocation on the part's GPU), its memory kind the part's location
    /// (host or device) and its length at least the part's region. The GPU
    /// ordinal is not compared: an import is mapped on the device that
    /// reads it, which may differ from the donor's, and the handle already
    /// names the donor's allocation.
    ///
    /// # Errors
    /// [`RemoteDonorError::Endpoint`] when `endpoint` is not `unix:<path>`,
    /// a plain absolute path or `tcp:<host>:<port>`;
    /// [`RemoteDonorError::MapCount`] when the map count is not the
    /// manifest's TP size; [`RemoteDonorError::MappingMismatch`] naming the
    /// rank and `export`, `kind` or `len` for a mapping that is not its
    /// part's memory (e.g. rank 1's mapping handed in as rank 0).
    pub fn new(
        manifest: BankManifest,
        maps: Vec<Arc<dyn BankMemory>>,
        endpoint: &str,
    ) -> Result<Self, RemoteDonorError> {
        PinEndpoint::parse(endpoint).map_err(RemoteDonorError::Endpoint)?;
        if maps.len() != manifest.tp_size() as usize {
            return Err(RemoteDonorError::MapCount {
                got: maps.len(),
                tp_size: manifest.tp_size(),
            });
        }
        for (rank, map) in maps.iter().enumerate() {
            bind_mapping(&manifest, rank, map.as_ref())?;
        }
        Ok(Self::with_sources(
            manifest,
            RankSources::Mapped(maps),
            endpoint,
        ))
    }

    fn with_sources(manifest: BankManifest, source: RankSources, endpoint: &str) -> Self {
        Self {
            manifest,
            source,
            endpoint: endpoint.to_owned(),
            timeout: DEFAULT_PIN_TIMEOUT,
            auth: None,
            next_request: AtomicU64::new(1),
            kept: parking_lot::Mutex::new(None),
            kept_idle_limit: DEFAULT_KEPT_IDLE_LIMIT,
        }
    }

    /// A donor on another host whose rank `r` memory is `regions[r]`, a
    /// region the donor's NIXL agent registered (its agent already loaded
    /// into this process's NIXL agent, see
    /// [`crate::TargetAgent::load_donor_nixl`]), read with NIXL READs by an
    /// executor on a `kv_transfer::nixl::NixlBackend`; pins still go
    /// through `endpoint` (`tcp:` for another host).
    ///
    /// Every region is bound to its manifest part before anything is
    /// pinned or read: one NIXL agent for all ranks, its kind the part's
    /// location (DRAM for a host part, VRAM for a GPU part) and its length
    /// at least the part's region. Whether VRAM is read device-direct is
    /// decided per read by the backend (host-staged VRAM fails closed).
    ///
    /// # Errors
    /// [`RemoteDonorError::Endpoint`] for a bad `endpoint`;
    /// [`RemoteDonorError::MapCount`] when the region count is not the
    /// manifest's TP size; [`RemoteDonorError::MappingMismatch`] naming the
    /// rank and `agent_name`, `kind` or `len`.
    pub fn open_nixl(
        manifest: BankManifest,
        regions: Vec<NixlRemoteRegion>,
        endpoint: &str,
    ) -> Result<Self, RemoteDonorError> {
        PinEndpoint::parse(endpoint).map_err(RemoteDonorError::Endpoint)?;
        if regions.len() != manifest.tp_size() as usize {
            return Err(RemoteDonorError::MapCount {
                got: regions.len(),
                tp_size: manifest.tp_size(),
            });
        }
        for (rank, region) in regions.iter().enumerate() {
            bind_nixl_region(&manifest, rank, region, &regions[0].agent_name)?;
        }
        Ok(Self::with_sources(
            manifest,
            RankSources::Nixl(regions),
            endpoint,
        ))
    }

    /// A donor with host shared-memory banks: maps every rank with
    /// [`HostShmMemory::open_descriptor`] (which requires the donor's live
    /// lease of that exact incarnation and generation).
    ///
    /// # Errors
    /// [`RemoteDonorError::Import`] for the first rank that cannot be
    /// mapped; the errors of [`RemoteDonor::new`].
    pub fn open_host_shm(manifest: BankManifest, endpoint: &str) -> Result<Self, RemoteDonorError> {
        let maps = manifest
            .parts()
            .iter()
            .map(|d| {
                HostShmMemory::open_descriptor(d)
                    .map(|m| Arc::new(m) as Arc<dyn BankMemory>)
                    .map_err(|source| RemoteDonorError::Import {
                        rank: d.tp_rank(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(manifest, maps, endpoint)
    }

    /// A donor with CUDA device banks: imports every rank's IPC or fabric
    /// handle with [`CudaIpcImport::open_descriptor`] on `destination_gpu[r]`,
    /// the local ordinal of the device that reads rank `r` (the target
    /// region's GPU; see `BankMemory::device_local_mapping`), under the
    /// donor's live lease.
    ///
    /// # Errors
    /// [`RemoteDonorError::MapCount`] when `destination_gpu` does not hold
    /// one ordinal per rank; [`RemoteDonorError::Import`] for the first rank
    /// that cannot be imported; the errors of [`RemoteDonor::new`].
    pub fn open_cuda_ipc(
        manifest: BankManifest,
        destination_gpu: &[u32],
        endpoint: &str,
    ) -> Result<Self, RemoteDonorError> {
        if destination_gpu.len() != manifest.tp_size() as usize {
            return Err(RemoteDonorError::MapCount {
                got: destination_gpu.len(),
                tp_size: manifest.tp_size(),
            });
        }
        let maps = manifest
            .parts()
            .iter()
            .zip(destination_gpu)
            .map(|(d, &gpu)| {
                CudaIpcImport::open_descriptor(d, gpu)
                    .map(|m| Arc::new(m) as Arc<dyn BankMemory>)
                    .map_err(|source| RemoteDonorError::Import {
                        rank: d.tp_rank(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(manifest, maps, endpoint)
    }

    /// Replaces the reply timeout ([`DEFAULT_PIN_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Replaces [`DEFAULT_KEPT_IDLE_LIMIT`]: a released pin's connection
    /// idle for longer is not reused (closed, a new one made).
    /// `Duration::ZERO` turns connection reuse off (every pin connects).
    pub fn with_kept_idle_limit(mut self, limit: Duration) -> Self {
        self.kept_idle_limit = limit;
        self
    }

    /// Sets the pre-shared key proven to a `tcp:` endpoint (unused on a
    /// Unix socket, whose file mode is the control).
    pub fn with_auth_key(mut self, key: PinAuthKey) -> Self {
        self.auth = Some(key);
        self
    }

    /// The control endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Asks the donor to pin what `hint` fetches.
    ///
    /// # Errors
    /// [`PinError::Refused`] with the donor's
    /// [`kv_descriptor::PinRefusalReason`] when the donor refuses;
    /// [`PinError::Auth`] when a `tcp:` endpoint has no key here, or the
    /// key exchange fails (wrong key: `PinAuthError::Refused`);
    /// [`PinError::Endpoint`], [`PinError::Io`] (`connect`, `send`,
    /// `receive`), [`PinError::Timeout`] or [`PinError::Protocol`] when it
    /// cannot be asked or its answer is not a grant. Nothing is pinned on error.
    pub fn pin_remote(&self, hint: &FetchGpuHint) -> Result<RemotePin<'_>, PinError> {
        let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
        let req = PinRequest::for_hint(request_id, hint);
        // A NIXL region is only an address: the bytes it yields are checked
        // against the donor's checksums (a mapping is bound by its handle).
        let req = match self.source {
            RankSources::Nixl(_) => req.with_block_checksums(),
            RankSources::Mapped(_) => req,
        };
        let frame =
            encode_pin_frame(&PinClientMessage::Pin(req)).map_err(|e| PinError::Protocol {
                detail: format!("encoding the pin request: {e}"),
            })?;
        // An inherited connection (`pid` differs) or one idle past the limit
        // is dropped here (for an inherited one that closes only this
        // process's descriptor).
        let kept = self.kept.lock().take();
        let usable =
            |k: &Kept| k.pid == std::process::id() && k.since.elapsed() < self.kept_idle_limit;
        if let Some(stream) = kept.filter(usable).map(|k| k.stream) {
            match self.exchange_pin(stream, &frame, request_id) {
                // The donor closed the kept connection (it restarted, or
                // closed it to admit another at its limit): no grant can
                // survive on it, so a new connection asks again.
                Err(PinError::Io { .. }) => {}
                done => return done,
            }
        }
        let stream = connect(&self.endpoint, self.timeout, self.auth.as_ref())?;
        self.exchange_pin(stream, &frame, request_id)
    }

    /// Sends one encoded pin request on `stream` and reads the donor's
    /// answer: a [`RemotePin`] owning `stream` on a grant.
    fn exchange_pin(
        &self,
        mut stream: PinStream,
        frame: &[u8],
        request_id: u64,
    ) -> Result<RemotePin<'_>, PinError> {
        let sent = std::io::Write::write_all(&mut stream, frame);
        // A donor over its connection limit answers before reading and
        // closes, so a failed write may still have a refusal waiting.
        let reply = read_donor_message(&mut stream, self.timeout);
        let reply = match (sent, reply) {
            (_, Ok(r)) => r,
            (Err(e), Err(_)) => return Err(PinError::io("send", e, self.timeout)),
            (Ok(()), Err(e)) => return Err(e),
        };
        match reply {
            PinDonorMessage::Granted(grant) if grant.request_id == request_id => Ok(RemotePin {
                donor: self,
                stream: Some(stream),
                grant,
                granted_at: Instant::now(),
            }),
            PinDonorMessage::Refused(r) => Err(PinError::Refused {
                reason: r.reason,
                detail: r.detail,
            }),
            other => Err(PinError::Protocol {
                detail: format!("unexpected reply to pin request {request_id}: {other:?}"),
            }),
        }
    }

    /// Keeps `stream` (its pin released, the donor's answer read) for the
    /// next pin, unless one is kept already.
    fn keep(&self, stream: PinStream) {
        let mut kept = self.kept.lock();
        if kept.is_none() && !self.kept_idle_limit.is_zero() {
            *kept = Some(Kept {
                pid: std::process::id(),
                since: Instant::now(),
                stream,
            });
        }
    }

    /// Closes the kept connection, if any (the donor's service thread for
    /// it then ends). Pins held now keep their own connections.
    pub fn close_kept_connection(&self) {
        drop(self.kept.lock().take());
    }
}

impl DonorSource for RemoteDonor {
    fn manifest(&self) -> &BankManifest {
        &self.manifest
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        self.pin_remote(hint)
            .map(|p| Box::new(p) as Box<dyn DonorPin>)
    }
}

/// Checks that `map` is the memory of `manifest`'s rank `rank` part (see
/// [`RemoteDonor::new`]).
fn bind_mapping(
    manifest: &BankManifest,
    rank: usize,
    map: &dyn BankMemory,
) -> Result<(), RemoteDonorError> {
    let part = &manifest.parts()[rank];
    let mismatch = |field, detail| RemoteDonorError::MappingMismatch {
        rank: rank as u32,
        field,
        detail,
    };
    match map.mapped_export() {
        Some(ref h) if h == part.export() => {}
        Some(h) => {
            // Name whose part it is when it is another rank's.
            let owner = manifest
                .parts()
                .iter()
                .find(|d| d.export() == &h)
                .map_or(String::new(), |d| format!(" (rank {}'s part)", d.tp_rank()));
            return Err(mismatch(
                "export",
                format!(
                    "maps {}{owner}, but rank {rank}'s part exports {}",
                    describe(&h),
                    describe(part.export())
                ),
            ));
        }
        None => {
            return Err(mismatch(
                "export",
                format!(
                    "the mapping has no export identity (process-private memory); rank \
                     {rank}'s part exports {}",
                    describe(part.export())
                ),
            ))
        }
    }
    let kind_ok = matches!(
        (part.location(), map.kind()),
        (MemoryLocation::Host { .. }, MemoryKind::Host)
            | (MemoryLocation::Gpu(_), MemoryKind::Cuda { .. })
    );
    if !kind_ok {
        return Err(mismatch(
            "kind",
            format!(
                "{} memory for a part located on {:?}",
                map.kind(),
                part.location()
            ),
        ));
    }
    if (map.len() as u64) < part.region_bytes() {
        return Err(mismatch(
            "len",
            format!(
                "{} bytes mapped, rank {rank}'s region holds {}",
                map.len(),
                part.region_bytes()
            ),
        ));
    }
    Ok(())
}

/// Checks that `region` can stand for `manifest`'s rank `rank` part (see
/// [`RemoteDonor::open_nixl`]); `agent` is rank 0's agent name.
fn bind_nixl_region(
    manifest: &BankManifest,
    rank: usize,
    region: &NixlRemoteRegion,
    agent: &str,
) -> Result<(), RemoteDonorError> {
    let part = &manifest.parts()[rank];
    let mismatch = |field, detail| RemoteDonorError::MappingMismatch {
        rank: rank as u32,
        field,
        detail,
    };
    if region.agent_name.is_empty() || region.agent_name != agent {
        // One donor bank is one NIXL agent: another name is another worker.
        return Err(mismatch(
            "agent_name",
            format!(
                "NIXL agent `{}`, rank 0 reads from `{agent}`",
                region.agent_name
            ),
        ));
    }
    let kind_ok = matches!(
        (part.location(), region.kind),
        (MemoryLocation::Host { .. }, MemoryKind::Host)
            | (MemoryLocation::Gpu(_), MemoryKind::Cuda { .. })
    );
    if !kind_ok {
        return Err(mismatch(
            "kind",
            format!(
                "{} NIXL region for a part located on {:?}",
                region.kind,
                part.location()
            ),
        ));
    }
    if region.len < part.region_bytes() {
        return Err(mismatch(
            "len",
            format!(
                "{} bytes registered, rank {rank}'s region holds {}",
                region.len,
                part.region_bytes()
            ),
        ));
    }
    Ok(())
}

/// A short, log-friendly name of an export handle (shm name, or the kind
/// and first 8 handle bytes in hex).
fn describe(h: &ExportHandle) -> String {
    let hex = |b: &[u8]| {
        b.iter()
            .take(8)
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    match h {
        ExportHandle::HostShm { name } => format!("host shm `{name}`"),
        ExportHandle::CudaIpc { handle } => format!("CUDA IPC handle {}..", hex(handle)),
        ExportHandle::CudaFabric { handle } => format!("CUDA fabric handle {}..", hex(handle)),
        ExportHandle::NixlAgent { agent_name, .. } => format!("NIXL agent `{agent_name}`"),
    }
}

/// A pin held by a remote donor; released on [`DonorPin::release`] or drop.
#[derive(Debug)]
pub struct RemotePin<'a> {
    donor: &'a RemoteDonor,
    stream: Option<PinStream>,
    grant: PinGrant,
    granted_at: Instant,
}

impl RemotePin<'_> {
    /// The donor's grant (pin id, hold bound).
    pub fn grant(&self) -> &PinGrant {
        &self.grant
    }

    /// Releases the pin and waits for the donor's acknowledgement.
    ///
    /// # Errors
    /// [`PinError::Expired`] when the donor reports the pin dropped at its
    /// hold bound before this release (the slots may have been reused while
    /// read); [`PinError::Io`] (`release`), [`PinError::Timeout`] or
    /// [`PinError::Protocol`] when the release is unconfirmed (the donor
    /// may have dropped the pin at any point); [`PinError::AlreadyReleased`].
    /// The pin is gone either way.
    pub fn release_now(&mut self) -> Result<Duration, PinError> {
        let Some(mut stream) = self.stream.take() else {
            return Err(PinError::AlreadyReleased);
        };
        let pin_id = self.grant.pin_id;
        let timeout = self.donor.timeout;
        let frame =
            encode_pin_frame(&PinClientMessage::Release(PinRelease { pin_id })).map_err(|e| {
                PinError::Protocol {
                    detail: format!("encoding the release of pin {pin_id}: {e}"),
                }
            })?;
        std::io::Write::write_all(&mut stream, &frame)
            .map_err(|e| PinError::io("release", e, timeout))?;
        match read_donor_message(&mut stream, timeout) {
            // The donor answered this release: the connection holds nothing
            // of this pin and is in step, so the next pin may use it.
            Ok(PinDonorMessage::Released(r)) if r.pin_id == pin_id && !r.expired => {
                self.donor.keep(stream);
                Ok(self.granted_at.elapsed())
            }
            Ok(PinDonorMessage::Released(r)) if r.pin_id == pin_id => {
                self.donor.keep(stream);
                Err(PinError::Expired {
                    pin_id,
                    max_hold_ms: self.grant.max_hold_ms,
                })
            }
            Ok(other) => Err(PinError::Protocol {
                detail: format!("unexpected reply to release {pin_id}: {other:?}"),
            }),
            // A receive failure here is a release the donor never confirmed.
            Err(PinError::Io { source, .. }) => Err(PinError::Io {
                op: "release",
                source,
            }),
            Err(PinError::Timeout { timeout_ms, .. }) => Err(PinError::Timeout {
                op: "release",
                timeout_ms,
            }),
            Err(e) => Err(e),
        }
    }
}

impl DonorPin for RemotePin<'_> {
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory> {
        match &self.donor.source {
            RankSources::Mapped(maps) => maps.get(rank as usize).map(|m| m.as_ref()),
            RankSources::Nixl(_) => None,
        }
    }
    fn rank_source(&self, rank: u32) -> Option<SourceRegion<'_>> {
        match &self.donor.source {
            RankSources::Mapped(maps) => maps
                .get(rank as usize)
                .map(|m| SourceRegion::Mapped(m.as_ref())),
            RankSources::Nixl(regions) => regions.get(rank as usize).map(SourceRegion::Nixl),
        }
    }
    fn release(mut self: Box<Self>) -> Result<(), PinError> {
        self.release_now().map(drop)
    }
    fn block_checksums(&self) -> Option<&[u64]> {
        match &self.donor.source {
            RankSources::Nixl(_) => Some(&self.grant.block_checksums),
            RankSources::Mapped(_) => None,
        }
    }
}

impl Drop for RemotePin<'_> {
    fn drop(&mut self) {
        if self.stream.is_some() {
            // Closing the connection releases too; the explicit release
            // makes the donor's pin count drop before this returns.
            let _ = self.release_now();
        }
    }
}
