//! Multi-turn session workload: conversations whose next turn is the previous
//! prompt + the previous output + new text, with lengths drawn from the
//! Mooncake trace.
//!
//! The Mooncake trace has no session ids and covers prompts only, so it cannot
//! show reuse of K/V that decode *generated*. This generator makes that reuse
//! explicit: turn `k + 1` of a session starts with every token of turn `k`'s
//! prompt and output, which only the decode worker that served turn `k` holds.
//!
//! Length distributions (empirical, resampled uniformly with replacement):
//! - **first-turn prompt**: `input_length` of trace requests that share at most
//!   one 512-token block with any earlier request (fresh conversations; the
//!   first block is a system prompt shared by almost all requests);
//! - **follow-up new text**: for trace requests sharing at least two blocks
//!   with an earlier request, `input_length − 512 x shared blocks` (the part a
//!   real follow-up adds; 4,540 requests, median 846, mean 3,327 tokens);
//! - **output**: `output_length` of all trace requests.
//!
//! Arrivals: sessions start as a Poisson process; each later turn arrives an
//! exponential think time after the previous turn's last output token.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::replay::{block_chain, ReplayRequest, Workload};
use crate::trace::{splitmix64, MooncakeTrace, TRACE_BLOCK_TOKENS};

/// Generator parameters. All printed by [`SessionParams::describe`].
///
/// ```
/// use kv_testkit::sessions::SessionParams;
/// let p = SessionParams::default();
/// assert!(p.describe().contains("sessions = 400"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SessionParams {
    /// Number of sessions (default 400).
    pub sessions: u32,
    /// Fewest turns per session (default 2).
    pub min_turns: u32,
    /// Most turns per session (default 6); turns are uniform in `min..=max`.
    pub max_turns: u32,
    /// Mean think time between a turn's last output token and the next
    /// turn's arrival, s, exponential (default 20).
    pub think_time_mean_s: f64,
    /// Session start rate, sessions per second, Poisson (default 0.5, so
    /// 400 sessions start over ~13 minutes).
    pub session_rate_per_s: f64,
    /// A session ends early when the next turn (prompt + output) would exceed
    /// this many tokens; a first turn is clamped to half of it (prompt) and
    /// the rest (output). Default 131,072: Llama-3.1's context.
    pub max_context_tokens: u32,
    /// Tokens per KV block used to hash the requests (default 16).
    pub tokens_per_block: u32,
    /// RNG seed (ChaCha8) for lengths, turns and times (default 2026).
    pub seed: u64,
}

impl Default for SessionParams {
    fn default() -> Self {
        Self {
            sessions: 400,
            min_turns: 2,
            max_turns: 6,
            think_time_mean_s: 20.0,
            session_rate_per_s: 0.5,
            max_context_tokens: 131_072,
            tokens_per_block: 16,
            seed: 2026,
        }
    }
}

impl SessionParams {
    /// One `name = value  # meaning` line per parameter.
    pub fn describe(&self) -> String {
        format!(
            "sessions = {}  # conversations\n\
             turns = {}..={}  # per session, uniform\n\
             think_time_mean_s = {}  # exponential, after the previous turn's last token\n\
             session_rate_per_s = {}  # Poisson session starts\n\
             max_context_tokens = {}  # a session ends before exceeding it\n\
             tokens_per_block = {}\n\
             seed = {}\n\
             lengths = Mooncake trace: first prompt of fresh requests, follow-up increment of \
             requests sharing >= 2 blocks, output of all requests",
            self.sessions,
            self.min_turns,
            self.max_turns,
            self.think_time_mean_s,
            self.session_rate_per_s,
            self.max_context_tokens,
            self.tokens_per_block,
            self.seed
        )
    }
}

/// Why a session workload could not be generated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    /// A parameter is out of range.
    #[error("invalid session parameter `{field}`: {reason}")]
    Param {
        /// Offending field of [`SessionParams`].
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The trace yields no sample for a distribution.
    #[error("trace has no sample for the `{what}` distribution")]
    EmptyDistribution {
        /// `first_prompt`, `followup_new` or `output`.
        what: &'static str,
    },
}

/// Empirical length distributions drawn from a trace (tokens).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LengthDistributions {
    /// First-turn prompt lengths.
    pub first_prompt: Vec<u32>,
    /// New tokens a follow-up turn adds.
    pub followup_new: Vec<u32>,
    /// Output lengths.
    pub output: Vec<u32>,
}

