//! RouterService: advise wire round trip, typed refusals, nothing changed by bad input.

use std::sync::Arc;

use kv_descriptor::{EngineId, SequenceHash, Wire};

use crate::qualify::{Scenario, DONOR_BLOCKS, TARGET_BASELINE};
use crate::service::*;
use crate::*;

fn service(s: &Scenario) -> RouterService {
    let advisor = s.advisor(crate::qualify::admitting_settings()).unwrap();
    let svc = RouterService::new(Arc::new(advisor));
    svc.add_target(s.target);
    svc
}

fn decode(bytes: &[u8]) -> AdviseReply {
    AdviseReply::from_wire(bytes).unwrap()
}

#[test]
fn advise_over_the_wire_admits_with_terms_and_hint() {
    let s = Scenario::new().unwrap();
    let svc = service(&s);
    let req = AdviseRequest {
        request_id: "r1".into(),
        target: s.target,
        keys: AdviseKeys::SequenceHashes(s.hashes.clone()),
    };
    let reply = decode(&svc.handle(&req.to_wire().unwrap()));
    assert_eq!(reply.request_id, "r1");
    let AdviseResult::Decided { decision, hint } = reply.result else {
        panic!("refused: {reply:?}");
    };
    assert!(decision.admitted(), "{decision}");
    let t = decision.terms.unwrap();
    let fetched = (DONOR_BLOCKS - TARGET_BASELINE) as u64;
    assert_eq!(t.transfer_blocks, fetched);
    assert_eq!(t.reused_tokens, fetched * 16);
    let env = hint.expect("hint when admitted");
    assert_eq!(env.message_id, "r1");
    assert_eq!(
        env.fetch_gpu_actions().unwrap()[0].donor_engine_id,
        s.donor.owner().engine_id
    );
    assert_eq!(svc.advisor().log().recent().len(), 1);
}

#[test]
fn refusals_are_typed_and_change_nothing() {
    let s = Scenario::new().unwrap();
    let svc = service(&s);
    let ok = |keys| AdviseRequest {
        request_id: "r".into(),
        target: s.target,
        keys,
    };
    let cases: Vec<(Vec<u8>, AdviseRefusal)> = vec![
        (
            AdviseRequest {
                target: EngineId(uuid::Uuid::from_u128(7)),
                ..ok(AdviseKeys::SequenceHashes(s.hashes.clone()))
            }
            .to_wire()
            .unwrap(),
            AdviseRefusal::UnknownTarget(EngineId(uuid::Uuid::from_u128(7))),
        ),
        (
            ok(AdviseKeys::SequenceHashes(vec![
                SequenceHash(1);
                MAX_ADVISE_BLOCKS + 1
            ]))
            .to_wire()
            .unwrap(),
            AdviseRefusal::Oversized {
                field: "sequence_hashes".into(),
                len: MAX_ADVISE_BLOCKS as u64 + 1,
                max: MAX_ADVISE_BLOCKS as u64,
            },
        ),
        (
            ok(AdviseKeys::Tokens {
                token_ids: vec![1; 32],
                tokens_per_block: 0,
            })
            .to_wire()
            .unwrap(),
            AdviseRefusal::Empty {
                field: "tokens_per_block".into(),
            },
        ),
        (
            vec![0u8; MAX_ADVISE_REQUEST_BYTES + 1],
            AdviseRefusal::Oversized {
                field: "payload".into(),
                len: MAX_ADVISE_REQUEST_BYTES as u64 + 1,
                max: MAX_ADVISE_REQUEST_BYTES as u64,
            },
        ),
    ];
    for (payload, want) in cases {
        let reply = decode(&svc.handle(&payload));
        assert_eq!(reply.result, AdviseResult::Refused(want));
    }
    let garbage = decode(&svc.handle(&[0xc1, 0x00]));
    assert!(
        matches!(
            garbage.result,
            AdviseResult::Refused(AdviseRefusal::Malformed(_))
        ),
        "{garbage:?}"
    );
    // An unknown target is most often one announcing in another namespace:
    // the message says so (helper-22 finding 8: nothing pointed there).
    let unknown = AdviseRefusal::UnknownTarget(EngineId(uuid::Uuid::from_u128(7))).to_string();
    assert!(
        unknown.starts_with("unknown target engine 00000000-0000-0000-0000-000000000007 ("),
        "{unknown}"
    );
    assert!(unknown.contains("router's --namespace"), "{unknown}");
    // Or a router of another namespace answering on a shared advise
    // subject (trial h44, 11).
    assert!(
        unknown.contains("a router of another namespace share this advise subject")
            && unknown.contains("`--advise-subject`")
            && unknown.contains("`RouterClient(subject=)`"),
        "{unknown}"
    );
    assert_eq!(svc.refused(), 5);
    assert_eq!(
        svc.advisor().log().recent().len(),
        0,
        "no decision logged for refusals"
    );
}

#[test]
fn tokens_hash_like_the_index_and_drain_refuses() {
    let s = Scenario::new().unwrap();
    let svc = service(&s);
    // The scenario's prompt is tokens 0.., so 64 token ids are its first 4
    // blocks: the service must hash them exactly like the index does.
    let tokens: Vec<u32> = (0..64).collect();
    assert_eq!(kv_descriptor::sequence_hashes(&tokens, 16), s.hashes[..4]);
    let req = AdviseRequest {
        request_id: "t".into(),
        target: s.target,
        keys: AdviseKeys::Tokens {
            token_ids: tokens,
            tokens_per_block: 16,
        },
    };
    let AdviseResult::Decided { decision, hint } = svc.advise(&req).result else {
        panic!("refused");
    };
    assert!(hint.is_none());
    assert_eq!(
        decision.verdict,
        Verdict::Refuse(RefuseReason::TooFewBlocks),
        "{decision}"
    );
    let t = decision.terms.unwrap();
    assert_eq!(t.transfer_blocks, 4 - TARGET_BASELINE as u64);
    svc.drain();
    assert_eq!(
        svc.advise(&req).result,
        AdviseResult::Refused(AdviseRefusal::Draining)
    );
}
