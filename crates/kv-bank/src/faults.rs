//! Bank-level rows of the qualify fault matrix (issue #11): each fault is
//! injected for real, must end in a fallback (the consumer is refused and
//! computes normally), must never look like a success, and must leave no
//! leak (compared with [`crate::leaks`] snapshots, checked, not assumed).
//!
//! | fault | injected by | expected |
//! | --- | --- | --- |
//! | `bank_owner_killed` | SIGKILL of a child process that owns a TP2 host bank and renews its lease | imports work while it lives; after the kill its lease lapses, imports are refused before and after reclamation, [`crate::reclaim_stale`] removes every segment and lease |
//! | `bank_owner_stalled` | an owner (manual renewal) that stops renewing | importers refused once lapsed, reclaimed while its pid lives, the owner's own pins and renewals refused |
//! | `forged_hint` | hints with a wrong engine id, wrong generation, out-of-range slot, slot holding another block, wrong layout | every one refused by `pin_hint` with zero memory reads and no pin |
//! | `stale_bank_generation` | descriptors and hints of a closed generation after the owner opened the next | refused (lease gone, generation mismatch) |
//! | `bank_allocation_failure` | a failing rank allocation, a lease that cannot be created, an impossible segment size, a full destination pool | an error, and nothing registered or left behind |
//!
//! [`owner_killed`] needs a child process: the caller passes the executable
//! and the arguments that lead it to [`child_main`] (the kvq runner:
//! `kvq child bank-lease-owner ...`; a test binary: its own filter).

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{
    BankManifest, DType, ExportHandle, FetchGpuHint, FetchPart, KvLayout, LayoutFingerprint,
    MemoryLocation, OwnerLease, Role, SequenceHash, TensorOrder, Wire,
};

use crate::leaks::{self, shm_names};
use crate::reclaim::ScanTime;
use crate::{
    read_lease, reclaim_stale, sealed_blocks, BankConfig, BankError, BankManager, BankMemory,
    DestinationPool, HostShmMemory, LeaseConfig, MemoryKind, RankMemory, ReclaimReport,
};

mod forged;
mod owner;

use forged::forged_hints;
#[cfg(test)]
use forged::forged_hints_with;
pub use forged::{forged_variants, hint_for, tripwire_bank, TripwireMemory};
use owner::owner_killed_row;
pub use owner::{child_main, owner_killed, OwnerKilledOutcome};

/// The subcommand word the lease-owner child is started with.
pub const CHILD_SUBCOMMAND: &str = "bank-lease-owner";

/// One row of the fault table, as recorded in `record.json` `faults[]`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FaultRow {
    /// Fault name (`bank_owner_killed`, ...).
    pub fault: String,
    /// Injections run.
    pub runs: u32,
    /// Injections that ended in the expected fallback (refusal, no effect).
    pub fallbacks: u32,
    /// Injections that reported or allowed success where they must not.
    pub false_completions: u32,
    /// Leaked resources (file descriptors, shm entries, mappings, pins,
    /// reservations, leases, threads, memory reads where none may happen).
    pub leaks: u32,
    /// What was observed, for the report.
    pub detail: String,
}

impl FaultRow {
    /// True when every run fell back, none falsely completed and nothing leaked.
    pub fn passed(&self) -> bool {
        self.runs > 0
            && self.fallbacks == self.runs
            && self.false_completions == 0
            && self.leaks == 0
    }

    fn failed_setup(fault: &str, e: impl std::fmt::Display) -> Self {
        Self {
            fault: fault.into(),
            runs: 1,
            fallbacks: 0,
            false_completions: 0,
            leaks: 0,
            detail: format!("setup failed: {e}"),
        }
    }
}

/// Runs every bank-level fault (see the module docs) and returns one row
/// each. `exe` plus `child_args_prefix` must start [`child_main`] when
/// followed by [`CHILD_SUBCOMMAND`] and its arguments. Never panics: a
/// setup failure is a row with no fallback. Takes about 2 s (lease expiries).
///
/// Leak counts compare process-wide snapshots: run it while no other bank
/// work of this process is in flight.
pub fn qualify_faults(exe: &Path, child_args_prefix: &[String]) -> Vec<FaultRow> {
    vec![
        owner_killed_row(exe, child_args_prefix),
        owner_stalled(),
        forged_hints(),
        stale_generation(),
        allocation_failure(),
    ]
}

fn unique_prefix(tag: &str) -> String {
    format!("kvbank-{tag}{:08x}", uuid::Uuid::new_v4().as_u128() as u32)
}

fn small_layout() -> Result<KvLayout, BankError> {
    Ok(KvLayout::new(
        2,
        4,
        8,
        DType::F32,
        4,
        TensorOrder::BlockMajor,
        2,
    )?)
}

fn pattern(h: SequenceHash, rank: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (h.0 >> ((i % 8) * 8)) as u8 ^ (rank as u8).wrapping_mul(131) ^ (i as u8))
        .collect()
}

