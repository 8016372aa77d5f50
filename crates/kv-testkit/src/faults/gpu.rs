//! GPU-profile fault rows: the same faults as the host matrix, with the
//! donor bank and the target's destination rows in CUDA device memory and
//! the bytes moved by kv-transfer's [`CudaCopyBackend`], the production GPU
//! path. Never mocked: without `libcuda` or a device every entry point
//! returns [`FaultError::Skipped`] with the reason.
//!
//! | row | injected by | expected |
//! | --- | --- | --- |
//! | `donor_killed_mid_transfer_gpu` | a child process (`kvq child fault-donor-gpu`) owns a TP-N device bank (one [`kv_bank::CudaDeviceMemory`] per rank, exported by CUDA IPC handle); the parent imports every rank through the mapping cache ([`CudaIpcImport::open_descriptor`]) and fetches with [`CudaCopyBackend`]; SIGKILL of the child from inside the delivery (first run: after every part copied, before verification; second run: before the last rank's part, i.e. between the parts at TP2 and before the only part at TP1, so the copy then reads a dead process's memory) | liveness probe refuses; no completion; every import of the dead donor closed (re-importing its handle is not a cache hit); its leases reclaimed; device memory back to baseline |
//! | `cancel_at_transfer_gpu` | in-process device bank; cancelled before the last rank's part | refused, rows free |
//! | `deadline_passed_gpu` | in-process device bank; 30 ms deadline, the last rank stalls 60 ms | `DeadlineExceeded` |
//! | `none_gpu` (control) | nothing | the fetch completes from device memory and the outputs computed on the fetched K/V equal recompute: proves the checks can see a completion |
//!
//! TP is the number of visible devices, at most 2 (a manifest refuses two
//! ranks on one GPU, so a one-GPU machine runs TP1); rank `r` lives on device `r`.
//!
//! Each run is checked like the host rows (fell back, no false completion,
//! outputs equal recompute bit for bit, destination rows free and, where the
//! fault strikes before the first byte, still holding their poison, and an
//! equal [`kv_bank::leaks`] snapshot: fds, device allocations and bytes, IPC
//! mappings, pins, reserved rows, leases, threads), plus two device checks:
//!
//! - **device memory** (`cuMemGetInfo`, device-wide): free bytes of every
//!   device used, after teardown, are back to their value before the run's
//!   setup within [`DEVICE_FREE_TOLERANCE_BYTES`] (polled for up to 5 s,
//!   because a killed process's memory is released by the driver as its
//!   files close). The donor bank is sized [`DONOR_RANK_BYTES`] per rank so
//!   that a bank left allocated, or a dead donor's allocation kept alive by
//!   a mapping this process forgot to close, is 16 times the tolerance; the
//!   run also checks the measurement is sensitive: free bytes while the
//!   donor's bank existed were at least [`DONOR_RANK_BYTES`] per rank lower.
//! - **IPC mappings** (child row): every mapping opened in the run was closed
//!   (cache counters), none is live, and opening the dead donor's handle
//!   again is not served from the cache.
//!
//! Tolerance: 4 MiB is two 2 MiB pages, the driver's allocation granularity.
//! Small allocations (the destination rows, a few KiB per rank here; the CUDA
//! backend's stream) are sub-allocated from such pages, and a freed page may
//! stay with the context, so a smaller bound would report noise. Everything
//! that matters is much larger: a donor bank rank ([`DONOR_RANK_BYTES`]), a
//! dead child's context (hundreds of MiB), and destination rows leak into
//! the exact `device_allocations` / `device_bytes` counters as well.
//!
//! One-time per-process driver state (first module load, first IPC import,
//! driver fds) is not a leak of a run: [`gpu_fault_table`] runs one untimed
//! warm-up of the control and of the child row first and reports what it
//! left (`warmup` in [`GpuFaultTable`]) instead of hiding it.

use kv_bank::{
    cuda_probe, device_memory_info, ipc_cache_stats, CudaDeviceMemory, CudaIpcImport, IpcCacheStats,
};
use kv_descriptor::MemoryLocation;
use kv_transfer::cuda::{CudaCopyBackend, CudaMode};

use super::*;

/// The `kvq child` role of the GPU donor child process ([`child_main`]).
pub const GPU_CHILD_ROLE: &str = "fault-donor-gpu";
/// Bytes of each donor bank rank (slots beyond the conversation stay free):
/// large enough that the device memory check sees a bank, 16 x the tolerance.
pub const DONOR_RANK_BYTES: u64 = 64 << 20;
/// Free device bytes may differ by this much between before and after a run
/// (see the module docs for why).
pub const DEVICE_FREE_TOLERANCE_BYTES: u64 = 4 << 20;
/// How long a run waits for device memory to return to its baseline.
const DEVICE_SETTLE: Duration = Duration::from_secs(5);

