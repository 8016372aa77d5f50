//! [`Link`]: the SUB and replay (DEALER) sockets of one subscription, the
//! replay round trip, reconnecting a closed replay socket with back-off
//! ([`Redial`]), the SUB socket's connection state (ZeroMQ reconnects a
//! lost PUB endpoint by itself; the link watches its monitor and says so
//! in its own, rate-limited words: [`Down`]), and the gap repair and
//! restart checks that use them. A child of `subscriber.rs`, which owns the
//! state these sockets feed.

// The parent's imports and private items, as if this were still its body.
use super::*;

/// The sockets of one subscription.
pub(super) struct Link {
    pub(super) config: VllmSubscriberConfig,
    pub(super) sub: SubSocket,
    /// The SUB socket's monitor: its connection to the PUB endpoint lost
    /// (`Disconnected`) and made again (`Connected`).
    pub(super) sub_events: SubEvents,
    /// Set while the PUB endpoint's connection is lost.
    pub(super) down: Option<Down>,
    /// The open replay socket. `None` with a configured replay endpoint:
    /// closed after a failed round trip, or its endpoint was down; it is
    /// connected again at the next replay ([`Redial`]).
    pub(super) dealer: Option<DealerSocket>,
    pub(super) redial: Redial,
    pub(super) probe_warn: LogThrottle,
}

pub(super) type Dialing = tokio::task::JoinHandle<Result<DealerSocket, VllmEventError>>;

/// A SUB socket's monitor events.
pub(super) type SubEvents = futures::channel::mpsc::Receiver<SocketEvent>;

/// The PUB endpoint's connection is lost: ZeroMQ reconnects it in the
/// background (its own back-off, up to about 30 s between attempts; its own
/// per-attempt log lines are off in the router's default filter), and the
/// link warns once when it is lost and again every [`DOWN_WARN_EVERY`]
/// while it stays lost.
#[derive(Debug, Clone, Copy)]
pub(super) struct Down {
    pub(super) since: Instant,
    /// No "still down" warning before this.
    pub(super) next_warn: Instant,
}

/// Reconnecting a closed replay socket: one connect at a time, in the
/// background, with a bounded exponential back-off between failed ones.
#[derive(Default)]
pub(super) struct Redial {
    pub(super) dialing: Option<Dialing>,
    /// No new connect before this.
    pub(super) not_before: Option<Instant>,
    pub(super) backoff: Duration,
    /// Why the last connect failed.
    pub(super) last_error: Option<String>,
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(d) = self.redial.dialing.take() {
            d.abort();
        }
    }
}

