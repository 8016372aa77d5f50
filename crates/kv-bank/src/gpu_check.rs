//! Two-process CUDA IPC check, for a GPU machine.
//!
//! [`run`] (parent) allocates a device bank region, fills it with a
//! pattern, exports its IPC handle and spawns `exe <prefix...> bank-ipc-child
//! <args>`; [`child_main`] imports the handle, checks every byte, imports a
//! second time (which must be a mapping-cache hit) and prints one JSON line.
//! The lead wires both into a hidden `xtask` subcommand.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use crate::{cuda_probe, BankError, BankMemory, CudaDeviceMemory, CudaIpcImport};

/// The subcommand word the child is started with.
pub const CHILD_SUBCOMMAND: &str = "bank-ipc-child";

/// Region bytes of the check (64 MiB: ANCHORS.md measured opening such a handle at ~0.09 ms).
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
    /// The child's measurements.
    pub child: ChildReport,
    /// True when bytes matched, the first import opened and the second hit the cache.
    pub ok: bool,
}

fn pattern_byte(i: usize) -> u8 {
    ((i.wrapping_mul(2_654_435_761)) >> 13) as u8
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, BankError> {
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

/// Parent side: runs the check on device `0`.
///
/// # Errors
/// [`BankError::CudaUnavailable`] without a GPU (says why); a CUDA error of
/// the parent; [`BankError::Child`] when the child cannot start, fails, or
/// prints no report.
pub fn run(exe: &Path, child_args_prefix: &[String]) -> Result<GpuCheckReport, BankError> {
    let info = cuda_probe(0)?;
    let t = Instant::now();
    let mem = CudaDeviceMemory::new(0, CHECK_BYTES)?;
    let alloc_export_us = t.elapsed().as_micros() as u64;
    let data: Vec<u8> = (0..CHECK_BYTES).map(pattern_byte).collect();
    let t = Instant::now();
    mem.write_bytes(0, &data)?;
    let fill_us = t.elapsed().as_micros() as u64;
    let out = Command::new(exe)
        .args(child_args_prefix)
        .arg(CHILD_SUBCOMMAND)
        .arg(hex(mem.ipc_handle()))
        .arg(CHECK_BYTES.to_string())
        .output()
        .map_err(|e| BankError::Child(format!("cannot start {}: {e}", exe.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The JSON line may follow other text on its line (a test harness prints
    // `test name ... ` before the child's output), so parse from the first `{`.
    let child: ChildReport = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(&l[l.find('{')?..]).ok())
        .ok_or_else(|| {
            BankError::Child(format!(
                "exit {:?}, no report line; stdout: {stdout}; stderr: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            ))
        })?;
    // The child has exited, so its mappings are closed before `mem` is freed here.
    drop(mem);
    let ok = out.status.success()
        && child.mismatched_bytes == 0
        && child.first_was_miss
        && child.second_was_hit
        && child.same_mapping
        && child.bytes == CHECK_BYTES as u64;
    Ok(GpuCheckReport {
        device: format!("{} {}", info.name, info.uuid),
        bytes: CHECK_BYTES as u64,
        alloc_export_us,
        fill_us,
        child,
        ok,
    })
}

/// Child side: `args` are what follows `bank-ipc-child` (the hex handle and
/// the byte length). Prints one JSON [`ChildReport`] line; returns the exit
/// code (0 when every byte matched and the cache behaved, 1 on a mismatch,
/// 2 on an error, printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    match child(args) {
        Ok(r) => {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            if r.mismatched_bytes == 0 && r.first_was_miss && r.second_was_hit && r.same_mapping {
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
    let [handle, len] = args.as_slice() else {
        return Err(BankError::arg(
            "args",
            format!("expected <hex handle> <bytes>, got {args:?}"),
        ));
    };
    let handle = unhex(handle)?;
    let len: usize = len
        .parse()
        .map_err(|e| BankError::arg("bytes", format!("{len:?}: {e}")))?;
    let t = Instant::now();
    cuda_probe(0)?;
    let context_us = t.elapsed().as_micros() as u64;
    let t = Instant::now();
    let first = CudaIpcImport::open(&handle, 0, len)?;
    let first_import_us = t.elapsed().as_micros() as u64;
    let mut back = vec![0u8; len];
    first.read_bytes(0, &mut back)?;
    let mismatched = back
        .iter()
        .enumerate()
        .filter(|(i, &b)| b != pattern_byte(*i))
        .count();
    let t = Instant::now();
    let second = CudaIpcImport::open(&handle, 0, len)?;
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
            eprintln!("skipped: a CUDA driver is present; tests/gpu_ipc.rs covers the GPU path");
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
