//! Running one fault: the in-process fetch faults and the damaged
//! event-stream faults.

use super::*;

/// Runs `fault` once with conversation `seed`. `child` is required for
/// [`Fault::needs_child`] faults.
///
/// # Errors
/// [`FaultError`] when the run could not be set up (including
/// [`FaultError::Skipped`] for a missing `nats-server` outside CI); a
/// fallback or a failed check is a [`RunOutcome`], not an error.
///
/// ```no_run
/// use kv_testkit::faults::{run_fault, Fault};
/// let o = run_fault(Fault::RankPartFails, 7, None).unwrap();
/// assert!(o.passed(), "{o:?}");
/// ```
pub fn run_fault(
    fault: Fault,
    seed: u64,
    child: Option<&ChildCommand>,
) -> Result<RunOutcome, FaultError> {
    let _guard = run_lock();
    if fault == Fault::NatsServerRestart {
        warm_tokio_globals();
    }
    if fault == Fault::LinkCutMidTransfer {
        link_cut::warm_nixl_globals();
    }
    let prefix = unique_prefix();
    let probe = LeakProbe::start(&prefix);
    let result = match fault {
        Fault::DonorKilledMidTransfer | Fault::SigtermDuringTransfer => {
            let child = child.ok_or_else(|| {
                FaultError::Child(format!("{} needs a child command", fault.name()))
            })?;
            child_fault(fault, seed, child, &prefix)
        }
        Fault::DuplicatedEvents | Fault::ReorderedEvents | Fault::GappedEvents => {
            event_fault(fault, seed, &prefix)
        }
        Fault::NatsServerRestart => nats_restart(seed, &prefix),
        Fault::LinkCutMidTransfer => {
            let child = child.ok_or_else(|| {
                FaultError::Child(format!("{} needs a child command", fault.name()))
            })?;
            link_cut::link_cut(seed, child, &prefix)
        }
        _ => fetch_fault(fault, seed, &prefix),
    };
    // Everything of the run was dropped inside the runner: compare now.
    let leaks = probe.finish();
    result.map(|mut o| {
        o.leaks = leaks;
        o
    })
}

/// Tokio's signal driver opens a process-wide self-pipe (two fds) the first
/// time a runtime with signals is built, and keeps it for the life of the
/// process. Building one runtime before the first snapshot keeps that
/// one-time allocation out of the leak count.
fn warm_tokio_globals() {
    static WARM: std::sync::Once = std::sync::Once::new();
    WARM.call_once(|| {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(async {});
        }
    });
}

pub(super) fn outcome(fault: Fault) -> RunOutcome {
    RunOutcome {
        fault,
        fell_back: false,
        completed: false,
        fetched: false,
        outputs_match: false,
        destination_untouched: false,
        leaks: Vec::new(),
        detail: String::new(),
    }
}