impl Link {
    pub(super) async fn connect(config: &VllmSubscriberConfig) -> Result<Self, VllmEventError> {
        let transport = |endpoint: &str, reason: String| VllmEventError::Transport {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let (sub, sub_events) = Self::subscribe(config)
            .await
            .map_err(|reason| transport(&config.endpoint, reason))?;
        let dealer = match &config.replay_endpoint {
            Some(ep) => Some(Self::dealer(ep, config.connect_timeout).await?),
            None => None,
        };
        Ok(Self {
            config: config.clone(),
            sub,
            sub_events,
            down: None,
            dealer,
            redial: Redial::default(),
            probe_warn: LogThrottle::new(PROBE_WARN_EVERY),
        })
    }

    /// A SUB socket connected to `config.endpoint` and subscribed to its
    /// topic, with its monitor (set before the connect, so no event of it
    /// is missed).
    pub(super) async fn subscribe(
        config: &VllmSubscriberConfig,
    ) -> Result<(SubSocket, SubEvents), String> {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(config.connect_timeout);
        let mut sub = SubSocket::with_options(opts);
        let events = sub.monitor();
        sub.connect(&config.endpoint)
            .await
            .map_err(|e| e.to_string())?;
        sub.subscribe(&config.topic)
            .await
            .map_err(|e| e.to_string())?;
        Ok((sub, events))
    }

    /// Takes in one event of the SUB socket's monitor: a lost connection is
    /// warned about once (`vLLM event endpoint disconnected: reconnecting`)
    /// and counted (`disconnects`), one made again while it was lost is
    /// logged with how long it was down and counted (`reconnects`); other
    /// events change nothing.
    pub(super) fn on_sub_event(&mut self, shared: &Mutex<Shared>, event: SocketEvent) {
        match event {
            SocketEvent::Disconnected(_) if self.down.is_none() => {
                let now = Instant::now();
                self.down = Some(Down {
                    since: now,
                    next_warn: now + DOWN_WARN_EVERY,
                });
                shared.lock().stats.disconnects += 1;
                tracing::warn!(
                    endpoint = %self.config.endpoint,
                    replay = self.has_replay(),
                    "vLLM event endpoint disconnected: reconnecting"
                );
            }
            SocketEvent::Connected(..) => self.sub_up(shared),
            _ => {}
        }
    }

    /// The SUB socket is connected (ZeroMQ's reconnect, or a new socket
    /// after a restart): ends a [`Down`], logged and counted.
    pub(super) fn sub_up(&mut self, shared: &Mutex<Shared>) {
        if let Some(down) = self.down.take() {
            shared.lock().stats.reconnects += 1;
            tracing::info!(
                endpoint = %self.config.endpoint,
                down_for = ?down.since.elapsed(),
                "vLLM event endpoint reconnected"
            );
        }
    }

    /// While the PUB endpoint's connection stays lost: one warning per
    /// [`DOWN_WARN_EVERY`], with how long it has been down.
    pub(super) fn warn_still_down(&mut self) {
        let Some(down) = self.down.as_mut() else {
            return;
        };
        down.next_warn = Instant::now() + DOWN_WARN_EVERY;
        tracing::warn!(
            endpoint = %self.config.endpoint,
            down_for = ?down.since.elapsed(),
            "vLLM event endpoint still down: reconnecting"
        );
    }

    pub(super) async fn dealer(
        endpoint: &str,
        timeout: Duration,
    ) -> Result<DealerSocket, VllmEventError> {
        let mut opts = SocketOptions::default();
        opts.connect_timeout(timeout);
        let mut d = DealerSocket::with_options(opts);
        d.connect(endpoint)
            .await
            .map_err(|e| VllmEventError::Transport {
                endpoint: endpoint.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(d)
    }

    pub(super) async fn run(mut self, shared: Arc<Mutex<Shared>>, mut stop: oneshot::Receiver<()>) {
        let idle = self.config.idle_probe.filter(|_| self.has_replay());
        loop {
            let (sub, sub_events) = (&mut self.sub, &mut self.sub_events);
            let recv = async {
                match idle {
                    Some(d) => tokio::time::timeout(d, sub.recv()).await.ok(),
                    None => Some(sub.recv().await),
                }
            };
            let down = self.down;
            let still_down = async {
                match down {
                    Some(d) => tokio::time::sleep_until(d.next_warn.into()).await,
                    None => std::future::pending().await,
                }
            };
            let got = tokio::select! {
                _ = &mut stop => return,
                Some(event) = sub_events.next() => {
                    self.on_sub_event(&shared, event);
                    continue;
                }
                () = still_down => {
                    self.warn_still_down();
                    continue;
                }
                got = recv => got,
            };
            match got {
                // Idle: ask for anything newer than what we have.
                None => {
                    if let Err(reason) = self.idle_probe(&shared).await {
                        if let Some(suppressed) = self.probe_warn.admit(Instant::now()) {
                            tracing::warn!(
                                %reason,
                                endpoint = %self.config.endpoint,
                                suppressed,
                                "vLLM idle replay probe failed"
                            );
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, endpoint = %self.config.endpoint, "vLLM SUB receive failed");
                    tokio::select! {
                        _ = &mut stop => return,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                Some(Ok(msg)) => match split_live(msg) {
                    Err(e) => {
                        tracing::warn!(error = %e, "malformed vLLM event message");
                        shared.lock().stats.malformed_frames += 1;
                    }
                    Ok((seq, payload)) => self.on_live(&shared, seq, payload).await,
                },
            }
        }
    }

    /// One live batch: duplicate, restart, gap, implausible jump or the next
    /// one (see the module documentation).
    pub(super) async fn on_live(&mut self, shared: &Mutex<Shared>, seq: u64, payload: Vec<u8>) {
        let next = shared.lock().stats.next_seq;
        if seq < next {
            if shared.lock().is_duplicate(seq, &payload) {
                shared.lock().stats.duplicates += 1;
                return;
            }
            self.on_suspected_restart(shared, seq, payload).await;
            return;
        }
        if !self.has_replay() {
            let mut sh = shared.lock();
            sh.apply_unreplayed(seq, payload, self.config.max_seq_jump);
            return;
        }
        if seq > next {
            match self.replay(shared, next).await {
                Ok(replies) => {
                    let listed = replies.iter().any(|(s, _)| *s >= seq);
                    let mut sh = shared.lock();
                    sh.apply_replies(replies);
                    if !listed {
                        // The publisher never sent `seq`: a foreign frame.
                        tracing::warn!(
                            seq,
                            next,
                            "vLLM batch seq not in the publisher's replay buffer: refused"
                        );
                        sh.stats.implausible_seq += 1;
                        return;
                    }
                    if sh.stats.next_seq < seq {
                        sh.lose(seq);
                    }
                }
                Err(reason) => {
                    tracing::warn!(%reason, from = next, upto = seq, "vLLM gap repair failed");
                    let mut sh = shared.lock();
                    if seq - next > self.config.max_seq_jump {
                        sh.stats.implausible_seq += 1;
                        return;
                    }
                    sh.lose(seq);
                }
            }
        }
        let undecodable = {
            let mut sh = shared.lock();
            if seq < sh.stats.next_seq {
                sh.stats.duplicates += 1;
                return;
            }
            !sh.apply(seq, &payload, false)
        };
        if undecodable {
            // Ask the publisher for its own copy of that batch.
            if let Err(reason) = self.repair(shared, None).await {
                tracing::warn!(%reason, seq, "vLLM replay of an undecodable batch failed");
            }
        }
    }

    /// Replays from the last applied batch: the publisher's copy of it must
    /// be the one applied, else (another payload, or nothing at or after it
    /// in a buffer that only trims when newer batches exist) the engine
    /// restarted. Newer batches are applied.
    pub(super) async fn idle_probe(&mut self, shared: &Mutex<Shared>) -> Result<(), String> {
        let last = {
            let sh = shared.lock();
            sh.recent
                .back()
                .copied()
                .filter(|(s, _)| s.saturating_add(1) == sh.stats.next_seq)
        };
        let Some((last_seq, last_digest)) = last else {
            return self.repair(shared, None).await;
        };
        let replies = self.replay(shared, last_seq).await?;
        let restarted = match replies.first() {
            Some((s, p)) if *s == last_seq => digest(p) != last_digest,
            Some(_) => false,
            None => true,
        };
        if restarted {
            shared.lock().restart();
            self.resubscribe(shared).await;
            return self.repair(shared, None).await;
        }
        // The first reply is the batch we already hold: not a duplicate.
        let newer = replies.into_iter().filter(|(s, _)| *s > last_seq).collect();
        shared.lock().apply_replies(newer);
        Ok(())
    }

    /// A restarted engine bound its sockets anew: connect the SUB socket
    /// again rather than rely on the old connection's reconnects.
    pub(super) async fn resubscribe(&mut self, shared: &Mutex<Shared>) {
        match Self::subscribe(&self.config).await {
            Ok((sub, events)) => {
                self.sub = sub;
                self.sub_events = events;
                self.sub_up(shared);
            }
            Err(reason) => {
                tracing::warn!(endpoint = %self.config.endpoint, %reason, "vLLM resubscribe after restart failed");
            }
        }
    }

    /// A live batch under an already applied `seq` with another payload.
    pub(super) async fn on_suspected_restart(
        &mut self,
        shared: &Mutex<Shared>,
        seq: u64,
        payload: Vec<u8>,
    ) {
        if self.has_replay() {
            // Confirmed only if the publisher's buffer holds this payload
            // under this seq (a new incarnation's batch, not a foreign frame).
            let want = digest(&payload);
            match self.replay(shared, seq).await {
                Ok(replies) => {
                    if !replies.iter().any(|(s, p)| *s == seq && digest(p) == want) {
                        tracing::warn!(seq, "vLLM batch repeats a seq with another payload, not from the publisher: refused");
                        shared.lock().stats.implausible_seq += 1;
                        return;
                    }
                }
                Err(reason) => {
                    tracing::warn!(%reason, seq, "vLLM restart check failed");
                    shared.lock().stats.implausible_seq += 1;
                    return;
                }
            }
        }
        shared.lock().restart();
        self.resubscribe(shared).await;
        if self.has_replay() {
            if let Err(reason) = self.repair(shared, None).await {
                tracing::warn!(%reason, "vLLM replay after a restart failed");
            }
        }
        let mut sh = shared.lock();
        if seq >= sh.stats.next_seq {
            sh.apply(seq, &payload, false);
        }
    }

    /// Replays from the next expected `seq` and applies what comes back.
    /// `upto`: the live `seq` that revealed a gap (everything before it that
    /// the replay does not supply is lost). A failed replay with a known gap
    /// counts the gap as lost.
    pub(super) async fn repair(
        &mut self,
        shared: &Mutex<Shared>,
        upto: Option<u64>,
    ) -> Result<(), String> {
        let from = shared.lock().stats.next_seq;
        let replies = match self.replay(shared, from).await {
            Ok(r) => r,
            Err(reason) => {
                if let Some(upto) = upto {
                    shared.lock().lose(upto);
                }
                return Err(reason);
            }
        };
        let mut sh = shared.lock();
        sh.apply_replies(replies);
        if let Some(upto) = upto {
            if sh.stats.next_seq < upto {
                sh.lose(upto);
            }
        }
        Ok(())
    }

    /// One replay round trip: `[empty, from]` out, replies (either shape of
    /// [`parse_replay_reply`]) until the end marker.
    pub(super) async fn replay(
        &mut self,
        shared: &Mutex<Shared>,
        from: u64,
    ) -> Result<Vec<(u64, Vec<u8>)>, String> {
        // Counted per attempt, so that `replay_failures` never exceeds it
        // (it was counted per success: trial h42, 6).
        shared.lock().stats.replay_requests += 1;
        let result = self.round_trip(from).await;
        if result.is_err() {
            shared.lock().stats.replay_failures += 1;
        }
        result
    }

    /// Whether a replay endpoint is configured (its socket may be closed
    /// for now: [`Link::open_dealer`]).
    pub(super) fn has_replay(&self) -> bool {
        self.config.replay_endpoint.is_some()
    }

    pub(super) async fn round_trip(&mut self, from: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        if self.dealer.is_none() {
            let opened = self.open_dealer().await?;
            self.dealer = Some(opened);
        }
        let Some(dealer) = self.dealer.as_mut() else {
            return Err("no replay socket".into());
        };
        let timeout = self.config.replay_timeout;
        let result = async {
            tokio::time::timeout(
                timeout,
                dealer.send(multipart(vec![Vec::new(), from.to_be_bytes().to_vec()])),
            )
            .await
            .map_err(|_| format!("replay request not sent within {timeout:?}"))?
            .map_err(|e| format!("replay request not sent: {e}"))?;
            let mut out = Vec::new();
            loop {
                let msg = tokio::time::timeout(timeout, dealer.recv())
                    .await
                    .map_err(|_| format!("no replay reply within {timeout:?}"))?
                    .map_err(|e| format!("replay receive failed: {e}"))?;
                let frames = msg.into_vec();
                match parse_replay_reply(&frames).map_err(|e| e.to_string())? {
                    None => return Ok(out),
                    Some(reply) => out.push(reply),
                }
            }
        }
        .await;
        if result.is_err() {
            // Late replies of this request must not be read as answers to
            // the next one: the next replay starts over with a fresh socket
            // (connected then, so an endpoint down right now is not lost).
            self.dealer = None;
        }
        result
    }

    /// Connects the replay socket again: one connect at a time, run in the
    /// background (awaited here for at most [`REDIAL_WAIT`]); after a failed
    /// one, none before a back-off from [`REDIAL_BACKOFF_MIN`] doubling up to
    /// [`REDIAL_BACKOFF_MAX`]. The error says why there is no socket.
    pub(super) async fn open_dealer(&mut self) -> Result<DealerSocket, String> {
        let Some(ep) = self.config.replay_endpoint.clone() else {
            return Err("no replay endpoint configured".into());
        };
        let r = &mut self.redial;
        if r.dialing.is_none() {
            if let Some(at) = r.not_before {
                let now = Instant::now();
                if now < at {
                    return Err(format!(
                        "replay socket to {ep} not connected ({}); next connect in {:?}",
                        r.last_error.as_deref().unwrap_or("connect failed"),
                        at - now
                    ));
                }
            }
            let timeout = self.config.connect_timeout;
            let endpoint = ep.clone();
            r.dialing = Some(tokio::spawn(async move {
                Self::dealer(&endpoint, timeout).await
            }));
        }
        let Some(dialing) = r.dialing.as_mut() else {
            unreachable!("started above");
        };
        let Ok(joined) = tokio::time::timeout(REDIAL_WAIT, dialing).await else {
            return Err(format!("replay socket to {ep} not connected (connecting)"));
        };
        r.dialing = None;
        match joined
            .map_err(|e| e.to_string())
            .and_then(|d| d.map_err(|e| e.to_string()))
        {
            Ok(dealer) => {
                *r = Redial::default();
                Ok(dealer)
            }
            Err(reason) => {
                r.backoff = (r.backoff * 2).clamp(REDIAL_BACKOFF_MIN, REDIAL_BACKOFF_MAX);
                r.not_before = Some(Instant::now() + r.backoff);
                let msg = format!(
                    "replay socket to {ep} not connected ({reason}); next connect in {:?}",
                    r.backoff
                );
                r.last_error = Some(reason);
                Err(msg)
            }
        }
    }
}