/// One GPU fault row (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuFault {
    /// Control run: the fetch from device memory must complete.
    None,
    /// SIGKILL of the child owning the device bank, mid-delivery.
    DonorKilledMidTransfer,
    /// Cancelled before the last rank's part.
    CancelAtTransfer,
    /// The deadline passes while the last rank stalls.
    DeadlinePassed,
}

impl GpuFault {
    /// Every row, in table order.
    ///
    /// The child row runs last: its kill-before-copy run reads a dead
    /// process's device memory, and should the driver ever poison this
    /// process's context for it, the other rows are measured already.
    pub const ALL: [GpuFault; 4] = [
        GpuFault::CancelAtTransfer,
        GpuFault::DeadlinePassed,
        GpuFault::None,
        GpuFault::DonorKilledMidTransfer,
    ];

    /// Row name (`record.json` `faults[].fault`).
    pub fn name(self) -> &'static str {
        match self {
            GpuFault::None => "none_gpu",
            GpuFault::DonorKilledMidTransfer => "donor_killed_mid_transfer_gpu",
            GpuFault::CancelAtTransfer => "cancel_at_transfer_gpu",
            GpuFault::DeadlinePassed => "deadline_passed_gpu",
        }
    }

    /// True when the row needs the GPU donor child ([`child_command`]).
    pub fn needs_child(self) -> bool {
        self == GpuFault::DonorKilledMidTransfer
    }
}

/// `exe child fault-donor-gpu` (the kvq convention for [`child_main`]).
pub fn child_command(exe: impl Into<PathBuf>) -> ChildCommand {
    ChildCommand {
        exe: exe.into(),
        args: vec!["child".into(), GPU_CHILD_ROLE.into()],
    }
}

/// Device ordinals of the GPU rows: one per TP rank, `0..min(devices, 2)`.
///
/// # Errors
/// [`FaultError::Skipped`] with the reason when `libcuda` is missing or no
/// device is visible.
pub fn gpu_ordinals() -> Result<Vec<u32>, FaultError> {
    if !kv_transfer::cuda::driver_present() {
        return Err(FaultError::Skipped(
            "libcuda (the CUDA driver library) is not present".into(),
        ));
    }
    match kv_transfer::cuda::device_count() {
        0 => Err(FaultError::Skipped("no CUDA device visible".into())),
        n => Ok((0..n.min(2) as u32).collect()),
    }
}

/// Free bytes of one device before and after a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceFree {
    /// Device ordinal.
    pub ordinal: u32,
    /// Free bytes before the run's setup.
    pub before: u64,
    /// Lowest free bytes seen while the donor bank existed.
    pub with_bank: u64,
    /// Child row: free bytes after the donor was killed and reaped, while
    /// this process still held its imports (informative: shows whether a
    /// mapping keeps a dead donor's memory alive).
    pub while_mapped: Option<u64>,
    /// Free bytes after teardown (after waiting up to 5 s to settle).
    pub after: u64,
    /// Milliseconds waited for `after` to settle.
    pub settle_ms: u64,
}

impl DeviceFree {
    /// `before - after` in bytes (negative: more free than before).
    pub fn delta(&self) -> i64 {
        self.before as i64 - self.after as i64
    }
}

/// IPC mapping cache observations of the child row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IpcObservation {
    /// Cache counters before the run.
    pub before: IpcCacheStats,
    /// Cache counters after teardown.
    pub after: IpcCacheStats,
    /// What opening the dead donor's rank-0 handle again gave (`error: ...`
    /// or `opened (cache miss), closed`); a cache hit fails the run.
    pub reimport: String,
    /// Lease files of the dead donor reclaimed.
    pub leases_reclaimed: usize,
}

/// What one GPU run observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRunOutcome {
    /// Row name.
    pub fault: String,
    /// Conversation seed.
    pub seed: u64,
    /// TP size (devices used).
    pub tp: u32,
    /// The request recomputed instead of using fetched blocks.
    pub fell_back: bool,
    /// The executor reported a completed fetch.
    pub completed: bool,
    /// Output tokens and first logits equal recompute.
    pub outputs_match: bool,
    /// Destination rows free, poison intact where required.
    pub destination_untouched: bool,
    /// The device memory measurement saw the donor bank (see module docs).
    pub device_check_sensitive: bool,
    /// Leaked resources (`resource: before -> after`), device memory included.
    pub leaks: Vec<String>,
    /// Per-device free bytes.
    pub devices: Vec<DeviceFree>,
    /// Child row only.
    pub ipc: Option<IpcObservation>,
    /// Wall time of the run in milliseconds.
    pub wall_ms: u64,
    /// Fallback reason or what went wrong.
    pub detail: String,
}

