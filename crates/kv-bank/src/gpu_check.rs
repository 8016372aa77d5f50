//! Two-process CUDA IPC check, for a GPU machine.
//!
//! [`run`] (parent) allocates a device bank region, fills it with a
//! pattern, exports its IPC handle and spawns `exe <prefix...> bank-ipc-child
//! <args>`; [`child_main`] imports the handle, checks every byte, imports a
//! second time (which must be a mapping-cache hit) and prints one JSON line.
//! The lead wires both into a hidden `xtask` subcommand.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::child_process::{ChildProcess, ChildStderr};
use crate::{cuda_probe, BankError, BankMemory, CudaDeviceMemory, CudaIpcImport};

/// The subcommand word the child is started with.
pub const CHILD_SUBCOMMAND: &str = "bank-ipc-child";

/// Region bytes of the check (64 MiB: opening its handle took ~0.12 ms on an
/// H200, `first_import_us` of `bank_cuda_ipc` in
/// `docs/qualification/h200-x2/record.json`).
pub const CHECK_BYTES: usize = 64 << 20;

/// What the child measured, as its JSON line.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChildReport {
    /// Bytes checked.
    pub bytes: u64,
    /// First import (`cuIpcOpenMemHandle`) in µs, context already created.
    pub first_import_us: u64,
    /// Second import of the same handle in µs (cache hit expected).
    pub second_import_us: u64,
    /// CUDA context creation plus probe in µs (paid once per importer process).
    pub context_us: u64,
    /// True when the first import was a cache miss.
    pub first_was_miss: bool,
    /// True when the second import was a cache hit.
    pub second_was_hit: bool,
    /// Cache opens counted after both imports (expected 1).
    pub cache_opens: u64,
    /// Cache hits counted after both imports (expected 1).
    pub cache_hits: u64,
    /// Bytes that differed from the pattern.
    pub mismatched_bytes: u64,
    /// Both mappings had the same device address.
    pub same_mapping: bool,
}

/// Outcome of the optional fabric-handle round of the check.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FabricOutcome {
    /// True when the device reports fabric support and a round was attempted.
    pub attempted: bool,
    /// True when the child imported the fabric handle byte-exact with a cache hit on re-import.
    pub ok: bool,
    /// Why it was skipped or failed, or `imported` on success.
    pub detail: String,
    /// The child's measurements, when it ran.
    pub child: Option<ChildReport>,
}

/// Result of [`run`], serializable for the GPU bundle's record.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuCheckReport {
    /// GPU name and UUID.
    pub device: String,
    /// Bytes allocated, exported and checked.
    pub bytes: u64,
    /// Parent: `cuMemAlloc` + `cuIpcGetMemHandle` in µs.
    pub alloc_export_us: u64,
    /// Parent: host-to-device pattern fill in µs.
    pub fill_us: u64,
    /// The child's measurements (CUDA IPC handle).
    pub child: ChildReport,
    /// True when bytes matched, the first import opened and the second hit the cache.
    pub ok: bool,
    /// The same round with a fabric handle, where the device supports it
    /// (needs an IMEX channel; informative, not part of `ok`).
    pub fabric: FabricOutcome,
}

