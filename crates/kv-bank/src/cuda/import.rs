//! Imports of another process's device allocation ([`CudaIpcImport`])
//! through the process-wide mapping cache.

use super::*;

/// Counters of the process-wide IPC mapping cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IpcCacheStats {
    /// `cuIpcOpenMemHandle` calls made (cache misses).
    pub opens: u64,
    /// Imports served from an existing mapping.
    pub hits: u64,
    /// `cuIpcCloseMemHandle` calls made (last import of a mapping dropped).
    pub closes: u64,
    /// Mappings open now.
    pub live: u64,
}

/// One imported mapping, as the cache holds it.
struct Mapping {
    ptr: u64,
    ordinal: u32,
    len: usize,
    /// `Some` for an imported fabric handle, `None` for a CUDA IPC mapping.
    vmm: Option<VmmRegion>,
}

static IPC_CACHE: OnceLock<MappingCache<Mapping>> = OnceLock::new();

fn ipc_cache() -> &'static MappingCache<Mapping> {
    IPC_CACHE.get_or_init(MappingCache::new)
}

/// Counters of this process's IPC mapping cache.
pub fn ipc_cache_stats() -> IpcCacheStats {
    ipc_cache().stats()
}

/// A mapping of another process's device allocation, through the
/// process-wide cache (see the module docs).
#[derive(Debug)]
pub struct CudaIpcImport {
    key: MapKey,
    ordinal: u32,
    ptr: u64,
    len: usize,
    cache_hit: bool,
    open_us: u64,
}

impl CudaIpcImport {
    /// Maps the allocation behind CUDA IPC `handle` (64 bytes) on device
    /// `ordinal`, the device that will read it (the copy's destination GPU:
    /// see [`BankMemory::device_local_mapping`]); `len` is the region length
    /// the importer expects (from the descriptor). A second import of the same handle in this process reuses
    /// the mapping.
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] for a handle that is not 64 bytes, a
    /// `len` of 0, or a `len`/`ordinal` that disagrees with an existing
    /// mapping of the same handle; [`BankError::CudaUnavailable`];
    /// [`BankError::Cuda`] naming `cuIpcOpenMemHandle` (e.g. the owner freed
    /// it, or the handle is from this same process).
    pub fn open(handle: &[u8], ordinal: u32, len: usize) -> Result<Self, BankError> {
        Self::open_kind(false, handle, ordinal, len)
    }

    /// As [`CudaIpcImport::open`] for a fabric handle
    /// (`cuMemImportFromShareableHandle` + map), cached the same way.
    ///
    /// # Errors
    /// As [`CudaIpcImport::open`], naming the failing VMM call.
    pub fn open_fabric(handle: &[u8], ordinal: u32, len: usize) -> Result<Self, BankError> {
        Self::open_kind(true, handle, ordinal, len)
    }

    /// Maps a descriptor's export handle ([`ExportHandle::CudaIpc`] or [`ExportHandle::CudaFabric`]).
    ///
    /// # Errors
    /// [`BankError::Unsupported`] for host or NIXL handles; otherwise as above.
    pub fn open_export(export: &ExportHandle, ordinal: u32, len: usize) -> Result<Self, BankError> {
        match export {
            ExportHandle::CudaIpc { handle } => Self::open(handle, ordinal, len),
            ExportHandle::CudaFabric { handle } => Self::open_fabric(handle, ordinal, len),
            other => Err(BankError::Unsupported {
                op: "CUDA import",
                kind: format!("{other:?}").chars().take(40).collect(),
            }),
        }
    }

    /// Maps the device bank part described by `d` on local device `ordinal`
    /// (the device that will read it: the copy's destination GPU, which may
    /// differ from `d`'s GPU; see [`BankMemory::device_local_mapping`]),
    /// after checking its owner lease
    /// ([`crate::check_descriptor_lease`]): it must exist, name `d`'s engine
    /// id, generation, role and rank, and be live. Checked on every call,
    /// before the mapping cache is consulted, so a cached mapping of a dead
    /// bank is never handed out again.
    ///
    /// # Errors
    /// The lease errors ([`BankError::LeaseMissing`], [`BankError::LeaseExpired`],
    /// [`BankError::LeaseRevoked`], [`BankError::LeaseMismatch`],
    /// [`BankError::LeaseInvalid`]); then as [`CudaIpcImport::open_export`].
    pub fn open_descriptor(
        d: &kv_descriptor::BankDescriptor,
        ordinal: u32,
    ) -> Result<Self, BankError> {
        crate::lease::check_descriptor_lease(d, crate::LeaseInstant::now())?;
        Self::open_export(d.export(), ordinal, d.region_bytes() as usize)
    }

    fn open_kind(fabric: bool, handle: &[u8], ordinal: u32, len: usize) -> Result<Self, BankError> {
        let bytes: [u8; CUDA_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            BankError::arg(
                "handle",
                format!("must be {CUDA_HANDLE_BYTES} bytes, got {}", handle.len()),
            )
        })?;
        if len == 0 {
            return Err(BankError::arg("len", "must be at least 1 byte, got 0"));
        }
        let key = (fabric, bytes);
        let t0 = Instant::now();
        let check = |m: &Mapping| {
            if m.ordinal != ordinal || len > m.len {
                return Err(BankError::arg(
                    "len",
                    format!(
                        "handle already mapped on device {} with {} bytes; asked device {ordinal}, {len} bytes",
                        m.ordinal, m.len
                    ),
                ));
            }
            Ok(m.ptr)
        };
        // Context creation and the open run outside the cache's lock.
        let open = || {
            bind(ordinal)?;
            let (ptr, vmm) = if fabric {
                import_fabric(&bytes, ordinal, len)?
            } else {
                (import_ipc(&bytes)?, None)
            };
            let m = Mapping {
                ptr,
                ordinal,
                len,
                vmm,
            };
            Ok((m, ptr))
        };
        let (ptr, cache_hit) = ipc_cache().acquire(key, check, open)?;
        Ok(Self {
            key,
            ordinal,
            ptr,
            len,
            cache_hit,
            open_us: t0.elapsed().as_micros() as u64,
        })
    }

    /// True when this import reused a mapping already open in this process.
    pub fn cache_hit(&self) -> bool {
        self.cache_hit
    }

    /// Microseconds this import took (the `cuIpcOpenMemHandle` call on a miss).
    pub fn open_us(&self) -> u64 {
        self.open_us
    }
}

