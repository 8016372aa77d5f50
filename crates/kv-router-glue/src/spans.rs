//! Tracing spans of a fetch's life, and the advisor and executor observed
//! (spans + metrics) for the router and worker processes.
//!
//! Span names (target `kv_reuse`), each with the field `request_id` (the
//! router's request id, which is also the hint envelope's `message_id`):
//!
//! | span | where | extra fields |
//! | --- | --- | --- |
//! | `kv_reuse.decision` | router: lookup + admission + hint | `target`, `blocks`, `verdict` |
//! | `kv_reuse.lookup` | router: bounded donor lookup (inside `decision`) | `donor_blocks`, `elapsed_us` |
//! | `kv_reuse.fetch` | prefill worker: one hint executed | `outcome`, `bytes` |
//! | `kv_reuse.reserve` | worker: destination rows reserved (inside `fetch`) | |
//! | `kv_reuse.transfer` | worker: bytes moved (inside `fetch`) | |
//! | `kv_reuse.verify` | worker: delivery checked complete (inside `fetch`) | |
//! | `kv_reuse.commit` | worker: rows handed to the native cache (inside `fetch`) | |
//!
//! The constructors below are the one place these names are spelled; the
//! [`ObservedAdvisor`] and [`ObservedExecutor`] wrappers open `decision` /
//! `lookup` and `fetch` and record [`ReuseMetrics`].

use std::sync::Arc;

use kv_descriptor::{EngineId, HintEnvelope, SequenceHash};
use kv_transfer::DeliveryControl;
use tracing::field::Empty;
use tracing::Span;

use crate::metrics::{fallback_label, refuse_label, ReuseMetrics};
use crate::{Advice, Advisor, DonorSource, FetchError, FetchExecutor, FetchOutcome, Verdict};

/// Every span name, in the order a fetch passes through them.
pub const SPAN_NAMES: [&str; 7] = [
    "kv_reuse.decision",
    "kv_reuse.lookup",
    "kv_reuse.fetch",
    "kv_reuse.reserve",
    "kv_reuse.transfer",
    "kv_reuse.verify",
    "kv_reuse.commit",
];

/// `kv_reuse.decision` for `request_id` routed to `target`.
pub fn decision(request_id: &str, target: EngineId, blocks: usize) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.decision", request_id, target = %target, blocks, verdict = Empty)
}

/// `kv_reuse.lookup` for `request_id`.
pub fn lookup(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.lookup", request_id, donor_blocks = Empty, elapsed_us = Empty)
}

/// `kv_reuse.fetch` for `request_id`.
pub fn fetch(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.fetch", request_id, outcome = Empty, bytes = Empty)
}

/// `kv_reuse.reserve` for `request_id`.
pub fn reserve(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.reserve", request_id)
}

/// `kv_reuse.transfer` for `request_id`.
pub fn transfer(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.transfer", request_id)
}

/// `kv_reuse.verify` for `request_id`.
pub fn verify(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.verify", request_id)
}

/// `kv_reuse.commit` for `request_id`.
pub fn commit(request_id: &str) -> Span {
    tracing::info_span!(target: "kv_reuse", "kv_reuse.commit", request_id)
}

/// An [`Advisor`] whose decisions are traced and counted.
#[derive(Debug)]
pub struct ObservedAdvisor {
    advisor: Advisor,
    metrics: Arc<ReuseMetrics>,
}

impl ObservedAdvisor {
    /// Wraps `advisor`, recording into `metrics`.
    pub fn new(advisor: Advisor, metrics: Arc<ReuseMetrics>) -> Self {
        Self { advisor, metrics }
    }

    /// The wrapped advisor.
    pub fn advisor(&self) -> &Advisor {
        &self.advisor
    }

    /// [`Advisor::advise`] inside a `kv_reuse.decision` span; the lookup's
    /// outcome is recorded on a `kv_reuse.lookup` span and in the lookup
    /// latency histogram, the verdict in `kv_reuse_decisions_total`.
    pub fn advise(&self, request_id: &str, hashes: &[SequenceHash], target: EngineId) -> Advice {
        let span = decision(request_id, target, hashes.len());
        let _entered = span.enter();
        let advice = self.advisor.advise(request_id, hashes, target);
        if let Some(outcome) = &advice.lookup {
            let l = lookup(request_id);
            l.record("elapsed_us", outcome.elapsed.as_micros() as u64);
            if let Ok(d) = &outcome.donor {
                l.record("donor_blocks", d.blocks);
            }
            drop(l.enter());
            self.metrics.observe_lookup(outcome.elapsed);
        }
        span.record(
            "verdict",
            match &advice.decision.verdict {
                Verdict::Admit => "admit",
                Verdict::Refuse(r) => refuse_label(r),
            },
        );
        self.metrics.record_decision(&advice.decision);
        advice
    }
}

/// A [`FetchExecutor`] whose fetches are traced and counted.
#[derive(Debug)]
pub struct ObservedExecutor {
    executor: FetchExecutor,
    metrics: Arc<ReuseMetrics>,
}

impl ObservedExecutor {
    /// Wraps `executor`, recording into `metrics`.
    pub fn new(executor: FetchExecutor, metrics: Arc<ReuseMetrics>) -> Self {
        Self { executor, metrics }
    }

    /// The wrapped executor.
    pub fn executor(&self) -> &FetchExecutor {
        &self.executor
    }

    /// [`FetchExecutor::execute`] inside a `kv_reuse.fetch` span named by
    /// the envelope's `message_id`; the outcome goes to the fetch, fallback,
    /// byte and transfer-latency metrics.
    ///
    /// # Errors
    /// Those of [`FetchExecutor::execute`], unchanged.
    pub fn execute(
        &self,
        envelope: &HintEnvelope,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        let span = fetch(&envelope.message_id);
        let _entered = span.enter();
        let result = self.executor.execute(envelope, donor, control);
        match &result {
            Ok(o) => {
                span.record("outcome", "completed");
                span.record("bytes", o.report.counters.bytes);
            }
            Err(e) => {
                span.record("outcome", fallback_label(e));
            }
        }
        self.metrics.record_fetch(&result);
        result
    }
}
