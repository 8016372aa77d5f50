//! Owner leases: proof, readable by other processes, that a bank's owner is
//! alive and still stands behind one exact incarnation and generation.
//!
//! Every rank of every bank has one lease file in the host's shared-memory
//! directory ([`SHM_DIR`]). A host shm bank's lease lives next to its
//! segment, `/<segment>.lease`; a device or NIXL bank's lease is named from
//! its owner, `/kvbank-<kind>-<engine id>-g<generation>-r<rank>.lease`
//! ([`lease_name_for`]), so an importer holding only a descriptor finds it.
//!
//! # File format (256 bytes, little endian)
//! | offset | field | mutability |
//! | --- | --- | --- |
//! | 0 | magic `KVLEASE2` (stored last, release) | set once |
//! | 8 | `expires_at_us`: lease-clock µs; 0 = revoked | atomic, compare-and-swap |
//! | 16 | `renewed_at_us`: lease-clock µs of the last renewal | atomic |
//! | 24 | `renewals`: count | atomic |
//! | 32 | engine id (16 bytes UUID) | immutable |
//! | 48 | generation `u64` | immutable |
//! | 56 | owner pid `u32`, 60: TP rank `u32` | immutable |
//! | 64 | role `u8` (0 prefill, 1 decode), 65..72 zero | immutable |
//! | 72 | lease duration µs, 80: created at (lease-clock µs) | immutable |
//! | 88 | XXH3-64 (seed 1337) of bytes 32..88 | immutable |
//!
//! # Rules
//! - **A lapsed lease is never renewed.** The owner renews with a
//!   compare-and-swap from the expiry it last saw, and only while that expiry
//!   is still in the future; a reclaimer first swaps an expired value to 0
//!   (revoked) and only then unlinks. Whichever swap wins decides, so a bank
//!   is never both renewed and reclaimed.
//! - Times are microseconds of the lease clock, `CLOCK_BOOTTIME`
//!   ([`crate::LeaseInstant`]): all processes of a host read the same value
//!   and nothing steps it, so a wall-clock step (NTP, operator, VM resume)
//!   neither lapses a live bank nor keeps a dead one alive. Format 1
//!   (`KVLEASE1`) held wall-clock Unix µs; its magic no longer matches, so a
//!   reader of either format refuses the other's leases as invalid instead
//!   of comparing times of different clocks.
//! - The owner pid is advisory (reports, leak accounting); only the expiry
//!   decides, so pid reuse or another pid namespace cannot keep a bank alive.
//!
//! All unsafe code of the lease path (the atomics inside the shared mapping)
//! lives in the private `LeaseMap` type.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use kv_descriptor::{BankDescriptor, EngineId, ExportHandle, OwnerLease, Role};
use memmap2::{MmapOptions, MmapRaw};

use crate::leaks;
use crate::lease_clock::LeaseInstant;
use crate::{BankError, CreatorProcess};

mod record;
pub use record::LeaseRecord;

/// Directory where POSIX shared-memory objects appear on Linux (`shm_open`
/// names map to files here); leases are files in it as well.
pub const SHM_DIR: &str = "/dev/shm";

/// Suffix of lease file names.
pub const LEASE_SUFFIX: &str = ".lease";

/// Size of a lease file in bytes (see the module docs for the layout).
pub const LEASE_FILE_BYTES: usize = 256;

/// Format 2: times on the lease clock (format 1, `KVLEASE1`, used Unix µs).
const MAGIC: u64 = u64::from_le_bytes(*b"KVLEASE2");
const OFF_EXPIRES: usize = 8;
const OFF_RENEWED: usize = 16;
const OFF_RENEWALS: usize = 24;
const IMMUTABLE: std::ops::Range<usize> = 32..88;
const OFF_CHECKSUM: usize = 88;

/// How a bank's owner keeps its lease alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRenewal {
    /// A background thread of the bank manager renews every `interval`.
    Background {
        /// Time between renewals; at most half the lease duration.
        interval: Duration,
    },
    /// The engine calls [`crate::BankManager::renew_lease`] itself, more
    /// often than the lease duration.
    Manual,
}

