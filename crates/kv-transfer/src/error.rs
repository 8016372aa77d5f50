//! The one error type of this crate.

use kv_descriptor::LayoutFingerprint;

/// Why a plan was refused or a delivery failed.
///
/// Every variant that is caused by input names the offending field or rank so
/// that the caller can log it and fall back to recompute. No variant is ever
/// returned after a delivery has been reported complete: an error means "do
/// not use the destination rows".
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// Donor and target geometry differ (fingerprint covers every layout field,
    /// TP size included); nothing was copied.
    #[error("layout mismatch: donor fingerprint {donor}, target fingerprint {target} (resharding is not supported)")]
    LayoutMismatch {
        /// Donor layout fingerprint.
        donor: LayoutFingerprint,
        /// Target layout fingerprint.
        target: LayoutFingerprint,
    },
    /// A plan or delivery input was out of range or inconsistent.
    #[error("invalid `{field}`: {reason}")]
    InvalidInput {
        /// Dotted path of the field, e.g. `moves[3].dst_block`.
        field: &'static str,
        /// Human-readable reason, including the value seen.
        reason: String,
    },
    /// A region layout of a converting plan was refused (wrong rank, or
    /// donor and target are not the same geometry); nothing was copied.
    #[error("invalid `{field}` for rank {rank}: {source}")]
    RegionLayout {
        /// Which side: `donor`, `target`, `donor.tp_rank`, `target.tp_rank`.
        field: &'static str,
        /// TP rank (index of the region in the plan's input).
        rank: u32,
        /// What was refused; its own field names the geometry field.
        #[source]
        source: kv_descriptor::RegionLayoutError,
    },
    /// The backend does not execute converting parts (a target layout other
    /// than block-major rows); refused before a byte moves.
    #[error("backend `{backend}` cannot convert rank {rank}'s blocks from {src} to {dst}")]
    UnsupportedLayout {
        /// Backend name.
        backend: &'static str,
        /// TP rank.
        rank: u32,
        /// Donor region order, as text.
        src: String,
        /// Target region order, as text.
        dst: String,
    },
    /// The backend cannot move bytes between these kinds of memory.
    #[error("backend `{backend}` cannot copy {src} -> {dst} for rank {rank}")]
    UnsupportedMemory {
        /// Backend name.
        backend: &'static str,
        /// TP rank.
        rank: u32,
        /// Source memory kind, as text.
        src: String,
        /// Destination memory kind, as text.
        dst: String,
    },
    /// The caller's cancellation token fired.
    #[error("delivery cancelled")]
    Cancelled,
    /// The deadline passed before every part finished.
    #[error("delivery deadline exceeded after {elapsed_us} µs")]
    DeadlineExceeded {
        /// Time spent when the deadline was observed, in µs.
        elapsed_us: u64,
    },
    /// The donor died, lost its lease, or cannot be reached.
    #[error("donor unreachable for rank {rank}: {reason}")]
    DonorUnreachable {
        /// TP rank whose source could not be read.
        rank: u32,
        /// What was observed.
        reason: String,
    },
    /// One part moved a different number of bytes than planned.
    #[error("rank {rank} delivered {got} bytes, expected {expected}")]
    ShortPart {
        /// TP rank.
        rank: u32,
        /// Bytes the backend reports as moved.
        got: u64,
        /// Bytes the plan requires.
        expected: u64,
    },
    /// Payload bytes went through host memory on a path whose destination is
    /// GPU memory: refused, the GPU path carries only control traffic on the host.
    #[error("rank {rank} staged {bytes} payload bytes through host memory on the GPU path")]
    HostStaged {
        /// TP rank.
        rank: u32,
        /// Host payload bytes reported by the backend.
        bytes: u64,
    },
    /// One part failed; the whole delivery failed with it.
    #[error("rank {rank} failed: {source}")]
    PartFailed {
        /// TP rank of the first failing part.
        rank: u32,
        /// The part's error.
        #[source]
        source: Box<TransferError>,
    },
    /// A part was abandoned (cancelled, past its deadline) while its read was
    /// in flight, and the backend could not confirm that the read stopped:
    /// it may still write the destination rows, which therefore must not be
    /// reused (the fetch executor orphans them).
    #[error("rank {rank} abandoned a read that may still write the destination: {reason}")]
    NotQuiesced {
        /// TP rank of the abandoned part.
        rank: u32,
        /// What the backend observed.
        reason: String,
    },
    /// A device-to-device part finished, but the transport that moved it
    /// could not be established as device-direct (no UCX protocol log, or a
    /// transport this crate does not classify): the GPU path fails closed
    /// rather than risk payload staged through host memory. Nothing is in
    /// flight.
    #[error("rank {rank}: GPU path refused, transport `{transport}` not verified device-direct: {reason}")]
    TransportUnverified {
        /// TP rank.
        rank: u32,
        /// Transport label as reported (`unknown` when UCX said nothing).
        transport: String,
        /// Why it is not accepted.
        reason: String,
    },
    /// The NIXL runtime (`libnixl_capi.so`) could not be loaded.
    #[error("NIXL runtime not loadable: {0}")]
    NixlUnavailable(String),
    /// A NIXL call failed.
    #[error("NIXL `{op}` failed: {reason}")]
    Nixl {
        /// Which call (`register_memory`, `post_xfer_req`, ...).
        op: &'static str,
        /// NIXL's error text.
        reason: String,
    },
    /// No CUDA driver, or a CUDA / NVRTC call failed.
    #[error("CUDA `{op}` failed: {reason}")]
    Cuda {
        /// Which call (`cuMemcpyDtoDAsync`, `nvrtc`, ...).
        op: &'static str,
        /// Driver error text.
        reason: String,
    },
    /// CUDA may not be used in this process (the rule of
    /// `kv_bank::cuda_usable_here`): a child forked after another process
    /// initialized CUDA or made the backend's CUDA objects (the reason names
    /// both processes; nothing was launched), or no driver to initialize.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// Why, as kv-bank words it.
        reason: String,
    },
    /// A bank operation (store, pin, import, close) failed.
    #[error("bank: {0}")]
    Bank(#[from] kv_bank::BankError),
    /// Host memory could not be allocated or mapped.
    #[error("host memory: {0}")]
    Host(String),
}

