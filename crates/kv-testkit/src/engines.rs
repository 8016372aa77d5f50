//! In-process worker engines around the reference model: a prefill engine
//! with a native prefix cache and the fetch executor, a decode engine with a
//! retained bank, and a router with the real index and advisor.
//!
//! Everything on the reuse path is the product's code: block hashes
//! (kv-descriptor), the retained bank and its events (kv-bank), the index
//! and bounded lookup (kv-lookup), admission and hints (kv-router-glue
//! [`Advisor`]), hint validation, pinning, planning and the copy
//! (kv-router-glue [`FetchExecutor`] over kv-transfer's host backend). The
//! engines add only what a serving engine has: the model, a native cache,
//! and the order of operations.
//!
//! Memory ([`MemoryProfile`]): on the host profile banks live in POSIX shared
//! memory and fetches land in host staging rows ([`HostBuffer`]); on the CUDA
//! profile both are device memory and kv-transfer's CUDA backend moves the
//! bytes (the host carries control only). Either way the fetched rows are
//! then read back and imported into the request's [`KvCache`] (the model
//! runs on the CPU); native cache blocks are byte copies per rank.
//!
//! Observability: every engine records into a [`ReuseMetrics`] (its own, or
//! one shared through the `with_metrics` constructors; see `metrics()`): the
//! router's decisions and lookups through [`ObservedAdvisor`], the prefill
//! engine's executed fetches through [`ObservedExecutor`] (with their
//! `kv_reuse.*` spans), and the decode engine's retained bytes per bank and
//! rank ([`ReuseMetrics::observe_bank`]) after every store and restart. A
//! hint the prefill engine refuses before executing it (it does not match
//! the prompt or the native cache) is a fallback in [`PrefillOutput`] but
//! not a fetch in the metrics.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kv_bank::{
    sealed_blocks, BankConfig, BankManager, BankMemory, CudaDeviceMemory, DestinationPool,
    StoreStatus,
};
use kv_descriptor::{
    EngineId, HintEnvelope, KvEvent, KvEventData, KvLayout, OwnerLease, Role, SequenceHash,
    StorageTier, StoredBlock,
};
use kv_lookup::{EventOutcome, InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::metrics::ReuseMetrics;
use kv_router_glue::spans::{ObservedAdvisor, ObservedExecutor};
use kv_router_glue::{
    check_prompt_prefix, Advice, Advisor, CostModel, DecisionLog, FetchExecutor, LiveCostModel,
    LocalDonorDirectory, ReuseSettings,
};
use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
use kv_transfer::{CopyBackend, DeliveryControl, DeliveryCounters, HostBuffer, HostCopyBackend};

use crate::model::{argmax, KvCache, ModelError, ReferenceModel};

mod decode;
pub use self::decode::DecodeEngine;
mod router;
pub use self::router::Router;

/// Where banks and fetch destinations live.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryProfile {
    /// POSIX shared memory and host staging rows; host memcpy backend.
    Host,
    /// CUDA device memory, rank `r` on ordinal `ordinals[r]` (distinct GPUs:
    /// a manifest refuses two ranks on one GPU); kv-transfer's CUDA backend
    /// (device copies or the gather kernel).
    Cuda {
        /// CUDA ordinal of each TP rank.
        ordinals: Vec<u32>,
    },
}

/// Why an engine operation failed (a fetch failure is *not* an error: it
/// falls back and is reported in [`PrefillOutput::fallback`]).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model refused the input.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A bank operation failed.
    #[error("bank `{op}`: {reason}")]
    Bank {
        /// Operation (`new`, `store`, `write_pending`, `ack`, `close`).
        op: &'static str,
        /// The bank's message.
        reason: String,
    },
    /// Router setup failed (registration, cost model, executor).
    #[error("router `{op}`: {reason}")]
    Router {
        /// Operation.
        op: &'static str,
        /// Message.
        reason: String,
    },
}

fn bank_err(op: &'static str) -> impl Fn(kv_bank::BankError) -> EngineError {
    move |e| EngineError::Bank {
        op,
        reason: e.to_string(),
    }
}

/// LRU native prefix cache of one prefill engine: sealed blocks by sequence
/// hash, each the per-rank bytes of one block. Publishes `Device`-tier
/// events so the router's baseline is exact.
struct NativeCache {
    capacity: usize,
    blocks: HashMap<SequenceHash, (Vec<Vec<u8>>, u64)>,
    clock: u64,
}

impl NativeCache {
    fn prefix_len(&self, hashes: &[StoredBlock]) -> usize {
        hashes
            .iter()
            .take_while(|b| self.blocks.contains_key(&b.sequence_hash))
            .count()
    }

