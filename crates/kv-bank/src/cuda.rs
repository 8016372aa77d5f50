//! CUDA device memory through the driver API (cudarc, loaded dynamically).
//!
//! The owner allocates with `cuMemAlloc` and exports a CUDA IPC handle
//! (`cuIpcGetMemHandle`, 64 bytes); an importer in another process on the same
//! host opens it with `cuIpcOpenMemHandle`. Opening costs 0.1-3 ms and grows
//! with the allocation (120 µs for 64 MiB on an H200, `bank_cuda_ipc` in
//! `docs/qualification/h200-x2/record.json`), so imports go through a process-wide
//! mapping cache keyed by the handle bytes (`ipc_cache.rs`): each donor
//! allocation is opened once per importing process and shared, refcounted,
//! by every [`CudaIpcImport`] of it; the last one closes the mapping. No
//! global lock is held across an open, a close or a context creation, so an
//! import of one donor never waits behind a slow import of another.
//!
//! Where the device supports it (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`
//! and an IMEX channel), [`CudaDeviceMemory::new_fabric`] allocates through
//! the virtual memory API (`cuMemCreate` with `CU_MEM_HANDLE_TYPE_FABRIC`)
//! and exports a fabric handle instead, which multi-node NVLink peers can
//! import; [`CudaIpcImport::open_export`] maps either kind.
//!
//! Every call first probes for `libcuda` ([`cuda_probe`]): cudarc panics when
//! the library is missing, this module returns [`BankError::CudaUnavailable`]
//! instead. All operations use the device's primary context, made current on
//! the calling thread. Every CUDA unsafe call of this crate lives here.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::{result, sys};
use kv_descriptor::{ExportHandle, GpuIdentity, MemoryLocation, CUDA_HANDLE_BYTES};
use parking_lot::Mutex;

use crate::ipc_cache::{MapKey, MappingCache};
use crate::memory::check_range;
use crate::{BankError, BankMemory, CreatorProcess, MemoryKind};

mod device;
mod import;

pub use device::CudaDeviceMemory;
pub use import::{ipc_cache_stats, CudaIpcImport, IpcCacheStats};

fn cuda_err(op: &'static str) -> impl Fn(result::DriverError) -> BankError {
    move |e| BankError::Cuda {
        op,
        reason: format!("{e:?}"),
    }
}

/// Facts about one CUDA device, from [`cuda_probe`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CudaDeviceInfo {
    /// Device ordinal in this process.
    pub ordinal: u32,
    /// Driver UUID of the GPU.
    pub uuid: uuid::Uuid,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// Devices visible to this process.
    pub device_count: u32,
    /// True when the device supports `CU_MEM_HANDLE_TYPE_FABRIC` (multi-node NVLink export).
    pub fabric_supported: bool,
}

/// The driver's initialization, once per process image: the process that
/// ran `cuInit`, or why it could not.
static DRIVER: OnceLock<Result<CreatorProcess, String>> = OnceLock::new();

fn driver() -> Result<(), BankError> {
    let init = DRIVER.get_or_init(|| {
        // SAFETY: only tries to dlopen libcuda; no CUDA symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda (the CUDA driver library) is not present on this machine".into());
        }
        result::init()
            .map(|()| CreatorProcess::current())
            .map_err(|e| format!("cuInit failed: {e:?}"))
    });
    usable_here(init)
}

/// `Ok` when the CUDA driver state `init` describes belongs to this
/// process. A child forked after the parent initialized CUDA inherits that
/// state but may not use it (CUDA does not support `fork()` after `cuInit`:
/// a call there can fail, or block on a lock a parent thread held at the
/// fork). So in such a child every entry point of this module, the drops of
/// device memory and imports included (they call CUDA only after `bind`
/// succeeds), gets [`BankError::CudaUnavailable`] saying so, instead of
/// touching the driver: the parent's allocations stay the parent's, as
/// host banks do ([`CreatorProcess`]).
fn usable_here(init: &Result<CreatorProcess, String>) -> Result<(), BankError> {
    match init {
        Ok(creator) => cuda_usable_here(*creator, "CUDA was initialized"),
        Err(reason) => Err(BankError::CudaUnavailable {
            reason: reason.clone(),
        }),
    }
}

