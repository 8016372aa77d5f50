//! Rules of [`super::WorkerRegistry`] and the announcement's bounds.

use kv_descriptor::*;
use proptest::prelude::*;
use uuid::Uuid;

use super::*;
use crate::{EventPlane, InProcessPlane};

fn gpu(ordinal: u32) -> GpuIdentity {
    GpuIdentity {
        uuid: Uuid::from_u128(0x6000 + ordinal as u128),
        ordinal,
        host_id: "host-a".into(),
        fabric: None,
    }
}

fn ann(key: &str, engine: EngineId) -> WorkerAnnouncement {
    WorkerAnnouncement {
        worker_key: key.into(),
        engine_id: engine,
        role: Role::Decode,
        layout_fingerprint: LayoutFingerprint(0xF1F1),
        tp_size: 2,
        gpus: vec![gpu(0), gpu(1)],
        pin_endpoint: "unix:/tmp/kv-pin.sock".into(),
        event_subject: "kv.qa.decode.events".into(),
    }
}

#[test]
fn new_incarnation_replaces_the_old_and_retires_it() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (e1, e2) = (EngineId::fresh(), EngineId::fresh());
    assert_eq!(reg.announce(ann("decode-0", e1), 0), Registration::New);
    assert_eq!(
        reg.announce(ann("decode-0", e1), 1_000),
        Registration::Refreshed
    );
    assert_eq!(
        reg.announce(ann("decode-0", e2), 1_500),
        Registration::Replaced { dropped: e1 }
    );
    assert!(reg.is_retired(e1));
    assert!(!reg.is_retired(e2));
    assert_eq!(reg.get("decode-0").unwrap().engine_id, e2);
    // A late announcement of the old incarnation is ignored and does not
    // bring it back.
    assert_eq!(
        reg.announce(ann("decode-0", e1), 1_600),
        Registration::Retired
    );
    assert_eq!(reg.get("decode-0").unwrap().engine_id, e2);
    assert_eq!(reg.len(), 1);
}

/// Trial h42, 1: one engine id serves one worker key. Announced under a
/// second key it is ignored (before, it was registered under both, and the
/// first key's silence dropped the live engine); once its first key was
/// dropped for silence, it comes back under the new key if that is free.
#[test]
fn an_engine_announcing_a_second_key_is_ignored_until_its_first_key_is_dropped() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let e = EngineId::fresh();
    assert_eq!(reg.announce(ann("k1", e), 0), Registration::New);
    let other = Registration::OtherKey {
        registered_under: "k1".into(),
    };
    assert_eq!(reg.announce(ann("k2", e), 500), other);
    assert_eq!((reg.len(), reg.get("k2")), (1, None));
    // Announcing only under k2 keeps k1 silent: dropped after 3 periods.
    assert_eq!(reg.announce(ann("k2", e), 2_500), other);
    assert_eq!(reg.tick(3_001), vec![("k1".to_string(), e)]);
    assert_eq!(reg.announce(ann("k2", e), 3_500), Registration::Readmitted);
    assert_eq!(reg.get("k2").unwrap().engine_id, e);
    assert_eq!((reg.len(), reg.get("k1")), (1, None));
    assert!(!reg.is_retired(e));
}

/// Trial h42, 1: an incarnation removed for silence announcing under a key
/// another live worker holds panicked the announcement follower (a debug
/// assertion) and, in a release build, overwrote that worker's entry. It
/// is ignored; the live worker keeps its key.
#[test]
fn a_silenced_engine_does_not_take_a_live_workers_key() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (e, f) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("k1", e), 0);
    reg.announce(ann("k2", f), 0);
    reg.announce(ann("k2", f), 3_000);
    assert_eq!(reg.tick(3_500), vec![("k1".to_string(), e)]);
    assert_eq!(
        reg.announce(ann("k2", e), 3_600),
        Registration::OtherKey {
            registered_under: "k1".into()
        }
    );
    assert_eq!(reg.get("k2").unwrap().engine_id, f);
    assert_eq!(reg.len(), 1);
    // Still remembered as silenced under k1: taken back there.
    assert!(reg.is_retired(e) && !reg.is_replaced(e));
    assert_eq!(reg.announce(ann("k1", e), 3_700), Registration::Readmitted);
    assert_eq!(reg.len(), 2);
}

