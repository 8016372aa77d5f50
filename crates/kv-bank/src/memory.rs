//! Memory behind a bank (or behind a native KV cache): one trait, several kinds.
//!
//! Implementations in this crate: [`crate::HostShmMemory`] (POSIX shared
//! memory, CPU profile) and, with a CUDA driver present,
//! [`crate::CudaDeviceMemory`] (owner) and [`crate::CudaIpcImport`] (importer).

use std::sync::Arc;

use kv_descriptor::{BankDescriptor, ExportHandle};

use crate::BankError;

/// Maps the device bank part `d` on local CUDA device `ordinal` in every
/// build: with the `cuda` feature it is `CudaIpcImport::open_descriptor`
/// (lease checked first, then the process-wide mapping cache); without it
/// (a CPU-only worker) the import is refused as a machine without a driver
/// refuses it, so a caller falls back with no cfg of its own.
///
/// # Errors
/// With `cuda`: as `CudaIpcImport::open_descriptor` (lease errors,
/// [`BankError::Unsupported`] for a host export, CUDA errors). Without it:
/// [`BankError::CudaUnavailable`], before any lease is read.
pub fn open_device_descriptor(
    d: &BankDescriptor,
    ordinal: u32,
) -> Result<Arc<dyn BankMemory>, BankError> {
    #[cfg(feature = "cuda")]
    return crate::CudaIpcImport::open_descriptor(d, ordinal)
        .map(|m| Arc::new(m) as Arc<dyn BankMemory>);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (d, ordinal);
        Err(BankError::CudaUnavailable {
            reason: "kv-bank was built without its `cuda` feature".into(),
        })
    }
}

/// Which address space [`BankMemory::base_addr`] belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host virtual memory of this process.
    Host,
    /// CUDA device memory (`CUdeviceptr`) on the device with this ordinal, in this process.
    Cuda {
        /// CUDA device ordinal in this process.
        ordinal: u32,
    },
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Rows in CUDA device memory of this process that a store copies into a
/// device bank's slots ([`crate::BankManager::write_pending_from_device`]):
/// the engine's own KV blocks, on the bank's GPU or a peer GPU, so no byte
/// of the payload passes through host memory.
///
/// `rows` rows of `row_bytes` bytes each, contiguous from `addr`; row `i`
/// starts at `addr + i x row_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRows {
    /// CUDA ordinal (in this process) of the device holding the rows.
    pub ordinal: u32,
    /// `CUdeviceptr` of the first row, in the device's primary context
    /// (where the CUDA runtime, torch and CuPy allocate).
    pub addr: u64,
    /// Bytes of one row: the bank's slot bytes (one rank's part of one KV block).
    pub row_bytes: usize,
    /// How many rows.
    pub rows: usize,
}

impl DeviceRows {
    /// Device address of row `i` (unchecked against `rows`).
    pub fn row_addr(&self, i: usize) -> u64 {
        self.addr + (i * self.row_bytes) as u64
    }
}

/// A contiguous region of memory mapped into this process.
///
/// Implementations own (or hold a mapping of) `len()` bytes starting at
/// `base_addr()`; the address stays valid for as long as the value lives.
/// Transfers read and write through these addresses, so an implementation
/// must not move or unmap the region while it is alive.
///
/// [`BankMemory::write_bytes`] and [`BankMemory::read_bytes`] are synchronous
/// copies between this region and host buffers (a device memory does a
/// blocking host-to-device / device-to-host copy). They are for filling and
/// checking slots, not for the transfer data path. Their default is
/// [`BankError::Unsupported`], so implementing the trait needs no unsafe code.
///
/// # Aliasing rule for implementations
/// The bytes change behind `&self`: other processes (host shm importers, a
/// donor's engine), copy engines and NIXL / UCX threads write them through
/// the base address, and [`BankMemory::write_bytes`] takes `&self`. An
/// implementation therefore never hands out a `&[u8]` (or any reference)
/// into the region for `&self`: the compiler may assume such bytes do not
/// change while the reference lives, and a read across a concurrent write
/// could return a stale value. Reads and writes are copies of exact,
/// bounds-checked ranges through raw pointers (or device copies). Which
/// party may touch which bytes when is the bank protocol's: a slot is
/// written only while pending and read only once ready and pinned; a
/// destination row is written only by the delivery that reserved it and
/// read after that delivery returned.
///
/// ```
/// use kv_bank::{BankMemory, HostShmMemory, MemoryKind};
/// let m = HostShmMemory::create_unique("kvbank-doc", 4096).unwrap();
/// assert_eq!(m.kind(), MemoryKind::Host);
/// m.write_bytes(100, b"abc").unwrap();
/// let mut back = [0u8; 3];
/// m.read_bytes(100, &mut back).unwrap();
/// assert_eq!(&back, b"abc");
/// assert!(m.write_bytes(4095, b"ab").is_err()); // past the end
/// ```
pub trait BankMemory: Send + Sync + std::fmt::Debug {
    /// Address space of [`BankMemory::base_addr`].
    fn kind(&self) -> MemoryKind;
    /// Length of the region in bytes.
    fn len(&self) -> usize;
    /// True when the region has zero length.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// First byte of the region in this process (host pointer or `CUdeviceptr`).
    fn base_addr(&self) -> u64;
    /// How another process on the same host maps this region, if it can.
    fn export_handle(&self) -> Option<ExportHandle>;

