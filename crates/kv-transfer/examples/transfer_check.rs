//! Runs the kv-transfer oracle or benchmark and prints JSON, for machines
//! where `cargo xtask` is not available (e.g. a lent GPU node).
//!
//! ```text
//! transfer_check oracle cpu|gpu [native|nixl]
//! transfer_check bench  cpu|gpu [--quick] [--no-nixl] [--repeats N]
//! transfer_check ipc     (GPU: donor here, one target process per GPU)
//! ```
//! Exit status 1 when the oracle fails or anything errors.

use kv_transfer::bench::{self, BenchOpts};
use kv_transfer::oracle::{self, OracleBackend, Profile};

/// Prints the report (pretty JSON, then `passed: ...`) and exits 0 when it
/// passed, 1 when it failed or `what` errored.
fn finish<R: serde::Serialize, E: std::fmt::Display>(what: &str, r: Result<(bool, R), E>) -> ! {
    match r {
        Ok((passed, r)) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&r).expect("report serializes")
            );
            println!("passed: {passed}");
            std::process::exit(if passed { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("{what} error: {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: transfer_check oracle cpu|gpu [native|nixl] | bench cpu|gpu [--quick] [--no-nixl] [--repeats N]";
    match args.first().map(String::as_str) {
        Some(kv_transfer::ipc_check::CHILD_SUBCOMMAND) => {
            match kv_transfer::ipc_check::child_main(&args[1..]) {
                Ok(r) => {
                    println!("{}", serde_json::to_string(&r).expect("report serializes"));
                    return;
                }
                Err(e) => {
                    eprintln!("ipc child error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Some("ipc") => {
            let exe = std::env::current_exe().expect("own path");
            let r = kv_transfer::ipc_check::run(&exe, &[]);
            finish("ipc check", r.map(|r| (r.passed(), r)));
        }
        _ => {}
    }
    let (Some(what), Some(profile)) = (args.first(), args.get(1)) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let profile: Profile = profile.parse().unwrap_or_else(|e| {
        eprintln!("{e}\n{usage}");
        std::process::exit(2)
    });
    match what.as_str() {
        "oracle" => {
            let backend = match args.get(2).map(String::as_str) {
                None | Some("native") => OracleBackend::Native,
                Some("nixl") => OracleBackend::Nixl,
                Some(other) => {
                    eprintln!("unknown backend `{other}`\n{usage}");
                    std::process::exit(2)
                }
            };
            let r = oracle::run_backend(profile, backend);
            finish("oracle", r.map(|r| (r.passed(), r)));
        }
        "bench" => {
            let mut opts = BenchOpts {
                profile,
                ..BenchOpts::default()
            };
            let mut it = args[2..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--quick" => opts.quick = true,
                    "--no-nixl" => opts.nixl = false,
                    "--repeats" => {
                        opts.repeats = it.next().and_then(|n| n.parse().ok()).unwrap_or(10)
                    }
                    other => {
                        eprintln!("unknown flag `{other}`\n{usage}");
                        std::process::exit(2);
                    }
                }
            }
            match bench::run(&opts) {
                Ok(rows) => {
                    for r in &rows {
                        println!("{}", serde_json::to_string(r).expect("row serializes"));
                    }
                }
                Err(e) => {
                    eprintln!("bench error: {e}");
                    std::process::exit(1);
                }
            }
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
}