/// Trial h44, 6: an incarnation back from silence under another key
/// whose own incarnation was also dropped for silence took that key and
/// retired it; that one, back under its own key, was refused for as long
/// as the mover ran. Such a key is not free: the mover is ignored, and
/// both are taken back under their own keys.
#[test]
fn a_silenced_engine_does_not_take_the_key_of_another_silenced_incarnation() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (x, y) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("k6", x), 0);
    reg.announce(ann("k7", y), 0);
    let mut dropped = reg.tick(3_001);
    dropped.sort();
    let mut expected = vec![("k6".to_string(), x), ("k7".to_string(), y)];
    expected.sort();
    assert_eq!(dropped, expected);
    assert_eq!(reg.silenced_under("k7"), Some(y));
    assert_eq!(
        reg.announce(ann("k7", x), 3_500),
        Registration::OtherKey {
            registered_under: "k6".into()
        }
    );
    assert_eq!((reg.len(), reg.get("k7")), (0, None));
    assert!(!reg.is_replaced(y), "y is not retired by the mover");
    assert_eq!(reg.announce(ann("k7", y), 3_600), Registration::Readmitted);
    assert_eq!(reg.get("k7").unwrap().engine_id, y);
    assert_eq!(reg.silenced_under("k7"), None);
    // x stays remembered as silenced, no longer keeping k6 (it announced
    // another key), and is taken back there when it announces k6 again.
    assert_eq!(reg.silenced_under("k6"), None);
    assert_eq!(reg.announce(ann("k6", x), 3_700), Registration::Readmitted);
    assert_eq!(reg.len(), 2);
    // A key free of live and silenced incarnations is taken by a mover.
    reg.announce(ann("k7", y), 6_000);
    assert_eq!(reg.tick(6_701), vec![("k6".to_string(), x)]);
    assert_eq!(reg.announce(ann("k8", x), 6_800), Registration::Readmitted);
    assert_eq!(reg.get("k8").unwrap().engine_id, x);
    assert_eq!(reg.silenced_under("k6"), None);
}

/// Trial h47, 4: two incarnations dropped for silence that swapped worker
/// keys (each announcing the other's) were refused for as long as both
/// ran: each kept its own key from the other, and each refusal renewed its
/// memory. One heard under another key no longer keeps its own, so both
/// are taken back under their new keys.
#[test]
fn two_silenced_incarnations_that_swapped_keys_are_both_taken_back() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (x, y) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("kx", x), 0);
    reg.announce(ann("ky", y), 0);
    assert_eq!(reg.tick(3_001).len(), 2);
    // x first: ky is still kept for y, which may come back under it.
    assert_eq!(
        reg.announce(ann("ky", x), 3_100),
        Registration::OtherKey {
            registered_under: "kx".into()
        }
    );
    // y, announcing kx: x moved away from kx, so kx is free for y, and x is
    // not retired by it.
    assert_eq!(reg.announce(ann("kx", y), 3_200), Registration::Readmitted);
    assert!(!reg.is_replaced(x));
    // x again, under ky: y left it, so x is taken back there.
    assert_eq!(reg.announce(ann("ky", x), 3_300), Registration::Readmitted);
    assert_eq!(
        (
            reg.get("kx").map(|a| a.engine_id),
            reg.get("ky").map(|a| a.engine_id)
        ),
        (Some(y), Some(x))
    );
    assert_eq!(reg.len(), 2);
}