/// Lease settings of a bank.
///
/// A dead owner's bank becomes reclaimable at most `duration` after its last
/// renewal; a live owner must renew within `duration` or lose the bank.
///
/// ```
/// use std::time::Duration;
/// use kv_bank::{LeaseConfig, LeaseRenewal};
/// let c = LeaseConfig::default();
/// assert_eq!(c.duration, Duration::from_secs(15));
/// assert_eq!(c.renewal, LeaseRenewal::Background { interval: Duration::from_secs(3) });
/// assert!(LeaseConfig::background(Duration::from_millis(100), Duration::from_millis(80)).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long one renewal keeps the lease live (1 ms ..= 1 day).
    pub duration: Duration,
    /// Who renews, and how often.
    pub renewal: LeaseRenewal,
}

impl Default for LeaseConfig {
    /// 15 s leases renewed every 3 s by a background thread: an owner survives
    /// a 12 s stall, and a dead owner's bank is reclaimable within 15 s.
    fn default() -> Self {
        Self::background(Duration::from_secs(15), Duration::from_secs(3))
    }
}

impl LeaseConfig {
    /// Leases of `duration`, renewed every `interval` by a background thread.
    pub fn background(duration: Duration, interval: Duration) -> Self {
        Self {
            duration,
            renewal: LeaseRenewal::Background { interval },
        }
    }
    /// Leases of `duration`, renewed by the engine ([`crate::BankManager::renew_lease`]).
    pub fn manual(duration: Duration) -> Self {
        Self {
            duration,
            renewal: LeaseRenewal::Manual,
        }
    }
    /// Checks the values.
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] naming `lease.duration` (outside 1 ms ..= 1 day)
    /// or `lease.interval` (zero, or above half the duration).
    pub fn validate(&self) -> Result<(), BankError> {
        if self.duration < Duration::from_millis(1) || self.duration > Duration::from_secs(86_400) {
            return Err(BankError::arg(
                "lease.duration",
                format!("must be 1 ms ..= 1 day, got {:?}", self.duration),
            ));
        }
        if let LeaseRenewal::Background { interval } = self.renewal {
            if interval.is_zero() || interval > self.duration / 2 {
                return Err(BankError::arg(
                    "lease.interval",
                    format!(
                        "must be above 0 and at most half the duration {:?}, got {interval:?}",
                        self.duration
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The lease name that covers `d` (see the module docs).
///
/// ```
/// use kv_descriptor::*;
/// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// let d = BankDescriptor::new(BankParts {
///     layout, tp_rank: 0,
///     location: MemoryLocation::Host { host_id: "h".into() },
///     owner: OwnerLease::fresh(Role::Decode),
///     export: ExportHandle::HostShm { name: "/kvbank-1-0-abcd".into() },
///     slot_count: 4, slot_bytes: layout.rank_block_bytes() as u64,
/// }).unwrap();
/// assert_eq!(kv_bank::lease_name_for(&d), "/kvbank-1-0-abcd.lease");
/// ```
pub fn lease_name_for(d: &BankDescriptor) -> String {
    let kind = match d.export() {
        ExportHandle::HostShm { name } => return format!("{name}{LEASE_SUFFIX}"),
        ExportHandle::CudaIpc { .. } => "cuda",
        ExportHandle::CudaFabric { .. } => "fabric",
        ExportHandle::NixlAgent { .. } => "nixl",
    };
    format!(
        "/kvbank-{kind}-{}-g{}-r{}{LEASE_SUFFIX}",
        d.owner().engine_id.0.simple(),
        d.owner().generation,
        d.tp_rank()
    )
}

/// Importer-side check: the lease of `d` exists, names `d`'s engine id,
/// generation, role and rank, and is live at `now` (normally
/// [`LeaseInstant::now`]). Run before mapping.
///
/// # Errors
/// [`BankError::LeaseMissing`] (never created, closed or reclaimed),
/// [`BankError::LeaseInvalid`], [`BankError::LeaseMismatch`],
/// [`BankError::LeaseRevoked`], [`BankError::LeaseExpired`].
pub fn check_descriptor_lease(
    d: &BankDescriptor,
    now: LeaseInstant,
) -> Result<LeaseRecord, BankError> {
    let rec = read_lease(&lease_name_for(d))?;
    rec.check(d.owner(), d.tp_rank(), now)?;
    Ok(rec)
}

/// Reads the lease `name` (`/...lease`).
///
/// # Errors
/// [`BankError::LeaseMissing`] when no such file exists;
/// [`BankError::LeaseInvalid`] for a short file, missing magic (not fully
/// written) or a bad checksum.
pub fn read_lease(name: &str) -> Result<LeaseRecord, BankError> {
    LeaseMap::open(name)?.record()
}

pub(crate) fn shm_path(name: &str) -> String {
    format!("{SHM_DIR}{name}")
}

fn check_lease_name(name: &str) -> Result<(), BankError> {
    if !name.starts_with('/')
        || name.len() > 255
        || name[1..].contains('/')
        || !name.ends_with(LEASE_SUFFIX)
    {
        return Err(BankError::arg(
            "lease.name",
            format!(
                "must be `/...{LEASE_SUFFIX}`, at most 255 bytes without inner `/`, got {name:?}"
            ),
        ));
    }
    Ok(())
}

/// A lease file mapped read-write in this process.
#[derive(Debug)]
pub(crate) struct LeaseMap {
    name: String,
    map: MmapRaw,
    ino: u64,
}

impl LeaseMap {
    /// Opens an existing lease file.
    pub(crate) fn open(name: &str) -> Result<Self, BankError> {
        check_lease_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(shm_path(name))
            .map_err(|source| {
                if source.kind() == std::io::ErrorKind::NotFound {
                    BankError::LeaseMissing {
                        lease: name.to_string(),
                    }
                } else {
                    BankError::HostMemory {
                        name: name.to_string(),
                        op: "open(lease)",
                        source,
                    }
                }
            })?;
        Self::map_file(name, &file)
    }

    fn map_file(name: &str, file: &File) -> Result<Self, BankError> {
        let meta = file.metadata().map_err(|source| BankError::HostMemory {
            name: name.to_string(),
            op: "fstat(lease)",
            source,
        })?;
        if meta.len() < LEASE_FILE_BYTES as u64 {
            return Err(BankError::LeaseInvalid {
                lease: name.to_string(),
                reason: format!("{} bytes, a lease has {LEASE_FILE_BYTES}", meta.len()),
            });
        }
        let map = MmapOptions::new()
            .len(LEASE_FILE_BYTES)
            .map_raw(file)
            .map_err(|source| BankError::HostMemory {
                name: name.to_string(),
                op: "mmap(lease)",
                source,
            })?;
        Ok(Self {
            name: name.to_string(),
            map,
            ino: meta.ino(),
        })
    }

    fn atomic(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= LEASE_FILE_BYTES);
        // SAFETY: the mapping is page-aligned and LEASE_FILE_BYTES long, and
        // `offset` is a multiple of 8 inside it, so the pointer is valid and
        // aligned for an AtomicU64 for as long as `self` (the mapping) lives.
        // Every process touches these words only through atomics (lock-free
        // on every 64-bit target we build for), so cross-process access is
        // race-free.
        unsafe { &*(self.map.as_mut_ptr().add(offset) as *const AtomicU64) }
    }

    fn magic(&self) -> &AtomicU64 {
        self.atomic(0)
    }
    pub(crate) fn expiry(&self) -> &AtomicU64 {
        self.atomic(OFF_EXPIRES)
    }

    fn immutable_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        // SAFETY: bytes 32..96 lie inside the mapping; they are written once,
        // before the magic is published with release ordering, and callers
        // read them only after an acquire load of the magic.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(32), b.as_mut_ptr(), 64);
        }
        b
    }

    /// Decodes the record; the immutable part only after the magic is seen.
    pub(crate) fn record(&self) -> Result<LeaseRecord, BankError> {
        let invalid = |reason: String| BankError::LeaseInvalid {
            lease: self.name.clone(),
            reason,
        };
        let magic = self.magic().load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(invalid(format!(
                "magic {magic:#018x}: not a lease, or not fully written"
            )));
        }
        let b = self.immutable_bytes();
        let at = |o: usize| u64::from_le_bytes(b[o - 32..o - 24].try_into().expect("8 bytes"));
        let stored = at(OFF_CHECKSUM);
        let computed =
            xxhash_rust::xxh3::xxh3_64_with_seed(&b[..IMMUTABLE.len()], kv_descriptor::XXH3_SEED);
        if stored != computed {
            return Err(invalid(format!(
                "checksum {stored:#018x}, content hashes to {computed:#018x}"
            )));
        }
        let role = match b[64 - 32] {
            0 => Role::Prefill,
            1 => Role::Decode,
            r => return Err(invalid(format!("role byte {r}"))),
        };
        Ok(LeaseRecord {
            name: self.name.clone(),
            engine_id: EngineId(uuid::Uuid::from_bytes(
                b[..16].try_into().expect("16 bytes"),
            )),
            generation: at(48),
            pid: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")),
            tp_rank: u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")),
            role,
            duration_us: at(72),
            created_at_us: at(80),
            expires_at_us: self.expiry().load(Ordering::Acquire),
            renewed_at_us: self.atomic(OFF_RENEWED).load(Ordering::Relaxed),
            renewals: self.atomic(OFF_RENEWALS).load(Ordering::Relaxed),
        })
    }

    /// True while the file at this name is still the one mapped here.
    pub(crate) fn still_linked(&self) -> bool {
        std::fs::metadata(shm_path(&self.name)).is_ok_and(|m| m.ino() == self.ino)
    }

    /// Removes the name if it is still this file.
    pub(crate) fn unlink_if_ours(&self) -> bool {
        self.still_linked() && std::fs::remove_file(shm_path(&self.name)).is_ok()
    }

    /// Reclaimer side: swaps an expired (or revoked) expiry to 0. Returns
    /// false when the owner renewed first (the lease is live again).
    pub(crate) fn revoke_if_lapsed(&self, now: LeaseInstant) -> bool {
        let now_us = now.as_micros();
        let e = self.expiry();
        let mut seen = e.load(Ordering::Acquire);
        loop {
            if seen != 0 && now_us < seen {
                return false;
            }
            if seen == 0 {
                return true;
            }
            match e.compare_exchange(seen, 0, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(v) => seen = v,
            }
        }
    }
}

/// The owner's side of one lease file: creates it, renews it, and revokes
/// and unlinks it when dropped. A copy inherited by a forked child does
/// none of that: the lease is the creating process's, and revoking it from
/// the child would kill the parent's live bank for every importer.
#[derive(Debug)]
pub(crate) struct LeaseHolder {
    map: LeaseMap,
    duration_us: u64,
    creator: CreatorProcess,
    _live: leaks::Live,
}

impl LeaseHolder {
    /// Creates lease `name` (`O_EXCL`, mode 0600) for `owner`'s rank
    /// `tp_rank`, live until `now + duration`.
    pub(crate) fn create(
        name: &str,
        owner: &OwnerLease,
        tp_rank: u32,
        duration: Duration,
        now: LeaseInstant,
    ) -> Result<Self, BankError> {
        check_lease_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(shm_path(name))
            .map_err(|source| BankError::HostMemory {
                name: name.to_string(),
                op: "create(lease)",
                source,
            })?;
        let unlink = || {
            let _ = std::fs::remove_file(shm_path(name));
        };
        if let Err(source) = file.set_len(LEASE_FILE_BYTES as u64) {
            unlink();
            return Err(BankError::HostMemory {
                name: name.to_string(),
                op: "ftruncate(lease)",
                source,
            });
        }
        // The record is written through the mapping below: on a full
        // /dev/shm an unreserved page would kill this process with SIGBUS.
        if let Err(e) = crate::shm::reserve_pages(&file, name, "lease", LEASE_FILE_BYTES as u64) {
            unlink();
            return Err(e.with_free_space());
        }
        let map = match LeaseMap::map_file(name, &file) {
            Ok(m) => m,
            Err(e) => {
                unlink();
                return Err(e);
            }
        };
        let now_us = now.as_micros();
        let duration_us = duration.as_micros() as u64;
        let mut imm = [0u8; 64];
        imm[..16].copy_from_slice(owner.engine_id.0.as_bytes());
        imm[16..24].copy_from_slice(&owner.generation.to_le_bytes());
        imm[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        imm[28..32].copy_from_slice(&tp_rank.to_le_bytes());
        imm[32] = match owner.role {
            Role::Prefill => 0,
            Role::Decode => 1,
        };
        imm[40..48].copy_from_slice(&duration_us.to_le_bytes());
        imm[48..56].copy_from_slice(&now_us.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&imm[..56], kv_descriptor::XXH3_SEED);
        imm[56..64].copy_from_slice(&sum.to_le_bytes());
        // SAFETY: bytes 32..96 lie inside the fresh mapping of a file this call
        // created exclusively; nobody reads them before the magic below is
        // published with release ordering.
        unsafe {
            std::ptr::copy_nonoverlapping(imm.as_ptr(), map.map.as_mut_ptr().add(32), 64);
        }
        map.expiry().store(now_us + duration_us, Ordering::Relaxed);
        map.atomic(OFF_RENEWED).store(now_us, Ordering::Relaxed);
        map.magic().store(MAGIC, Ordering::Release);
        Ok(Self {
            map,
            duration_us,
            creator: CreatorProcess::current(),
            _live: leaks::Live::new(&leaks::LEASE_HOLDERS),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.map.name
    }

    /// Removes the lease's name (if it is still this file) without revoking
    /// it: the mapping stays, so the holder still renews into it until its
    /// renewal notices the name is gone. Only in the creating process.
    pub(crate) fn unlink_name(&self) -> bool {
        self.creator.is_current() && self.map.unlink_if_ours()
    }

    pub(crate) fn expires_at_us(&self) -> u64 {
        self.map.expiry().load(Ordering::Acquire)
    }

    pub(crate) fn renewals(&self) -> u64 {
        self.map.atomic(OFF_RENEWALS).load(Ordering::Relaxed)
    }

    /// Extends the lease to `now + duration`, only if it has not lapsed,
    /// was not revoked, and the file is still linked under its name.
    pub(crate) fn renew(&self, now: LeaseInstant) -> Result<u64, BankError> {
        if !self.creator.is_current() {
            // A forked child renewing would keep the bank importable after
            // its creator died.
            return Err(BankError::LeaseLost {
                lease: self.map.name.clone(),
                reason: format!(
                    "only its creating process {} renews it, this is process {}",
                    self.creator.pid(),
                    std::process::id()
                ),
            });
        }
        let now_us = now.as_micros();
        let e = self.map.expiry();
        let mut seen = e.load(Ordering::Acquire);
        loop {
            if seen == 0 {
                return Err(BankError::LeaseLost {
                    lease: self.map.name.clone(),
                    reason: "revoked (closed, or reclaimed after it lapsed)".into(),
                });
            }
            if now_us >= seen {
                return Err(BankError::LeaseLost {
                    lease: self.map.name.clone(),
                    reason: format!(
                        "lapsed {} µs ago; a lapsed lease is never renewed",
                        now_us - seen
                    ),
                });
            }
            let next = now_us + self.duration_us;
            match e.compare_exchange(seen, next.max(seen), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(v) => seen = v,
            }
        }
        if !self.map.still_linked() {
            self.revoke(false);
            return Err(BankError::LeaseLost {
                lease: self.map.name.clone(),
                reason: "lease file unlinked by someone else".into(),
            });
        }
        self.map
            .atomic(OFF_RENEWED)
            .store(now_us, Ordering::Relaxed);
        self.map
            .atomic(OFF_RENEWALS)
            .fetch_add(1, Ordering::Relaxed);
        Ok(self.expires_at_us())
    }

    /// Marks the lease dead at once (importers refuse it from now on) and,
    /// with `unlink`, removes its name. Only in the creating process: a
    /// forked child's copy maps the same file, and the lease is not its to
    /// end.
    pub(crate) fn revoke(&self, unlink: bool) {
        if !self.creator.is_current() {
            return;
        }
        self.map.expiry().store(0, Ordering::Release);
        if unlink {
            self.map.unlink_if_ours();
        }
    }
}

impl Drop for LeaseHolder {
    fn drop(&mut self) {
        self.revoke(true);
    }
}

/// The leases of one bank (one per rank) and their renewal state.
#[derive(Debug)]
pub(crate) struct OwnerLeases {
    holders: Vec<LeaseHolder>,
    config: LeaseConfig,
    lost: AtomicBool,
}

impl OwnerLeases {
    /// Creates one lease per descriptor; on error the ones made are removed.
    pub(crate) fn create(
        parts: &[BankDescriptor],
        config: LeaseConfig,
    ) -> Result<Arc<Self>, BankError> {
        config.validate()?;
        let now = LeaseInstant::now();
        let holders = parts
            .iter()
            .map(|d| {
                LeaseHolder::create(
                    &lease_name_for(d),
                    d.owner(),
                    d.tp_rank(),
                    config.duration,
                    now,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(Self {
            holders,
            config,
            lost: AtomicBool::new(false),
        }))
    }

    pub(crate) fn config(&self) -> LeaseConfig {
        self.config
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.holders.iter().map(|h| h.name().to_string()).collect()
    }

    /// Earliest expiry over the ranks (lease-clock µs; 0 once revoked).
    pub(crate) fn expires_at_us(&self) -> u64 {
        self.holders
            .iter()
            .map(LeaseHolder::expires_at_us)
            .min()
            .unwrap_or(0)
    }

    pub(crate) fn renewals(&self) -> u64 {
        self.holders
            .iter()
            .map(LeaseHolder::renewals)
            .min()
            .unwrap_or(0)
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Renews every rank's lease; the first failure marks the bank's leases lost.
    pub(crate) fn renew(&self, now: LeaseInstant) -> Result<u64, BankError> {
        if self.is_lost() {
            return Err(BankError::LeaseLost {
                lease: self.names().join(","),
                reason: "lost earlier".into(),
            });
        }
        for h in &self.holders {
            if let Err(e) = h.renew(now) {
                self.lost.store(true, Ordering::Release);
                return Err(e);
            }
        }
        Ok(self.expires_at_us())
    }

    /// Owner-side liveness: not lost, not revoked, not lapsed at `now`.
    pub(crate) fn check_live(&self, now: LeaseInstant) -> Result<(), BankError> {
        let now_us = now.as_micros();
        for h in &self.holders {
            let e = h.expires_at_us();
            if e == 0 {
                self.lost.store(true, Ordering::Release);
                return Err(BankError::LeaseLost {
                    lease: h.name().to_string(),
                    reason: "revoked (closed, or reclaimed after it lapsed)".into(),
                });
            }
            if self.is_lost() {
                return Err(BankError::LeaseLost {
                    lease: h.name().to_string(),
                    reason: "a renewal failed earlier".into(),
                });
            }
            if now_us >= e {
                self.lost.store(true, Ordering::Release);
                return Err(BankError::LeaseExpired {
                    lease: h.name().to_string(),
                    expires_at_us: e,
                    now_us,
                });
            }
        }
        Ok(())
    }

    /// Removes every lease's name, leaving the leases mapped and unrevoked
    /// ([`LeaseHolder::unlink_name`]); returns the names removed.
    pub(crate) fn unlink_names(&self) -> Vec<String> {
        self.holders
            .iter()
            .filter(|h| h.unlink_name())
            .map(|h| h.name().to_string())
            .collect()
    }

    /// Revokes every lease and removes their names (the bank is dead).
    pub(crate) fn revoke_all(&self) {
        self.lost.store(true, Ordering::Release);
        for h in &self.holders {
            h.revoke(true);
        }
    }
}

/// Background renewal of one bank's leases; stops (and joins) when dropped
/// in the process that started it.
#[derive(Debug)]
pub(crate) struct Renewer {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    creator: CreatorProcess,
}

impl Renewer {
    pub(crate) fn start(leases: Arc<OwnerLeases>, interval: Duration) -> Result<Self, BankError> {
        let (stop, stopped) = mpsc::channel::<()>();
        // Counted before the spawn, so a snapshot right after start sees it.
        let live = leaks::Live::new(&leaks::RENEWER_THREADS);
        let thread = std::thread::Builder::new()
            .name("kv-bank-lease".into())
            .spawn(move || {
                let _live = live;
                // Any message or a dropped sender ends the loop.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    if let Err(e) = leases.renew(LeaseInstant::now()) {
                        tracing::warn!("bank lease renewal stopped: {e}");
                        // The generation is dead: ranks renewed before the
                        // failing one must not stay importable until they lapse.
                        leases.revoke_all();
                        return;
                    }
                }
            })
            .map_err(|e| BankError::arg("lease.renewal", format!("cannot start thread: {e}")))?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
            creator: CreatorProcess::current(),
        })
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        if !self.creator.is_current() {
            // A forked child has no renewal thread: joining it would panic
            // (std finds a thread that never finished). The channel is
            // forgotten too, as its state was copied at the fork, possibly
            // mid-operation by the parent's thread.
            if let Some(t) = self.thread.take() {
                let _ = self.creator.join_or_forget(t);
            }
            std::mem::forget(self.stop.take());
            return;
        }
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests;
