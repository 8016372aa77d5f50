//! Stale-bank reclamation: banks whose owner stopped renewing its lease
//! (it died, or stalled past the lease) are removed without an operator.
//!
//! [`reclaim_stale`] scans [`crate::SHM_DIR`] for entries starting with a
//! prefix (`kvbank` covers every bank this crate creates by default):
//! - a **lease** that is expired or revoked is first swapped to revoked
//!   (so its owner can never renew it again, see [`crate::lease`]), then its
//!   segment (`/<segment>.lease` names `/<segment>`) is unlinked, then the
//!   lease itself. Segment first: at every moment an importer either finds
//!   no segment or finds a lease that refuses it.
//! - a lease that is unreadable (no magic: its creator died while writing
//!   it, or a bad checksum) is removed with its segment once older than
//!   [`ReclaimPolicy::incomplete_grace`];
//! - a **segment without a lease** whose name carries a creator pid
//!   (`…-<pid>-<n>-<hex>`, [`crate::HostShmMemory::create_unique`]) that is
//!   no longer running is an orphan: removed once older than
//!   [`ReclaimPolicy::orphan_grace`] (`None` keeps orphans; use that where
//!   several pid namespaces share one shared-memory directory).
//!
//! A live lease is never touched, whatever its pid looks like. A reclaimed
//! bank's names are gone, and a re-created bank has another engine id or
//! generation, so old descriptors fail the lease check for good.

use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use kv_descriptor::EngineId;
use parking_lot::Mutex;

use crate::leaks::{self, name_pid, shm_names};
use crate::lease::{shm_path, LeaseMap, LEASE_SUFFIX};
use crate::{BankError, LeaseInstant};

/// The moment a scan judges entries at, on the two clocks it needs: leases
/// on the lease clock ([`LeaseInstant`], `CLOCK_BOOTTIME`, which no clock
/// step moves), grace periods on the wall clock, because they compare file
/// modification times, which the kernel stamps from the wall clock.
///
/// ```
/// use std::time::Duration;
/// let now = kv_bank::reclaim::ScanTime::now();
/// let later = now.later(Duration::from_secs(2));
/// assert_eq!(later.lease.as_micros() - now.lease.as_micros(), 2_000_000);
/// assert_eq!(later.wall.duration_since(now.wall).unwrap(), Duration::from_secs(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanTime {
    /// Leases lapse against this.
    pub lease: LeaseInstant,
    /// Ages of unreadable leases and orphan segments are measured to this.
    pub wall: std::time::SystemTime,
}

impl ScanTime {
    /// Both clocks now.
    pub fn now() -> Self {
        Self {
            lease: LeaseInstant::now(),
            wall: SystemTime::now(),
        }
    }

    /// `d` after `self` on both clocks (a scan "from the future", for tests
    /// that must see leases lapsed without waiting).
    pub fn later(self, d: Duration) -> Self {
        Self {
            lease: self.lease + d,
            wall: self.wall + d,
        }
    }
}

/// What [`reclaim_stale_with`] may remove besides lapsed leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimPolicy {
    /// Age after which a segment without a lease, whose creator pid is gone,
    /// is removed; `None` never removes such segments.
    pub orphan_grace: Option<Duration>,
    /// Age after which an unreadable lease file (and its segment) is removed.
    pub incomplete_grace: Duration,
}

impl Default for ReclaimPolicy {
    /// Orphans and unreadable leases older than 60 s.
    fn default() -> Self {
        Self {
            orphan_grace: Some(Duration::from_secs(60)),
            incomplete_grace: Duration::from_secs(60),
        }
    }
}

/// One reclaimed bank rank.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReclaimedBank {
    /// The lease removed.
    pub lease: String,
    /// The shared-memory segment removed with it (host banks), if it existed.
    pub segment: Option<String>,
    /// Owner incarnation.
    pub engine_id: EngineId,
    /// Bank generation.
    pub generation: u64,
    /// TP rank.
    pub tp_rank: u32,
    /// Owner pid from the lease.
    pub pid: u32,
    /// Whether that pid was still running on this host (a stalled owner).
    pub owner_alive: bool,
    /// How long past its expiry the lease was, in µs (0 for a revoked lease).
    pub expired_for_us: u64,
}

/// What one scan did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReclaimReport {
    /// Banks (ranks) reclaimed because their lease lapsed or was revoked.
    pub reclaimed: Vec<ReclaimedBank>,
    /// Unreadable lease files removed, with their segments.
    pub invalid_leases: Vec<String>,
    /// Leaseless segments of dead creators removed.
    pub orphans: Vec<String>,
    /// Live leases seen (left alone).
    pub live: usize,
    /// Entries that could not be handled, with the reason (left alone).
    pub errors: Vec<(String, String)>,
}

impl ReclaimReport {
    /// Every name this scan unlinked.
    pub fn removed_names(&self) -> Vec<String> {
        let mut v = Vec::new();
        for r in &self.reclaimed {
            v.extend(r.segment.clone());
            v.push(r.lease.clone());
        }
        v.extend(self.invalid_leases.iter().cloned());
        v.extend(self.orphans.iter().cloned());
        v
    }
}

