//! The GPU donor child (`kvq child fault-donor-gpu`): it owns a TP-N device
//! bank exported by CUDA IPC and is SIGKILLed mid-delivery; the parent's
//! side imports every rank through the mapping cache.

use super::*;

pub(super) fn child_run(
    seed: u64,
    ordinals: &[u32],
    cmd: &ChildCommand,
    prefix: &str,
    strike_at: u32,
) -> Result<GpuRunOutcome, FaultError> {
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let (conv, _) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let before = free_bytes(ordinals)?;
    let ipc_before = ipc_cache_stats();
    let mut o = GpuRunOutcome::new(GpuFault::DonorKilledMidTransfer, seed, tp);
    let ords: Vec<String> = ordinals.iter().map(|x| x.to_string()).collect();
    let mut start = Command::new(&cmd.exe);
    start.args(&cmd.args).args([
        prefix.to_string(),
        seed.to_string(),
        CHILD_LEASE_MS.to_string(),
        ords.join(","),
    ]);
    let (HelloChild { child, guard, pid }, hello): (HelloChild, ChildHello) =
        spawn_with_hello(start, Duration::from_secs(60))?;
    let mut with_bank = free_bytes(ordinals)?;
    let manifest =
        BankManifest::from_wire(&hello.manifest).map_err(|e| FaultError::Child(e.to_string()))?;
    let mut maps = Vec::new();
    let mut ordinal0 = 0;
    for d in manifest.parts() {
        let ordinal = local_ordinal(d)?;
        if d.tp_rank() == 0 {
            ordinal0 = ordinal;
        }
        maps.push(CudaIpcImport::open_descriptor(d, ordinal).map_err(bank_err("open_descriptor"))?);
    }
    let handle0 = manifest.parts()[0].export().clone();
    let len0 = manifest.parts()[0].region_bytes() as usize;
    let parts = manifest.parts().to_vec();
    let alive: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || {
        pid_alive(pid)
            && parts
                .iter()
                .all(|d| check_descriptor_lease(d, kv_bank::LeaseInstant::now()).is_ok())
    });
    let donor = RemoteDeviceDonor {
        manifest: manifest.clone(),
        maps,
        alive: alive.clone(),
    };
    let bs = layout.tokens_per_block() as usize;
    let usable = (conv.prompt.len() - 1) / bs;
    let entries: Vec<(u64, u32)> = hello.entries.iter().take(usable).copied().collect();
    let env = retained_hint_envelope(
        &manifest,
        &layout,
        &entries,
        &format!("gpu-fault-{seed}"),
        &format!("pid:{pid}"),
    )?;
    let strike_child = child.clone();
    let kill: Action = Arc::new(move || {
        let mut c = strike_child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = c.kill();
        let _ = c.wait();
    });
    let (strike, where_) = if strike_at % 2 == 0 {
        (
            Strike::BeforeRank(tp - 1, kill),
            format!("before rank {}'s part", tp - 1),
        )
    } else {
        (Strike::AfterAll(kill), "after every part".to_string())
    };
    let target = device_target(
        layout,
        (conv.prompt.len() / bs) as u32 + 2,
        ordinals,
        strike,
    )?;
    let control = DeliveryControl {
        donor_alive: Some(alive),
        ..DeliveryControl::new()
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &donor, &control)?;
    let status = wait_exit(&child, Duration::from_secs(5));
    drop(guard);
    let while_mapped = free_bytes(ordinals)?;
    min_into(&mut with_bank, &while_mapped);
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    // The copy runs even after the kill (it reads the dead donor's mapping),
    // so only the rows' release is required, as in the host row.
    o.destination_untouched = target.rows_free();
    drop(target);
    drop(donor);
    // Every mapping of the dead donor must be closed now, and its handle
    // must not come back from the cache.
    let after_drop = ipc_cache_stats();
    let reimport = match &handle0 {
        kv_descriptor::ExportHandle::CudaIpc { handle } => {
            match CudaIpcImport::open(handle, ordinal0, len0) {
                Ok(m) if m.cache_hit() => {
                    o.leaks
                        .push("ipc mapping of the dead donor still cached".into());
                    "cache hit".to_string()
                }
                Ok(m) => {
                    drop(m);
                    "opened (cache miss), closed".to_string()
                }
                Err(e) => format!("error: {e}"),
            }
        }
        other => format!("not a CUDA IPC handle: {other:?}"),
    };
    let ipc_after = ipc_cache_stats();
    let opened = after_drop.opens - ipc_before.opens;
    let closed = after_drop.closes - ipc_before.closes;
    if after_drop.live > ipc_before.live || closed != opened {
        o.leaks.push(format!(
            "ipc mappings: live {} -> {}, opened {opened}, closed {closed}",
            ipc_before.live, after_drop.live
        ));
    }
    if opened != u64::from(tp) {
        o.leaks.push(format!(
            "ipc mappings: {opened} opened for {tp} ranks (each rank must be one cache miss)"
        ));
    }
    // A killed owner leaves its lease files: they go once they lapsed.
    let lease_prefix = format!("kvbank-cuda-{}", manifest.owner().engine_id.0.simple());
    let mut reclaimed = 0;
    let end = Instant::now() + Duration::from_millis(CHILD_LEASE_MS * 4);
    while !shm_entries(&lease_prefix).is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(CHILD_LEASE_MS / 4));
        if let Ok(r) = kv_bank::reclaim_stale(&lease_prefix, kv_bank::reclaim::ScanTime::now()) {
            reclaimed += r.removed_names().len();
        }
    }
    let left = shm_entries(&lease_prefix);
    if !left.is_empty() {
        o.leaks
            .push(format!("lease files of the dead donor: {left:?}"));
    }
    o.ipc = Some(IpcObservation {
        before: ipc_before,
        after: ipc_after,
        reimport: reimport.clone(),
        leases_reclaimed: reclaimed,
    });
    o.detail = format!(
        "{}; killed {where_}; child exit {:?}; re-import: {reimport}; leases reclaimed {reclaimed}",
        fallback.unwrap_or_else(|| "fetch completed".into()),
        status.map(|s| s.to_string())
    );
    device_verdict(&mut o, ordinals, &before, &with_bank, Some(&while_mapped))?;
    Ok(o)
}

