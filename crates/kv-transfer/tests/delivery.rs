//! Delivery semantics over real host memory: completion only when every part
//! delivered its bytes; cancellation, deadline, donor loss, a failing rank,
//! a short part and host staging on the GPU path all fail the whole delivery;
//! missing keys leave their rows untouched.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_bank::{BankMemory, MemoryKind};
use kv_descriptor::{DType, ExportHandle, KvLayout, SequenceHash, TensorOrder};
use kv_transfer::plan::{BlockMove, PartPlan, RegionGeometry, TransferPlan};
use kv_transfer::{
    deliver, CopyBackend, DeliveryControl, DeliveryStatus, HostBuffer, HostCopyBackend,
    PartOutcome, RankIo, SourceRegion, TransferError,
};
use proptest::prelude::*;

const POISON: u8 = 0x5A;

fn layout(tp: u32) -> KvLayout {
    KvLayout::new(2, 2 * tp, 16, DType::Bf16, 4, TensorOrder::BlockMajor, tp).unwrap()
}

struct Group {
    donors: Vec<HostBuffer>,
    targets: Vec<HostBuffer>,
    geom: RegionGeometry,
    bb: usize,
}

impl Group {
    fn new(l: &KvLayout, rows: u32) -> Self {
        let geom = RegionGeometry::dense(l, rows);
        let bb = l.rank_block_bytes();
        let donors = (0..l.tp_size())
            .map(|r| {
                let mut d = HostBuffer::zeroed(geom.region_bytes() as usize).unwrap();
                for (i, b) in d.as_mut_slice().iter_mut().enumerate() {
                    *b = byte(r, (i / bb) as u32, i % bb);
                }
                d
            })
            .collect();
        let targets = (0..l.tp_size())
            .map(|_| {
                let mut t = HostBuffer::zeroed(geom.region_bytes() as usize).unwrap();
                t.as_mut_slice().fill(POISON);
                t
            })
            .collect();
        Self {
            donors,
            targets,
            geom,
            bb,
        }
    }
    fn io(&self) -> Vec<RankIo<'_>> {
        self.donors
            .iter()
            .zip(&self.targets)
            .map(|(d, t)| RankIo {
                src: SourceRegion::Mapped(d),
                dst: t,
            })
            .collect()
    }
    fn row(&self, rank: usize, block: u32) -> Vec<u8> {
        self.targets[rank]
            .read_vec(block as usize * self.bb, self.bb)
            .unwrap()
    }
}

fn byte(rank: u32, slot: u32, i: usize) -> u8 {
    (i as u32 ^ slot.wrapping_mul(37) ^ rank.wrapping_mul(91)).wrapping_add(1) as u8
}

fn mv(k: u64, s: Option<u32>, d: u32) -> BlockMove {
    BlockMove {
        key: SequenceHash(k),
        src_slot: s,
        dst_block: d,
    }
}

/// Host copies, except for one rank whose part is replaced by `fault`.
struct FaultyRank {
    rank: u32,
    fault: fn(&PartPlan) -> Result<PartOutcome, TransferError>,
}

impl CopyBackend for FaultyRank {
    fn name(&self) -> &'static str {
        "faulty_rank"
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        c: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        if part.tp_rank() == self.rank {
            return (self.fault)(part);
        }
        HostCopyBackend.copy_part(part, io, c)
    }
}

#[test]
fn tp2_complete_delivery_copies_exact_rows() {
    let l = layout(2);
    let g = Group::new(&l, 16);
    let moves = [mv(1, Some(2), 0), mv(2, Some(3), 1), mv(3, Some(11), 7)];
    let plan = TransferPlan::new(&l, &l, &moves, &[g.geom; 2], &[g.geom; 2]).unwrap();
    let rep = deliver(&plan, &HostCopyBackend, &g.io(), &DeliveryControl::new()).unwrap();
    assert!(rep.is_complete());
    assert_eq!(rep.counters.bytes, 2 * 3 * g.bb as u64);
    assert_eq!(rep.counters.copies, 4, "two runs per rank");
    assert_eq!(
        rep.parts.iter().map(|p| p.tp_rank).collect::<Vec<_>>(),
        [0, 1]
    );
    for r in 0..2 {
        for m in &moves {
            let s = m.src_slot.unwrap();
            assert!(g
                .row(r, m.dst_block)
                .iter()
                .enumerate()
                .all(|(i, &b)| b == byte(r as u32, s, i)));
        }
        assert!(
            g.row(r, 2).iter().all(|&b| b == POISON),
            "rows outside the plan are untouched"
        );
    }
}

