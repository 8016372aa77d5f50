//! The fault `nats_server_restart`: a real `nats-server` killed and restarted
//! on the same port while the donor publishes KV events.

use super::*;

/// A real `nats-server` restarted while the donor publishes KV events.
pub(super) fn nats_restart(seed: u64, prefix: &str) -> Result<RunOutcome, FaultError> {
    if let Err(e) = find_nats_server() {
        if kv_transfer::ci_requires() {
            return Err(FaultError::Nats(format!("{e}, under CI")));
        }
        return Err(FaultError::Skipped(e.to_string()));
    }
    let model = shared_model()?;
    let layout = model.config().layout(TP)?;
    let bs = layout.tokens_per_block();
    let convs: Vec<(Conversation, KvCache)> = (0..3u64)
        .map(|i| conversation(&model, seed.wrapping_add(i * 0x101)))
        .collect::<Result<_, _>>()?;
    let slots: u64 = convs
        .iter()
        .map(|(c, _)| (c.retained_tokens.len() / bs as usize) as u64)
        .sum::<u64>()
        + 2;
    let bank = Arc::new(host_bank(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots,
        prefix,
        LeaseConfig::default(),
    )?);
    let router = FaultRouter::new(bs)?;
    let target_engine = router.connect(&bank, &layout)?;
    let target = Target::new(
        layout,
        (convs[1].0.prompt.len() / bs as usize) as u32 + 2,
        Arc::new(HostCopyBackend),
    )?;
    let mut server = NatsServer::start().map_err(FaultError::Nats)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| FaultError::Nats(format!("runtime: {e}")))?;
    let mut o = outcome(Fault::NatsServerRestart);
    let result = rt.block_on(nats_scenario(
        &mut server,
        &bank,
        &router,
        &target,
        &model,
        &convs,
        target_engine,
    ));
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(server);
    let r = result?;
    o.fell_back = r.window_safe;
    o.fetched = r.inventory_complete && r.completed_after;
    o.completed = r.window_completed;
    o.outputs_match = r.outputs_match;
    o.destination_untouched = target.rows_free();
    o.detail = r.detail;
    drop(target);
    drop(router);
    bank.close(Duration::from_secs(1))
        .map_err(bank_err("close"))?;
    Ok(o)
}

struct NatsResult {
    pub(super) window_safe: bool,
    pub(super) window_completed: bool,
    pub(super) inventory_complete: bool,
    pub(super) completed_after: bool,
    pub(super) outputs_match: bool,
    pub(super) detail: String,
}

async fn nats_connect(url: &str, name: &str) -> Result<NatsPlane, FaultError> {
    NatsPlane::connect(
        url,
        NatsOptions {
            name: name.into(),
            max_reconnect_delay: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(2),
            ..NatsOptions::default()
        },
    )
    .await
    .map_err(|e| FaultError::Nats(e.to_string()))
}

