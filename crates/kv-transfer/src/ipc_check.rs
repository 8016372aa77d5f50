//! Two-process CUDA IPC fetch check and benchmark, for a GPU machine.
//!
//! [`run`] (the donor) allocates a device bank region on GPU 0, fills it with
//! a pattern, and spawns `exe <prefix...> transfer-ipc-child <handle> <len>
//! <ordinal>` once per visible GPU (at most two). [`child_main`] (the target)
//! maps the donor allocation with kv-bank's `CudaIpcImport` on its ordinal,
//! fetches through [`CudaCopyBackend`] (contiguous and scattered 1024 x 64 KiB,
//! and a 7 x 32 KiB fetch), checks every fetched byte of the scattered case
//! against the pattern, times each case against a raw device copy of the same
//! bytes from the mapped donor memory, and prints one JSON line.
//! This is the cross-process form of the GPU rows of [`crate::bench`].

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kv_bank::child_process::{ChildProcess, ChildStderr};
use kv_bank::{BankMemory, CudaDeviceMemory, CudaIpcImport};
use kv_descriptor::SequenceHash;
use serde::{Deserialize, Serialize};

use crate::bench::{layout_for, median, BenchRow};
use crate::cuda::{CudaCopyBackend, CudaMode};
use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
use crate::{deliver, DeliveryControl, RankIo, SourceRegion, TransferError};

/// The subcommand word the child is started with.
pub const CHILD_SUBCOMMAND: &str = "transfer-ipc-child";

const BLOCK: usize = 64 << 10;
const BLOCKS: u32 = 1024;
/// Donor region: twice the fetched blocks, so scattered slots have gaps.
const DONOR_BYTES: usize = 2 * BLOCKS as usize * BLOCK;
const REPEATS: usize = 50;

/// What one target process measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildReport {
    /// Device ordinal the target imported on and copied to.
    pub ordinal: u32,
    /// `cuIpcOpenMemHandle` time in µs (context already created).
    pub import_us: u64,
    /// Every fetched byte of the scattered case matched the donor pattern.
    pub bytes_ok: bool,
    /// Delivery counters' host payload over all cases (must be 0).
    pub host_payload_bytes: u64,
    /// Benchmark rows (same shape as [`crate::bench::run`]).
    pub rows: Vec<BenchRow>,
}

/// Result of [`run`]: one child report per target GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IpcCheckReport {
    /// Reports of the children, in ordinal order.
    pub children: Vec<ChildReport>,
}

impl IpcCheckReport {
    /// Every child verified its bytes and moved no payload through the host.
    pub fn passed(&self) -> bool {
        !self.children.is_empty()
            && self
                .children
                .iter()
                .all(|c| c.bytes_ok && c.host_payload_bytes == 0)
    }
}

fn pattern_at(offset: usize) -> u8 {
    let x = (offset as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 57) as u8 ^ (offset >> 16) as u8
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`hex`] output; errors name `what`.
pub(crate) fn unhex(what: &'static str, s: &str) -> Result<Vec<u8>, TransferError> {
    if s.len() % 2 != 0 {
        return Err(TransferError::input(what, "odd number of hex digits"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&s[i..i + 2], 16)
                .map_err(|e| TransferError::input(what, e.to_string()))
        })
        .collect()
}

/// Longest wait for an importer child's report and for its exit.
const CHILD_WAIT: Duration = Duration::from_secs(120);

/// Donor side: allocate, fill, spawn one child per GPU (at most two), collect.
///
/// # Errors
/// No GPU, allocation or fill failure, a child that fails or prints no report.
pub fn run(exe: &Path, prefix: &[&str]) -> Result<IpcCheckReport, TransferError> {
    let gpus = crate::cuda::device_count().min(2);
    if gpus == 0 {
        return Err(TransferError::Cuda {
            op: "cuDeviceGetCount",
            reason: "no CUDA device visible".into(),
        });
    }
    let donor = CudaDeviceMemory::new(0, DONOR_BYTES)?;
    let chunk = 16 << 20;
    for off in (0..DONOR_BYTES).step_by(chunk) {
        let bytes: Vec<u8> = (off..off + chunk).map(pattern_at).collect();
        donor.write_bytes(off, &bytes)?;
    }
    let handle = hex(donor.handle_bytes());
    let mut children = Vec::new();
    for ordinal in 0..gpus as u32 {
        let mut cmd = Command::new(exe);
        cmd.args(prefix).args([
            CHILD_SUBCOMMAND,
            &handle,
            &DONOR_BYTES.to_string(),
            &ordinal.to_string(),
        ]);
        let mut child = ChildProcess::spawn(cmd, ChildStderr::Capture)
            .map_err(|e| TransferError::Host(e.to_string()))?;
        let report = child.next_json("report", CHILD_WAIT).map_err(|e| {
            TransferError::Host(format!(
                "child for GPU {ordinal}: {e}; stderr: {}",
                child.stderr_tail()
            ))
        })?;
        child.wait_exit(CHILD_WAIT);
        children.push(report);
    }
    drop(donor);
    Ok(IpcCheckReport { children })
}