/// In-process donor bank + router + target; the fault strikes the fetch.
fn fetch_fault(fault: Fault, seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let (conv, cache) = conversation(&model, seed)?;
    let off = generate(&model, KvCache::new(layout), &conv.prompt)?;
    let donor_blocks = (conv.retained_tokens.len() / bs as usize) as u64;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        donor_blocks,
        prefix,
        LeaseConfig::default(),
    )?);
    let events = retain(&bank, &cache, &conv.retained_tokens)?;
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    router.apply(&events);

    let control = DeliveryControl::new();
    let cancel = control.cancel.clone();
    let fire: Action = Arc::new(move || cancel.cancel());
    let strike = match fault {
        Fault::CancelAtTransfer => Strike::BeforeRank(1, fire.clone()),
        Fault::CancelAtVerify => Strike::AfterAll(fire.clone()),
        Fault::DeadlinePassed => Strike::BeforeRank(1, stall()),
        Fault::RankPartFails => Strike::FailRank(1),
        _ => Strike::Never,
    };
    let rows = (conv.prompt.len() / bs as usize) as u32 + 2;
    let target = Target::new(layout, rows, Arc::new(FaultBackend::host(strike)))?;

    let hashes = prompt_hashes(&conv.prompt, bs as usize);
    let request_id = format!("fault-{seed}");
    let advice = if fault == Fault::CancelAtLookup {
        // The cancellation arrives while the lookup walks the index: the
        // first time the lookup asks, the token fires.
        router.advise_cancellable(&request_id, &hashes, target_engine, &|| {
            fire();
            control.cancel.is_cancelled()
        })
    } else {
        router.advise(&request_id, &hashes, target_engine)
    };
    let mut o = outcome(fault);
    if fault == Fault::CancelAtLookup {
        let cancelled_inside = matches!(
            advice.lookup.map(|l| l.donor),
            Some(Err(kv_lookup::NoDonorReason::Cancelled { .. }))
        );
        let refused = advice.decision.verdict
            == kv_router_glue::Verdict::Refuse(kv_router_glue::RefuseReason::Cancelled);
        let (served, completed, _) = target.serve(
            &model,
            &conv.prompt,
            advice.hint.as_ref(),
            bank.as_ref(),
            &control,
        )?;
        o.completed = completed;
        o.fell_back = cancelled_inside && refused && advice.hint.is_none() && !completed;
        o.outputs_match = served == off;
        o.destination_untouched = target.rows_free() && target.poison_intact();
        o.detail = format!(
            "lookup cancelled inside the walk: {cancelled_inside}; verdict {:?}",
            advice.decision.verdict
        );
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    }
    let Some(env) = advice.hint.clone() else {
        // The fault was never injected; the request still recomputes, and
        // its outputs are checked like any other.
        let (served, _, _) = target.serve(&model, &conv.prompt, None, bank.as_ref(), &control)?;
        o.outputs_match = served == off;
        o.detail = format!("no hint: {:?}", advice.decision.verdict);
        drop(target);
        drop(router);
        bank.close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
        return Ok(o);
    };
    // Faults that strike between advice and fetch.
    let mut bank_now = bank.clone();
    let mut blocker = None;
    match fault {
        Fault::MissingKeys => {
            // The donor stores another conversation of the same size: every
            // hinted slot is evicted and reused.
            let other = text(
                seed ^ 0xDEAD,
                2,
                conv.retained_tokens.len(),
                model.config().vocab,
            );
            let mut other_cache = model.new_cache(TP)?;
            model.prefill(&mut other_cache, &other)?;
            let ev = retain(&bank, &other_cache, &other[..other_cache.len_tokens()])?;
            router.apply(&ev);
        }
        Fault::StaleBankGeneration => {
            bank.close(Duration::from_secs(1))
                .map_err(bank_err("close"))?;
            let next = Arc::new(host_bank(
                layout,
                bank.owner().next_generation(),
                donor_blocks,
                prefix,
                LeaseConfig::default(),
            )?);
            router.add_donor(next.clone());
            bank_now = next;
        }
        Fault::AllocationFailure => {
            // Other fetches hold all but one row.
            blocker = Some(
                target
                    .pool
                    .reserve(rows as usize - 1)
                    .map_err(bank_err("reserve"))?,
            );
        }
        _ => {}
    }
    let hook_fire = fire.clone();
    let hooked = HookedDonor {
        inner: bank_now.as_ref(),
        on_pin: if fault == Fault::CancelAtReserve {
            hook_fire
        } else {
            Arc::new(|| {})
        },
    };
    let control = if fault == Fault::DeadlinePassed {
        deadline_from_now(control)
    } else {
        control
    };
    let (served, completed, fallback) =
        target.serve(&model, &conv.prompt, Some(&env), &hooked, &control)?;
    if let Some(b) = blocker.take() {
        b.cancel().quiesced();
    }
    o.completed = completed;
    o.fell_back = !completed && fallback.is_some();
    o.fetched = completed && fault.expected() == Expected::Fetch;
    o.outputs_match = served == off;
    o.destination_untouched = target.rows_free()
        && (completed || !fault.strikes_before_first_byte() || target.poison_intact());
    o.detail = fallback.unwrap_or_else(|| "fetch completed".into());
    drop(hooked);
    drop(target);
    drop(router);
    if !bank_now.is_closed() {
        bank_now
            .close(Duration::from_secs(1))
            .map_err(bank_err("close"))?;
    }
    Ok(o)
}

