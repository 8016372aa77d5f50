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
