//! Process-private host buffers: the memory of benchmarks, tests and the CPU
//! oracle's destination rows.
//!
//! A [`HostBuffer`] is page-aligned, zero-initialised heap memory that
//! implements [`BankMemory`] (kind `Host`, no export handle). It is not
//! shareable across processes; cross-process host banks are kv-bank's
//! `HostShmMemory`.

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
/// assert_eq!(b.as_slice()[9_999], 7);
/// ```
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain bytes owned by this value; shared access hands
// out only `&[u8]` or raw addresses whose writers follow the destination
// reservation protocol (one writer per row, readers after completion).
unsafe impl Send for HostBuffer {}
// SAFETY: see `Send`.
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

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` excludes other Rust references.
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
        // SAFETY: the range lies inside the allocation (checked above);
        // `ptr::copy` is a memmove, so `src` may even alias this buffer.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.check(offset, dst.len())?;
        dst.copy_from_slice(&self.as_slice()[offset..offset + dst.len()]);
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