impl LengthDistributions {
    /// Derives the three distributions from `trace` (see the module doc).
    ///
    /// # Errors
    /// [`SessionError::EmptyDistribution`] when one comes out empty.
    pub fn from_trace(trace: &MooncakeTrace) -> Result<Self, SessionError> {
        let mut seen = std::collections::HashSet::new();
        let mut d = Self {
            first_prompt: Vec::new(),
            followup_new: Vec::new(),
            output: Vec::new(),
        };
        for r in trace.requests() {
            let shared = r
                .hash_ids
                .iter()
                .enumerate()
                .take_while(|(i, id)| seen.contains(&(*i, **id)))
                .count();
            seen.extend(r.hash_ids.iter().copied().enumerate());
            let shared_tokens = shared * TRACE_BLOCK_TOKENS;
            if shared <= 1 {
                d.first_prompt.push(r.input_length);
            } else if shared_tokens < r.input_length as usize {
                d.followup_new.push(r.input_length - shared_tokens as u32);
            }
            d.output.push(r.output_length.max(1));
        }
        for (what, v) in [
            ("first_prompt", &d.first_prompt),
            ("followup_new", &d.followup_new),
            ("output", &d.output),
        ] {
            if v.is_empty() {
                return Err(SessionError::EmptyDistribution { what });
            }
        }
        Ok(d)
    }
}

/// Exponential sample with the given mean (inverse CDF).
fn exponential(rng: &mut ChaCha8Rng, mean: f64) -> f64 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    -mean * u.ln()
}

/// Token `pos` of the text piece `piece` (new text or output) of `session`'s
/// turn `turn`: unique to that piece.
fn session_token(seed: u64, session: u32, turn: u32, piece: u32, pos: usize) -> u32 {
    let key =
        splitmix64(seed ^ (u64::from(session) << 32 | u64::from(turn) << 8 | u64::from(piece)));
    splitmix64(key ^ pos as u64) as u32
}

