//! Worker agents in one process over the in-process planes: a donor agent
//! stores blocks, a router (kv-lookup index + advisor over a
//! `RemoteDonorDirectory` fed only by the planes) advises, a target agent
//! fetches exact bytes; after the donor closes its record is gone and the
//! next advise and fetch fall back; a new incarnation under the same worker
//! key replaces the old one.
//!
//! Tests share one lock: host shm names, leases and the leak counters
//! (open fds included) are process-wide.

mod agents_common;

use std::sync::Arc;
use std::time::Duration;

use agents_common::*;
use kv_bank::{BankMemory, DestinationPool};
use kv_descriptor::*;
use kv_router_glue::*;
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend};

#[test]
fn donor_stores_router_advises_target_fetches_then_close_falls_back() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let (tgt, rows) = target(dir.clone()).await;
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let before = kv_bank::leaks::snapshot();

        let donor = p.donor("decode-0", &ep).await;
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&donor, &blocks).await;
        router.pump().await;
        assert_eq!(router.registry.len(), 1, "the donor announced itself");
        let donor_id = donor.bank().owner().engine_id;

        let advice = router.advisor.advise("r1", &h, target_id);
        assert!(advice.decision.admitted(), "{}", advice.decision);
        let env = advice.hint.expect("hint attached");
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        assert_eq!(hint.donor_engine_id, donor_id);
        assert_eq!(hint.donor_control_endpoint, ep, "the record's pin endpoint");
        assert_eq!(hint.sequence_hashes, h);

        let out = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap();
        assert_eq!(out.fetched, h[hint.fetch_from as usize..].to_vec());
        assert_eq!(out.fetched.len(), BLOCKS, "nothing was on the target");
        assert_eq!(
            out.report.counters.bytes,
            (BLOCKS * TP as usize * rbb()) as u64
        );
        assert_rows_hold(&rows, &out);
        drop(out);

        // A hint for another prompt is refused before the donor is touched.
        let other = hashes(&prompt(7));
        let e = tgt
            .fetch(&env, &other, &DeliveryControl::new())
            .unwrap_err();
        assert!(
            matches!(e, AgentError::Fetch(FetchError::PromptMismatch { .. })),
            "{e:?}"
        );

        let report = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(report.pin_stats.granted, 1, "one fetch, one pin");
        assert_eq!(report.pin_stats.released, 1);
        assert_eq!(report.events_published, 1, "the bank's Cleared");
        router.pump().await;
        let again = router.advisor.advise("r2", &h, target_id);
        assert!(again.hint.is_none(), "closed donor: {}", again.decision);
        let e = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Resolve(ResolveError::UnknownDonor { donor }) if donor == donor_id
            ),
            "{e:?}"
        );
        assert_eq!(tgt.executor().pool().free_blocks(), ROWS as usize);
        let leaks = kv_bank::leaks::snapshot().leaks_since(&before);
        assert!(leaks.is_empty(), "leaked: {leaks:?}");
    });
}

#[test]
fn a_new_incarnation_under_the_same_worker_key_replaces_the_old_one() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep_a = p.endpoint("a");
        let ep_b = p.endpoint("b");
        let (tgt, rows) = target(dir.clone()).await;
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;

        let old = p.donor("decode-0", &ep_a).await;
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&old, &blocks).await;
        router.pump().await;
        let old_id = old.bank().owner().engine_id;
        assert!(!router.index.holds(old_id, h[0]).is_empty());

        // The worker restarts under the same key (the old incarnation is not
        // closed: a crash, whose record is still in the directory).
        let new = p.donor("decode-0", &ep_b).await;
        let new_id = new.bank().owner().engine_id;
        store(&new, &blocks).await;
        router.pump().await;
        assert!(router.registry.is_retired(old_id));
        assert!(
            router.index.holds(old_id, h[0]).is_empty(),
            "old inventory dropped"
        );

        let env = router
            .advisor
            .advise("r1", &h, target_id)
            .hint
            .expect("hint");
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        assert_eq!(hint.donor_engine_id, new_id, "the new incarnation donates");
        assert_eq!(hint.donor_control_endpoint, ep_b);
        let out = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap();
        assert_rows_hold(&rows, &out);
        drop(out);

        // The old incarnation's late events and renewals change nothing.
        let late = prompt(100);
        store(&old, &late).await;
        old.tick().await.unwrap();
        router.pump().await;
        assert_eq!(router.late_events_ignored, 1);
        assert!(router.index.holds(old_id, late[0].sequence_hash).is_empty());
        let e = router
            .remote
            .resolve(old_id, &h[..1])
            .expect_err("the old incarnation is forgotten");
        assert!(matches!(e, ResolveError::UnknownDonor { .. }), "{e:?}");

        old.close(Duration::from_secs(1)).await.unwrap();
        new.close(Duration::from_secs(1)).await.unwrap();
    });
}

