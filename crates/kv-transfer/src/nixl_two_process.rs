//! Two-process NIXL benchmark: the production shape of a NIXL fetch, with
//! the donor's memory registered by a NIXL agent in another process.
//!
//! Why: with both agents in one process (the oracle, [`crate::bench`]) UCX
//! has no GPU lane (`cuda_ipc` connects different processes only) and moved
//! VRAM through TCP emulation at 0.3-0.5 GB/s (`MEASURED.md`).
//!
//! The donor ([`donor_main`], started as child role [`DONOR_ROLE`]) allocates
//! a region (device memory on its GPU, or host memory), fills it with a known
//! pattern, registers it with its own [`NixlAgent`], and, on VRAM, also
//! allocates a second region with the same pattern whose CUDA IPC handle it
//! exports for the CUDA IPC baseline. It prints one JSON line
//! ([`DonorHandshake`]: agent metadata in hex, base addresses, lengths) and
//! waits for stdin to close (or SIGTERM, or its own timeout), then exits.
//!
//! The target ([`run`], this process) allocates its destination on the
//! target GPU (or host), creates its own agent, loads the donor's metadata,
//! and times [`crate::deliver`] through [`NixlBackend`] in
//! [`NixlMode::Prepared`] and [`NixlMode::Runs`] for a contiguous case
//! (`blocks` slots 0.. in order: one run) and a scattered case (every other
//! donor slot, shuffled: one run per block). Median of `repeats` deliveries
//! after one warm-up. After each case's timed runs every destination byte is
//! compared with the donor pattern (the destination is cleared before each
//! case). Baselines measured in the same run: a contiguous device copy
//! (`cuMemcpyDtoDAsync`, or `memcpy` on host memory) of the same bytes, and
//! on VRAM the same cases through [`CudaCopyBackend`] over CUDA IPC.
//!
//! A NIXL delivery that UCX staged through the host is refused on a GPU
//! destination ([`TransferError::HostStaged`], after the bytes moved): the
//! row is still timed and verified, and names the refusal and the transport.
//! The transport is read from UCX's protocol log when `UCX_PROTO_INFO=y` and
//! `UCX_LOG_FILE` are set before the first agent starts
//! ([`enable_ucx_proto_log`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_bank::{BankMemory, CudaDeviceMemory, CudaIpcImport, MemoryKind};
use kv_descriptor::{KvLayout, SequenceHash};
use serde::{Deserialize, Serialize};

use crate::bench::{gbps, layout_for, median};
use crate::cuda::{CudaCopyBackend, CudaMode};
use crate::ipc_check::{hex, unhex};
use crate::nixl::{NixlAgent, NixlBackend, NixlMode};
use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
use crate::{
    deliver, CopyBackend, DeliveryControl, HostBuffer, NixlRemoteRegion, RankIo, SourceRegion,
    TransferError,
};

mod cases;
mod donor;

use cases::{error_row, plan_for, raw_copy, time_case, Case};
pub use donor::donor_main;
use donor::{donor_args, DonorProcess};

/// Child role word of the donor process (`kvq child nixl-donor ...`).
pub const DONOR_ROLE: &str = "nixl-donor";

/// Exit code of [`donor_main`] when its stdin stayed open past its timeout.
pub const DONOR_TIMEOUT_EXIT: i32 = 3;

/// Where the donor and target regions live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Memory {
    /// Host memory (NIXL DRAM); runs without a GPU.
    Dram,
    /// CUDA device memory (NIXL VRAM).
    Vram,
}

impl Memory {
    fn word(self) -> &'static str {
        match self {
            Memory::Dram => "dram",
            Memory::Vram => "vram",
        }
    }
}

/// Benchmark settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TwoProcessOpts {
    /// Host or device memory on both sides.
    pub memory: Memory,
    /// CUDA ordinal of the donor region (VRAM only).
    pub donor_gpu: u32,
    /// CUDA ordinal of the target region (VRAM only).
    pub target_gpu: u32,
    /// Blocks per delivery; the donor region holds twice as many slots.
    pub blocks: u32,
    /// Bytes per block, a multiple of 16 KiB.
    pub block_bytes: usize,
    /// Timed deliveries per case (median reported), after one warm-up; at least 1.
    pub repeats: usize,
    /// Longest wait for the donor's handshake line.
    pub handshake_timeout: Duration,
    /// The donor exits by itself when its stdin is still open after this long.
    pub donor_timeout: Duration,
    /// Deadline of one delivery (a stalled UCX read becomes an error row).
    pub delivery_timeout: Duration,
}

