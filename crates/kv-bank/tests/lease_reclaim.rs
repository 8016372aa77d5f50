//! Owner leases and stale-bank reclamation, with a real owner process: the
//! test binary re-executes itself as the lease owner (`lease_owner_child_role`
//! with the child arguments as extra filters) and is SIGKILLed.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use kv_bank::reclaim::ScanTime;
use kv_bank::{
    faults, read_lease, reclaim_stale, reclaim_stale_with, BankConfig, BankError, BankManager,
    HostShmMemory, LeaseConfig, LeaseInstant, ReclaimPolicy, Reclaimer,
};
use kv_descriptor::{BankDescriptor, BankParts, EngineId, OwnerLease, Role};

/// Tests of this file that judge timing or scan shared names run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn prefix(tag: &str) -> String {
    format!("kvbank-t{tag}{:08x}", uuid::Uuid::new_v4().as_u128() as u32)
}

fn lease_bank(prefix: &str, lease: LeaseConfig) -> BankManager {
    let l = common::layout(2);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        4 * l.block_bytes() as u64,
    );
    cfg.shm_prefix = prefix.to_string();
    cfg.lease = lease;
    BankManager::new_host_shm(cfg, "test-host").unwrap()
}

fn shm_entries(prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    v.sort();
    v
}

#[test]
fn lease_owner_child_role() {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == faults::CHILD_SUBCOMMAND) else {
        return; // not started as the child
    };
    std::process::exit(faults::child_main(&args[at + 1..]));
}

#[test]
fn killed_owner_bank_lapses_is_refused_and_reclaimed_without_an_operator() {
    let _g = serial();
    let exe = std::env::current_exe().unwrap();
    let prefix: Vec<String> = ["--exact", "lease_owner_child_role", "--nocapture"]
        .map(String::from)
        .to_vec();
    let o = faults::owner_killed(&exe, &prefix, Duration::from_millis(600)).unwrap();
    println!("{}", serde_json::to_string_pretty(&o).unwrap());
    assert_ne!(o.child_pid, std::process::id());
    assert_eq!(o.live_imports, 2, "both ranks import while the owner lives");
    assert_eq!(o.live_mismatched_bytes, 0, "imported bytes are the child's");
    assert!(
        o.renewals_seen >= 2,
        "the child renewed: {}",
        o.renewals_seen
    );
    assert_eq!(
        o.reclaimed_while_live, 0,
        "a live owner's bank is never reclaimed"
    );
    assert!(
        o.lapse_after_kill_ms <= 600 + 500,
        "lapsed within one lease after the kill: {} ms",
        o.lapse_after_kill_ms
    );
    // Before reclamation: descriptor import and raw open both refused by the lease.
    assert_eq!(o.refused_before_reclaim.len(), 4);
    assert!(
        o.refused_before_reclaim
            .iter()
            .all(|e| e.contains("expired")),
        "{:?}",
        o.refused_before_reclaim
    );
    assert_eq!(o.reclaim.reclaimed.len(), 2);
    for r in &o.reclaim.reclaimed {
        assert_eq!(r.pid, o.child_pid);
        assert!(!r.owner_alive);
        assert!(r.segment.is_some(), "the segment went with its lease");
        assert_eq!(r.generation, 1);
    }
    assert_eq!(o.reclaim.removed_names().len(), 4);
    // After: the lease and the segment are gone.
    assert_eq!(o.refused_after_reclaim.len(), 4);
    assert!(
        o.refused_after_reclaim[0].contains("does not exist"),
        "{:?}",
        o.refused_after_reclaim
    );
    assert!(
        o.refused_after_reclaim[1].contains("shm_open"),
        "{:?}",
        o.refused_after_reclaim
    );
    assert_eq!(o.false_imports, 0);
    assert!(o.entries_left.is_empty(), "{:?}", o.entries_left);
}