/// Initializes the CUDA driver for this process on first use (`cuInit`,
/// recording this process as the one that ran it) and says whether this
/// process may use CUDA. Another crate that makes CUDA objects of its own
/// (kv-transfer's copy backend: streams, events, the gather module) calls
/// it first, so that the one record of who ran `cuInit` refuses its use in
/// a forked child as it refuses kv-bank's.
///
/// ```
/// // On a machine without a GPU this is an error that says why.
/// if let Err(e) = kv_bank::cuda_driver_here() {
///     assert!(e.to_string().starts_with("CUDA unavailable: "));
/// }
/// ```
///
/// # Errors
/// [`BankError::CudaUnavailable`] when `libcuda` is missing, `cuInit`
/// fails, or this process is a child forked after another process (named,
/// with this one) initialized the driver.
pub fn cuda_driver_here() -> Result<(), BankError> {
    driver()
}

/// `Ok` when CUDA state that process `made_by` set up may be used, and
/// destroyed, in this process: only in `made_by` itself. A child forked from
/// it inherits the state (the driver's initialization, and every stream,
/// event, module or allocation made after it) but CUDA does not support
/// using it there: a call can fail, or block on a lock a parent thread held
/// at the fork. So there the caller neither calls CUDA on it nor frees it:
/// it forgets it (the memory is the parent's, which the child cannot free
/// anyway). `what` says what `made_by` did, for the error (`CUDA was
/// initialized`, `this copy backend's device 0 was set up`).
///
/// ```
/// use kv_bank::{cuda_usable_here, CreatorProcess};
/// assert!(cuda_usable_here(CreatorProcess::current(), "CUDA was initialized").is_ok());
/// ```
///
/// # Errors
/// [`BankError::CudaUnavailable`] in any other process, naming `made_by`'s
/// pid and this one's.
pub fn cuda_usable_here(made_by: CreatorProcess, what: &str) -> Result<(), BankError> {
    if made_by.is_current() {
        return Ok(());
    }
    Err(BankError::CudaUnavailable {
        reason: format!(
            "{what} by process {}, and this process ({}) is a child forked from it, where the \
             inherited CUDA state may not be used: use CUDA in a process that did not inherit it \
             (multiprocessing's \"spawn\" start method)",
            made_by.pid(),
            std::process::id()
        ),
    })
}

/// Primary contexts retained by this process, by ordinal. Retained once and
/// never released: a context lives as long as the process (creating one costs
/// ~150-170 ms on an H200: `context_us` of `bank_cuda_ipc` in
/// `docs/qualification/h200-x2/record.json` and its `gpu-tests.log`), and
/// memory of this module may outlive any scope.
/// The map's lock is held only to find an ordinal's cell; the retain runs
/// under that cell's own lock, so binding a device whose context exists
/// never waits behind the creation of another device's context.
#[allow(clippy::type_complexity)]
static CONTEXTS: OnceLock<Mutex<HashMap<u32, Arc<Mutex<Option<usize>>>>>> = OnceLock::new();

/// Makes device `ordinal`'s primary context current on this thread.
fn bind(ordinal: u32) -> Result<sys::CUdevice, BankError> {
    let (dev, ctx) = primary_context(ordinal)?;
    // SAFETY: `ctx` is a retained primary context that is never released.
    unsafe { result::ctx::set_current(ctx) }.map_err(cuda_err("cuCtxSetCurrent"))?;
    Ok(dev)
}

