//! Leak accounting: what this process holds now, so that tests and the fault
//! matrix can assert "no leaks" by comparing two snapshots (checked, not assumed).
//!
//! [`snapshot`] counts open file descriptors (`/proc/self/fd`), this
//! process's entries in [`crate::SHM_DIR`] whose names start with
//! [`PROJECT_SHM_PREFIX`] (segments named `…-<pid>-<n>-<hex>` by
//! [`crate::HostShmMemory::create_unique`], and lease files whose record names
//! this pid), and live objects of this crate counted by process-wide
//! counters: shared-memory mappings, CUDA IPC / fabric import mappings
//! (`ipc_cache_stats`, 0 without the `cuda` feature), device allocations and bytes, bank pins,
//! reserved destination blocks, owner leases and background threads.
//!
//! Counts are process-wide: compare snapshots taken while no unrelated work
//! of this process runs concurrently (one test per binary, or a lock).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::lease::{read_lease, LEASE_SUFFIX, SHM_DIR};

/// Entries of [`crate::SHM_DIR`] starting with this belong to this project.
pub const PROJECT_SHM_PREFIX: &str = "kv";

/// A process-wide count of live objects of one kind.
#[derive(Debug)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Self {
        Self(AtomicU64::new(0))
    }
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn sub(&self, n: u64) {
        // Saturating: a counter never wraps even if a bug double-counts a drop.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Increments a counter for as long as it lives.
#[derive(Debug)]
pub(crate) struct Live(&'static Counter);

impl Live {
    pub(crate) fn new(c: &'static Counter) -> Self {
        c.add(1);
        Self(c)
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.sub(1);
    }
}

pub(crate) static SHM_MAPPINGS: Counter = Counter::new();
pub(crate) static DEVICE_ALLOCATIONS: Counter = Counter::new();
pub(crate) static DEVICE_BYTES: Counter = Counter::new();
pub(crate) static PINS: Counter = Counter::new();
pub(crate) static RESERVED_BLOCKS: Counter = Counter::new();
pub(crate) static LEASE_HOLDERS: Counter = Counter::new();
pub(crate) static RENEWER_THREADS: Counter = Counter::new();
pub(crate) static RECLAIMER_THREADS: Counter = Counter::new();

/// What this process holds at one moment. Compare two with [`LeakSnapshot::leaks_since`].
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct LeakSnapshot {
    /// Open file descriptors (entries of `/proc/self/fd`).
    pub open_fds: u64,
    /// This process's [`crate::SHM_DIR`] entries with the project prefix (`/name`).
    pub shm_entries: BTreeSet<String>,
    /// Live [`crate::HostShmMemory`] mappings (owned or opened).
    pub shm_mappings: u64,
    /// Live CUDA IPC / fabric import mappings in the process-wide cache.
    pub ipc_mappings: u64,
    /// Live `CudaDeviceMemory` allocations (0 without the `cuda` feature).
    pub device_allocations: u64,
    /// Bytes of those allocations.
    pub device_bytes: u64,
    /// Live [`crate::ManagerPin`] guards (source pins).
    pub pins: u64,
    /// Destination blocks reserved, cancelled-not-quiesced or orphaned.
    pub reserved_blocks: u64,
    /// Live owner leases (one per bank rank).
    pub lease_holders: u64,
    /// Live lease-renewer and reclaimer threads.
    pub background_threads: u64,
}

/// One resource that grew between two snapshots.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Leak {
    /// Field of [`LeakSnapshot`] (`open_fds`, `shm_entries`, `pins`, ...).
    pub resource: &'static str,
    /// Count before.
    pub before: u64,
    /// Count after.
    pub after: u64,
    /// For `shm_entries`: the names that appeared.
    pub names: Vec<String>,
}

impl std::fmt::Display for Leak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} -> {}", self.resource, self.before, self.after)?;
        if !self.names.is_empty() {
            write!(f, " {:?}", self.names)?;
        }
        Ok(())
    }
}

impl LeakSnapshot {
    /// Resources that grew since `before` (shrinking is not a leak). Empty
    /// when nothing leaked.
    pub fn leaks_since(&self, before: &LeakSnapshot) -> Vec<Leak> {
        let mut out = Vec::new();
        let mut num = |resource, b: u64, a: u64| {
            if a > b {
                out.push(Leak {
                    resource,
                    before: b,
                    after: a,
                    names: Vec::new(),
                });
            }
        };
        num("open_fds", before.open_fds, self.open_fds);
        num("shm_mappings", before.shm_mappings, self.shm_mappings);
        num("ipc_mappings", before.ipc_mappings, self.ipc_mappings);
        num(
            "device_allocations",
            before.device_allocations,
            self.device_allocations,
        );
        num("device_bytes", before.device_bytes, self.device_bytes);
        num("pins", before.pins, self.pins);
        num(
            "reserved_blocks",
            before.reserved_blocks,
            self.reserved_blocks,
        );
        num("lease_holders", before.lease_holders, self.lease_holders);
        num(
            "background_threads",
            before.background_threads,
            self.background_threads,
        );
        let new: Vec<String> = self
            .shm_entries
            .difference(&before.shm_entries)
            .cloned()
            .collect();
        if !new.is_empty() {
            out.push(Leak {
                resource: "shm_entries",
                before: before.shm_entries.len() as u64,
                after: self.shm_entries.len() as u64,
                names: new,
            });
        }
        out
    }
}

