//! ZMQ subscriber to a vLLM engine's KV event stream, with readiness and
//! gap repair through the engine's replay socket.
//!
//! Readiness: a ZMQ PUB socket silently drops what it publishes before a
//! subscriber's subscription reached it, and nothing acknowledges a
//! subscription. So [`VllmSubscriber::start`] connects the SUB socket,
//! subscribes, then asks the replay socket for everything from `first_seq`
//! and applies it before returning: every batch the engine published before
//! the subscriber became ready is applied (as far as the engine's replay
//! buffer reaches back), and every later one arrives live or is repaired.
//!
//! Gaps: a live batch whose `seq` skips ahead triggers a replay request from
//! the first missing `seq`. Whatever the replay cannot supply (trimmed
//! buffer, no replay socket, timeout) is lost for good: the engine's
//! inventory is reset in the index ([`VllmIngest::reset`]), because a lost
//! `BlockRemoved` would otherwise leave the router believing in blocks that
//! are gone. When no batch arrives for `idle_probe`, the subscriber asks the
//! replay socket for anything newer than what it has, so a batch dropped at
//! the end of a burst is not left missing until the next one.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::publisher::{multipart, REPLAY_END_SEQ};
use super::{decode_batch, IngestStats, VllmEventError, VllmIngest};

/// Where and how to subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmSubscriberConfig {
    /// The engine's PUB endpoint (vLLM `--kv-events-config` `endpoint`,
    /// e.g. `tcp://decode-0:5557`).
    pub endpoint: String,
    /// The engine's ROUTER replay endpoint (`replay_endpoint`); `None`
    /// disables readiness catch-up and gap repair (every gap is a loss).
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (vLLM `topic`, default empty: all).
    pub topic: String,
    /// First sequence number wanted: 0 for an engine whose stream this
    /// subscriber follows from its start.
    pub first_seq: u64,
    /// Limit on connecting each socket.
    pub connect_timeout: Duration,
    /// Limit on waiting for each replay reply.
    pub replay_timeout: Duration,
    /// Replay probe after this long without a live batch; `None`: never.
    pub idle_probe: Option<Duration>,
}

impl VllmSubscriberConfig {
    /// Defaults: empty topic, `first_seq` 0, 5 s connect timeout, 2 s replay
    /// timeout, 1 s idle probe.
    pub fn new(endpoint: impl Into<String>, replay_endpoint: Option<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint,
            topic: String::new(),
            first_seq: 0,
            connect_timeout: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(2),
            idle_probe: Some(Duration::from_secs(1)),
        }
    }
}

/// Counters of a subscriber.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Next sequence number expected.
    pub next_seq: u64,
    /// Batches applied as they arrived live.
    pub live_batches: u64,
    /// Batches applied from replay replies.
    pub replayed_batches: u64,
    /// Batches received again (live after replay, or replayed twice): ignored.
    pub duplicates: u64,
    /// Replay requests sent (start, gaps, idle probes).
    pub replay_requests: u64,
    /// Batches lost for good (each loss resets the engine's inventory).
    pub lost_batches: u64,
    /// Batches whose payload did not decode (counted as lost too).
    pub undecodable: u64,
    /// Messages that were not `[topic, seq, payload]`.
    pub malformed_frames: u64,
    /// The ingest's own totals.
    pub ingest: IngestStats,
}

struct Shared {
    ingest: VllmIngest,
    stats: SubscriberStats,
}

/// A running subscription feeding one [`VllmIngest`].
pub struct VllmSubscriber {
    shared: Arc<Mutex<Shared>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for VllmSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmSubscriber")
            .field("stats", &self.stats())
            .finish()
    }
}

