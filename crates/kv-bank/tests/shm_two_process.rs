//! Host shared memory across two real processes: the test binary re-executes
//! itself as the child (selected by `KV_BANK_SHM_CHILD`).

use std::process::Command;

use kv_bank::{BankMemory, HostShmMemory};

const CHILD_ENV: &str = "KV_BANK_SHM_CHILD";
const LEN: usize = 1 << 20;

fn pattern(i: usize, seed: u8) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed)
}

/// Child role: map the parent's object, check the parent's first half, write
/// the second half, exit 0 on success.
fn child(name: &str) -> i32 {
    let m = match HostShmMemory::open(name, LEN) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("child: open failed: {e}");
            return 2;
        }
    };
    let mut half = vec![0u8; LEN / 2];
    m.read_bytes(0, &mut half).unwrap();
    if let Some(i) = (0..LEN / 2).find(|&i| half[i] != pattern(i, 1)) {
        eprintln!("child: byte {i} is {} expected {}", half[i], pattern(i, 1));
        return 3;
    }
    let mine: Vec<u8> = (0..LEN / 2).map(|i| pattern(i, 2)).collect();
    m.write_bytes(LEN / 2, &mine).unwrap();
    assert!(!m.is_owner());
    0
}

#[test]
fn shm_bytes_cross_two_processes() {
    if let Ok(name) = std::env::var(CHILD_ENV) {
        std::process::exit(child(&name));
    }
    let owner = HostShmMemory::create_unique("kvbank-test", LEN).unwrap();
    let first: Vec<u8> = (0..LEN / 2).map(|i| pattern(i, 1)).collect();
    owner.write_bytes(0, &first).unwrap();

    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "shm_bytes_cross_two_processes",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, owner.name())
        .status()
        .unwrap();
    assert!(status.success(), "child failed: {status}");

    let mut second = vec![0u8; LEN / 2];
    owner.read_bytes(LEN / 2, &mut second).unwrap();
    let bad = (0..LEN / 2).filter(|&i| second[i] != pattern(i, 2)).count();
    assert_eq!(bad, 0, "bytes written by the child differ");

    let name = owner.name().to_string();
    drop(owner);
    assert!(
        !std::path::Path::new(&format!("/dev/shm{name}")).exists(),
        "owner drop must unlink"
    );
}

#[test]
fn child_fails_when_name_is_gone() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let owner = HostShmMemory::create_unique("kvbank-test", 4096).unwrap();
    let name = owner.name().to_string();
    drop(owner);
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_bytes_cross_two_processes", "--nocapture"])
        .env(CHILD_ENV, &name)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2), "child must report the open failure");
}

#[test]
fn create_rejects_bad_input_and_duplicates() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    assert!(HostShmMemory::create("no-slash", 10).is_err());
    assert!(HostShmMemory::create("/a/b", 10).is_err());
    assert!(HostShmMemory::create_unique("kvbank-test", 0).is_err());
    let a = HostShmMemory::create_unique("kvbank-test", 4096).unwrap();
    let err = HostShmMemory::create(a.name(), 4096)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shm_open"), "{err}");
    // The failed duplicate create must not unlink the owner's name.
    assert!(HostShmMemory::open(a.name(), 4096).is_ok());
    // An importer asking for more than exists is refused.
    assert!(HostShmMemory::open(a.name(), 8192).is_err());
}
