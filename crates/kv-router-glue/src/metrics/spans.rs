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
//! | `kv_reuse.fetch` | prefill worker: one hint executed | `outcome` (`completed`, `fallback`), `bytes`, `stage`, `cause` (of a fallback, as in `kv_reuse_fallbacks_total`) |
//! | `kv_reuse.reserve` | worker: destination rows reserved (inside `fetch`) | |
//! | `kv_reuse.transfer` | worker: bytes moved (inside `fetch`) | |
//! | `kv_reuse.verify` | worker: delivery checked complete (inside `fetch`) | |
//! | `kv_reuse.commit` | worker: rows handed to the native cache (inside `fetch`) | |
//!
//! The constructors below are the one place these names are spelled. The
//! advisor opens `lookup` and the executor `reserve`, `transfer`, `verify`
//! and `commit`; the [`ObservedAdvisor`] and [`ObservedExecutor`] wrappers
//! open `decision` and `fetch` around them and record [`ReuseMetrics`].

use std::sync::Arc;

#[cfg(feature = "worker")]
use kv_descriptor::HintEnvelope;
use kv_descriptor::{EngineId, SequenceHash};
#[cfg(feature = "worker")]
use kv_transfer::DeliveryControl;
use tracing::field::Empty;
use tracing::Span;

#[cfg(feature = "worker")]
use crate::metrics::fallback_labels;
use crate::metrics::{refuse_label, ReuseMetrics};
use crate::{Advice, Advisor, Verdict};
#[cfg(feature = "worker")]
use crate::{DonorSource, FetchError, FetchExecutor, FetchOutcome};

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
    tracing::info_span!(target: "kv_reuse", "kv_reuse.fetch", request_id, outcome = Empty, bytes = Empty, stage = Empty, cause = Empty)
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

    /// [`Advisor::advise`] inside a `kv_reuse.decision` span (the advisor
    /// opens `kv_reuse.lookup` inside it); the lookup time goes to the lookup
    /// latency histogram, the verdict to `kv_reuse_decisions_total`.
    pub fn advise(&self, request_id: &str, hashes: &[SequenceHash], target: EngineId) -> Advice {
        self.advise_cancellable(request_id, hashes, target, &|| false)
    }

    /// [`Advisor::advise_cancellable`], observed like [`ObservedAdvisor::advise`].
    pub fn advise_cancellable(
        &self,
        request_id: &str,
        hashes: &[SequenceHash],
        target: EngineId,
        cancelled: &dyn Fn() -> bool,
    ) -> Advice {
        let span = decision(request_id, target, hashes.len());
        let _entered = span.enter();
        let advice = self
            .advisor
            .advise_cancellable(request_id, hashes, target, cancelled);
        if let Some(outcome) = &advice.lookup {
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

#[cfg(feature = "worker")]
/// A [`FetchExecutor`] whose fetches are traced and counted.
#[derive(Debug)]
pub struct ObservedExecutor {
    executor: FetchExecutor,
    metrics: Arc<ReuseMetrics>,
}

#[cfg(feature = "worker")]
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
        self.observe(envelope, || self.executor.execute(envelope, donor, control))
    }

    /// [`FetchExecutor::execute_for_prompt`] observed as
    /// [`ObservedExecutor::execute`] is.
    ///
    /// # Errors
    /// Those of [`FetchExecutor::execute_for_prompt`], unchanged.
    pub fn execute_for_prompt(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        self.observe(envelope, || {
            self.executor
                .execute_for_prompt(envelope, prompt, donor, control)
        })
    }

    fn observe(
        &self,
        envelope: &HintEnvelope,
        run: impl FnOnce() -> Result<FetchOutcome, FetchError>,
    ) -> Result<FetchOutcome, FetchError> {
        let span = fetch(&envelope.message_id);
        let _entered = span.enter();
        let result = run();
        match &result {
            Ok(o) => {
                span.record("outcome", "completed");
                span.record("bytes", o.report.counters.bytes);
            }
            Err(e) => {
                let (stage, cause) = fallback_labels(e);
                span.record("outcome", "fallback");
                span.record("stage", stage);
                span.record("cause", cause);
            }
        }
        self.metrics.record_fetch(&result);
        result
    }
}

