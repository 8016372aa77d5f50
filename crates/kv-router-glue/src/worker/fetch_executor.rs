//! The prefill-side fetch executor: validate the hint, reserve destination
//! blocks, pin the donor's slots, transfer, verify, commit, or fall back.
//!
//! Order matters: the hint is checked against the donor's manifest and the
//! target's layout before the destination pool or the donor is touched, so a
//! forged, stale or out-of-range hint costs nothing. After that, every
//! failure cancels the reservation and drops the pin; the request
//! recomputes. The cancelled rows return to the pool (quiesced) once the
//! delivery returned with nothing in flight; when the backend could not stop
//! an abandoned read ([`kv_transfer::TransferError::may_still_write`]) they
//! stay orphaned instead, so a late write never lands in reused rows.
//!
//! Destinations are either the executor's own block-major rows
//! ([`FetchExecutor::new`]) or the engine's own KV tensors
//! ([`FetchExecutor::with_engine_regions`]: an [`EngineRegion`] per TP rank,
//! memory plus [`KvRegionLayout`]), where a fetch lands at the block ids the
//! engine's allocator chose ([`FetchExecutor::execute_at`]) with the same
//! reservation, quiescence and no-false-completion rules: the ids are
//! reserved exactly in the executor's pool for the fetch, and the
//! conversion into the engine's layout happens inside the copy.

use std::sync::Arc;

use kv_bank::{BankMemory, DestinationPool, DestinationReservation};
use kv_descriptor::{
    BankManifest, DescriptorError, FetchGpuHint, HintEnvelope, KvLayout, KvRegionLayout,
    SequenceHash,
};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{deliver, CopyBackend, DeliveryControl, DeliveryReport, RankIo, TransferError};

use crate::{check_prompt_prefix, validate_hint, FallbackCause, FetchError};

mod donor;
mod outcome;
pub use donor::{DonorPin, DonorSource};
pub use outcome::{FetchOutcome, FetchStages};

/// One TP rank's destination inside the engine's own KV tensors.
///
/// `layout`'s byte offsets are relative to `memory.base_addr()`: register
/// one memory spanning the rank's per-layer tensors (vLLM allocates one per
/// layer; their base pointers become `layout.layer_offsets()`), described
/// with [`KvRegionLayout::vllm_kv_first`], [`KvRegionLayout::vllm_block_first`],
/// [`KvRegionLayout::hf_tokens`] or [`KvRegionLayout::block_major`].
///
/// ```
/// use std::sync::Arc;
/// use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
/// use kv_router_glue::EngineRegion;
/// let g = KvLayout::new(2, 2, 8, DType::Bf16, 4, TensorOrder::BlockMajor, 1).unwrap();
/// // vLLM `[2, 64, 4, 2, 8]` bf16 per layer: 16 KiB a tensor, two tensors 1 MiB apart.
/// let layout = KvRegionLayout::vllm_kv_first(g, 0, 0, 1 << 20, 64, (1 << 20) + 16384).unwrap();
/// let memory = Arc::new(kv_transfer::HostBuffer::zeroed(layout.region_bytes() as usize).unwrap());
/// let region = EngineRegion { memory, layout };
/// assert_eq!(region.layout.num_blocks(), 64);
/// ```
#[derive(Clone)]
pub struct EngineRegion {
    /// Memory of the engine's tensors for this rank, mapped in this process
    /// (host, or a CUDA allocation for a CUDA backend).
    pub memory: Arc<dyn BankMemory>,
    /// Where each element of each block lies in `memory`.
    pub layout: KvRegionLayout,
}

impl std::fmt::Debug for EngineRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineRegion")
            .field("kind", &self.memory.kind())
            .field("len", &self.memory.len())
            .field("layout", &self.layout)
            .finish()
    }
}

/// Executes fetch hints into one target's block regions.
pub struct FetchExecutor {
    layout: KvLayout,
    pool: DestinationPool,
    regions: Vec<Arc<dyn BankMemory>>,
    blocks: u32,
    backend: Arc<dyn CopyBackend>,
    /// `Some` for engine regions: rank `r`'s target layout at index `r`.
    engine_layouts: Option<Vec<KvRegionLayout>>,
}