#[test]
fn the_record_is_re_put_before_it_lapses_and_a_lapsed_one_is_refused() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = Duration::from_millis(300);
        let donor = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap();
        let mut watch = dir.watch().await.unwrap();
        let Some(DirectoryChange::Put(first)) = watch.try_next() else {
            panic!("the open put the record")
        };
        assert_eq!(
            first.lease_expires_unix_ms() - first.published_unix_ms(),
            300
        );
        // Before a third of the TTL: no re-put.
        donor.tick().await.unwrap();
        assert!(watch.try_next().is_none(), "renewed too early");
        tokio::time::sleep(Duration::from_millis(120)).await;
        donor.tick().await.unwrap();
        let Some(DirectoryChange::Put(renewed)) = watch.try_next() else {
            panic!("a third of the TTL passed: re-put")
        };
        assert!(renewed.lease_expires_unix_ms() > first.lease_expires_unix_ms());

        // A target whose clock is past the lease refuses the record.
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&donor, &blocks).await;
        let rows: Vec<Arc<dyn BankMemory>> = (0..TP)
            .map(|_| {
                Arc::new(HostBuffer::zeroed(ROWS as usize * rbb()).unwrap()) as Arc<dyn BankMemory>
            })
            .collect();
        let exec = FetchExecutor::new(
            layout(),
            DestinationPool::new(ROWS),
            rows,
            ROWS,
            Arc::new(HostCopyBackend),
        )
        .unwrap();
        let late = renewed.lease_expires_unix_ms();
        let tgt = TargetAgent::connect_with_clock(exec, dir.clone(), None, move || late)
            .await
            .unwrap();
        let slots: Vec<u32> = h.iter().map(|x| donor.bank().lookup(x).unwrap()).collect();
        let hint = FetchGpuHint {
            donor_engine_id: donor.bank().owner().engine_id,
            bank_generation: donor.bank().owner().generation,
            layout_fingerprint: layout().fingerprint(),
            tp_size: TP,
            sequence_hashes: h.clone(),
            fetch_from: 0,
            parts: (0..TP)
                .map(|r| FetchPart {
                    tp_rank: r,
                    slot_ids: slots.clone(),
                    expected_bytes: (slots.len() * rbb()) as u64,
                })
                .collect(),
            donor_control_endpoint: ep.clone(),
        };
        let env = HintEnvelope::fetch_gpu("r1", "a0", &hint).unwrap();
        let e = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap_err();
        assert!(
            matches!(e, AgentError::Resolve(ResolveError::LeaseLapsed { .. })),
            "{e:?}"
        );
        let stats = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(stats.pin_stats.granted, 0, "a lapsed record asks no pin");
    });
}

#[test]
fn bad_donor_configs_are_refused_naming_the_field_and_open_nothing() {
    serial(|| async {
        let p = Planes::new();
        let (plane, dir) = (&p.plane, &p.dir);
        let ep = p.endpoint("d0");
        let before = kv_bank::leaks::snapshot();

        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = Duration::ZERO;
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::InvalidConfig {
                    field: "record_ttl",
                    ..
                }
            ),
            "{e:?}"
        );

        let mut cfg = donor_config("decode-0", &ep);
        cfg.record_ttl = cfg.bank.lease.duration + Duration::from_millis(1);
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::InvalidConfig {
                    field: "record_ttl",
                    ..
                }
            ),
            "{e:?}"
        );

        let mut cfg = donor_config("decode-0", &ep);
        cfg.gpus.pop();
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::Announcement(AnnouncementError::InvalidField { field: "gpus", .. })
            ),
            "{e:?}"
        );

        let cfg = donor_config("decode-0", "tcp:127.0.0.1:1");
        let e = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap_err();
        assert!(matches!(e, AgentError::PinService(_)), "{e:?}");

        let mut w = dir.watch().await.unwrap();
        assert!(w.try_next().is_none(), "no record was put");
        let leaks = kv_bank::leaks::snapshot().leaks_since(&before);
        assert!(leaks.is_empty(), "a refused open leaked: {leaks:?}");
    });
}