    fn touch(&mut self, h: &SequenceHash) {
        self.clock += 1;
        if let Some(e) = self.blocks.get_mut(h) {
            e.1 = self.clock;
        }
    }

    /// Inserts blocks (prefix order); returns (added, evicted). Evicts the
    /// least recently used block that is not in `blocks`.
    fn insert(
        &mut self,
        blocks: &[(StoredBlock, Vec<Vec<u8>>)],
    ) -> (Vec<StoredBlock>, Vec<SequenceHash>) {
        let mut added = Vec::new();
        let mut evicted = Vec::new();
        let keep: std::collections::HashSet<SequenceHash> =
            blocks.iter().map(|b| b.0.sequence_hash).collect();
        // Tail first, so a prefix is younger than its extension (evicted after it).
        for (b, bytes) in blocks.iter().rev() {
            self.clock += 1;
            if self
                .blocks
                .insert(b.sequence_hash, (bytes.clone(), self.clock))
                .is_none()
            {
                added.push(*b);
            }
        }
        added.reverse();
        while self.blocks.len() > self.capacity {
            let victim = self
                .blocks
                .iter()
                .filter(|(h, _)| !keep.contains(h))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(h, _)| *h);
            let Some(v) = victim.or_else(|| {
                self.blocks
                    .iter()
                    .min_by_key(|(_, (_, t))| *t)
                    .map(|(h, _)| *h)
            }) else {
                break;
            };
            self.blocks.remove(&v);
            if let Some(pos) = added.iter().position(|b| b.sequence_hash == v) {
                added.remove(pos);
            } else {
                evicted.push(v);
            }
        }
        (added, evicted)
    }
}

/// What one prefill did.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutput {
    /// First output token (greedy).
    pub first_token: u32,
    /// Logits that chose it.
    pub first_logits: Vec<f32>,
    /// Prompt tokens computed by the model.
    pub computed_tokens: u64,
    /// Prompt tokens taken from the native cache.
    pub native_tokens: u64,
    /// Prompt tokens fetched from a donor.
    pub fetched_tokens: u64,
    /// Bytes the fetch delivered (all ranks).
    pub bytes_moved: u64,
    /// Bytes that crossed host memory as payload (kv-transfer counter).
    pub host_payload_bytes: u64,
    /// `backend/transport` that moved the bytes (kv-transfer counters), when a fetch completed.
    pub transport: Option<String>,
    /// Set when a hint was given but the fetch fell back: the reason.
    pub fallback: Option<String>,
}

/// How the fetch of one request should be disturbed (fault injection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchFault {
    /// No fault.
    None,
    /// The donor is unreachable: the delivery's liveness probe says dead.
    DonorBlocked,
    /// The delivery was cancelled before it started.
    Cancelled,
}

/// A prefill engine: reference model, native prefix cache, fetch executor.
pub struct PrefillEngine {
    engine: EngineId,
    model: Arc<ReferenceModel>,
    layout: KvLayout,
    native: NativeCache,
    executor: ObservedExecutor,
    metrics: Arc<ReuseMetrics>,
    staging: Vec<Arc<dyn BankMemory>>,
    next_event_id: u64,
}

impl PrefillEngine {
    /// A prefill engine at TP size `tp` with `native_blocks` of native cache
    /// and `staging_blocks` fetch rows per rank in `profile`'s memory.
    ///
    /// # Errors
    /// [`EngineError::Model`] for an unsupported `tp`; [`EngineError::Router`]
    /// when the staging rows, the copy backend or the executor cannot be built
    /// (e.g. no CUDA driver on the CUDA profile, `ordinals` not one per rank).
    pub fn new(
        model: Arc<ReferenceModel>,
        tp: u32,
        native_blocks: usize,
        staging_blocks: u32,
        profile: &MemoryProfile,
    ) -> Result<Self, EngineError> {
        Self::with_metrics(
            model,
            tp,
            native_blocks,
            staging_blocks,
            profile,
            Arc::new(ReuseMetrics::new()),
        )
    }