/// Device `ordinal` and its primary context (retained once, never released).
fn primary_context(ordinal: u32) -> Result<(sys::CUdevice, sys::CUcontext), BankError> {
    driver()?;
    let count = result::device::get_count().map_err(cuda_err("cuDeviceGetCount"))?;
    if ordinal as i64 >= i64::from(count) {
        return Err(BankError::CudaUnavailable {
            reason: format!("device ordinal {ordinal} requested, {count} devices visible"),
        });
    }
    let dev = result::device::get(ordinal as i32).map_err(cuda_err("cuDeviceGet"))?;
    let cell = CONTEXTS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .entry(ordinal)
        .or_default()
        .clone();
    let mut slot = cell.lock();
    let ctx = match *slot {
        Some(c) => c as sys::CUcontext,
        None => {
            // SAFETY: `dev` came from cuDeviceGet for a valid ordinal.
            let c = unsafe { result::primary_ctx::retain(dev) }
                .map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
            *slot = Some(c as usize);
            c
        }
    };
    drop(slot);
    Ok((dev, ctx))
}

/// Probes the CUDA driver and device `ordinal` without allocating.
///
/// # Errors
/// [`BankError::CudaUnavailable`] when `libcuda` is missing, `cuInit` fails
/// or the ordinal does not exist; [`BankError::Cuda`] for a failing query.
///
/// ```
/// // On a machine without a GPU this is an error that says why.
/// match kv_bank::cuda_probe(0) {
///     Ok(info) => assert!(info.total_bytes > 0),
///     Err(e) => assert!(e.to_string().contains("CUDA")),
/// }
/// ```
pub fn cuda_probe(ordinal: u32) -> Result<CudaDeviceInfo, BankError> {
    let dev = bind(ordinal)?;
    let count = result::device::get_count().map_err(cuda_err("cuDeviceGetCount"))?;
    let uuid = result::device::get_uuid(dev).map_err(cuda_err("cuDeviceGetUuid"))?;
    let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
    let name = result::device::get_name(dev).map_err(cuda_err("cuDeviceGetName"))?;
    // SAFETY: `dev` is valid (from bind).
    let total = unsafe { result::device::total_mem(dev) }.map_err(cuda_err("cuDeviceTotalMem"))?;
    // SAFETY: `dev` is valid; the attribute exists in every CUDA 12.3+ driver.
    let fabric = unsafe {
        result::device::get_attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
        )
    }
    .unwrap_or(0);
    Ok(CudaDeviceInfo {
        ordinal,
        uuid: uuid::Uuid::from_bytes(bytes),
        name,
        total_bytes: total as u64,
        device_count: count as u32,
        fabric_supported: fabric != 0,
    })
}

/// Free and total memory of one device, from `cuMemGetInfo` ([`device_memory_info`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemoryInfo {
    /// Device ordinal in this process.
    pub ordinal: u32,
    /// Free bytes on the device, over all processes using it (device-wide,
    /// not this process's share).
    pub free_bytes: u64,
    /// Total bytes of the device.
    pub total_bytes: u64,
}

/// `cuMemGetInfo` on device `ordinal` (in its primary context, made current
/// on this thread). The free count is device-wide: another process's
/// allocations, contexts and mappings that keep its memory alive count too,
/// which is what the fault matrix's device leak check relies on.
///
/// # Errors
/// [`BankError::CudaUnavailable`] without driver or device;
/// [`BankError::Cuda`] naming `cuMemGetInfo`.
pub fn device_memory_info(ordinal: u32) -> Result<DeviceMemoryInfo, BankError> {
    bind(ordinal)?;
    let (free, total) = result::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?;
    Ok(DeviceMemoryInfo {
        ordinal,
        free_bytes: free as u64,
        total_bytes: total as u64,
    })
}

/// The [`MemoryLocation`] of device `ordinal` on host `host_id` (UUID from the driver).
///
/// # Errors
/// As [`cuda_probe`]; [`BankError::Descriptor`] for an empty `host_id`.
pub fn gpu_location(ordinal: u32, host_id: &str) -> Result<MemoryLocation, BankError> {
    let info = cuda_probe(ordinal)?;
    Ok(MemoryLocation::Gpu(GpuIdentity::new(
        info.uuid, ordinal, host_id,
    )?))
}

