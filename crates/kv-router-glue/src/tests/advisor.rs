use kv_descriptor::PinRefusalReason;
use kv_transfer::DeliveryControl;

use crate::qualify::{admitting_settings, Scenario, DONOR_BLOCKS, TARGET_BASELINE};
use crate::*;

/// Reuse on with the default thresholds (2 ms minimum saving, 4 blocks) and
/// the lookup budget at its maximum: the refusal tests need the thresholds;
/// a preempted debug-build lookup must not spend the budget.
fn enabled() -> ReuseSettings {
    ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        transfer_source_lookup_budget_ms: 1_000.0,
        ..ReuseSettings::default()
    }
}

#[test]
fn advisor_admits_a_long_prefix_and_the_executor_fetches_exact_bytes() {
    let s = Scenario::new().unwrap();
    let advisor = s.advisor(admitting_settings()).unwrap();
    let a = advisor.advise("r1", &s.hashes, s.target);
    let t = a.decision.terms.expect("terms recorded");
    let fetched = (DONOR_BLOCKS - TARGET_BASELINE) as u64;
    assert_eq!(t.transfer_blocks, fetched);
    assert_eq!(t.reused_tokens, fetched * 16);
    assert_eq!(t.path, TransferPath::Host);
    assert_eq!(t.transfer_cost_us, fetched as f64 * 400.0);
    assert!(
        // Measured wall time, within the 1 s budget (a loaded runner may
        // preempt it past the default 1 ms).
        t.lookup_us > 0.0 && t.lookup_us < 1_000_000.0,
        "lookup {} µs",
        t.lookup_us
    );
    assert_eq!(
        t.saving_us,
        fetched as f64 * 16.0 * admitting_settings().transfer_source_prefill_token_us
            - fetched as f64 * 400.0
            - t.lookup_us
    );
    assert!(a.decision.admitted(), "{}", a.decision);
    let env = a.hint.expect("hint attached");
    assert_eq!(env.message_id, "r1");
    let hint = env.fetch_gpu_actions().unwrap().remove(0);
    assert_eq!(hint.fetch_from as usize, TARGET_BASELINE);
    assert_eq!(hint.sequence_hashes, s.hashes);
    assert_eq!(hint.donor_engine_id, s.donor.owner().engine_id);

    let exec = s.executor().unwrap();
    let out = exec
        .execute(&env, s.donor.as_ref(), &DeliveryControl::new())
        .unwrap();
    assert_eq!(out.target_blocks.len(), fetched as usize);
    assert_eq!(
        out.report.counters.bytes,
        fetched * 2 * s.layout.rank_block_bytes() as u64
    );
    for (i, &row) in out.target_blocks.iter().enumerate() {
        assert!(
            s.row_holds_block(row, TARGET_BASELINE + i),
            "row {row} (block {})",
            TARGET_BASELINE + i
        );
    }
    assert_eq!(s.donor.pins_outstanding(), 0);
    assert_eq!(
        exec.pool().free_blocks(),
        64 - fetched as usize,
        "completed rows stay out of the pool while the outcome is held"
    );
    // A second fetch while the first outcome is held cannot take its rows:
    // 18 rows are free for 46 blocks, so it falls back at `reserve` (before
    // completion held the rows, it overwrote them) and the first request's
    // rows keep their bytes.
    let full = exec
        .execute(&env, s.donor.as_ref(), &DeliveryControl::new())
        .unwrap_err();
    assert!(
        matches!(
            &full,
            FetchError::Fallback {
                stage: "reserve",
                cause: FallbackCause::Bank(_),
            }
        ),
        "{full:?}"
    );
    for (i, &row) in out.target_blocks.iter().enumerate() {
        assert!(s.row_holds_block(row, TARGET_BASELINE + i), "row {row}");
    }
    drop(out);
    assert_eq!(
        exec.pool().free_blocks(),
        64,
        "a dropped outcome returns its rows"
    );
    let again = exec
        .execute(&env, s.donor.as_ref(), &DeliveryControl::new())
        .unwrap();
    assert_eq!(again.target_blocks.len(), fetched as usize);
    assert_eq!(advisor.log().admitted(), 1);
}

