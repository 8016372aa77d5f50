//! Multipart delivery: one part per TP rank, complete only when every part
//! delivered exactly its expected bytes.

use kv_bank::{BankMemory, MemoryKind};
use serde::{Deserialize, Serialize};

use crate::plan::{MissingKey, PartPlan, TransferPlan};
use crate::{DeliveryControl, TransferError};

/// Donor memory registered with a remote NIXL agent: not mapped here, read
/// through the agent. `base_addr` is the address in the donor process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlRemoteRegion {
    /// Remote agent name (as returned by loading its metadata).
    pub agent_name: String,
    /// First byte of the donor region in the donor's address space.
    pub base_addr: u64,
    /// Region length in bytes.
    pub len: u64,
    /// Host (DRAM) or CUDA device (VRAM, with the donor's device ordinal).
    pub kind: MemoryKind,
}

/// Where one rank's donor bytes are.
#[derive(Debug, Clone, Copy)]
pub enum SourceRegion<'a> {
    /// Mapped into this process (host shm, CUDA IPC import, local allocation).
    Mapped(&'a dyn BankMemory),
    /// Reachable through a NIXL agent.
    Nixl(&'a NixlRemoteRegion),
}

impl SourceRegion<'_> {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            SourceRegion::Mapped(m) => m.len() as u64,
            SourceRegion::Nixl(r) => r.len,
        }
    }
    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Memory kind.
    pub fn kind(&self) -> MemoryKind {
        match self {
            SourceRegion::Mapped(m) => m.kind(),
            SourceRegion::Nixl(r) => r.kind,
        }
    }
}

/// The memory of one rank's part: donor region and target region.
#[derive(Debug, Clone, Copy)]
pub struct RankIo<'a> {
    /// Donor region (offset 0 = donor slot 0).
    pub src: SourceRegion<'a>,
    /// Target region (offset 0 = target block 0). Its rows must be reserved
    /// for this delivery: nobody else reads or writes them until it returns.
    pub dst: &'a dyn BankMemory,
}

/// What one backend reports after running one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartOutcome {
    /// Payload bytes moved.
    pub bytes: u64,
    /// Copy operations issued (memcpy calls, device copies, kernel launches,
    /// NIXL requests).
    pub copies: u64,
    /// Payload bytes that passed through host memory.
    pub host_payload_bytes: u64,
    /// Transport that actually moved the bytes, or `"unknown"` when the
    /// backend cannot tell.
    pub transport: String,
}

/// A way to move bytes for one rank. Implementations: host memcpy, CUDA
/// device copies / gather kernel, NIXL.
pub trait CopyBackend: Send + Sync {
    /// Short stable name (`host_memcpy`, `cuda_ipc`, `nixl`).
    fn name(&self) -> &'static str;

    /// Copies every run of `part` from `io.src` to `io.dst` and returns when
    /// the bytes have landed (or the attempt is over and nothing is in
    /// flight, except after [`TransferError::NotQuiesced`]).
    ///
    /// Called only after [`deliver`] checked that every run lies inside both
    /// regions.
    ///
    /// # Errors
    /// Unsupported memory kinds, cancellation / deadline observed between
    /// batches, donor unreachable, backend failures;
    /// [`TransferError::NotQuiesced`] when an abandoned read could not be
    /// stopped and may still write `io.dst`.
    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError>;

    /// Abandoned reads ([`TransferError::NotQuiesced`]) that may still write
    /// their destination, after reaping those that have since finished or
    /// failed. When it returns 0, rows orphaned by such reads may be reused
    /// (`kv_bank::DestinationPool::reclaim_orphans_after_quiesce`). Backends
    /// that never abandon a read in flight keep the default, 0.
    fn in_flight(&self) -> usize {
        0
    }

    /// True when [`CopyBackend::copy_part`] executes converting parts
    /// ([`PartPlan::conversion`]: every [`crate::convert::Piece`] from donor
    /// to target, the conversion inside the copy). [`deliver`] refuses such a
    /// part for a backend that returns false (the default) with
    /// [`TransferError::UnsupportedLayout`] before a byte moves.
    fn converts(&self) -> bool {
        false
    }
}

/// Whether a delivery may be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum DeliveryStatus {
    /// Every requested key was delivered on every rank with its expected bytes.
    Complete,
    /// Some keys were absent on the donor: their destination rows were not
    /// touched; the present keys were copied. Not a completion.
    Incomplete {
        /// The absent keys.
        missing: Vec<MissingKey>,
    },
}

