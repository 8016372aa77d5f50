//! The error type of this crate: why an event or a registration was refused.

use kv_descriptor::{EngineId, LayoutFingerprint, Role};

/// Why the index refused an event, a registration or a resync.
///
/// A refused call changes nothing: the index checks everything it can before
/// it touches any holder set. The message names the refused field.
///
/// ```
/// use kv_descriptor::{EngineId, LayoutFingerprint, Role};
/// use kv_lookup::{InventoryIndex, LookupError, WorkerInfo, WorkerKey};
/// let index = InventoryIndex::new();
/// let w = WorkerInfo { engine: EngineId::fresh(), role: Role::Decode, layout_fingerprint: LayoutFingerprint(7), tp_size: 1 };
/// index.register_worker(WorkerKey(1), w)?;
/// // The same incarnation cannot change its TP size.
/// let err = index.register_worker(WorkerKey(1), WorkerInfo { tp_size: 2, ..w }).unwrap_err();
/// assert!(matches!(err, LookupError::IdentityMismatch { field: "tp_size", .. }));
/// assert!(err.to_string().ends_with("`tp_size` is 2 but the registered value is 1"));
/// assert_eq!(index.worker(w.engine).unwrap().1.tp_size, 1); // unchanged
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// An event or registration disagrees with what the index knows about
    /// that engine incarnation (an engine never changes role, layout or TP
    /// size without restarting under a new [`EngineId`]).
    #[error("engine {engine}: `{field}` is {got} but the registered value is {registered}")]
    IdentityMismatch {
        /// Engine incarnation.
        engine: EngineId,
        /// Which field disagrees: `role`, `layout_fingerprint` or `tp_size`.
        field: &'static str,
        /// Value known to the index.
        registered: String,
        /// Value carried by the refused call.
        got: String,
    },
    /// `event_id` 0 is not a valid event id (ids start at 1).
    #[error("engine {engine}: `event_id` must be at least 1, got 0")]
    ZeroEventId {
        /// Publisher of the event.
        engine: EngineId,
    },
    /// `tp_size` 0 is not a valid TP size.
    #[error("engine {engine}: `tp_size` must be at least 1, got 0")]
    ZeroTpSize {
        /// Engine incarnation.
        engine: EngineId,
    },
    /// The engine id belongs to an incarnation that was replaced or removed:
    /// its registrations are refused and its events ignored until
    /// [`crate::InventoryIndex::forget_retired`] forgets it.
    #[error("engine {engine}: `publisher` is a retired incarnation")]
    RetiredIncarnation {
        /// The retired incarnation.
        engine: EngineId,
    },
    /// A call names an engine the index does not know.
    #[error("engine {engine}: `publisher` is not registered")]
    UnknownEngine {
        /// Engine incarnation.
        engine: EngineId,
    },
    /// The index already tracks its maximum number of workers.
    #[error("cannot register engine {engine}: `workers` is at the limit of {limit}")]
    TooManyWorkers {
        /// Engine that could not be registered.
        engine: EngineId,
        /// [`crate::MAX_WORKERS`].
        limit: usize,
    },
}

impl LookupError {
    pub(crate) fn role_mismatch(engine: EngineId, registered: Role, got: Role) -> Self {
        Self::IdentityMismatch {
            engine,
            field: "role",
            registered: format!("{registered:?}"),
            got: format!("{got:?}"),
        }
    }

    pub(crate) fn fingerprint_mismatch(
        engine: EngineId,
        registered: LayoutFingerprint,
        got: LayoutFingerprint,
    ) -> Self {
        Self::IdentityMismatch {
            engine,
            field: "layout_fingerprint",
            registered: registered.to_string(),
            got: got.to_string(),
        }
    }

    pub(crate) fn tp_mismatch(engine: EngineId, registered: u32, got: u32) -> Self {
        Self::IdentityMismatch {
            engine,
            field: "tp_size",
            registered: registered.to_string(),
            got: got.to_string(),
        }
    }
}
