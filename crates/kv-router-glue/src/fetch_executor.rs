//! The prefill-side fetch executor: validate the hint, reserve destination
//! blocks, pin the donor's slots, transfer, verify, commit, or fall back.
//!
//! Order matters: the hint is checked against the donor's manifest and the
//! target's layout before the destination pool or the donor is touched, so a
//! forged, stale or out-of-range hint costs nothing. After that, every
//! failure cancels the reservation (quiesced once the delivery returned, as
//! nothing is then in flight) and drops the pin; the request recomputes.

use std::sync::Arc;

use kv_bank::{BankManager, BankMemory, DestinationPool, ManagerPin};
use kv_descriptor::{
    BankManifest, DescriptorError, FetchGpuHint, HintEnvelope, KvLayout, SequenceHash,
};
use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
use kv_transfer::{deliver, CopyBackend, DeliveryControl, DeliveryReport, RankIo, SourceRegion};

use crate::{validate_hint, FetchError};

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
}

/// A donor bank the target can read.
pub trait DonorSource {
    /// The donor's manifest, as the target trusts it (imported from the donor).
    fn manifest(&self) -> &BankManifest;
    /// Pins the hinted slots, checking that they still hold the hinted blocks.
    ///
    /// # Errors
    /// A reason when the donor refuses (stale generation, slot reused, closed).
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, String>;
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
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, String> {
        self.pin_hint(hint)
            .map(|p| Box::new(p) as Box<dyn DonorPin>)
            .map_err(|e| e.to_string())
    }
}

/// A completed fetch: the target blocks now hold the fetched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchOutcome {
    /// Target block ids, one per fetched block, in prefix order; now owned by
    /// the caller's native cache.
    pub target_blocks: Vec<u32>,
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
    /// `tp_size` or a region is smaller than `blocks` rows.
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

    /// Runs the single `kv.fetch_gpu@1.0` action of `envelope` from `donor`.
    ///
    /// # Errors
    /// Hint errors ([`FetchError::Malformed`], [`FetchError::WrongEngine`],
    /// [`FetchError::StaleGeneration`], [`FetchError::LayoutMismatch`],
    /// [`FetchError::SlotOutOfRange`], [`FetchError::InconsistentSlots`],
    /// [`FetchError::NotADonor`]) before anything is touched; then
    /// [`FetchError::Fallback`] at `reserve`, `pin`, `plan`, `transfer` or
    /// `verify`, with the reservation cancelled and the pin released.
    pub fn execute(
        &self,
        envelope: &HintEnvelope,
        donor: &dyn DonorSource,
        control: &DeliveryControl,
    ) -> Result<FetchOutcome, FetchError> {
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
        let manifest = donor.manifest();
        let v = validate_hint(&hint, manifest, &self.layout)?;
        let n = v.slot_ids.len();

        let fallback = |stage: &'static str, reason: String| FetchError::Fallback { stage, reason };
        let request_id = envelope.message_id.as_str();
        let reservation = crate::spans::reserve(request_id)
            .in_scope(|| self.pool.reserve(n))
            .map_err(|e| fallback("reserve", e.to_string()))?;
        let pin = match donor.pin(&hint) {
            Ok(p) => p,
            Err(e) => {
                // Nothing was issued against these rows yet.
                reservation.cancel().quiesced();
                return Err(fallback("pin", e));
            }
        };
        let fetched: Vec<SequenceHash> = hint.sequence_hashes[hint.fetch_from as usize..].to_vec();
        let result = crate::spans::transfer(request_id).in_scope(|| {
            self.transfer(
                &hint,
                manifest,
                &fetched,
                &v.slot_ids,
                reservation.blocks(),
                pin.as_ref(),
                control,
            )
        });
        let verify = crate::spans::verify(request_id);
        drop(pin);
        match result {
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
                    format!(
                        "delivery {:?} moved {} of {} bytes",
                        report.status, report.counters.bytes, v.total_bytes
                    ),
                ))
            }
            Err(e) => {
                // `deliver` returns only when nothing is in flight.
                reservation.cancel().quiesced();
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        hint: &FetchGpuHint,
        manifest: &BankManifest,
        fetched: &[SequenceHash],
        slots: &[u32],
        dst_blocks: &[u32],
        pin: &dyn DonorPin,
        control: &DeliveryControl,
    ) -> Result<DeliveryReport, FetchError> {
        let fallback = |stage: &'static str, reason: String| FetchError::Fallback { stage, reason };
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
        let tp = hint.tp_size as usize;
        let donor_geo = vec![RegionGeometry::dense(manifest.layout(), manifest.slot_count()); tp];
        let target_geo = vec![RegionGeometry::dense(&self.layout, self.blocks); tp];
        let plan = TransferPlan::new(
            manifest.layout(),
            &self.layout,
            &moves,
            &donor_geo,
            &target_geo,
        )
        .map_err(|e| fallback("plan", e.to_string()))?;
        let mut io = Vec::with_capacity(tp);
        for r in 0..tp {
            let src = pin
                .rank_source(r as u32)
                .ok_or_else(|| fallback("pin", format!("donor pin has no memory for rank {r}")))?;
            io.push(RankIo {
                src,
                dst: self.regions[r].as_ref(),
            });
        }
        deliver(&plan, self.backend.as_ref(), &io, control)
            .map_err(|e| fallback("transfer", e.to_string()))
    }
}
