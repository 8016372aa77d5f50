//! `cargo xtask`: the project's automation entry point.
//!
//! Owns: installing what the build and tests need from outside cargo (NIXL
//! runtime wheel, nats-server, libclang), the workspace test run with its
//! closing `N passed, N failed` line, the layering check, and driving the
//! `kvq` binary (kv-testkit) for qualification, benchmarks and the GPU bundle,
//! timed cargo-fuzz runs of the kv-descriptor decoders (`fuzz`), and the loom
//! model tests of kv-lookup's left-right twin (`loom`).
//!
//! Invariant: xtask depends on no workspace crate and nothing that needs
//! libclang or CUDA, so `cargo xtask` starts on a fresh machine and installs
//! the rest before anything heavy is compiled. Deliberately absent: any
//! qualification logic (it lives in kvq, which also runs on GPU machines
//! without a toolchain).

mod apt;
mod bench;
mod bundle;
mod command;
mod elf;
mod error;
mod feature_sets;
mod fuzz;
mod kvq;
mod layering;
mod libclang;
mod loom;
mod nats;
mod nixl;
mod pip;
mod prerequisites;
mod qualify;
mod test_suite;
mod wheel;
mod workspace;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::Result;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Project automation (see README.md)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the NIXL runtime, nats-server and libclang when missing; print the environment.
    Install,
    /// Check that workspace crates depend only downward (cargo metadata).
    Deps,
    /// Prerequisites, layering check, each feature set, fmt, every workspace test, loom, the wheel
    /// and its pytest suite, clippy and workspace docs (all with -D warnings).
    Test {
        /// Extra arguments for `cargo test` (e.g. `-- --nocapture`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cargo_args: Vec<String>,
    },
    /// The main job: build kvq and run every qualification section.
    Qualify {
        /// `cpu` here, `gpu` on GPU machines; `auto` picks by `nvidia-smi -L`.
        #[arg(long, value_enum, default_value = "auto")]
        profile: qualify::Profile,
        /// Output directory (default `target/qualify/<profile>`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Build kvq with the dev profile instead of `--release` (faster build, slower run).
        #[arg(long)]
        dev: bool,
        /// Extra arguments for `kvq qualify` (e.g. `--trace-requests 500`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        kvq_args: Vec<String>,
    },
    /// Run a benchmark: `transfer` (kv-transfer), `lookup` (kv-lookup) or `advise` (router service).
    Bench {
        /// Which benchmark.
        #[arg(value_enum)]
        which: bench::Bench,
        /// Write the JSON result here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Build kvq and run `kvq soak`: random faults over many fetches; prints
    /// fetches, fallbacks, false completions and leaks (must be 0).
    Soak {
        /// Wall time in minutes (fractions allowed).
        #[arg(long, default_value_t = 1.0)]
        minutes: f64,
        /// Seed of the fault sequence.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Run the cargo-fuzz targets of `fuzz/` for N seconds each over the
    /// committed corpus; table of runs and new crash artifacts (non-zero on a crash).
    Fuzz {
        /// Seconds of fuzzing per target (libFuzzer `-max_total_time`), at least 1.
        #[arg(long)]
        seconds: u64,
        /// Target to run (repeatable); default: every file in fuzz/fuzz_targets.
        #[arg(long = "target", value_name = "NAME")]
        targets: Vec<String>,
    },
    /// Run kv-lookup's loom model tests of the left-right twin (`--cfg
    /// kv_loom`, own target dir `target/loom`); part of `cargo xtask test`.
    Loom,
    /// Build the `kv_reuse` Python wheel into `target/wheels/` (venv in
    /// `target/py-venv`) and install it there.
    Wheel {
        /// Build with the release profile into `target/wheels-release/`
        /// instead (the GPU bundle's wheel); not installed. Prints how long
        /// maturin took and the wheel's size.
        #[arg(long)]
        release: bool,
    },
    /// Build `.bundle/` (kvq + NIXL libraries) for a GPU machine and print the command.
    GpuBundle {
        /// Also bundle release test binaries of the crates with GPU tests.
        #[arg(long)]
        with_tests: bool,
    },
}

fn main() -> ExitCode {
    match dispatch(Cli::parse().cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e}");
            match e {
                // Bad arguments: the same status clap uses for its own errors.
                error::XtaskError::Usage { .. } => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Install => {
            let p = prerequisites::Prerequisites::ensure()?;
            for line in p.shell_exports() {
                println!("{line}");
            }
            Ok(())
        }
        Cmd::Deps => {
            let json = command::capture(workspace::cargo().args([
                "metadata",
                "--format-version",
                "1",
                "--no-deps",
            ]))?;
            let edges = layering::check(&json)?;
            println!(
                "layering ok: {edges} internal edges, order {}",
                layering::ORDER.join(" <- ")
            );
            Ok(())
        }
        Cmd::Test { cargo_args } => test_suite::run(&cargo_args),
        Cmd::Qualify {
            profile,
            out,
            dev,
            kvq_args,
        } => {
            let build = if dev {
                kvq::BuildProfile::Dev
            } else {
                kvq::BuildProfile::Release
            };
            qualify::run(profile, out, build, &kvq_args)
        }
        Cmd::Bench { which, json } => bench::run(which, json.as_deref()),
        Cmd::Soak { minutes, seed } => {
            let prereq = prerequisites::Prerequisites::ensure()?;
            let (exe, line) = kvq::build(kvq::BuildProfile::Release)?;
            let mut c = kvq::command(&exe, &line, &prereq);
            // `--minutes=-1` as one word: as two, kvq would read `-1` as a
            // flag and never reach its range check.
            c.args([
                "soak".to_string(),
                format!("--minutes={minutes}"),
                format!("--seed={seed}"),
            ]);
            command::run(&mut c)
        }
        Cmd::Fuzz { seconds, targets } => fuzz::run(seconds, &targets),
        Cmd::Loom => command::run(&mut loom::command()),
        Cmd::GpuBundle { with_tests } => bundle::run(with_tests),
        Cmd::Wheel { release } => {
            // The extension links kv-transfer with its default `nixl`
            // feature: nixl-sys's bindgen needs libclang before maturin's
            // cargo build reaches it, and the venv needs ensurepip.
            libclang::ensure()?;
            prerequisites::ensure_python_venv()?;
            if release {
                return wheel_release();
            }
            let wheel = wheel::build_and_install()?;
            println!("wheel: {}", wheel.display());
            println!("installed into {}", wheel::venv_dir().display());
            Ok(())
        }
    }
}

/// `cargo xtask wheel --release`: the release wheel alone, with maturin's
/// time and the wheel's size.
fn wheel_release() -> Result<()> {
    let (wheel, took) = wheel::build(wheel::WheelProfile::Release)?;
    let bytes = std::fs::metadata(&wheel)
        .map_err(error::XtaskError::io(&wheel))?
        .len();
    println!(
        "wheel: {} ({:.1} MiB, maturin {:.0} s)",
        wheel.display(),
        bytes as f64 / (1 << 20) as f64,
        took.as_secs_f64()
    );
    Ok(())
}
