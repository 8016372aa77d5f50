//! [`RouterService`]: advise requests decoded, bounded, decided, encoded.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kv_descriptor::{sequence_hashes, EngineId, Wire};
use parking_lot::RwLock;

use super::wire::{AdviseKeys, AdviseRefusal, AdviseReply, AdviseRequest, AdviseResult};
use crate::Advisor;

/// The router's advise logic, independent of the transport (the binary
/// serves it on NATS request/reply; tests call it directly).
///
/// Malformed, oversized or unknown-target requests are refused before the
/// advisor runs, so they change nothing (no decision logged, no lookup).
pub struct RouterService {
    advisor: Arc<Advisor>,
    targets: RwLock<HashSet<EngineId>>,
    draining: AtomicBool,
    refused: AtomicU64,
}

impl std::fmt::Debug for RouterService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterService")
            .field("targets", &self.targets.read().len())
            .field("draining", &self.draining.load(Ordering::Relaxed))
            .finish()
    }
}

impl RouterService {
    /// A service over `advisor` (which holds the index, the donor directory
    /// and the live cost model) that knows no prefill target yet.
    pub fn new(advisor: Arc<Advisor>) -> Self {
        Self {
            advisor,
            targets: RwLock::new(HashSet::new()),
            draining: AtomicBool::new(false),
            refused: AtomicU64::new(0),
        }
    }

    /// The advisor (decision log, live model).
    pub fn advisor(&self) -> &Arc<Advisor> {
        &self.advisor
    }

    /// Accepts advise requests naming `target` as prefill worker.
    pub fn add_target(&self, target: EngineId) {
        self.targets.write().insert(target);
    }

    /// Refuses further requests naming `target` ([`AdviseRefusal::UnknownTarget`]).
    pub fn remove_target(&self, target: EngineId) {
        self.targets.write().remove(&target);
    }

    /// Stops taking requests: later ones get [`AdviseRefusal::Draining`].
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Requests refused before the advisor ran, since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Decides one decoded request.
    pub fn advise(&self, req: &AdviseRequest) -> AdviseReply {
        let refuse = |r: AdviseRefusal| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            AdviseReply {
                request_id: req.request_id.clone(),
                result: AdviseResult::Refused(r),
            }
        };
        if self.draining.load(Ordering::SeqCst) {
            return refuse(AdviseRefusal::Draining);
        }
        if let Err(r) = req.check() {
            return refuse(r);
        }
        if !self.targets.read().contains(&req.target) {
            return refuse(AdviseRefusal::UnknownTarget(req.target));
        }
        let hashes = match &req.keys {
            AdviseKeys::SequenceHashes(h) => h.clone(),
            AdviseKeys::Tokens {
                token_ids,
                tokens_per_block,
            } => sequence_hashes(token_ids, *tokens_per_block as usize),
        };
        let advice = self.advisor.advise(&req.request_id, &hashes, req.target);
        AdviseReply {
            request_id: req.request_id.clone(),
            result: AdviseResult::Decided {
                decision: advice.decision,
                hint: advice.hint,
            },
        }
    }

    /// Decodes `payload` and decides: the reply before encoding (what
    /// [`RouterService::handle`] encodes; the NATS server also reads its
    /// outcome for metrics). A payload that does not decode gets a
    /// [`AdviseRefusal::Malformed`] or `Oversized` refusal with an empty
    /// request id.
    pub fn handle_reply(&self, payload: &[u8]) -> AdviseReply {
        self.reply_for(AdviseRequest::decode(payload))
    }

    /// Decides an already decoded request, or refuses what did not decode
    /// (the second half of [`RouterService::handle_reply`], split so that the
    /// advise server can time decoding and deciding apart).
    pub(crate) fn reply_for(&self, decoded: Result<AdviseRequest, AdviseRefusal>) -> AdviseReply {
        match decoded {
            Ok(req) => self.advise(&req),
            Err(r) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                AdviseReply {
                    request_id: String::new(),
                    result: AdviseResult::Refused(r),
                }
            }
        }
    }

    /// Decodes `payload`, decides, and encodes the reply (what the NATS
    /// handler sends back). A payload that does not decode gets a
    /// [`AdviseRefusal::Malformed`] or `Oversized` reply with an empty
    /// request id.
    pub fn handle(&self, payload: &[u8]) -> Vec<u8> {
        encode_reply(&self.handle_reply(payload))
    }
}

/// Encodes a reply. Encoding a reply of validated values does not fail;
/// should it, the caller gets an empty payload, which decodes as malformed
/// and makes the router's caller recompute.
pub(crate) fn encode_reply(reply: &AdviseReply) -> Vec<u8> {
    reply.to_wire().unwrap_or_default()
}
