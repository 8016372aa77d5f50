//! Software prefetch: the only unsafe code of this crate.
//!
//! Event application knows every hash of an event before it starts, and a
//! donor walk knows the run it is reading: both ask the CPU to fetch cache
//! lines a few blocks ahead. With millions of blocks the tables are far
//! larger than the caches, and each block would otherwise wait for its own
//! DRAM miss in turn.

/// Hints the CPU to bring the cache line at `ptr` into L1. Never faults.
#[inline(always)]
pub(crate) fn prefetch_read<T>(ptr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only needs SSE, which every x86_64 CPU has
    // (it is part of the x86_64 baseline that rustc compiles for). A
    // prefetch is a hint: it does not dereference `ptr` architecturally,
    // cannot fault and has no effect on program state, so any pointer value
    // (even dangling) is sound.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}