/// Child side of `donor_killed_mid_transfer_gpu`: `args` = `<prefix> <seed>
/// <lease ms> <ordinals, comma-separated>` (a leading [`GPU_CHILD_ROLE`] is
/// skipped). Computes turn 0 of conversation `seed`, retains it in a device
/// bank (rank `r` on the `r`-th ordinal, exported by CUDA IPC handle, lease
/// renewed in the background), prints one JSON line (pid, manifest, slots),
/// then waits for SIGTERM (closes its bank, returns 0) or 60 s. Returns 2 on
/// an error (printed to stderr).
pub fn child_main(args: &[String]) -> i32 {
    child_exit(GPU_CHILD_ROLE, gpu_child(args))
}

fn gpu_child(args: &[String]) -> Result<(), FaultError> {
    let args: Vec<&String> = args.iter().filter(|a| *a != GPU_CHILD_ROLE).collect();
    let [prefix, seed, lease_ms, ordinals] = args.as_slice() else {
        return Err(FaultError::Child(format!(
            "expected <prefix> <seed> <lease ms> <ordinals>, got {args:?}"
        )));
    };
    let num = |field: &str, s: &str| {
        s.parse::<u64>()
            .map_err(|e| FaultError::Child(format!("`{field}` {s:?}: {e}")))
    };
    let (seed, lease_ms) = (num("seed", seed)?, num("lease_ms", lease_ms)?);
    let ordinals: Vec<u32> = ordinals
        .split(',')
        .map(|s| num("ordinals", s).map(|v| v as u32))
        .collect::<Result<_, _>>()?;
    let (rt, mut term) = child_runtime()?;
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let (conv, cache) = conversation_tp(&model, seed, tp)?;
    let bank = device_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        &ordinals,
        prefix,
        LeaseConfig::background(
            Duration::from_millis(lease_ms),
            Duration::from_millis((lease_ms / 4).max(1)),
        ),
    )?;
    retain(&bank, &cache, &conv.retained_tokens)?;
    let hello = ChildHello::for_bank(&bank, &conv.retained_tokens)?;
    let line = serde_json::to_string(&hello).map_err(|e| FaultError::Child(e.to_string()))?;
    println!("{line}");
    wait_for_sigterm(&rt, &mut term);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))
}
