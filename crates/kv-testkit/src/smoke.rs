//! Serving smoke: multi-turn conversations through router, prefill and decode
//! engines ([`crate::engines`]) running the reference model, three times:
//! reuse OFF, ON, and ON with every fetch forced to fall back.
//!
//! Each turn's prompt is the previous prompt + the previous output + new
//! text, and the prefill engine's native cache is cleared before every
//! request, so ON can only reuse what the decode engine retained. The
//! outputs of all three runs must be equal token for token (and the first
//! logits bit for bit): reuse may change cost, never results.
//!
//! Forced fallback cycles through three faults: the donor is unreachable
//! (liveness probe dead), the delivery is cancelled, and the donor is killed
//! (its bank closed, a new incarnation registered) between advice and fetch.
//!
//! Each run's engines record into one [`ReuseMetrics`] per run
//! ([`SmokeMetrics`], [`serving_smoke_observed`]); [`scrape_metrics`] reads a
//! `/metrics` endpoint back with a plain HTTP GET and [`ScrapedCounters`]
//! picks out the counters the smoke also counts itself.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use kv_bank::BankManager;
use kv_descriptor::{EngineId, Role};
use kv_router_glue::metrics::ReuseMetrics;
use kv_router_glue::ReuseSettings;
use serde::{Deserialize, Serialize};

use crate::engines::{DecodeEngine, EngineError, FetchFault, MemoryProfile, PrefillEngine, Router};
use crate::model::{ModelConfig, ReferenceModel};
use crate::trace::splitmix64;

/// Options of [`serving_smoke`]. Lengths in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SmokeOptions {
    /// Conversations, interleaved turn by turn (default 3).
    pub conversations: u32,
    /// Turns per conversation (default 4).
    pub turns: u32,
    /// First prompt length (default 100).
    pub first_prompt_tokens: u32,
    /// New text per later turn (default 40).
    pub new_tokens_per_turn: u32,
    /// Output tokens per turn (default 24).
    pub output_tokens: u32,
    /// TP size of prefill and decode (default 2: every fetch is two parts).
    pub tp: u32,
    /// Reference model (default [`ModelConfig::default`]).
    pub model: ModelConfig,
    /// Seed of the conversation text (default 11).
    pub seed: u64,
    /// Banks and fetch rows in CUDA memory (rank `r` on GPU `r`) instead of
    /// host shared memory (default false). Needs `tp` GPUs.
    #[serde(default)]
    pub gpu: bool,
}

impl Default for SmokeOptions {
    fn default() -> Self {
        Self {
            conversations: 3,
            turns: 4,
            first_prompt_tokens: 100,
            new_tokens_per_turn: 40,
            output_tokens: 24,
            tp: 2,
            model: ModelConfig::default(),
            seed: 11,
            gpu: false,
        }
    }
}

/// Why the smoke could not run (a fallback is not an error).
#[derive(Debug, thiserror::Error)]
pub enum SmokeError {
    /// An option is out of range.
    #[error("invalid smoke option `{field}`: {reason}")]
    Option {
        /// Offending field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One request of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SmokeRequest {
    /// Conversation index.
    pub conversation: u32,
    /// Turn index (0 = first).
    pub turn: u32,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens computed by prefill.
    pub computed_tokens: u64,
    /// Prompt tokens not computed (native cache + fetched).
    pub reused_tokens: u64,
    /// Of those, fetched from the decode donor.
    pub fetched_tokens: u64,
    /// Bytes the fetch delivered.
    pub bytes_moved: u64,
    /// Output tokens generated.
    pub output_tokens: u64,
    /// The output.
    pub output: Vec<u32>,
    /// Bits of the first logits (for bit-exact comparison across runs).
    pub first_logits_bits: Vec<u32>,
    /// Admission verdict of the router (`admit` or the refusal).
    pub advice: String,
    /// Fallback reason when a hint was given but not used.
    pub fallback: Option<String>,
    /// `backend/transport` that moved the fetched bytes, when a fetch completed.
    pub transport: Option<String>,
}

/// One run (`off`, `on`, `fallback`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SmokeRun {
    /// Run name.
    pub mode: String,
    /// Requests in serving order.
    pub requests: Vec<SmokeRequest>,
    /// Sum of computed tokens.
    pub computed_tokens: u64,
    /// Sum of reused tokens.
    pub reused_tokens: u64,
    /// Sum of bytes moved.
    pub bytes_moved: u64,
    /// Requests whose fetch completed.
    pub fetches: u64,
    /// Requests whose hint fell back.
    pub fallbacks: u64,
    /// Sum of host payload bytes of the fetches.
    pub host_payload_bytes: u64,
    /// Bytes of ready blocks in the (current) decode bank at the end of the
    /// run, per rank.
    #[serde(default)]
    pub retained_bytes_per_rank: u64,
}

