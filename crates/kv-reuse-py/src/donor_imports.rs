//! The CUDA IPC donors a `Target` keeps imported between its fetches.
//!
//! Why: kv-bank's process-wide mapping cache closes a mapping when its last
//! import is dropped, so a donor opened per fetch paid a
//! `cuIpcOpenMemHandle` (and its close) on every fetch: ~1 ms of each fetch
//! on the H200 (`docs/qualification/h200-s12`, `fetch_us.import`). Holding
//! the `RemoteDonor` keeps its imports, and so the mappings, open.
//!
//! Invariants:
//! - an entry is handed out only after every part's owner lease was found
//!   live for this fetch (the check `RemoteDonor::open_cuda_ipc` makes when
//!   it opens); the other entries' leases are checked at most once per
//!   [`SWEEP_INTERVAL`] (each check reads a lease file: not every fetch
//!   should pay one per kept donor), and those no longer live are dropped:
//!   a donor that closed (lease revoked), died (lease lapsed) or was
//!   replaced by a new incarnation (another manifest, another key) loses
//!   its mappings here at the first fetch after the next sweep is due;
//! - a fetch that fell back drops its donor (it may be gone), so the next
//!   one imports afresh;
//! - at most [`CAPACITY`] donors are held; the least recently used goes;
//! - a donor is keyed by its exact manifest bytes, pin endpoint and pin
//!   timeout, so a hit is the same bank, reached the same way.
//!
//! Deliberately absent: host-shm donors (mapping shm is cheap, and their
//! callers count shm mappings per fetch) and any background sweeping (a
//! donor that dies while this target fetches nothing keeps its mapping
//! until the next fetch, `Target.forget_donors()` or the target's end).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_bank::{check_descriptor_lease, LeaseInstant};
use kv_router_glue::{DonorSource, RemoteDonor};

/// Most donors one target keeps imported.
pub(crate) const CAPACITY: usize = 8;

/// How often the entries not used by a fetch have their leases checked.
pub(crate) const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

struct Entry {
    manifest: Vec<u8>,
    endpoint: String,
    timeout: Duration,
    donor: Arc<RemoteDonor>,
}

/// A target's kept donors, most recently used last.
pub(crate) struct DonorImports {
    state: Mutex<State>,
    sweep_interval: Duration,
}

struct State {
    entries: Vec<Entry>,
    /// When the last sweep of every entry's lease ran.
    swept: Option<Instant>,
}

impl Default for DonorImports {
    fn default() -> Self {
        Self::with_sweep_interval(SWEEP_INTERVAL)
    }
}

/// True while every part's owner lease is live.
fn live(donor: &RemoteDonor) -> bool {
    let now = LeaseInstant::now();
    donor
        .manifest()
        .parts()
        .iter()
        .all(|d| check_descriptor_lease(d, now).is_ok())
}

