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

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
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
        let rb = bank.rank(r)?;
        let len = rb.descriptor().slot_bytes() as usize;
        for (h, slot) in &p.entries {
            rb.write_slot(*slot, &pattern(*h, r, len))?;
        }
        bank.ack(p.store_id, r)?;
    }
    Ok(p.entries)
}

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

fn read_child_hello(
    lines: &mpsc::Receiver<String>,
    deadline: Instant,
) -> Result<ChildHello, BankError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .map_err(|e| BankError::Child(format!("no hello line from the child: {e}")))?;
        if let Some(at) = line.find('{') {
            if let Ok(h) = serde_json::from_str::<ChildHello>(&line[at..]) {
                return Ok(h);
            }
        }
    }
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
    let mut child = Command::new(exe)
        .args(child_args_prefix)
        .arg(CHILD_SUBCOMMAND)
        .args([
            prefix.clone(),
            lease.as_millis().to_string(),
            renew.as_millis().max(1).to_string(),
            "60000".into(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| BankError::Child(format!("cannot start {}: {e}", exe.display())))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let result = (|| {
        let hello = read_child_hello(&rx, Instant::now() + Duration::from_secs(30))?;
        observe_owner(&mut child, hello, &prefix, lease, renew)
    })();
    // Whatever happened, the child must not outlive this call.
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
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
    child: &mut std::process::Child,
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

    child
        .kill()
        .map_err(|e| BankError::Child(format!("kill: {e}")))?;
    let killed = Instant::now();
    let _ = child.wait();
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

fn owner_killed_row(exe: &Path, prefix: &[String]) -> FaultRow {
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

/// Host shared memory that counts every read of its bytes or address, so a
/// check can prove it never touched memory.
#[derive(Debug)]
pub struct TripwireMemory {
    inner: HostShmMemory,
    reads: Arc<AtomicU64>,
}

impl TripwireMemory {
    /// A fresh `len`-byte shm region under `prefix`, counting into `reads`.
    ///
    /// # Errors
    /// As [`HostShmMemory::create_unique`].
    pub fn new(prefix: &str, len: usize, reads: Arc<AtomicU64>) -> Result<Self, BankError> {
        Ok(Self {
            inner: HostShmMemory::create_unique(prefix, len)?,
            reads,
        })
    }
}

impl BankMemory for TripwireMemory {
    fn kind(&self) -> MemoryKind {
        self.inner.kind()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    /// Counted: handing out the address is how a transfer would read it.
    fn base_addr(&self) -> u64 {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.base_addr()
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        self.inner.export_handle()
    }
    fn mapped_export(&self) -> Option<ExportHandle> {
        self.inner.mapped_export()
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        self.inner.write_bytes(offset, src)
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read_bytes(offset, dst)
    }
}

/// A TP2 bank on [`TripwireMemory`]; `reads` counts memory touches.
///
/// # Errors
/// As [`BankManager::new`].
pub fn tripwire_bank(reads: Arc<AtomicU64>) -> Result<BankManager, BankError> {
    let layout = small_layout()?;
    let mut cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        8 * layout.block_bytes() as u64,
    );
    cfg.shm_prefix = unique_prefix("f");
    let prefix = cfg.shm_prefix.clone();
    BankManager::new(cfg, move |_, len| {
        Ok(RankMemory {
            memory: Arc::new(TripwireMemory::new(&prefix, len, reads.clone())?),
            location: MemoryLocation::Host {
                host_id: "fault-host".into(),
            },
        })
    })
}

/// The honest hint for `entries` (all ranks, fetch from 0).
pub fn hint_for(bank: &BankManager, entries: &[(SequenceHash, u32)]) -> FetchGpuHint {
    let m = bank.manifest();
    let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
    FetchGpuHint {
        donor_engine_id: bank.owner().engine_id,
        bank_generation: bank.owner().generation,
        layout_fingerprint: m.layout().fingerprint(),
        tp_size: m.tp_size(),
        sequence_hashes: entries.iter().map(|e| e.0).collect(),
        fetch_from: 0,
        parts: (0..m.tp_size())
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: slots.len() as u64 * m.parts()[0].slot_bytes(),
            })
            .collect(),
        donor_control_endpoint: "local".into(),
    }
}

/// The forged variants of an honest hint: (name, hint).
pub fn forged_variants(
    bank: &BankManager,
    good: &FetchGpuHint,
) -> Vec<(&'static str, FetchGpuHint)> {
    let mut v = Vec::new();
    let mut h = good.clone();
    h.donor_engine_id = kv_descriptor::EngineId::fresh();
    v.push(("wrong_engine_id", h));
    let mut h = good.clone();
    h.bank_generation += 1;
    v.push(("wrong_generation", h));
    let mut h = good.clone();
    for p in &mut h.parts {
        p.slot_ids[0] = bank.manifest().slot_count();
    }
    v.push(("out_of_range_slot", h));
    let mut h = good.clone();
    for p in &mut h.parts {
        p.slot_ids.reverse();
    }
    v.push(("slot_holds_another_block", h));
    let mut h = good.clone();
    h.layout_fingerprint = LayoutFingerprint(good.layout_fingerprint.0 ^ 1);
    v.push(("wrong_layout", h));
    v
}

fn forged_hints() -> FaultRow {
    forged_hints_with(BankManager::pin_hint)
}

/// The `forged_hint` row with `pin` standing for [`BankManager::pin_hint`].
fn forged_hints_with(
    pin: impl Fn(&BankManager, &FetchGpuHint) -> Result<crate::ManagerPin, BankError>,
) -> FaultRow {
    const FAULT: &str = "forged_hint";
    let before = leaks::snapshot();
    let reads = Arc::new(AtomicU64::new(0));
    let r = (|| -> Result<(u32, u32, u64, bool, String), BankError> {
        let bank = tripwire_bank(reads.clone())?;
        let entries = fill(&bank, 300, 3)?;
        let good = hint_for(&bank, &entries);
        let base = reads.load(Ordering::Relaxed);
        let mut refused = 0;
        let mut accepted = 0;
        let mut seen = Vec::new();
        for (name, h) in forged_variants(&bank, &good) {
            match pin(&bank, &h) {
                Ok(_) => accepted += 1,
                Err(e) => {
                    refused += 1;
                    seen.push(format!("{name}: {e}"));
                }
            }
        }
        let touched = reads.load(Ordering::Relaxed) - base;
        let pins = bank.pins_outstanding();
        // Control: the honest hint pins, so the refusals were not blanket.
        let honest = pin(&bank, &good).map(|p| p.slots().len());
        let control = honest.as_ref().is_ok_and(|&n| n == entries.len());
        let detail = format!(
            "{refused} refused, {accepted} accepted, {touched} memory reads, {pins} pins left; \
             honest hint pinned {honest:?}; {seen:?}"
        );
        bank.close(Duration::from_secs(1))?;
        Ok((refused, accepted, touched + pins, control, detail))
    })();
    match r {
        Err(e) => FaultRow::failed_setup(FAULT, e),
        Ok((refused, accepted, touched, control, detail)) => {
            let leaked = leaks::snapshot().leaks_since(&before);
            FaultRow {
                fault: FAULT.into(),
                runs: refused + accepted,
                // Refusals count only when the honest hint pinned: a pin_hint
                // that refuses everything is no fallback to credit.
                fallbacks: if control { refused } else { 0 },
                false_completions: accepted,
                leaks: touched as u32 + leaked.len() as u32,
                detail: if leaked.is_empty() {
                    detail
                } else {
                    format!("{detail}; leaked {leaked:?}")
                },
            }
        }
    }
}

// ------------------------------------------------------ stale generation ---

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
                    source: std::io::Error::from_raw_os_error(libc::ENOMEM),
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
