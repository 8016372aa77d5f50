//! Refusals of connections over [`PinServiceConfig::max_connections`],
//! written on their own thread so that the accept loop never blocks on a
//! socket write (a target that does not read would otherwise hold every
//! other target's connect for up to [`PinServiceConfig::io_timeout`]).

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};

use super::*;

/// Over-limit connections waiting for their refusal. One refusal frame fits
/// any socket buffer, so the queue only fills while the refuser is stalled
/// on a target that does not read; the excess is then closed unanswered.
pub(super) const REFUSAL_QUEUE: usize = 16;

/// Writes one donor message to a connection (the service's `send`).
pub(crate) type RefusalWriter = fn(&mut PinStream, &PinDonorMessage) -> std::io::Result<()>;

/// Starts the refuser thread; it ends when the returned sender is dropped.
pub(super) fn start(s: Arc<Shared>) -> std::io::Result<(SyncSender<PinStream>, JoinHandle<()>)> {
    let (tx, rx) = sync_channel(REFUSAL_QUEUE);
    let thread = std::thread::Builder::new()
        .name("kv-pin-refuse".into())
        .spawn(move || refuse_loop(&s, rx))?;
    Ok((tx, thread))
}

/// Accept thread: queues `stream` for its refusal, or closes it at once
/// when the queue is full. Never blocks.
pub(super) fn hand_over(s: &Shared, queue: &SyncSender<PinStream>, stream: PinStream) {
    s.counters
        .connections_refused
        .fetch_add(1, Ordering::SeqCst);
    if stream.is_tcp() {
        // Not authenticated yet: nothing is written to it, closing is the refusal.
        return;
    }
    match queue.try_send(stream) {
        Ok(()) => {}
        // Dropping the stream closes it: end-of-stream is the refusal.
        Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
    }
}

fn refuse_loop(s: &Shared, queue: Receiver<PinStream>) {
    for mut stream in queue {
        if s.stopping.load(Ordering::SeqCst) {
            continue; // closed unanswered: the service is going away
        }
        // The accept thread already set the write timeout (io_timeout).
        let _ = (s.refusal_writer)(
            &mut stream,
            &refusal(
                0,
                PinRefusalReason::TooManyPins,
                format!("connection limit {} reached", s.config.max_connections),
            ),
        );
    }
}
