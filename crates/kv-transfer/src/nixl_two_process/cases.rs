//! The measured cases of the two-process NIXL benchmark: the contiguous and
//! scattered plans, timing and verification of one case, the raw-copy
//! baseline, and the row of a case that failed.

use super::*;

/// Contiguous: slots 0.. in order (one run). Scattered: every other donor
/// slot in a permuted order (one run per block).
pub(super) fn plan_for(
    layout: &KvLayout,
    opts: &TwoProcessOpts,
    scattered: bool,
) -> Result<TransferPlan, TransferError> {
    let n = opts.blocks;
    let moves: Vec<BlockMove> = (0..n)
        .map(|i| BlockMove {
            key: SequenceHash(u64::from(i)),
            src_slot: Some(if scattered {
                ((u64::from(i) * u64::from(SCATTER_STEP)) % u64::from(n)) as u32 * 2 + 1
            } else {
                i
            }),
            dst_block: i,
        })
        .collect();
    TransferPlan::new(
        layout,
        layout,
        &moves,
        &[RegionGeometry::dense(layout, 2 * n)],
        &[RegionGeometry::dense(layout, n)],
    )
}

pub(super) fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

pub(super) struct Case<'a> {
    pub(super) backend: &'static str,
    pub(super) label: &'static str,
    pub(super) pattern: &'static str,
    pub(super) plan: &'a TransferPlan,
}

/// Times one case (warm-up + `repeats`), then verifies every destination byte.
pub(super) fn time_case(
    case: &Case<'_>,
    copy: &dyn CopyBackend,
    io: &[RankIo<'_>],
    dst: &dyn BankMemory,
    opts: &TwoProcessOpts,
    fallback_transport: &dyn Fn() -> String,
) -> TwoProcessRow {
    let bytes = case.plan.expected_bytes();
    let mut row = TwoProcessRow {
        name: format!(
            "{}/{}/{}x{}",
            case.label,
            case.pattern,
            opts.blocks,
            size_label(opts.block_bytes)
        ),
        backend: case.backend.into(),
        pattern: case.pattern.into(),
        bytes,
        blocks: u64::from(opts.blocks),
        gbps: None,
        p50_us: None,
        min_us: None,
        transport: "unknown".into(),
        host_payload_bytes: 0,
        bytes_ok: None,
        ratio_vs_raw_copy: None,
        ratio_vs_cuda_ipc: None,
        refused: None,
        error: None,
    };
    if let Err(e) = clear(dst) {
        row.error = Some(format!("clearing the destination: {e}"));
        return row;
    }
    let mut times = Vec::with_capacity(opts.repeats);
    for i in 0..=opts.repeats.max(1) {
        let control = DeliveryControl::with_timeout(opts.delivery_timeout);
        let t0 = Instant::now();
        let r = deliver(case.plan, copy, io, &control);
        let t = t0.elapsed();
        match r {
            Ok(rep) if rep.is_complete() => {
                row.transport = rep.counters.transport;
                row.host_payload_bytes = rep.counters.host_payload_bytes;
            }
            Ok(_) => {
                row.error = Some("delivery incomplete".into());
                return row;
            }
            Err(e @ TransferError::HostStaged { bytes: b, .. }) => {
                // The bytes moved; only the result was refused.
                row.refused = Some(e.to_string());
                row.host_payload_bytes = b;
                row.transport = fallback_transport();
            }
            Err(e) => {
                row.error = Some(format!("delivery {i} (0 = warm-up): {e}"));
                return row;
            }
        }
        if i > 0 {
            times.push(t);
        }
    }
    let min = *times.iter().min().expect("at least one timed run");
    let p50 = median(times);
    row.gbps = Some(gbps(bytes, p50));
    row.p50_us = Some(p50.as_secs_f64() * 1e6);
    row.min_us = Some(min.as_secs_f64() * 1e6);
    match verify_rows(case.plan, dst) {
        Ok(ok) => row.bytes_ok = Some(ok),
        Err(e) => row.error = Some(format!("reading the destination back: {e}")),
    }
    row
}

pub(super) fn error_row(
    label: &str,
    pattern: &str,
    plan: &TransferPlan,
    opts: &TwoProcessOpts,
    e: &TransferError,
) -> TwoProcessRow {
    TwoProcessRow {
        name: format!(
            "{label}/{pattern}/{}x{}",
            opts.blocks,
            size_label(opts.block_bytes)
        ),
        backend: if label.starts_with("nixl") {
            "nixl"
        } else {
            "cuda_ipc"
        }
        .into(),
        pattern: pattern.into(),
        bytes: plan.expected_bytes(),
        blocks: u64::from(opts.blocks),
        gbps: None,
        p50_us: None,
        min_us: None,
        transport: "unknown".into(),
        host_payload_bytes: 0,
        bytes_ok: None,
        ratio_vs_raw_copy: None,
        ratio_vs_cuda_ipc: None,
        refused: None,
        error: Some(e.to_string()),
    }
}

pub(super) fn raw_copy(
    opts: &TwoProcessOpts,
    src: &dyn BankMemory,
    dst: &dyn BankMemory,
) -> Result<RawCopy, TransferError> {
    let bytes = opts.target_bytes();
    let repeats = opts.repeats.max(1);
    let (what, times) = match opts.memory {
        Memory::Vram => (
            format!(
                "cuMemcpyDtoDAsync GPU{} -> GPU{}",
                opts.donor_gpu, opts.target_gpu
            ),
            crate::cuda::time_raw_device_copy(
                opts.donor_gpu,
                opts.target_gpu,
                dst.base_addr(),
                src.base_addr(),
                bytes,
                repeats,
            )?,
        ),
        Memory::Dram => {
            // Host copy through the BankMemory interface: read into a host
            // buffer is itself a memcpy of the same bytes.
            let mut buf = vec![0u8; bytes];
            let mut v = Vec::with_capacity(repeats);
            for i in 0..=repeats {
                let t0 = Instant::now();
                src.read_bytes(0, &mut buf)?;
                std::hint::black_box(&buf);
                if i > 0 {
                    v.push(t0.elapsed());
                }
            }
            ("memcpy (host)".to_string(), v)
        }
    };
    let p50 = median(times);
    Ok(RawCopy {
        what,
        bytes: bytes as u64,
        gbps: gbps(bytes as u64, p50),
        p50_us: p50.as_secs_f64() * 1e6,
    })
}