#[test]
fn pins_travel_over_tcp_with_the_key_and_a_wrong_key_is_refused_typed() {
    serial(|| async {
        let key = PinAuthKey::from_bytes(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
        let wrong = PinAuthKey::from_bytes(b"ffffffffffffffffffffffffffffffff".to_vec()).unwrap();
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let target_id = EngineId::fresh();
        let mut router = Router::new(plane.clone(), dir.as_ref(), target_id).await;
        let before = kv_bank::leaks::snapshot();

        // Without the key a TCP endpoint opens nothing.
        let e = DonorAgent::open(
            donor_config("decode-0", "tcp:127.0.0.1:0"),
            dir.clone(),
            plane.clone(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::PinService(PinServiceError::AuthRequired { .. })
            ),
            "{e:?}"
        );

        let mut cfg = donor_config("decode-0", "tcp:127.0.0.1:0");
        cfg.pin_auth_key = Some(key.clone());
        let donor = DonorAgent::open(cfg, dir.clone(), plane.clone())
            .await
            .unwrap();
        let ep = donor.pin_endpoint().to_string();
        let port: u16 = ep
            .strip_prefix("tcp:127.0.0.1:")
            .expect("the bound endpoint is published")
            .parse()
            .unwrap();
        assert_ne!(port, 0, "the bound port, not 0");
        let blocks = prompt(0);
        let h = hashes(&blocks);
        store(&donor, &blocks).await;
        router.pump().await;
        let env = router
            .advisor
            .advise("r1", &h, target_id)
            .hint
            .expect("hint");
        let hint = env.fetch_gpu_actions().unwrap().remove(0);
        assert_eq!(hint.donor_control_endpoint, ep, "the record advertises TCP");

        // Right key: exact bytes.
        let (tgt, rows) = target(dir.clone()).await;
        let tgt = tgt.with_pin_auth_key(key);
        let out = tgt.fetch(&env, &h, &DeliveryControl::new()).unwrap();
        assert_eq!(out.fetched, h);
        assert_rows_hold(&rows, &out);
        drop(out);

        // Wrong key, and no key: refused typed, nothing pinned, the
        // destination rows back in the pool.
        let (bad, _) = target(dir.clone()).await;
        let bad = bad.with_pin_auth_key(wrong);
        let (none, _) = target(dir.clone()).await;
        for (name, t, want_refused) in [("wrong key", &bad, true), ("no key", &none, false)] {
            let e = t.fetch(&env, &h, &DeliveryControl::new()).unwrap_err();
            let cause = match &e {
                AgentError::Fetch(f) => f.fallback_cause(),
                _ => None,
            };
            let ok = match cause {
                Some(FallbackCause::Pin(PinError::Auth(PinAuthError::Refused))) => want_refused,
                Some(FallbackCause::Pin(PinError::Auth(PinAuthError::KeyMissing { .. }))) => {
                    !want_refused
                }
                _ => false,
            };
            assert!(ok, "{name}: {e:?}");
            assert_eq!(t.executor().pool().free_blocks(), ROWS as usize, "{name}");
        }
        let report = donor.close(Duration::from_secs(1)).await.unwrap();
        assert_eq!(report.pin_stats.granted, 1, "only the keyed fetch pinned");
        assert_eq!(report.pin_stats.released, 1);
        let leaks = kv_bank::leaks::snapshot().leaks_since(&before);
        assert!(leaks.is_empty(), "leaked: {leaks:?}");
    });
}
