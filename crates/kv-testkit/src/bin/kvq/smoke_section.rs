//! Section `serving_smoke`: multi-turn conversations through real router,
//! prefill and decode engines running kv-testkit's reference model, reuse
//! OFF, ON, and ON with every fetch forced to fall back
//! (`kv_testkit::smoke::serving_smoke`). Reuse may change cost, never results.

use kv_testkit::smoke::{serving_smoke, ServingSmokeResult, SmokeOptions};

use crate::section::{Ctx, Profile, SectionResult, Stop};

/// The section body (default smoke: 3 conversations x 4 turns, TP2).
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    // The GPU profile keeps banks and fetched rows in device memory (rank r on
    // GPU r), so TP2 needs two GPUs; with one GPU it runs TP1.
    let opts = match ctx.profile {
        Profile::Gpu => {
            let gpus = crate::record::devices().len() as u32;
            if gpus == 0 {
                return Err(Stop::Error(
                    "GPU profile but nvidia-smi lists no GPU".into(),
                ));
            }
            SmokeOptions {
                gpu: true,
                tp: gpus.min(2),
                ..SmokeOptions::default()
            }
        }
        Profile::Cpu => SmokeOptions::default(),
    };
    let res = serving_smoke(&opts).map_err(|e| Stop::Error(e.to_string()))?;
    record(&res, r);
    Ok(())
}

/// Checks and metrics of one smoke result.
pub fn record(s: &ServingSmokeResult, r: &mut SectionResult) {
    r.record = Some(serde_json::json!({
        "off_computed_tokens": s.off_computed_tokens,
        "on_computed_tokens": s.on_computed_tokens,
        "on_reused_tokens": s.on_reused_tokens,
        "outputs_match": s.outputs_match,
        "fallback_outputs_match": s.fallback_outputs_match,
        "on_bytes_moved": s.on_bytes_moved,
        "on_host_payload_bytes": s.on_host_payload_bytes,
        "on_transports": s.on_transports,
        "profile": s.profile,
        "tp": s.options.tp,
    }));
    let requests = s.runs.first().map_or(0, |run| run.requests.len());
    println!(
        "serving_smoke: {requests} requests per run; computed tokens OFF {} ON {} ({} reused, {} B moved); forced fallback: {} fallbacks, {} fetches",
        s.off_computed_tokens, s.on_computed_tokens, s.on_reused_tokens, s.on_bytes_moved, s.fallback_fallbacks, s.fallback_fetches
    );
    r.check(
        "three_runs",
        s.runs.len() == 3,
        format!(
            "runs: {:?}",
            s.runs.iter().map(|x| x.mode.as_str()).collect::<Vec<_>>()
        ),
    );
    r.check(
        "on_outputs_equal_off",
        s.outputs_match,
        "outputs and first logits (bitwise) of ON vs OFF",
    );
    r.check(
        "fallback_outputs_equal_off",
        s.fallback_outputs_match,
        "outputs and first logits (bitwise) of forced fallback vs OFF",
    );
    r.check(
        "on_computes_fewer_tokens",
        s.on_computed_tokens < s.off_computed_tokens && s.on_reused_tokens > 0,
        format!(
            "OFF {} ON {} (reused {})",
            s.off_computed_tokens, s.on_computed_tokens, s.on_reused_tokens
        ),
    );
    r.check(
        "forced_fallback_never_fetches",
        s.fallback_fetches == 0 && s.fallback_fallbacks > 0,
        format!(
            "{} fallbacks, {} fetches",
            s.fallback_fallbacks, s.fallback_fetches
        ),
    );
    for (k, v) in [
        ("requests_per_run", requests as u64),
        ("off_computed_tokens", s.off_computed_tokens),
        ("on_computed_tokens", s.on_computed_tokens),
        ("on_reused_tokens", s.on_reused_tokens),
        ("on_bytes_moved", s.on_bytes_moved),
        ("fallback_fallbacks", s.fallback_fallbacks),
        ("fallback_fetches", s.fallback_fetches),
        ("tp", u64::from(s.options.tp)),
    ] {
        r.metric(k, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_smoke_passes_and_a_mismatch_fails() {
        let opts = SmokeOptions {
            conversations: 1,
            turns: 2,
            first_prompt_tokens: 40,
            new_tokens_per_turn: 8,
            output_tokens: 8,
            tp: 1,
            ..Default::default()
        };
        let mut res = serving_smoke(&opts).unwrap();
        let mut r = SectionResult::new("serving_smoke");
        record(&res, &mut r);
        assert!(r.failed_checks().next().is_none(), "{:#?}", r.checks);
        assert_eq!(r.metrics["requests_per_run"], 2);
        res.outputs_match = false;
        let mut r = SectionResult::new("serving_smoke");
        record(&res, &mut r);
        let failed: Vec<_> = r.failed_checks().map(|c| c.name.as_str()).collect();
        assert_eq!(failed, ["on_outputs_equal_off"]);
    }
}