/// Trial h44, 6: an engine re-announcing another role, layout or TP was
/// taken as a refresh (the index refused it, and it stayed an advise
/// target with the registered facts). It is ignored, not heard: silent
/// under its registered facts it is dropped, then taken back with the new.
#[test]
fn an_engine_changing_role_layout_or_tp_is_ignored_until_dropped_for_silence() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let e = EngineId::fresh();
    assert_eq!(reg.announce(ann("k1", e), 0), Registration::New);
    let changed = |f: &dyn Fn(&mut WorkerAnnouncement)| {
        let mut a = ann("k1", e);
        f(&mut a);
        a
    };
    let role = changed(&|a| a.role = Role::Prefill);
    let layout = changed(&|a| a.layout_fingerprint = LayoutFingerprint(0xF2F2));
    let tp = changed(&|a| {
        a.tp_size = 1;
        a.gpus.truncate(1);
    });
    for (a, field, registered, announced) in [
        (&role, IdentityField::Role, "Decode", "Prefill"),
        (
            &layout,
            IdentityField::LayoutFingerprint,
            "0xf1f1",
            "0xf2f2",
        ),
        (&tp, IdentityField::TpSize, "2", "1"),
    ] {
        assert_eq!(
            reg.announce(a.clone(), 1_000),
            Registration::IdentityChanged { field }
        );
        assert_eq!(field.value_in(reg.get("k1").unwrap()), registered);
        assert_eq!(field.value_in(a), announced);
    }
    assert_eq!(
        IdentityField::LayoutFingerprint.to_string(),
        "layout_fingerprint"
    );
    // Role first when several differ.
    let both = changed(&|a| {
        a.role = Role::Prefill;
        a.tp_size = 1;
        a.gpus.truncate(1);
    });
    assert_eq!(
        reg.announce(both, 2_000),
        Registration::IdentityChanged {
            field: IdentityField::Role
        }
    );
    assert_eq!(reg.get("k1").unwrap().role, Role::Decode);
    // None of them renewed it: silent since 0.
    assert_eq!(reg.tick(3_001), vec![("k1".to_string(), e)]);
    assert_eq!(reg.announce(role.clone(), 3_500), Registration::Readmitted);
    assert_eq!(reg.get("k1").unwrap().role, Role::Prefill);
    assert_eq!(reg.announce(role, 4_000), Registration::Refreshed);
}

/// Trial h42, 1: a replaced incarnation took any free key as its own
/// (`Readmitted` under a key it never had). It gets only its own key back.
#[test]
fn a_replaced_incarnation_does_not_take_another_free_key() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (a, b) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("k3", a), 0);
    assert_eq!(
        reg.announce(ann("k3", b), 100),
        Registration::Replaced { dropped: a }
    );
    assert_eq!(
        reg.announce(ann("k4", a), 200),
        Registration::OtherKey {
            registered_under: "k3".into()
        }
    );
    assert_eq!((reg.len(), reg.get("k4")), (1, None));
    assert!(reg.is_replaced(a));
    // A live engine under a second key, held by another: ignored too.
    let c = EngineId::fresh();
    reg.announce(ann("k5", c), 300);
    assert_eq!(
        reg.announce(ann("k3", c), 400),
        Registration::OtherKey {
            registered_under: "k5".into()
        }
    );
    assert_eq!(reg.get("k3").unwrap().engine_id, b);
}