impl std::fmt::Debug for FetchExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchExecutor")
            .field("layout", &self.layout)
            .field("blocks", &self.blocks)
            .field("backend", &self.backend.name())
            .field("engine_layouts", &self.engine_layouts)
            .finish()
    }
}

impl FetchExecutor {
    /// An executor writing into `regions` (one per TP rank, `blocks` dense rows
    /// of `layout.rank_block_bytes()` each), reserving rows from `pool`
    /// (capacity `blocks`), moving bytes with `backend`.
    ///
    /// # Errors
    /// [`FetchError::LayoutMismatch`] naming `regions` when the count is not
    /// `tp_size` or a region is smaller than `blocks` rows, naming `pool`
    /// when the pool hands out more than `blocks` rows.
    pub fn new(
        layout: KvLayout,
        pool: DestinationPool,
        regions: Vec<Arc<dyn BankMemory>>,
        blocks: u32,
        backend: Arc<dyn CopyBackend>,
    ) -> Result<Self, FetchError> {
        let need = u64::from(blocks) * layout.rank_block_bytes() as u64;
        if regions.len() != layout.tp_size() as usize {
            return Err(FetchError::LayoutMismatch {
                field: "regions",
                detail: format!("{} regions for tp_size {}", regions.len(), layout.tp_size()),
            });
        }
        if let Some((r, m)) = regions
            .iter()
            .enumerate()
            .find(|(_, m)| (m.len() as u64) < need)
        {
            return Err(FetchError::LayoutMismatch {
                field: "regions",
                detail: format!(
                    "rank {r} region has {} bytes, {blocks} blocks need {need}",
                    m.len()
                ),
            });
        }
        // The pool hands out row ids `0..capacity`; a row past the regions
        // would only be refused by the plan of some later fetch.
        if pool.capacity() > blocks {
            return Err(FetchError::LayoutMismatch {
                field: "pool",
                detail: format!(
                    "pool hands out {} rows but the regions hold {blocks}",
                    pool.capacity()
                ),
            });
        }
        Ok(Self {
            layout,
            pool,
            regions,
            blocks,
            backend,
            engine_layouts: None,
        })
    }

