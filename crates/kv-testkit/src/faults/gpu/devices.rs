//! Device memory accounting of the GPU rows: free bytes per ordinal, settling
//! after a run, the verdict on a leak, and the donor's device bank.

use super::*;

pub(super) fn cuda_err(op: &'static str) -> impl Fn(kv_bank::BankError) -> FaultError {
    bank_err(op)
}

pub(super) fn free_bytes(ordinals: &[u32]) -> Result<Vec<u64>, FaultError> {
    ordinals
        .iter()
        .map(|&o| device_memory_info(o).map(|i| i.free_bytes))
        .collect::<Result<_, _>>()
        .map_err(cuda_err("cuMemGetInfo"))
}

/// Polls until every device is back within the tolerance of `before` (or
/// [`DEVICE_SETTLE`] passed); returns the last reading and the wait.
fn settle(ordinals: &[u32], before: &[u64]) -> Result<(Vec<u64>, u64), FaultError> {
    let t0 = Instant::now();
    loop {
        let now = free_bytes(ordinals)?;
        let ok = now
            .iter()
            .zip(before)
            .all(|(a, b)| a + DEVICE_FREE_TOLERANCE_BYTES >= *b);
        if ok || t0.elapsed() >= DEVICE_SETTLE {
            return Ok((now, t0.elapsed().as_millis() as u64));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for device memory to settle, then judges it ([`judge_devices`]).
pub(super) fn device_verdict(
    o: &mut GpuRunOutcome,
    ordinals: &[u32],
    before: &[u64],
    with_bank: &[u64],
    while_mapped: Option<&[u64]>,
) -> Result<(), FaultError> {
    let (after, settle_ms) = settle(ordinals, before)?;
    let readings = ordinals
        .iter()
        .enumerate()
        .map(|(i, &ordinal)| DeviceFree {
            ordinal,
            before: before[i],
            with_bank: with_bank[i],
            while_mapped: while_mapped.map(|w| w[i]),
            after: after[i],
            settle_ms,
        })
        .collect();
    judge_devices(o, readings);
    Ok(())
}

/// Fills in `o.devices`, the sensitivity check (free bytes with the bank at
/// least [`DONOR_RANK_BYTES`] per rank on that device below `before`) and a
/// leak per device whose free bytes after are more than
/// [`DEVICE_FREE_TOLERANCE_BYTES`] below `before`. Rank `r` is on `devices[r]`.
pub(super) fn judge_devices(o: &mut GpuRunOutcome, devices: Vec<DeviceFree>) {
    o.device_check_sensitive = !devices.is_empty()
        && devices.iter().all(|d| {
            let ranks_here = devices.iter().filter(|x| x.ordinal == d.ordinal).count() as u64;
            d.before.saturating_sub(d.with_bank) >= ranks_here * DONOR_RANK_BYTES
        });
    for d in &devices {
        if d.after + DEVICE_FREE_TOLERANCE_BYTES < d.before {
            o.leaks.push(format!(
                "device {} free bytes: {} -> {} ({} MiB lower, tolerance {} MiB)",
                d.ordinal,
                d.before,
                d.after,
                d.delta() >> 20,
                DEVICE_FREE_TOLERANCE_BYTES >> 20
            ));
        }
    }
    if !o.device_check_sensitive {
        let seen: Vec<(u64, u64)> = devices.iter().map(|d| (d.before, d.with_bank)).collect();
        o.detail.push_str(&format!(
            "; device check not sensitive: (free before, with bank) {seen:?}"
        ));
    }
    o.devices = devices;
}

pub(super) fn min_into(acc: &mut [u64], now: &[u64]) {
    for (a, n) in acc.iter_mut().zip(now) {
        *a = (*a).min(*n);
    }
}

/// A device bank of `DONOR_RANK_BYTES` per rank on `ordinals`.
pub(super) fn device_bank(
    layout: KvLayout,
    owner: OwnerLease,
    ordinals: &[u32],
    prefix: &str,
    lease: LeaseConfig,
) -> Result<BankManager, FaultError> {
    // Rounded up: each rank region is at least DONOR_RANK_BYTES.
    let slots = DONOR_RANK_BYTES.div_ceil(layout.rank_block_bytes() as u64);
    let budget = slots * u64::from(layout.tp_size()) * layout.rank_block_bytes() as u64;
    let mut cfg = BankConfig::new(layout, owner, budget);
    cfg.shm_prefix = prefix.to_string();
    cfg.lease = lease;
    BankManager::new_cuda(cfg, "fault-gpu", ordinals).map_err(bank_err("new_cuda"))
}