/// Target side: `args` = `[handle_hex, donor_len, ordinal]`. Prints nothing;
/// the caller prints the returned report as one JSON line.
///
/// # Errors
/// Bad arguments, import or allocation failure, a failed or incomplete delivery.
pub fn child_main(args: &[String]) -> Result<ChildReport, TransferError> {
    let [handle, len, ordinal] = args else {
        return Err(TransferError::input(
            "args",
            "expected <handle_hex> <donor_len> <ordinal>",
        ));
    };
    let handle = unhex("handle", handle)?;
    let len: usize = len
        .parse()
        .map_err(|_| TransferError::input("donor_len", "not a number"))?;
    let ordinal: u32 = ordinal
        .parse()
        .map_err(|_| TransferError::input("ordinal", "not a number"))?;
    // Create the context before timing the import: ~150-170 ms once per
    // process on an H200 (`context_us` of `bank_cuda_ipc`,
    // docs/qualification/h200-x2/record.json).
    let target = CudaDeviceMemory::new(ordinal, BLOCKS as usize * BLOCK)?;
    let t0 = Instant::now();
    let src = CudaIpcImport::open(&handle, ordinal, len)?;
    let import_us = t0.elapsed().as_micros() as u64;
    let backend = CudaCopyBackend::new(CudaMode::Auto)?;
    let io = [RankIo {
        src: SourceRegion::Mapped(&src),
        dst: &target,
    }];
    let mut rows = Vec::new();
    let mut host_payload = 0;
    let mut bytes_ok = true;
    let cases: [(&str, usize, Vec<u32>); 3] = [
        ("contiguous/1024x64KiB", BLOCK, (0..BLOCKS).collect()),
        (
            "scattered/1024x64KiB",
            BLOCK,
            (0..BLOCKS)
                .map(|i| (i.wrapping_mul(617) % BLOCKS) * 2 + 1)
                .collect(),
        ),
        (
            "fetch7_latency/7x32KiB",
            32 << 10,
            vec![41, 3, 17, 29, 8, 60, 22],
        ),
    ];
    for (name, block, slots) in cases {
        let layout = layout_for(block)?;
        let moves: Vec<BlockMove> = slots
            .iter()
            .enumerate()
            .map(|(i, &s)| BlockMove {
                key: SequenceHash(i as u64),
                src_slot: Some(s),
                dst_block: i as u32,
            })
            .collect();
        let plan = TransferPlan::new(
            &layout,
            &layout,
            &moves,
            &[RegionGeometry::dense(&layout, (len / block) as u32)],
            &[RegionGeometry::dense(
                &layout,
                (target.len() / block) as u32,
            )],
        )?;
        let mut times = Vec::new();
        for i in 0..=REPEATS {
            let t = Instant::now();
            let rep = deliver(&plan, &backend, &io, &DeliveryControl::new())?;
            if !rep.is_complete() {
                return Err(TransferError::input(
                    "ipc_check",
                    format!("{name}: delivery incomplete"),
                ));
            }
            host_payload += rep.counters.host_payload_bytes;
            if i > 0 {
                times.push(t.elapsed());
            }
        }
        if name.starts_with("scattered") {
            let mut got = vec![0u8; slots.len() * block];
            target.read_bytes(0, &mut got)?;
            for (i, &s) in slots.iter().enumerate() {
                let base = s as usize * block;
                bytes_ok &= got[i * block..(i + 1) * block]
                    .iter()
                    .enumerate()
                    .all(|(j, &b)| b == pattern_at(base + j));
            }
        }
        let bytes = plan.expected_bytes();
        let raw = median(crate::cuda::time_raw_device_copy(
            ordinal,
            ordinal,
            target.base_addr(),
            src.base_addr(),
            bytes as usize,
            REPEATS,
        )?);
        let t = median(times);
        let (g, rg) = (
            bytes as f64 / t.as_secs_f64() / 1e9,
            bytes as f64 / raw.as_secs_f64() / 1e9,
        );
        rows.push(BenchRow {
            name: format!("gpu_ipc_gpu0_to_gpu{ordinal}/cuda_ipc/{name}"),
            bytes,
            blocks: slots.len() as u64,
            gbps: g,
            raw_gbps: rg,
            ratio: g / rg,
            p50_us: t.as_secs_f64() * 1e6,
            phases: None,
            gather_upload: None,
        });
    }
    Ok(ChildReport {
        ordinal,
        import_us,
        bytes_ok,
        host_payload_bytes: host_payload,
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_hex_round_trips_and_rejects_garbage() {
        let h: Vec<u8> = (0..64).collect();
        assert_eq!(unhex("handle", &hex(&h)).unwrap(), h);
        assert!(unhex("handle", "abc").is_err());
        assert!(unhex("handle", "zz")
            .unwrap_err()
            .to_string()
            .contains("handle"));
    }

    #[test]
    fn child_rejects_bad_arguments_before_touching_cuda() {
        let e = child_main(&["00".into()]).unwrap_err().to_string();
        assert!(e.contains("args"), "{e}");
    }
}