/// Trial h39, 1: a replaced incarnation still announcing gets its key back
/// once what replaced it is dropped for silence, instead of staying refused
/// with nobody serving the key. Before, `e1` (replaced by the stale `e2`,
/// which then died) was refused for as long as it announced.
#[test]
fn a_replaced_incarnation_takes_its_key_back_once_its_replacement_is_silent() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (e1, e2) = (EngineId::fresh(), EngineId::fresh());
    assert_eq!(reg.announce(ann("decode-0", e1), 0), Registration::New);
    assert_eq!(
        reg.announce(ann("decode-0", e2), 500),
        Registration::Replaced { dropped: e1 }
    );
    // Both announce: the key stays with e2, e1 is refused.
    assert_eq!(
        reg.announce(ann("decode-0", e1), 1_000),
        Registration::Retired
    );
    assert_eq!(
        reg.announce(ann("decode-0", e2), 1_000),
        Registration::Refreshed
    );
    // e2 stops; e1 goes on announcing, refused until e2 is dropped.
    assert_eq!(
        reg.announce(ann("decode-0", e1), 3_000),
        Registration::Retired
    );
    let dropped = reg.tick(4_500);
    assert_eq!(dropped, vec![("decode-0".to_string(), e2)]);
    assert_eq!(
        reg.announce(ann("decode-0", e1), 5_000),
        Registration::Readmitted
    );
    assert_eq!(reg.get("decode-0").unwrap().engine_id, e1);
    assert!(!reg.is_retired(e1));
    // e2 is the replaced one now: its late announcement is refused.
    assert!(reg.is_retired(e2));
    assert_eq!(
        reg.announce(ann("decode-0", e2), 5_100),
        Registration::Retired
    );
    assert_eq!(reg.get("decode-0").unwrap().engine_id, e1);
    assert_eq!(reg.len(), 1);
}

#[test]
fn a_worker_silent_for_the_allowed_periods_is_removed() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (a, b) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("decode-0", a), 0);
    reg.announce(ann("decode-1", b), 0);
    reg.announce(ann("decode-1", b), 2_500);
    // Exactly 3 periods of silence is still allowed.
    assert!(reg.tick(3_000).is_empty());
    assert_eq!(reg.tick(3_001), vec![("decode-0".to_string(), a)]);
    assert!(reg.is_retired(a));
    assert_eq!(reg.len(), 1);
    assert_eq!(reg.tick(5_501), vec![("decode-1".to_string(), b)]);
    assert!(reg.is_empty());
}

#[test]
fn a_worker_dropped_for_silence_is_taken_back_when_it_announces_again() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let a = EngineId::fresh();
    reg.announce(ann("decode-0", a), 0);
    assert_eq!(reg.tick(3_001), vec![("decode-0".to_string(), a)]);
    // Away: its events are ignored, but it is not replaced.
    assert!(reg.is_retired(a));
    assert!(!reg.is_replaced(a));
    assert_eq!(
        reg.announce(ann("decode-0", a), 9_000),
        Registration::Readmitted
    );
    assert!(!reg.is_retired(a));
    assert_eq!(reg.get("decode-0").unwrap().engine_id, a);
    assert_eq!(
        reg.announce(ann("decode-0", a), 9_500),
        Registration::Refreshed
    );
    // Its silence is counted from its last announcement again.
    assert!(reg.tick(12_500).is_empty());
    assert_eq!(reg.tick(12_501), vec![("decode-0".to_string(), a)]);
}

#[test]
fn a_silent_worker_whose_key_a_new_incarnation_took_stays_refused() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let (old, new) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("decode-0", old), 0);
    assert_eq!(reg.tick(3_001).len(), 1);
    assert_eq!(reg.announce(ann("decode-0", new), 4_000), Registration::New);
    assert!(reg.is_replaced(old));
    assert_eq!(
        reg.announce(ann("decode-0", old), 4_100),
        Registration::Retired
    );
    assert_eq!(reg.get("decode-0").unwrap().engine_id, new);
    assert_eq!(reg.len(), 1);
}

#[test]
fn nobody_is_dropped_while_paused_and_silence_restarts_from_the_resume() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let a = EngineId::fresh();
    reg.announce(ann("decode-0", a), 0);
    reg.pause();
    assert!(reg.is_paused());
    // Far past the 3 s allowed: the router was away, not the worker.
    assert!(reg.tick(60_000).is_empty());
    reg.resume(60_000);
    assert!(!reg.is_paused());
    assert!(reg.tick(63_000).is_empty());
    assert_eq!(reg.tick(63_001), vec![("decode-0".to_string(), a)]);
}

