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

use std::sync::Arc;

use kv_bank::{BankManager, BankMemory, CompletedBlocks, DestinationPool, ManagerPin};
use kv_descriptor::{
    BankManifest, DescriptorError, FetchGpuHint, HintEnvelope, KvLayout, SequenceHash,
};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{deliver, CopyBackend, DeliveryControl, DeliveryReport, RankIo, SourceRegion};

use crate::{check_prompt_prefix, validate_hint, FallbackCause, FetchError, PinError};

/// Pinned donor slots; the pin is released on drop.
pub trait DonorPin {
    /// Rank `rank`'s donor region (offset 0 = slot 0), mapped in this process.
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory>;

    /// Where rank `rank`'s donor bytes are read from. Defaults to the mapped
    /// [`DonorPin::rank_memory`]; a donor reached through a NIXL agent (another
    /// host) returns [`SourceRegion::Nixl`] instead, with `rank_memory` `None`.
    fn rank_source(&self, rank: u32) -> Option<SourceRegion<'_>> {
        self.rank_memory(rank).map(SourceRegion::Mapped)
    }

    /// Releases the pin, reporting whether it held from grant to now.
    ///
    /// The executor calls this after the delivery and completes the fetch
    /// only on `Ok`: a pin the donor dropped early (a remote pin past its
    /// hold bound, or whose connection failed) may have let the slots be
    /// reused while they were read. An in-process [`ManagerPin`] cannot end
    /// early, so the default (drop, `Ok`) is right for it.
    ///
    /// # Errors
    /// Why the pin cannot be trusted to have held throughout (e.g.
    /// [`PinError::Expired`], or a transport [`PinError::Io`] /
    /// [`PinError::Timeout`] after which the donor may have dropped it).
    fn release(self: Box<Self>) -> Result<(), PinError> {
        Ok(())
    }
}

/// A donor bank the target can read.
pub trait DonorSource {
    /// The donor's manifest, as the target trusts it (imported from the donor).
    fn manifest(&self) -> &BankManifest;
    /// Pins the hinted slots, checking that they still hold the hinted blocks.
    ///
    /// # Errors
    /// A [`PinError`]: a refusal carrying its
    /// [`kv_descriptor::PinRefusalReason`] (stale generation, slot reused,
    /// closed, ...; [`PinError::refusal_reason`]), or a transport, timeout
    /// or protocol failure. Nothing is pinned on error.
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError>;
}

impl DonorPin for ManagerPin {
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory> {
        self.rank(rank).ok().map(|b| b.memory().as_ref())
    }
}

impl DonorSource for BankManager {
    fn manifest(&self) -> &BankManifest {
        BankManager::manifest(self)
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        self.pin_hint(hint)
            .map(|p| Box::new(p) as Box<dyn DonorPin>)
            .map_err(PinError::Bank)
    }
}

/// A completed fetch: the target blocks now hold the fetched prefix.
#[derive(Debug, PartialEq, Eq)]
pub struct FetchOutcome {
    /// Target block ids, one per fetched block, in prefix order. They stay
    /// out of the executor's pool, so no later fetch overwrites them, until
    /// this outcome (or the moved-out guard) is dropped: keep it while the
    /// request's cache reads them.
    pub target_blocks: CompletedBlocks,
    /// Index of the first fetched block in the request.
    pub fetch_from: u32,
    /// Sequence hashes of the fetched blocks.
    pub fetched: Vec<SequenceHash>,
    /// The delivery's report (bytes, copies, host payload, transport).
    pub report: DeliveryReport,
}

/// Executes fetch hints into one target's block regions.
pub struct FetchExecutor {
    layout: KvLayout,
    pool: DestinationPool,
    regions: Vec<Arc<dyn BankMemory>>,
    blocks: u32,
    backend: Arc<dyn CopyBackend>,
}

impl std::fmt::Debug for FetchExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchExecutor")
            .field("layout", &self.layout)
            .field("blocks", &self.blocks)
            .field("backend", &self.backend.name())
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
        self.run(envelope, None, donor, control)
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
        self.run(envelope, Some(prompt), donor, control)
    }

    fn run(
        &self,
        envelope: &HintEnvelope,
        prompt: Option<&[SequenceHash]>,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
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
        let reservation = crate::spans::reserve(request_id)
            .in_scope(|| self.pool.reserve(n))
            .map_err(|e| fallback("reserve", FallbackCause::Bank(e)))?;
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
        let pin = match donor.pin(&hint) {
            Ok(p) => p,
            Err(e) => {
                // Nothing was issued against these rows yet.
                reservation.cancel().quiesced();
                return Err(fallback("pin", FallbackCause::Pin(e)));
            }
        };
        let result = crate::spans::transfer(request_id)
            .in_scope(|| self.transfer(&plan, pin.as_ref(), control));
        let verify = crate::spans::verify(request_id);
        let released = pin.release();
        match result {
            Ok(_) if released.is_err() => {
                reservation.cancel().quiesced();
                let e = released.expect_err("guarded by is_err");
                Err(fallback("verify", FallbackCause::PinNotHeld(e)))
            }
            Ok(report)
                if verify.in_scope(|| {
                    report.is_complete() && report.counters.bytes == v.total_bytes
                }) =>
            {
                Ok(FetchOutcome {
                    target_blocks: crate::spans::commit(request_id)
                        .in_scope(|| reservation.complete()),
                    fetch_from: hint.fetch_from,
                    fetched,
                    report,
                })
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

    fn transfer(
        &self,
        plan: &TransferPlan,
        pin: &dyn DonorPin,
        control: &DeliveryControl,
    ) -> Result<DeliveryReport, Failed> {
        let mut io = Vec::with_capacity(plan.parts().len());
        for part in plan.parts() {
            let r = part.tp_rank;
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

/// A failed transfer, and whether its destination rows may still be written.
struct Failed {
    error: FetchError,
    may_still_write: bool,
}