#[test]
fn advisor_refusals_carry_their_reason() {
    let s = Scenario::new().unwrap();
    let off = s.advisor(ReuseSettings::default()).unwrap();
    let a = off.advise("r0", &s.hashes, s.target);
    assert_eq!(
        a.decision.verdict,
        Verdict::Refuse(RefuseReason::ReuseDisabled)
    );
    assert!(a.lookup.is_none(), "reuse off must not even look up");

    let on = s.advisor(enabled()).unwrap();
    let a = on.advise("short", &s.hashes[..TARGET_BASELINE + 3], s.target);
    assert_eq!(
        a.decision.verdict,
        Verdict::Refuse(RefuseReason::TooFewBlocks)
    );
    assert!(a.hint.is_none());
    // 10 blocks fetched: 8 x (480 − 400) µs − lookup < 2 ms.
    let a = on.advise("medium", &s.hashes[..TARGET_BASELINE + 8], s.target);
    assert_eq!(
        a.decision.verdict,
        Verdict::Refuse(RefuseReason::SavingBelowMinimum),
        "{}",
        a.decision
    );
    let other = kv_descriptor::sequence_hashes(&(5_000..5_160).collect::<Vec<u32>>(), 16);
    let a = on.advise("other", &other, s.target);
    assert!(
        matches!(
            a.decision.verdict,
            Verdict::Refuse(RefuseReason::NoDonor(_))
        ),
        "{}",
        a.decision
    );
    // The donor left the directory: the lookup finds it but no hint can be written.
    s.directory.remove(s.donor.owner().engine_id);
    let a = on.advise("gone", &s.hashes, s.target);
    assert!(
        matches!(
            a.decision.verdict,
            Verdict::Refuse(RefuseReason::HintUnavailable(_))
        ),
        "{}",
        a.decision
    );
    assert_eq!(on.log().refused().values().sum::<u64>(), 4);
}

#[test]
fn executor_rejects_bad_hints_before_touching_memory_and_falls_back_cleanly() {
    let s = Scenario::new().unwrap();
    let advisor = s.advisor(admitting_settings()).unwrap();
    let env = advisor.advise("r", &s.hashes, s.target).hint.unwrap();
    let hint = env.fetch_gpu_actions().unwrap().remove(0);
    let exec = s.executor().unwrap();
    let ctl = DeliveryControl::new();
    let rerun = |h: &kv_descriptor::FetchGpuHint| {
        let e = kv_descriptor::HintEnvelope::fetch_gpu("x", "a", h).unwrap();
        exec.execute(&e, s.donor.as_ref(), &ctl)
    };

    let mut stale = hint.clone();
    stale.bank_generation += 1;
    assert!(matches!(
        rerun(&stale),
        Err(FetchError::StaleGeneration { .. })
    ));
    let mut forged = hint.clone();
    for p in &mut forged.parts {
        p.slot_ids[0] = 10_000;
    }
    assert!(matches!(
        rerun(&forged),
        Err(FetchError::SlotOutOfRange { slot: 10_000, .. })
    ));
    assert_eq!(exec.pool().free_blocks(), 64);
    assert_eq!(s.donor.pins_outstanding(), 0);
    // In-range slots that hold other blocks: the donor's pin check refuses, the
    // reservation is cancelled and quiesced, and no target row is written.
    let mut swapped = hint.clone();
    for p in &mut swapped.parts {
        p.slot_ids.swap(0, 1);
    }
    let e = rerun(&swapped).unwrap_err();
    assert!(
        matches!(
            &e,
            FetchError::Fallback {
                stage: "pin",
                cause: FallbackCause::Pin(p),
            } if p.refusal_reason() == Some(PinRefusalReason::SlotReused)
        ),
        "{e:?}"
    );
    assert_eq!(crate::metrics::fallback_labels(&e), ("pin", "pin_refused"));
    assert_eq!(exec.pool().free_blocks(), 64);
    assert_eq!(exec.pool().orphaned_blocks(), 0);
    assert!(!s.row_holds_block(0, TARGET_BASELINE));
    // A cancelled delivery falls back at transfer and releases everything.
    let cancelled = DeliveryControl::new();
    cancelled.cancel.cancel();
    let e = exec
        .execute(&env, s.donor.as_ref(), &cancelled)
        .unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::Fallback {
                stage: "transfer",
                cause: FallbackCause::Transfer(kv_transfer::TransferError::Cancelled),
            }
        ),
        "{e}"
    );
    assert_eq!(e.cause_label(), "transfer_cancelled");
    assert_eq!(exec.pool().free_blocks(), 64);
    assert_eq!(s.donor.pins_outstanding(), 0);
}

#[test]
fn qualify_section_prints_settings_and_decisions_with_terms() {
    let loaded = SettingsLoader::new().build().unwrap();
    let q = crate::qualify::qualify_section(&loaded);
    let text = q.render();
    println!("{text}");
    assert!(q.passed, "{text}");
    assert_eq!(q.settings.len(), 8);
    assert_eq!(q.decisions.len(), 3);
    assert!(q.decisions.iter().all(|d| !d.admitted()));
    assert!(
        q.decisions_if_enabled.iter().any(|d| d.admitted()),
        "{text}"
    );
    assert!(
        text.contains("ADMIT: Host:") && text.contains("REFUSE (too few blocks)"),
        "{text}"
    );
    assert!(
        q.checks
            .iter()
            .any(|(n, ok, _)| n == "fetch_bytes_match_donor" && *ok),
        "{text}"
    );
}

