//! A publisher speaking vLLM's `ZmqEventPublisher` protocol, for test
//! engines, qualification and tools that emit vLLM-format KV events.
//!
//! Protocol (vLLM `vllm/distributed/kv_events.py`):
//! - PUB socket: multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian
//!   unsigned integer starting at 0, +1 per batch; `payload` a msgpack
//!   `KVEventBatch`.
//! - ROUTER replay socket: a client sends `[empty, start_seq]` (8-byte
//!   big-endian) from a DEALER (or REQ) socket; the publisher answers one
//!   `[empty, topic, seq, payload]` per buffered batch with `seq >= start_seq`,
//!   then `[empty, empty, -1 as 8-byte big-endian signed, empty]` as the end
//!   marker (vLLM 0.33; releases before vLLM PR #45177 sent no topic frame:
//!   [`VllmZmqPublisher::set_legacy_replay`]). The buffer keeps the last
//!   `buffer_steps` batches.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{encode_batch, VllmEncoding, VllmEventBatch, VllmEventError};

/// The replay end marker's sequence frame: -1 as 8-byte big-endian signed.
pub const REPLAY_END_SEQ: [u8; 8] = [0xff; 8];

/// Builds a multipart message from frames (at least one).
pub(crate) fn multipart(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let mut it = frames.into_iter().rev();
    let mut msg = ZmqMessage::from(it.next().unwrap_or_default());
    for f in it {
        msg.prepend(&ZmqMessage::from(f));
    }
    msg
}

#[derive(Debug, Default)]
struct ReplayState {
    buffer: VecDeque<(u64, Vec<u8>)>,
    requests: Vec<u64>,
    /// Reply without the topic frame (vLLM before PR #45177).
    legacy: bool,
}

/// A vLLM-protocol KV event publisher (PUB + ROUTER replay), bound on TCP.
pub struct VllmZmqPublisher {
    socket: PubSocket,
    topic: Vec<u8>,
    next_seq: u64,
    buffer_steps: usize,
    state: Arc<Mutex<ReplayState>>,
    replay_task: tokio::task::JoinHandle<()>,
    endpoint: String,
    replay_endpoint: String,
}

impl std::fmt::Debug for VllmZmqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmZmqPublisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