/// A router's registry stays bounded however many workers restart: one
/// worker key through `MAX_REMEMBERED` + 11 incarnations, and
/// `MAX_REMEMBERED` + 5 workers dropped for silence at once, leave
/// `MAX_REMEMBERED` of each remembered, the oldest forgotten and handed
/// out once for the caller's index (each set grew by one entry per restart
/// for the router's life before).
#[test]
fn many_incarnations_leave_at_most_the_cap_remembered() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let engines: Vec<EngineId> = (0..MAX_REMEMBERED + 11)
        .map(|_| EngineId::fresh())
        .collect();
    for (t, &e) in engines.iter().enumerate() {
        reg.announce(ann("decode-0", e), t as u64);
    }
    assert_eq!(reg.remembered(), (MAX_REMEMBERED, 0));
    assert_eq!(reg.forgotten(), 10);
    assert_eq!(reg.take_forgotten(), engines[..10]);
    assert!(reg.take_forgotten().is_empty());
    let last = engines.len() - 1;
    // The newest replaced ones are still refused, the oldest are not known.
    assert!(reg.is_replaced(engines[last - 1]));
    assert!(reg.is_replaced(engines[10]));
    assert!(!reg.is_retired(engines[9]));
    assert_eq!(
        reg.announce(ann("decode-0", engines[last - 1]), 20_000),
        Registration::Retired
    );
    assert_eq!(reg.get("decode-0").unwrap().engine_id, engines[last]);

    let mut reg = WorkerRegistry::new(1_000, 3);
    for i in 0..MAX_REMEMBERED + 5 {
        reg.announce(ann(&format!("decode-{i}"), EngineId::fresh()), 0);
    }
    let dropped = reg.tick(3_001);
    assert_eq!(dropped.len(), MAX_REMEMBERED + 5);
    assert_eq!(reg.remembered(), (0, MAX_REMEMBERED));
    assert_eq!(reg.forgotten(), 5);
    // The 5 dropped first (the tick's order) were forgotten at once.
    let first: Vec<EngineId> = dropped[..5].iter().map(|&(_, e)| e).collect();
    assert_eq!(reg.take_forgotten(), first);
    assert!(dropped[5..].iter().all(|&(_, e)| reg.is_retired(e)));
}

/// The forgotten ids wait for [`WorkerRegistry::take_forgotten`], but no
/// more than both kinds of memory can forget at once (2 x
/// `MAX_REMEMBERED`): a caller that never takes them keeps a bounded list,
/// the ids forgotten longest ago dropped first.
#[test]
fn forgotten_ids_not_taken_are_kept_bounded() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let n = 3 * MAX_REMEMBERED + 11;
    let engines: Vec<EngineId> = (0..n).map(|_| EngineId::fresh()).collect();
    for (t, &e) in engines.iter().enumerate() {
        reg.announce(ann("decode-0", e), t as u64);
    }
    // n - 1 replaced, MAX_REMEMBERED of them remembered.
    assert_eq!(reg.forgotten(), 2 * MAX_REMEMBERED as u64 + 10);
    assert_eq!(reg.take_forgotten(), engines[10..2 * MAX_REMEMBERED + 10]);
}

#[test]
fn the_retention_is_a_multiple_of_the_silence_window_with_a_floor() {
    // 100 windows of 3 x 1 s; 100 x 10 ms would be 1 s, raised to 5 min.
    assert_eq!(WorkerRegistry::new(1_000, 3).retention_ms(), 300_000);
    assert_eq!(
        WorkerRegistry::new(10, 1).retention_ms(),
        FORGET_AFTER_MIN_MS
    );
    assert_eq!(WorkerRegistry::new(2_000, 5).retention_ms(), 1_000_000);
    assert_eq!(
        WorkerRegistry::new(60_000, 1_000).retention_ms(),
        60_000 * 1_000 * FORGET_AFTER_SILENCE_WINDOWS
    );
}

