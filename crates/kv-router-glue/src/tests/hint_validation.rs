use kv_descriptor::*;
use proptest::prelude::*;

use crate::*;

fn layout(tp: u32, dtype: DType) -> KvLayout {
    KvLayout::new(2, 4, 8, dtype, 4, TensorOrder::BlockMajor, tp).unwrap()
}

fn manifest(tp: u32, owner: OwnerLease, slot_count: u32) -> BankManifest {
    let l = layout(tp, DType::F32);
    let parts = (0..tp)
        .map(|r| {
            BankDescriptor::new(BankParts {
                layout: l,
                tp_rank: r,
                location: MemoryLocation::Host {
                    host_id: "h".into(),
                },
                owner,
                export: ExportHandle::HostShm {
                    name: format!("/kvbank-test-{r}"),
                },
                slot_count,
                slot_bytes: l.rank_block_bytes() as u64,
            })
            .unwrap()
        })
        .collect();
    BankManifest::new(parts).unwrap()
}

fn hint(owner: &OwnerLease, tp: u32, slots: Vec<u32>) -> FetchGpuHint {
    let l = layout(tp, DType::F32);
    let n = slots.len();
    FetchGpuHint {
        donor_engine_id: owner.engine_id,
        bank_generation: owner.generation,
        layout_fingerprint: l.fingerprint(),
        tp_size: tp,
        sequence_hashes: (0..n as u64 + 1).map(SequenceHash).collect(),
        fetch_from: 1,
        parts: (0..tp)
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: n as u64 * l.rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: "kv.ns.decode.control".into(),
    }
}

#[test]
fn valid_tp2_hint_gives_slots_and_bytes() {
    let owner = OwnerLease::fresh(Role::Decode);
    let m = manifest(2, owner, 16);
    let v = validate_hint(&hint(&owner, 2, vec![3, 9, 4]), &m, &layout(2, DType::F32)).unwrap();
    let rbb = layout(2, DType::F32).rank_block_bytes() as u64;
    assert_eq!(v.slot_ids, vec![3, 9, 4]);
    assert_eq!(v.rank_bytes, 3 * rbb);
    assert_eq!(v.total_bytes, 6 * rbb);
}

#[test]
fn stale_forged_and_out_of_range_hints_are_rejected() {
    let owner = OwnerLease::fresh(Role::Decode);
    let m = manifest(2, owner, 16);
    let target = layout(2, DType::F32);
    let good = hint(&owner, 2, vec![1, 2]);

    let mut h = good.clone();
    h.donor_engine_id = EngineId::fresh();
    assert!(matches!(
        validate_hint(&h, &m, &target),
        Err(FetchError::WrongEngine { .. })
    ));

    let mut h = good.clone();
    h.bank_generation = 2;
    assert!(matches!(
        validate_hint(&h, &m, &target),
        Err(FetchError::StaleGeneration {
            hint: 2,
            manifest: 1
        })
    ));
    // A reopened bank (next generation) refuses the old generation's hint.
    let reopened = manifest(2, owner.next_generation(), 16);
    assert!(matches!(
        validate_hint(&good, &reopened, &target),
        Err(FetchError::StaleGeneration {
            hint: 1,
            manifest: 2
        })
    ));

    let e = validate_hint(&good, &m, &layout(2, DType::Bf16)).unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::LayoutMismatch {
                field: "hint.layout_fingerprint",
                ..
            }
        ),
        "{e}"
    );

    let mut h = good.clone();
    h.parts[1].slot_ids[1] = 16;
    assert!(matches!(
        validate_hint(&h, &m, &target),
        Err(FetchError::SlotOutOfRange {
            rank: 1,
            slot: 16,
            slot_count: 16
        })
    ));
    h.parts[1].slot_ids[1] = 5;
    assert!(matches!(
        validate_hint(&h, &m, &target),
        Err(FetchError::InconsistentSlots { rank: 1, .. })
    ));

    let dup = hint(&owner, 2, vec![7, 7]);
    let e = validate_hint(&dup, &m, &target);
    // The descriptor's own check or ours, whichever runs first, names the repeated slot.
    assert!(
        matches!(&e, Err(FetchError::InconsistentSlots { rank: 0, .. }))
            || matches!(
                &e,
                Err(FetchError::Malformed(DescriptorError::InvalidField {
                    field: "hint.parts.slot_ids",
                    ..
                }))
            ),
        "{e:?}"
    );

    let mut h = good.clone();
    h.parts[0].expected_bytes += 1;
    let e = validate_hint(&h, &m, &target).unwrap_err();
    assert!(e.to_string().contains("hint.parts.expected_bytes"), "{e}");

    let prefill_owner = OwnerLease {
        role: Role::Prefill,
        ..owner
    };
    let pm = manifest(2, prefill_owner, 16);
    assert!(matches!(
        validate_hint(&good, &pm, &target),
        Err(FetchError::NotADonor { .. })
    ));

    // TP mismatch: a TP1 hint against a TP2 donor is malformed (parts != tp) or mismatched.
    let tp1 = hint(&owner, 1, vec![1, 2]);
    assert!(validate_hint(&tp1, &m, &target).is_err());
}

proptest! {
    /// A hint is accepted exactly when its slots are in range and distinct.
    #[test]
    fn slot_checks_are_exact(slots in proptest::collection::vec(0u32..40, 1..12)) {
        let owner = OwnerLease::fresh(Role::Decode);
        let m = manifest(1, owner, 32);
        let ok = validate_hint(&hint(&owner, 1, slots.clone()), &m, &layout(1, DType::F32)).is_ok();
        let distinct = slots.iter().collect::<std::collections::HashSet<_>>().len() == slots.len();
        prop_assert_eq!(ok, distinct && slots.iter().all(|&s| s < 32));
    }
}

#[test]
fn prompt_prefix_check_names_the_first_differing_block() {
    let owner = OwnerLease::fresh(Role::Decode);
    let h = hint(&owner, 1, vec![1, 2, 3]); // hashes 0..4
    let prompt: Vec<SequenceHash> = (0..6).map(SequenceHash).collect();
    assert!(check_prompt_prefix(&h, &prompt).is_ok());
    assert!(
        check_prompt_prefix(&h, &prompt[..4]).is_ok(),
        "equal length is a prefix"
    );
    let mut other = prompt.clone();
    other[2] = SequenceHash(99);
    assert!(matches!(
        check_prompt_prefix(&h, &other),
        Err(FetchError::PromptMismatch { block: 2 })
    ));
    assert!(matches!(
        check_prompt_prefix(&h, &prompt[..3]),
        Err(FetchError::HintBeyondPrompt {
            hint_blocks: 4,
            prompt_blocks: 3
        })
    ));
    // A prompt for a different conversation from block 0.
    let unrelated: Vec<SequenceHash> = (100..106).map(SequenceHash).collect();
    let e = check_prompt_prefix(&h, &unrelated).unwrap_err();
    assert!(matches!(e, FetchError::PromptMismatch { block: 0 }), "{e}");
    assert_eq!(e.cause_label(), "prompt_mismatch");
}
