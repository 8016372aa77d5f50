//! Property tests of the advise wire: whatever bytes arrive on
//! `kv_reuse.advise`, the decoders and the service's handler never panic,
//! and the service always answers with a reply that decodes.

use std::sync::Arc;

use kv_descriptor::{EngineId, SequenceHash, Wire};
use proptest::prelude::*;

use super::*;
use crate::qualify::Scenario;
use crate::ReuseSettings;

fn request(target: EngineId, hashes: Vec<u64>) -> AdviseRequest {
    AdviseRequest {
        request_id: "prop-1".into(),
        target,
        keys: AdviseKeys::SequenceHashes(hashes.into_iter().map(SequenceHash).collect()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary bytes: both decoders return, never panic.
    #[test]
    fn advise_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = AdviseRequest::decode(&bytes);
        let _ = AdviseReply::from_wire(&bytes);
    }

    /// A valid request with bytes changed or cut decodes to a request
    /// (which `check` accepts or refuses) or is refused as malformed, and
    /// the service answers every one of them with a reply that decodes.
    #[test]
    fn the_service_answers_every_mutated_request(
        hashes in proptest::collection::vec(any::<u64>(), 0..64),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let s = Scenario::new().unwrap();
        let advisor = s
            .advisor(ReuseSettings { enable_decode_to_prefill_reuse: true, ..ReuseSettings::default() })
            .unwrap();
        let svc = RouterService::new(Arc::new(advisor));
        svc.add_target(s.target);
        let mut bytes = request(s.target, hashes).to_wire().unwrap();
        for (i, b) in edits {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        let n = cut.index(bytes.len() + 1);
        if let Ok(r) = AdviseRequest::decode(&bytes[..n]) {
            let _ = r.check();
        }
        let reply = AdviseReply::from_wire(&svc.handle(&bytes[..n]));
        prop_assert!(reply.is_ok(), "the service's reply does not decode: {:?}", reply.err());
    }
}

/// A field of the wrong type is named in the refusal (helper-20: a bad
/// `target` used to read only "UUID parsing failed").
#[test]
fn a_malformed_request_names_the_field() {
    let good = request(EngineId::fresh(), vec![1, 2]).to_wire().unwrap();
    for (key, bad, field) in [
        ("target", rmpv::Value::from("not-a-uuid"), "target"),
        ("request_id", rmpv::Value::from(7), "request_id"),
    ] {
        let mut v = rmpv::decode::read_value(&mut &good[..]).unwrap();
        let rmpv::Value::Map(entries) = &mut v else {
            panic!("{v:?}")
        };
        let (_, val) = entries
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some(key))
            .unwrap();
        *val = bad;
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &v).unwrap();
        match AdviseRequest::decode(&bytes) {
            Err(AdviseRefusal::Malformed(m)) => assert!(
                m.starts_with(&format!("cannot decode `advise_request` at `{field}`: ")),
                "{m}"
            ),
            other => panic!("{key}: {other:?}"),
        }
    }
}