impl TwoProcessOpts {
    /// The production-shape case: 1024 x 64 KiB blocks on `memory`, 10 repeats.
    pub fn new(memory: Memory) -> Self {
        Self {
            memory,
            donor_gpu: 0,
            target_gpu: 0,
            blocks: 1024,
            block_bytes: 64 << 10,
            repeats: 10,
            handshake_timeout: Duration::from_secs(90),
            donor_timeout: Duration::from_secs(300),
            delivery_timeout: Duration::from_secs(30),
        }
    }

    fn donor_bytes(&self) -> usize {
        2 * self.blocks as usize * self.block_bytes
    }

    fn target_bytes(&self) -> usize {
        self.blocks as usize * self.block_bytes
    }

    fn validate(&self) -> Result<(), TransferError> {
        if self.block_bytes == 0 || self.block_bytes % 16_384 != 0 {
            return Err(TransferError::input(
                "block_bytes",
                "must be a positive multiple of 16 KiB",
            ));
        }
        if self.blocks == 0 || self.blocks % SCATTER_STEP == 0 {
            return Err(TransferError::input(
                "blocks",
                format!("must be positive and not a multiple of {SCATTER_STEP}"),
            ));
        }
        Ok(())
    }
}

/// The donor's one JSON line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DonorHandshake {
    /// Donor process id.
    pub pid: u32,
    /// Donor memory kind.
    pub memory: Memory,
    /// Donor CUDA ordinal (0 on DRAM).
    pub gpu: u32,
    /// Serialized NIXL agent metadata, hex.
    pub metadata_hex: String,
    /// First byte of the NIXL-registered region in the donor's address space.
    pub base_addr: u64,
    /// Length of the NIXL-registered region in bytes.
    pub len: u64,
    /// CUDA IPC handle (hex) of the second region with the same pattern (VRAM only).
    pub ipc_handle_hex: Option<String>,
    /// Length of the CUDA IPC region in bytes (0 without one).
    pub ipc_len: u64,
}

/// A timed baseline: a plain contiguous copy of the same bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawCopy {
    /// What was copied (`cuMemcpyDtoDAsync GPU0 -> GPU0` or `memcpy`).
    pub what: String,
    /// Bytes per copy.
    pub bytes: u64,
    /// 10^9 bytes per second at the median time.
    #[serde(rename = "GBps")]
    pub gbps: f64,
    /// Median time of one copy in µs.
    pub p50_us: f64,
}

/// One timed case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TwoProcessRow {
    /// `backend/pattern/blocksxsize`, e.g. `nixl_prepared/scattered/1024x64KiB`.
    pub name: String,
    /// `nixl` or `cuda_ipc`.
    pub backend: String,
    /// `contiguous` or `scattered`.
    pub pattern: String,
    /// Bytes per delivery.
    pub bytes: u64,
    /// Blocks per delivery.
    pub blocks: u64,
    /// 10^9 bytes per second at the median time; `None` when the case failed.
    #[serde(rename = "GBps")]
    pub gbps: Option<f64>,
    /// Median delivery time in µs.
    pub p50_us: Option<f64>,
    /// Fastest delivery time in µs.
    pub min_us: Option<f64>,
    /// Transport of the last delivery (UCX's choice for NIXL, `unknown`
    /// without the UCX protocol log).
    pub transport: String,
    /// Host payload bytes of the last delivery.
    pub host_payload_bytes: u64,
    /// Every destination byte matched the donor pattern after the timed runs.
    pub bytes_ok: Option<bool>,
    /// `GBps` over the contiguous raw copy of the same bytes.
    pub ratio_vs_raw_copy: Option<f64>,
    /// `GBps` over the CUDA IPC row of the same pattern (VRAM only).
    pub ratio_vs_cuda_ipc: Option<f64>,
    /// The delivery refused its result although the bytes moved (e.g.
    /// host-staged VRAM); the row is still timed and verified.
    pub refused: Option<String>,
    /// The case could not run or failed; nothing else in the row is measured.
    pub error: Option<String>,
}

