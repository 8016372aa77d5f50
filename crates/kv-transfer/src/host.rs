//! Host-memory backend: `memcpy` between mapped host regions (the CPU
//! profile: host shared memory banks, process-private destination rows, an
//! engine's own host tensors). Converting parts are copied piece by piece
//! straight into the target layout: the conversion is the gather itself, so
//! every layout runs in CI through the same descriptions as the GPU path.

use kv_bank::MemoryKind;

use crate::delivery::{CopyBackend, PartOutcome, RankIo, SourceRegion};
use crate::plan::PartPlan;
use crate::{DeliveryControl, TransferError};

/// Bytes copied between two cancellation / deadline checks. Large enough that
/// the check costs nothing, small enough that a cancel lands within ~1 ms.
const CHECK_EVERY_BYTES: u64 = 16 << 20;

/// Copies runs with `memcpy` (one call per coalesced run, or per merged
/// [`crate::convert::Piece`] of a converting part) on the calling thread.
/// Both regions must be host memory mapped into this process. Every byte
/// counts as host payload.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostCopyBackend;

impl CopyBackend for HostCopyBackend {
    fn name(&self) -> &'static str {
        "host_memcpy"
    }

    fn converts(&self) -> bool {
        true
    }

    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        let src = match io.src {
            SourceRegion::Mapped(m) if m.kind() == MemoryKind::Host => m,
            other => {
                return Err(TransferError::UnsupportedMemory {
                    backend: self.name(),
                    rank: part.tp_rank(),
                    src: format!("{:?}", other.kind()),
                    dst: format!("{:?}", io.dst.kind()),
                })
            }
        };
        if io.dst.kind() != MemoryKind::Host {
            return Err(TransferError::UnsupportedMemory {
                backend: self.name(),
                rank: part.tp_rank(),
                src: "Host".into(),
                dst: format!("{:?}", io.dst.kind()),
            });
        }
        let (sb, db) = (src.base_addr(), io.dst.base_addr());
        let (mut bytes, mut copies, mut since_check) = (0u64, 0u64, 0u64);
        let mut copy = |src_offset: u64, dst_offset: u64, len: u64| {
            if since_check >= CHECK_EVERY_BYTES {
                control.check()?;
                since_check = 0;
            }
            // SAFETY: `deliver` checked that both ranges lie inside their
            // regions (a run's offsets, or a conversion's layouts' region
            // sizes, whose every piece the validated `KvRegionLayout`s keep
            // inside), which stay mapped while `io` borrows them. The copy
            // goes through raw pointers and touches exactly these two ranges;
            // no `BankMemory` hands out references into its bytes (the
            // trait's aliasing rule), so no Rust reference is invalidated.
            // The target rows are reserved for this delivery (no other
            // reader or writer until it returns) and the donor rows are
            // pinned (not rewritten while pinned). `ptr::copy` (memmove)
            // rather than `copy_nonoverlapping`: nothing in `RankIo` stops a
            // caller from passing one region as both source and destination,
            // and overlapping ranges must then not be undefined behaviour.
            unsafe {
                std::ptr::copy(
                    (sb + src_offset) as *const u8,
                    (db + dst_offset) as *mut u8,
                    len as usize,
                );
            }
            bytes += len;
            since_check += len;
            copies += 1;
            Ok::<(), TransferError>(())
        };
        match part.conversion() {
            Some(c) => {
                for p in c.pieces() {
                    copy(p.src_offset, p.dst_offset, p.len)?;
                }
            }
            None => {
                for run in part.runs() {
                    copy(run.src_offset, run.dst_offset, run.len)?;
                }
            }
        }
        Ok(PartOutcome {
            bytes,
            copies,
            host_payload_bytes: bytes,
            transport: "memcpy".into(),
        })
    }
}