/// The metric registries of the three runs: each run's router, prefill and
/// decode engines record into its own.
#[derive(Debug, Clone, Default)]
pub struct SmokeMetrics {
    /// Reuse OFF.
    pub off: Arc<ReuseMetrics>,
    /// Reuse ON.
    pub on: Arc<ReuseMetrics>,
    /// Forced fallback.
    pub fallback: Arc<ReuseMetrics>,
}

/// `record.json` section `serving_smoke`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServingSmokeResult {
    /// Prompt tokens computed with reuse OFF.
    pub off_computed_tokens: u64,
    /// Prompt tokens computed with reuse ON.
    pub on_computed_tokens: u64,
    /// Prompt tokens reused with reuse ON.
    pub on_reused_tokens: u64,
    /// ON outputs (and first logits, bitwise) equal OFF's.
    pub outputs_match: bool,
    /// Forced-fallback outputs (and first logits) equal OFF's.
    pub fallback_outputs_match: bool,
    /// Bytes moved with reuse ON.
    pub on_bytes_moved: u64,
    /// Fallbacks in the forced-fallback run (every hinted request should fall back).
    pub fallback_fallbacks: u64,
    /// Fetches completed in the forced-fallback run (should be 0).
    pub fallback_fetches: u64,
    /// Bytes that crossed host memory as payload in ON fetches (0 on the
    /// GPU profile: the host carries control only).
    pub on_host_payload_bytes: u64,
    /// `host` or `cuda`.
    pub profile: String,
    /// Distinct `backend/transport` values of the ON fetches.
    pub on_transports: Vec<String>,
    /// Options used.
    pub options: SmokeOptions,
    /// The three runs, request by request.
    pub runs: Vec<SmokeRun>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
    Fallback,
}

fn text_token(seed: u64, conversation: u32, turn: u32, pos: u32, vocab: u32) -> u32 {
    let key = splitmix64(seed ^ (u64::from(conversation) << 40) ^ (u64::from(turn) << 20));
    (splitmix64(key ^ u64::from(pos)) % u64::from(vocab)) as u32
}

