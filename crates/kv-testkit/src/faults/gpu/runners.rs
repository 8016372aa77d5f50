//! Running one GPU row in this process: the device-memory target, the
//! router, and the cancel / deadline / control rows.

use super::*;

/// A target whose staging rows are device allocations (rank `r` on
/// `ordinals[r]`) and whose copies go through [`CudaCopyBackend`] with
/// `strike` injected.
pub(super) fn device_target(
    layout: KvLayout,
    rows: u32,
    ordinals: &[u32],
    strike: Strike,
) -> Result<Target, FaultError> {
    let len = rows as usize * layout.rank_block_bytes();
    let mut staging: Vec<Arc<dyn BankMemory>> = Vec::new();
    for &o in ordinals {
        let m = CudaDeviceMemory::new(o, len).map_err(cuda_err("staging cuMemAlloc"))?;
        staging.push(Arc::new(m));
    }
    let cuda = CudaCopyBackend::new(CudaMode::Auto)
        .map_err(|e| router_err("cuda backend")(e.to_string()))?;
    let backend = FaultBackend::new(Arc::new(cuda), strike, ordinals.len() as u32);
    Target::with_staging(layout, rows, staging, Arc::new(backend))
}

/// Runs GPU row `fault` once with conversation `seed` on devices `ordinals`
/// (rank `r` on `ordinals[r]`). `child` (from [`child_command`]) is
/// required for [`GpuFault::needs_child`]; `strike` picks the child row's
/// kill point (even: before the last rank's part, odd: after every part).
///
/// # Errors
/// [`FaultError::Skipped`] without a GPU; other [`FaultError`]s when the run
/// could not be set up. A fallback or a failed check is an outcome.
pub fn run_gpu_fault(
    fault: GpuFault,
    seed: u64,
    ordinals: &[u32],
    child: Option<&ChildCommand>,
    strike: u32,
) -> Result<GpuRunOutcome, FaultError> {
    gpu_ordinals()?;
    let _guard = run_lock();
    let t0 = Instant::now();
    let prefix = unique_prefix();
    let probe = LeakProbe::start(&prefix);
    let result = if fault.needs_child() {
        let child = child
            .ok_or_else(|| FaultError::Child(format!("{} needs a child command", fault.name())))?;
        child_run(seed, ordinals, child, &prefix, strike)
    } else {
        in_process_run(fault, seed, ordinals, &prefix)
    };
    let leaks = probe.finish();
    result.map(|mut o| {
        // Device leaks were found by the runner; the snapshot's come first.
        let device_leaks = std::mem::take(&mut o.leaks);
        o.leaks = leaks;
        o.leaks.extend(device_leaks);
        o.wall_ms = t0.elapsed().as_millis() as u64;
        o
    })
}

/// In-process device bank + router + device target (the host `fetch_fault`
/// on the GPU path).
fn in_process_run(
    fault: GpuFault,
    seed: u64,
    ordinals: &[u32],
    prefix: &str,
) -> Result<GpuRunOutcome, FaultError> {
    let tp = ordinals.len() as u32;
    let model = shared_model()?;
    let layout = model.config().layout(tp)?;
    let bs = layout.tokens_per_block();
    let (conv, cache) = conversation_tp(&model, seed, tp)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let before = free_bytes(ordinals)?;
    let mut o = GpuRunOutcome::new(fault, seed, tp);
    let bank = Arc::new(device_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        ordinals,
        prefix,
        LeaseConfig::default(),
    )?);
    let mut with_bank = free_bytes(ordinals)?;
    let events = retain(&bank, &cache, &conv.retained_tokens)?;
    let router = gpu_router(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    router.apply(&events);

    let control = DeliveryControl::new();
    let cancel = control.cancel.clone();
    let last = tp - 1;
    let strike = match fault {
        GpuFault::CancelAtTransfer => Strike::BeforeRank(last, Arc::new(move || cancel.cancel())),
        GpuFault::DeadlinePassed => Strike::BeforeRank(last, stall()),
        _ => Strike::Never,
    };
    let rows = (conv.prompt.len() / bs as usize) as u32 + 2;
    let target = device_target(layout, rows, ordinals, strike)?;
    let advice = router.advise(
        &format!("gpu-fault-{seed}"),
        &prompt_hashes(&conv.prompt, bs as usize),
        target_engine,
    );
    let Some(env) = advice.hint.clone() else {
        o.detail = format!("no hint: {:?}", advice.decision.verdict);
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    };
    let control = if fault == GpuFault::DeadlinePassed {
        deadline_from_now(control)
    } else {
        control
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), bank.as_ref(), &control)?;
    min_into(&mut with_bank, &free_bytes(ordinals)?);
    o.completed = completed && fallback.is_none();
    o.fell_back = !completed && fallback.is_some();
    o.outputs_match = served == off;
    // At TP1 the strike comes before the only part: no byte may have landed.
    let before_first_byte = tp == 1 && fault != GpuFault::None;
    o.destination_untouched =
        target.rows_free() && (completed || !before_first_byte || target.poison_intact());
    o.detail = fallback.unwrap_or_else(|| "fetch completed".into());
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    drop(bank);
    device_verdict(&mut o, ordinals, &before, &with_bank, None)?;
    Ok(o)
}