/// Result of [`run`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TwoProcessReport {
    /// Settings.
    pub memory: Memory,
    /// Donor CUDA ordinal.
    pub donor_gpu: u32,
    /// Target CUDA ordinal.
    pub target_gpu: u32,
    /// Blocks per delivery.
    pub blocks: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Timed deliveries per case.
    pub repeats: usize,
    /// Why nothing ran (no GPU, no NIXL runtime); `rows` is then empty.
    pub skipped: Option<String>,
    /// Donor process id.
    pub donor_pid: Option<u32>,
    /// Spawn to handshake line, ms (donor CUDA context, allocation, fill, agent).
    pub donor_startup_ms: Option<f64>,
    /// Loading the donor's metadata in the target agent, µs.
    pub load_remote_us: Option<u64>,
    /// How the donor process ended (`exit status: 0`, or killed).
    pub donor_exit: Option<String>,
    /// `UCX_TLS` of this process (inherited by the donor), if set.
    pub ucx_tls: Option<String>,
    /// UCX log file pattern (`%p` = pid) holding the protocol tables, if set.
    pub ucx_log: Option<String>,
    /// Contiguous copy of the same bytes, same run.
    pub raw_copy: Option<RawCopy>,
    /// Why the raw copy could not be timed (e.g. no peer access between the GPUs).
    pub raw_copy_error: Option<String>,
    /// CUDA IPC baseline rows then NIXL rows.
    pub rows: Vec<TwoProcessRow>,
}

impl TwoProcessReport {
    fn skipped(opts: &TwoProcessOpts, why: String) -> Self {
        Self {
            memory: opts.memory,
            donor_gpu: opts.donor_gpu,
            target_gpu: opts.target_gpu,
            blocks: opts.blocks,
            block_bytes: opts.block_bytes as u64,
            repeats: opts.repeats,
            skipped: Some(why),
            donor_pid: None,
            donor_startup_ms: None,
            load_remote_us: None,
            donor_exit: None,
            ucx_tls: std::env::var("UCX_TLS").ok(),
            ucx_log: std::env::var("UCX_LOG_FILE").ok(),
            raw_copy: None,
            raw_copy_error: None,
            rows: Vec::new(),
        }
    }

    /// Skipped, or every NIXL case ran, and every row that ran verified its bytes.
    pub fn passed(&self) -> bool {
        self.skipped.is_some()
            || (self.rows.iter().any(|r| r.backend == "nixl")
                && self
                    .rows
                    .iter()
                    .all(|r| r.error.is_none() && r.bytes_ok == Some(true)))
    }
}

/// Sets `UCX_PROTO_INFO=y` and `UCX_LOG_FILE=<dir>/ucx-<tag>-%p.log` in this
/// process's environment (inherited by the donor) unless `UCX_LOG_FILE` is
/// already set; returns the pattern in effect. UCX reads them when the first
/// agent starts, so call this before any [`NixlAgent`] exists and while no
/// other thread reads the environment (e.g. first thing in `main`).
pub fn enable_ucx_proto_log(dir: &Path, tag: &str) -> Option<String> {
    if let Ok(f) = std::env::var("UCX_LOG_FILE") {
        return Some(f);
    }
    let f = dir.join(format!("ucx-{tag}-%p.log"));
    std::env::set_var("UCX_PROTO_INFO", "y");
    std::env::set_var("UCX_LOG_FILE", &f);
    Some(f.display().to_string())
}

/// Multiplier of the scattered order (prime: a permutation unless `blocks`
/// is a multiple of it).
const SCATTER_STEP: u32 = 617;

/// Donor byte at `offset` (same function in every region of both processes).
fn pattern_at(offset: usize) -> u8 {
    let x = (offset as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 57) as u8 ^ (offset >> 14) as u8
}

