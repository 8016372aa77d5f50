//! A donor agent's NIXL agent, from its directory record to the target's
//! NIXL agent: published name + metadata (bounded, refused naming the field
//! when over), resolved through the target's directory cache and loaded with
//! the real NIXL runtime (`load_remote_md`), a record naming another agent
//! refused.
//!
//! Skips (printing why) when `libnixl_capi.so` is not loadable (run with the
//! environment of `cargo xtask install`), except under `CI=true`, where a
//! missing runtime fails the test.

mod agents_common;

use std::sync::Arc;
use std::time::Duration;

use agents_common::*;
use kv_descriptor::MAX_NIXL_METADATA_BYTES;
use kv_router_glue::*;
use kv_transfer::nixl::{runtime_status, NixlAgent};

fn runtime_or_skip() -> bool {
    match runtime_status() {
        Ok(()) => true,
        Err(e) if kv_transfer::ci_requires() => panic!("CI and {e}"),
        Err(e) => {
            println!("SKIP a_donor_publishes_its_nixl_agent_and_the_target_loads_it: {e}");
            false
        }
    }
}

#[test]
fn a_donor_publishes_its_nixl_agent_and_the_target_loads_it() {
    if !runtime_or_skip() {
        return;
    }
    serial(|| async {
        let sock = tempfile::tempdir().unwrap();
        let ep = format!("unix:{}", sock.path().join("d0.sock").display());
        let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
        let dir = Arc::new(InProcessDirectory::new());
        let donor = DonorAgent::open(donor_config("decode-0", &ep), dir.clone(), plane.clone())
            .await
            .unwrap();
        let engine = donor.bank().owner().engine_id;
        let (target, _rows) = target(dir.as_ref()).await;
        let target_nixl = NixlAgent::new("kv-agents-nixl-target").unwrap();

        // No NIXL agent published yet: a typed refusal (recompute).
        match target.load_donor_nixl(engine, &target_nixl) {
            Err(AgentError::NoNixlAgent { donor: d }) => assert_eq!(d, engine),
            other => panic!("expected NoNixlAgent, got {other:?}"),
        }

        // The donor's NIXL agent registers every rank of the bank.
        let donor_nixl = NixlAgent::new("kv-agents-nixl-donor").unwrap();
        for r in 0..TP {
            donor_nixl
                .register(donor.bank().rank(r).unwrap().memory().as_ref())
                .unwrap();
        }
        let metadata = donor_nixl.metadata().unwrap();
        assert!(!metadata.is_empty() && metadata.len() <= MAX_NIXL_METADATA_BYTES);

        // Oversized metadata or an empty name: refused naming the field, the
        // record keeps publishing none.
        for (name, md, field) in [
            (
                donor_nixl.name().to_string(),
                vec![0u8; MAX_NIXL_METADATA_BYTES + 1],
                "nixl_agent_metadata",
            ),
            (String::new(), metadata.clone(), "nixl_agent_name"),
        ] {
            match donor.publish_nixl_agent(name, md).await {
                Err(AgentError::Record(DonorRecordError::InvalidField { field: f, .. })) => {
                    assert_eq!(f, field)
                }
                other => panic!("expected a refusal naming {field}, got {other:?}"),
            }
            let r = donor.record(unix_now_ms()).unwrap();
            assert_eq!((r.nixl_agent_name(), r.nixl_agent_metadata()), (None, None));
        }

        // Published: the record carries both; the target resolves the donor
        // from its directory cache and its NIXL agent loads the metadata.
        donor
            .publish_nixl_agent(donor_nixl.name().to_string(), metadata.clone())
            .await
            .unwrap();
        let r = donor.record(unix_now_ms()).unwrap();
        assert_eq!(r.nixl_agent_name(), Some("kv-agents-nixl-donor"));
        assert_eq!(r.nixl_agent_metadata(), Some(metadata.as_slice()));
        assert_eq!(
            target.load_donor_nixl(engine, &target_nixl).unwrap(),
            "kv-agents-nixl-donor"
        );

        // A record whose name is not the metadata's agent is not used.
        donor
            .publish_nixl_agent("kv-agents-nixl-other".into(), metadata)
            .await
            .unwrap();
        match target.load_donor_nixl(engine, &target_nixl) {
            Err(AgentError::NixlAgentMismatch { published, loaded }) => {
                assert_eq!(
                    (published.as_str(), loaded.as_str()),
                    ("kv-agents-nixl-other", "kv-agents-nixl-donor")
                );
            }
            other => panic!("expected NixlAgentMismatch, got {other:?}"),
        }
        donor.close(Duration::ZERO).await.unwrap();
    });
}