#[cfg(all(test, feature = "worker"))]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use kv_transfer::DeliveryControl;
    use parking_lot::Mutex;
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::Layer;

    use super::*;
    use crate::qualify::Scenario;

    /// Spans seen: name, parent name, fields (as text).
    #[derive(Debug, Clone, Default)]
    struct Seen {
        name: &'static str,
        parent: Option<&'static str>,
        fields: HashMap<String, String>,
    }

    /// Every span opened, in order; ids of closed spans are reused by the
    /// registry, so records go to the latest span with that id.
    #[derive(Default, Clone)]
    struct Capture(Arc<Mutex<Captured>>);

    /// Spans in opening order, and the index of the latest span per id.
    type Captured = (Vec<Seen>, HashMap<u64, usize>);

    struct Fields<'a>(&'a mut HashMap<String, String>);
    impl tracing::field::Visit for Fields<'_> {
        fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
            self.0.insert(
                f.name().to_owned(),
                format!("{v:?}").trim_matches('"').to_owned(),
            );
        }
    }

    impl<S> Layer<S> for Capture
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
            let mut seen = Seen {
                name: attrs.metadata().name(),
                parent: ctx.span(id).and_then(|s| s.parent()).map(|p| p.name()),
                ..Seen::default()
            };
            attrs.record(&mut Fields(&mut seen.fields));
            let mut st = self.0.lock();
            st.0.push(seen);
            let at = st.0.len() - 1;
            st.1.insert(id.into_u64(), at);
        }
        fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
            let mut st = self.0.lock();
            if let Some(&at) = st.1.get(&id.into_u64()) {
                values.record(&mut Fields(&mut st.0[at].fields));
            }
        }
    }

    /// The process-wide capture. A global subscriber, because a scoped one
    /// races with tests on other threads that register the same callsites
    /// while no subscriber is interested.
    fn capture() -> &'static Capture {
        static CAPTURE: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
        CAPTURE.get_or_init(|| {
            let c = Capture::default();
            tracing::subscriber::set_global_default(tracing_subscriber::registry().with(c.clone()))
                .expect("no other global subscriber in this test binary");
            c
        })
    }

    #[test]
    fn decision_lookup_and_fetch_spans_carry_the_request_id() {
        let capture = capture();
        let s = Scenario::new().unwrap();
        let metrics = Arc::new(ReuseMetrics::new());
        let settings = crate::qualify::admitting_settings();
        let advisor = ObservedAdvisor::new(s.advisor(settings).unwrap(), metrics.clone());
        let exec = ObservedExecutor::new(s.executor().unwrap(), metrics);
        let env = advisor.advise("req-77", &s.hashes, s.target).hint.unwrap();
        exec.execute(&env, s.donor.as_ref(), &DeliveryControl::new())
            .unwrap();
        // Spans of other tests in this binary are captured too: keep ours.
        let seen: Vec<Seen> = capture
            .0
            .lock()
            .0
            .iter()
            .filter(|s| s.fields.get("request_id").map(String::as_str) == Some("req-77"))
            .cloned()
            .collect();
        let by_name = |n: &str| {
            seen.iter()
                .find(|s| s.name == n)
                .unwrap_or_else(|| panic!("no span {n} in {seen:?}"))
                .clone()
        };
        let d = by_name("kv_reuse.decision");
        assert_eq!(d.fields["request_id"], "req-77");
        assert_eq!(d.fields["verdict"], "admit");
        assert_eq!(d.fields["target"], s.target.to_string());
        assert_eq!(d.fields["blocks"], s.hashes.len().to_string());
        let l = by_name("kv_reuse.lookup");
        assert_eq!(l.parent, Some("kv_reuse.decision"));
        assert_eq!(l.fields["request_id"], "req-77");
        assert_eq!(l.fields["donor_blocks"], s.hashes.len().to_string());
        let f = by_name("kv_reuse.fetch");
        assert_eq!(f.fields["request_id"], "req-77");
        assert_eq!(f.fields["outcome"], "completed");
        assert!(f.fields["bytes"].parse::<u64>().unwrap() > 0);
        for name in SPAN_NAMES {
            assert!(name.starts_with("kv_reuse."), "{name}");
        }
        for step in ["reserve", "transfer", "verify", "commit"] {
            let sp = by_name(&format!("kv_reuse.{step}"));
            assert_eq!(sp.parent, Some("kv_reuse.fetch"), "{step}");
            assert_eq!(sp.fields["request_id"], "req-77", "{step}");
        }
        assert_eq!(seen.len(), SPAN_NAMES.len(), "one span each: {seen:?}");
    }
}
