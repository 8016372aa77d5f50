//! Process-private host buffers: the memory of benchmarks, tests and the CPU
//! oracle's destination rows; and [`EngineMemory`], memory the engine owns
//! (its KV tensors) registered by base pointer and length as a fetch's
//! destination.
//!
//! A [`HostBuffer`] is page-aligned, zero-initialised heap memory that
//! implements [`BankMemory`] (kind `Host`, no export handle). It is not
//! shareable across processes; cross-process host banks are kv-bank's
//! `HostShmMemory`.
//!
//! # Aliasing
//! The bytes are written behind shared references: by
//! [`BankMemory::write_bytes`] and by copy backends through
//! [`BankMemory::base_addr`] (memcpy, NIXL / UCX threads), one writer per
//! destination row under the destination reservation. So no `&[u8]` over the
//! buffer is ever handed out for `&self`: such a view tells the compiler the
//! bytes cannot change while it lives, and a read through it across another
//! thread's write may return the stale byte (a standalone copy of that
//! pattern did so under `-O`). Shared access is by copies of exact ranges
//! ([`BankMemory::read_bytes`], [`BankMemory::read_vec`],
//! [`BankMemory::write_bytes`]) that go through raw pointers; slice views
//! exist only for `&mut self` ([`HostBuffer::as_mut_slice`]), where the
//! borrow checker rules out every other user in this process.
//!
//! ```compile_fail,E0599
//! // There is no shared slice view of the bytes.
//! let b = kv_transfer::HostBuffer::zeroed(8).unwrap();
//! let _ = b.as_slice();
//! ```

use std::alloc::Layout;
use std::ptr::NonNull;

use kv_bank::{BankError, BankMemory, MemoryKind};
use kv_descriptor::ExportHandle;

use crate::TransferError;

const PAGE: usize = 4096;

/// Page-aligned, zeroed, process-private host memory.
///
/// ```
/// use kv_bank::BankMemory;
/// let mut b = kv_transfer::HostBuffer::zeroed(10_000).unwrap();
/// b.as_mut_slice()[9_999] = 7;
/// assert_eq!(b.len(), 10_000);
/// assert_eq!(b.base_addr() % 4096, 0);
/// assert_eq!(b.read_vec(9_998, 2).unwrap(), [0, 7]);
/// b.write_bytes(0, &[1, 2]).unwrap(); // through `&self`: raw copy of 2 bytes
/// assert_eq!(&b.as_mut_slice()[..3], &[1, 2, 0]);
/// ```
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `HostBuffer` owns its allocation outright (no thread-local state,
// no `Rc`), and deallocating from another thread is fine for the global
// allocator, so moving the owner between threads is sound.
unsafe impl Send for HostBuffer {}
// SAFETY: the only operations available through `&HostBuffer` are
// `len`/`base_addr` (plain values) and `read_bytes`/`write_bytes`, which
// copy exact, bounds-checked ranges through raw pointers; no method creates
// a reference into the bytes for `&self` (see the module docs), so sharing
// the value between threads creates no aliasing reference that a concurrent
// write could invalidate. Who writes which range when is the transfer
// protocol's business: a destination row has one writer (the delivery that
// reserved it) and is read only after that delivery returned.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zero bytes (at least one page is reserved).
    ///
    /// # Errors
    /// [`TransferError::Host`] when `len` is 0 or the allocation fails.
    pub fn zeroed(len: usize) -> Result<Self, TransferError> {
        if len == 0 {
            return Err(TransferError::Host(
                "a host buffer needs at least 1 byte".into(),
            ));
        }
        let layout =
            Layout::from_size_align(len, PAGE).map_err(|e| TransferError::Host(e.to_string()))?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| TransferError::Host(format!("allocation of {len} bytes failed")))?;
        Ok(Self { ptr, layout })
    }

    /// The bytes, mutably. Needs `&mut self`: while the slice lives no other
    /// Rust code can reach the buffer (a copy backend or NIXL transfer holds
    /// `&self` through its `RankIo`), so the view cannot go stale.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes for our
        // lifetime, and `&mut self` excludes every other Rust reference to
        // the buffer for as long as the returned borrow lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl BankMemory for HostBuffer {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
    fn base_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        None
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        self.check(offset, src.len())?;
        // SAFETY: the range lies inside the allocation (checked above). No
        // reference into the buffer exists while `&self` is shared (the only
        // slice view needs `&mut self`), so writing through the raw pointer
        // invalidates no Rust reference; `src` therefore cannot point into
        // this buffer either, and `ptr::copy` (a memmove) would be correct
        // even if it did.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.check(offset, dst.len())?;
        // SAFETY: the range lies inside the allocation (checked above) and
        // `dst` is a distinct Rust buffer (`&mut` excludes aliasing with
        // anything else), so the ranges do not overlap. Only these bytes are
        // read, through a raw pointer: no reference over the buffer exists.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }
}

