//! `kv-bank-reclaim`: the operator's stale-bank cleanup.
//!
//! Removes retained banks (shared-memory segments under `/dev/shm` and their
//! lease records) whose owner died: a lease that lapsed, or a leaseless
//! segment of a dead creator after its grace period. Live banks are never
//! touched ([`kv_bank::reclaim_stale`] holds the rules). One scan by default;
//! `--every SECONDS` repeats until SIGTERM / SIGINT, for a sidecar or a
//! node daemon. Each scan prints one JSON object on stdout:
//! `{"prefix", "removed": [names], "live_leases", "errors": [..]}`.
//!
//! Exit status: 0 when every scan handled every entry, 1 when an entry could
//! not be handled (named in `errors`), 2 for bad arguments (an empty prefix or
//! one with `/`).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;

/// Remove retained KV banks left behind by dead owners.
#[derive(Debug, Parser)]
#[command(name = "kv-bank-reclaim", version, about, long_about = None)]
struct Cli {
    /// Name prefix of the banks to judge (workers' banks use `kvbank`).
    #[arg(long, default_value = kv_bank::DEFAULT_SHM_PREFIX)]
    prefix: String,
    /// Scan again every SECONDS until SIGTERM or SIGINT (default: one scan).
    #[arg(long, value_name = "SECONDS", value_parser = parse_every)]
    every: Option<Duration>,
}

/// How often a waiting `--every` loop looks for a termination signal.
const POLL: Duration = Duration::from_millis(100);

fn parse_every(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|e| format!("`--every`: {e}"))?;
    if !(secs.is_finite() && (0.1..=86_400.0).contains(&secs)) {
        return Err(format!(
            "`--every` must be within 0.1 ..= 86400 seconds, got {s}"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// One scan, printed; `Err` carries the exit code for a refused prefix.
fn scan(prefix: &str) -> Result<bool, ExitCode> {
    match kv_bank::reclaim_stale(prefix, kv_bank::reclaim::ScanTime::now()) {
        Ok(r) => {
            let report = serde_json::json!({
                "prefix": prefix,
                "removed": r.removed_names(),
                "live_leases": r.live,
                "errors": r.errors,
            });
            println!("{report}");
            Ok(r.errors.is_empty())
        }
        Err(e) => {
            eprintln!("kv-bank-reclaim: {e}");
            Err(ExitCode::from(2))
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(every) = cli.every else {
        return match scan(&cli.prefix) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(code) => code,
        };
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, stop.clone()) {
            eprintln!("kv-bank-reclaim: cannot handle signal {sig}: {e}");
            return ExitCode::from(2);
        }
    }
    let mut all_ok = true;
    'scans: loop {
        match scan(&cli.prefix) {
            Ok(ok) => all_ok &= ok,
            Err(code) => return code,
        }
        // Sleep in short steps so a signal ends the wait promptly.
        let until = Instant::now() + every;
        while Instant::now() < until {
            if stop.load(Ordering::Relaxed) {
                break 'scans;
            }
            std::thread::sleep(POLL.min(until.saturating_duration_since(Instant::now())));
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
