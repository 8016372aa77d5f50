//! Device allocations owned by this process ([`CudaDeviceMemory`]):
//! `cuMemAlloc` + CUDA IPC handle, or VMM + fabric handle.

use super::*;

/// One device allocation owned by this process, exported by CUDA IPC handle
/// ([`CudaDeviceMemory::new`]) or fabric handle ([`CudaDeviceMemory::new_fabric`]).
///
/// Freed on drop. Importers must have closed their mappings first; a bank
/// guarantees it by freeing only after every pin drained.
#[derive(Debug)]
pub struct CudaDeviceMemory {
    ordinal: u32,
    ptr: u64,
    len: usize,
    handle: [u8; CUDA_HANDLE_BYTES],
    /// `Some` for a fabric (VMM) allocation, `None` for `cuMemAlloc`.
    vmm: Option<VmmRegion>,
    _live: crate::leaks::Live,
}

fn count_device_bytes(len: usize) -> crate::leaks::Live {
    crate::leaks::DEVICE_BYTES.add(len as u64);
    crate::leaks::Live::new(&crate::leaks::DEVICE_ALLOCATIONS)
}

impl CudaDeviceMemory {
    /// Allocates `len` bytes on device `ordinal` and gets its IPC handle.
    ///
    /// # Errors
    /// [`BankError::CudaUnavailable`] without driver or device;
    /// [`BankError::Cuda`] naming `cuMemAlloc` (out of memory) or
    /// `cuIpcGetMemHandle`. If exporting fails the allocation is freed again.
    pub fn new(ordinal: u32, len: usize) -> Result<Self, BankError> {
        if len == 0 {
            return Err(BankError::arg("len", "must be at least 1 byte, got 0"));
        }
        bind(ordinal)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; a context is current.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }
            .result()
            .map_err(cuda_err("cuMemAlloc"))?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `h` is a valid out-pointer; `ptr` is the base of a live allocation.
        let got = unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) }.result();
        if let Err(e) = got {
            // SAFETY: freeing the allocation made above, never exported.
            unsafe { sys::cuMemFree_v2(ptr) };
            return Err(cuda_err("cuIpcGetMemHandle")(e));
        }
        // SAFETY: cuIpcGetMemHandle succeeded, so `h` is initialised.
        let h = unsafe { h.assume_init() };
        Ok(Self {
            ordinal,
            ptr,
            len,
            handle: h.reserved.map(|b| b as u8),
            vmm: None,
            _live: count_device_bytes(len),
        })
    }

    /// Allocates `len` bytes (rounded up to the allocation granularity) on
    /// device `ordinal` with a fabric handle (multi-node NVLink export).
    ///
    /// # Errors
    /// [`BankError::CudaUnavailable`] when the device does not support fabric
    /// handles; [`BankError::Cuda`] naming the failing call (`cuMemCreate`
    /// fails with `CUDA_ERROR_NOT_PERMITTED` when no IMEX channel is set up).
    /// Whatever was created before the failure is released.
    pub fn new_fabric(ordinal: u32, len: usize) -> Result<Self, BankError> {
        if len == 0 {
            return Err(BankError::arg("len", "must be at least 1 byte, got 0"));
        }
        if !cuda_probe(ordinal)?.fabric_supported {
            return Err(BankError::CudaUnavailable {
                reason: format!("device {ordinal} does not support fabric handles"),
            });
        }
        let size = VmmRegion::granular_size(ordinal, len)?;
        let prop = VmmRegion::prop(ordinal);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property struct; context bound by cuda_probe.
        unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }
            .result()
            .map_err(cuda_err("cuMemCreate(fabric)"))?;
        // On error, `map`'s partial region releases `handle` as it drops.
        let region = VmmRegion::map(handle, ordinal, size)?;
        // SAFETY: a plain byte array, all-zero valid.
        let mut fh: sys::CUmemFabricHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `fh` is a 64-byte out-buffer for the fabric handle type; `handle` is live.
        unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fh as *mut sys::CUmemFabricHandle as *mut std::ffi::c_void,
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        }
        .result()
        .map_err(cuda_err("cuMemExportToShareableHandle(fabric)"))?;
        Ok(Self {
            ordinal,
            ptr: region.ptr,
            len,
            handle: fh.data,
            vmm: Some(region),
            _live: count_device_bytes(len),
        })
    }

    /// The 64 export handle bytes (IPC or fabric, see [`CudaDeviceMemory::is_fabric`]).
    pub fn handle_bytes(&self) -> &[u8; CUDA_HANDLE_BYTES] {
        &self.handle
    }

    /// True when exported by fabric handle.
    pub fn is_fabric(&self) -> bool {
        self.vmm.is_some()
    }
}

impl BankMemory for CudaDeviceMemory {
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
    fn export_handle(&self) -> Option<ExportHandle> {
        let handle = self.handle.to_vec();
        Some(if self.is_fabric() {
            ExportHandle::CudaFabric { handle }
        } else {
            ExportHandle::CudaIpc { handle }
        })
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        htod(self.ordinal, self.ptr, self.len, offset, src)
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        dtoh(self.ordinal, self.ptr, self.len, offset, dst)
    }
    fn copy_from_device(
        &self,
        copies: &[(usize, u64)],
        len: usize,
        src_ordinal: u32,
    ) -> Result<(), BankError> {
        dtod_rows(self.ordinal, self.ptr, self.len, copies, len, src_ordinal)
    }
}

impl Drop for CudaDeviceMemory {
    fn drop(&mut self) {
        crate::leaks::DEVICE_BYTES.sub(self.len as u64);
        if self.vmm.is_some() {
            return; // the region's own Drop unmaps and releases it
        }
        if bind(self.ordinal).is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc in this process and is freed once.
            let r = unsafe { sys::cuMemFree_v2(self.ptr) }.result();
            if let Err(e) = r {
                tracing::warn!(ordinal = self.ordinal, "cuMemFree failed: {e:?}");
            }
        }
    }
}