/// Stores `n` blocks of a fresh chain with every rank's pattern, ready.
fn fill(bank: &BankManager, seed: u32, n: u32) -> Result<Vec<(SequenceHash, u32)>, BankError> {
    let tpb = bank.manifest().layout().tokens_per_block();
    let tokens: Vec<u32> = (seed..seed + n * tpb).collect();
    let blocks = sealed_blocks(None, &tokens, tpb as usize);
    let p = bank.store(None, &blocks)?;
    for r in 0..bank.manifest().tp_size() {
        let len = bank.manifest().parts()[r as usize].slot_bytes() as usize;
        for (index, (h, _)) in p.entries.iter().enumerate() {
            bank.write_pending(p.store_id, r, index, &pattern(*h, r, len))?;
        }
        bank.ack(p.store_id, r)?;
    }
    Ok(p.entries)
}

// --------------------------------------------------------- owner stalled ---

fn owner_stalled() -> FaultRow {
    const FAULT: &str = "bank_owner_stalled";
    let before = leaks::snapshot();
    let r = (|| -> Result<(bool, bool, String), BankError> {
        let layout = small_layout()?;
        let prefix = unique_prefix("s");
        let mut cfg = BankConfig::new(
            layout,
            OwnerLease::fresh(Role::Decode),
            4 * layout.block_bytes() as u64,
        );
        cfg.shm_prefix = prefix.clone();
        cfg.lease = LeaseConfig::manual(Duration::from_millis(150));
        let bank = BankManager::new_host_shm(cfg, "fault-host")?;
        let entries = fill(&bank, 7, 2)?;
        let renewed = bank.renew_lease().is_ok();
        let d = bank.manifest().parts()[0].clone();
        let live_import = HostShmMemory::open_descriptor(&d).is_ok();
        // The owner stalls: no renewal until the lease lapsed.
        let t = Instant::now();
        while bank.lease_status().live && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let import = HostShmMemory::open_descriptor(&d);
        let reclaim = reclaim_stale(&prefix, ScanTime::now())?;
        let hint = hint_for(&bank, &entries);
        let pin = bank.pin_hint(&hint);
        let renew = bank.renew_lease();
        let cleared = bank
            .drain_events()
            .iter()
            .any(|e| matches!(e.data, kv_descriptor::KvEventData::Cleared));
        let left = shm_names(&prefix);
        let false_completion = import.is_ok() || pin.is_ok() || renew.is_ok();
        let fell_back = renewed
            && live_import
            && matches!(import, Err(BankError::LeaseExpired { .. }))
            && reclaim.reclaimed.len() == 2
            && reclaim.reclaimed.iter().all(|r| r.owner_alive)
            && pin.is_err()
            && renew.is_err()
            && cleared
            && left.is_empty();
        let detail = format!(
            "live import {live_import}; after the lapse import: {}; reclaimed {} ranks (owner alive: {}); \
             owner pin_hint: {}; renew: {}; Cleared event {cleared}; left {left:?}",
            err_text(&import),
            reclaim.reclaimed.len(),
            reclaim.reclaimed.iter().all(|r| r.owner_alive),
            err_text(&pin),
            err_text(&renew),
        );
        drop(pin);
        drop(bank);
        Ok((fell_back, false_completion, detail))
    })();
    finish_row(FAULT, 1, r, &before)
}

fn err_text<T>(r: &Result<T, BankError>) -> String {
    match r {
        Ok(_) => "accepted".into(),
        Err(e) => format!("refused ({e})"),
    }
}

fn finish_row(
    fault: &str,
    runs: u32,
    r: Result<(bool, bool, String), BankError>,
    before: &leaks::LeakSnapshot,
) -> FaultRow {
    match r {
        Err(e) => FaultRow::failed_setup(fault, e),
        Ok((fell_back, false_completion, detail)) => {
            let leaked: Vec<String> = leaks::snapshot()
                .leaks_since(before)
                .iter()
                .map(ToString::to_string)
                .collect();
            FaultRow {
                fault: fault.into(),
                runs,
                fallbacks: if fell_back { runs } else { 0 },
                false_completions: u32::from(false_completion),
                leaks: leaked.len() as u32,
                detail: if leaked.is_empty() {
                    detail
                } else {
                    format!("{detail}; leaked {leaked:?}")
                },
            }
        }
    }
}

// ---------------------------------------------------------- forged hints ---