impl VllmSubscriber {
    /// Connects, subscribes, catches up through the replay socket, and
    /// returns once ready (see the module documentation). Must run inside a
    /// tokio runtime; the subscription runs as a task on it.
    ///
    /// # Errors
    /// [`VllmEventError::Transport`] when a socket cannot connect within
    /// `connect_timeout` or the catch-up replay gets no answer within
    /// `replay_timeout`.
    pub async fn start(
        config: VllmSubscriberConfig,
        ingest: VllmIngest,
    ) -> Result<Self, VllmEventError> {
        let mut link = Link::connect(&config).await?;
        let shared = Arc::new(Mutex::new(Shared {
            ingest,
            stats: SubscriberStats {
                next_seq: config.first_seq,
                ..SubscriberStats::default()
            },
        }));
        if link.dealer.is_some() {
            link.repair(&shared, None)
                .await
                .map_err(|reason| VllmEventError::Transport {
                    endpoint: config.replay_endpoint.clone().unwrap_or_default(),
                    reason: format!("catch-up replay failed: {reason}"),
                })?;
        }
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = tokio::spawn(link.run(shared.clone(), stop_rx));
        Ok(Self {
            shared,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// Current counters.
    pub fn stats(&self) -> SubscriberStats {
        let sh = self.shared.lock();
        SubscriberStats {
            ingest: sh.ingest.stats().clone(),
            ..sh.stats.clone()
        }
    }

    /// Reads the ingest (vLLM-name map, worker) under the subscriber's lock.
    pub fn with_ingest<R>(&self, f: impl FnOnce(&VllmIngest) -> R) -> R {
        f(&self.shared.lock().ingest)
    }

    /// Stops the subscription and hands back the ingest (to resume later
    /// with `first_seq` = [`SubscriberStats::next_seq`]).
    pub async fn stop(mut self) -> (VllmIngest, SubscriberStats) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let stats = self.stats();
        let shared = Arc::clone(&self.shared);
        drop(self);
        let shared = Arc::try_unwrap(shared)
            .ok()
            .expect("the subscription task has ended")
            .into_inner();
        (shared.ingest, stats)
    }
}

impl Drop for VllmSubscriber {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The sockets of one subscription.
struct Link {
    config: VllmSubscriberConfig,
    sub: SubSocket,
    dealer: Option<DealerSocket>,
}

/// A message is `[topic, seq, payload]`.
fn split_live(msg: ZmqMessage) -> Result<(u64, Vec<u8>), VllmEventError> {
    let frames = msg.into_vec();
    if frames.len() != 3 {
        return Err(VllmEventError::Frame {
            field: "frames",
            reason: format!("{} frames, expected [topic, seq, payload]", frames.len()),
        });
    }
    Ok((seq_of(&frames[1])?, frames[2].to_vec()))
}

fn seq_of(frame: &[u8]) -> Result<u64, VllmEventError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| VllmEventError::Frame {
            field: "seq",
            reason: format!("{} bytes, expected 8", frame.len()),
        })
}

impl Link {
    async fn connect(config: &VllmSubscriberConfig) -> Result<Self, VllmEventError> {
        let transport = |endpoint: &str, reason: String| VllmEventError::Transport {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let mut opts = SocketOptions::default();
        opts.connect_timeout(config.connect_timeout);
        let mut sub = SubSocket::with_options(opts);
        sub.connect(&config.endpoint)
            .await
            .map_err(|e| transport(&config.endpoint, e.to_string()))?;
        sub.subscribe(&config.topic)
            .await
            .map_err(|e| transport(&config.endpoint, e.to_string()))?;
        let dealer = match &config.replay_endpoint {
            Some(ep) => Some(Self::dealer(ep, config.connect_timeout).await?),
            None => None,
        };
        Ok(Self {
            config: config.clone(),
            sub,
            dealer,
        })
    }

    async fn dealer(endpoint: &str, timeout: Duration) -> Result<DealerSocket, VllmEventError> {
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

    async fn run(mut self, shared: Arc<Mutex<Shared>>, mut stop: oneshot::Receiver<()>) {
        let idle = self.config.idle_probe.filter(|_| self.dealer.is_some());
        loop {
            let recv = async {
                match idle {
                    Some(d) => tokio::time::timeout(d, self.sub.recv()).await.ok(),
                    None => Some(self.sub.recv().await),
                }
            };
            let got = tokio::select! {
                _ = &mut stop => return,
                got = recv => got,
            };
            match got {
                // Idle: ask for anything newer than what we have.
                None => {
                    if let Err(reason) = self.repair(&shared, None).await {
                        tracing::warn!(%reason, "vLLM idle replay probe failed");
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
                    Ok((seq, payload)) => {
                        let next = shared.lock().stats.next_seq;
                        if seq > next {
                            if let Err(reason) = self.repair(&shared, Some(seq)).await {
                                tracing::warn!(%reason, from = next, upto = seq, "vLLM gap repair failed");
                            }
                        }
                        let mut sh = shared.lock();
                        if seq >= sh.stats.next_seq {
                            sh.apply(seq, &payload, false);
                        } else {
                            sh.stats.duplicates += 1;
                        }
                    }
                },
            }
        }
    }

    /// Replays from the next expected `seq` and applies what comes back.
    /// `upto`: the live `seq` that revealed a gap (everything before it that
    /// the replay does not supply is lost). A failed replay with a known gap
    /// counts the gap as lost.
    async fn repair(&mut self, shared: &Mutex<Shared>, upto: Option<u64>) -> Result<(), String> {
        let from = shared.lock().stats.next_seq;
        let replies = match self.replay(from).await {
            Ok(r) => r,
            Err(reason) => {
                if let Some(upto) = upto {
                    shared.lock().lose(upto);
                }
                return Err(reason);
            }
        };
        shared.lock().stats.replay_requests += 1;
        let mut sh = shared.lock();
        for (seq, payload) in replies {
            if seq < sh.stats.next_seq {
                sh.stats.duplicates += 1;
                continue;
            }
            sh.apply(seq, &payload, true);
        }
        if let Some(upto) = upto {
            if sh.stats.next_seq < upto {
                sh.lose(upto);
            }
        }
        Ok(())
    }

    /// One replay round trip: `[empty, from]` out, `[empty, seq, payload]`
    /// replies until the end marker.
    async fn replay(&mut self, from: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let Some(dealer) = self.dealer.as_mut() else {
            return Err("no replay endpoint configured".into());
        };
        let timeout = self.config.replay_timeout;
        let result = async {
            dealer
                .send(multipart(vec![Vec::new(), from.to_be_bytes().to_vec()]))
                .await
                .map_err(|e| format!("replay request not sent: {e}"))?;
            let mut out = Vec::new();
            loop {
                let msg = tokio::time::timeout(timeout, dealer.recv())
                    .await
                    .map_err(|_| format!("no replay reply within {timeout:?}"))?
                    .map_err(|e| format!("replay receive failed: {e}"))?;
                let frames = msg.into_vec();
                let [_, seq, payload] = frames.as_slice() else {
                    return Err(format!(
                        "replay reply of {} frames, expected [empty, seq, payload]",
                        frames.len()
                    ));
                };
                if seq.as_ref() == REPLAY_END_SEQ {
                    return Ok(out);
                }
                let seq = seq_of(seq).map_err(|e| e.to_string())?;
                out.push((seq, payload.to_vec()));
            }
        }
        .await;
        if result.is_err() {
            // Late replies of this request must not be read as answers to
            // the next one: start over with a fresh socket.
            let ep = self.config.replay_endpoint.clone().unwrap_or_default();
            self.dealer = Self::dealer(&ep, self.config.connect_timeout).await.ok();
        }
        result
    }
}

impl Shared {
    /// Applies batch `seq` (at or past `next_seq`); anything skipped before
    /// it is lost.
    fn apply(&mut self, seq: u64, payload: &[u8], replayed: bool) {
        if seq > self.stats.next_seq {
            self.lose(seq);
        }
        self.stats.next_seq = seq + 1;
        match decode_batch(payload) {
            Ok(batch) => {
                self.ingest.apply_batch(&batch);
                if replayed {
                    self.stats.replayed_batches += 1;
                } else {
                    self.stats.live_batches += 1;
                }
            }
            Err(e) => {
                tracing::warn!(seq, error = %e, "undecodable vLLM event batch: inventory reset");
                self.stats.undecodable += 1;
                self.reset();
            }
        }
    }

    /// Batches `next_seq..upto` are lost for good.
    fn lose(&mut self, upto: u64) {
        if upto <= self.stats.next_seq {
            return;
        }
        let lost = upto - self.stats.next_seq;
        tracing::warn!(
            from = self.stats.next_seq,
            upto,
            "vLLM event batches lost: inventory reset"
        );
        self.stats.lost_batches += lost;
        self.stats.next_seq = upto;
        self.reset();
    }

    fn reset(&mut self) {
        if let Err(e) = self.ingest.reset() {
            tracing::warn!(error = %e, "vLLM inventory reset refused");
        }
    }
}
