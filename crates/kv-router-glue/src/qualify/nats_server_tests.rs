//! `find_nats_server`'s checks against fake `nats-server` scripts.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::{find_in, fresh_dir, parse_version, NatsServerError};

/// A temp dir holding `nats-server`, a shell script printing `version_line`
/// for `--version`, with mode `mode`.
fn fake(tag: &str, version_line: &str, mode: u32) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("kv-fake-nats-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("nats-server");
    std::fs::write(&bin, format!("#!/bin/sh\necho '{version_line}'\n")).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(mode)).unwrap();
    (dir, bin)
}

fn none() -> &'static Path {
    Path::new("/nonexistent/kv-test/nats-server")
}

#[test]
fn explicit_binary_without_executable_bit_is_rejected_naming_the_path() {
    let (dir, bin) = fake("noexec", "nats-server: v2.10.22", 0o644);
    let got = find_in(Some(bin.clone().into()), None, none());
    assert_eq!(
        got,
        Err(NatsServerError::NotExecutable { path: bin.clone() })
    );
    assert!(got
        .unwrap_err()
        .to_string()
        .contains(&bin.display().to_string()));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn old_server_is_rejected_with_its_version() {
    let (dir, bin) = fake("old", "nats-server: v2.9.25", 0o755);
    let got = find_in(Some(bin.clone().into()), None, none());
    assert_eq!(
        got,
        Err(NatsServerError::TooOld {
            path: bin.clone(),
            version: "2.9.25".into()
        })
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn any_file_printing_no_version_is_rejected() {
    let (dir, bin) = fake("garbage", "hello", 0o755);
    match find_in(Some(bin.clone().into()), None, none()) {
        Err(NatsServerError::VersionUnreadable { path, reason }) => {
            assert_eq!(path, bin);
            assert!(reason.contains("hello"), "{reason}");
        }
        other => panic!("expected VersionUnreadable, got {other:?}"),
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn current_server_on_path_is_accepted_and_non_executable_ones_passed_over() {
    let (bad_dir, _) = fake("path-noexec", "nats-server: v2.10.22", 0o644);
    let (good_dir, good) = fake("path-good", "nats-server: v2.10.0", 0o755);
    let path_var = std::env::join_paths([&bad_dir, &good_dir]).unwrap();
    assert_eq!(find_in(None, Some(path_var), none()), Ok(good));
    assert_eq!(find_in(None, None, none()), Err(NatsServerError::NotFound));
    std::fs::remove_dir_all(bad_dir).unwrap();
    std::fs::remove_dir_all(good_dir).unwrap();
}

#[test]
fn version_parsing_reads_the_first_semver_word() {
    assert_eq!(parse_version("nats-server: v2.10.22\n"), Some((2, 10, 22)));
    assert_eq!(parse_version("nats-server: v2.11.0-RC.1"), Some((2, 11, 0)));
    assert_eq!(parse_version("nats-server: 2.10.22"), None);
    assert_eq!(parse_version("v2.10"), None);
}

/// The NATS `INFO` line a server sends first on a connection, which names
/// its `server_id` (distinct per server process).
fn server_id(port: u16) -> String {
    use std::io::{BufRead, BufReader};
    let stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    let info: serde_json::Value =
        serde_json::from_str(line.strip_prefix("INFO ").expect("INFO first")).unwrap();
    info["server_id"].as_str().unwrap().to_string()
}

#[test]
fn servers_started_at_once_get_their_own_ports_and_a_restart_keeps_its_port() {
    const TEST: &str = "servers_started_at_once_get_their_own_ports_and_a_restart_keeps_its_port";
    if super::NatsServer::start_or_skip(TEST).is_none() {
        return;
    }
    let servers: Vec<super::NatsServer> = std::thread::scope(|s| {
        let started: Vec<_> = (0..6)
            .map(|_| s.spawn(|| super::NatsServer::start().unwrap()))
            .collect();
        started.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ports: std::collections::BTreeSet<u16> = servers.iter().map(|s| s.port).collect();
    assert_eq!(ports.len(), servers.len(), "{ports:?}");
    let ids: std::collections::BTreeSet<String> =
        servers.iter().map(|s| server_id(s.port)).collect();
    assert_eq!(ids.len(), servers.len(), "each port is its own server");
    let mut first = servers.into_iter().next().unwrap();
    let (port, before) = (first.port, server_id(first.port));
    first.restart().unwrap();
    assert_eq!(first.port, port);
    assert_eq!(first.url(), format!("nats://127.0.0.1:{port}"));
    assert_ne!(
        server_id(port),
        before,
        "a new process answers on the same port"
    );
}

#[test]
fn a_store_dir_left_by_an_earlier_process_is_emptied_before_use() {
    // What a killed process with this pid left: a JetStream store.
    let dir = std::env::temp_dir().join(format!("kv-fake-nats-{}-stale", std::process::id()));
    std::fs::create_dir_all(dir.join("jetstream/$G/streams/KV_kv_donors")).unwrap();
    std::fs::write(
        dir.join("jetstream/$G/streams/KV_kv_donors/meta.inf"),
        b"{}",
    )
    .unwrap();
    fresh_dir(&dir).unwrap();
    assert!(dir.is_dir());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "stale store kept"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    // A missing one is created.
    fresh_dir(&dir).unwrap();
    assert!(dir.is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}
