//! The bank owner killed row: the owner child process (child role
//! [`CHILD_SUBCOMMAND`], [`child_main`]), its hello, and the parent that
//! SIGKILLs it and watches its lease lapse and its bank get reclaimed.

use super::*;
use crate::child_process::{ChildProcess, ChildStderr};

// ---------------------------------------------------------------- child ---

#[derive(serde::Serialize, serde::Deserialize)]
struct ChildHello {
    pid: u32,
    manifest_hex: String,
    entries: Vec<(u64, u32)>,
}

/// Child side of [`owner_killed`]: `args` follow [`CHILD_SUBCOMMAND`]:
/// `<shm prefix> <lease ms> <renew ms> <max life ms>`. Creates a TP2 host
/// bank under the prefix with background lease renewal, stores 3 blocks,
/// prints one JSON line (pid, manifest, slots), then lives until killed or
/// `max life` passes (then closes the bank and exits 0). Returns the exit
/// code (2 on an error, printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    match child(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{CHILD_SUBCOMMAND}: {e}");
            2
        }
    }
}

fn child(args: &[String]) -> Result<(), BankError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != CHILD_SUBCOMMAND).collect();
    let [prefix, lease_ms, renew_ms, life_ms] = args.as_slice() else {
        return Err(BankError::arg(
            "args",
            format!("expected <prefix> <lease ms> <renew ms> <max life ms>, got {args:?}"),
        ));
    };
    let ms = |field: &'static str, s: &str| -> Result<Duration, BankError> {
        s.parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|e| BankError::arg(field, format!("{s:?}: {e}")))
    };
    let layout = small_layout()?;
    let mut cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        4 * layout.block_bytes() as u64,
    );
    cfg.shm_prefix = prefix.to_string();
    cfg.lease = LeaseConfig::background(ms("lease_ms", lease_ms)?, ms("renew_ms", renew_ms)?);
    let bank = BankManager::new_host_shm(cfg, "fault-host")?;
    let entries = fill(&bank, 40, 3)?;
    let hello = ChildHello {
        pid: std::process::id(),
        manifest_hex: crate::gpu_check::hex(&bank.manifest().to_wire()?),
        entries: entries.iter().map(|(h, s)| (h.0, *s)).collect(),
    };
    println!(
        "{}",
        serde_json::to_string(&hello).map_err(|e| BankError::Child(e.to_string()))?
    );
    std::thread::sleep(ms("max_life_ms", life_ms)?);
    bank.close(Duration::from_secs(1))
}

// ---------------------------------------------------------- owner killed ---

/// What [`owner_killed`] observed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OwnerKilledOutcome {
    /// The child's pid.
    pub child_pid: u32,
    /// Ranks imported through [`HostShmMemory::open_descriptor`] while the owner lived.
    pub live_imports: u32,
    /// Slot bytes read in those imports that differed from what the child wrote.
    pub live_mismatched_bytes: u64,
    /// Lease renewals seen while the owner lived (fewest over ranks).
    pub renewals_seen: u64,
    /// Ranks a reclaim scan reclaimed while the owner lived (must be 0).
    pub reclaimed_while_live: usize,
    /// Milliseconds from the kill until every lease read expired.
    pub lapse_after_kill_ms: u64,
    /// Errors of imports tried after the lapse, before reclamation.
    pub refused_before_reclaim: Vec<String>,
    /// The reclamation scan.
    pub reclaim: ReclaimReport,
    /// Errors of imports tried after reclamation.
    pub refused_after_reclaim: Vec<String>,
    /// Imports that succeeded after the lapse (must be 0).
    pub false_imports: u32,
    /// Entries under the prefix left after reclamation (must be none).
    pub entries_left: Vec<String>,
    /// Leaks of this (parent) process over the whole run.
    pub parent_leaks: Vec<String>,
}

/// Starts a lease-owner child (`exe <prefix...> bank-lease-owner ...`) with
/// `lease` renewed every `lease / 6`, imports its bank while it lives,
/// SIGKILLs it, waits for the lease to lapse, checks imports are refused,
/// reclaims, and checks nothing is left and imports stay refused.
///
/// # Errors
/// [`BankError::Child`] when the child cannot start or says nothing within
/// 30 s; bank errors of the parent's own steps that are not the expected refusals.
pub fn owner_killed(
    exe: &Path,
    child_args_prefix: &[String],
    lease: Duration,
) -> Result<OwnerKilledOutcome, BankError> {
    let before = leaks::snapshot();
    let prefix = unique_prefix("k");
    let renew = lease / 6;
    let mut cmd = Command::new(exe);
    cmd.args(child_args_prefix).arg(CHILD_SUBCOMMAND).args([
        prefix.clone(),
        lease.as_millis().to_string(),
        renew.as_millis().max(1).to_string(),
        "60000".into(),
    ]);
    let mut child = ChildProcess::spawn(cmd, ChildStderr::Null)?;
    let result = (|| {
        let hello: ChildHello = child.next_json("hello", Duration::from_secs(30))?;
        observe_owner(&child, hello, &prefix, lease, renew)
    })();
    // Whatever happened, the child must not outlive this call.
    drop(child);
    // Belt and braces for a failed run: never leave the child's bank behind.
    let _ = reclaim_stale(&prefix, ScanTime::now().later(lease * 2));
    let mut out = result?;
    out.parent_leaks = leaks::snapshot()
        .leaks_since(&before)
        .iter()
        .map(ToString::to_string)
        .collect();
    Ok(out)
}

