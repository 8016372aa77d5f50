//! Section `descriptor_wire`: the whole Mooncake trace through the wire.
//!
//! Every request's `hash_ids` are expanded into synthetic tokens
//! (`kv_testkit::trace`), hashed into 16-token blocks
//! (`kv_descriptor::sequence_hashes`, Dynamo's scheme), published as a
//! `Stored` KV event of a decode donor (tier `retained_gpu_direct`), and, when
//! an earlier request already stored a prefix of it, answered with a
//! `kv.fetch_gpu@1.0` hint for that prefix (TP1 and TP2 alternately, an 8B
//! Llama layout). Each event and hint envelope is encoded with the `Wire`
//! trait, decoded, and compared with the original.

use std::collections::HashSet;

use kv_descriptor::{
    chain_sequence_hash, sequence_hashes, token_block_hashes, DType, EngineId, FetchGpuHint,
    FetchPart, HintEnvelope, KvEvent, KvEventData, KvLayout, Role, SequenceHash, StorageTier,
    StoredBlock, TensorOrder, Wire,
};
use kv_testkit::trace::{MooncakeTrace, TRACE_BLOCK_TOKENS};

use crate::section::{Ctx, SectionResult, Stop};

/// Engine block size used for hashing (tokens per block).
pub const TOKENS_PER_BLOCK: usize = 16;
/// Engine blocks per trace block (512 / 16).
const BLOCKS_PER_TRACE_BLOCK: usize = TRACE_BLOCK_TOKENS / TOKENS_PER_BLOCK;
/// Every this many requests, `sequence_hashes` is recomputed independently
/// and compared with the chained token hashes the section builds.
const RECHECK_EVERY: usize = 97;

#[derive(Default)]
struct Tally {
    requests: u64,
    tokens: u64,
    blocks: u64,
    reused_blocks: u64,
    events: u64,
    event_bytes: u64,
    event_mismatches: Vec<String>,
    hints: u64,
    hint_bytes: u64,
    hint_mismatches: Vec<String>,
    hash_mismatches: Vec<String>,
    prefix_pairs: u64,
    prefix_mismatches: Vec<String>,
}