fn fill_pattern(mem: &dyn BankMemory) -> Result<(), TransferError> {
    let chunk = 8 << 20;
    let mut off = 0;
    while off < mem.len() {
        let n = chunk.min(mem.len() - off);
        let bytes: Vec<u8> = (off..off + n).map(pattern_at).collect();
        mem.write_bytes(off, &bytes)?;
        off += n;
    }
    Ok(())
}

fn clear(mem: &dyn BankMemory) -> Result<(), TransferError> {
    let zeros = vec![0u8; (8 << 20).min(mem.len())];
    let mut off = 0;
    while off < mem.len() {
        let n = zeros.len().min(mem.len() - off);
        mem.write_bytes(off, &zeros[..n])?;
        off += n;
    }
    Ok(())
}

/// Every byte of every planned destination row against the donor pattern.
fn verify_rows(plan: &TransferPlan, dst: &dyn BankMemory) -> Result<bool, TransferError> {
    let mut ok = true;
    for r in plan.parts()[0].runs() {
        let mut got = vec![0u8; r.len as usize];
        dst.read_bytes(r.dst_offset as usize, &mut got)?;
        let base = r.src_offset as usize;
        ok &= got
            .iter()
            .enumerate()
            .all(|(j, &b)| b == pattern_at(base + j));
    }
    Ok(ok)
}

fn skip_reason(opts: &TwoProcessOpts) -> Result<Option<String>, TransferError> {
    if opts.memory == Memory::Vram {
        if !crate::cuda::driver_present() {
            return Ok(Some(
                "no CUDA driver: libcuda cannot be loaded on this machine".into(),
            ));
        }
        let n = crate::cuda::device_count();
        if n == 0 {
            return Ok(Some("no CUDA device visible".into()));
        }
        let need = opts.donor_gpu.max(opts.target_gpu) as usize;
        if need >= n {
            return Err(TransferError::input(
                "gpu",
                format!(
                    "GPU {need} requested but {n} device(s) visible (ordinals 0..{})",
                    n - 1
                ),
            ));
        }
    }
    if let Err(e) = crate::nixl::runtime_status() {
        return Ok(Some(format!("NIXL runtime unavailable: {e}")));
    }
    Ok(None)
}