/// Memory an engine owns (its KV tensors), borrowed by address: the
/// destination of fetches that land in the engine's own layout
/// (kv-router-glue's `EngineRegion`). Nothing is allocated or freed here.
///
/// Host memory supports [`BankMemory::read_bytes`] / [`BankMemory::write_bytes`]
/// (raw, bounds-checked copies); device memory leaves them
/// [`BankError::Unsupported`] (a CUDA backend writes it through the base
/// address). No export handle: it is not shared with other processes.
///
/// ```
/// use kv_bank::{BankMemory, MemoryKind};
/// let mut tensor = vec![0u8; 4096]; // the engine's allocation
/// // SAFETY: `tensor` outlives `m` and nothing else touches it meanwhile.
/// let m = unsafe {
///     kv_transfer::EngineMemory::from_raw_parts(MemoryKind::Host, tensor.as_mut_ptr() as u64, 4096)
/// }
/// .unwrap();
/// m.write_bytes(10, &[7, 8]).unwrap();
/// assert_eq!(m.read_vec(9, 3).unwrap(), [0, 7, 8]);
/// assert!(m.write_bytes(4095, &[1, 2]).is_err()); // past the end
/// drop(m);
/// assert_eq!(tensor[11], 8);
/// // SAFETY: refused before anything could use it.
/// assert!(unsafe { kv_transfer::EngineMemory::from_raw_parts(MemoryKind::Host, 0, 8) }.is_err());
/// ```
#[derive(Debug)]
pub struct EngineMemory {
    kind: MemoryKind,
    base: u64,
    len: usize,
}

impl EngineMemory {
    /// Registers `len` bytes at `base` (a host pointer, or a `CUdeviceptr`
    /// of device `ordinal` for [`MemoryKind::Cuda`]).
    ///
    /// # Safety
    /// For as long as the returned value (or any delivery using it) lives,
    /// `base..base + len` must stay allocated and writable in this process
    /// (on the named device for CUDA), and no Rust reference into those bytes
    /// may exist: copy backends and [`BankMemory::write_bytes`] write them
    /// through raw pointers while only `&self` is held. Which bytes may be
    /// written when is the fetch executor's reservation protocol: the engine
    /// must not read or write a block while a fetch has it reserved.
    ///
    /// # Errors
    /// [`TransferError::Host`] when `len` is 0, `base` is 0, or the range
    /// wraps the address space.
    pub unsafe fn from_raw_parts(
        kind: MemoryKind,
        base: u64,
        len: usize,
    ) -> Result<Self, TransferError> {
        if len == 0 || base == 0 || base.checked_add(len as u64).is_none() {
            return Err(TransferError::Host(format!(
                "engine memory of {len} bytes at {base:#x} is empty, null or wraps"
            )));
        }
        Ok(Self { kind, base, len })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), BankError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(BankError::OutOfRange {
                field: "offset",
                offset: offset as u64,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

impl BankMemory for EngineMemory {
    fn kind(&self) -> MemoryKind {
        self.kind
    }
    fn len(&self) -> usize {
        self.len
    }
    fn base_addr(&self) -> u64 {
        self.base
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        None
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        if self.kind != MemoryKind::Host {
            return Err(BankError::Unsupported {
                op: "write_bytes",
                kind: self.kind.to_string(),
            });
        }
        self.check(offset, src.len())?;
        // SAFETY: the range lies inside the registered memory (checked
        // above), which `from_raw_parts`' contract keeps allocated, writable
        // and free of Rust references while `self` lives; `ptr::copy`
        // (memmove) is correct even if `src` pointed into it.
        unsafe { std::ptr::copy(src.as_ptr(), (self.base as *mut u8).add(offset), src.len()) };
        Ok(())
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        if self.kind != MemoryKind::Host {
            return Err(BankError::Unsupported {
                op: "read_bytes",
                kind: self.kind.to_string(),
            });
        }
        self.check(offset, dst.len())?;
        // SAFETY: as in `write_bytes`; `dst` is a distinct `&mut` buffer, so
        // the ranges do not overlap, and only these bytes are read.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.base as *const u8).add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }
}

impl HostBuffer {
    fn check(&self, offset: usize, len: usize) -> Result<(), BankError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.layout.size() => Ok(()),
            _ => Err(BankError::OutOfRange {
                field: "offset",
                offset: offset as u64,
                len: len as u64,
                region_len: self.layout.size() as u64,
            }),
        }
    }
}
