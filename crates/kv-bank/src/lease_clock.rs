//! The clock owner leases are written and judged on: `CLOCK_BOOTTIME`.
//!
//! A lease is a promise between processes of one host ("this bank is live
//! until T"), so its clock must be one that every process of the host reads
//! alike and that nothing steps. The wall clock (`CLOCK_REALTIME`,
//! `SystemTime`) fails the second condition: NTP, an operator or a VM
//! resume can step it by any amount, and one forward step longer than the
//! lease made every renewal see its own lease as lapsed, so every bank on
//! the host died for good at the same moment (a lapsed lease is never
//! renewed). `CLOCK_BOOTTIME` counts from boot, never steps, and, unlike
//! `CLOCK_MONOTONIC`, keeps counting during suspend, so a lease still lapses
//! after the host slept longer than it.
//!
//! All processes of a bank (owner, importers, reclaimers) must share one
//! time namespace: Linux time namespaces (`unshare(CLONE_NEWTIME)`, opt-in
//! for containers) offset `CLOCK_BOOTTIME` per namespace. Default container
//! runtimes do not create them.

use std::time::Duration;

/// A reading of the lease clock: microseconds of `CLOCK_BOOTTIME` (time
/// since boot, suspend included). Values are comparable between the
/// processes of one host (one time namespace) and across reboots never
/// (leases live in `/dev/shm`, which a reboot empties).
///
/// ```
/// use std::time::Duration;
/// use kv_bank::LeaseInstant;
/// let a = LeaseInstant::now();
/// let b = a + Duration::from_millis(5);
/// assert_eq!(b.as_micros() - a.as_micros(), 5_000);
/// assert!(LeaseInstant::now() >= a); // never steps back
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct LeaseInstant(u64);

impl LeaseInstant {
    /// The lease clock now (`clock_gettime(CLOCK_BOOTTIME)` through the vDSO).
    pub fn now() -> Self {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        // The kernel keeps tv_sec >= 0 and tv_nsec in 0..1e9 for this clock.
        Self(t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1_000)
    }

    /// The instant `us` microseconds after boot (a value read from a lease file).
    pub const fn from_micros(us: u64) -> Self {
        Self(us)
    }

    /// Microseconds after boot: the unit of a lease file's time fields.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Microseconds from `earlier` to `self`, 0 if `earlier` is later.
    pub fn micros_since(self, earlier: LeaseInstant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl std::ops::Add<Duration> for LeaseInstant {
    type Output = LeaseInstant;
    /// Saturating: a lease clock reading never wraps.
    fn add(self, d: Duration) -> LeaseInstant {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        LeaseInstant(self.0.saturating_add(us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/uptime`'s first field is `CLOCK_BOOTTIME` in seconds with two
    /// decimals (the kernel's `ktime_get_boottime`): an oracle that does not
    /// go through this module.
    fn proc_uptime_us() -> u64 {
        let s = std::fs::read_to_string("/proc/uptime").unwrap();
        let secs: f64 = s.split_whitespace().next().unwrap().parse().unwrap();
        (secs * 1e6) as u64
    }

    #[test]
    fn reads_the_boot_clock_not_the_wall_clock() {
        let before = proc_uptime_us();
        let now = LeaseInstant::now().as_micros();
        let after = proc_uptime_us();
        // /proc/uptime has 10 ms resolution.
        assert!(
            now + 20_000 >= before && now <= after + 20_000,
            "lease clock {now} µs, /proc/uptime {before}..{after} µs"
        );
        let unix_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64;
        assert!(now < unix_us / 2, "{now} µs looks like wall-clock time");
    }

    #[test]
    fn addition_saturates_and_differences_do_not_underflow() {
        let t = LeaseInstant::from_micros(u64::MAX - 5);
        assert_eq!((t + Duration::from_secs(1)).as_micros(), u64::MAX);
        let a = LeaseInstant::from_micros(10);
        let b = LeaseInstant::from_micros(25);
        assert_eq!(b.micros_since(a), 15);
        assert_eq!(a.micros_since(b), 0);
    }
}
