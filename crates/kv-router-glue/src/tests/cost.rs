use proptest::prelude::*;

use crate::*;

fn on() -> ReuseSettings {
    ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        enable_decode_to_prefill_gpu_reuse: true,
        minimum_estimated_ttft_saving_ms: 2.0,
        minimum_transfer_prefix_blocks: 4,
        transfer_source_estimated_block_us: 400.0,
        transfer_source_gpu_estimated_block_us: 25.0,
        transfer_source_lookup_budget_ms: 1.0,
        transfer_source_prefill_token_us: 30.0,
    }
}

fn inputs(blocks: u64, path: TransferPath, lookup_us: f64) -> CostInputs {
    CostInputs {
        reused_tokens: blocks * 16,
        transfer_blocks: blocks,
        path,
        lookup_us,
    }
}

#[test]
fn terms_follow_the_formula() {
    let m = CostModel::new(on(), 16).unwrap();
    let t = m.estimate(inputs(10, TransferPath::Host, 150.0));
    assert_eq!(t.reused_tokens, 160);
    assert_eq!(t.recompute_saved_us, 4800.0);
    assert_eq!(t.block_us, 400.0);
    assert_eq!(t.transfer_cost_us, 4000.0);
    assert_eq!(t.lookup_us, 150.0);
    assert_eq!(t.saving_us, 650.0);
    assert_eq!(t.minimum_saving_us, 2000.0);
    assert_eq!(t.minimum_blocks, 4);
    let g = m.estimate(inputs(10, TransferPath::Gpu, 150.0));
    assert_eq!(g.block_us, 25.0);
    assert_eq!(g.saving_us, 4800.0 - 250.0 - 150.0);
}

#[test]
fn each_refusal_reason_and_the_exact_boundary() {
    let m = CostModel::new(on(), 16).unwrap();
    // Host: 10 blocks saves 650 µs < 2000 µs.
    assert_eq!(
        m.admit("a", inputs(10, TransferPath::Host, 150.0)).verdict,
        Verdict::Refuse(RefuseReason::SavingBelowMinimum)
    );
    assert_eq!(
        m.admit("b", inputs(3, TransferPath::Gpu, 0.0)).verdict,
        Verdict::Refuse(RefuseReason::TooFewBlocks)
    );
    // GPU: 4 blocks x (480 − 25) = 1820 µs; with minimum 1.82 ms it is admitted exactly at the boundary.
    let mut s = on();
    s.minimum_estimated_ttft_saving_ms = 1.82;
    let m2 = CostModel::new(s.clone(), 16).unwrap();
    let d = m2.admit("c", inputs(4, TransferPath::Gpu, 0.0));
    assert_eq!(d.terms.unwrap().saving_us, 1820.0);
    assert!(d.admitted(), "{d}");
    s.minimum_estimated_ttft_saving_ms = 1.821;
    let m3 = CostModel::new(s.clone(), 16).unwrap();
    assert!(!m3.admit("d", inputs(4, TransferPath::Gpu, 0.0)).admitted());
    // GPU path off: the same GPU fetch is refused for that reason, host still priced.
    s.enable_decode_to_prefill_gpu_reuse = false;
    let m4 = CostModel::new(s, 16).unwrap();
    assert_eq!(
        m4.admit("e", inputs(100, TransferPath::Gpu, 0.0)).verdict,
        Verdict::Refuse(RefuseReason::GpuPathDisabled)
    );
    assert!(m4
        .admit("f", inputs(100, TransferPath::Host, 0.0))
        .admitted());
}