/// A replaced incarnation's stray announcement within the retention is
/// ignored and keeps it remembered (a second process under the key stays
/// refused while it runs); once nothing of it was heard for the retention
/// it is forgotten (handed out for the caller's index), and an
/// announcement of it after that is a new incarnation's: it replaces the
/// live one.
#[test]
fn a_replaced_incarnation_is_refused_for_the_retention_after_it_was_last_heard() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let r = reg.retention_ms();
    let (old, new) = (EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("decode-0", old), 0);
    reg.announce(ann("decode-0", new), 1_000);
    assert_eq!(
        reg.announce(ann("decode-0", old), 1_000 + r),
        Registration::Retired
    );
    // Heard at 1_000 + r: remembered until 1_000 + 2r.
    reg.announce(ann("decode-0", new), 1_000 + 2 * r);
    assert!(reg.tick(1_000 + 2 * r).is_empty());
    assert!(reg.is_replaced(old));
    assert_eq!(reg.forgotten(), 0);
    reg.announce(ann("decode-0", new), 1_001 + 2 * r);
    assert!(reg.tick(1_001 + 2 * r).is_empty());
    assert!(!reg.is_retired(old));
    assert_eq!((reg.forgotten(), reg.remembered()), (1, (0, 0)));
    assert_eq!(reg.take_forgotten(), [old]);
    assert_eq!(
        reg.announce(ann("decode-0", old), 1_002 + 2 * r),
        Registration::Replaced { dropped: new }
    );
    assert!(reg.is_replaced(new));
}

/// A worker dropped for silence is taken back within the retention; once
/// forgotten (handed out for the caller's index) it registers as new (its
/// key is free).
#[test]
fn a_silenced_worker_forgotten_after_the_retention_registers_as_new() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let r = reg.retention_ms();
    let a = EngineId::fresh();
    reg.announce(ann("decode-0", a), 0);
    assert_eq!(reg.tick(3_001).len(), 1);
    assert!(reg.tick(3_001 + r).is_empty());
    assert!(reg.is_retired(a));
    assert!(reg.take_forgotten().is_empty());
    assert!(reg.tick(3_002 + r).is_empty());
    assert!(!reg.is_retired(a));
    assert_eq!((reg.forgotten(), reg.remembered()), (1, (0, 0)));
    assert_eq!(reg.take_forgotten(), [a]);
    assert_eq!(
        reg.announce(ann("decode-0", a), 3_003 + r),
        Registration::New
    );
}

/// While the router's own connection is down it hears nothing, so nothing
/// is forgotten, and every remembered incarnation gets a fresh retention at
/// the resume (as every worker gets a fresh silence deadline).
#[test]
fn nothing_is_forgotten_while_paused_and_the_retention_restarts_at_the_resume() {
    let mut reg = WorkerRegistry::new(1_000, 3);
    let r = reg.retention_ms();
    let (old, new, silent) = (EngineId::fresh(), EngineId::fresh(), EngineId::fresh());
    reg.announce(ann("decode-0", old), 0);
    reg.announce(ann("decode-0", new), 0);
    reg.announce(ann("decode-1", silent), 0);
    reg.announce(ann("decode-0", new), 3_000);
    assert_eq!(reg.tick(3_001), vec![("decode-1".to_string(), silent)]);
    reg.pause();
    assert!(reg.tick(10 * r).is_empty());
    assert_eq!(
        reg.announce(ann("decode-0", new), 10 * r),
        Registration::Refreshed
    );
    assert_eq!((reg.forgotten(), reg.remembered()), (0, (1, 1)));
    assert!(reg.take_forgotten().is_empty());
    reg.resume(10 * r);
    reg.announce(ann("decode-0", new), 11 * r);
    assert!(reg.tick(11 * r).is_empty());
    assert!(reg.is_replaced(old) && reg.is_retired(silent));
    reg.announce(ann("decode-0", new), 11 * r + 1);
    assert!(reg.tick(11 * r + 1).is_empty());
    assert_eq!((reg.forgotten(), reg.remembered()), (2, (0, 0)));
    // Both expire at the same tick: the replaced kind first.
    assert_eq!(reg.take_forgotten(), [old, silent]);
}