fn run_mode(
    o: &SmokeOptions,
    mode: Mode,
    profile: &MemoryProfile,
    metrics: &Arc<ReuseMetrics>,
) -> Result<SmokeRun, SmokeError> {
    let model = Arc::new(ReferenceModel::new(o.model).map_err(EngineError::from)?);
    let bs = o.model.tokens_per_block;
    let settings = match mode {
        Mode::Off => ReuseSettings::default(),
        Mode::On | Mode::Fallback => ReuseSettings {
            enable_decode_to_prefill_reuse: true,
            minimum_estimated_ttft_saving_ms: 0.0,
            minimum_transfer_prefix_blocks: 1,
            enable_decode_to_prefill_gpu_reuse: o.gpu,
            ..ReuseSettings::default()
        },
    };
    let mut router = Router::with_metrics(settings, bs, metrics.clone())?;
    let max_blocks =
        (o.first_prompt_tokens + o.turns * (o.new_tokens_per_turn + o.output_tokens)) / bs + 2;
    let mut prefill = PrefillEngine::with_metrics(
        model.clone(),
        o.tp,
        4 * max_blocks as usize,
        max_blocks,
        profile,
        metrics.clone(),
    )?;
    let layout = *prefill.layout();
    let budget =
        u64::from(o.conversations) * u64::from(max_blocks) * layout.block_bytes() as u64 * 2;
    let mut decode = DecodeEngine::with_metrics(
        model.clone(),
        o.tp,
        budget,
        "testkit-smoke",
        profile,
        metrics.clone(),
    )?;
    router.register(prefill.engine_id(), Role::Prefill, &layout, None)?;
    let decode_key = router.register(decode.engine_id(), Role::Decode, &layout, None)?;
    router.add_donor(decode.bank().clone());
    let mut banks: HashMap<EngineId, Arc<BankManager>> = HashMap::new();
    banks.insert(decode.engine_id(), decode.bank().clone());

    let mut history: Vec<Vec<u32>> = vec![Vec::new(); o.conversations as usize];
    let mut run = SmokeRun {
        mode: match mode {
            Mode::Off => "off",
            Mode::On => "on",
            Mode::Fallback => "fallback",
        }
        .into(),
        requests: Vec::new(),
        computed_tokens: 0,
        reused_tokens: 0,
        bytes_moved: 0,
        fetches: 0,
        fallbacks: 0,
        host_payload_bytes: 0,
        retained_bytes_per_rank: 0,
    };
    let mut faults = 0u32;
    for turn in 0..o.turns {
        for c in 0..o.conversations {
            let new = if turn == 0 {
                o.first_prompt_tokens
            } else {
                o.new_tokens_per_turn
            };
            let mut prompt = history[c as usize].clone();
            prompt.extend((0..new).map(|p| text_token(o.seed, c, turn, p, o.model.vocab)));
            let cleared = prefill.clear_native();
            router.apply(&[cleared])?;
            let advice = router.advise(
                &format!("c{c}t{turn}"),
                &prompt,
                prefill.engine_id(),
                bs as usize,
            );
            let verdict = if advice.decision.admitted() {
                "admit".to_string()
            } else {
                format!("{:?}", advice.decision.verdict)
            };
            let mut fault = FetchFault::None;
            let hint = advice.hint.as_ref().map(|env| {
                let donor = env
                    .fetch_gpu_actions()
                    .ok()
                    .and_then(|h| h.first().map(|h| h.donor_engine_id))
                    .and_then(|id| banks.get(&id).cloned());
                (env, donor)
            });
            if mode == Mode::Fallback && hint.is_some() {
                faults += 1;
                match faults % 3 {
                    1 => fault = FetchFault::DonorBlocked,
                    2 => fault = FetchFault::Cancelled,
                    _ => {
                        // Donor killed between advice and fetch; it restarts empty.
                        let events = decode.kill_and_restart()?;
                        router.apply(&events)?;
                        router.register(
                            decode.engine_id(),
                            Role::Decode,
                            &layout,
                            Some(decode_key),
                        )?;
                        router.add_donor(decode.bank().clone());
                        banks.insert(decode.engine_id(), decode.bank().clone());
                    }
                }
            }
            let hint_ref = match &hint {
                Some((env, Some(bank))) => Some((*env, bank.as_ref())),
                _ => None,
            };
            let (out, cache, events) = prefill.prefill(&prompt, hint_ref, fault)?;
            router.apply(&events)?;
            let fallback = match (&hint, &out.fallback) {
                (Some((_, None)), _) => Some("hint names an unknown donor".to_string()),
                (_, f) => f.clone(),
            };
            let (output, events) =
                decode.decode(cache, &prompt, out.first_token, o.output_tokens as usize)?;
            router.apply(&events)?;
            let req = SmokeRequest {
                conversation: c,
                turn,
                prompt_tokens: prompt.len() as u64,
                computed_tokens: out.computed_tokens,
                reused_tokens: out.native_tokens + out.fetched_tokens,
                fetched_tokens: out.fetched_tokens,
                bytes_moved: out.bytes_moved,
                output_tokens: output.len() as u64,
                output: output.clone(),
                first_logits_bits: out.first_logits.iter().map(|f| f.to_bits()).collect(),
                advice: verdict,
                fallback: fallback.clone(),
                transport: out.transport.clone(),
            };
            run.computed_tokens += req.computed_tokens;
            run.reused_tokens += req.reused_tokens;
            run.bytes_moved += req.bytes_moved;
            run.host_payload_bytes += out.host_payload_bytes;
            run.fetches += u64::from(req.fetched_tokens > 0);
            run.fallbacks += u64::from(fallback.is_some());
            run.requests.push(req);
            prompt.extend(&output);
            history[c as usize] = prompt;
        }
    }
    let inv = decode.bank().inventory();
    run.retained_bytes_per_rank = inv.ready.len() as u64 * inv.slot_bytes;
    Ok(run)
}