#[test]
fn live_owner_is_never_reclaimed_while_it_renews() {
    let _g = serial();
    let p = prefix("l");
    let bank = lease_bank(
        &p,
        LeaseConfig::background(Duration::from_millis(300), Duration::from_millis(40)),
    );
    let first = bank.lease_status();
    assert_eq!(first.names.len(), 2);
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(100));
        let r = reclaim_stale(&p, ScanTime::now()).unwrap();
        assert!(r.reclaimed.is_empty(), "{r:?}");
        assert_eq!(r.live, 2);
    }
    let now = bank.lease_status();
    assert!(now.live);
    assert!(now.renewals >= 8, "renewals {}", now.renewals);
    assert!(now.expires_at_us > first.expires_at_us + 500_000);
    let m = HostShmMemory::open_descriptor(&bank.manifest().parts()[1]).unwrap();
    drop(m);
    assert_eq!(shm_entries(&p).len(), 4, "2 segments + 2 leases");
    bank.close(Duration::from_secs(1)).unwrap();
    assert!(
        shm_entries(&p).is_empty(),
        "close removes segments and leases"
    );
}

#[test]
fn lapsed_lease_is_never_renewed_and_ends_the_generation() {
    let _g = serial();
    let p = prefix("m");
    let bank = lease_bank(&p, LeaseConfig::manual(Duration::from_millis(80)));
    let blocks = common::chain(0, 2);
    common::store_ready(&bank, None, &blocks);
    bank.drain_events();
    let s1 = bank.renew_lease().unwrap();
    assert_eq!(s1.renewals, 1);
    assert!(s1.live);
    let pin = bank.pin_prefix(&common::hashes(&blocks)).unwrap();
    std::thread::sleep(Duration::from_millis(120));
    let e = bank.renew_lease().unwrap_err();
    assert!(matches!(e, BankError::LeaseExpired { .. }), "{e}");
    assert!(bank.is_closed(), "a lapsed lease kills the generation");
    assert!(matches!(bank.renew_lease(), Err(BankError::Closed { .. })));
    assert!(matches!(
        bank.pin_prefix(&common::hashes(&blocks)),
        Err(BankError::Closed { .. })
    ));
    let evs = bank.drain_events();
    assert!(matches!(evs.as_slice(), [e] if matches!(e.data, kv_descriptor::KvEventData::Cleared)));
    // Leases are gone at once; the pinned memory stays until the pin drops.
    assert_eq!(shm_entries(&p).len(), 2, "{:?}", shm_entries(&p));
    assert!(!bank.lease_status().live);
    drop(pin);
    assert!(shm_entries(&p).is_empty());
}

