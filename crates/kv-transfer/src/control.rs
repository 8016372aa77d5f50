//! Cancellation, deadline and donor liveness for one delivery.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::TransferError;

/// Cloneable cancellation flag shared between the caller and the delivery.
///
/// ```
/// let t = kv_transfer::CancelToken::new();
/// let t2 = t.clone();
/// t2.cancel();
/// assert!(t.is_cancelled());
/// ```
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token that has not fired.
    pub fn new() -> Self {
        Self::default()
    }
    /// Fires the token; every clone observes it.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
    /// True once [`CancelToken::cancel`] was called on any clone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Reports whether the donor is still alive and still owns the pinned slots
/// (for example: its lease is current and its process exists).
pub type LivenessProbe = Arc<dyn Fn() -> bool + Send + Sync>;

/// Called once per rank part, with its TP rank, when the part's copies are
/// issued and the [`ConsumerStream`] of its destination device was made to
/// wait for them (the bytes have not landed yet).
pub type EnqueuedNotice = Arc<dyn Fn(u32) + Send + Sync>;

/// The engine's CUDA stream that is to read the delivered rows: the CUDA
/// backend makes it wait for the delivery's copies (an event recorded after
/// them, `cuStreamWaitEvent`) as soon as they are issued, then calls the
/// notice, then synchronises its own stream as always. Work the engine
/// enqueues on that stream afterwards (its forward pass) runs once the bytes
/// have landed, while the host side of the fetch (waiting, donor probe, pin
/// release, verification, commit) goes on: the engine launches its forward
/// without waiting for the fetch to return.
///
/// The fetch is still not complete until [`crate::deliver`] (and the caller's
/// verification) returned success: work queued behind the wait computes on
/// bytes that may yet be refused, so its results must be discarded unless the
/// fetch succeeds (no false completion). Other backends (host memcpy, NIXL)
/// ignore it: their copies have landed when they return.
///
/// ```no_run
/// # fn f(torch_stream: u64) {
/// use std::sync::Arc;
/// // SAFETY: `torch_stream` is a live stream of device 0's primary context
/// // (torch's `Stream.cuda_stream`) that outlives the delivery.
/// let s = unsafe {
///     kv_transfer::ConsumerStream::new(0, torch_stream, Arc::new(|rank| println!("rank {rank} enqueued")))
/// };
/// let control = kv_transfer::DeliveryControl { consumer: Some(s), ..kv_transfer::DeliveryControl::new() };
/// # }
/// ```
#[derive(Clone)]
pub struct ConsumerStream {
    ordinal: u32,
    stream: u64,
    notice: EnqueuedNotice,
}

impl std::fmt::Debug for ConsumerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerStream")
            .field("ordinal", &self.ordinal)
            .field("stream", &format_args!("{:#x}", self.stream))
            .finish()
    }
}

impl ConsumerStream {
    /// The stream `stream` (a raw `CUstream` handle as an integer, e.g.
    /// torch's `torch.cuda.Stream.cuda_stream`; 0 is the legacy default
    /// stream) of CUDA device `ordinal`; `notice` is called once per rank
    /// part when that stream waits for the part's copies.
    ///
    /// # Safety
    /// `stream` must be a stream of the primary context of device `ordinal`
    /// (the context every CUDA runtime user, torch included, shares) or 0,
    /// and must stay alive until every delivery given this control returned:
    /// the backend passes it to `cuStreamWaitEvent`, and the driver does not
    /// validate handles.
    pub unsafe fn new(ordinal: u32, stream: u64, notice: EnqueuedNotice) -> Self {
        Self {
            ordinal,
            stream,
            notice,
        }
    }

    /// CUDA device ordinal of the stream.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The raw `CUstream` handle.
    pub fn stream(&self) -> u64 {
        self.stream
    }

    /// Tells the caller that rank `rank`'s copies are issued and the stream
    /// waits for them.
    pub fn notify(&self, rank: u32) {
        (self.notice)(rank)
    }
}

/// How a delivery may be stopped. Backends check it between batches of copies
/// and the delivery checks it once more after every part finished, so a
/// cancelled, late or donor-lost delivery is never reported complete.
#[derive(Clone)]
pub struct DeliveryControl {
    /// Cancellation token.
    pub cancel: CancelToken,
    /// Start of the delivery (for the deadline and error messages).
    pub started: Instant,
    /// Absolute deadline, if any.
    pub deadline: Option<Instant>,
    /// Donor liveness probe, if any. Checked before the first byte and after
    /// the last one: bytes read from a donor that died meanwhile are not trusted.
    pub donor_alive: Option<LivenessProbe>,
    /// The engine stream that reads the delivered rows, made to wait for the
    /// copies as soon as they are issued ([`ConsumerStream`]; CUDA only).
    pub consumer: Option<ConsumerStream>,
}

impl std::fmt::Debug for DeliveryControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryControl")
            .field("cancelled", &self.cancel.is_cancelled())
            .field("deadline", &self.deadline)
            .field("has_liveness_probe", &self.donor_alive.is_some())
            .field("consumer", &self.consumer)
            .finish()
    }
}

impl Default for DeliveryControl {
    fn default() -> Self {
        Self::new()
    }
}

impl DeliveryControl {
    /// No deadline, fresh token, no liveness probe.
    pub fn new() -> Self {
        Self {
            cancel: CancelToken::new(),
            started: Instant::now(),
            deadline: None,
            donor_alive: None,
            consumer: None,
        }
    }

    /// Same, with a deadline `timeout` from now.
    pub fn with_timeout(timeout: Duration) -> Self {
        let now = Instant::now();
        Self {
            deadline: Some(now + timeout),
            started: now,
            ..Self::new()
        }
    }

    /// Errors when cancelled or past the deadline.
    ///
    /// # Errors
    /// [`TransferError::Cancelled`] or [`TransferError::DeadlineExceeded`].
    pub fn check(&self) -> Result<(), TransferError> {
        if self.cancel.is_cancelled() {
            return Err(TransferError::Cancelled);
        }
        if let Some(d) = self.deadline {
            let now = Instant::now();
            if now >= d {
                return Err(TransferError::DeadlineExceeded {
                    elapsed_us: now.duration_since(self.started).as_micros() as u64,
                });
            }
        }
        Ok(())
    }

    /// Errors when the liveness probe says the donor is gone.
    ///
    /// # Errors
    /// [`TransferError::DonorUnreachable`] naming `rank`.
    pub fn check_donor(&self, rank: u32) -> Result<(), TransferError> {
        match &self.donor_alive {
            Some(alive) if !alive() => Err(TransferError::DonorUnreachable {
                rank,
                reason: "liveness probe reports the donor dead or its lease gone".into(),
            }),
            _ => Ok(()),
        }
    }
}