/// [`reclaim_stale_with`] under [`ReclaimPolicy::default`].
///
/// ```
/// use kv_bank::reclaim::ScanTime;
/// // A prefix nothing uses: nothing found, nothing removed.
/// let r = kv_bank::reclaim_stale("kvbank-doc-none", ScanTime::now()).unwrap();
/// assert!(r.reclaimed.is_empty() && r.orphans.is_empty() && r.live == 0);
/// ```
///
/// # Errors
/// As [`reclaim_stale_with`].
pub fn reclaim_stale(prefix: &str, now: ScanTime) -> Result<ReclaimReport, BankError> {
    reclaim_stale_with(prefix, now, &ReclaimPolicy::default())
}

/// Whether `prefix` may start a scan: non-empty (an empty prefix would
/// scan other software's objects), without `/` (shared-memory names are
/// flat) and without control characters (no bank name holds one: a `NUL`
/// or newline is a caller's mistake that would match nothing, silently).
///
/// ```
/// use kv_bank::reclaim::check_prefix;
/// assert!(check_prefix("kvbank").is_ok());
/// for bad in ["", "a/b", "kv\0bank", "kv\n"] {
///     assert!(check_prefix(bad).unwrap_err().to_string().contains("`prefix`"));
/// }
/// ```
///
/// # Errors
/// [`BankError::InvalidArgument`] naming `prefix`.
pub fn check_prefix(prefix: &str) -> Result<(), BankError> {
    if prefix.is_empty() || prefix.contains('/') || prefix.chars().any(char::is_control) {
        return Err(BankError::arg(
            "prefix",
            format!("must be non-empty without `/` or control characters, got {prefix:?}"),
        ));
    }
    Ok(())
}

/// Reclaims stale banks whose names start with `prefix` (see the module
/// docs), judging leases at `now.lease` and file ages at `now.wall`.
/// Per-entry failures are reported in
/// [`ReclaimReport::errors`], not returned.
///
/// # Errors
/// [`BankError::InvalidArgument`] naming `prefix` as [`check_prefix`] does.
pub fn reclaim_stale_with(
    prefix: &str,
    now: ScanTime,
    policy: &ReclaimPolicy,
) -> Result<ReclaimReport, BankError> {
    check_prefix(prefix)?;
    let names = shm_names(prefix);
    let mut report = ReclaimReport::default();
    let mut partnered = std::collections::HashSet::new();
    for lease in names.iter().filter(|n| n.ends_with(LEASE_SUFFIX)) {
        let segment = lease
            .strip_suffix(LEASE_SUFFIX)
            .unwrap_or(lease)
            .to_string();
        partnered.insert(segment.clone());
        let map = match LeaseMap::open(lease) {
            Ok(m) => m,
            Err(BankError::LeaseMissing { .. }) => continue, // removed meanwhile
            Err(e) => {
                report.errors.push((lease.clone(), e.to_string()));
                continue;
            }
        };
        let rec = match map.record() {
            Ok(r) => r,
            Err(e) => {
                if age(lease, now.wall).is_some_and(|a| a >= policy.incomplete_grace) {
                    remove(&segment, &mut report);
                    if map.unlink_if_ours() {
                        report.invalid_leases.push(lease.clone());
                    }
                } else {
                    report
                        .errors
                        .push((lease.clone(), format!("{e}; within grace")));
                }
                continue;
            }
        };
        if !map.revoke_if_lapsed(now.lease) {
            report.live += 1;
            continue;
        }
        let removed_segment = remove(&segment, &mut report);
        if !map.unlink_if_ours() {
            continue; // someone else removed it first
        }
        report.reclaimed.push(ReclaimedBank {
            lease: lease.clone(),
            segment: removed_segment.then_some(segment),
            engine_id: rec.engine_id,
            generation: rec.generation,
            tp_rank: rec.tp_rank,
            pid: rec.pid,
            owner_alive: pid_alive(rec.pid),
            expired_for_us: if rec.expires_at_us == 0 {
                0
            } else {
                now.lease
                    .micros_since(LeaseInstant::from_micros(rec.expires_at_us))
            },
        });
    }
    if let Some(grace) = policy.orphan_grace {
        for seg in names.iter().filter(|n| !n.ends_with(LEASE_SUFFIX)) {
            if partnered.contains(seg) || shm_exists(&format!("{seg}{LEASE_SUFFIX}")) {
                continue; // covered by a lease (possibly created after the listing)
            }
            let Some(pid) = name_pid(seg) else { continue };
            if pid_alive(pid) || age(seg, now.wall).is_none_or(|a| a < grace) {
                continue;
            }
            if std::fs::remove_file(shm_path(seg)).is_ok() {
                report.orphans.push(seg.clone());
            }
        }
    }
    if !report.reclaimed.is_empty() || !report.orphans.is_empty() {
        tracing::info!(
            reclaimed = report.reclaimed.len(),
            orphans = report.orphans.len(),
            "reclaimed stale banks under {prefix:?}"
        );
    }
    Ok(report)
}