#[test]
fn any_failing_rank_fails_the_delivery() {
    let l = layout(2);
    let g = Group::new(&l, 8);
    let plan = TransferPlan::new(&l, &l, &[mv(1, Some(0), 0)], &[g.geom; 2], &[g.geom; 2]).unwrap();
    let backend = FaultyRank {
        rank: 1,
        fault: |p| {
            Err(TransferError::DonorUnreachable {
                rank: p.tp_rank(),
                reason: "injected".into(),
            })
        },
    };
    match deliver(&plan, &backend, &g.io(), &DeliveryControl::new()).unwrap_err() {
        TransferError::PartFailed { rank: 1, source } => {
            assert!(matches!(
                *source,
                TransferError::DonorUnreachable { rank: 1, .. }
            ))
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn a_short_part_is_never_complete() {
    let l = layout(2);
    let g = Group::new(&l, 8);
    let plan = TransferPlan::new(
        &l,
        &l,
        &[mv(1, Some(0), 0), mv(2, Some(5), 3)],
        &[g.geom; 2],
        &[g.geom; 2],
    )
    .unwrap();
    let backend = FaultyRank {
        rank: 0,
        fault: |p| {
            Ok(PartOutcome {
                bytes: p.expected_bytes() - 1,
                copies: 1,
                host_payload_bytes: 0,
                transport: "test".into(),
            })
        },
    };
    let e = deliver(&plan, &backend, &g.io(), &DeliveryControl::new()).unwrap_err();
    assert!(matches!(e, TransferError::ShortPart { rank: 0, .. }), "{e}");
}

#[test]
fn cancelled_or_late_or_donor_dead_never_completes() {
    let l = layout(1);
    let g = Group::new(&l, 8);
    let plan = TransferPlan::new(&l, &l, &[mv(1, Some(0), 0)], &[g.geom], &[g.geom]).unwrap();

    let c = DeliveryControl::new();
    c.cancel.cancel();
    assert!(matches!(
        deliver(&plan, &HostCopyBackend, &g.io(), &c),
        Err(TransferError::Cancelled)
    ));
    assert!(
        g.row(0, 0).iter().all(|&b| b == POISON),
        "cancelled before the first byte"
    );

    let c = DeliveryControl::with_timeout(Duration::ZERO);
    assert!(matches!(
        deliver(&plan, &HostCopyBackend, &g.io(), &c),
        Err(TransferError::DeadlineExceeded { .. })
    ));

    // The donor dies while the copy runs: the probe answers alive once, then dead.
    let alive = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (a, n) = (alive.clone(), calls.clone());
    let mut c = DeliveryControl::new();
    c.donor_alive = Some(Arc::new(move || {
        if n.fetch_add(1, Ordering::SeqCst) >= 1 {
            a.store(false, Ordering::SeqCst);
        }
        a.load(Ordering::SeqCst)
    }));
    let e = deliver(&plan, &HostCopyBackend, &g.io(), &c).unwrap_err();
    assert!(
        matches!(e, TransferError::DonorUnreachable { rank: 0, .. }),
        "{e}"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "probed before the first and after the last byte"
    );
}

#[test]
fn inputs_are_checked_before_a_byte_moves() {
    let l = layout(2);
    let g = Group::new(&l, 8);
    let plan = TransferPlan::new(&l, &l, &[mv(1, Some(7), 7)], &[g.geom; 2], &[g.geom; 2]).unwrap();
    let io = g.io();
    let e = deliver(&plan, &HostCopyBackend, &io[..1], &DeliveryControl::new()).unwrap_err();
    assert!(e.to_string().contains("`io`"), "{e}");
    let small = HostBuffer::zeroed(g.bb).unwrap();
    let bad = [
        io[0],
        RankIo {
            src: io[1].src,
            dst: &small,
        },
    ];
    let e = deliver(&plan, &HostCopyBackend, &bad, &DeliveryControl::new()).unwrap_err();
    assert!(e.to_string().contains("io.dst"), "{e}");
    assert!(
        g.row(0, 7).iter().all(|&b| b == POISON),
        "rank 0 untouched although its own io was fine"
    );
}

/// Memory that claims to be on a GPU but is host bytes: only to check that
/// `deliver` refuses host payload toward a GPU destination.
#[derive(Debug)]
struct LabelledGpu(HostBuffer);
impl BankMemory for LabelledGpu {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda { ordinal: 0 }
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn base_addr(&self) -> u64 {
        self.0.base_addr()
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        None
    }
}

#[test]
fn host_payload_toward_a_gpu_destination_is_refused() {
    let l = layout(1);
    let g = Group::new(&l, 4);
    let plan = TransferPlan::new(&l, &l, &[mv(1, Some(0), 0)], &[g.geom], &[g.geom]).unwrap();
    let dst = LabelledGpu(HostBuffer::zeroed(g.geom.region_bytes() as usize).unwrap());
    let backend = FaultyRank {
        rank: 0,
        fault: |p| {
            Ok(PartOutcome {
                bytes: p.expected_bytes(),
                copies: 1,
                host_payload_bytes: p.expected_bytes(),
                transport: "tcp/lo".into(),
            })
        },
    };
    let io = [RankIo {
        src: SourceRegion::Mapped(&g.donors[0]),
        dst: &dst,
    }];
    let e = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap_err();
    assert!(
        matches!(e, TransferError::HostStaged { rank: 0, .. }),
        "{e}"
    );
    // And the host backend refuses GPU memory outright.
    let e = deliver(&plan, &HostCopyBackend, &io, &DeliveryControl::new()).unwrap_err();
    assert!(e.to_string().contains("cannot copy"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever subset of keys is missing: present rows equal their donor
    /// slot on every rank, every other row keeps its poison, and completion is
    /// reported exactly when nothing is missing.
    #[test]
    fn missing_keys_leave_rows_untouched(
        n in 1usize..12,
        missing_mask in any::<u16>(),
        seed in any::<u64>(),
    ) {
        let l = layout(2);
        let g = Group::new(&l, 24);
        let mut slots: Vec<u32> = (0..24).collect();
        let mut x = seed | 1;
        for i in (1..slots.len()).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            slots.swap(i, (x >> 33) as usize % (i + 1));
        }
        let moves: Vec<BlockMove> = (0..n)
            .map(|i| mv(i as u64, (missing_mask >> i & 1 == 0).then_some(slots[i]), slots[23 - i]))
            .collect();
        let plan = TransferPlan::new(&l, &l, &moves, &[g.geom; 2], &[g.geom; 2]).unwrap();
        let rep = deliver(&plan, &HostCopyBackend, &g.io(), &DeliveryControl::new()).unwrap();
        let missing = moves.iter().filter(|m| m.src_slot.is_none()).count();
        prop_assert_eq!(rep.is_complete(), missing == 0);
        if let DeliveryStatus::Incomplete { missing: m } = &rep.status {
            prop_assert_eq!(m.len(), missing);
        }
        for r in 0..2usize {
            for row in 0..24u32 {
                let got = g.row(r, row);
                match moves.iter().find(|m| m.dst_block == row).and_then(|m| m.src_slot) {
                    Some(s) => prop_assert!(got.iter().enumerate().all(|(i, &b)| b == byte(r as u32, s, i))),
                    None => prop_assert!(got.iter().all(|&b| b == POISON)),
                }
            }
        }
    }
}

/// A part's injected result.
type Fault = fn(&PartPlan) -> Result<PartOutcome, TransferError>;

/// Each rank's part replaced by its own fault (`None`: host copy).
struct FaultPerRank {
    faults: Vec<Option<Fault>>,
}

impl CopyBackend for FaultPerRank {
    fn name(&self) -> &'static str {
        "fault_per_rank"
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        c: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        match self.faults[part.tp_rank() as usize] {
            Some(f) => f(part),
            None => HostCopyBackend.copy_part(part, io, c),
        }
    }
}

fn not_quiesced(p: &PartPlan) -> Result<PartOutcome, TransferError> {
    Err(TransferError::NotQuiesced {
        rank: p.tp_rank(),
        reason: "injected: read stalled on a cut link".into(),
    })
}

#[test]
fn a_part_that_may_still_write_decides_the_error_whatever_rank_0_reports() {
    // Rank 0 fails first in rank order with an error that is returned only
    // once nothing is in flight; rank 1's read may still land. The combined
    // error must say so, or the caller hands rank 1's rows back to the pool.
    let l = layout(2);
    let g = Group::new(&l, 8);
    let plan = TransferPlan::new(&l, &l, &[mv(1, Some(0), 0)], &[g.geom; 2], &[g.geom; 2]).unwrap();
    let rank0: [(&str, Fault); 4] = [
        ("cancelled", |_| Err(TransferError::Cancelled)),
        ("deadline", |_| {
            Err(TransferError::DeadlineExceeded { elapsed_us: 9 })
        }),
        ("short part", |p| {
            Ok(PartOutcome {
                bytes: p.expected_bytes() - 1,
                copies: 1,
                host_payload_bytes: 0,
                transport: "test".into(),
            })
        }),
        ("donor unreachable", |p| {
            Err(TransferError::DonorUnreachable {
                rank: p.tp_rank(),
                reason: "injected".into(),
            })
        }),
    ];
    for (what, f) in rank0 {
        let backend = FaultPerRank {
            faults: vec![Some(f), Some(not_quiesced)],
        };
        let e = deliver(&plan, &backend, &g.io(), &DeliveryControl::new()).unwrap_err();
        assert!(e.may_still_write(), "rank 0 {what}: got {e}");
        match e {
            TransferError::PartFailed { rank: 1, source } => assert!(
                matches!(*source, TransferError::NotQuiesced { rank: 1, .. }),
                "rank 0 {what}: {source}"
            ),
            other => panic!("rank 0 {what}: unexpected {other}"),
        }
    }
    // A healthy rank 0 and a rank 1 that may still write: the same.
    let backend = FaultPerRank {
        faults: vec![None, Some(not_quiesced)],
    };
    let e = deliver(&plan, &backend, &g.io(), &DeliveryControl::new()).unwrap_err();
    assert!(e.may_still_write(), "{e}");
    // Control: the same rank 0 faults without rank 1's stalled read are
    // reported as before and say nothing is in flight.
    let backend = FaultPerRank {
        faults: vec![Some(|_| Err(TransferError::Cancelled)), None],
    };
    let e = deliver(&plan, &backend, &g.io(), &DeliveryControl::new()).unwrap_err();
    assert!(matches!(e, TransferError::Cancelled), "{e}");
    assert!(!e.may_still_write());
}