    /// An executor writing into the engine's own tensors: `regions[r]` is TP
    /// rank `r`'s [`EngineRegion`], block ids `0..num_blocks` of its layout;
    /// `pool` (capacity at most the smallest `num_blocks`) tracks which of
    /// them a fetch has reserved, so one block never has two writers and a
    /// block an abandoned read may still write stays out of use
    /// ([`DestinationPool::is_reserved`]: the engine's allocator must not hand
    /// out such a block).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kv_bank::DestinationPool;
    /// use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
    /// use kv_router_glue::{EngineRegion, FetchExecutor};
    /// use kv_transfer::{HostBuffer, HostCopyBackend};
    /// let g = KvLayout::new(2, 4, 8, DType::F32, 4, TensorOrder::BlockMajor, 2).unwrap();
    /// let layer = 16 * g.rank_block_bytes() as u64 / 2; // one vLLM tensor, 16 blocks
    /// let regions = (0..2)
    ///     .map(|r| {
    ///         let layout = KvRegionLayout::vllm_block_first(g, r, 0, layer, 16, 2 * layer).unwrap();
    ///         let memory = Arc::new(HostBuffer::zeroed(2 * layer as usize).unwrap());
    ///         EngineRegion { memory, layout }
    ///     })
    ///     .collect();
    /// let exec = FetchExecutor::with_engine_regions(
    ///     g, DestinationPool::new(16), regions, Arc::new(HostCopyBackend),
    /// ).unwrap();
    /// assert_eq!(exec.pool().free_blocks(), 16);
    /// ```
    ///
    /// # Errors
    /// [`FetchError::LayoutMismatch`], before anything is used, naming
    /// `regions` (count is not `tp_size`), `regions.layout.tp_rank` (entry `r`
    /// is another rank's), `regions.layout` (not the geometry of `layout`:
    /// layers, heads, head_dim, dtype, tokens per block, TP size; the
    /// [`kv_descriptor::RegionLayoutError`] text names the field),
    /// `regions.memory` (smaller than the layout's `region_bytes`), `pool`
    /// (hands out ids past a region's blocks) or `backend` (a layout other
    /// than bank rows and a backend that does not convert,
    /// [`CopyBackend::converts`]).
    pub fn with_engine_regions(
        layout: KvLayout,
        pool: DestinationPool,
        regions: Vec<EngineRegion>,
        backend: Arc<dyn CopyBackend>,
    ) -> Result<Self, FetchError> {
        let mismatch = |field, detail| FetchError::LayoutMismatch { field, detail };
        if regions.len() != layout.tp_size() as usize {
            return Err(mismatch(
                "regions",
                format!("{} regions for tp_size {}", regions.len(), layout.tp_size()),
            ));
        }
        let bb = layout.rank_block_bytes() as u64;
        for (r, region) in regions.iter().enumerate() {
            let l = &region.layout;
            if l.tp_rank() != r as u32 {
                return Err(mismatch(
                    "regions.layout.tp_rank",
                    format!("entry {r} describes rank {}", l.tp_rank()),
                ));
            }
            // The executor's geometry as a one-block bank of this rank: the
            // engine's layout may differ in memory order only.
            KvRegionLayout::block_major(layout, r as u32, 0, 1, bb)
                .and_then(|own| own.check_compatible(l))
                .map_err(|e| mismatch("regions.layout", format!("rank {r}: {e}")))?;
            if (region.memory.len() as u64) < l.region_bytes() {
                return Err(mismatch(
                    "regions.memory",
                    format!(
                        "rank {r} memory has {} bytes, its layout addresses {}",
                        region.memory.len(),
                        l.region_bytes()
                    ),
                ));
            }
            if !backend.converts() && !kv_transfer::convert::is_bank_rows(l) {
                return Err(mismatch(
                    "backend",
                    format!(
                        "`{}` does not convert into rank {r}'s {:?} layout",
                        backend.name(),
                        l.order()
                    ),
                ));
            }
        }
        let blocks = regions
            .iter()
            .map(|r| r.layout.num_blocks())
            .min()
            .unwrap_or(0);
        if pool.capacity() > blocks {
            return Err(mismatch(
                "pool",
                format!(
                    "pool hands out {} blocks but the engine regions hold {blocks}",
                    pool.capacity()
                ),
            ));
        }
        let (memories, layouts) = regions.into_iter().map(|r| (r.memory, r.layout)).unzip();
        Ok(Self {
            layout,
            pool,
            regions: memories,
            blocks,
            backend,
            engine_layouts: Some(layouts),
        })
    }

    /// The destination pool (to see free and reserved rows).
    pub fn pool(&self) -> &DestinationPool {
        &self.pool
    }

    /// Reads this executor's backend abandoned that may still write rows
    /// ([`CopyBackend::in_flight`]).
    pub fn backend_in_flight(&self) -> usize {
        self.backend.in_flight()
    }

    /// Returns rows orphaned by abandoned reads to the pool once the backend
    /// reports none of them in flight ([`CopyBackend::in_flight`]); returns
    /// the number of rows freed. [`FetchExecutor::execute`] calls it first.
    ///
    /// ```no_run
    /// # fn f(executor: &kv_router_glue::FetchExecutor) {
    /// // After a fetch abandoned on a cut link, once the read has ended:
    /// let freed = executor.reclaim_quiesced();
    /// assert_eq!(executor.pool().orphaned_blocks(), 0, "{freed} rows back");
    /// # }
    /// ```
    pub fn reclaim_quiesced(&self) -> usize {
        if self.pool.orphaned_blocks() > 0 && self.backend.in_flight() == 0 {
            self.pool.reclaim_orphans_after_quiesce()
        } else {
            0
        }
    }

    /// Runs the single `kv.fetch_gpu@1.0` action of `envelope` from `donor`.
    ///
    /// # Errors
    /// Hint errors ([`FetchError::Malformed`], [`FetchError::WrongEngine`],
    /// [`FetchError::StaleGeneration`], [`FetchError::LayoutMismatch`],
    /// [`FetchError::SlotOutOfRange`], [`FetchError::InconsistentSlots`],
    /// [`FetchError::NotADonor`]) before anything is touched; then
    /// [`FetchError::Fallback`] at `reserve`, `pin`, `plan`, `transfer` or
    /// `verify`, with the reservation cancelled and the pin released.
    ///
    /// The caller must have checked the hint against the request's prompt
    /// ([`check_prompt_prefix`]); [`FetchExecutor::execute_for_prompt`]
    /// does both.
    pub fn execute(
        &self,
        envelope: &HintEnvelope,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        self.run(envelope, None, None, donor, control)
    }