impl GpuRunOutcome {
    fn new(fault: GpuFault, seed: u64, tp: u32) -> Self {
        Self {
            fault: fault.name().into(),
            seed,
            tp,
            fell_back: false,
            completed: false,
            outputs_match: false,
            destination_untouched: false,
            device_check_sensitive: false,
            leaks: Vec::new(),
            devices: Vec::new(),
            ipc: None,
            wall_ms: 0,
            detail: String::new(),
        }
    }

    /// The run ended as its row requires (as [`RunOutcome::passed`]), the
    /// device measurement was sensitive, and nothing leaked.
    pub fn passed(&self) -> bool {
        let ended_right = if self.fault == GpuFault::None.name() {
            self.completed
        } else {
            self.fell_back && !self.completed && self.destination_untouched
        };
        ended_right && self.outputs_match && self.device_check_sensitive && self.leaks.is_empty()
    }
}

// -------------------------------------------------------------- devices ---

fn cuda_err(op: &'static str) -> impl Fn(kv_bank::BankError) -> FaultError {
    bank_err(op)
}

fn free_bytes(ordinals: &[u32]) -> Result<Vec<u64>, FaultError> {
    ordinals
        .iter()
        .map(|&o| device_memory_info(o).map(|i| i.free_bytes))
        .collect::<Result<_, _>>()
        .map_err(cuda_err("cuMemGetInfo"))
}