impl VllmZmqPublisher {
    /// Binds the PUB socket on `endpoint` and the ROUTER replay socket on
    /// `replay_endpoint` (`tcp://127.0.0.1:0` picks a free port; see
    /// [`VllmZmqPublisher::endpoint`]). Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`VllmEventError::Config`] for `buffer_steps` 0,
    /// [`VllmEventError::Transport`] when a bind fails.
    pub async fn bind(
        endpoint: &str,
        replay_endpoint: &str,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<Self, VllmEventError> {
        if buffer_steps == 0 {
            return Err(VllmEventError::Config {
                field: "buffer_steps",
                reason: "must be at least 1".into(),
            });
        }
        let transport = |endpoint: &str, e: zeromq::ZmqError| VllmEventError::Transport {
            endpoint: endpoint.to_owned(),
            reason: e.to_string(),
        };
        let mut socket = PubSocket::new();
        let bound = socket
            .bind(endpoint)
            .await
            .map_err(|e| transport(endpoint, e))?;
        let mut router = RouterSocket::new();
        let replay_bound = router
            .bind(replay_endpoint)
            .await
            .map_err(|e| transport(replay_endpoint, e))?;
        let state = Arc::new(Mutex::new(ReplayState::default()));
        let replay_task = tokio::spawn(serve_replay(
            router,
            state.clone(),
            topic.as_bytes().to_vec(),
        ));
        Ok(Self {
            socket,
            topic: topic.as_bytes().to_vec(),
            next_seq: 0,
            buffer_steps,
            state,
            replay_task,
            endpoint: bound.to_string(),
            replay_endpoint: replay_bound.to_string(),
        })
    }

    /// The bound PUB endpoint (`tcp://host:port`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound ROUTER replay endpoint.
    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// Sequence number the next batch will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Answer replay requests as vLLM releases before PR #45177 did
    /// (`[empty, seq, payload]`, no topic frame) when `on`; the default is
    /// vLLM 0.33's `[empty, topic, seq, payload]`.
    pub fn set_legacy_replay(&self, on: bool) {
        self.state.lock().legacy = on;
    }

    /// Start sequence numbers of the replay requests served so far, in order.
    pub fn replay_requests(&self) -> Vec<u64> {
        self.state.lock().requests.clone()
    }

    /// Encodes and publishes `batch`; returns its sequence number.
    ///
    /// # Errors
    /// [`VllmEventError::Transport`] when the PUB socket fails.
    pub async fn publish(
        &mut self,
        batch: &VllmEventBatch,
        encoding: VllmEncoding,
    ) -> Result<u64, VllmEventError> {
        self.publish_payload(encode_batch(batch, encoding)).await
    }

    /// Publishes an already encoded payload; returns its sequence number.
    ///
    /// # Errors
    /// [`VllmEventError::Transport`] when the PUB socket fails.
    pub async fn publish_payload(&mut self, payload: Vec<u8>) -> Result<u64, VllmEventError> {
        let seq = self.buffer(payload.clone());
        self.socket
            .send(multipart(vec![
                self.topic.clone(),
                seq.to_be_bytes().to_vec(),
                payload,
            ]))
            .await
            .map_err(|e| VllmEventError::Transport {
                endpoint: self.endpoint.clone(),
                reason: e.to_string(),
            })?;
        Ok(seq)
    }

    /// Sends `[topic, seq, payload]` live with any `seq`, without taking a
    /// sequence number or keeping it for replay: a foreign or corrupt frame
    /// on the endpoint. Fault injection for the subscriber's tests.
    ///
    /// # Errors
    /// [`VllmEventError::Transport`] when the PUB socket fails.
    pub async fn send_raw(&mut self, seq: u64, payload: Vec<u8>) -> Result<(), VllmEventError> {
        self.socket
            .send(multipart(vec![
                self.topic.clone(),
                seq.to_be_bytes().to_vec(),
                payload,
            ]))
            .await
            .map_err(|e| VllmEventError::Transport {
                endpoint: self.endpoint.clone(),
                reason: e.to_string(),
            })
    }

    /// Takes a sequence number and keeps `payload` for replay without
    /// sending it live: what a PUB socket does to a subscriber past its
    /// high-water mark. Fault injection for gap and resync tests.
    pub fn drop_live(&mut self, batch: &VllmEventBatch, encoding: VllmEncoding) -> u64 {
        self.buffer(encode_batch(batch, encoding))
    }

    fn buffer(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut st = self.state.lock();
        st.buffer.push_back((seq, payload));
        while st.buffer.len() > self.buffer_steps {
            st.buffer.pop_front();
        }
        seq
    }
}

impl Drop for VllmZmqPublisher {
    fn drop(&mut self) {
        self.replay_task.abort();
    }
}

async fn serve_replay(mut router: RouterSocket, state: Arc<Mutex<ReplayState>>, topic: Vec<u8>) {
    while let Ok(msg) = router.recv().await {
        let frames: Vec<Vec<u8>> = msg.into_vec().into_iter().map(|b| b.to_vec()).collect();
        // [identity, empty delimiter, start_seq]; vLLM ignores anything else.
        let [id, _, start] = frames.as_slice() else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let (replies, legacy): (Vec<(u64, Vec<u8>)>, bool) = {
            let mut st = state.lock();
            st.requests.push(start);
            let replies = st
                .buffer
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            (replies, st.legacy)
        };
        // [identity, empty, (topic,) seq, payload]
        let reply = |topic: &[u8], seq: Vec<u8>, payload: Vec<u8>| {
            let mut frames = vec![id.clone(), Vec::new()];
            if !legacy {
                frames.push(topic.to_vec());
            }
            frames.extend([seq, payload]);
            multipart(frames)
        };
        for (seq, payload) in replies {
            if router
                .send(reply(&topic, seq.to_be_bytes().to_vec(), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = router
            .send(reply(&[], REPLAY_END_SEQ.to_vec(), Vec::new()))
            .await;
    }
}
