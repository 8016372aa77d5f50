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
}

impl std::fmt::Debug for DeliveryControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeliveryControl")
            .field("cancelled", &self.cancel.is_cancelled())
            .field("deadline", &self.deadline)
            .field("has_liveness_probe", &self.donor_alive.is_some())
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