#[test]
fn retune_refuses_settings_the_model_cannot_use_and_keeps_the_old_one() {
    let live = LiveCostModel::new(CostModel::new(on(), 16).unwrap());
    let mut bad = on();
    bad.transfer_source_gpu_estimated_block_us = 480.0; // = 16 tokens x 30 µs: can never save
    let e = live.retune(bad).unwrap_err();
    // No internal jargon ("retune") in what an operator reads.
    assert!(
        e.to_string()
            .starts_with("unusable setting `transfer_source_gpu_estimated_block_us` = 480 µs"),
        "{e}"
    );
    assert!(
        matches!(
            e,
            SettingsError::Unusable {
                key: "transfer_source_gpu_estimated_block_us",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        live.current()
            .settings()
            .transfer_source_gpu_estimated_block_us,
        25.0
    );
    let mut out_of_range = on();
    out_of_range.minimum_transfer_prefix_blocks = 0;
    assert!(matches!(
        live.retune(out_of_range),
        Err(SettingsError::OutOfRange { .. })
    ));
    // The same costs are fine while the GPU path is off (the model never uses them).
    let mut gpu_off = on();
    gpu_off.enable_decode_to_prefill_gpu_reuse = false;
    gpu_off.transfer_source_gpu_estimated_block_us = 480.0;
    live.retune(gpu_off).unwrap();
    assert!(!live.current().settings().enable_decode_to_prefill_gpu_reuse);
    let mut good = on();
    good.transfer_source_prefill_token_us = 40.0;
    live.retune(good).unwrap();
    assert_eq!(
        live.current().settings().transfer_source_prefill_token_us,
        40.0
    );
    assert_eq!(live.current().tokens_per_block(), Some(16));
}

#[test]
fn zero_tokens_per_block_is_refused_naming_the_argument() {
    let e = CostModel::new(on(), 0).unwrap_err();
    assert_eq!(
        e,
        SettingsError::InvalidArgument {
            argument: "tokens_per_block",
            reason: "0, must be at least 1".into(),
        }
    );
    // The text reaches operators (router binary, Python `Router(settings, 0)`).
    assert_eq!(
        e.to_string(),
        "invalid `tokens_per_block`: 0, must be at least 1"
    );
}

#[test]
fn decision_log_keeps_recent_decisions_and_totals() {
    let m = CostModel::new(on(), 16).unwrap();
    let log = DecisionLog::new(2);
    for (i, blocks) in [100u64, 1, 100, 2].iter().enumerate() {
        log.record(&m.admit(&format!("r{i}"), inputs(*blocks, TransferPath::Gpu, 0.0)));
    }
    log.record(&AdmissionDecision {
        request_id: "r4".into(),
        terms: None,
        verdict: Verdict::Refuse(RefuseReason::NoDonor("no holder".into())),
    });
    assert_eq!(log.admitted(), 2);
    let refused = log.refused();
    assert_eq!(refused["too few blocks"], 2);
    assert_eq!(refused["no donor"], 1);
    let recent: Vec<String> = log.recent().into_iter().map(|d| d.request_id).collect();
    assert_eq!(recent, ["r3", "r4"]);
    let line = m
        .admit("x", inputs(100, TransferPath::Gpu, 10.0))
        .to_string();
    assert!(
        line.starts_with("x: ADMIT: Gpu: 1600 tok x 30.00 µs = 48000.0 µs"),
        "{line}"
    );
}

proptest! {
    /// Admission agrees with the formula and thresholds for any inputs.
    #[test]
    fn admission_matches_formula(blocks in 0u64..10_000, lookup in 0.0..5_000.0f64, gpu in any::<bool>()) {
        let m = CostModel::new(on(), 16).unwrap();
        let path = if gpu { TransferPath::Gpu } else { TransferPath::Host };
        let d = m.admit("p", inputs(blocks, path, lookup));
        let block_us = if gpu { 25.0 } else { 400.0 };
        let saving = (blocks * 16) as f64 * 30.0 - blocks as f64 * block_us - lookup;
        let t = d.terms.unwrap();
        prop_assert!((t.saving_us - saving).abs() < 1e-6);
        prop_assert_eq!(d.admitted(), blocks >= 4 && saving >= 2000.0);
    }
}