#[test]
fn executor_refuses_a_hint_for_another_or_a_shorter_prompt_before_touching_memory() {
    let s = Scenario::new().unwrap();
    let advisor = s.advisor(admitting_settings()).unwrap();
    let env = advisor.advise("r", &s.hashes, s.target).hint.unwrap();
    let hint_blocks = env.fetch_gpu_actions().unwrap()[0].sequence_hashes.len();
    let exec = s.executor().unwrap();
    let ctl = DeliveryControl::new();

    // Another prompt whose block 3 differs: its chain differs from there on.
    let mut other = s.hashes.clone();
    for h in &mut other[3..] {
        h.0 ^= 0x5a5a;
    }
    let e = exec
        .execute_for_prompt(&env, &other, s.donor.as_ref(), &ctl)
        .unwrap_err();
    assert!(matches!(e, FetchError::PromptMismatch { block: 3 }), "{e}");
    assert_eq!(
        crate::metrics::fallback_labels(&e),
        ("hint", "prompt_mismatch")
    );
    // A prompt shorter than the hint.
    let e = exec
        .execute_for_prompt(&env, &s.hashes[..hint_blocks - 1], s.donor.as_ref(), &ctl)
        .unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::HintBeyondPrompt { hint_blocks: h, prompt_blocks: p }
                if h == hint_blocks && p == hint_blocks - 1
        ),
        "{e}"
    );
    // Nothing was reserved or pinned by the refusals.
    assert_eq!(exec.pool().free_blocks(), 64);
    assert_eq!(s.donor.pins_outstanding(), 0);
    // The prompt the hint was written for fetches.
    let out = exec
        .execute_for_prompt(&env, &s.hashes, s.donor.as_ref(), &ctl)
        .unwrap();
    assert_eq!(out.fetched.len(), DONOR_BLOCKS - TARGET_BASELINE);
}

/// A directory that answers with another bank's manifest (another layout)
/// under the donor's engine id and the real slots: what a misconfigured
/// donor's record, or one that outlived a re-layout, would give.
struct ForeignLayoutDirectory {
    real: std::sync::Arc<LocalDonorDirectory>,
    foreign: kv_descriptor::BankManifest,
}

impl DonorDirectory for ForeignLayoutDirectory {
    fn resolve(
        &self,
        donor: kv_descriptor::EngineId,
        hashes: &[kv_descriptor::SequenceHash],
    ) -> Result<ResolvedDonor, ResolveError> {
        let real = self.real.resolve(donor, hashes)?;
        Ok(ResolvedDonor {
            manifest: self.foreign.clone(),
            ..real
        })
    }
}

#[test]
fn a_directory_record_of_another_layout_is_refused_before_any_hint() {
    use std::sync::Arc;
    let s = Scenario::new().unwrap();
    // Same TP and block size, 8 KV heads instead of 4: another fingerprint.
    let other = kv_descriptor::KvLayout::new(
        2,
        8,
        8,
        kv_descriptor::DType::F32,
        16,
        kv_descriptor::TensorOrder::BlockMajor,
        2,
    )
    .unwrap();
    assert_ne!(other.fingerprint(), s.layout.fingerprint());
    let bank = kv_bank::BankManager::new_host_shm(
        kv_bank::BankConfig::new(
            other,
            kv_descriptor::OwnerLease::fresh(kv_descriptor::Role::Decode),
            64 * 2 * other.rank_block_bytes() as u64,
        ),
        "glue-foreign",
    )
    .unwrap();
    let directory = Arc::new(ForeignLayoutDirectory {
        real: s.directory.clone(),
        foreign: bank.manifest().clone(),
    });
    let model = CostModel::new(enabled(), 16).unwrap();
    let advisor = Advisor::new(
        s.index.clone(),
        directory,
        LiveCostModel::new(model),
        Arc::new(DecisionLog::new(8)),
        16_384,
    );
    let a = advisor.advise("foreign", &s.hashes, s.target);
    assert!(a.hint.is_none());
    match &a.decision.verdict {
        Verdict::Refuse(RefuseReason::HintUnavailable(why)) => {
            assert!(why.contains("layout fingerprint"), "{why}");
            assert!(
                why.contains(&format!("{:#x}", other.fingerprint().0))
                    && why.contains(&format!("{:#x}", s.layout.fingerprint().0)),
                "{why}"
            );
        }
        v => panic!("a record of another layout must be refused, got {v:?}"),
    }
    // The scenario's own directory still admits the same request.
    assert!(s
        .advisor(admitting_settings())
        .unwrap()
        .advise("own", &s.hashes, s.target)
        .decision
        .admitted());
}