/// Polls until every device is back within the tolerance of `before` (or
/// [`DEVICE_SETTLE`] passed); returns the last reading and the wait.
fn settle(ordinals: &[u32], before: &[u64]) -> Result<(Vec<u64>, u64), FaultError> {
    let t0 = Instant::now();
    loop {
        let now = free_bytes(ordinals)?;
        let ok = now
            .iter()
            .zip(before)
            .all(|(a, b)| a + DEVICE_FREE_TOLERANCE_BYTES >= *b);
        if ok || t0.elapsed() >= DEVICE_SETTLE {
            return Ok((now, t0.elapsed().as_millis() as u64));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for device memory to settle, then judges it ([`judge_devices`]).
fn device_verdict(
    o: &mut GpuRunOutcome,
    ordinals: &[u32],
    before: &[u64],
    with_bank: &[u64],
    while_mapped: Option<&[u64]>,
) -> Result<(), FaultError> {
    let (after, settle_ms) = settle(ordinals, before)?;
    let readings = ordinals
        .iter()
        .enumerate()
        .map(|(i, &ordinal)| DeviceFree {
            ordinal,
            before: before[i],
            with_bank: with_bank[i],
            while_mapped: while_mapped.map(|w| w[i]),
            after: after[i],
            settle_ms,
        })
        .collect();
    judge_devices(o, readings);
    Ok(())
}

/// Fills in `o.devices`, the sensitivity check (free bytes with the bank at
/// least [`DONOR_RANK_BYTES`] per rank on that device below `before`) and a
/// leak per device whose free bytes after are more than
/// [`DEVICE_FREE_TOLERANCE_BYTES`] below `before`. Rank `r` is on `devices[r]`.
fn judge_devices(o: &mut GpuRunOutcome, devices: Vec<DeviceFree>) {
    o.device_check_sensitive = !devices.is_empty()
        && devices.iter().all(|d| {
            let ranks_here = devices.iter().filter(|x| x.ordinal == d.ordinal).count() as u64;
            d.before.saturating_sub(d.with_bank) >= ranks_here * DONOR_RANK_BYTES
        });
    for d in &devices {
        if d.after + DEVICE_FREE_TOLERANCE_BYTES < d.before {
            o.leaks.push(format!(
                "device {} free bytes: {} -> {} ({} MiB lower, tolerance {} MiB)",
                d.ordinal,
                d.before,
                d.after,
                d.delta() >> 20,
                DEVICE_FREE_TOLERANCE_BYTES >> 20
            ));
        }
    }
    if !o.device_check_sensitive {
        let seen: Vec<(u64, u64)> = devices.iter().map(|d| (d.before, d.with_bank)).collect();
        o.detail.push_str(&format!(
            "; device check not sensitive: (free before, with bank) {seen:?}"
        ));
    }
    o.devices = devices;
}

fn min_into(acc: &mut [u64], now: &[u64]) {
    for (a, n) in acc.iter_mut().zip(now) {
        *a = (*a).min(*n);
    }
}

/// A device bank of `DONOR_RANK_BYTES` per rank on `ordinals`.
fn device_bank(
    layout: KvLayout,
    owner: OwnerLease,
    ordinals: &[u32],
    prefix: &str,
    lease: LeaseConfig,
) -> Result<BankManager, FaultError> {
    // Rounded up: each rank region is at least DONOR_RANK_BYTES.
    let slots = DONOR_RANK_BYTES.div_ceil(layout.rank_block_bytes() as u64);
    let budget = slots * u64::from(layout.tp_size()) * layout.rank_block_bytes() as u64;
    let mut cfg = BankConfig::new(layout, owner, budget);
    cfg.shm_prefix = prefix.to_string();
    cfg.lease = lease;
    BankManager::new_cuda(cfg, "fault-gpu", ordinals).map_err(bank_err("new_cuda"))
}

// --------------------------------------------------------------- target ---

/// A target whose staging rows are device allocations (rank `r` on
/// `ordinals[r]`) and whose copies go through [`CudaCopyBackend`] with
/// `strike` injected.
fn device_target(
    layout: KvLayout,
    rows: u32,
    ordinals: &[u32],
    strike: Strike,
) -> Result<Target, FaultError> {
    let len = rows as usize * layout.rank_block_bytes();
    let mut staging: Vec<Arc<dyn BankMemory>> = Vec::new();
    for &o in ordinals {
        let m = CudaDeviceMemory::new(o, len).map_err(cuda_err("staging cuMemAlloc"))?;
        staging.push(Arc::new(m));
    }
    let cuda = CudaCopyBackend::new(CudaMode::Auto)
        .map_err(|e| router_err("cuda backend")(e.to_string()))?;
    let backend = FaultBackend::new(Arc::new(cuda), strike, ordinals.len() as u32);
    Target::with_staging(layout, rows, staging, Arc::new(backend))
}

// -------------------------------------------------------------- runners ---

/// Runs GPU row `fault` once with conversation `seed` on devices `ordinals`
/// (rank `r` on `ordinals[r]`). `child` (from [`child_command`]) is
/// required for [`GpuFault::needs_child`]; `strike` picks the child row's
/// kill point (even: before the last rank's part, odd: after every part).
///
/// # Errors
/// [`FaultError::Skipped`] without a GPU; other [`FaultError`]s when the run
/// could not be set up. A fallback or a failed check is an outcome.
pub fn run_gpu_fault(
    fault: GpuFault,
    seed: u64,
    ordinals: &[u32],
    child: Option<&ChildCommand>,
    strike: u32,
) -> Result<GpuRunOutcome, FaultError> {
    gpu_ordinals()?;
    let _guard = run_lock();
    let t0 = Instant::now();
    let prefix = unique_prefix();
    let probe = LeakProbe::start(&prefix);
    let result = if fault.needs_child() {
        let child = child
            .ok_or_else(|| FaultError::Child(format!("{} needs a child command", fault.name())))?;
        child_run(seed, ordinals, child, &prefix, strike)
    } else {
        in_process_run(fault, seed, ordinals, &prefix)
    };
    let leaks = probe.finish();
    result.map(|mut o| {
        // Device leaks were found by the runner; the snapshot's come first.
        let device_leaks = std::mem::take(&mut o.leaks);
        o.leaks = leaks;
        o.leaks.extend(device_leaks);
        o.wall_ms = t0.elapsed().as_millis() as u64;
        o
    })
}

/// In-process device bank + router + device target (the host `fetch_fault`
/// on the GPU path).
fn in_process_run(
    fault: GpuFault,
    seed: u64,
    ordinals: &[u32],
    prefix: &str,
) -> Result<GpuRunOutcome, FaultError> {
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let bs = layout.tokens_per_block();
    let (conv, cache) = conversation_tp(&model, seed, tp)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let before = free_bytes(ordinals)?;
    let mut o = GpuRunOutcome::new(fault, seed, tp);
    let bank = Arc::new(device_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        ordinals,
        prefix,
        LeaseConfig::default(),
    )?);
    let mut with_bank = free_bytes(ordinals)?;
    let events = retain(&bank, &cache, &conv.retained_tokens)?;
    let router = gpu_router(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    router.apply(&events);

    let control = DeliveryControl::new();
    let cancel = control.cancel.clone();
    let last = tp - 1;
    let strike = match fault {
        GpuFault::CancelAtTransfer => Strike::BeforeRank(last, Arc::new(move || cancel.cancel())),
        GpuFault::DeadlinePassed => Strike::BeforeRank(last, stall()),
        _ => Strike::Never,
    };
    let rows = (conv.prompt.len() / bs as usize) as u32 + 2;
    let target = device_target(layout, rows, ordinals, strike)?;
    let advice = router.advise(
        &format!("gpu-fault-{seed}"),
        &prompt_hashes(&conv.prompt, bs as usize),
        target_engine,
    );
    let Some(env) = advice.hint.clone() else {
        o.detail = format!("no hint: {:?}", advice.decision.verdict);
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    };
    let control = if fault == GpuFault::DeadlinePassed {
        deadline_from_now(control)
    } else {
        control
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), bank.as_ref(), &control)?;
    min_into(&mut with_bank, &free_bytes(ordinals)?);
    o.completed = completed && fallback.is_none();
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    // At TP1 the strike comes before the only part: no byte may have landed.
    let before_first_byte = tp == 1 && fault != GpuFault::None;
    o.destination_untouched =
        target.rows_free() && (completed || !before_first_byte || target.poison_intact());
    o.detail = fallback.unwrap_or_else(|| "fetch completed".into());
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    drop(bank);
    device_verdict(&mut o, ordinals, &before, &with_bank, None)?;
    Ok(o)
}

/// The host rows' router settings with GPU reuse on as well: a device bank
/// is the GPU path, which a router refuses (`GpuPathDisabled`) unless
/// `enable_decode_to_prefill_gpu_reuse` is set.
fn gpu_router(tokens_per_block: u32) -> Result<FaultRouter, FaultError> {
    let settings = ReuseSettings {
        enable_decode_to_prefill_gpu_reuse: true,
        ..FaultRouter::settings()
    };
    FaultRouter::with_settings(settings, tokens_per_block)
}

/// Turn 0 of conversation `seed` at TP `tp` (the host rows always use TP2).
fn conversation_tp(
    model: &ReferenceModel,
    seed: u64,
    tp: u32,
) -> Result<(Conversation, KvCache), FaultError> {
    if tp == TP {
        return conversation(model, seed);
    }
    // Same tokens as `conversation`, K/V laid out for `tp` ranks.
    let (conv, _) = conversation(model, seed)?;
    let mut cache = model.new_cache(tp)?;
    model.prefill(&mut cache, &conv.retained_tokens)?;
    Ok((conv, cache))
}

/// The child's device bank as the target sees it: every rank imported by
/// CUDA IPC handle through the mapping cache, under a live lease.
struct RemoteDeviceDonor {
    manifest: BankManifest,
    maps: Vec<CudaIpcImport>,
    alive: Arc<dyn Fn() -> bool + Send + Sync>,
}

struct ImportPin<'a>(&'a [CudaIpcImport]);

impl DonorPin for ImportPin<'_> {
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory> {
        self.0.get(rank as usize).map(|m| m as &dyn BankMemory)
    }
}