fn htod(ordinal: u32, base: u64, len: usize, offset: usize, src: &[u8]) -> Result<(), BankError> {
    check_range("offset", offset, src.len(), len)?;
    bind(ordinal)?;
    // SAFETY: the destination range lies inside a live allocation of `len`
    // bytes (checked above) in the bound context; `src` is a host buffer that
    // stays borrowed for the whole synchronous copy.
    unsafe { result::memcpy_htod_sync(base + offset as u64, src) }.map_err(cuda_err("cuMemcpyHtoD"))
}

fn dtoh(
    ordinal: u32,
    base: u64,
    len: usize,
    offset: usize,
    dst: &mut [u8],
) -> Result<(), BankError> {
    check_range("offset", offset, dst.len(), len)?;
    bind(ordinal)?;
    // SAFETY: as in `htod`, source range inside the live allocation, `dst` a
    // host buffer mutably borrowed for the synchronous copy.
    unsafe { result::memcpy_dtoh_sync(dst, base + offset as u64) }.map_err(cuda_err("cuMemcpyDtoH"))
}

/// One `cuPointerGetAttribute` of `addr` (an `int`-, `CUdeviceptr`- or
/// `size_t`-sized attribute, read into a `u64`).
fn pointer_attribute(addr: u64, attr: sys::CUpointer_attribute, bytes: usize) -> Option<u64> {
    let mut v: u64 = 0;
    // SAFETY: `v` is an 8-byte out-buffer, at least as large as each
    // attribute read here (`int` / `unsigned int`: 4, `CUdeviceptr` /
    // `size_t`: 8); little-endian, so a 4-byte value lands in the low half.
    let r = unsafe {
        sys::cuPointerGetAttribute(&mut v as *mut u64 as *mut std::ffi::c_void, attr, addr)
    };
    r.result().ok()?;
    Some(if bytes == 4 { v & 0xffff_ffff } else { v })
}

/// Checks that `addr..addr+len` is device memory of one allocation on
/// device `ordinal` (`cuPointerGetAttribute`: memory type, device ordinal,
/// allocation range), so a host pointer, a pointer on another device or a
/// range running past its allocation is refused before any copy.
fn check_device_source(addr: u64, len: usize, ordinal: u32) -> Result<(), BankError> {
    use sys::CUpointer_attribute as A;
    let refuse = |why: String| Err(BankError::arg("source", why));
    const CU_MEMORYTYPE_DEVICE: u64 = 2;
    match pointer_attribute(addr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, 4) {
        Some(CU_MEMORYTYPE_DEVICE) => {}
        Some(t) => return refuse(format!("{addr:#x} is not device memory (CUmemorytype {t})")),
        None => return refuse(format!("{addr:#x} is not memory CUDA knows")),
    }
    match pointer_attribute(addr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, 4) {
        Some(o) if o == u64::from(ordinal) => {}
        Some(o) => return refuse(format!("{addr:#x} is on cuda:{o}, expected cuda:{ordinal}")),
        None => return refuse(format!("{addr:#x}: device ordinal unknown")),
    }
    let start = pointer_attribute(addr, A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, 8);
    let size = pointer_attribute(addr, A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, 8);
    match (start, size) {
        (Some(s), Some(n)) if addr + len as u64 <= s.saturating_add(n) => Ok(()),
        (Some(s), Some(n)) => refuse(format!(
            "{addr:#x}+{len} runs past its allocation {s:#x}+{n}"
        )),
        _ => refuse(format!("{addr:#x}: allocation range unknown")),
    }
}

