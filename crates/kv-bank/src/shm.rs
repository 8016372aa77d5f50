//! Host memory shareable between processes: a POSIX shared-memory object
//! (`shm_open` through rustix, so without unsafe) mapped with `mmap`.
//!
//! The creating process owns the name and unlinks it on drop; importers open
//! the same name and map it. A child forked from the creator inherits the
//! value but not the name: its drop only unmaps. Every unsafe call of this
//! crate's host path lives in this module.
//!
//! A segment's pages are reserved when it is created (`fallocate`): tmpfs
//! otherwise allocates them on first touch, so a segment larger than the
//! free space of `/dev/shm` would be created without error and the first
//! write past the free space would kill the process with `SIGBUS`.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_descriptor::{BankDescriptor, ExportHandle};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::Mode;
use rustix::shm;

use crate::memory::check_range;
use crate::{BankError, BankMemory, CreatorProcess, MemoryKind};

/// A mapped POSIX shared-memory object (`/dev/shm/<name>` on Linux).
///
/// Created zero-filled, its pages reserved, by [`HostShmMemory::create`]
/// (the owner, which `shm_unlink`s the name when dropped: importers that
/// already mapped it keep their mapping, later opens fail), or opened by
/// [`HostShmMemory::open`] in another process. Exported as
/// [`ExportHandle::HostShm`]. A copy inherited by a forked child is not the
/// owner there ([`HostShmMemory::is_owner`] is false): dropping it only
/// unmaps, the creator's name stays.
///
/// ```
/// use kv_bank::{BankMemory, HostShmMemory};
/// let owner = HostShmMemory::create_unique("kvbank-doc", 1 << 16).unwrap();
/// let name = owner.name().to_string();
/// owner.write_bytes(0, &[7; 16]).unwrap();
/// let other = HostShmMemory::open(&name, 1 << 16).unwrap(); // normally another process
/// let mut b = [0u8; 16];
/// other.read_bytes(0, &mut b).unwrap();
/// assert_eq!(b, [7; 16]);
/// drop(other);
/// drop(owner);
/// assert!(HostShmMemory::open(&name, 1 << 16).is_err()); // unlinked
/// ```
#[derive(Debug)]
pub struct HostShmMemory {
    name: String,
    map: MmapRaw,
    owner: bool,
    /// The process that created or opened this value: only a creating
    /// owner unlinks the name, and only in that process.
    creator: CreatorProcess,
    _live: crate::leaks::Live,
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

fn check_name(name: &str) -> Result<std::ffi::CString, BankError> {
    if !name.starts_with('/') || name.len() < 2 || name.len() > 255 || name[1..].contains('/') {
        return Err(BankError::arg(
            "shm.name",
            format!("must be `/` followed by 1..=254 bytes without `/`, got {name:?}"),
        ));
    }
    std::ffi::CString::new(name)
        .map_err(|_| BankError::arg("shm.name", format!("contains a NUL byte: {name:?}")))
}

fn io_err(name: &str, op: &'static str, e: rustix::io::Errno) -> BankError {
    BankError::HostMemory {
        name: name.to_string(),
        op,
        source: e.into(),
    }
}

impl HostShmMemory {
    /// Creates a new shared-memory object `name` of `len` bytes (zero-filled)
    /// and maps it read-write. Fails if the name exists (`O_EXCL`): two owners
    /// never share a name. Every page is reserved before it is mapped
    /// (`fallocate`), so a segment that does not fit in `/dev/shm` is refused
    /// here rather than killing the process with `SIGBUS` at its first write
    /// past the free space.
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] for a bad `shm.name` or `len` 0;
    /// [`BankError::ShmNoSpace`] naming `len` when `/dev/shm` cannot hold
    /// `len` more bytes; [`BankError::HostMemory`] naming the failing call
    /// (`shm_open`, `ftruncate`, `fallocate`, `mmap`). On error the object is
    /// unlinked again: nothing is left behind.
    pub fn create(name: &str, len: usize) -> Result<Self, BankError> {
        let cname = check_name(name)?;
        if len == 0 {
            return Err(BankError::arg("len", "must be at least 1 byte, got 0"));
        }
        // rustix opens with FD_CLOEXEC set; the fd is owned (closed on drop of
        // the `File`, the mapping stays valid after close).
        let fd = shm::open(
            cname.as_c_str(),
            shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io_err(name, "shm_open", e))?;
        let file = File::from(fd);
        let unlink = || {
            // Best effort: the name is ours (O_EXCL above), nobody else unlinks it.
            let _ = shm::unlink(cname.as_c_str());
        };
        if let Err(source) = file.set_len(len as u64) {
            unlink();
            return Err(BankError::HostMemory {
                name: name.to_string(),
                op: "ftruncate",
                source,
            });
        }
        if let Err(e) = reserve_pages(&file, name, "len", len as u64) {
            unlink();
            return Err(e.with_free_space());
        }
        match MmapOptions::new().len(len).map_raw(&file) {
            Ok(map) => Ok(Self {
                name: name.to_string(),
                map,
                owner: true,
                creator: CreatorProcess::current(),
                _live: crate::leaks::Live::new(&crate::leaks::SHM_MAPPINGS),
            }),
            Err(source) => {
                unlink();
                Err(BankError::HostMemory {
                    name: name.to_string(),
                    op: "mmap",
                    source,
                })
            }
        }
    }