/// The section body.
pub fn run(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let trace = MooncakeTrace::load(&ctx.trace_path).map_err(|e| Stop::Error(e.to_string()))?;
    let trace = match ctx.trace_requests {
        Some(n) => trace.head(n),
        None => trace,
    };
    let layouts = [1, 2].map(|tp| {
        KvLayout::new(
            32,
            8,
            128,
            DType::Bf16,
            TOKENS_PER_BLOCK as u32,
            TensorOrder::BlockMajor,
            tp,
        )
        .expect("Llama-3.1-8B layout is valid at TP1 and TP2")
    });
    let donor = EngineId::fresh();
    let mut seen: HashSet<SequenceHash> = HashSet::new();
    let mut t = Tally::default();
    let mut event_id = 0u64;
    let mut prev: Option<(Vec<u64>, Vec<SequenceHash>, u32)> = None;
    let t0 = std::time::Instant::now();

    for (i, req) in trace.requests().iter().enumerate() {
        let tokens = req.prompt_tokens();
        let token_hashes = token_block_hashes(&tokens, TOKENS_PER_BLOCK);
        let mut seq = Vec::with_capacity(token_hashes.len());
        for th in &token_hashes {
            seq.push(chain_sequence_hash(seq.last().copied(), *th));
        }
        if i % RECHECK_EVERY == 0 && sequence_hashes(&tokens, TOKENS_PER_BLOCK) != seq {
            t.hash_mismatches.push(format!("request {i}"));
        }
        if let Some((prev_ids, prev_seq, prev_len)) = &prev {
            check_shared_prefix(
                i,
                (prev_ids, prev_seq, *prev_len),
                (&req.hash_ids, &seq, req.input_length),
                &mut t,
            );
        }
        t.requests += 1;
        t.tokens += tokens.len() as u64;
        t.blocks += seq.len() as u64;

        // A prefill target would fetch the prefix that earlier requests stored.
        let reused = seq.iter().take_while(|h| seen.contains(h)).count();
        t.reused_blocks += reused as u64;
        if reused > 0 {
            let layout = &layouts[i % 2];
            let hint = fetch_hint(i, donor, layout, &seq[..reused]);
            match round_trip_hint(i, &hint, layout.rank_block_bytes() as u64) {
                Ok(bytes) => t.hint_bytes += bytes,
                Err(e) => t.hint_mismatches.push(e),
            }
            t.hints += 1;
        }

        event_id += 1;
        let blocks: Vec<StoredBlock> = seq
            .iter()
            .zip(&token_hashes)
            .map(|(s, th)| StoredBlock {
                sequence_hash: *s,
                token_hash: *th,
                slot: None,
            })
            .collect();
        let stored = event(
            donor,
            event_id,
            &layouts[0],
            KvEventData::Stored {
                parent: None,
                blocks,
            },
        );
        round_trip_event(i, &stored, &mut t);
        if i % 10 == 9 && seq.len() > 1 {
            // Evict the tail of every tenth request, as a bank under pressure would.
            event_id += 1;
            let tail = seq[seq.len() / 2..].to_vec();
            let removed = event(
                donor,
                event_id,
                &layouts[0],
                KvEventData::Removed {
                    sequence_hashes: tail,
                },
            );
            round_trip_event(i, &removed, &mut t);
        }
        seen.extend(seq.iter().copied());
        prev = Some((req.hash_ids.clone(), seq, req.input_length));
    }
    event_id += 1;
    round_trip_event(
        trace.len(),
        &event(donor, event_id, &layouts[0], KvEventData::Cleared),
        &mut t,
    );
    let elapsed = t0.elapsed();

    let trace_path =
        std::fs::canonicalize(&ctx.trace_path).unwrap_or_else(|_| ctx.trace_path.clone());
    r.metric("trace", trace_path.display().to_string());
    r.metric("requests", t.requests);
    r.metric("prompt_tokens", t.tokens);
    r.metric("blocks_16_tokens", t.blocks);
    r.metric("reused_prefix_blocks", t.reused_blocks);
    r.metric(
        "reused_prefix_fraction",
        round4(t.reused_blocks as f64 / t.blocks.max(1) as f64),
    );
    r.metric("events", t.events);
    r.metric("event_wire_bytes", t.event_bytes);
    r.metric(
        "event_wire_bytes_per_block",
        round4(t.event_bytes as f64 / t.blocks.max(1) as f64),
    );
    r.metric("hints", t.hints);
    r.metric("hint_wire_bytes", t.hint_bytes);
    r.metric("shared_prefix_pairs_checked", t.prefix_pairs);
    r.metric("elapsed_ms", round4(elapsed.as_secs_f64() * 1e3));
    println!(
        "descriptor_wire: {} requests, {} tokens, {} blocks ({:.1}% reusable prefix), {} events ({} B), {} hints ({} B)",
        t.requests,
        t.tokens,
        t.blocks,
        100.0 * t.reused_blocks as f64 / t.blocks.max(1) as f64,
        t.events,
        t.event_bytes,
        t.hints,
        t.hint_bytes
    );

    r.check(
        "trace_nonempty",
        t.requests > 0,
        format!("{} requests", t.requests),
    );
    r.check(
        "events_round_trip",
        t.event_mismatches.is_empty(),
        summary(t.events, &t.event_mismatches),
    );
    r.check(
        "hints_round_trip",
        t.hint_mismatches.is_empty() && t.hints > 0,
        summary(t.hints, &t.hint_mismatches),
    );
    r.check(
        "sequence_hashes_recheck",
        t.hash_mismatches.is_empty(),
        summary(
            t.requests.div_ceil(RECHECK_EVERY as u64),
            &t.hash_mismatches,
        ),
    );
    r.check(
        "shared_trace_prefix_gives_shared_hashes",
        t.prefix_mismatches.is_empty() && t.prefix_pairs > 0,
        summary(t.prefix_pairs, &t.prefix_mismatches),
    );
    Ok(())
}

fn event(publisher: EngineId, event_id: u64, layout: &KvLayout, data: KvEventData) -> KvEvent {
    KvEvent {
        publisher,
        event_id,
        role: Role::Decode,
        layout_fingerprint: layout.fingerprint(),
        tp_size: layout.tp_size(),
        tier: StorageTier::RetainedGpuDirect,
        data,
    }
}

fn fetch_hint(
    i: usize,
    donor: EngineId,
    layout: &KvLayout,
    covered: &[SequenceHash],
) -> FetchGpuHint {
    // Odd requests pretend the target already holds the first quarter.
    let fetch_from = if i % 2 == 1 {
        (covered.len() / 4) as u32
    } else {
        0
    };
    let n = covered.len() - fetch_from as usize;
    FetchGpuHint {
        donor_engine_id: donor,
        bank_generation: 1 + (i as u64 % 3),
        layout_fingerprint: layout.fingerprint(),
        tp_size: layout.tp_size(),
        sequence_hashes: covered.to_vec(),
        fetch_from,
        parts: (0..layout.tp_size())
            .map(|rank| FetchPart {
                tp_rank: rank,
                slot_ids: (0..n).map(|k| ((i * 7919 + k) % 65_536) as u32).collect(),
                expected_bytes: n as u64 * layout.rank_block_bytes() as u64,
            })
            .collect(),
        donor_control_endpoint: format!("kv.decode.{}", i % 4),
    }
}