/// Damaged KV event streams into the real index.
fn event_fault(fault: Fault, seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let (a, cache_a) = conversation(&model, seed)?;
    let (b, cache_b) = conversation(&model, seed.wrapping_add(0x5EED))?;
    let slots = ((a.retained_tokens.len() + b.retained_tokens.len()) / bs as usize) as u64 + 2;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::default(),
    )?);
    let ev_a = retain(&bank, &cache_a, &a.retained_tokens)?;
    let ev_b = retain(&bank, &cache_b, &b.retained_tokens)?;
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    let donor = bank.owner().engine_id;
    let b_hashes = prompt_hashes(&b.prompt, bs as usize);
    let b_retained: Vec<SequenceHash> = sealed_blocks(None, &b.retained_tokens, bs as usize)
        .iter()
        .map(|x| x.sequence_hash)
        .collect();

    let mut all_events = [&ev_a[..], &ev_b[..]].concat();
    let mut o = outcome(fault);
    let mut notes = Vec::new();
    let damaged_ok = match fault {
        Fault::GappedEvents => {
            // A's Stored event is lost; B's arrives with a gap.
            let out = router.apply(&ev_b);
            notes.push(format!("{out:?}"));
            matches!(out.first(), Some(EventOutcome::Gap { .. }))
        }
        Fault::DuplicatedEvents | Fault::ReorderedEvents => {
            // B's blocks leave the bank (a Removed event).
            bank.exclude(&b_retained);
            let ev_rm = bank.drain_events();
            all_events.extend(ev_rm.iter().cloned());
            let out = if fault == Fault::DuplicatedEvents {
                router.apply(&[ev_a.clone(), ev_b.clone(), ev_rm, ev_b.clone()].concat())
            } else {
                router.apply(&[ev_a.clone(), ev_rm, ev_b.clone()].concat())
            };
            notes.push(format!("{out:?}"));
            // The stale Stored must not resurrect B in the index.
            !router.holds_any(donor, &b_retained)
                && matches!(out.last(), Some(EventOutcome::Duplicate { .. }))
        }
        _ => unreachable!("event_fault called with {fault:?}"),
    };
    let target = Target::new(
        layout,
        (b.prompt.len() / bs as usize) as u32 + 2,
        Arc::new(HostCopyBackend),
    )?;
    let off_b = generate(&model, KvCache::new(layout), &b.prompt)?;
    // While damaged: B's request must get no hint (and recompute).
    let advice = router.advise("damaged", &b_hashes, target_engine);
    let damaged_hint = advice.hint.is_some();
    let (served, completed, fallback) = target.serve(
        &model,
        &b.prompt,
        advice.hint.as_ref(),
        bank.as_ref(),
        &DeliveryControl::new(),
    )?;
    let damaged_match = served == off_b;
    // Repair: resync the donor from its bank, then the fetch works again
    // (B itself is gone from the bank after an exclusion; A is fetched then).
    let last_id = all_events.iter().map(|e| e.event_id).max().unwrap_or(0);
    router.resync(&bank, last_id)?;
    let repaired = router.holds_all(&bank) && router.index().workers_needing_resync().is_empty();
    let probe_conv = if fault == Fault::GappedEvents { &b } else { &a };
    let off_probe = generate(&model, KvCache::new(layout), &probe_conv.prompt)?;
    let advice = router.advise(
        "repaired",
        &prompt_hashes(&probe_conv.prompt, bs as usize),
        target_engine,
    );
    let no_hint2 = advice
        .hint
        .is_none()
        .then(|| format!("no hint: {:?}", advice.decision.verdict));
    let (served2, completed2, fallback2) = target.serve(
        &model,
        &probe_conv.prompt,
        advice.hint.as_ref(),
        bank.as_ref(),
        &DeliveryControl::new(),
    )?;
    o.fell_back = damaged_ok && !damaged_hint;
    o.fetched = repaired && completed2;
    o.completed = completed;
    o.outputs_match = damaged_match && served2 == off_probe;
    o.destination_untouched = target.rows_free() && !completed;
    o.detail = format!(
        "damaged: {}; hint while damaged: {damaged_hint}; repaired: {repaired}; \
         fetch after repair: {completed2} {}; {}",
        notes.join(" "),
        fallback2.or(no_hint2).unwrap_or_default(),
        fallback.unwrap_or_default()
    );
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    Ok(o)
}