impl TransferError {
    /// True when a destination write may still land after this error was
    /// returned ([`TransferError::NotQuiesced`], also inside
    /// [`TransferError::PartFailed`]): the destination rows must not be
    /// handed back. Every other error is returned only once nothing is in
    /// flight.
    ///
    /// ```
    /// use kv_transfer::TransferError;
    /// let e = TransferError::PartFailed {
    ///     rank: 1,
    ///     source: Box::new(TransferError::NotQuiesced { rank: 1, reason: "link down".into() }),
    /// };
    /// assert!(e.may_still_write());
    /// assert!(!TransferError::Cancelled.may_still_write());
    /// ```
    pub fn may_still_write(&self) -> bool {
        match self {
            Self::NotQuiesced { .. } => true,
            Self::PartFailed { source, .. } => source.may_still_write(),
            _ => false,
        }
    }

    /// The error itself, or for [`TransferError::PartFailed`] the failing
    /// part's own error (unwrapped all the way), so a caller can match on
    /// the cause whatever the delivery wrapped around it.
    ///
    /// ```
    /// use kv_transfer::TransferError;
    /// let e = TransferError::PartFailed { rank: 0, source: Box::new(TransferError::Cancelled) };
    /// assert!(matches!(e.part_cause(), TransferError::Cancelled));
    /// ```
    pub fn part_cause(&self) -> &TransferError {
        match self {
            Self::PartFailed { source, .. } => source.part_cause(),
            other => other,
        }
    }

    pub(crate) fn input(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidInput {
            field,
            reason: reason.into(),
        }
    }
}