fn round_trip_hint(i: usize, hint: &FetchGpuHint, rank_block_bytes: u64) -> Result<u64, String> {
    hint.validate(rank_block_bytes)
        .map_err(|e| format!("request {i}: invalid hint: {e}"))?;
    let env = HintEnvelope::fetch_gpu(format!("req-{i}"), "a0", hint)
        .map_err(|e| format!("request {i}: {e}"))?;
    let bytes = env.to_wire().map_err(|e| format!("request {i}: {e}"))?;
    let back = HintEnvelope::from_wire(&bytes).map_err(|e| format!("request {i}: {e}"))?;
    if back != env {
        return Err(format!("request {i}: envelope changed in the round trip"));
    }
    match back.fetch_gpu_actions() {
        Ok(actions) if actions == [hint.clone()] => Ok(bytes.len() as u64),
        Ok(_) => Err(format!("request {i}: decoded hint differs")),
        Err(e) => Err(format!("request {i}: {e}")),
    }
}

fn round_trip_event(i: usize, e: &KvEvent, t: &mut Tally) {
    t.events += 1;
    let result = e
        .to_wire()
        .and_then(|b| KvEvent::from_wire(&b).map(|back| (b.len(), back)));
    match result {
        Ok((n, back)) if &back == e => t.event_bytes += n as u64,
        Ok(_) => t
            .event_mismatches
            .push(format!("request {i}: event {} changed", e.event_id)),
        Err(err) => t
            .event_mismatches
            .push(format!("request {i}: event {}: {err}", e.event_id)),
    }
}

/// Consecutive requests that share their first `k` full trace blocks must
/// share exactly their first `k x 32` engine blocks, and differ at the next
/// block when both have it and the trace ids differ there.
fn check_shared_prefix(
    i: usize,
    (a_ids, a_seq, a_len): (&[u64], &[SequenceHash], u32),
    (b_ids, b_seq, b_len): (&[u64], &[SequenceHash], u32),
    t: &mut Tally,
) {
    let full = |len: u32| len as usize / TRACE_BLOCK_TOKENS;
    let k = a_ids
        .iter()
        .zip(b_ids)
        .take(full(a_len).min(full(b_len)))
        .take_while(|(x, y)| x == y)
        .count();
    if k == 0 {
        return;
    }
    t.prefix_pairs += 1;
    let shared = k * BLOCKS_PER_TRACE_BLOCK;
    if a_seq[..shared] != b_seq[..shared] {
        t.prefix_mismatches.push(format!(
            "requests {} and {i}: first {shared} blocks differ",
            i - 1
        ));
    }
    let diverge = a_ids.get(k).zip(b_ids.get(k)).is_some_and(|(x, y)| x != y);
    if diverge && a_seq.len() > shared && b_seq.len() > shared && a_seq[shared] == b_seq[shared] {
        t.prefix_mismatches.push(format!(
            "requests {} and {i}: block {shared} equal after divergence",
            i - 1
        ));
    }
}

fn summary(total: u64, bad: &[String]) -> String {
    if total == 0 {
        // A check over nothing fails; say why instead of "0 of 0 failed".
        return "nothing to check: the trace produced none".into();
    }
    let mut s = format!("{} of {total} failed", bad.len());
    for b in bad.iter().take(5) {
        s.push_str("; ");
        s.push_str(b);
    }
    s
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::section::{self, test_ctx as ctx, Profile, Section, Status};

    #[test]
    fn head_of_project_trace_round_trips_with_real_counts() {
        let s = Section {
            name: "descriptor_wire",
            profiles: &[Profile::Cpu],
            body: run,
        };
        let r = section::run(&s, &ctx(300));
        assert_eq!(r.status, Status::Passed, "{:#?}", r.checks);
        assert_eq!(r.metrics["requests"], 300);
        let blocks = r.metrics["blocks_16_tokens"].as_u64().unwrap();
        let tokens = r.metrics["prompt_tokens"].as_u64().unwrap();
        assert_eq!(blocks, {
            let t = MooncakeTrace::load(kv_testkit::trace::default_trace_path())
                .unwrap()
                .head(300);
            t.requests()
                .iter()
                .map(|q| q.input_length as u64 / 16)
                .sum::<u64>()
        });
        assert!(tokens >= blocks * 16 && tokens < blocks * 16 + 300 * 16);
        // Every request of the trace starts with hash id 0: all but the first reuse something.
        assert_eq!(r.metrics["hints"], 299);
        // One Stored per request, a Removed per tenth, one Cleared.
        assert_eq!(r.metrics["events"], 300 + 30 + 1);
        assert!(r.metrics["shared_prefix_pairs_checked"].as_u64().unwrap() > 100);
    }

    #[test]
    fn hint_round_trip_rejects_an_inconsistent_hint() {
        let layout =
            KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
        let donor = EngineId::fresh();
        let covered = [
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
            SequenceHash(4),
        ];
        let good = fetch_hint(3, donor, &layout, &covered);
        assert!(round_trip_hint(3, &good, layout.rank_block_bytes() as u64).unwrap() > 0);
        let mut bad = good.clone();
        bad.parts[1].expected_bytes += 1;
        let e = round_trip_hint(3, &bad, layout.rank_block_bytes() as u64).unwrap_err();
        assert!(e.contains("expected_bytes"), "{e}");
    }
}