fn stale_generation() -> FaultRow {
    const FAULT: &str = "stale_bank_generation";
    let before = leaks::snapshot();
    let r = (|| -> Result<(bool, bool, String), BankError> {
        let layout = small_layout()?;
        let owner = OwnerLease::fresh(Role::Decode);
        let mk = |owner: OwnerLease| {
            let mut cfg = BankConfig::new(layout, owner, 4 * layout.block_bytes() as u64);
            cfg.shm_prefix = unique_prefix("g");
            BankManager::new_host_shm(cfg, "fault-host")
        };
        let g1 = mk(owner)?;
        let e1 = fill(&g1, 5, 2)?;
        let old_hint = hint_for(&g1, &e1);
        let old = g1.manifest().parts()[0].clone();
        g1.close(Duration::from_secs(1))?;
        let g2 = mk(owner.next_generation())?;
        let e2 = fill(&g2, 5, 2)?;
        let import_old = HostShmMemory::open_descriptor(&old);
        let pin_old = g2.pin_hint(&old_hint);
        let import_new = HostShmMemory::open_descriptor(&g2.manifest().parts()[0]);
        let pin_new = g2.pin_hint(&hint_for(&g2, &e2));
        let fell_back = import_old.is_err()
            && matches!(
                pin_old,
                Err(BankError::StaleOwner {
                    field: "bank_generation",
                    ..
                })
            )
            && import_new.is_ok()
            && pin_new.is_ok();
        let detail = format!(
            "generation 1 descriptor import: {}; generation 1 hint on generation 2: {}; \
             generation 2 import ok {}, pin ok {}",
            err_text(&import_old),
            err_text(&pin_old),
            import_new.is_ok(),
            pin_new.is_ok()
        );
        let false_completion = import_old.is_ok() || pin_old.is_ok();
        drop((pin_new, import_new));
        g2.close(Duration::from_secs(1))?;
        Ok((fell_back, false_completion, detail))
    })();
    finish_row(FAULT, 2, r, &before)
}

// ---------------------------------------------------- allocation failure ---

fn allocation_failure() -> FaultRow {
    const FAULT: &str = "bank_allocation_failure";
    let before = leaks::snapshot();
    let mut runs = 0;
    let mut fallbacks = 0;
    let mut false_completions = 0;
    let mut seen = Vec::new();
    let mut record = |name: &str, r: Result<(), BankError>| {
        runs += 1;
        match r {
            Ok(()) => false_completions += 1,
            Err(e) => {
                fallbacks += 1;
                seen.push(format!("{name}: {e}"));
            }
        }
    };
    let layout = match small_layout() {
        Ok(l) => l,
        Err(e) => return FaultRow::failed_setup(FAULT, e),
    };
    let cfg = || {
        let mut c = BankConfig::new(
            layout,
            OwnerLease::fresh(Role::Decode),
            4 * layout.block_bytes() as u64,
        );
        c.shm_prefix = unique_prefix("a");
        c
    };
    for failing in 0..layout.tp_size() {
        let c = cfg();
        let prefix = c.shm_prefix.clone();
        let r = BankManager::new(c, move |rank, len| {
            if rank == failing {
                return Err(BankError::HostMemory {
                    name: format!("/rank{rank}"),
                    op: "mmap",
                    source: std::io::Error::from(rustix::io::Errno::NOMEM),
                });
            }
            Ok(RankMemory {
                memory: Arc::new(HostShmMemory::create_unique(&prefix, len)?),
                location: MemoryLocation::Host {
                    host_id: "fault-host".into(),
                },
            })
        });
        record("rank_allocation", r.map(drop));
    }
    // The lease of rank 1 cannot be created (its name is taken).
    let c = cfg();
    let prefix = c.shm_prefix.clone();
    let squatter = std::sync::Mutex::new(None);
    let r = BankManager::new(c, |rank, len| {
        let m = HostShmMemory::create_unique(&prefix, len)?;
        if rank == 1 {
            let p = crate::lease::shm_path(&format!("{}{}", m.name(), crate::lease::LEASE_SUFFIX));
            std::fs::write(&p, b"squatter").map_err(|source| BankError::HostMemory {
                name: p.clone(),
                op: "write",
                source,
            })?;
            *squatter.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
        }
        Ok(RankMemory {
            memory: Arc::new(m),
            location: MemoryLocation::Host {
                host_id: "fault-host".into(),
            },
        })
    });
    if let Some(p) = squatter.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = std::fs::remove_file(p);
    }
    record("lease_creation", r.map(drop));
    record(
        "impossible_segment_size",
        HostShmMemory::create_unique(&unique_prefix("a"), 1 << 50).map(drop),
    );
    let pool = DestinationPool::new(4);
    record("destination_pool_full", pool.reserve(5).map(drop));
    drop(pool);
    let leaked: Vec<String> = leaks::snapshot()
        .leaks_since(&before)
        .iter()
        .map(ToString::to_string)
        .collect();
    FaultRow {
        fault: FAULT.into(),
        runs,
        fallbacks,
        false_completions,
        leaks: leaked.len() as u32,
        detail: format!("{seen:?}; leaked {leaked:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forged_hint_row_fails_when_even_the_honest_hint_is_refused() {
        // A pin_hint that refuses everything refuses every forgery too; the
        // row must not count that as five correct fallbacks.
        let row = forged_hints_with(|_, _| Err(BankError::arg("hint", "refuses everything")));
        assert!(!row.passed(), "{row:#?}");
        assert_eq!(row.fallbacks, 0, "{row:#?}");
        // The real pin_hint passes the row (leaks aside: process-wide counts).
        let real = forged_hints();
        assert_eq!((real.runs, real.fallbacks), (5, 5), "{real:#?}");
    }
}