/// Device-to-device copies into the allocation `base..base+region_len` on
/// device `dst_ordinal`: `len` bytes from each `src` to `base + offset`,
/// the sources on device `src_ordinal` (the same device: `cuMemcpyDtoDAsync`;
/// a peer: `cuMemcpyPeerAsync`, which the driver routes over NVLink / PCIe
/// peer access or stages itself), then one stream synchronize.
///
/// The copies run on the legacy default stream of the destination's
/// primary context: it waits for the work already queued on every blocking
/// stream of that context, which is where an engine (torch's default
/// stream) computed the rows, so they are complete before they are copied;
/// a producer on a non-blocking stream makes it wait first (DLPack's
/// `__dlpack__(stream=1)` contract, which the Python binding uses).
pub(crate) fn dtod_rows(
    dst_ordinal: u32,
    base: u64,
    region_len: usize,
    copies: &[(usize, u64)],
    len: usize,
    src_ordinal: u32,
) -> Result<(), BankError> {
    for (offset, _) in copies {
        check_range("offset", *offset, len, region_len)?;
    }
    let (_, src_ctx) = primary_context(src_ordinal)?;
    bind(src_ordinal)?;
    // The whole source span at once, from its lowest address: a row past
    // the allocation is then "runs past its allocation", not an address
    // CUDA does not know.
    if let (Some(lo), Some(hi)) = (
        copies.iter().map(|c| c.1).min(),
        copies.iter().map(|c| c.1 + len as u64).max(),
    ) {
        check_device_source(lo, (hi - lo) as usize, src_ordinal)?;
    }
    bind(dst_ordinal)?;
    let (_, dst_ctx) = primary_context(dst_ordinal)?;
    let stream = result::stream::null();
    for (offset, src) in copies {
        let dst = base + *offset as u64;
        // SAFETY: the destination range lies inside the live allocation of
        // `region_len` bytes (checked above); each source range lies inside
        // one live device allocation of `src_ordinal` (checked above, and
        // the caller keeps it alive until this returns); both contexts are
        // retained primary contexts; the stream is the bound context's
        // legacy default stream, synchronized below before returning.
        let r = unsafe {
            if src_ordinal == dst_ordinal {
                result::memcpy_dtod_async(dst, *src, len, stream)
            } else {
                result::memcpy_peer_async(dst_ctx, dst, src_ctx, *src, len, stream)
            }
        };
        r.map_err(cuda_err(if src_ordinal == dst_ordinal {
            "cuMemcpyDtoDAsync"
        } else {
            "cuMemcpyPeerAsync"
        }))?;
    }
    // SAFETY: the null stream of the bound context; every copy queued above
    // has landed when this returns.
    unsafe { result::stream::synchronize(stream) }.map_err(cuda_err("cuStreamSynchronize"))
}

/// A virtual-memory allocation (`cuMemCreate` + `cuMemAddressReserve` +
/// `cuMemMap`), undone in reverse order by `Drop` as far as it got, so that a
/// failure half-way leaves nothing behind.
#[derive(Debug)]
struct VmmRegion {
    handle: Option<sys::CUmemGenericAllocationHandle>,
    ptr: u64,
    size: usize,
    mapped: bool,
    ordinal: u32,
}

impl VmmRegion {
    fn prop(ordinal: u32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is a valid (default) value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal as i32;
        prop
    }

    /// `len` rounded up to the allocation granularity of device `ordinal`.
    fn granular_size(ordinal: u32, len: usize) -> Result<usize, BankError> {
        let prop = Self::prop(ordinal);
        let mut g = 0usize;
        // SAFETY: valid out-pointer and property struct.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(cuda_err("cuMemGetAllocationGranularity"))?;
        let g = g.max(1);
        Ok(len.div_ceil(g) * g)
    }

    /// Reserves an address range for `handle` and maps it read-write on the device.
    fn map(
        handle: sys::CUmemGenericAllocationHandle,
        ordinal: u32,
        size: usize,
    ) -> Result<Self, BankError> {
        let mut r = Self {
            handle: Some(handle),
            ptr: 0,
            size,
            mapped: false,
            ordinal,
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no fixed address or alignment requested.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) }
            .result()
            .map_err(cuda_err("cuMemAddressReserve"))?;
        r.ptr = ptr;
        // SAFETY: `ptr..ptr+size` was just reserved; `handle` is a live allocation of `size` bytes.
        unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) }
            .result()
            .map_err(cuda_err("cuMemMap"))?;
        r.mapped = true;
        // SAFETY: a plain C struct; all-zero then filled.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = ordinal as i32;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is mapped; one descriptor.
        unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1) }
            .result()
            .map_err(cuda_err("cuMemSetAccess"))?;
        Ok(r)
    }
}

