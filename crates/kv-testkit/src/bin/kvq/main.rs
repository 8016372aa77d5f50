//! `kvq`: the qualification runner. `cargo xtask qualify` builds and runs it
//! here; on a GPU machine without a toolchain it runs from the GPU bundle
//! (`bash .bundle/run.sh qualify --profile gpu --out $OUT`).
//!
//! Owns: the section framework (a failed, erroring, panicking or check-less
//! section fails the run; skips carry a reason), the reproduction record
//! (`record.json`), the report (`REPORT.md`, TTFT CDF plot), the first
//! section (`descriptor_wire`), and hidden child roles for multi-process
//! checks. The checks themselves belong to the crates they qualify; this
//! binary only calls their library functions.
//!
//! Exit codes: 0 all sections passed or skipped; 1 a check failed; 2 usage or
//! output errors.

mod advise_bench;
mod child;
mod cluster_section;
mod descriptor_wire;
mod fault_section;
mod gpu_serving_section;
mod nixl_two_process;
mod record;
mod replay_section;
mod report;
mod section;
mod sections;
mod smoke_section;
mod transfer;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};

use crate::record::Record;
use crate::section::{Ctx, Profile, Status};

#[derive(Parser)]
#[command(
    name = "kvq",
    about = "Decode-to-prefill KV reuse qualification runner"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the qualification sections; write record.json and REPORT.md.
    Qualify {
        /// `cpu` (host memory) or `gpu` (CUDA memory, IPC, NIXL VRAM).
        #[arg(long, value_enum, default_value = "cpu")]
        profile: Profile,
        /// Output directory (created; default `target/qualify/<profile>`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Mooncake JSONL trace (default: the project's copy).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Use only the first N requests of the trace (at least 1).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        trace_requests: Option<u64>,
        /// Run only these sections (repeatable).
        #[arg(long)]
        only: Vec<String>,
    },
    /// List sections and the profiles they run in.
    List,
    /// Run kv-transfer's native oracle once and print its JSON report.
    Oracle {
        /// `cpu` (host shared memory) or `gpu` (CUDA device memory).
        #[arg(long, value_enum, default_value = "cpu")]
        profile: Profile,
        /// Move the bytes through two NIXL agents instead of the native backend.
        #[arg(long)]
        nixl: bool,
    },
    /// Run a benchmark and print ratios against its in-run baseline.
    Bench {
        /// Which benchmark.
        #[arg(value_enum)]
        which: BenchKind,
        /// `cpu` or `gpu` cases (default: `cpu`; `gpu` for nixl-two-process,
        /// where `cpu` means DRAM on both sides).
        #[arg(long, value_enum)]
        profile: Option<Profile>,
        /// nixl-two-process: CUDA ordinal of the donor process's memory.
        #[arg(long, default_value_t = 0)]
        donor_gpu: u32,
        /// nixl-two-process: CUDA ordinal of this process's destination.
        #[arg(long, default_value_t = 0)]
        target_gpu: u32,
        /// Timed runs per case (median reported).
        #[arg(long, default_value_t = 10)]
        repeats: usize,
        /// Shrink every case (smoke run).
        #[arg(long)]
        quick: bool,
        /// transfer, GPU profile: sweep the gather's launch knobs (threads,
        /// CTAs per SM, max piece) over the scattered and HF rows instead.
        #[arg(long)]
        sweep: bool,
        /// advise: busy-poll window (µs) of the advise server after each
        /// answer and of the blocking client while it waits (0: off).
        #[arg(long, default_value_t = 0)]
        busy_poll_us: u64,
        /// Also write the result as JSON here.
        #[arg(long, alias = "out")]
        json: Option<PathBuf>,
    },
    /// Random faults over many fetches (`kv_testkit::faults::soak_with`);
    /// prints fetches, fallbacks, false completions and leaks as JSON.
    /// Exit 1 when any run failed, falsely completed or leaked.
    Soak {
        /// Wall time in minutes (fractions allowed).
        #[arg(long, default_value_t = 1.0)]
        minutes: f64,
        /// Seed of the fault sequence.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// The local cluster (section `cluster`): nats-server, a router, 2
    /// decode and 2 prefill processes, >= 200 multi-turn requests and four
    /// faults across processes; prints the summary and the report as JSON.
    /// Exit 0 passed, 1 a condition failed, 2 it could not run, 3 skipped
    /// (no nats-server).
    Cluster {
        /// `cpu` (host-shm banks) or `gpu` (CUDA IPC banks).
        #[arg(long, value_enum, default_value = "cpu")]
        profile: Profile,
        /// Write the report JSON here instead of stdout.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Second process of a multi-process check (started by sections).
    #[command(hide = true)]
    Child {
        /// Child role, e.g. `bank-ipc-child`.
        role: String,
        /// Role arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Benchmarks kvq runs (lookup's is a cargo bench target of kv-lookup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BenchKind {
    /// `kv_transfer::bench::run`.
    Transfer,
    /// `kv_transfer::nixl_two_process::run`: NIXL reads from a donor process.
    NixlTwoProcess,
    /// The router service's advise over NATS beside the in-process advise
    /// (`advise_bench`; `--quick`, `--json`).
    Advise,
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(code.clamp(0, 255) as u8)
}

fn main() -> ExitCode {
    match Cli::parse().cmd {
        Cmd::Qualify {
            profile,
            out,
            trace,
            trace_requests,
            only,
        } => {
            let out = out.unwrap_or_else(|| {
                PathBuf::from("target/qualify").join(match profile {
                    Profile::Cpu => "cpu",
                    Profile::Gpu => "gpu",
                })
            });
            qualify(
                profile,
                out,
                trace,
                trace_requests.map(|n| n as usize),
                &only,
            )
        }
        Cmd::List => {
            // The profile names as `--profile` takes them.
            for s in sections::ALL {
                let profiles: Vec<String> = s
                    .profiles
                    .iter()
                    .filter_map(clap::ValueEnum::to_possible_value)
                    .map(|v| v.get_name().to_string())
                    .collect();
                println!("{:<24} {}", s.name, profiles.join(", "));
            }
            ExitCode::SUCCESS
        }
        Cmd::Oracle { profile, nixl } => exit(transfer::oracle_command(profile, nixl)),
        Cmd::Bench {
            which: BenchKind::Transfer,
            profile,
            repeats,
            quick,
            sweep,
            json,
            ..
        } => exit(transfer::bench_command(
            profile.unwrap_or(Profile::Cpu),
            repeats,
            quick,
            sweep,
            json.as_deref(),
        )),
        Cmd::Bench {
            which: BenchKind::NixlTwoProcess,
            profile,
            donor_gpu,
            target_gpu,
            repeats,
            quick,
            json,
            ..
        } => exit(nixl_two_process::bench_command(
            profile.unwrap_or(Profile::Gpu),
            (donor_gpu, target_gpu),
            repeats,
            quick,
            json.as_deref(),
        )),
        Cmd::Bench {
            which: BenchKind::Advise,
            quick,
            busy_poll_us,
            json,
            ..
        } => exit(advise_bench::bench_command(
            quick,
            busy_poll_us,
            json.as_deref(),
        )),
        Cmd::Soak { minutes, seed } => soak(minutes, seed),
        Cmd::Cluster { profile, json } => exit(cluster_section::command(profile, json.as_deref())),
        Cmd::Child { role, args } => exit(child::main(&role, &args)),
    }
}

fn qualify(
    profile: Profile,
    out: PathBuf,
    trace: Option<PathBuf>,
    trace_requests: Option<usize>,
    only: &[String],
) -> ExitCode {
    let selected = sections::selected(profile, only);
    if let Some(unknown) = only
        .iter()
        .find(|o| !sections::ALL.iter().any(|s| s.name == o.as_str()))
    {
        eprintln!("kvq: unknown section {unknown:?} (see `kvq list`)");
        return ExitCode::from(2);
    }
    if selected.is_empty() {
        eprintln!("kvq: no section of profile {profile} matches --only {only:?}: nothing would be checked");
        return ExitCode::from(2);
    }
    // A GPU qualification without a GPU would pass on its CPU-only sections alone.
    let devices = record::devices();
    if profile == Profile::Gpu && devices.is_empty() {
        eprintln!("kvq: --profile gpu but nvidia-smi lists no GPU");
        return ExitCode::from(2);
    }
    // Only once the arguments are known good: a refused run leaves no folder.
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("kvq: cannot create {}: {e}", out.display());
        return ExitCode::from(2);
    }
    let ctx = Ctx {
        profile,
        trace_path: trace.unwrap_or_else(default_trace),
        trace_requests,
        out_dir: out.clone(),
        exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("kvq")),
        gpus: devices.len() as u32,
    };
    if selected.iter().any(|s| s.name == fault_section::NAME) {
        // UCX reads the routing table once per process: the link-cut fault's
        // veth pair must exist before any section starts a NIXL agent
        // (kv_testkit::netns). Where it cannot be made, that fault skips.
        if let Err(e) = kv_testkit::netns::NetnsLink::shared() {
            println!("kvq: no network namespace for link_cut_mid_transfer: {e}");
        }
    }
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let t0 = Instant::now();
    let mut results = Vec::new();
    for s in selected {
        println!("== {} ...", s.name);
        let r = section::run(s, &ctx);
        match r.status {
            Status::Passed => println!(
                "== {}: passed ({} checks, {:.0} ms)",
                r.name,
                r.checks.len(),
                r.duration_ms
            ),
            Status::Skipped => println!(
                "== {}: skipped: {}",
                r.name,
                r.skip_reason.as_deref().unwrap_or("")
            ),
            Status::Failed => {
                println!("== {}: FAILED", r.name);
                for c in r.failed_checks() {
                    println!("   {}: {}", c.name, c.detail);
                }
            }
        }
        results.push(r);
    }
    let record = Record::new(
        profile,
        started,
        t0.elapsed().as_secs_f64(),
        results,
        devices,
    );
    print!("\n{}", report::summary_table(&record));
    let written = record
        .write(&out)
        .and_then(|()| report::write(&record, &out));
    if let Err(e) = written {
        eprintln!("kvq: {e}");
        return ExitCode::from(2);
    }
    println!(
        "record: {}\nreport: {}",
        out.join("record.json").display(),
        out.join("REPORT.md").display()
    );
    if record.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// `kvq soak`: the donor-process faults start this binary as the child.
fn soak(minutes: f64, seed: u64) -> ExitCode {
    // At most a week: `Duration::from_secs_f64` panics on infinity, and a
    // NaN or non-positive budget would silently run a single request.
    if !(minutes.is_finite() && minutes > 0.0 && minutes <= 7.0 * 24.0 * 60.0) {
        eprintln!("kvq soak: `--minutes` must be a number in (0, 10080], got {minutes}");
        return ExitCode::from(2);
    }
    let child = kv_testkit::faults::ChildCommand::current_kvq();
    let r = kv_testkit::faults::soak_with(minutes, seed, Some(&child));
    match serde_json::to_string_pretty(&r) {
        Ok(json) => println!("{json}"),
        Err(e) => eprintln!("kvq soak: cannot encode the report: {e}"),
    }
    println!(
        "soak: {} requests in {:.0} s: {} fetches, {} fallbacks, {} false completions, {} wrong outputs, {} leaks",
        r.requests, r.seconds, r.fetches, r.fallbacks, r.false_completions, r.wrong_outputs, r.leaks
    );
    if r.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The project's trace: below `$KVQ_DATA_DIR` when set (the GPU bundle's
/// `run.sh` points it at the bundle's copy), else the path compiled into
/// kv-testkit ([`kv_testkit::trace::trace_path_in`]).
fn default_trace() -> PathBuf {
    let dir = std::env::var_os(kv_testkit::trace::DATA_DIR_ENV);
    kv_testkit::trace::trace_path_in(dir.as_deref())
}