/// Target side: starts the donor with `donor_command(args)` (a command that
/// runs [`donor_main`] with `args`, e.g. `kvq child nixl-donor ARGS...`),
/// measures, and stops it. A machine without a GPU (VRAM) or without the
/// NIXL runtime yields a report with `skipped` set and no rows.
///
/// # Errors
/// Bad options, a GPU ordinal that is not visible, allocation or agent
/// failures, a donor that fails or prints no handshake within
/// `handshake_timeout` (its stderr is in the message). A failing case is a
/// row with `error`, not an error.
pub fn run(
    opts: &TwoProcessOpts,
    donor_command: &dyn Fn(&[String]) -> Command,
) -> Result<TwoProcessReport, TransferError> {
    opts.validate()?;
    if let Some(why) = skip_reason(opts)? {
        return Ok(TwoProcessReport::skipped(opts, why));
    }
    let mut report = TwoProcessReport::skipped(opts, String::new());
    report.skipped = None;
    let layout = layout_for(opts.block_bytes)?;
    let bytes = opts.target_bytes();

    // Destination first: the CUDA context exists before UCX starts.
    let dst: Box<dyn BankMemory> = match opts.memory {
        Memory::Dram => Box::new(HostBuffer::zeroed(bytes)?),
        Memory::Vram => Box::new(CudaDeviceMemory::new(opts.target_gpu, bytes)?),
    };
    // Raw copy baseline: a local source of the same bytes on the donor's device.
    let raw_src: Box<dyn BankMemory> = match opts.memory {
        Memory::Dram => Box::new(HostBuffer::zeroed(bytes)?),
        Memory::Vram => Box::new(CudaDeviceMemory::new(opts.donor_gpu, bytes)?),
    };
    match raw_copy(opts, raw_src.as_ref(), dst.as_ref()) {
        Ok(r) => report.raw_copy = Some(r),
        Err(e) => report.raw_copy_error = Some(e.to_string()),
    }
    drop(raw_src);

    let t_spawn = Instant::now();
    let mut donor = DonorProcess::spawn(donor_command(&donor_args(opts)))?;
    let hs = donor.handshake(opts.handshake_timeout)?;
    report.donor_startup_ms = Some(t_spawn.elapsed().as_secs_f64() * 1e3);
    report.donor_pid = Some(hs.pid);
    if hs.memory != opts.memory || (hs.len as usize) < opts.donor_bytes() {
        return Err(TransferError::Host(format!(
            "donor handshake does not match the request: {:?} {} bytes",
            hs.memory, hs.len
        )));
    }

    let plans = [
        ("contiguous", plan_for(&layout, opts, false)?),
        ("scattered", plan_for(&layout, opts, true)?),
    ];

    // CUDA IPC baseline over the donor's second region (VRAM only), imported
    // on the target's device: the copy runs there, and an import is readable
    // only on the device it was opened on (`BankMemory::device_local_mapping`).
    // The transport label therefore reads `cuda_same_device_*` even when the
    // donor is another GPU; the raw-copy row names both devices.
    if let (Memory::Vram, Some(h)) = (opts.memory, &hs.ipc_handle_hex) {
        let import = unhex("ipc_handle", h).and_then(|h| {
            Ok(CudaIpcImport::open(
                &h,
                opts.target_gpu,
                hs.ipc_len as usize,
            )?)
        });
        let backend = CudaCopyBackend::new(CudaMode::Auto);
        match (import, backend) {
            (Ok(src), Ok(backend)) => {
                let io = [RankIo {
                    src: SourceRegion::Mapped(&src),
                    dst: dst.as_ref(),
                }];
                for (pattern, plan) in &plans {
                    let case = Case {
                        backend: "cuda_ipc",
                        label: "cuda_ipc",
                        pattern,
                        plan,
                    };
                    let mut row = time_case(&case, &backend, &io, dst.as_ref(), opts, &|| {
                        "cuda_ipc".into()
                    });
                    if row.transport == "unknown" {
                        row.transport = "cuda_ipc".into();
                    }
                    report.rows.push(row);
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                for (pattern, plan) in &plans {
                    report
                        .rows
                        .push(error_row("cuda_ipc", pattern, plan, opts, &e));
                }
            }
        }
    }

    let agent = Arc::new(NixlAgent::new(&format!(
        "kvx-2p-target-{}",
        std::process::id()
    ))?);
    agent.register(dst.as_ref())?;
    let metadata = unhex("metadata", &hs.metadata_hex)?;
    let t0 = Instant::now();
    let remote_name = agent.load_remote(&metadata)?;
    report.load_remote_us = Some(t0.elapsed().as_micros() as u64);
    let remote_kind = match opts.memory {
        Memory::Dram => MemoryKind::Host,
        Memory::Vram => MemoryKind::Cuda { ordinal: hs.gpu },
    };
    let remote = NixlRemoteRegion {
        agent_name: remote_name,
        base_addr: hs.base_addr,
        len: hs.len,
        kind: remote_kind,
    };
    let io = [RankIo {
        src: SourceRegion::Nixl(&remote),
        dst: dst.as_ref(),
    }];
    let dst_kind = dst.kind();
    let transport = move || {
        crate::nixl_transport::ucx_transport(dst_kind, remote_kind)
            .unwrap_or_else(|| "unknown".into())
    };
    let mut stop: Option<String> = None;
    for (pattern, plan) in &plans {
        for (mode, label) in [
            (NixlMode::Prepared, "nixl_prepared"),
            (NixlMode::Runs, "nixl_runs"),
        ] {
            if let Some(why) = &stop {
                let e = TransferError::Host(format!("not run: {why}"));
                report.rows.push(error_row(label, pattern, plan, opts, &e));
                continue;
            }
            let backend = NixlBackend::new(agent.clone(), mode);
            let case = Case {
                backend: "nixl",
                label,
                pattern,
                plan,
            };
            let row = time_case(&case, &backend, &io, dst.as_ref(), opts, &transport);
            if row.error.is_some() && agent.reap_abandoned() > 0 {
                // A read still in flight may land later: no further case
                // may reuse the destination.
                stop = Some(format!("a read of {} is still in flight", row.name));
            }
            report.rows.push(row);
        }
    }
    // Ratios against the baselines of the same run.
    let raw = report.raw_copy.as_ref().map(|r| r.gbps);
    let ipc: Vec<(String, f64)> = report
        .rows
        .iter()
        .filter(|r| r.backend == "cuda_ipc")
        .filter_map(|r| Some((r.pattern.clone(), r.gbps?)))
        .collect();
    for r in &mut report.rows {
        let Some(g) = r.gbps else { continue };
        r.ratio_vs_raw_copy = raw.map(|x| g / x);
        if r.backend == "nixl" {
            r.ratio_vs_cuda_ipc = ipc
                .iter()
                .find(|(p, _)| *p == r.pattern)
                .map(|(_, x)| g / x);
        }
    }
    if agent.reap_abandoned() == 0 {
        let _ = agent.forget_remote(&remote.agent_name);
    }
    report.donor_exit = Some(donor.finish());
    drop(agent);
    drop(dst);
    Ok(report)
}
/// Command that runs this binary's hidden donor role: `exe prefix... ROLE ARGS...`.
pub fn child_command(exe: &Path, prefix: &[&str]) -> impl Fn(&[String]) -> Command {
    let exe: PathBuf = exe.to_path_buf();
    let prefix: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
    move |args| {
        let mut c = Command::new(&exe);
        c.args(&prefix).arg(DONOR_ROLE).args(args);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::donor::parse_donor_args;
    use super::*;

    #[test]
    fn donor_rejects_bad_arguments_before_touching_memory() {
        assert_eq!(donor_main(&[]), 2);
        assert_eq!(
            donor_main(&["flash".into(), "0".into(), "1".into(), "1".into()]),
            2
        );
        assert_eq!(
            donor_main(&["dram".into(), "0".into(), "x".into(), "1".into()]),
            2
        );
        assert_eq!(
            donor_main(&["dram".into(), "0".into(), "0".into(), "1".into()]),
            2
        );
    }

    #[test]
    fn options_validate_and_args_round_trip() {
        let mut o = TwoProcessOpts::new(Memory::Dram);
        o.validate().unwrap();
        let a = parse_donor_args(&donor_args(&o)).unwrap();
        assert_eq!((a.memory, a.gpu, a.bytes), (Memory::Dram, 0, 128 << 20));
        o.block_bytes = 1000;
        assert!(o.validate().is_err());
        o.block_bytes = 16 << 10;
        o.blocks = SCATTER_STEP;
        assert!(o.validate().is_err());
    }

    #[test]
    fn scattered_plan_reads_every_other_slot_once() {
        let mut o = TwoProcessOpts::new(Memory::Dram);
        o.blocks = 64;
        o.block_bytes = 16 << 10;
        let l = layout_for(o.block_bytes).unwrap();
        let p = plan_for(&l, &o, true).unwrap();
        let mut slots: Vec<u64> = p.parts()[0]
            .runs()
            .iter()
            .map(|r| r.src_offset / o.block_bytes as u64)
            .collect();
        assert_eq!(slots.len(), 64, "one run per block");
        slots.sort_unstable();
        assert_eq!(slots, (0..64).map(|i| 2 * i + 1).collect::<Vec<_>>());
        let c = plan_for(&l, &o, false).unwrap();
        assert_eq!(c.parts()[0].runs().len(), 1);
        assert_eq!(c.expected_bytes(), 64 * (16 << 10));
    }

    #[test]
    fn hex_round_trips() {
        let h: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex("x", &hex(&h)).unwrap(), h);
        assert!(unhex("x", "abc").is_err());
    }

    #[test]
    fn passed_needs_verified_nixl_rows() {
        let o = TwoProcessOpts::new(Memory::Dram);
        let skipped = TwoProcessReport::skipped(&o, "no GPU".into());
        assert!(skipped.passed());
        let mut r = TwoProcessReport::skipped(&o, String::new());
        r.skipped = None;
        assert!(!r.passed(), "no rows is not a pass");
    }
}