impl DonorSource for RemoteDeviceDonor {
    fn manifest(&self) -> &BankManifest {
        &self.manifest
    }
    fn pin<'a>(&'a self, _hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, String> {
        if !(self.alive)() {
            return Err("donor process or lease gone".into());
        }
        Ok(Box::new(ImportPin(&self.maps)))
    }
}

/// This process's ordinal of the GPU a descriptor names (by UUID).
fn local_ordinal(d: &kv_descriptor::BankDescriptor) -> Result<u32, FaultError> {
    let MemoryLocation::Gpu(g) = d.location() else {
        return Err(FaultError::Child(format!(
            "rank {} of the donor is not in device memory",
            d.tp_rank()
        )));
    };
    let n = kv_transfer::cuda::device_count() as u32;
    (0..n)
        .find(|&o| cuda_probe(o).is_ok_and(|i| i.uuid == g.uuid))
        .ok_or_else(|| FaultError::Child(format!("GPU {} is not visible here", g.uuid)))
}

fn child_run(
    seed: u64,
    ordinals: &[u32],
    cmd: &ChildCommand,
    prefix: &str,
    strike_at: u32,
) -> Result<GpuRunOutcome, FaultError> {
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let (conv, _) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let before = free_bytes(ordinals)?;
    let ipc_before = ipc_cache_stats();
    let mut o = GpuRunOutcome::new(GpuFault::DonorKilledMidTransfer, seed, tp);
    let ords: Vec<String> = ordinals.iter().map(|x| x.to_string()).collect();
    let mut start = Command::new(&cmd.exe);
    start.args(&cmd.args).args([
        prefix.to_string(),
        seed.to_string(),
        CHILD_LEASE_MS.to_string(),
        ords.join(","),
    ]);
    let (HelloChild { child, guard, pid }, hello): (HelloChild, ChildHello) =
        spawn_with_hello(start, Duration::from_secs(60))?;
    let mut with_bank = free_bytes(ordinals)?;
    let manifest =
        BankManifest::from_wire(&hello.manifest).map_err(|e| FaultError::Child(e.to_string()))?;
    let mut maps = Vec::new();
    let mut ordinal0 = 0;
    for d in manifest.parts() {
        let ordinal = local_ordinal(d)?;
        if d.tp_rank() == 0 {
            ordinal0 = ordinal;
        }
        maps.push(CudaIpcImport::open_descriptor(d, ordinal).map_err(bank_err("open_descriptor"))?);
    }
    let handle0 = manifest.parts()[0].export().clone();
    let len0 = manifest.parts()[0].region_bytes() as usize;
    let parts = manifest.parts().to_vec();
    let alive: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || {
        pid_alive(pid)
            && parts
                .iter()
                .all(|d| check_descriptor_lease(d, kv_bank::LeaseInstant::now()).is_ok())
    });
    let donor = RemoteDeviceDonor {
        manifest: manifest.clone(),
        maps,
        alive: alive.clone(),
    };
    let bs = layout.tokens_per_block() as usize;
    let usable = (conv.prompt.len() - 1) / bs;
    let entries: Vec<(u64, u32)> = hello.entries.iter().take(usable).copied().collect();
    let env = retained_hint_envelope(
        &manifest,
        &layout,
        &entries,
        &format!("gpu-fault-{seed}"),
        &format!("pid:{pid}"),
    )?;
    let strike_child = child.clone();
    let kill: Action = Arc::new(move || {
        let mut c = strike_child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = c.kill();
        let _ = c.wait();
    });
    let (strike, where_) = if strike_at % 2 == 0 {
        (
            Strike::BeforeRank(tp - 1, kill),
            format!("before rank {}'s part", tp - 1),
        )
    } else {
        (Strike::AfterAll(kill), "after every part".to_string())
    };
    let target = device_target(
        layout,
        (conv.prompt.len() / bs) as u32 + 2,
        ordinals,
        strike,
    )?;
    let control = DeliveryControl {
        donor_alive: Some(alive),
        ..DeliveryControl::new()
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &donor, &control)?;
    let status = wait_exit(&child, Duration::from_secs(5));
    drop(guard);
    let while_mapped = free_bytes(ordinals)?;
    min_into(&mut with_bank, &while_mapped);
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    // The copy runs even after the kill (it reads the dead donor's mapping),
    // so only the rows' release is required, as in the host row.
    o.destination_untouched = target.rows_free();
    drop(target);
    drop(donor);
    // Every mapping of the dead donor must be closed now, and its handle
    // must not come back from the cache.
    let after_drop = ipc_cache_stats();
    let reimport = match &handle0 {
        kv_descriptor::ExportHandle::CudaIpc { handle } => {
            match CudaIpcImport::open(handle, ordinal0, len0) {
                Ok(m) if m.cache_hit() => {
                    o.leaks
                        .push("ipc mapping of the dead donor still cached".into());
                    "cache hit".to_string()
                }
                Ok(m) => {
                    drop(m);
                    "opened (cache miss), closed".to_string()
                }
                Err(e) => format!("error: {e}"),
            }
        }
        other => format!("not a CUDA IPC handle: {other:?}"),
    };
    let ipc_after = ipc_cache_stats();
    let opened = after_drop.opens - ipc_before.opens;
    let closed = after_drop.closes - ipc_before.closes;
    if after_drop.live > ipc_before.live || closed != opened {
        o.leaks.push(format!(
            "ipc mappings: live {} -> {}, opened {opened}, closed {closed}",
            ipc_before.live, after_drop.live
        ));
    }
    if opened != u64::from(tp) {
        o.leaks.push(format!(
            "ipc mappings: {opened} opened for {tp} ranks (each rank must be one cache miss)"
        ));
    }
    // A killed owner leaves its lease files: they go once they lapsed.
    let lease_prefix = format!("kvbank-cuda-{}", manifest.owner().engine_id.0.simple());
    let mut reclaimed = 0;
    let end = Instant::now() + Duration::from_millis(CHILD_LEASE_MS * 4);
    while !shm_entries(&lease_prefix).is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(CHILD_LEASE_MS / 4));
        if let Ok(r) = kv_bank::reclaim_stale(&lease_prefix, kv_bank::reclaim::ScanTime::now()) {
            reclaimed += r.removed_names().len();
        }
    }
    let left = shm_entries(&lease_prefix);
    if !left.is_empty() {
        o.leaks
            .push(format!("lease files of the dead donor: {left:?}"));
    }
    o.ipc = Some(IpcObservation {
        before: ipc_before,
        after: ipc_after,
        reimport: reimport.clone(),
        leases_reclaimed: reclaimed,
    });
    o.detail = format!(
        "{}; killed {where_}; child exit {:?}; re-import: {reimport}; leases reclaimed {reclaimed}",
        fallback.unwrap_or_else(|| "fetch completed".into()),
        status.map(|s| s.to_string())
    );
    device_verdict(&mut o, ordinals, &before, &with_bank, Some(&while_mapped))?;
    Ok(o)
}