    /// [`PrefillEngine::new`] recording its fetches (outcome, fallback
    /// reason, bytes, transfer latency) into `metrics`.
    ///
    /// # Errors
    /// Those of [`PrefillEngine::new`].
    pub fn with_metrics(
        model: Arc<ReferenceModel>,
        tp: u32,
        native_blocks: usize,
        staging_blocks: u32,
        profile: &MemoryProfile,
        metrics: Arc<ReuseMetrics>,
    ) -> Result<Self, EngineError> {
        let layout = model.config().layout(tp)?;
        let len = staging_blocks as usize * layout.rank_block_bytes();
        let router_err = |e: String| EngineError::Router {
            op: "executor",
            reason: e,
        };
        let (staging, backend): (Vec<Arc<dyn BankMemory>>, Arc<dyn CopyBackend>) = match profile {
            MemoryProfile::Host => (
                (0..tp)
                    .map(|_| HostBuffer::zeroed(len).map(|b| Arc::new(b) as Arc<dyn BankMemory>))
                    .collect::<Result<_, _>>()
                    .map_err(|e| router_err(e.to_string()))?,
                Arc::new(HostCopyBackend),
            ),
            MemoryProfile::Cuda { ordinals } => {
                if ordinals.len() != tp as usize {
                    return Err(router_err(format!(
                        "`ordinals` has {} entries for tp {tp}",
                        ordinals.len()
                    )));
                }
                (
                    ordinals
                        .iter()
                        .map(|&o| {
                            CudaDeviceMemory::new(o, len)
                                .map(|m| Arc::new(m) as Arc<dyn BankMemory>)
                        })
                        .collect::<Result<_, _>>()
                        .map_err(|e| router_err(e.to_string()))?,
                    Arc::new(
                        CudaCopyBackend::new(CudaMode::Auto)
                            .map_err(|e| router_err(e.to_string()))?,
                    ),
                )
            }
        };
        let executor = FetchExecutor::new(
            layout,
            DestinationPool::new(staging_blocks),
            staging.clone(),
            staging_blocks,
            backend,
        )
        .map_err(|e| router_err(e.to_string()))?;
        Ok(Self {
            engine: EngineId::fresh(),
            model,
            layout,
            native: NativeCache {
                capacity: native_blocks,
                blocks: HashMap::new(),
                clock: 0,
            },
            executor: ObservedExecutor::new(executor, metrics.clone()),
            metrics,
            staging,
            next_event_id: 1,
        })
    }