#[test]
fn descriptor_import_checks_engine_generation_rank_and_liveness() {
    let _g = serial();
    let p = prefix("d");
    let bank = lease_bank(&p, LeaseConfig::default());
    let d0 = bank.manifest().parts()[0].clone();
    let rec = kv_bank::check_descriptor_lease(&d0, LeaseInstant::now()).unwrap();
    assert_eq!(
        (rec.pid, rec.tp_rank, rec.generation),
        (std::process::id(), 0, 1)
    );
    assert_eq!(rec.engine_id, bank.owner().engine_id);
    assert_eq!(rec.duration_us, 15_000_000);
    HostShmMemory::open_descriptor(&d0).unwrap();

    let forge = |f: &dyn Fn(&mut BankParts)| {
        let mut parts = d0.parts().clone();
        f(&mut parts);
        BankDescriptor::new(parts).unwrap()
    };
    let other_engine = forge(&|p| p.owner.engine_id = EngineId::fresh());
    let other_gen = forge(&|p| p.owner = p.owner.next_generation());
    let other_rank = forge(&|p| p.tp_rank = 1);
    let other_role = forge(&|p| p.owner.role = Role::Prefill);
    for (d, field) in [
        (&other_engine, "engine_id"),
        (&other_gen, "bank_generation"),
        (&other_rank, "tp_rank"),
        (&other_role, "role"),
    ] {
        match HostShmMemory::open_descriptor(d) {
            Err(BankError::LeaseMismatch { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    bank.close(Duration::from_secs(1)).unwrap();
    let e = HostShmMemory::open_descriptor(&d0).unwrap_err();
    assert!(matches!(e, BankError::LeaseMissing { .. }), "{e}");
    let kv_descriptor::ExportHandle::HostShm { name } = d0.export() else {
        unreachable!()
    };
    assert!(
        HostShmMemory::open(name, 64).is_err(),
        "segment unlinked at close"
    );
}

fn dead_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    pid
}

#[test]
fn orphans_of_dead_creators_are_removed_and_live_ones_kept() {
    let _g = serial();
    let p = prefix("o");
    let dead = format!("/dev/shm/{p}-{}-0-deadbeef", dead_pid());
    let live = format!("/dev/shm/{p}-{}-1-deadbeef", std::process::id());
    let unparsable = format!("/dev/shm/{p}-not-a-pid");
    for f in [&dead, &live, &unparsable] {
        std::fs::write(f, b"x").unwrap();
    }
    let keep = ReclaimPolicy {
        orphan_grace: None,
        ..Default::default()
    };
    let r = reclaim_stale_with(&p, ScanTime::now(), &keep).unwrap();
    assert!(r.orphans.is_empty());
    // Within the default 60 s grace nothing goes either.
    assert!(reclaim_stale(&p, ScanTime::now())
        .unwrap()
        .orphans
        .is_empty());
    let now_ok = ReclaimPolicy {
        orphan_grace: Some(Duration::ZERO),
        ..Default::default()
    };
    let r = reclaim_stale_with(&p, ScanTime::now(), &now_ok).unwrap();
    assert_eq!(
        r.orphans,
        vec![dead.trim_start_matches("/dev/shm").to_string()]
    );
    assert_eq!(
        shm_entries(&p).len(),
        2,
        "live creator and unparsable name kept"
    );
    for f in [&live, &unparsable] {
        std::fs::remove_file(f).unwrap();
    }
}

#[test]
fn unreadable_lease_is_removed_with_its_segment_only_after_grace() {
    let _g = serial();
    let p = prefix("i");
    let seg = format!("/dev/shm/{p}-1-0-0000abcd");
    let lease = format!("{seg}.lease");
    std::fs::write(&seg, vec![0u8; 4096]).unwrap();
    std::fs::write(&lease, vec![0u8; 256]).unwrap(); // no magic: creator died mid-write
    let e = read_lease(lease.trim_start_matches("/dev/shm")).unwrap_err();
    assert!(matches!(e, BankError::LeaseInvalid { .. }), "{e}");
    // A raw open of the segment is refused: its lease exists but is not valid.
    let name = seg.trim_start_matches("/dev/shm");
    assert!(matches!(
        HostShmMemory::open(name, 4096),
        Err(BankError::LeaseInvalid { .. })
    ));
    let r = reclaim_stale(&p, ScanTime::now()).unwrap();
    assert!(r.invalid_leases.is_empty() && r.errors.len() == 1, "{r:?}");
    let grace0 = ReclaimPolicy {
        incomplete_grace: Duration::ZERO,
        ..Default::default()
    };
    let r = reclaim_stale_with(&p, ScanTime::now(), &grace0).unwrap();
    assert_eq!(r.invalid_leases.len(), 1);
    assert!(shm_entries(&p).is_empty());
}

#[test]
fn background_reclaimer_takes_a_stalled_bank_and_the_owner_learns_it() {
    let _g = serial();
    let p = prefix("r");
    let bank = lease_bank(&p, LeaseConfig::manual(Duration::from_millis(60)));
    let reclaimer =
        Reclaimer::start(&p, Duration::from_millis(15), ReclaimPolicy::default()).unwrap();
    let t = std::time::Instant::now();
    while reclaimer.totals().reclaimed.len() < 2 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let totals = reclaimer.totals();
    drop(reclaimer);
    assert_eq!(totals.reclaimed.len(), 2, "{totals:?}");
    assert!(totals
        .reclaimed
        .iter()
        .all(|r| r.owner_alive && r.pid == std::process::id()));
    assert!(shm_entries(&p).is_empty(), "segments and leases removed");
    // The reclaimer revoked the lease, so the owner can never renew it.
    let e = bank.renew_lease().unwrap_err();
    assert!(matches!(e, BankError::LeaseLost { .. }), "{e}");
    assert!(bank.is_closed());
    // The owner's own mapping stays valid memory; close frees it cleanly.
    bank.close(Duration::from_secs(1)).unwrap();
}

#[test]
fn bad_lease_settings_are_refused_before_allocating() {
    let l = common::layout(1);
    let mut cfg = BankConfig::new(
        l,
        OwnerLease::fresh(Role::Decode),
        4 * l.block_bytes() as u64,
    );
    cfg.lease = LeaseConfig::background(Duration::from_millis(100), Duration::from_millis(60));
    let e = BankManager::new_host_shm(cfg.clone(), "h").unwrap_err();
    assert!(e.to_string().contains("`lease.interval`"), "{e}");
    cfg.lease = LeaseConfig::manual(Duration::ZERO);
    let e = BankManager::new_host_shm(cfg, "h").unwrap_err();
    assert!(e.to_string().contains("`lease.duration`"), "{e}");
}

#[test]
fn failed_background_renewal_revokes_every_rank_at_once() {
    // Rank 1's lease is unlinked behind the owner's back: the background
    // renewer fails on it and stops. The generation is dead, so rank 0's
    // lease must not stay importable until it lapses on its own (5 s here).
    let _g = serial();
    let p = prefix("w");
    let bank = lease_bank(
        &p,
        LeaseConfig::background(Duration::from_secs(5), Duration::from_millis(20)),
    );
    let names = bank.lease_status().names;
    std::fs::remove_file(format!("/dev/shm{}", names[1])).unwrap();
    let d0 = bank.manifest().parts()[0].clone();
    let t = std::time::Instant::now();
    while HostShmMemory::open_descriptor(&d0).is_ok() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let import = HostShmMemory::open_descriptor(&d0);
    assert!(
        import.is_err(),
        "rank 0 still importable {:?} after the renewal failed",
        t.elapsed()
    );
    assert!(!bank.lease_status().live);
    assert!(bank.pin_prefix(&[]).is_err(), "the owner learns it too");
    assert!(bank.is_closed());
    drop(import);
    bank.close(Duration::from_secs(1)).unwrap();
    assert!(shm_entries(&p).is_empty(), "{:?}", shm_entries(&p));
}

/// Child for `failed_owner_killed_run_still_reclaims_the_child_bank`: owns a
/// real TP2 host bank under the prefix it is given (written to the marker
/// file named just before the subcommand), then says a hello the parent
/// cannot decode, so the parent's run fails after the bank exists.
#[test]
fn undecodable_hello_child_role() {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == faults::CHILD_SUBCOMMAND) else {
        return; // not started as the child
    };
    let (marker, prefix) = (&args[at - 1], &args[at + 1]);
    let _bank = lease_bank(
        prefix,
        LeaseConfig::background(Duration::from_millis(600), Duration::from_millis(100)),
    );
    std::fs::write(marker, prefix).unwrap();
    println!(
        r#"{{"pid":{},"manifest_hex":"not hex","entries":[]}}"#,
        std::process::id()
    );
    std::thread::sleep(Duration::from_secs(60));
    std::process::exit(0);
}

#[test]
fn failed_owner_killed_run_still_reclaims_the_child_bank() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("prefix");
    let exe = std::env::current_exe().unwrap();
    let args: Vec<String> = vec![
        "--exact".into(),
        "undecodable_hello_child_role".into(),
        "--nocapture".into(),
        marker.display().to_string(),
    ];
    let lease = Duration::from_millis(600);
    let r = faults::owner_killed(&exe, &args, lease);
    assert!(r.is_err(), "the hello cannot be decoded: {r:?}");
    let p = std::fs::read_to_string(&marker).unwrap();
    let left = shm_entries(&p);
    // Never leave junk behind, even when the assertion below fails.
    let _ = reclaim_stale(&p, ScanTime::now().later(lease * 10));
    assert!(
        left.is_empty(),
        "the killed child's bank was left: {left:?}"
    );
}