fn pattern_byte(i: usize) -> u8 {
    ((i.wrapping_mul(2_654_435_761)) >> 13) as u8
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Result<Vec<u8>, BankError> {
    if s.len() % 2 != 0 {
        return Err(BankError::arg("handle", "odd hex length"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&s[i..i + 2], 16)
                .map_err(|e| BankError::arg("handle", e.to_string()))
        })
        .collect()
}

/// Longest wait for the importer child's report and for its exit.
const CHILD_WAIT: Duration = Duration::from_secs(60);

fn child_ok(c: &ChildReport) -> bool {
    c.mismatched_bytes == 0 && c.first_was_miss && c.second_was_hit && c.same_mapping
}

/// Spawns the child on `mem`'s handle and returns its report; `mem` must
/// outlive the child (it does: the child has exited when this returns).
fn spawn_child(
    exe: &Path,
    prefix: &[String],
    mem: &CudaDeviceMemory,
) -> Result<ChildReport, BankError> {
    let mut cmd = Command::new(exe);
    cmd.args(prefix)
        .arg(CHILD_SUBCOMMAND)
        .arg(hex(mem.handle_bytes()))
        .arg(CHECK_BYTES.to_string());
    if mem.is_fabric() {
        cmd.arg("fabric");
    }
    let mut proc = ChildProcess::spawn(cmd, ChildStderr::Inherit)?;
    let child: ChildReport = proc.next_json("report", CHILD_WAIT)?;
    let status = proc.wait_exit(CHILD_WAIT);
    if !status.is_some_and(|s| s.success()) && child_ok(&child) {
        return Err(BankError::Child(format!(
            "exit {status:?} despite a good report"
        )));
    }
    Ok(child)
}

/// Parent side: runs the check on device `0`.
///
/// # Errors
/// [`BankError::CudaUnavailable`] without a GPU (says why); a CUDA error of
/// the parent; [`BankError::Child`] when the child cannot start, fails, or
/// prints no report. A failing fabric round is reported in
/// [`GpuCheckReport::fabric`], not as an error.
pub fn run(exe: &Path, child_args_prefix: &[String]) -> Result<GpuCheckReport, BankError> {
    let info = cuda_probe(0)?;
    let data: Vec<u8> = (0..CHECK_BYTES).map(pattern_byte).collect();
    let t = Instant::now();
    let mem = CudaDeviceMemory::new(0, CHECK_BYTES)?;
    let alloc_export_us = t.elapsed().as_micros() as u64;
    let t = Instant::now();
    mem.write_bytes(0, &data)?;
    let fill_us = t.elapsed().as_micros() as u64;
    let child = spawn_child(exe, child_args_prefix, &mem)?;
    drop(mem);
    let fabric = if !info.fabric_supported {
        FabricOutcome {
            attempted: false,
            ok: false,
            detail: "device does not report fabric handle support".into(),
            child: None,
        }
    } else {
        let round = CudaDeviceMemory::new_fabric(0, CHECK_BYTES).and_then(|m| {
            m.write_bytes(0, &data)?;
            spawn_child(exe, child_args_prefix, &m)
        });
        match round {
            Ok(c) => FabricOutcome {
                attempted: true,
                ok: child_ok(&c),
                detail: "imported".into(),
                child: Some(c),
            },
            Err(e) => FabricOutcome {
                attempted: true,
                ok: false,
                detail: e.to_string(),
                child: None,
            },
        }
    };
    Ok(GpuCheckReport {
        device: format!("{} {}", info.name, info.uuid),
        bytes: CHECK_BYTES as u64,
        alloc_export_us,
        fill_us,
        ok: child_ok(&child) && child.bytes == CHECK_BYTES as u64,
        child,
        fabric,
    })
}

/// Child side: `args` are what follows `bank-ipc-child` (the hex handle,
/// the byte length, and `fabric` for a fabric handle). Prints one JSON [`ChildReport`] line; returns the exit
/// code (0 when every byte matched and the cache behaved, 1 on a mismatch,
/// 2 on an error, printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    match child(args) {
        Ok(r) => {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            if child_ok(&r) {
                0
            } else {
                1
            }
        }
        Err(e) => {
            eprintln!("bank-ipc-child: {e}");
            2
        }
    }
}

fn child(args: &[String]) -> Result<ChildReport, BankError> {
    let args: Vec<&String> = args
        .iter()
        .filter(|a| a.as_str() != CHILD_SUBCOMMAND)
        .collect();
    let (handle, len, fabric) = match args.as_slice() {
        [h, l] => (h, l, false),
        [h, l, f] if f.as_str() == "fabric" => (h, l, true),
        _ => {
            return Err(BankError::arg(
                "args",
                format!("expected <hex handle> <bytes> [fabric], got {args:?}"),
            ))
        }
    };
    let open = if fabric {
        CudaIpcImport::open_fabric
    } else {
        CudaIpcImport::open
    };
    let handle = unhex(handle)?;
    let len: usize = len
        .parse()
        .map_err(|e| BankError::arg("bytes", format!("{len:?}: {e}")))?;
    let t = Instant::now();
    cuda_probe(0)?;
    let context_us = t.elapsed().as_micros() as u64;
    let t = Instant::now();
    let first = open(&handle, 0, len)?;
    let first_import_us = t.elapsed().as_micros() as u64;
    let mut back = vec![0u8; len];
    first.read_bytes(0, &mut back)?;
    let mismatched = back
        .iter()
        .enumerate()
        .filter(|(i, &b)| b != pattern_byte(*i))
        .count();
    let t = Instant::now();
    let second = open(&handle, 0, len)?;
    let second_import_us = t.elapsed().as_micros() as u64;
    let stats = crate::ipc_cache_stats();
    Ok(ChildReport {
        bytes: len as u64,
        first_import_us,
        second_import_us,
        context_us,
        first_was_miss: !first.cache_hit(),
        second_was_hit: second.cache_hit(),
        cache_opens: stats.opens,
        cache_hits: stats.hits,
        mismatched_bytes: mismatched as u64,
        same_mapping: first.base_addr() == second.base_addr(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_gpu_run_says_why() {
        // SAFETY: only a dlopen probe.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            println!("SKIP no-GPU gpu_check test: a CUDA driver is present; tests/gpu_ipc.rs covers the GPU path");
            return;
        }
        let e = run(Path::new("/bin/false"), &[]).unwrap_err();
        assert!(e.to_string().contains("libcuda"), "{e}");
        assert_eq!(child_main(&["00".repeat(64), "1024".into()]), 2);
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let h: Vec<u8> = (0..64).collect();
        assert_eq!(unhex(&hex(&h)).unwrap(), h);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
        assert_eq!(child_main(&["only-one".into()]), 2);
    }
}