/// Generates the session workload.
///
/// Requests are emitted session by session, turn by turn; a turn's `parent`
/// is the session's previous turn and its `arrival_us` the think time.
///
/// # Errors
/// [`SessionError::Param`] naming the field: zero sessions or block size,
/// `min_turns` 0 or above `max_turns`, non-positive rate or negative think
/// time, `max_context_tokens` 0.
///
/// ```
/// use kv_testkit::sessions::{generate, LengthDistributions, SessionParams};
/// use kv_testkit::trace::{default_trace_path, MooncakeTrace};
/// let d = LengthDistributions::from_trace(&MooncakeTrace::load(default_trace_path()).unwrap()).unwrap();
/// let p = SessionParams { sessions: 3, max_context_tokens: 4096, ..SessionParams::default() };
/// let w = generate(&p, &d).unwrap();
/// assert!(w.requests.iter().filter(|r| r.turn == 0).count() == 3);
/// ```
pub fn generate(p: &SessionParams, d: &LengthDistributions) -> Result<Workload, SessionError> {
    let bad = |field, reason: String| Err(SessionError::Param { field, reason });
    if p.sessions == 0 {
        return bad("sessions", "must be at least 1".into());
    }
    if p.min_turns == 0 || p.min_turns > p.max_turns {
        return bad(
            "min_turns",
            format!(
                "need 1 <= min_turns <= max_turns, got {}..={}",
                p.min_turns, p.max_turns
            ),
        );
    }
    if !(p.session_rate_per_s > 0.0 && p.session_rate_per_s.is_finite()) {
        return bad(
            "session_rate_per_s",
            format!("must be positive, got {}", p.session_rate_per_s),
        );
    }
    if !(p.think_time_mean_s >= 0.0 && p.think_time_mean_s.is_finite()) {
        return bad(
            "think_time_mean_s",
            format!("must be non-negative, got {}", p.think_time_mean_s),
        );
    }
    if p.max_context_tokens < 2 {
        return bad(
            "max_context_tokens",
            format!("must be at least 2, got {}", p.max_context_tokens),
        );
    }
    if p.tokens_per_block == 0 {
        return bad("tokens_per_block", "must be at least 1".into());
    }
    let bs = p.tokens_per_block as usize;
    let max_ctx = p.max_context_tokens as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut requests = Vec::new();
    let mut start_s = 0.0f64;
    for s in 0..p.sessions {
        start_s += exponential(&mut rng, 1.0 / p.session_rate_per_s);
        let turns = rng.gen_range(p.min_turns..=p.max_turns);
        let mut context: Vec<u32> = Vec::new();
        let mut parent = None;
        for turn in 0..turns {
            let new_len = if turn == 0 {
                d.first_prompt[rng.gen_range(0..d.first_prompt.len())] as usize
            } else {
                d.followup_new[rng.gen_range(0..d.followup_new.len())] as usize
            };
            let mut out_len = d.output[rng.gen_range(0..d.output.len())] as usize;
            let think_us = exponential(&mut rng, p.think_time_mean_s) * 1e6;
            let mut new_len = new_len;
            if turn == 0 {
                // Every session has a first turn: clamp it into the context.
                new_len = new_len.min(max_ctx / 2);
                out_len = out_len.min(max_ctx - new_len);
            }
            if context.len() + new_len + out_len > max_ctx {
                break;
            }
            context.extend((0..new_len).map(|i| session_token(p.seed, s, turn, 0, i)));
            let prompt_tokens = context.len() as u32;
            context.extend((0..out_len).map(|i| session_token(p.seed, s, turn, 1, i)));
            let index = requests.len();
            requests.push(ReplayRequest {
                arrival_us: if turn == 0 { start_s * 1e6 } else { think_us },
                parent,
                prompt_tokens,
                output_tokens: out_len as u32,
                blocks: block_chain(&context, bs),
                turn,
            });
            parent = Some(index);
        }
    }
    Ok(Workload {
        name: format!(
            "sessions(n={}, turns={}..={}, seed={})",
            p.sessions, p.min_turns, p.max_turns, p.seed
        ),
        tokens_per_block: p.tokens_per_block,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::default_trace_path;

    fn dists() -> LengthDistributions {
        LengthDistributions::from_trace(&MooncakeTrace::load(default_trace_path()).unwrap())
            .unwrap()
    }

    #[test]
    fn distributions_match_the_trace() {
        let d = dists();
        assert_eq!(d.output.len(), 12_031);
        assert_eq!(d.followup_new.len(), 4_540);
        let mut f = d.followup_new.clone();
        f.sort_unstable();
        assert_eq!(f[f.len() / 2], 846);
        assert!(d.first_prompt.len() + 4_540 <= 12_031);
    }

    #[test]
    fn later_turns_extend_the_previous_prompt_and_output() {
        let p = SessionParams {
            sessions: 5,
            max_context_tokens: 20_000,
            ..SessionParams::default()
        };
        let w = generate(&p, &dists()).unwrap();
        assert_eq!(w.requests.iter().filter(|r| r.turn == 0).count(), 5);
        let mut followups = 0;
        for (i, r) in w.requests.iter().enumerate() {
            assert!(r.prompt_tokens as usize + r.output_tokens as usize <= 20_000);
            assert_eq!(
                r.blocks.len(),
                (r.prompt_tokens + r.output_tokens) as usize / 16
            );
            if let Some(pi) = r.parent {
                followups += 1;
                let prev = &w.requests[pi];
                assert_eq!(pi + 1, i);
                assert_eq!(r.turn, prev.turn + 1);
                assert!(r.prompt_tokens > prev.prompt_tokens + prev.output_tokens);
                // Every full block of the previous prompt + output is a prefix of this one.
                assert_eq!(r.blocks[..prev.blocks.len()], prev.blocks[..]);
            }
        }
        assert!(followups > 0);
        // Deterministic in the seed, different across seeds.
        assert_eq!(generate(&p, &dists()).unwrap(), w);
        let other = generate(&SessionParams { seed: 1, ..p }, &dists()).unwrap();
        assert_ne!(other.requests[0].blocks, w.requests[0].blocks);
    }

    #[test]
    fn bad_parameters_name_the_field() {
        let d = dists();
        for (p, field) in [
            (
                SessionParams {
                    sessions: 0,
                    ..SessionParams::default()
                },
                "sessions",
            ),
            (
                SessionParams {
                    min_turns: 4,
                    max_turns: 3,
                    ..SessionParams::default()
                },
                "min_turns",
            ),
            (
                SessionParams {
                    session_rate_per_s: 0.0,
                    ..SessionParams::default()
                },
                "session_rate_per_s",
            ),
            (
                SessionParams {
                    think_time_mean_s: -1.0,
                    ..SessionParams::default()
                },
                "think_time_mean_s",
            ),
            (
                SessionParams {
                    tokens_per_block: 0,
                    ..SessionParams::default()
                },
                "tokens_per_block",
            ),
        ] {
            let e = generate(&p, &d).unwrap_err();
            assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
        }
    }

    #[test]
    fn session_replay_reuses_decode_generated_kv_in_later_turns() {
        let p = SessionParams {
            sessions: 12,
            max_context_tokens: 12_000,
            ..SessionParams::default()
        };
        let w = generate(&p, &dists()).unwrap();
        let mut o = crate::replay::ReplayOptions::default();
        o.cluster.prefill_workers = 2;
        o.cluster.decode_workers = 2;
        let c = crate::replay::compare(&w, &o).unwrap();
        assert!(c.on.donor_hit_tokens > 0);
        assert!(c.on.prefill_tokens < c.off.prefill_tokens);
        assert!(c.on.later_turn_ttft_mean_ms < c.off.later_turn_ttft_mean_ms);
    }
}