    /// This incarnation's id.
    pub fn engine_id(&self) -> EngineId {
        self.engine
    }
    /// The metrics its fetches are recorded into.
    pub fn metrics(&self) -> &Arc<ReuseMetrics> {
        &self.metrics
    }
    /// Cache layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn event(&mut self, data: KvEventData) -> KvEvent {
        let e = KvEvent {
            publisher: self.engine,
            event_id: self.next_event_id,
            role: Role::Prefill,
            layout_fingerprint: self.layout.fingerprint(),
            tp_size: self.layout.tp_size(),
            tier: StorageTier::Device,
            data,
        };
        self.next_event_id += 1;
        e
    }

    /// Drops the whole native cache (what an engine does on a cache reset);
    /// returns the `Cleared` event for the router.
    pub fn clear_native(&mut self) -> KvEvent {
        self.native.blocks.clear();
        self.event(KvEventData::Cleared)
    }

    /// Prefills `prompt`: native prefix first, then the hinted donor blocks
    /// (if `hint` is given and the fetch succeeds), then computes the rest.
    /// Returns the output, the request's cache (handed to decode) and the
    /// KV events for the router.
    ///
    /// A hint that does not match the prompt's hashes, or whose `fetch_from`
    /// is beyond what the native cache still holds, falls back without being
    /// executed; any executor error falls back after it released everything.
    ///
    /// # Errors
    /// [`EngineError::Model`] for an empty prompt or out-of-vocabulary tokens.
    pub fn prefill(
        &mut self,
        prompt: &[u32],
        hint: Option<(&HintEnvelope, &BankManager)>,
        fault: FetchFault,
    ) -> Result<(PrefillOutput, KvCache, Vec<KvEvent>), EngineError> {
        if prompt.is_empty() {
            return Err(ModelError::Empty { field: "prompt" }.into());
        }
        let bs = self.layout.tokens_per_block() as usize;
        let blocks = sealed_blocks(None, prompt, bs);
        let reusable = ((prompt.len() - 1) / bs).min(blocks.len());
        let native = self.native.prefix_len(&blocks[..reusable]);
        let mut cache = KvCache::new(self.layout);
        let tp = self.layout.tp_size() as usize;
        for (i, b) in blocks[..native].iter().enumerate() {
            self.native.touch(&b.sequence_hash);
            let parts = &self.native.blocks[&b.sequence_hash].0;
            cache.import_blocks(i, parts)?;
        }
        let mut out = PrefillOutput {
            first_token: 0,
            first_logits: Vec::new(),
            computed_tokens: 0,
            native_tokens: (native * bs) as u64,
            fetched_tokens: 0,
            bytes_moved: 0,
            host_payload_bytes: 0,
            transport: None,
            fallback: None,
        };
        if let Some((env, donor)) = hint {
            match self.fetch(env, donor, fault, &blocks[..reusable], native, &mut cache) {
                Ok((fetched, counters)) => {
                    out.fetched_tokens = (fetched * bs) as u64;
                    out.bytes_moved = counters.bytes;
                    out.host_payload_bytes = counters.host_payload_bytes;
                    out.transport = Some(format!("{}/{}", counters.backend, counters.transport));
                }
                Err(reason) => out.fallback = Some(reason),
            }
        }
        let start = cache.len_tokens();
        let logits = self.model.prefill(&mut cache, &prompt[start..])?;
        out.computed_tokens = (prompt.len() - start) as u64;
        out.first_token = argmax(&logits);
        out.first_logits = logits;
        // Every sealed prompt block enters the native cache (computed or fetched).
        let sealed = cache.sealed_blocks().min(blocks.len());
        let mut entries = Vec::with_capacity(sealed);
        for (i, b) in blocks[..sealed].iter().enumerate() {
            let parts = cache.export_blocks(i, 1)?;
            debug_assert_eq!(parts.len(), tp);
            entries.push((*b, parts));
        }
        let (added, evicted) = self.native.insert(&entries);
        let mut events = Vec::new();
        if !evicted.is_empty() {
            events.push(self.event(KvEventData::Removed {
                sequence_hashes: evicted,
            }));
        }
        if !added.is_empty() {
            let parent = blocks[..sealed]
                .iter()
                .position(|b| b.sequence_hash == added[0].sequence_hash)
                .and_then(|i| i.checked_sub(1))
                .map(|i| blocks[i].sequence_hash);
            events.push(self.event(KvEventData::Stored {
                parent,
                blocks: added,
            }));
        }
        Ok((out, cache, events))
    }

    /// Runs the executor and imports the fetched rows; returns the blocks
    /// imported and the delivery's counters, or the fallback reason.
    fn fetch(
        &mut self,
        env: &HintEnvelope,
        donor: &BankManager,
        fault: FetchFault,
        prompt_blocks: &[StoredBlock],
        native: usize,
        cache: &mut KvCache,
    ) -> Result<(usize, DeliveryCounters), String> {
        let hints = env.fetch_gpu_actions().map_err(|e| format!("hint: {e}"))?;
        let h = hints.first().ok_or("hint: no kv.fetch_gpu action")?;
        let k = h.sequence_hashes.len();
        let from = h.fetch_from as usize;
        let prompt: Vec<SequenceHash> = prompt_blocks.iter().map(|b| b.sequence_hash).collect();
        // The product check every prefill worker makes; run first so that the
        // native-cache checks below only ever see a hint for this prompt.
        check_prompt_prefix(h, &prompt).map_err(|e| format!("hint: {e}"))?;
        if native < from {
            return Err(format!(
                "native cache holds {native} blocks, hint fetches from {from}"
            ));
        }
        if native >= k {
            return Err(format!("native cache already holds all {k} hinted blocks"));
        }
        let control = DeliveryControl::new();
        let control = match fault {
            FetchFault::None => control,
            FetchFault::Cancelled => {
                control.cancel.cancel();
                control
            }
            FetchFault::DonorBlocked => DeliveryControl {
                donor_alive: Some(Arc::new(|| false)),
                ..control
            },
        };
        let outcome = self
            .executor
            .execute_for_prompt(env, &prompt, donor, &control)
            .map_err(|e| e.to_string())?;
        let rbb = self.layout.rank_block_bytes();
        // Rows of blocks `from..native` duplicate the native cache; import the rest.
        for (j, row) in outcome.target_blocks.iter().enumerate().skip(native - from) {
            let parts = self
                .staging
                .iter()
                .map(|buf| {
                    let mut v = vec![0u8; rbb];
                    buf.read_bytes(*row as usize * rbb, &mut v).map(|_| v)
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("staging read: {e}"))?;
            cache
                .import_blocks(from + j, &parts)
                .map_err(|e| e.to_string())?;
        }
        Ok((k - native, outcome.report.counters))
    }
}

/// Hashes of the sealed blocks a prompt may reuse (all but its last token's block).
pub(crate) fn prompt_hashes(prompt: &[u32], tokens_per_block: usize) -> Vec<SequenceHash> {
    sealed_blocks(None, prompt, tokens_per_block)
        .iter()
        .map(|b| b.sequence_hash)
        .take(prompt.len().saturating_sub(1) / tokens_per_block)
        .collect()
}