/// Totals of one delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryCounters {
    /// Payload bytes moved, all ranks.
    pub bytes: u64,
    /// Copy operations issued, all ranks.
    pub copies: u64,
    /// Payload bytes that passed through host memory (0 on the GPU path).
    pub host_payload_bytes: u64,
    /// Backend name.
    pub backend: String,
    /// Transport that actually ran (`"unknown"` when the backend cannot tell);
    /// distinct transports of the parts are joined with `+`.
    pub transport: String,
}

/// Per-rank result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartReport {
    /// TP rank.
    pub tp_rank: u32,
    /// Bytes moved (equal to the plan's expected bytes, or the delivery failed).
    pub bytes: u64,
    /// Copy operations.
    pub copies: u64,
}

/// Result of a delivery that did not fail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryReport {
    /// Complete, or incomplete with the missing keys.
    pub status: DeliveryStatus,
    /// Totals.
    pub counters: DeliveryCounters,
    /// One entry per rank, in rank order.
    pub parts: Vec<PartReport>,
    /// Wall time from the first check to the last, in µs.
    pub elapsed_us: u64,
}

impl DeliveryReport {
    /// True only for [`DeliveryStatus::Complete`].
    pub fn is_complete(&self) -> bool {
        self.status == DeliveryStatus::Complete
    }
}

