use crate::ols;
use crate::*;

/// Deterministic pseudo-noise in [-1, 1] (a linear congruential sequence).
fn noise(i: u64) -> f64 {
    let x = i
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        >> 11;
    (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
}

fn samples(per_block: f64, fixed: f64, amplitude: f64, n: u64) -> Vec<CalibrationSample> {
    (1..=n)
        .map(|i| {
            let blocks = 1 + (i % 40);
            CalibrationSample {
                reused_tokens: blocks * 16,
                transfer_blocks: blocks,
                measured_saving_us: per_block * blocks as f64 + fixed + amplitude * noise(i),
            }
        })
        .collect()
}

#[test]
fn ols_matches_hand_computed_textbook_example() {
    // x = 1..5, y = 2,4,5,4,5: slope 0.6, intercept 2.2, RSS 2.4, s² = 0.8,
    // se(slope) = sqrt(0.8 / 10), se(intercept) = sqrt(0.8 x (1/5 + 9/10)).
    let rows: Vec<Vec<f64>> = (1..=5).map(|x| vec![x as f64, 1.0]).collect();
    let fit = ols::fit(&rows, &[2.0, 4.0, 5.0, 4.0, 5.0], &["x", "intercept"]).unwrap();
    assert!((fit.coef[0] - 0.6).abs() < 1e-12);
    assert!((fit.coef[1] - 2.2).abs() < 1e-12);
    assert!((fit.std_err[0] - (0.08f64).sqrt()).abs() < 1e-12);
    assert!((fit.std_err[1] - (0.88f64).sqrt()).abs() < 1e-12);
    assert_eq!(fit.dof, 3);
    assert!((fit.r2 - 0.6).abs() < 1e-12, "r2 {}", fit.r2);
    let (mean, se) = fit.predict(&[3.0, 1.0]);
    assert!((mean - 4.0).abs() < 1e-12);
    assert!((se - (0.8f64 / 5.0).sqrt()).abs() < 1e-12);
}

#[test]
fn ols_refuses_rows_of_the_wrong_width_instead_of_panicking() {
    let rows = vec![vec![1.0, 1.0], vec![2.0], vec![3.0, 1.0], vec![4.0, 1.0]];
    let e = ols::fit(&rows, &[1.0, 2.0, 3.0, 4.0], &["x", "intercept"]).unwrap_err();
    assert_eq!(
        e,
        CalibrationError::Shape {
            field: "rows",
            index: Some(1),
            got: 1,
            want: 2
        }
    );
    let e = ols::fit(&rows[..1], &[1.0, 2.0], &["x", "intercept"]).unwrap_err();
    assert_eq!(
        e,
        CalibrationError::Shape {
            field: "y",
            index: None,
            got: 2,
            want: 1
        }
    );
}

#[test]
fn t_quantiles_match_tables() {
    // Standard tables, 3 decimals.
    assert!((ols::t_one_sided_95(1) - 6.314).abs() < 5e-4);
    assert!((ols::t_one_sided_95(10) - 1.812).abs() < 5e-4);
    assert!((ols::t_one_sided_95(30) - 1.697).abs() < 5e-4);
    assert!((ols::t_one_sided_95(60) - 1.671).abs() < 0.002);
    assert!((ols::t_one_sided_95(120) - 1.658).abs() < 0.002);
    assert!(ols::t_one_sided_95(0).is_infinite());
}

#[test]
fn clear_gain_enables_with_fitted_costs() {
    // Net 400 µs saved per block, 300 µs fixed overhead, ±50 µs noise.
    let s = samples(400.0, -300.0, 50.0, 60);
    let c = calibrate(&s, &ReuseSettings::default(), 16, TransferPath::Gpu).unwrap();
    assert_eq!(c.model, CalibrationModel::BlocksOnly);
    assert!((c.fit.coef[0] - 400.0).abs() < 5.0, "{}", c.report());
    assert!((c.fit.coef[1] + 300.0).abs() < 60.0, "{}", c.report());
    let CalibrationVerdict::Enable {
        minimum_blocks,
        suggested,
    } = &c.verdict
    else {
        panic!("{}", c.report())
    };
    // 400 b − 300 > 0 needs b >= 1 by the mean; the lower bound needs the same or one more.
    assert!((1..=2).contains(minimum_blocks), "{}", c.report());
    assert!(
        suggested.enable_decode_to_prefill_reuse && suggested.enable_decode_to_prefill_gpu_reuse
    );
    // Net per block = 16 x 30 − block_us: block_us is fitted to ~80 µs.
    assert!((suggested.transfer_source_gpu_estimated_block_us - 80.0).abs() < 5.0);
    assert_eq!(suggested.minimum_transfer_prefix_blocks, 4);
    CostModel::new((**suggested).clone(), 16).unwrap();
}

#[test]
fn no_gain_or_noise_keeps_reuse_off() {
    for (per_block, fixed, amp) in [(-10.0, 0.0, 5.0), (0.0, 0.0, 500.0), (2.0, -5_000.0, 10.0)] {
        let s = samples(per_block, fixed, amp, 40);
        let c = calibrate(&s, &ReuseSettings::default(), 16, TransferPath::Host).unwrap();
        assert!(
            !c.enables(),
            "per_block {per_block} fixed {fixed}: {}",
            c.report()
        );
        assert!(c.report().contains("KEEP OFF"));
        assert!(c.at_max_blocks.1 <= 0.0);
    }
}

#[test]
fn small_gain_enables_only_above_break_even() {
    // 100 µs per block minus 2 ms fixed: break-even at 20 blocks.
    let s = samples(100.0, -2_000.0, 20.0, 80);
    let c = calibrate(&s, &ReuseSettings::default(), 16, TransferPath::Host).unwrap();
    let CalibrationVerdict::Enable {
        minimum_blocks,
        suggested,
    } = &c.verdict
    else {
        panic!("{}", c.report())
    };
    assert!((21..=23).contains(minimum_blocks), "{}", c.report());
    assert_eq!(
        u64::from(suggested.minimum_transfer_prefix_blocks),
        *minimum_blocks
    );
    assert!(!suggested.enable_decode_to_prefill_gpu_reuse);
}

#[test]
fn independent_tokens_and_blocks_recover_both_costs() {
    // Samples where part of the prefix was already on the target: tokens vary apart from blocks.
    let s: Vec<CalibrationSample> = (0..30u64)
        .map(|i| {
            let blocks = 2 + i % 7;
            let tokens = 16 * (blocks + i % 5);
            CalibrationSample {
                reused_tokens: tokens,
                transfer_blocks: blocks,
                measured_saving_us: 35.0 * tokens as f64 - 60.0 * blocks as f64 - 100.0,
            }
        })
        .collect();
    let c = calibrate(&s, &ReuseSettings::default(), 16, TransferPath::Gpu).unwrap();
    assert_eq!(c.model, CalibrationModel::TokensAndBlocks);
    assert!((c.fit.coef[0] - 35.0).abs() < 1e-6);
    assert!((c.fit.coef[1] + 60.0).abs() < 1e-6);
    assert!((c.fit.coef[2] + 100.0).abs() < 1e-6);
    let CalibrationVerdict::Enable { suggested, .. } = &c.verdict else {
        panic!("{}", c.report())
    };
    assert!((suggested.transfer_source_prefill_token_us - 35.0).abs() < 1e-6);
    assert!((suggested.transfer_source_gpu_estimated_block_us - 60.0).abs() < 1e-6);
}

#[test]
fn bad_inputs_are_errors() {
    let e = calibrate(
        &samples(1.0, 0.0, 1.0, 3),
        &ReuseSettings::default(),
        16,
        TransferPath::Gpu,
    )
    .unwrap_err();
    assert_eq!(e, CalibrationError::TooFewSamples { got: 3, need: 4 });
    let same: Vec<CalibrationSample> = (0..10)
        .map(|i| CalibrationSample {
            reused_tokens: 64,
            transfer_blocks: 4,
            measured_saving_us: 100.0 + i as f64,
        })
        .collect();
    let e = calibrate(&same, &ReuseSettings::default(), 16, TransferPath::Gpu).unwrap_err();
    assert_eq!(
        e,
        CalibrationError::Singular {
            column: "intercept"
        }
    );
    let mut s = samples(1.0, 0.0, 1.0, 10);
    s[3].measured_saving_us = f64::NAN;
    let e = calibrate(&s, &ReuseSettings::default(), 16, TransferPath::Gpu).unwrap_err();
    assert!(matches!(e, CalibrationError::BadSample { index: 3, .. }));
}