    /// The export handle of the allocation this region maps, when known: a
    /// region's own handle ([`BankMemory::export_handle`], the default) or,
    /// for an import ([`crate::CudaIpcImport`], which is not re-exported),
    /// the handle it was opened from. `None` for process-private memory.
    ///
    /// This is what binds a mapping to the manifest part it claims to be: a
    /// target compares it with the part's `BankDescriptor::export()` before
    /// reading, so a mapping of rank 1 handed in as rank 0 is refused.
    ///
    /// ```
    /// use kv_bank::{BankMemory, HostShmMemory};
    /// let owner = HostShmMemory::create_unique("kvbank-doc-id", 4096).unwrap();
    /// let again = HostShmMemory::open(owner.name(), 4096).unwrap();
    /// assert_eq!(again.mapped_export(), owner.export_handle());
    /// ```
    fn mapped_export(&self) -> Option<ExportHandle> {
        self.export_handle()
    }

    /// True when only work on this region's own device (the ordinal of
    /// [`MemoryKind::Cuda`]) may read it: a CUDA IPC or fabric import, mapped
    /// in that one device's context. Copy backends must then run on that
    /// device, so an import is opened on the device that will read it (the
    /// destination GPU), not on the donor's. Measured on an H200 pair: a gather
    /// kernel on GPU1 reading an IPC import opened on GPU0 failed with
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (which poisons the context), and a plain
    /// copy ran at 38 GB/s against 377 GB/s peer-to-peer.
    ///
    /// ```
    /// use kv_bank::{BankMemory, HostShmMemory};
    /// let m = HostShmMemory::create_unique("kvbank-doc-local", 4096).unwrap();
    /// assert!(!m.device_local_mapping());
    /// ```
    fn device_local_mapping(&self) -> bool {
        false
    }

    /// The shared-memory name this value created and removes when dropped
    /// (`/...`): `Some` only for the creating owner in its creating process
    /// ([`crate::HostShmMemory`]'s owner), `None` for an import, a forked
    /// child's copy and memory without a name (the default).
    /// [`crate::BankManager::unlink_names`] removes exactly these names.
    ///
    /// ```
    /// use kv_bank::{BankMemory, HostShmMemory};
    /// let owner = HostShmMemory::create_unique("kvbank-doc-owned", 4096).unwrap();
    /// assert_eq!(owner.owned_shm_name(), Some(owner.name().to_string()));
    /// let import = HostShmMemory::open(owner.name(), 4096).unwrap();
    /// assert_eq!(import.owned_shm_name(), None);
    /// ```
    fn owned_shm_name(&self) -> Option<String> {
        None
    }

    /// Copies `src` into the region at byte `offset`.
    ///
    /// # Errors
    /// [`BankError::OutOfRange`] if `offset + src.len()` exceeds `len()`;
    /// [`BankError::Unsupported`] for memory without host copy support;
    /// [`BankError::Cuda`] when a device copy fails.
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        let _ = (offset, src);
        Err(BankError::Unsupported {
            op: "write_bytes",
            kind: self.kind().to_string(),
        })
    }

    /// Copies `len` bytes from device memory into the region, once per
    /// `(offset, src_addr)` of `copies`: region bytes `offset..offset+len`
    /// from `src_addr..src_addr+len` on device `src_ordinal` (this region's
    /// own device, or a peer). Synchronous: every byte landed when it
    /// returns, so a store acked after it never seals a half-copied slot.
    ///
    /// # Errors
    /// [`BankError::Unsupported`] for memory that is not CUDA device memory
    /// owned by this process (the default); [`BankError::OutOfRange`] for a
    /// destination range past `len()`; [`BankError::InvalidArgument`] naming
    /// `source` when a source range is not inside one device allocation of
    /// device `src_ordinal`; [`BankError::Cuda`] when a copy fails.
    fn copy_from_device(
        &self,
        copies: &[(usize, u64)],
        len: usize,
        src_ordinal: u32,
    ) -> Result<(), BankError> {
        let _ = (copies, len, src_ordinal);
        Err(BankError::Unsupported {
            op: "copy_from_device",
            kind: self.kind().to_string(),
        })
    }

    /// Copies `dst.len()` bytes of the region at byte `offset` into `dst`.
    ///
    /// # Errors
    /// As [`BankMemory::write_bytes`].
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        let _ = (offset, dst);
        Err(BankError::Unsupported {
            op: "read_bytes",
            kind: self.kind().to_string(),
        })
    }

    /// Copies `len` bytes of the region at byte `offset` into a new vector
    /// ([`BankMemory::read_bytes`] into a zeroed buffer of `len` bytes).
    ///
    /// ```
    /// use kv_bank::{BankMemory, HostShmMemory};
    /// let m = HostShmMemory::create_unique("kvbank-doc-vec", 4096).unwrap();
    /// m.write_bytes(10, &[1, 2, 3]).unwrap();
    /// assert_eq!(m.read_vec(9, 5).unwrap(), [0, 1, 2, 3, 0]);
    /// assert!(m.read_vec(4095, 2).is_err());
    /// ```
    ///
    /// # Errors
    /// As [`BankMemory::read_bytes`]; the range is checked before anything
    /// is allocated, so a huge `len` is refused, not allocated.
    fn read_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, BankError> {
        check_range("offset", offset, len, self.len())?;
        let mut v = vec![0u8; len];
        self.read_bytes(offset, &mut v)?;
        Ok(v)
    }
}

/// Checks that `[offset, offset + len)` lies inside a region of `region_len` bytes.
pub(crate) fn check_range(
    field: &'static str,
    offset: usize,
    len: usize,
    region_len: usize,
) -> Result<(), BankError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(BankError::OutOfRange {
            field,
            offset: offset as u64,
            len: len as u64,
            region_len: region_len as u64,
        }),
    }
}
