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

mod devices;
use self::devices::{cuda_err, device_bank, device_verdict, free_bytes, min_into};
mod runners;
pub use self::runners::run_gpu_fault;
use self::runners::{conversation_tp, device_target, local_ordinal, RemoteDeviceDonor};
mod donor_child;
pub use self::donor_child::child_main;
use self::donor_child::child_run;

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

    /// What its row requires of every run: the control a fetch, the rest a
    /// fallback.
    pub fn expected(self) -> Expected {
        match self {
            GpuFault::None => Expected::Fetch,
            _ => Expected::Fallback,
        }
    }

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

    /// The run of row `fault` as its table row counts it (as
    /// [`RunOutcome::tally`]); a run whose device measurement was not
    /// sensitive counts as neither fetch nor fallback.
    pub fn tally(&self, fault: GpuFault) -> RunTally {
        let checked = self.outputs_match && self.device_check_sensitive;
        let expected = fault.expected();
        RunTally {
            fetched: expected.fetch() && self.completed && checked,
            fell_back: self.fell_back && !self.completed && self.destination_untouched && checked,
            false_completion: self.completed && !expected.fetch(),
            leaks: self.leaks.len() as u32,
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
        let mut row = FaultRow::new(f.name(), f.expected());
        for i in 0..n {
            // Child row: kill after every part first, before the last part second.
            match run_gpu_fault(f, 1 + u64::from(i), &ordinals, Some(child), i + 1) {
                Ok(o) => {
                    row.count(o.tally(f));
                    if row.detail.is_empty() || !o.passed() {
                        row.detail = format!("{}{}", summary(&o), leak_note(&o.leaks));
                    }
                    runs.push(o);
                }
                Err(e) => {
                    row.runs += 1;
                    row.detail = format!("setup failed: {e}");
                }
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
    use super::devices::judge_devices;
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