/// The host rows' router settings with GPU reuse on as well: a device bank
/// is the GPU path, which a router refuses (`GpuPathDisabled`) unless
/// `enable_decode_to_prefill_gpu_reuse` is set.
fn gpu_router(tokens_per_block: u32) -> Result<FaultRouter, FaultError> {
    let settings = ReuseSettings {
        enable_decode_to_prefill_gpu_reuse: true,
        ..FaultRouter::settings()
    };
    FaultRouter::with_settings(settings, tokens_per_block)
}

/// Turn 0 of conversation `seed` at TP `tp` (the host rows always use TP2).
pub(super) fn conversation_tp(
    model: &ReferenceModel,
    seed: u64,
    tp: u32,
) -> Result<(Conversation, KvCache), FaultError> {
    if tp == TP {
        return conversation(model, seed);
    }
    // Same tokens as `conversation`, K/V laid out for `tp` ranks.
    let (conv, _) = conversation(model, seed)?;
    let mut cache = model.new_cache(tp)?;
    model.prefill(&mut cache, &conv.retained_tokens)?;
    Ok((conv, cache))
}

/// The child's device bank as the target sees it: every rank imported by
/// CUDA IPC handle through the mapping cache, under a live lease.
pub(super) struct RemoteDeviceDonor {
    pub(super) manifest: BankManifest,
    pub(super) maps: Vec<CudaIpcImport>,
    pub(super) alive: Arc<dyn Fn() -> bool + Send + Sync>,
}

struct ImportPin<'a>(&'a [CudaIpcImport]);

impl DonorPin for ImportPin<'_> {
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory> {
        self.0.get(rank as usize).map(|m| m as &dyn BankMemory)
    }
}

impl DonorSource for RemoteDeviceDonor {
    fn manifest(&self) -> &BankManifest {
        &self.manifest
    }
    fn pin<'a>(&'a self, _hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        if !(self.alive)() {
            return Err(PinError::DonorUnavailable {
                detail: "donor process or lease gone".into(),
            });
        }
        Ok(Box::new(ImportPin(&self.maps)))
    }
}

/// This process's ordinal of the GPU a descriptor names (by UUID).
pub(super) fn local_ordinal(d: &kv_descriptor::BankDescriptor) -> Result<u32, FaultError> {
    let MemoryLocation::Gpu(g) = d.location() else {
        return Err(FaultError::Child(format!(
            "rank {} of the donor is not in device memory",
            d.tp_rank()
        )));
    };
    let n = kv_transfer::cuda::device_count() as u32;
    (0..n)
        .find(|&o| cuda_probe(o).is_ok_and(|i| i.uuid == g.uuid))
        .ok_or_else(|| FaultError::Child(format!("GPU {} is not visible here", g.uuid)))
}
