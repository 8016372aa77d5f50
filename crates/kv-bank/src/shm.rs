//! Host memory shareable between processes: a POSIX shared-memory object
//! (`shm_open` through rustix, so without unsafe) mapped with `mmap`.
//!
//! The creating process owns the name and unlinks it on drop; importers open
//! the same name and map it. Every unsafe call of this crate's host path lives
//! in this module.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_descriptor::{BankDescriptor, ExportHandle};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::Mode;
use rustix::shm;

use crate::memory::check_range;
use crate::{BankError, BankMemory, MemoryKind};

/// A mapped POSIX shared-memory object (`/dev/shm/<name>` on Linux).
///
/// Created zero-filled by [`HostShmMemory::create`] (the owner, which
/// `shm_unlink`s the name when dropped: importers that already mapped it keep
/// their mapping, later opens fail), or opened by [`HostShmMemory::open`] in
/// another process. Exported as [`ExportHandle::HostShm`].
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
    /// never share a name.
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] for a bad `shm.name` or `len` 0;
    /// [`BankError::HostMemory`] naming the failing call (`shm_open`,
    /// `ftruncate`, `mmap`). On error the object is unlinked again.
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
        match MmapOptions::new().len(len).map_raw(&file) {
            Ok(map) => Ok(Self {
                name: name.to_string(),
                map,
                owner: true,
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

    /// True for the creating process (which unlinks the name on drop).
    pub fn is_owner(&self) -> bool {
        self.owner
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
        if self.owner {
            // The name was created by this value (O_EXCL); a failure here
            // (already unlinked by an operator's cleanup) leaves nothing to do.
            let _ = shm::unlink(self.name.as_str());
        }
    }
}