    /// [`FetchExecutor::execute`] landing the fetched blocks at `dst_blocks`,
    /// the target block ids the engine's allocator chose (one per fetched
    /// block, in prefix order), reserved exactly for this fetch. On success
    /// [`FetchOutcome::target_blocks`] holds exactly `dst_blocks`.
    ///
    /// ```no_run
    /// # fn f(exec: &kv_router_glue::FetchExecutor, env: &kv_descriptor::HintEnvelope,
    /// #      bank: &kv_bank::BankManager) {
    /// // The engine's allocator gave blocks 9, 2 and 5 to the request's prefix.
    /// let out = exec.execute_at(env, &[9, 2, 5], bank, &kv_transfer::DeliveryControl::new()).unwrap();
    /// assert_eq!(&out.target_blocks[..], &[9, 2, 5]);
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`FetchExecutor::execute`]; after the hint checks and before the
    /// pool or the donor is touched, the argument errors of
    /// [`FetchExecutor::check_dst_blocks`] ([`FetchError::DstBlocksCount`],
    /// [`FetchError::DstBlockOutOfRange`], [`FetchError::DstBlockRepeated`]:
    /// a caller bug, not a [`FetchError::Fallback`], though the request
    /// recomputes and the metrics count it under stage `argument`);
    /// [`FetchError::Fallback`] at `reserve`
    /// with [`kv_bank::BankError::AlreadyReserved`] when another fetch holds
    /// one of the blocks (contention).
    pub fn execute_at(
        &self,
        envelope: &HintEnvelope,
        dst_blocks: &[u32],
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        self.run(envelope, None, Some(dst_blocks), donor, control)
    }

    /// Checks `dst_blocks` for a fetch of `hint` as
    /// [`FetchExecutor::execute_at`] will, without touching the pool or the
    /// donor: one id per fetched block ([`FetchGpuHint::fetch_blocks`]),
    /// each below the pool's capacity, none repeated. The answer depends on
    /// the arguments and the pool's capacity only, so a caller may check
    /// early (e.g. before importing the donor) and report an allocator bug
    /// as an argument error.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kv_bank::DestinationPool;
    /// use kv_descriptor::{DType, KvLayout, TensorOrder};
    /// use kv_router_glue::{FetchError, FetchExecutor};
    /// # use kv_descriptor::{EngineId, FetchGpuHint, FetchPart, SequenceHash};
    /// let g = KvLayout::new(1, 1, 4, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    /// let rows: Arc<dyn kv_bank::BankMemory> =
    ///     Arc::new(kv_transfer::HostBuffer::zeroed(8 * g.rank_block_bytes()).unwrap());
    /// let exec = FetchExecutor::new(
    ///     g, DestinationPool::new(8), vec![rows], 8, Arc::new(kv_transfer::HostCopyBackend),
    /// ).unwrap();
    /// # let hint = FetchGpuHint {
    /// #     donor_engine_id: EngineId(uuid::Uuid::nil()), bank_generation: 1,
    /// #     layout_fingerprint: g.fingerprint(), tp_size: 1,
    /// #     sequence_hashes: vec![SequenceHash(1), SequenceHash(2)], fetch_from: 0,
    /// #     parts: vec![FetchPart { tp_rank: 0, slot_ids: vec![0, 1], expected_bytes: 0 }],
    /// #     donor_control_endpoint: "unix:/x".into(),
    /// # };
    /// // `hint` fetches 2 blocks.
    /// exec.check_dst_blocks(&hint, &[7, 3]).unwrap();
    /// assert!(matches!(
    ///     exec.check_dst_blocks(&hint, &[7, 8]),
    ///     Err(FetchError::DstBlockOutOfRange { index: 1, block: 8, capacity: 8 })
    /// ));
    /// assert!(matches!(
    ///     exec.check_dst_blocks(&hint, &[3, 3]),
    ///     Err(FetchError::DstBlockRepeated { index: 1, block: 3, first: 0 })
    /// ));
    /// assert!(matches!(
    ///     exec.check_dst_blocks(&hint, &[3]),
    ///     Err(FetchError::DstBlocksCount { given: 1, fetched: 2, fetch_from: 0 })
    /// ));
    /// ```
    ///
    /// # Errors
    /// [`FetchError::DstBlocksCount`], then [`FetchError::DstBlockOutOfRange`]
    /// or [`FetchError::DstBlockRepeated`] for the first bad id.
    pub fn check_dst_blocks(
        &self,
        hint: &FetchGpuHint,
        dst_blocks: &[u32],
    ) -> Result<(), FetchError> {
        Self::check_dst_count(hint, dst_blocks)?;
        self.pool.check_blocks(dst_blocks).map_err(reserve_error)
    }

    /// [`FetchError::DstBlocksCount`] unless `dst_blocks` has one id per
    /// block `hint` fetches; the rest of [`FetchExecutor::check_dst_blocks`]
    /// is the pool's own check, which `reserve_exact` runs first anyway.
    fn check_dst_count(hint: &FetchGpuHint, dst_blocks: &[u32]) -> Result<(), FetchError> {
        let fetched = hint.fetch_blocks();
        if dst_blocks.len() != fetched {
            return Err(FetchError::DstBlocksCount {
                given: dst_blocks.len(),
                fetched,
                fetch_from: hint.fetch_from,
            });
        }
        Ok(())
    }

    /// [`FetchExecutor::execute_at`] after [`check_prompt_prefix`], as
    /// [`FetchExecutor::execute_for_prompt`].
    ///
    /// ```no_run
    /// # fn f(exec: &kv_router_glue::FetchExecutor, env: &kv_descriptor::HintEnvelope,
    /// #      prompt: &[kv_descriptor::SequenceHash], bank: &kv_bank::BankManager) {
    /// let ctl = kv_transfer::DeliveryControl::new();
    /// let out = exec.execute_for_prompt_at(env, prompt, &[4, 5], bank, &ctl).unwrap();
    /// assert_eq!(&out.target_blocks[..], &[4, 5]);
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`FetchExecutor::execute_for_prompt`] and [`FetchExecutor::execute_at`].
    pub fn execute_for_prompt_at(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
        dst_blocks: &[u32],
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        self.run(envelope, Some(prompt), Some(dst_blocks), donor, control)
    }

    /// [`FetchExecutor::execute`] for a request whose prompt's sealed blocks
    /// have the sequence hashes `prompt`: the hint is refused, before
    /// anything is touched, unless its `sequence_hashes` are a prefix of
    /// `prompt` ([`check_prompt_prefix`]).
    ///
    /// # Errors
    /// [`FetchError::PromptMismatch`] (naming the first differing block) or
    /// [`FetchError::HintBeyondPrompt`], else as [`FetchExecutor::execute`].
    pub fn execute_for_prompt(
        &self,
        envelope: &HintEnvelope,
        prompt: &[SequenceHash],
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        self.run(envelope, Some(prompt), None, donor, control)
    }

    fn run(
        &self,
        envelope: &HintEnvelope,
        prompt: Option<&[SequenceHash]>,
        dst_blocks: Option<&[u32]>,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
        let t0 = std::time::Instant::now();
        let us = |a: std::time::Instant, b: std::time::Instant| {
            b.saturating_duration_since(a).as_micros() as u64
        };
        self.reclaim_quiesced();
        let mut hints = envelope.fetch_gpu_actions()?;
        if hints.len() != 1 {
            return Err(FetchError::Malformed(DescriptorError::InvalidField {
                field: "hint.actions",
                reason: format!(
                    "expected exactly one kv.fetch_gpu action, got {}",
                    hints.len()
                ),
            }));
        }
        let hint = hints.remove(0);
        if let Some(prompt) = prompt {
            check_prompt_prefix(&hint, prompt)?;
        }
        let manifest = donor.manifest();
        let v = validate_hint(&hint, manifest, &self.layout)?;
        let n = v.slot_ids.len();

        let fallback =
            |stage: &'static str, cause: FallbackCause| FetchError::Fallback { stage, cause };
        let request_id = envelope.message_id.as_str();
        if let Some(b) = dst_blocks {
            // Range and repeats: `reserve_exact` checks them before it reads
            // the pool's state (mapped to the same argument errors).
            Self::check_dst_count(&hint, b)?;
        }
        let reservation = crate::spans::reserve(request_id)
            .in_scope(|| match dst_blocks {
                Some(b) => self.pool.reserve_exact(b),
                None => self.pool.reserve(n),
            })
            .map_err(reserve_error)?;
        let t_reserved = std::time::Instant::now();
        let fetched: Vec<SequenceHash> = hint.sequence_hashes[hint.fetch_from as usize..].to_vec();
        // Everything checkable here is checked before the donor is asked:
        // a refused plan must not have cost the donor a pin.
        let plan = match self.plan(manifest, &fetched, &v.slot_ids, reservation.blocks()) {
            Ok(p) => p,
            Err(e) => {
                reservation.cancel().quiesced();
                return Err(fallback("plan", FallbackCause::Transfer(e)));
            }
        };
        let t_planned = std::time::Instant::now();
        let pin = match donor.pin(&hint) {
            Ok(p) => p,
            Err(e) => {
                // Nothing was issued against these rows yet.
                reservation.cancel().quiesced();
                return Err(fallback("pin", FallbackCause::Pin(e)));
            }
        };
        let t_pinned = std::time::Instant::now();
        let result = crate::spans::transfer(request_id)
            .in_scope(|| self.transfer(&plan, pin.as_ref(), control));
        let t_transferred = std::time::Instant::now();
        let stages = |end: std::time::Instant| FetchStages {
            reserve_us: us(t0, t_reserved),
            plan_us: us(t_reserved, t_planned),
            pin_us: us(t_planned, t_pinned),
            transfer_us: us(t_pinned, t_transferred),
            verify_commit_us: us(t_transferred, end),
        };
        // Both successful arms below publish the rows the same way.
        let commit = |reservation: DestinationReservation, report: DeliveryReport| {
            let target_blocks =
                crate::spans::commit(request_id).in_scope(|| reservation.complete());
            FetchOutcome {
                target_blocks,
                fetch_from: hint.fetch_from,
                fetched,
                report,
                stages: stages(std::time::Instant::now()),
            }
        };
        let verify = crate::spans::verify(request_id);
        let checksums = pin.block_checksums().map(<[u64]>::to_vec);
        let released = pin.release();
        match result {
            Ok(_) if released.is_err() => {
                reservation.cancel().quiesced();
                let e = released.expect_err("guarded by is_err");
                Err(fallback("verify", FallbackCause::PinNotHeld(e)))
            }
            Ok(report)
                if report.is_complete()
                    && report.counters.bytes == v.total_bytes
                    && checksums.is_some() =>
            {
                // Before anything is published: bytes read by address may
                // be another block's (a wrong but registered address).
                let expected = checksums.as_deref().unwrap_or_default();
                match verify
                    .in_scope(|| self.check_blocks(manifest, expected, reservation.blocks()))
                {
                    Ok(()) => Ok(commit(reservation, report)),
                    Err(e) => {
                        reservation.cancel().quiesced();
                        Err(fallback("verify", FallbackCause::BlockChecksum(e)))
                    }
                }
            }
            Ok(report)
                if verify.in_scope(|| {
                    report.is_complete() && report.counters.bytes == v.total_bytes
                }) =>
            {
                Ok(commit(reservation, report))
            }
            Ok(report) => {
                reservation.cancel().quiesced();
                Err(fallback(
                    "verify",
                    FallbackCause::ShortDelivery {
                        status: report.status,
                        moved: report.counters.bytes,
                        expected: v.total_bytes,
                    },
                ))
            }
            Err(Failed {
                error,
                may_still_write,
            }) => {
                if may_still_write {
                    // An abandoned read may still land in these rows: they
                    // stay orphaned (unusable) instead of returning to the
                    // pool; `DestinationPool::reclaim_orphans_after_quiesce`
                    // frees them once the backend has quiesced.
                    drop(reservation.cancel());
                } else {
                    // Nothing of this delivery is in flight any more.
                    reservation.cancel().quiesced();
                }
                Err(error)
            }
        }
    }

    /// The copy plan of one fetch: `slots[i]` of the donor to
    /// `dst_blocks[i]` here, on every rank. Pure arithmetic over the
    /// manifest's and this executor's geometry.
    fn plan(
        &self,
        manifest: &BankManifest,
        fetched: &[SequenceHash],
        slots: &[u32],
        dst_blocks: &[u32],
    ) -> Result<TransferPlan, kv_transfer::TransferError> {
        let moves: Vec<BlockMove> = fetched
            .iter()
            .zip(slots)
            .zip(dst_blocks)
            .map(|((key, slot), dst)| BlockMove {
                key: *key,
                src_slot: Some(*slot),
                dst_block: *dst,
            })
            .collect();
        let tp = self.layout.tp_size() as usize;
        if let Some(targets) = &self.engine_layouts {
            let (dl, slots) = (manifest.layout(), manifest.slot_count());
            let bank_bytes = u64::from(slots) * dl.rank_block_bytes() as u64;
            let donor = (0..tp as u32)
                .map(|r| {
                    KvRegionLayout::block_major(*dl, r, 0, slots, bank_bytes).map_err(|source| {
                        TransferError::RegionLayout {
                            field: "donor",
                            rank: r,
                            source,
                        }
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            return TransferPlan::converting(&donor, targets, &moves);
        }
        let donor_geo = vec![RegionGeometry::dense(manifest.layout(), manifest.slot_count()); tp];
        let target_geo = vec![RegionGeometry::dense(&self.layout, self.blocks); tp];
        TransferPlan::new(
            manifest.layout(),
            &self.layout,
            &moves,
            &donor_geo,
            &target_geo,
        )
    }

    /// Checks the received rows `dst_blocks` against the donor's block
    /// `checksums`: pool rows are hashed in place; engine regions are
    /// gathered back through their layouts into the donor's block-major
    /// byte order first (same checksum, whatever the engine's layout).
    fn check_blocks(
        &self,
        manifest: &BankManifest,
        checksums: &[u64],
        dst_blocks: &[u32],
    ) -> Result<(), crate::BlockChecksumError> {
        use crate::worker::block_checksums::{verify, verify_engine};
        if let Some(layouts) = &self.engine_layouts {
            return verify_engine(checksums, &self.regions, layouts, dst_blocks);
        }
        let rbb = self.layout.rank_block_bytes();
        if manifest.layout().rank_block_bytes() != rbb {
            return Err(crate::BlockChecksumError::Unverifiable {
                reason: format!(
                    "pool rows of {rbb} bytes, the donor's blocks are {}",
                    manifest.layout().rank_block_bytes()
                ),
            });
        }
        verify(checksums, &self.regions, dst_blocks, rbb)
    }

    fn transfer(
        &self,
        plan: &TransferPlan,
        pin: &dyn DonorPin,
        control: &DeliveryControl,
    ) -> Result<DeliveryReport, Failed> {
        let mut io = Vec::with_capacity(plan.parts().len());
        for part in plan.parts() {
            let r = part.tp_rank();
            let src = pin.rank_source(r).ok_or(Failed {
                error: FetchError::Fallback {
                    stage: "pin",
                    cause: FallbackCause::MissingRankMemory { rank: r },
                },
                may_still_write: false,
            })?;
            io.push(RankIo {
                src,
                dst: self.regions[r as usize].as_ref(),
            });
        }
        deliver(plan, self.backend.as_ref(), &io, control).map_err(|e| Failed {
            may_still_write: e.may_still_write(),
            error: FetchError::Fallback {
                stage: "transfer",
                cause: FallbackCause::Transfer(e),
            },
        })
    }
}

/// A destination pool refusal as the fetch's error: a bad id of the
/// caller's list (out of range, repeated) is the caller's argument error;
/// anything else (a block another fetch holds, a full pool) is contention,
/// a fallback at `reserve`.
fn reserve_error(e: kv_bank::BankError) -> FetchError {
    use kv_bank::BankError as B;
    match e {
        B::BlockOutOfRange {
            index,
            block,
            capacity,
        } => FetchError::DstBlockOutOfRange {
            index,
            block,
            capacity,
        },
        B::DuplicateBlock {
            index,
            block,
            first,
        } => FetchError::DstBlockRepeated {
            index,
            block,
            first,
        },
        e => FetchError::Fallback {
            stage: "reserve",
            cause: FallbackCause::Bank(e),
        },
    }
}

/// A failed transfer, and whether its destination rows may still be written.
struct Failed {
    error: FetchError,
    may_still_write: bool,
}