    /// [`HostShmMemory::create`] with a fresh name
    /// `/<prefix>-<pid>-<counter>-<random>`, unique on this host.
    ///
    /// # Errors
    /// As [`HostShmMemory::create`]; `shm.name` if `prefix` contains `/` or is too long.
    pub fn create_unique(prefix: &str, len: usize) -> Result<Self, BankError> {
        let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
        let rnd = uuid::Uuid::new_v4().as_u128() as u32;
        Self::create(
            &format!("/{prefix}-{}-{n}-{rnd:08x}", std::process::id()),
            len,
        )
    }

    /// Opens and maps an existing object created by another process. `len`
    /// is the length the importer expects (from the bank descriptor); the
    /// object must be at least that large.
    ///
    /// If the object has a lease next to it (`<name>.lease`, every bank
    /// segment does), the lease must be live: a bank whose owner died or
    /// stalled is refused even before it is reclaimed. Only liveness can be
    /// checked from a name; [`HostShmMemory::open_descriptor`] also checks
    /// the owner. Objects without a lease (plain regions, not banks) open as
    /// before.
    ///
    /// # Errors
    /// [`BankError::HostMemory`] (`shm_open` fails when the name does not exist,
    /// e.g. the owner already dropped it); [`BankError::OutOfRange`] when the
    /// object is smaller than `len`; [`BankError::LeaseExpired`],
    /// [`BankError::LeaseRevoked`] or [`BankError::LeaseInvalid`] for a bank
    /// segment whose lease is not live.
    pub fn open(name: &str, len: usize) -> Result<Self, BankError> {
        let cname = check_name(name)?;
        if len == 0 {
            return Err(BankError::arg("len", "must be at least 1 byte, got 0"));
        }
        match crate::lease::read_lease(&format!("{name}{}", crate::lease::LEASE_SUFFIX)) {
            Ok(rec) => rec.check_live(crate::LeaseInstant::now())?,
            Err(BankError::LeaseMissing { .. }) => {}
            // A name too long to carry a lease suffix cannot have a lease.
            Err(BankError::InvalidArgument { .. }) => {}
            Err(e) => return Err(e),
        }
        // Opening without CREATE never creates anything; FD_CLOEXEC is set.
        let fd = shm::open(cname.as_c_str(), shm::OFlags::RDWR, Mode::empty())
            .map_err(|e| io_err(name, "shm_open", e))?;
        let file = File::from(fd);
        let size = file
            .metadata()
            .map_err(|source| BankError::HostMemory {
                name: name.to_string(),
                op: "fstat",
                source,
            })?
            .len();
        check_range("len", 0, len, size as usize)?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|source| BankError::HostMemory {
                name: name.to_string(),
                op: "mmap",
                source,
            })?;
        Ok(Self {
            name: name.to_string(),
            map,
            owner: false,
            creator: CreatorProcess::current(),
            _live: crate::leaks::Live::new(&crate::leaks::SHM_MAPPINGS),
        })
    }

    /// Opens the host bank part described by `d`, after checking its owner
    /// lease ([`crate::check_descriptor_lease`]): the lease must exist, name
    /// `d`'s engine id, generation, role and rank, and be live. Maps
    /// `d.region_bytes()` bytes.
    ///
    /// The lease is checked before mapping; if it lapses afterwards the
    /// mapping stays valid memory (pins on the owner side protect content).
    ///
    /// # Errors
    /// [`BankError::Unsupported`] for a descriptor that is not host shm;
    /// the lease errors ([`BankError::LeaseMissing`], [`BankError::LeaseExpired`],
    /// [`BankError::LeaseRevoked`], [`BankError::LeaseMismatch`],
    /// [`BankError::LeaseInvalid`]); then as [`HostShmMemory::open`].
    pub fn open_descriptor(d: &BankDescriptor) -> Result<Self, BankError> {
        let ExportHandle::HostShm { name } = d.export() else {
            return Err(BankError::Unsupported {
                op: "host shm import",
                kind: format!("{:?}", d.location()).chars().take(40).collect(),
            });
        };
        crate::lease::check_descriptor_lease(d, crate::LeaseInstant::now())?;
        Self::open(name, d.region_bytes() as usize)
    }

    /// The shared-memory name (`/...`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True for the value that created the object, in the process that
    /// created it (which unlinks the name on drop); false for an importer
    /// and for a copy inherited by a forked child.
    pub fn is_owner(&self) -> bool {
        self.owner && self.creator.is_current()
    }
}