#[test]
fn bad_announcements_are_refused_naming_the_field() {
    let e = EngineId::fresh();
    let cases: Vec<(WorkerAnnouncement, &str)> = vec![
        (
            WorkerAnnouncement {
                worker_key: String::new(),
                ..ann("k", e)
            },
            "worker_key",
        ),
        (
            WorkerAnnouncement {
                pin_endpoint: "p".repeat(300),
                ..ann("k", e)
            },
            "pin_endpoint",
        ),
        (
            WorkerAnnouncement {
                event_subject: String::new(),
                ..ann("k", e)
            },
            "event_subject",
        ),
        (
            WorkerAnnouncement {
                tp_size: 0,
                gpus: vec![],
                ..ann("k", e)
            },
            "tp_size",
        ),
        (
            WorkerAnnouncement {
                tp_size: 4,
                ..ann("k", e)
            },
            "gpus",
        ),
    ];
    // An event subject the router could never follow: a wildcard (it would
    // subscribe to every subject), another shape than
    // `kv.<ns>.<component>.<topic>`, a token with whitespace.
    let subjects = [
        ">",
        "kv.qa.*.events",
        "kv_reuse.advise",
        "kv.qa.decode",
        "kv.qa.de code.e",
    ];
    let cases = cases.into_iter().chain(subjects.into_iter().map(|s| {
        (
            WorkerAnnouncement {
                event_subject: s.into(),
                ..ann("k", e)
            },
            "event_subject",
        )
    }));
    for (a, want) in cases {
        match a.validate() {
            Err(AnnouncementError::InvalidField { field, .. }) => assert_eq!(field, want),
            other => panic!("{want}: {other:?}"),
        }
        // The same refusal on the wire: encode without validation, decode refuses.
        let bytes = rmp_serde::to_vec_named(&a).unwrap();
        let err = WorkerAnnouncement::decode(&bytes).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("worker_announcement.{want}")),
            "{err}"
        );
    }
    let big = vec![0u8; MAX_ANNOUNCEMENT_BYTES + 1];
    assert!(matches!(
        WorkerAnnouncement::decode(&big),
        Err(AnnouncementError::TooLarge { .. })
    ));
}

/// An undecodable announcement names its type once: the log line of a
/// refused announcement read "cannot decode `worker_announcement`: cannot
/// decode `worker_announcement`: ..." (seen on a router fed garbage).
#[test]
fn undecodable_announcements_name_the_type_once() {
    for bytes in [
        &b"\xff\xfe garbage"[..],
        b"",
        &rmp_serde::to_vec_named(&1u8).unwrap(),
    ] {
        let text = WorkerAnnouncement::decode(bytes).unwrap_err().to_string();
        assert_eq!(
            text.matches("worker_announcement").count(),
            1,
            "{bytes:?}: {text}"
        );
        assert!(
            text.starts_with("cannot decode `worker_announcement`: "),
            "{text}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// The decoder never panics on arbitrary bytes.
    #[test]
    fn announcement_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        let _ = WorkerAnnouncement::decode(&bytes);
    }
}

#[tokio::test]
async fn announcements_travel_over_the_event_plane() {
    let plane = InProcessPlane::new();
    let subject = announce_subject("qa").unwrap();
    assert_eq!(subject.as_str(), "kv.qa.workers.announce");
    let mut sub = plane.subscribe(&subject).await.unwrap();
    let a = ann("decode-0", EngineId::fresh());
    plane.publish(&subject, a.to_wire().unwrap()).await.unwrap();
    let m = sub
        .next_timeout(std::time::Duration::from_secs(5))
        .await
        .unwrap();
    let got = WorkerAnnouncement::decode(&m.payload).unwrap();
    assert_eq!(got, a);
    let mut reg = WorkerRegistry::new(1_000, 3);
    assert_eq!(reg.announce(got, 0), Registration::New);
}
