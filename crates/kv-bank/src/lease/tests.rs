//! Unit tests of the lease file and its renew / reclaim rules.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// Advance the clock by this many µs.
    Wait(u64),
    Renew,
    Reclaim,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..3_000).prop_map(Op::Wait),
        Just(Op::Renew),
        Just(Op::Reclaim),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Renewals and reclaim swaps, at any interleaving on a virtual clock,
    /// agree with the model: a lease is renewed only while live, revoked
    /// only once lapsed, and once revoked it stays dead.
    #[test]
    fn renew_and_reclaim_follow_the_lease_model(ops in proptest::collection::vec(op(), 1..40)) {
        let owner = OwnerLease::fresh(Role::Decode);
        let name = format!("/kvbank-unit-{}-0-{:08x}.lease", std::process::id(), uuid::Uuid::new_v4().as_u128() as u32);
        let t0 = LeaseInstant::now();
        let dur = 1_000u64;
        let holder = LeaseHolder::create(&name, &owner, 0, Duration::from_micros(dur), t0).unwrap();
        let reader = LeaseMap::open(&name).unwrap();
        let mut now = t0.as_micros();
        let mut model_expiry = now + dur; // 0 = revoked
        for op in ops {
            match op {
                Op::Wait(us) => now += us,
                Op::Renew => {
                    let r = holder.renew(LeaseInstant::from_micros(now));
                    let live = model_expiry != 0 && now < model_expiry;
                    prop_assert_eq!(r.is_ok(), live, "renew at {} with expiry {}", now, model_expiry);
                    if live { model_expiry = now + dur; }
                }
                Op::Reclaim => {
                    let revoked = reader.revoke_if_lapsed(LeaseInstant::from_micros(now));
                    let lapsed = model_expiry == 0 || now >= model_expiry;
                    prop_assert_eq!(revoked, lapsed);
                    if lapsed { model_expiry = 0; }
                }
            }
            let rec = reader.record().unwrap();
            prop_assert_eq!(rec.expires_at_us, model_expiry);
            prop_assert_eq!(rec.is_live(LeaseInstant::from_micros(now)), model_expiry != 0 && now < model_expiry);
        }
        drop(holder);
        let gone = matches!(read_lease(&name), Err(BankError::LeaseMissing { .. }));
        prop_assert!(gone, "the owner's drop removes the lease");
    }
}

#[test]
fn record_round_trips_and_corruption_is_detected() {
    let owner = OwnerLease::fresh(Role::Prefill);
    let name = format!(
        "/kvbank-unit-{}-1-{:08x}.lease",
        std::process::id(),
        uuid::Uuid::new_v4().as_u128() as u32
    );
    let t0 = LeaseInstant::now();
    let h = LeaseHolder::create(&name, &owner, 3, Duration::from_secs(2), t0).unwrap();
    let r = read_lease(&name).unwrap();
    assert_eq!(
        (r.engine_id, r.generation, r.role, r.tp_rank),
        (owner.engine_id, 1, Role::Prefill, 3)
    );
    assert_eq!(r.pid, std::process::id());
    assert_eq!(r.expires_at_us, t0.as_micros() + 2_000_000);
    assert_eq!(r.created_at_us, t0.as_micros());
    assert_eq!(r.duration_us, 2_000_000);
    // A second owner can never take the same name.
    assert!(LeaseHolder::create(&name, &owner, 3, Duration::from_secs(2), t0).is_err());
    // Flip one immutable byte (the generation): the checksum refuses it.
    let path = shm_path(&name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[48] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let e = read_lease(&name).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    drop(h);
    assert!(!std::path::Path::new(&path).exists());
}

#[test]
fn a_format_1_lease_is_refused_not_judged_on_the_wrong_clock() {
    // Format 1 held wall-clock Unix µs: compared with the boot clock, its
    // expiry would look decades away and a dead owner's bank would never lapse.
    let owner = OwnerLease::fresh(Role::Decode);
    let name = format!(
        "/kvbank-unit-{}-2-{:08x}.lease",
        std::process::id(),
        uuid::Uuid::new_v4().as_u128() as u32
    );
    let h = LeaseHolder::create(
        &name,
        &owner,
        0,
        Duration::from_secs(2),
        LeaseInstant::now(),
    )
    .unwrap();
    let path = shm_path(&name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(b"KVLEASE1");
    std::fs::write(&path, &bytes).unwrap();
    let e = read_lease(&name).unwrap_err();
    assert!(
        matches!(&e, BankError::LeaseInvalid { reason, .. } if reason.contains("magic")),
        "{e}"
    );
    drop(h);
}
