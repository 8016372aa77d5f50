//! `kvq bench nixl-two-process`: kv-transfer's two-process NIXL benchmark
//! (`kv_transfer::nixl_two_process`), with the donor started as
//! `kvq child nixl-donor ...`. Prints a table and the JSON report; exit 0
//! when it passed, or skipped on the CPU profile (no NIXL runtime: reason
//! printed), 1 when a case failed or a byte differed, 2 on a setup or usage
//! error, including a GPU profile that could not run (no GPU or no NIXL
//! runtime: [`Profile::Gpu`] makes a missing GPU a failure, as `kvq bench
//! transfer` and `kvq oracle` do).

use std::path::Path;
use std::time::Duration;

use kv_transfer::nixl_two_process::{self, Memory, TwoProcessOpts, TwoProcessReport};

use crate::section::Profile;

/// Runs the benchmark: `profile` gpu = VRAM on `gpus.0` (donor) and `gpus.1`
/// (target), cpu = DRAM; `quick` caps `repeats` at 5 (same sizes).
pub fn bench_command(
    profile: Profile,
    gpus: (u32, u32),
    repeats: usize,
    quick: bool,
    json: Option<&Path>,
) -> i32 {
    const NAME: &str = "kvq bench nixl-two-process";
    // Before any agent exists and while single-threaded: UCX reads these at
    // startup, and the donor inherits them. The log goes next to the JSON.
    let log_dir = json
        .and_then(Path::parent)
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(std::env::temp_dir, Path::to_path_buf);
    if let Err(e) = std::fs::create_dir_all(&log_dir) {
        eprintln!("{NAME}: cannot create {}: {e}", log_dir.display());
        return 2;
    }
    nixl_two_process::enable_ucx_proto_log(&log_dir, "nixl-two-process");

    let mut opts = TwoProcessOpts::new(match profile {
        Profile::Cpu => Memory::Dram,
        Profile::Gpu => Memory::Vram,
    });
    (opts.donor_gpu, opts.target_gpu) = gpus;
    opts.repeats = if quick {
        repeats.clamp(1, 5)
    } else {
        repeats.max(1)
    };
    if quick {
        opts.handshake_timeout = Duration::from_secs(45);
        opts.delivery_timeout = Duration::from_secs(10);
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| "kvq".into());
    let donor = nixl_two_process::child_command(&exe, &[crate::child::SUBCOMMAND]);
    let rep = match nixl_two_process::run(&opts, &donor) {
        Ok(rep) => rep,
        Err(e) => {
            eprintln!("{NAME}: {e}");
            return 2;
        }
    };
    let doc = serde_json::to_string_pretty(&rep).unwrap_or_default();
    if let Some(why) = &rep.skipped {
        println!("{NAME}: skipped: {why}");
    } else {
        print!("{}", table(&rep));
    }
    println!("{doc}");
    if let Some(path) = json {
        if let Err(e) = std::fs::write(path, &doc) {
            eprintln!("{NAME}: cannot write {}: {e}", path.display());
            return 2;
        }
        println!("json: {}", path.display());
    }
    if rep.skipped.is_some() && profile == Profile::Gpu {
        eprintln!("{NAME}: the gpu profile could not run here");
        return 2;
    }
    i32::from(!rep.passed())
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

/// Fixed-width table: one row per case, with both ratios and the transport.
fn table(rep: &TwoProcessReport) -> String {
    let mut s = String::new();
    if let Some(r) = &rep.raw_copy {
        s.push_str(&format!(
            "raw copy: {} of {} bytes: {:.2} GB/s (p50 {:.1} µs)\n",
            r.what, r.bytes, r.gbps, r.p50_us
        ));
    }
    if let Some(e) = &rep.raw_copy_error {
        s.push_str(&format!("raw copy: not timed: {e}\n"));
    }
    s.push_str(&format!(
        "{:<36} {:>9} {:>10} {:>8} {:>8} {:>6} {:<24} {}\n",
        "case", "GB/s", "p50 µs", "vs raw", "vs ipc", "bytes", "transport", "note"
    ));
    for r in &rep.rows {
        let ok = match r.bytes_ok {
            Some(true) => "ok",
            Some(false) => "BAD",
            None => "-",
        };
        let note = r
            .error
            .as_deref()
            .map(|e| format!("ERROR {e}"))
            .or_else(|| r.refused.as_deref().map(|e| format!("refused: {e}")))
            .unwrap_or_default();
        s.push_str(&format!(
            "{:<36} {:>9} {:>10} {:>8} {:>8} {:>6} {:<24} {}\n",
            r.name,
            opt(r.gbps, 2),
            opt(r.p50_us, 1),
            opt(r.ratio_vs_raw_copy, 3),
            opt(r.ratio_vs_cuda_ipc, 3),
            ok,
            r.transport,
            note
        ));
    }
    s
}