fn same_outputs(a: &SmokeRun, b: &SmokeRun) -> bool {
    a.requests.len() == b.requests.len()
        && a.requests
            .iter()
            .zip(&b.requests)
            .all(|(x, y)| x.output == y.output && x.first_logits_bits == y.first_logits_bits)
}

/// Runs the smoke OFF, ON and forced-fallback.
///
/// # Errors
/// [`SmokeError::Option`] naming the field (zero conversations, turns, or
/// lengths; prompts beyond the vocabulary are impossible by construction);
/// [`SmokeError::Engine`] when an engine fails outside the fetch path.
///
/// ```
/// use kv_testkit::smoke::{serving_smoke, SmokeOptions};
/// let r = serving_smoke(&SmokeOptions { conversations: 1, turns: 2, first_prompt_tokens: 40,
///     new_tokens_per_turn: 8, output_tokens: 8, tp: 1, ..Default::default() }).unwrap();
/// assert!(r.outputs_match && r.fallback_outputs_match);
/// assert!(r.on_computed_tokens < r.off_computed_tokens);
/// ```
pub fn serving_smoke(opts: &SmokeOptions) -> Result<ServingSmokeResult, SmokeError> {
    serving_smoke_observed(opts, &SmokeMetrics::default())
}

/// [`serving_smoke`] with each run's engines recording into `metrics`
/// (decisions, lookups, fetches, fallbacks, bytes, retained bytes).
///
/// # Errors
/// Those of [`serving_smoke`].
pub fn serving_smoke_observed(
    opts: &SmokeOptions,
    metrics: &SmokeMetrics,
) -> Result<ServingSmokeResult, SmokeError> {
    for (field, v) in [
        ("conversations", opts.conversations),
        ("turns", opts.turns),
        ("first_prompt_tokens", opts.first_prompt_tokens),
        ("new_tokens_per_turn", opts.new_tokens_per_turn),
        ("output_tokens", opts.output_tokens),
        ("tp", opts.tp),
    ] {
        if v == 0 {
            return Err(SmokeError::Option {
                field,
                reason: "must be at least 1".into(),
            });
        }
    }
    let profile = if opts.gpu {
        let found = kv_transfer::cuda::device_count();
        if found < opts.tp as usize {
            return Err(SmokeError::Option {
                field: "gpu",
                reason: format!(
                    "needs {} CUDA devices (one per TP rank), found {found}",
                    opts.tp
                ),
            });
        }
        MemoryProfile::Cuda {
            ordinals: (0..opts.tp).collect(),
        }
    } else {
        MemoryProfile::Host
    };
    let off = run_mode(opts, Mode::Off, &profile, &metrics.off)?;
    let on = run_mode(opts, Mode::On, &profile, &metrics.on)?;
    let fb = run_mode(opts, Mode::Fallback, &profile, &metrics.fallback)?;
    Ok(ServingSmokeResult {
        off_computed_tokens: off.computed_tokens,
        on_computed_tokens: on.computed_tokens,
        on_reused_tokens: on.reused_tokens,
        outputs_match: same_outputs(&off, &on),
        fallback_outputs_match: same_outputs(&off, &fb),
        on_bytes_moved: on.bytes_moved,
        fallback_fallbacks: fb.fallbacks,
        fallback_fetches: fb.fetches,
        on_host_payload_bytes: on.host_payload_bytes,
        profile: if opts.gpu { "cuda" } else { "host" }.into(),
        on_transports: on
            .requests
            .iter()
            .filter_map(|q| q.transport.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect(),
        options: *opts,
        runs: vec![off, on, fb],
    })
}

/// `GET /metrics` from `addr` over a plain TCP connection; returns the body.
///
/// # Errors
/// I/O errors (connect, write, read; 5 s timeouts), or `InvalidData` when
/// the response is not `200 OK` or has no header/body separator.
pub fn scrape_metrics(addr: SocketAddr) -> std::io::Result<String> {
    let timeout = Duration::from_secs(5);
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad(format!("no end of headers in {resp:?}")))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(bad(format!(
            "status: {}",
            head.lines().next().unwrap_or("")
        )));
    }
    Ok(body.to_owned())
}

