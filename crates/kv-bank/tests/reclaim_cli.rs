//! `kv-bank-reclaim`: the operator's stale-bank scan from the command line.

use std::process::Command;

fn reclaim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kv-bank-reclaim"))
        .args(args)
        .output()
        .expect("kvq runs")
}

#[test]
fn reclaim_removes_only_aged_orphans_and_refuses_an_empty_prefix() {
    // Leaseless segments named like banks of a creator pid that cannot exist
    // (pid_max is at most 2^22): orphans once older than the 60 s grace.
    let prefix = format!("kvbankreclaimtest{}", std::process::id());
    let fresh = format!("{prefix}-4194304-0-00000001");
    let aged = format!("{prefix}-4194304-1-00000002");
    let shm = std::path::Path::new("/dev/shm");
    std::fs::write(shm.join(&fresh), b"x").unwrap();
    std::fs::write(shm.join(&aged), b"x").unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(600);
    std::fs::File::options()
        .write(true)
        .open(shm.join(&aged))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let out = reclaim(&["--prefix", &prefix]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {stdout} / {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let fresh_left = shm.join(&fresh).exists();
    let _ = std::fs::remove_file(shm.join(&fresh));
    let _ = std::fs::remove_file(shm.join(&aged));
    assert!(out.status.success(), "{report}");
    assert_eq!(report["prefix"], prefix.as_str());
    assert_eq!(report["live_leases"], 0);
    assert_eq!(
        report["removed"],
        serde_json::json!([format!("/{aged}")]),
        "{report}"
    );
    assert!(fresh_left, "a segment within its grace period stays");

    let out = reclaim(&["--prefix", ""]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("prefix"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--every` repeats the scan and a SIGTERM ends the loop with status 0.
#[test]
fn every_repeats_scans_until_sigterm() {
    let prefix = format!("kvbankreclaimloop{}", std::process::id());
    let child = Command::new(env!("CARGO_BIN_EXE_kv-bank-reclaim"))
        .args(["--prefix", &prefix, "--every", "0.2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(900));
    // Our own child, not yet reaped: its pid cannot have been reused.
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let scans = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&prefix))
        .count();
    assert!(scans >= 2, "expected repeated scans, got {scans}");

    let out = reclaim(&["--every", "0"]);
    assert_eq!(out.status.code(), Some(2), "an interval of 0 is refused");
}