fn observe_owner(
    child: &ChildProcess,
    hello: ChildHello,
    prefix: &str,
    lease: Duration,
    renew: Duration,
) -> Result<OwnerKilledOutcome, BankError> {
    let bytes = crate::gpu_check::unhex(&hello.manifest_hex)?;
    let manifest = BankManifest::from_wire(&bytes)?;
    let lease_names: Vec<String> = manifest.parts().iter().map(crate::lease_name_for).collect();
    let renewals = || {
        lease_names
            .iter()
            .map(|n| read_lease(n).map(|r| r.renewals).unwrap_or(0))
            .min()
            .unwrap_or(0)
    };
    let mut live_imports = 0;
    let mut mismatched = 0u64;
    for d in manifest.parts() {
        let m = HostShmMemory::open_descriptor(d)?;
        live_imports += 1;
        let len = d.slot_bytes() as usize;
        for &(h, slot) in &hello.entries {
            let mut got = vec![0u8; len];
            m.read_bytes(slot as usize * len, &mut got)?;
            let want = pattern(SequenceHash(h), d.tp_rank(), len);
            mismatched += got.iter().zip(&want).filter(|(a, b)| a != b).count() as u64;
        }
    }
    // Let the owner renew a few times, then prove a scan leaves it alone.
    let t = Instant::now();
    while renewals() < 2 && t.elapsed() < lease * 4 {
        std::thread::sleep(renew / 2);
    }
    let renewals_seen = renewals();
    let live_scan = reclaim_stale(prefix, ScanTime::now())?;

    child.kill();
    let killed = Instant::now();
    let all_lapsed = || {
        let now = crate::LeaseInstant::now();
        lease_names
            .iter()
            .all(|n| read_lease(n).map_or(true, |r| !r.is_live(now)))
    };
    while !all_lapsed() {
        if killed.elapsed() > lease * 3 + Duration::from_secs(2) {
            return Err(BankError::Child(
                "lease still live long after the kill".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let lapse_after_kill_ms = killed.elapsed().as_millis() as u64;

    let mut false_imports = 0;
    let mut try_imports = |out: &mut Vec<String>| {
        for d in manifest.parts() {
            match HostShmMemory::open_descriptor(d) {
                Ok(_) => false_imports += 1,
                Err(e) => out.push(e.to_string()),
            }
            if let ExportHandle::HostShm { name } = d.export() {
                match HostShmMemory::open(name, d.region_bytes() as usize) {
                    Ok(_) => false_imports += 1,
                    Err(e) => out.push(e.to_string()),
                }
            }
        }
    };
    let mut refused_before_reclaim = Vec::new();
    try_imports(&mut refused_before_reclaim);
    let reclaim = reclaim_stale(prefix, ScanTime::now())?;
    let mut refused_after_reclaim = Vec::new();
    try_imports(&mut refused_after_reclaim);
    Ok(OwnerKilledOutcome {
        child_pid: hello.pid,
        live_imports,
        live_mismatched_bytes: mismatched,
        renewals_seen,
        reclaimed_while_live: live_scan.reclaimed.len(),
        lapse_after_kill_ms,
        refused_before_reclaim,
        reclaim,
        refused_after_reclaim,
        false_imports,
        entries_left: shm_names(prefix),
        parent_leaks: Vec::new(),
    })
}

pub(super) fn owner_killed_row(exe: &Path, prefix: &[String]) -> FaultRow {
    const FAULT: &str = "bank_owner_killed";
    match owner_killed(exe, prefix, Duration::from_millis(600)) {
        Err(e) => FaultRow::failed_setup(FAULT, e),
        Ok(o) => {
            let tp = o.live_imports as usize;
            let fell_back = o.live_imports == 2
                && o.live_mismatched_bytes == 0
                && o.reclaimed_while_live == 0
                && o.refused_before_reclaim.len() == 2 * tp
                && o.refused_after_reclaim.len() == 2 * tp
                && o.reclaim.reclaimed.len() == tp
                && o.reclaim
                    .reclaimed
                    .iter()
                    .all(|r| !r.owner_alive && r.segment.is_some());
            FaultRow {
                fault: FAULT.into(),
                runs: 1,
                fallbacks: u32::from(fell_back),
                false_completions: o.false_imports + o.reclaimed_while_live as u32,
                leaks: (o.entries_left.len() + o.parent_leaks.len()) as u32,
                detail: format!(
                    "child {} imported on {} ranks ({} bytes differ), {} renewals, {} reclaimed while live; \
                     lease lapsed {} ms after SIGKILL; {} imports refused before and {} after reclaiming {} ranks; \
                     left {:?}; parent leaks {:?}",
                    o.child_pid,
                    o.live_imports,
                    o.live_mismatched_bytes,
                    o.renewals_seen,
                    o.reclaimed_while_live,
                    o.lapse_after_kill_ms,
                    o.refused_before_reclaim.len(),
                    o.refused_after_reclaim.len(),
                    o.reclaim.reclaimed.len(),
                    o.entries_left,
                    o.parent_leaks
                ),
            }
        }
    }
}