// ---------------------------------------------------------------- child ---

/// Child side of `donor_killed_mid_transfer_gpu`: `args` = `<prefix> <seed>
/// <lease ms> <ordinals, comma-separated>` (a leading [`GPU_CHILD_ROLE`] is
/// skipped). Computes turn 0 of conversation `seed`, retains it in a device
/// bank (rank `r` on the `r`-th ordinal, exported by CUDA IPC handle, lease
/// renewed in the background), prints one JSON line (pid, manifest, slots),
/// then waits for SIGTERM (closes its bank, returns 0) or 60 s. Returns 2 on
/// an error (printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    child_exit(GPU_CHILD_ROLE, gpu_child(args))
}

fn gpu_child(args: &[String]) -> Result<(), FaultError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != GPU_CHILD_ROLE).collect();
    let [prefix, seed, lease_ms, ordinals] = args.as_slice() else {
        return Err(FaultError::Child(format!(
            "expected <prefix> <seed> <lease ms> <ordinals>, got {args:?}"
        )));
    };
    let num = |field: &str, s: &str| {
        s.parse::<u64>()
            .map_err(|e| FaultError::Child(format!("`{field}` {s:?}: {e}")))
    };
    let (seed, lease_ms) = (num("seed", seed)?, num("lease_ms", lease_ms)?);
    let ordinals: Vec<u32> = ordinals
        .split(',')
        .map(|s| num("ordinals", s).map(|v| v as u32))
        .collect::<Result<_, _>>()?;
    let (rt, mut term) = child_runtime()?;
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let (conv, cache) = conversation_tp(&model, seed, tp)?;
    let bank = device_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        &ordinals,
        prefix,
        LeaseConfig::background(
            Duration::from_millis(lease_ms),
            Duration::from_millis((lease_ms / 4).max(1)),
        ),
    )?;
    retain(&bank, &cache, &conv.retained_tokens)?;
    let hello = ChildHello::for_bank(&bank, &conv.retained_tokens)?;
    let line = serde_json::to_string(&hello).map_err(|e| FaultError::Child(e.to_string()))?;
    println!("{line}");
    wait_for_sigterm(&rt, &mut term);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))
}