/// Takes a snapshot of this process (see the module docs).
///
/// ```
/// let a = kv_bank::leaks::snapshot();
/// let m = kv_bank::HostShmMemory::create_unique("kvbank-doc", 4096).unwrap();
/// let b = kv_bank::leaks::snapshot();
/// assert!(b.leaks_since(&a).iter().any(|l| l.resource == "shm_entries"));
/// drop(m);
/// assert!(kv_bank::leaks::snapshot().shm_entries.is_subset(&a.shm_entries));
/// ```
pub fn snapshot() -> LeakSnapshot {
    let me = std::process::id();
    let shm_entries = shm_names(PROJECT_SHM_PREFIX)
        .into_iter()
        .filter(|n| entry_owner_pid(n) == Some(me))
        .collect();
    LeakSnapshot {
        open_fds: std::fs::read_dir("/proc/self/fd")
            .map(|d| d.count() as u64)
            .unwrap_or(0),
        shm_entries,
        shm_mappings: SHM_MAPPINGS.get(),
        ipc_mappings: ipc_mappings_live(),
        device_allocations: DEVICE_ALLOCATIONS.get(),
        device_bytes: DEVICE_BYTES.get(),
        pins: PINS.get(),
        reserved_blocks: RESERVED_BLOCKS.get(),
        lease_holders: LEASE_HOLDERS.get(),
        background_threads: RENEWER_THREADS.get() + RECLAIMER_THREADS.get(),
    }
}

/// Names (`/name`) of [`crate::SHM_DIR`] entries starting with `prefix`, sorted.
pub(crate) fn shm_names(prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(SHM_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .map(|n| format!("/{n}"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The creator pid encoded in a name made by `create_unique`
/// (`/<prefix>-<pid>-<counter>-<8 hex>`, optionally `.lease`).
pub(crate) fn name_pid(name: &str) -> Option<u32> {
    let base = name.strip_suffix(LEASE_SUFFIX).unwrap_or(name);
    let mut it = base.rsplitn(4, '-');
    let rnd = it.next()?;
    let counter = it.next()?;
    let pid = it.next()?;
    it.next()?;
    let hex8 = rnd.len() == 8 && rnd.bytes().all(|b| b.is_ascii_hexdigit());
    let digits = !counter.is_empty() && counter.bytes().all(|b| b.is_ascii_digit());
    if !hex8 || !digits {
        return None;
    }
    pid.parse().ok()
}

/// Owner pid of an entry: from its name, or from the record of a lease file.
fn entry_owner_pid(name: &str) -> Option<u32> {
    name_pid(name).or_else(|| {
        name.ends_with(LEASE_SUFFIX)
            .then(|| read_lease(name).ok().map(|r| r.pid))
            .flatten()
    })
}

/// Live CUDA IPC / fabric import mappings; a build without the `cuda`
/// feature has no mapping cache, hence none.
fn ipc_mappings_live() -> u64 {
    #[cfg(feature = "cuda")]
    return crate::ipc_cache_stats().live;
    #[cfg(not(feature = "cuda"))]
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_made_by_create_unique_carry_their_pid() {
        assert_eq!(name_pid("/kvbank-123-4-0000abcd"), Some(123));
        assert_eq!(name_pid("/kvbank-test-77-0-deadbeef.lease"), Some(77));
        assert_eq!(name_pid("/kvbank-cuda-0123-g1-r0.lease"), None);
        assert_eq!(name_pid("/kvbank-1-2-xyz"), None);
        assert_eq!(name_pid("/a-b"), None);
    }

    #[test]
    fn only_growth_is_a_leak() {
        let a = LeakSnapshot {
            pins: 2,
            ..Default::default()
        };
        let mut b = a.clone();
        b.pins = 1;
        assert!(b.leaks_since(&a).is_empty());
        b.pins = 3;
        b.shm_entries.insert("/kvbank-1-0-00000000".into());
        let l = b.leaks_since(&a);
        assert_eq!(l.len(), 2);
        assert_eq!((l[0].resource, l[0].before, l[0].after), ("pins", 2, 3));
        assert_eq!(l[1].names, vec!["/kvbank-1-0-00000000".to_string()]);
    }
}
