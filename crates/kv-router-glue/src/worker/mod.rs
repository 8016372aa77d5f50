//! The worker side: hint validation (against the donor's manifest and the
//! prompt), the prefill fetch executor, and the source-pin protocol (the
//! donor's [`PinService`](crate::PinService), the target's
//! [`RemoteDonor`](crate::RemoteDonor)).
//!
//! Who may use it: prefill workers (targets) and decode workers (donors).
//! [`validate_hint`](crate::validate_hint) is also what the router's advisor
//! runs before it emits a hint.

pub(crate) mod block_checksums;
#[cfg(feature = "worker")]
pub(crate) mod fetch_executor;
pub(crate) mod hint_validation;
#[cfg(feature = "worker")]
pub(crate) mod pin_service;
#[cfg(feature = "worker")]
pub(crate) mod pin_transport;
#[cfg(feature = "worker")]
pub(crate) mod remote_donor;