/// The value of the exposition line of exactly `series` (name and labels as
/// encoded, e.g. `kv_reuse_fetches_total{outcome="completed"}`), if present.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The counters of one scrape that the smoke counts itself. A labelled
/// series never incremented is absent from the exposition and reads 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScrapedCounters {
    /// `kv_reuse_fetches_total{outcome="completed"}`.
    pub fetches_completed: u64,
    /// `kv_reuse_fetches_total{outcome="fallback"}`.
    pub fetches_fallback: u64,
    /// Sum of `kv_reuse_fallbacks_total` over every reason.
    pub fallbacks: u64,
    /// `kv_reuse_fetched_bytes_total`.
    pub fetched_bytes: u64,
    /// `kv_reuse_host_payload_bytes_total`.
    pub host_payload_bytes: u64,
    /// `kv_reuse_decisions_total{verdict="admit"}`.
    pub admitted: u64,
    /// `kv_reuse_retained_bytes{engine=..,rank=..}` by `engine/rank` (`engine` as labelled).
    pub retained_bytes: std::collections::BTreeMap<String, u64>,
}

impl ScrapedCounters {
    /// Parses an exposition (OpenMetrics text).
    pub fn parse(text: &str) -> Self {
        let get = |series: &str| metric_sample(text, series).unwrap_or(0.0) as u64;
        let fallbacks = text
            .lines()
            .filter(|l| l.starts_with("kv_reuse_fallbacks_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64;
        let retained_bytes = text
            .lines()
            .filter_map(|l| l.strip_prefix("kv_reuse_retained_bytes{"))
            .filter_map(|l| {
                let (labels, value) = l.split_once("} ")?;
                let field = |k: &str| {
                    labels
                        .split(',')
                        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix("=\""))
                        .map(|v| v.trim_end_matches('"').to_owned())
                };
                Some((
                    format!("{}/{}", field("engine")?, field("rank")?),
                    value.trim().parse::<f64>().ok()? as u64,
                ))
            })
            .collect();
        Self {
            fetches_completed: get(r#"kv_reuse_fetches_total{outcome="completed"}"#),
            fetches_fallback: get(r#"kv_reuse_fetches_total{outcome="fallback"}"#),
            fallbacks,
            fetched_bytes: get("kv_reuse_fetched_bytes_total"),
            host_payload_bytes: get("kv_reuse_host_payload_bytes_total"),
            admitted: get(r#"kv_reuse_decisions_total{verdict="admit"}"#),
            retained_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(tp: u32) -> SmokeOptions {
        SmokeOptions {
            conversations: 2,
            turns: 3,
            first_prompt_tokens: 50,
            new_tokens_per_turn: 20,
            output_tokens: 12,
            tp,
            ..SmokeOptions::default()
        }
    }

    #[test]
    fn on_reuses_decode_kv_and_all_runs_agree_tp1_and_tp2() {
        for tp in [1, 2] {
            let r = serving_smoke(&small(tp)).unwrap();
            let [off, on, fb] = [&r.runs[0], &r.runs[1], &r.runs[2]];
            assert!(r.outputs_match, "tp{tp}");
            assert!(r.fallback_outputs_match, "tp{tp}");
            // OFF clears the native cache before every request: computes every prompt token.
            let prompts: u64 = off.requests.iter().map(|q| q.prompt_tokens).sum();
            assert_eq!(off.computed_tokens, prompts);
            assert_eq!(off.reused_tokens, 0);
            // ON: every later turn fetches the whole sealed conversation so far.
            for q in on.requests.iter().filter(|q| q.turn > 0) {
                let before = q.prompt_tokens - 20; // previous prompt + output
                assert_eq!(q.fetched_tokens, before / 16 * 16, "tp{tp} {q:?}");
                assert_eq!(q.computed_tokens, q.prompt_tokens - q.fetched_tokens);
                // Bytes: 2 (K,V) x 3 layers x 2 KV heads x 16 dims x 4 bytes per token.
                assert_eq!(q.bytes_moved, q.fetched_tokens * 2 * 3 * 2 * 16 * 4);
                assert!(q.fallback.is_none());
                assert!(
                    q.transport
                        .as_deref()
                        .is_some_and(|t| t.starts_with("host")),
                    "{:?}",
                    q.transport
                );
            }
            assert!(r.on_computed_tokens < r.off_computed_tokens);
            assert_eq!(
                r.on_computed_tokens + r.on_reused_tokens,
                r.off_computed_tokens
            );
            // Forced fallback: every hinted request fell back and computed everything.
            // Faults cycle blocked, cancelled, killed; after the kill the
            // restarted donor holds nothing, so later requests get no hint.
            assert_eq!(fb.fetches, 0);
            let hinted: Vec<_> = fb.requests.iter().filter(|q| q.advice == "admit").collect();
            assert_eq!(hinted.len(), 3, "tp{tp}");
            assert!(hinted.iter().all(|q| q.fallback.is_some()), "tp{tp}");
            assert_eq!(fb.fallbacks, 3);
            assert_eq!(fb.computed_tokens, off.computed_tokens);
        }
    }

    /// GPU profile: runs where CUDA devices exist, skips with a reason elsewhere.
    #[test]
    fn gpu_profile_moves_model_kv_device_to_device() {
        let n = kv_transfer::cuda::device_count();
        if n == 0 {
            println!("SKIP gpu_profile_moves_model_kv_device_to_device: no CUDA driver or device");
            return;
        }
        let r = serving_smoke(&SmokeOptions {
            gpu: true,
            ..small(1)
        })
        .unwrap();
        println!(
            "gpu smoke: computed OFF {} ON {}, bytes {}, host payload {}",
            r.off_computed_tokens, r.on_computed_tokens, r.on_bytes_moved, r.on_host_payload_bytes
        );
        assert!(r.outputs_match && r.fallback_outputs_match);
        assert!(r.on_computed_tokens < r.off_computed_tokens);
        assert!(r.on_bytes_moved > 0);
        assert_eq!(r.on_host_payload_bytes, 0);
    }

    #[test]
    fn zero_options_are_refused() {
        let e = serving_smoke(&SmokeOptions {
            turns: 0,
            ..small(1)
        })
        .unwrap_err();
        assert!(e.to_string().contains("`turns`"), "{e}");
    }
}