impl DonorImports {
    /// Kept donors whose unused entries are swept every `sweep_interval`.
    pub fn with_sweep_interval(sweep_interval: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                entries: Vec::new(),
                swept: None,
            }),
            sweep_interval,
        }
    }

    /// The kept donor for (`manifest`, `endpoint`, `timeout`), or the one
    /// `open` makes (then kept). Its lease is checked first (a kept donor
    /// no longer live is dropped and opened anew); when a sweep is due, the
    /// other entries' too. `open`'s error is returned as is, and nothing is
    /// kept.
    pub fn get_or_open<E>(
        &self,
        manifest: &[u8],
        endpoint: &str,
        timeout: Duration,
        open: impl FnOnce() -> Result<RemoteDonor, E>,
    ) -> Result<Arc<RemoteDonor>, E> {
        let same =
            |e: &Entry| e.manifest == manifest && e.endpoint == endpoint && e.timeout == timeout;
        {
            let mut st = self.lock();
            // Dropping an entry may close its mappings (a driver call)
            // under this lock; it guards only this target's own list.
            let now = Instant::now();
            if st
                .swept
                .is_none_or(|t| now.duration_since(t) >= self.sweep_interval)
            {
                st.entries.retain(|e| live(&e.donor));
                st.swept = Some(now);
            }
            if let Some(i) = st.entries.iter().position(same) {
                let e = st.entries.remove(i);
                if live(&e.donor) {
                    let donor = e.donor.clone();
                    st.entries.push(e);
                    return Ok(donor);
                }
            }
        }
        // Opened without the lock: an import takes ~1 ms.
        let donor = Arc::new(open()?);
        let mut st = self.lock();
        let entries = &mut st.entries;
        if let Some(i) = entries.iter().position(same) {
            // Another fetch opened it meanwhile: keep one.
            return Ok(entries[i].donor.clone());
        }
        if entries.len() >= CAPACITY {
            entries.remove(0);
        }
        entries.push(Entry {
            manifest: manifest.to_vec(),
            endpoint: endpoint.to_owned(),
            timeout,
            donor: donor.clone(),
        });
        Ok(donor)
    }

    /// Drops `donor` if kept (after its fetch fell back).
    pub fn forget(&self, donor: &Arc<RemoteDonor>) {
        self.lock()
            .entries
            .retain(|e| !Arc::ptr_eq(&e.donor, donor));
    }

    /// Drops every kept donor; returns how many were kept.
    pub fn clear(&self) -> usize {
        let mut st = self.lock();
        let n = st.entries.len();
        st.entries.clear();
        n
    }

    /// Donors kept now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_bank::{BankConfig, BankManager};
    use kv_descriptor::{DType, KvLayout, OwnerLease, Role, TensorOrder, Wire};

    fn bank() -> BankManager {
        let l = KvLayout::new(1, 1, 4, DType::F32, 2, TensorOrder::BlockMajor, 1).unwrap();
        let budget = 4 * l.rank_block_bytes() as u64;
        BankManager::new_host_shm(
            BankConfig::new(l, OwnerLease::fresh(Role::Decode), budget),
            "imports-test",
        )
        .unwrap()
    }

    /// `get_or_open` for `bank`'s donor, counting opens in `opened`.
    fn get(imports: &DonorImports, bank: &BankManager, opened: &mut usize) -> Arc<RemoteDonor> {
        let m = bank.manifest().clone();
        let bytes = m.to_wire().unwrap();
        imports
            .get_or_open(
                &bytes,
                "unix:/tmp/none.sock",
                Duration::from_secs(2),
                || {
                    *opened += 1;
                    RemoteDonor::open_host_shm(m, "unix:/tmp/none.sock")
                },
            )
            .unwrap()
    }

    #[test]
    fn a_donor_is_opened_once_kept_least_recently_used_and_dropped_when_its_lease_ends() {
        // Every fetch sweeps here, so a dead entry goes at the very next one.
        let imports = DonorImports::with_sweep_interval(Duration::ZERO);
        let banks: Vec<BankManager> = (0..=CAPACITY).map(|_| bank()).collect();
        let mut opened = 0;
        let a = get(&imports, &banks[0], &mut opened);
        let b = get(&imports, &banks[0], &mut opened);
        assert!(Arc::ptr_eq(&a, &b) && opened == 1, "a hit opens nothing");
        // The same bytes under another timeout are another entry.
        let bytes = banks[0].manifest().to_wire().unwrap();
        let other = imports
            .get_or_open(
                &bytes,
                "unix:/tmp/none.sock",
                Duration::from_secs(3),
                || RemoteDonor::open_host_shm(banks[0].manifest().clone(), "unix:/tmp/none.sock"),
            )
            .unwrap();
        assert!(!Arc::ptr_eq(&a, &other) && imports.len() == 2);
        imports.forget(&other);
        assert_eq!(imports.len(), 1);
        // CAPACITY more banks: the first, least recently used, goes.
        for bank in &banks[1..] {
            get(&imports, bank, &mut opened);
        }
        assert_eq!((imports.len(), opened), (CAPACITY, 1 + CAPACITY));
        get(&imports, &banks[0], &mut opened);
        assert_eq!(opened, 2 + CAPACITY, "the evicted donor is opened again");
        // Kept now: banks 2..=CAPACITY and 0. A closed bank revokes its
        // lease: its entry is dropped at the next fetch, whichever donor.
        banks[2].close(Duration::from_secs(1)).unwrap();
        get(&imports, &banks[3], &mut opened);
        assert_eq!(opened, 2 + CAPACITY, "bank 3 was kept");
        assert_eq!(imports.len(), CAPACITY - 1);
        assert_eq!(imports.clear(), CAPACITY - 1);
        assert_eq!(imports.len(), 0);
        drop((a, b));
    }

    #[test]
    fn the_used_donor_is_lease_checked_at_every_fetch_the_others_at_each_sweep() {
        let imports = DonorImports::with_sweep_interval(Duration::from_secs(3600));
        let (used, other) = (bank(), bank());
        let mut opened = 0;
        get(&imports, &used, &mut opened);
        get(&imports, &other, &mut opened);
        // `other` closes: not swept within the hour, so it stays kept ...
        other.close(Duration::from_secs(1)).unwrap();
        get(&imports, &used, &mut opened);
        assert_eq!((imports.len(), opened), (2, 2));
        // ... but a fetch from it finds its lease gone and opens anew.
        let bytes = other.manifest().to_wire().unwrap();
        let again = imports.get_or_open(
            &bytes,
            "unix:/tmp/none.sock",
            Duration::from_secs(2),
            || RemoteDonor::open_host_shm(other.manifest().clone(), "unix:/tmp/none.sock"),
        );
        assert!(again.is_err(), "a closed bank cannot be opened again");
        assert_eq!(
            imports.len(),
            1,
            "the dead entry was dropped, nothing new kept"
        );
    }
}
