//! Memory behind a bank (or behind a native KV cache): one trait, several kinds.

use kv_descriptor::ExportHandle;

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

/// A contiguous region of memory mapped into this process.
///
/// Implementations own (or hold a mapping of) `len()` bytes starting at
/// `base_addr()`; the address stays valid for as long as the value lives.
/// Transfers read and write through these addresses, so an implementation
/// must not move or unmap the region while it is alive.
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
}