impl Drop for VmmRegion {
    fn drop(&mut self) {
        if bind(self.ordinal).is_err() {
            return;
        }
        // SAFETY: each step undoes one that succeeded in `map`/`new_fabric`, in reverse order.
        unsafe {
            if self.mapped {
                sys::cuMemUnmap(self.ptr, self.size);
            }
            if self.ptr != 0 {
                sys::cuMemAddressFree(self.ptr, self.size);
            }
            if let Some(h) = self.handle {
                sys::cuMemRelease(h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_may_not_use_the_cuda_state_it_inherited() {
        assert!(usable_here(&Ok(CreatorProcess::current())).is_ok());
        // Any other pid stands for the parent that ran cuInit before a fork.
        let parent = CreatorProcess::of_pid(std::process::id().wrapping_add(1));
        let e = usable_here(&Ok(parent)).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, BankError::CudaUnavailable { .. }), "{e:?}");
        assert!(
            text.starts_with(&format!(
                "CUDA unavailable: CUDA was initialized by process {}, and this process ({}) is a \
                 child forked from it",
                parent.pid(),
                std::process::id()
            )),
            "{text}"
        );
        let e = usable_here(&Err("cuInit failed: X".into())).unwrap_err();
        assert_eq!(e.to_string(), "CUDA unavailable: cuInit failed: X");
    }

    #[test]
    fn without_gpu_every_entry_point_says_why() {
        // SAFETY: only a dlopen probe.
        if unsafe { sys::is_culib_present() } {
            println!(
                "SKIP no-GPU path test: libcuda present, the no-GPU path is not exercised here"
            );
            return;
        }
        for e in [
            cuda_probe(0).unwrap_err(),
            CudaDeviceMemory::new(0, 1024).unwrap_err(),
            CudaIpcImport::open(&[0u8; 64], 0, 1024).unwrap_err(),
            device_memory_info(0).unwrap_err(),
        ] {
            assert!(matches!(e, BankError::CudaUnavailable { .. }), "{e}");
            assert!(e.to_string().contains("libcuda"), "{e}");
        }
    }

    #[test]
    fn descriptor_import_without_a_live_lease_is_refused_before_any_cuda_call() {
        use kv_descriptor::*;
        let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
        let gpu = GpuIdentity::new(uuid::Uuid::from_u128(5), 0, "h").unwrap();
        let d = BankDescriptor::new(BankParts {
            layout,
            tp_rank: 0,
            location: MemoryLocation::Gpu(gpu),
            owner: OwnerLease::fresh(Role::Decode),
            export: ExportHandle::CudaIpc {
                handle: vec![7; CUDA_HANDLE_BYTES],
            },
            slot_count: 4,
            slot_bytes: layout.rank_block_bytes() as u64,
        })
        .unwrap();
        // No owner ever published a lease for this incarnation: refused by
        // name, even on a machine without libcuda (no CUDA call was made).
        // `open_device_descriptor` (every build's entry point) is this path
        // in a CUDA build: both refuse the same way.
        for e in [
            CudaIpcImport::open_descriptor(&d, 0).unwrap_err(),
            match crate::open_device_descriptor(&d, 0) {
                Err(e) => e,
                Ok(_) => panic!("imported a bank that has no lease"),
            },
        ] {
            match e {
                BankError::LeaseMissing { lease } => {
                    assert!(lease.starts_with("/kvbank-cuda-"), "{lease}");
                    assert!(lease.ends_with("-g1-r0.lease"), "{lease}");
                }
                other => panic!("{other}"),
            }
        }
    }

    #[test]
    fn bad_handle_length_is_refused_before_any_cuda_call() {
        let e = CudaIpcImport::open(&[0u8; 10], 0, 1024).unwrap_err();
        assert!(e.to_string().contains("`handle`"), "{e}");
    }
}