/// Runs `plan` with `backend`, one part per rank, concurrently when TP > 1.
///
/// Before a byte moves, every run is checked against both regions of its rank
/// (`io[r]`), the control is checked and the donor probed. After the parts,
/// each part's bytes must equal its expected bytes, GPU destinations must have
/// seen no host payload, and the control and donor are checked again.
///
/// ```
/// use kv_bank::BankMemory;
/// use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
/// use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
/// use kv_transfer::{deliver, DeliveryControl, HostBuffer, HostCopyBackend, RankIo, SourceRegion};
/// let l = KvLayout::new(1, 1, 4, DType::F32, 2, TensorOrder::BlockMajor, 1).unwrap();
/// let g = [RegionGeometry::dense(&l, 4)];
/// let mut donor = HostBuffer::zeroed(g[0].region_bytes() as usize).unwrap();
/// donor.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
/// let target = HostBuffer::zeroed(g[0].region_bytes() as usize).unwrap();
/// let moves = [BlockMove { key: SequenceHash(1), src_slot: Some(2), dst_block: 0 }];
/// let plan = TransferPlan::new(&l, &l, &moves, &g, &g).unwrap();
/// let io = [RankIo { src: SourceRegion::Mapped(&donor), dst: &target }];
/// let r = deliver(&plan, &HostCopyBackend, &io, &DeliveryControl::new()).unwrap();
/// assert!(r.is_complete());
/// // rank block = 2 (K,V) x 1 layer x 2 tokens x 1 head x 4 dims x 4 bytes = 64
/// assert_eq!(target.read_vec(0, 64).unwrap(), donor.read_vec(128, 64).unwrap());
/// ```
///
/// # Errors
/// `io` of the wrong length or a run outside a region ([`TransferError::InvalidInput`]),
/// cancellation, deadline, donor loss, [`TransferError::HostStaged`],
/// [`TransferError::ShortPart`], or [`TransferError::PartFailed`] for the
/// first failing rank. When any part may still write its destination
/// ([`TransferError::may_still_write`]), that part's error is returned
/// (wrapped in [`TransferError::PartFailed`]) whatever the other parts
/// reported, so the combined error never hides a read still in flight.
/// Any error means the destination rows must not be used.
pub fn deliver(
    plan: &TransferPlan,
    backend: &dyn CopyBackend,
    io: &[RankIo<'_>],
    control: &DeliveryControl,
) -> Result<DeliveryReport, TransferError> {
    let t0 = std::time::Instant::now();
    if io.len() != plan.parts().len() {
        return Err(TransferError::input(
            "io",
            format!(
                "plan has {} rank parts but {} rank regions were given",
                plan.parts().len(),
                io.len()
            ),
        ));
    }
    for (part, rio) in plan.parts().iter().zip(io) {
        if let Some(c) = part.conversion() {
            if !backend.converts() {
                return Err(TransferError::UnsupportedLayout {
                    backend: backend.name(),
                    rank: part.tp_rank(),
                    src: format!("{:?}", c.src().order()),
                    dst: format!("{:?}", c.dst().order()),
                });
            }
        }
        // A conversion's pieces lie inside its layouts' regions (checked
        // when the layouts were built); the regions must fit the memory.
        // For rows, the furthest run end on each side, found when the plan
        // was built (its runs cannot change since): no pass over the runs
        // before the first byte moves (a scattered part of 4096 runs is
        // 160 KiB).
        let (src_end, dst_end) = part.region_ends();
        if src_end > rio.src.len() {
            return Err(TransferError::input(
                "io.src",
                format!(
                    "rank {} reads up to byte {src_end} of a {}-byte donor region",
                    part.tp_rank(),
                    rio.src.len()
                ),
            ));
        }
        if dst_end > rio.dst.len() as u64 {
            return Err(TransferError::input(
                "io.dst",
                format!(
                    "rank {} writes up to byte {dst_end} of a {}-byte target region",
                    part.tp_rank(),
                    rio.dst.len()
                ),
            ));
        }
    }
    control.check()?;
    for part in plan.parts() {
        control.check_donor(part.tp_rank())?;
    }

    let outcomes: Vec<Result<PartOutcome, TransferError>> = if plan.parts().len() == 1 {
        vec![backend.copy_part(&plan.parts()[0], &io[0], control)]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = plan
                .parts()
                .iter()
                .zip(io)
                .map(|(part, rio)| s.spawn(move || backend.copy_part(part, rio, control)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(TransferError::Host("a part's copy thread panicked".into()))
                    })
                })
                .collect()
        })
    };

    // A part that may still write decides the delivery's error, whatever
    // rank reported first: every other error is returned only once nothing
    // is in flight, so returning one of those would let the caller hand rows
    // back to its pool while this part's read can still land in them.
    if let Some(idx) = outcomes
        .iter()
        .position(|o| matches!(o, Err(e) if e.may_still_write()))
    {
        let rank = plan.parts()[idx].tp_rank();
        if let Some(Err(e)) = outcomes.into_iter().nth(idx) {
            return Err(TransferError::PartFailed {
                rank,
                source: Box::new(e),
            });
        }
        unreachable!("outcome {idx} was selected as an error");
    }

    let mut parts = Vec::with_capacity(outcomes.len());
    let mut counters = DeliveryCounters {
        bytes: 0,
        copies: 0,
        host_payload_bytes: 0,
        backend: backend.name().to_string(),
        transport: String::new(),
    };
    let mut transports: Vec<String> = Vec::new();
    for ((part, rio), outcome) in plan.parts().iter().zip(io).zip(outcomes) {
        let o = match outcome {
            Ok(o) => o,
            Err(e @ (TransferError::Cancelled | TransferError::DeadlineExceeded { .. })) => {
                return Err(e)
            }
            Err(e) => {
                return Err(TransferError::PartFailed {
                    rank: part.tp_rank(),
                    source: Box::new(e),
                })
            }
        };
        if o.bytes != part.expected_bytes() {
            return Err(TransferError::ShortPart {
                rank: part.tp_rank(),
                got: o.bytes,
                expected: part.expected_bytes(),
            });
        }
        if matches!(rio.dst.kind(), MemoryKind::Cuda { .. }) && o.host_payload_bytes > 0 {
            return Err(TransferError::HostStaged {
                rank: part.tp_rank(),
                bytes: o.host_payload_bytes,
            });
        }
        counters.bytes += o.bytes;
        counters.copies += o.copies;
        counters.host_payload_bytes += o.host_payload_bytes;
        if !transports.contains(&o.transport) {
            transports.push(o.transport);
        }
        parts.push(PartReport {
            tp_rank: part.tp_rank(),
            bytes: o.bytes,
            copies: o.copies,
        });
    }
    counters.transport = transports.join("+");
    control.check()?;
    for part in plan.parts() {
        control.check_donor(part.tp_rank())?;
    }
    let status = if plan.missing().is_empty() {
        DeliveryStatus::Complete
    } else {
        DeliveryStatus::Incomplete {
            missing: plan.missing().to_vec(),
        }
    };
    Ok(DeliveryReport {
        status,
        counters,
        parts,
        elapsed_us: t0.elapsed().as_micros() as u64,
    })
}