fn import_ipc(bytes: &[u8; CUDA_HANDLE_BYTES]) -> Result<u64, BankError> {
    let h = sys::CUipcMemHandle {
        reserved: bytes.map(|b| b as std::ffi::c_char),
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: `ptr` is a valid out-pointer, `h` a handle value; the driver
    // validates the handle and fails cleanly for a stale or foreign one.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .map_err(cuda_err("cuIpcOpenMemHandle"))?;
    Ok(ptr)
}

fn import_fabric(
    bytes: &[u8; CUDA_HANDLE_BYTES],
    ordinal: u32,
    len: usize,
) -> Result<(u64, Option<VmmRegion>), BankError> {
    let size = VmmRegion::granular_size(ordinal, len)?;
    let mut fh = sys::CUmemFabricHandle { data: *bytes };
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `fh` is a 64-byte fabric handle buffer, `handle` a valid out-pointer.
    unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            &mut fh as *mut sys::CUmemFabricHandle as *mut std::ffi::c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
        )
    }
    .result()
    .map_err(cuda_err("cuMemImportFromShareableHandle(fabric)"))?;
    let region = VmmRegion::map(handle, ordinal, size)?;
    Ok((region.ptr, Some(region)))
}

impl BankMemory for CudaIpcImport {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda {
            ordinal: self.ordinal,
        }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn base_addr(&self) -> u64 {
        self.ptr
    }
    /// Imports are not re-exported: consumers reach the owner's allocation directly.
    fn export_handle(&self) -> Option<ExportHandle> {
        None
    }
    /// The IPC or fabric handle this import was opened from (the owner's
    /// allocation on the donor's GPU), so a target can bind the mapping to
    /// its manifest part.
    fn mapped_export(&self) -> Option<ExportHandle> {
        let (fabric, bytes) = self.key;
        let handle = bytes.to_vec();
        Some(if fabric {
            ExportHandle::CudaFabric { handle }
        } else {
            ExportHandle::CudaIpc { handle }
        })
    }
    /// Mapped in `ordinal`'s context only (IPC) or with access for `ordinal`
    /// only (fabric, `cuMemSetAccess`).
    fn device_local_mapping(&self) -> bool {
        true
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        htod(self.ordinal, self.ptr, self.len, offset, src)
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        dtoh(self.ordinal, self.ptr, self.len, offset, dst)
    }
}

impl Drop for CudaIpcImport {
    fn drop(&mut self) {
        // The close runs outside the cache's lock.
        ipc_cache().release(&self.key, |m| {
            if m.vmm.is_some() {
                drop(m); // the region's Drop unmaps and releases the imported handle
            } else if bind(m.ordinal).is_ok() {
                // SAFETY: `m.ptr` came from cuIpcOpenMemHandle, and the cache
                // hands the mapping to this closure only once its last import
                // is gone (and marks the key busy until the close returns).
                let r = unsafe { sys::cuIpcCloseMemHandle(m.ptr) }.result();
                if let Err(e) = r {
                    tracing::warn!(ordinal = m.ordinal, "cuIpcCloseMemHandle failed: {e:?}");
                }
            }
        });
    }
}