fn shm_exists(name: &str) -> bool {
    std::fs::symlink_metadata(shm_path(name)).is_ok()
}

/// Unlinks segment `name` if present; an error other than "gone" is reported.
fn remove(name: &str, report: &mut ReclaimReport) -> bool {
    match std::fs::remove_file(shm_path(name)) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            report.errors.push((name.to_string(), e.to_string()));
            false
        }
    }
}

/// Age of an entry by its modification time, relative to `now`.
fn age(name: &str, now: SystemTime) -> Option<Duration> {
    let m = std::fs::symlink_metadata(shm_path(name))
        .ok()?
        .modified()
        .ok()?;
    Some(now.duration_since(m).unwrap_or(Duration::ZERO))
}

/// True when `pid` runs in this pid namespace and is not a zombie (state
/// `Z` or `X` in `/proc/<pid>/stat`, proc(5)); false for pid 0.
///
/// The one liveness test of the workspace: a lease owner, a donor child of
/// the test kit and the reclaimer all ask it. A pid is reused only after its
/// process was reaped, so a caller that holds an unreaped child gets an exact
/// answer; for any other pid it is a snapshot.
///
/// ```
/// assert!(kv_bank::reclaim::pid_alive(std::process::id()));
/// assert!(!kv_bank::reclaim::pid_alive(0));
/// ```
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S ...`: comm may hold spaces and parentheses; the state
    // follows the last `)`.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, Some('Z') | Some('X') | None)
}

/// Totals of a background [`Reclaimer`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReclaimerTotals {
    /// Scans run.
    pub scans: u64,
    /// Bank ranks reclaimed, in scan order.
    pub reclaimed: Vec<ReclaimedBank>,
    /// Orphan segments and invalid leases removed.
    pub other_removed: Vec<String>,
    /// Last per-scan error, if any.
    pub last_error: Option<String>,
}

/// A background thread running [`reclaim_stale_with`] every `interval`;
/// stops (and joins) when dropped.
///
/// ```
/// use std::time::Duration;
/// let r = kv_bank::Reclaimer::start("kvbank-doc-none", Duration::from_millis(5), Default::default()).unwrap();
/// std::thread::sleep(Duration::from_millis(30));
/// assert!(r.totals().scans >= 1);
/// ```
#[derive(Debug)]
pub struct Reclaimer {
    totals: Arc<Mutex<ReclaimerTotals>>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    creator: crate::CreatorProcess,
}

impl Reclaimer {
    /// Starts scanning `prefix` every `interval` (first scan at once).
    ///
    /// # Errors
    /// `prefix` as in [`reclaim_stale_with`]; `interval` zero; a thread that cannot start.
    pub fn start(
        prefix: &str,
        interval: Duration,
        policy: ReclaimPolicy,
    ) -> Result<Self, BankError> {
        reclaim_stale_with(prefix, ScanTime::now(), &policy)?;
        if interval.is_zero() {
            return Err(BankError::arg("interval", "must be above 0"));
        }
        let totals = Arc::new(Mutex::new(ReclaimerTotals::default()));
        let (stop, stopped) = mpsc::channel::<()>();
        let (t, prefix) = (totals.clone(), prefix.to_string());
        // Counted before the spawn, so a snapshot right after start sees it.
        let live = leaks::Live::new(&leaks::RECLAIMER_THREADS);
        let thread = std::thread::Builder::new()
            .name("kv-bank-reclaim".into())
            .spawn(move || {
                let _live = live;
                loop {
                    let r = reclaim_stale_with(&prefix, ScanTime::now(), &policy);
                    let mut t = t.lock();
                    t.scans += 1;
                    match r {
                        Ok(r) => {
                            t.other_removed.extend(r.invalid_leases);
                            t.other_removed.extend(r.orphans);
                            t.reclaimed.extend(r.reclaimed);
                            t.last_error = r.errors.last().map(|(n, e)| format!("{n}: {e}"));
                        }
                        Err(e) => t.last_error = Some(e.to_string()),
                    }
                    drop(t);
                    if !matches!(
                        stopped.recv_timeout(interval),
                        Err(mpsc::RecvTimeoutError::Timeout)
                    ) {
                        return;
                    }
                }
            })
            .map_err(|e| BankError::arg("interval", format!("cannot start thread: {e}")))?;
        Ok(Self {
            totals,
            stop: Some(stop),
            thread: Some(thread),
            creator: crate::CreatorProcess::current(),
        })
    }

    /// What it did so far.
    pub fn totals(&self) -> ReclaimerTotals {
        self.totals.lock().clone()
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        // A forked child has no scanning thread (see `CreatorProcess`): it
        // neither joins it nor signals it through the copied channel.
        drop(self.creator.keep_here(self.stop.take()));
        if let Some(t) = self.thread.take() {
            let _ = self.creator.join_or_forget(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_pid_zero_is_not() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
    }

    #[test]
    fn empty_or_slashed_prefix_is_refused() {
        for p in ["", "a/b", "a\0", "kvbank\n"] {
            let e = reclaim_stale(p, ScanTime::now()).unwrap_err();
            assert!(e.to_string().contains("`prefix`"), "{e}");
        }
    }
}
