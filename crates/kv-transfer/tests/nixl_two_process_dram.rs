//! The two-process NIXL benchmark's machinery on host memory (no GPU): this
//! test binary starts itself again as the donor (`KVX_2P_DONOR_ARGS` set),
//! which registers DRAM with its own NIXL agent; the test reads it through
//! `NixlBackend` in both modes and checks every byte.
//!
//! One test per binary: it sets `UCX_PROTO_INFO` / `UCX_LOG_FILE` (read by
//! UCX process-wide), and the donor re-runs this same test by name. Skips
//! without the NIXL runtime, except under `CI=true`.

use std::process::Command;
use std::time::Duration;

use kv_transfer::nixl::runtime_status;
use kv_transfer::nixl_two_process::{self, Memory, TwoProcessOpts};

const DONOR_ENV: &str = "KVX_2P_DONOR_ARGS";
const THIS_TEST: &str = "dram_fetch_from_a_donor_process";

fn donor_command(args: &[String]) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test executable"));
    c.args(["--exact", THIS_TEST, "--nocapture", "--test-threads=1"])
        .env(DONOR_ENV, args.join(" "));
    c
}

#[test]
fn dram_fetch_from_a_donor_process() {
    if let Ok(args) = std::env::var(DONOR_ENV) {
        let args: Vec<String> = args.split(' ').map(String::from).collect();
        std::process::exit(nixl_two_process::donor_main(&args));
    }
    match runtime_status() {
        Ok(()) => {}
        Err(e) if kv_transfer::ci_requires() => panic!("CI=true and {e}"),
        Err(e) => {
            println!("SKIP nixl two-process test: {e}");
            return;
        }
    }
    // Both processes' UCX logs (`%p`) go in a folder removed with the test.
    let log_dir = tempfile::tempdir().unwrap();
    let log = nixl_two_process::enable_ucx_proto_log(log_dir.path(), "kvx-2p-test");
    let mut opts = TwoProcessOpts::new(Memory::Dram);
    opts.blocks = 16;
    opts.block_bytes = 16 << 10;
    opts.repeats = 3;
    opts.handshake_timeout = Duration::from_secs(60);
    opts.donor_timeout = Duration::from_secs(120);

    let rep = nixl_two_process::run(&opts, &donor_command).unwrap();
    println!("{}", serde_json::to_string_pretty(&rep).unwrap());
    assert_eq!(rep.skipped, None);
    assert_ne!(rep.donor_pid, Some(std::process::id()));
    assert_eq!(rep.ucx_log, log);
    assert!(rep.raw_copy.as_ref().is_some_and(|r| r.gbps > 0.0));
    let names: Vec<&str> = rep.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nixl_prepared/contiguous/16x16KiB",
            "nixl_runs/contiguous/16x16KiB",
            "nixl_prepared/scattered/16x16KiB",
            "nixl_runs/scattered/16x16KiB",
        ]
    );
    for r in &rep.rows {
        assert_eq!(r.error, None, "{}", r.name);
        assert_eq!(r.bytes_ok, Some(true), "{}", r.name);
        assert_eq!(r.bytes, 16 * (16 << 10));
        assert!(r.gbps.is_some_and(|g| g > 0.0) && r.ratio_vs_raw_copy.is_some());
        // Host memory: every byte counts as host payload.
        assert_eq!(r.host_payload_bytes, r.bytes, "{}", r.name);
        // UCX's protocol table names what it chose between the two processes.
        assert_ne!(r.transport, "unknown", "{}: UCX log {log:?}", r.name);
    }
    assert!(rep.passed());
    assert_eq!(rep.donor_exit.as_deref(), Some("exit status: 0"));

    // A donor that fails before its handshake: a clean error with its stderr.
    let bad = |_: &[String]| donor_command(&["flash".into(), "0".into(), "1".into(), "1".into()]);
    let e = nixl_two_process::run(&opts, &bad).unwrap_err().to_string();
    assert!(
        e.contains("before its handshake") && e.contains("flash"),
        "{e}"
    );
}
