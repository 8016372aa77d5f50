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
    /// Per-layer release ([`ConsumerStream::with_layer_groups`]): the
    /// number of layer groups asked for and where each group goes.
    layers: Option<(u32, LayerNotice)>,
}

/// Called once per layer group of a converting rank part, in layer order,
/// as soon as that group's copies are issued ([`ConsumerStream::with_layer_groups`]).
pub type LayerNotice = Arc<dyn Fn(LayersReady) + Send + Sync>;

/// What makes a stream wait for one layer group's copies: a closure over
/// the event the backend recorded after them ([`LayersReady::new`]).
pub type GroupWait = Arc<dyn Fn(&ConsumerStream) -> Result<(), TransferError> + Send + Sync>;

/// The copies of layers `layers` of rank `rank`'s part are issued (not yet
/// landed): [`LayersReady::enqueue_wait`] makes the consumer stream wait for
/// them, and work enqueued there afterwards reads those layers' rows once
/// they landed. Layers of other groups may still be in flight; an engine
/// waits for group `g` before the first layer of `g` reads its KV (vLLM's
/// connector calls this point `wait_for_layer_load`).
///
/// Made by backends ([`LayersReady::new`]); the event it waits on stays
/// alive as long as the value does.
///
/// ```
/// use std::sync::Arc;
/// let r = kv_transfer::LayersReady::new(0, 0..4, Arc::new(|_| Ok(())));
/// assert_eq!((r.rank(), r.layers()), (0, 0..4));
/// ```
#[derive(Clone)]
pub struct LayersReady {
    rank: u32,
    layers: std::ops::Range<u32>,
    wait: GroupWait,
}

impl std::fmt::Debug for LayersReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayersReady")
            .field("rank", &self.rank)
            .field("layers", &self.layers)
            .finish()
    }
}

impl LayersReady {
    /// Layers `layers` (model layer indices, end exclusive) of TP rank
    /// `rank` are issued; `wait` enqueues a wait for them on the stream it
    /// is given (a backend's closure over its event; the host backend's
    /// copies have landed when it returns, so its closure does nothing).
    pub fn new(rank: u32, layers: std::ops::Range<u32>, wait: GroupWait) -> Self {
        Self { rank, layers, wait }
    }

    /// TP rank of the part.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Model layers whose copies this group issued (end exclusive).
    pub fn layers(&self) -> std::ops::Range<u32> {
        self.layers.clone()
    }

    /// Makes `on` wait for this group's copies: work enqueued on `on`
    /// afterwards runs after they landed. Safe: [`ConsumerStream::new`]'s
    /// contract is that its stream is live while it is used, and the event
    /// lives as long as `self`.
    ///
    /// # Errors
    /// [`TransferError::Cuda`] naming `cuStreamWaitEvent`;
    /// [`TransferError::CudaUnavailable`] in a child forked after the
    /// event was recorded (nothing is enqueued there: CUDA may not be used
    /// after `fork()`, and the child's copy of the event is forgotten, not
    /// destroyed, when the last clone of `self` goes).
    pub fn enqueue_wait(&self, on: &ConsumerStream) -> Result<(), TransferError> {
        (self.wait)(on)
    }
}

/// The layer groups a converting part of `layers` model layers is cut into
/// when a consumer asks for `groups` ([`ConsumerStream::with_layer_groups`]):
/// `min(groups, layers)` contiguous ranges in layer order, sizes differing
/// by at most one, the larger ones first; empty when `layers` or `groups`
/// is 0.
///
/// ```
/// assert_eq!(kv_transfer::layer_group_ranges(32, 8)[1], 4..8);
/// assert_eq!(kv_transfer::layer_group_ranges(10, 4), [0..3, 3..6, 6..8, 8..10]);
/// assert_eq!(kv_transfer::layer_group_ranges(2, 8), [0..1, 1..2]);
/// ```
pub fn layer_group_ranges(layers: u32, groups: u32) -> Vec<std::ops::Range<u32>> {
    let g = groups.min(layers);
    if g == 0 {
        return Vec::new();
    }
    let (base, extra) = (layers / g, layers % g);
    let mut start = 0;
    (0..g)
        .map(|k| {
            let end = start + base + u32::from(k < extra);
            let r = start..end;
            start = end;
            r
        })
        .collect()
}

impl std::fmt::Debug for ConsumerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerStream")
            .field("ordinal", &self.ordinal)
            .field("stream", &format_args!("{:#x}", self.stream))
            .field("layer_groups", &self.layer_groups())
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
            layers: None,
        }
    }

    /// The same stream released layer group by layer group: a converting
    /// part on this stream's device is launched as [`layer_group_ranges`]`(layers,
    /// groups)` (one launch per group, in layer order), and after each
    /// launch `on_group` gets a [`LayersReady`] for it; the stream itself is
    /// *not* made to wait for the whole part (the engine enqueues each
    /// group's wait before the layer that reads it, so its forward starts
    /// after the first group instead of the last). `notice` is still called
    /// once per part after its last group. A part that cannot be cut by
    /// layer (block-major pool rows, one layer) is released as without
    /// groups, then reported as one group of every layer whose wait does
    /// nothing (the stream waits already). The stream must stay live for
    /// every [`LayersReady::enqueue_wait`] on it, as for the delivery.
    ///
    /// # Errors
    /// [`TransferError::InvalidInput`] naming `layer_groups` when `groups`
    /// is 0.
    pub fn with_layer_groups(
        mut self,
        groups: u32,
        on_group: LayerNotice,
    ) -> Result<Self, TransferError> {
        if groups == 0 {
            return Err(TransferError::input(
                "layer_groups",
                "at least one layer group".to_string(),
            ));
        }
        self.layers = Some((groups, on_group));
        Ok(self)
    }

    /// Layer groups asked for ([`ConsumerStream::with_layer_groups`]); None
    /// when the stream is released once per part.
    pub fn layer_groups(&self) -> Option<u32> {
        self.layers.as_ref().map(|(g, _)| *g)
    }

    /// Hands a layer group's readiness to the consumer (backends call this
    /// in layer order; no-op without layer groups).
    pub fn notify_layers(&self, ready: LayersReady) {
        if let Some((_, f)) = &self.layers {
            f(ready)
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