impl BankMemory for HostShmMemory {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn len(&self) -> usize {
        self.map.len()
    }
    fn base_addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        Some(ExportHandle::HostShm {
            name: self.name.clone(),
        })
    }
    fn owned_shm_name(&self) -> Option<String> {
        self.is_owner().then(|| self.name.clone())
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        check_range("offset", offset, src.len(), self.map.len())?;
        // SAFETY: the range was checked to lie inside the live mapping, and `src`
        // is a distinct Rust buffer, so the regions do not overlap. Concurrent
        // writers of the same bytes (other processes) are excluded by the bank's
        // slot protocol (a slot is written only while it is pending).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                src.len(),
            )
        };
        Ok(())
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        check_range("offset", offset, dst.len(), self.map.len())?;
        // SAFETY: range checked inside the mapping; `dst` is a distinct buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }
}

impl Drop for HostShmMemory {
    fn drop(&mut self) {
        // Only the creating process: a forked child's copy (a helper that
        // exits runs every destructor) must not unlink the parent's live
        // segment. Either way the mapping is unmapped when `map` drops.
        if self.is_owner() {
            // The name was created by this value (O_EXCL); a failure here
            // (already unlinked by an operator's cleanup) leaves nothing to do.
            let _ = shm::unlink(self.name.as_str());
        }
    }
}

/// Removes the shared-memory name `name` (`/...`); true when it existed.
/// The mappings of the object stay valid (the kernel frees its pages once
/// the last one is unmapped). Used by [`crate::BankManager::unlink_names`]
/// for names this process created; the owner's later drop finds the name
/// gone and ignores that.
pub(crate) fn unlink_name(name: &str) -> bool {
    shm::unlink(name).is_ok()
}

/// Reserves the pages of `len` bytes of `file`, a fresh object in the
/// shared-memory filesystem, so that writing them can never fail later.
///
/// tmpfs allocates a shared mapping's pages on first touch; when the
/// filesystem is full then, the kernel can only deliver `SIGBUS`, which
/// kills the process (no error reaches the caller). `fallocate` allocates
/// them now, or fails with `ENOSPC` (at once when `len` exceeds the
/// filesystem's size, after undoing what it allocated otherwise).
///
/// # Errors
/// [`BankError::ShmNoSpace`] naming `field` on `ENOSPC` (its `free_bytes`
/// still unknown: the caller fills it in once it removed the object, see
/// [`BankError::with_free_space`]); [`BankError::HostMemory`] naming
/// `fallocate` for any other failure. A filesystem without `fallocate`
/// (`EOPNOTSUPP`: `/dev/shm` is not a tmpfs) is not an error: the pages stay
/// unreserved, as before this check existed.
///
/// A tmpfs mounted without a size limit (it reports 0 blocks) is not
/// reserved either: it never refuses a page for space, so no `SIGBUS` comes
/// from it, and reserving there would only take the memory early (an absurd
/// size would wake the OOM killer instead of failing).
pub(crate) fn reserve_pages(
    file: &File,
    name: &str,
    field: &'static str,
    len: u64,
) -> Result<(), BankError> {
    match rustix::fs::fstatvfs(file) {
        Ok(st) if st.f_blocks == 0 => return Ok(()),
        Ok(_) => {}
        Err(e) => return Err(io_err(name, "fstatvfs", e)),
    }
    loop {
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
            Ok(()) => return Ok(()),
            // A large reservation is interruptible (tmpfs checks for
            // pending signals while it allocates) and undone; try again.
            Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::NOSPC) => {
                return Err(BankError::ShmNoSpace {
                    field,
                    bytes: len,
                    free_bytes: None,
                })
            }
            Err(rustix::io::Errno::OPNOTSUPP) => {
                tracing::debug!(
                    name,
                    "the shared-memory filesystem has no fallocate; pages not reserved"
                );
                return Ok(());
            }
            Err(e) => return Err(io_err(name, "fallocate", e)),
        }
    }
}

/// Bytes free for an unprivileged writer in [`crate::SHM_DIR`] now, or
/// `None` when it cannot be read or the filesystem reports no size (a tmpfs
/// mounted without a size limit reports 0 blocks).
pub(crate) fn shm_free_bytes() -> Option<u64> {
    let st = rustix::fs::statvfs(crate::SHM_DIR).ok()?;
    (st.f_blocks > 0).then(|| st.f_bavail.saturating_mul(st.f_frsize))
}