/// Applies every event the receiver yields within `wait`; on `Lost`,
/// resyncs the donor from its bank. Returns (events applied, full resyncs).
async fn pump(
    rx: &mut KvEventReceiver,
    router: &FaultRouter,
    bank: &BankManager,
    wait: Duration,
    until_complete: bool,
) -> Result<(u64, u64), FaultError> {
    let (mut applied, mut resyncs) = (0u64, 0u64);
    let end = tokio::time::Instant::now() + wait;
    loop {
        if until_complete && router.holds_all(bank) {
            return Ok((applied, resyncs));
        }
        let left = end.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok((applied, resyncs));
        }
        match rx.next_timeout(left.min(Duration::from_millis(200))).await {
            Some(KvStreamItem::Event(e)) => {
                router.apply(&[e]);
                applied += 1;
            }
            Some(KvStreamItem::Lost { to_event_id, .. }) => {
                router.resync(bank, to_event_id)?;
                resyncs += 1;
            }
            None if !until_complete => return Ok((applied, resyncs)),
            None => {}
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn nats_scenario(
    server: &mut NatsServer,
    bank: &BankManager,
    router: &FaultRouter,
    target: &Target,
    model: &ReferenceModel,
    convs: &[(Conversation, KvCache)],
    target_engine: EngineId,
) -> Result<NatsResult, FaultError> {
    let bs = target.layout.tokens_per_block() as usize;
    let url = server.url();
    let pub_plane: Arc<dyn EventPlane> = Arc::new(nats_connect(&url, "fault-decode").await?);
    let sub_plane: Arc<dyn EventPlane> = Arc::new(nats_connect(&url, "fault-router").await?);
    let subject = Subject::new("faults", "decode", "kv_events")
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let header = PublisherHeader {
        publisher: bank.owner().engine_id,
        role: Role::Decode,
        layout_fingerprint: target.layout.fingerprint(),
        tp_size: target.layout.tp_size(),
    };
    let publisher = Arc::new(KvEventPublisher::new(
        pub_plane.clone(),
        subject.clone(),
        header,
        256,
    ));
    let resync_task = publisher
        .serve_resync()
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let mut rx = KvEventReceiver::subscribe(sub_plane.clone(), &subject, Duration::from_secs(2))
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    pub_plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(5))
        .await
        .map_err(|e| FaultError::Nats(e.to_string()))?;
    let mut publish_errors = 0u32;
    let publish = |events: Vec<KvEvent>| {
        let p = publisher.clone();
        async move {
            let mut errs = 0;
            for e in events {
                if p.publish(e.tier, e.data).await.is_err() {
                    errs += 1;
                }
            }
            errs
        }
    };
    // Conversation 0 before the restart.
    let ev = retain(bank, &convs[0].1, &convs[0].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    pump(&mut rx, router, bank, Duration::from_secs(5), true).await?;
    let before_ok = router.holds_all(bank);

    // Restart; conversation 1 is published while the clients reconnect.
    server.restart().map_err(FaultError::Nats)?;
    let ev = retain(bank, &convs[1].1, &convs[1].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    pub_plane
        .wait_for_subscribers(&subject, 1, Duration::from_secs(10))
        .await
        .map_err(|e| FaultError::Nats(format!("after restart: {e}")))?;
    pump(&mut rx, router, bank, Duration::from_millis(300), false).await?;

    // A request for conversation 1 inside the window: whatever the index
    // knows, the output must be right and nothing false may complete.
    let c1 = &convs[1].0;
    let off1 = generate(model, KvCache::new(target.layout), &c1.prompt)?;
    let advice = router.advise("nats-window", &prompt_hashes(&c1.prompt, bs), target_engine);
    let (w, window_completed, window_fallback) = target.serve(
        model,
        &c1.prompt,
        advice.hint.as_ref(),
        bank,
        &DeliveryControl::new(),
    )?;
    let window_safe =
        w == off1 && (window_completed || advice.hint.is_none() || window_fallback.is_some());

    // Conversation 2 after reconnect reveals any gap; resync repairs it.
    let ev = retain(bank, &convs[2].1, &convs[2].0.retained_tokens)?;
    publish_errors += publish(ev).await;
    let (applied, resyncs) = pump(&mut rx, router, bank, Duration::from_secs(10), true).await?;
    let stats = rx.stats();
    let inventory_complete = router.holds_all(bank);
    let advice = router.advise("nats-after", &prompt_hashes(&c1.prompt, bs), target_engine);
    let (after, completed_after, after_fallback) = target.serve(
        model,
        &c1.prompt,
        advice.hint.as_ref(),
        bank,
        &DeliveryControl::new(),
    )?;
    resync_task.abort();
    Ok(NatsResult {
        window_safe: window_safe && before_ok,
        window_completed: window_completed && w != off1,
        inventory_complete,
        completed_after,
        outputs_match: w == off1 && after == off1,
        detail: format!(
            "before restart complete: {before_ok}; window: hint {} completed {window_completed}; \
             publish errors {publish_errors}; receiver gaps {} lost {} duplicates {}; \
             applied after restart {applied}; full resyncs {resyncs}; inventory complete: \
             {inventory_complete}; fetch after: {completed_after} {}",
            advice.hint.is_some(),
            stats.gaps,
            stats.lost,
            stats.duplicates,
            after_fallback.unwrap_or_default()
        ),
    })
}