// --------------------------------------------------------------- tables ---

/// The GPU rows of one table run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuFaultTable {
    /// Device ordinals used (rank `r` on `ordinals[r]`).
    pub ordinals: Vec<u32>,
    /// GPU name and UUID per ordinal.
    pub devices: Vec<String>,
    /// Rows in the shape of the host table.
    pub rows: Vec<FaultRow>,
    /// Every measured run, with device numbers.
    pub runs: Vec<GpuRunOutcome>,
    /// The untimed warm-up runs (control, then child row), reported, not counted.
    pub warmup: Vec<GpuRunOutcome>,
}

/// Runs every [`GpuFault`] (1 run each when `quick`, else 3; the child row
/// 2: one per kill point, after every part first) on devices [`gpu_ordinals`], after one warm-up of
/// the control and the child row. `child` must reach [`child_main`]
/// ([`child_command`]).
///
/// # Errors
/// [`FaultError::Skipped`] with the reason without `libcuda` or a device; a
/// warm-up that cannot be set up. Per-run setup errors become failed rows.
pub fn gpu_fault_table(quick: bool, child: &ChildCommand) -> Result<GpuFaultTable, FaultError> {
    let ordinals = gpu_ordinals()?;
    let devices = ordinals
        .iter()
        .map(|&o| {
            cuda_probe(o)
                .map(|i| format!("{} {}", i.name, i.uuid))
                .map_err(bank_err("cuda_probe"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let warmup = vec![
        run_gpu_fault(GpuFault::None, 1000, &ordinals, Some(child), 0)?,
        run_gpu_fault(
            GpuFault::DonorKilledMidTransfer,
            1001,
            &ordinals,
            Some(child),
            1,
        )?,
    ];
    let (runs_each, child_runs) = if quick { (1, 1) } else { (3, 2) };
    let mut rows = Vec::new();
    let mut runs = Vec::new();
    for f in GpuFault::ALL {
        let n = if f.needs_child() {
            child_runs
        } else {
            runs_each
        };
        let mut row = empty_row(f.name());
        for i in 0..n {
            row.runs += 1;
            // Child row: kill after every part first, before the last part second.
            match run_gpu_fault(f, 1 + u64::from(i), &ordinals, Some(child), i + 1) {
                Ok(o) => {
                    if o.passed() {
                        row.fallbacks += 1;
                    }
                    if o.completed && f != GpuFault::None {
                        row.false_completions += 1;
                    }
                    row.leaks += o.leaks.len() as u32;
                    if row.detail.is_empty() || !o.passed() {
                        row.detail = format!("{}{}", summary(&o), leak_note(&o.leaks));
                    }
                    runs.push(o);
                }
                Err(e) => row.detail = format!("setup failed: {e}"),
            }
        }
        rows.push(row);
    }
    Ok(GpuFaultTable {
        ordinals,
        devices,
        rows,
        runs,
        warmup,
    })
}

/// One line per run: outcome and device numbers.
pub fn summary(o: &GpuRunOutcome) -> String {
    let dev: Vec<String> = o
        .devices
        .iter()
        .map(|d| {
            format!(
                "gpu{} free {} -> {} MiB (delta {} KiB, bank -{} MiB{}, settled {} ms)",
                d.ordinal,
                d.before >> 20,
                d.after >> 20,
                d.delta() / 1024,
                d.before.saturating_sub(d.with_bank) >> 20,
                d.while_mapped
                    .map(|w| format!(
                        ", dead donor still mapped -{} MiB",
                        d.before.saturating_sub(w) >> 20
                    ))
                    .unwrap_or_default(),
                d.settle_ms
            )
        })
        .collect();
    format!(
        "tp{} {} ms: {}; {}",
        o.tp,
        o.wall_ms,
        o.detail,
        dev.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_row_names_are_distinct_from_the_host_rows() {
        let mut names: Vec<&str> = GpuFault::ALL.iter().map(|f| f.name()).collect();
        assert!(names.iter().all(|n| n.ends_with("_gpu")));
        names.extend(Fault::ALL.iter().map(|f| f.name()));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        assert_eq!(GpuFault::ALL.iter().filter(|f| f.needs_child()).count(), 1);
    }

    #[test]
    fn passed_needs_a_sensitive_device_check_and_no_device_leak() {
        let mut o = GpuRunOutcome::new(GpuFault::CancelAtTransfer, 1, 1);
        o.fell_back = true;
        o.outputs_match = true;
        o.destination_untouched = true;
        o.device_check_sensitive = true;
        assert!(o.passed());
        assert!(!GpuRunOutcome {
            device_check_sensitive: false,
            ..o.clone()
        }
        .passed());
        assert!(!GpuRunOutcome {
            completed: true,
            ..o.clone()
        }
        .passed());
        let mut leaked = o.clone();
        judge_devices(&mut leaked, vec![reading(100 << 20, 30 << 20, 90 << 20)]);
        assert!(!leaked.passed(), "{leaked:?}");
        let mut fine = o.clone();
        judge_devices(&mut fine, vec![reading(100 << 20, 30 << 20, 97 << 20)]);
        assert!(fine.passed(), "{fine:?}");
        let mut blind = o.clone();
        judge_devices(&mut blind, vec![reading(100 << 20, 90 << 20, 100 << 20)]);
        assert!(
            !blind.passed(),
            "a check that cannot see the bank proves nothing"
        );
        // Two ranks on one device need twice the bank to count as seen.
        let mut two = o;
        judge_devices(
            &mut two,
            vec![
                reading(200 << 20, 100 << 20, 200 << 20),
                reading(200 << 20, 100 << 20, 200 << 20),
            ],
        );
        assert!(!two.device_check_sensitive);
    }

    fn reading(before: u64, with_bank: u64, after: u64) -> DeviceFree {
        DeviceFree {
            ordinal: 0,
            before,
            with_bank,
            while_mapped: None,
            after,
            settle_ms: 0,
        }
    }

    #[test]
    fn without_a_gpu_the_rows_skip_with_the_reason() {
        if kv_transfer::cuda::driver_present() && kv_transfer::cuda::device_count() > 0 {
            println!("SKIP no-GPU fault-row test: a GPU is present; tests/gpu_fault_rows.rs runs the rows");
            return;
        }
        let e = run_gpu_fault(GpuFault::None, 1, &[0], None, 0).unwrap_err();
        assert!(matches!(e, FaultError::Skipped(_)), "{e}");
        let e = gpu_fault_table(true, &child_command("/bin/false")).unwrap_err();
        assert!(
            e.to_string().contains("libcuda") || e.to_string().contains("device"),
            "{e}"
        );
        assert_eq!(child_main(&["x".into()]), 2);
    }
}
