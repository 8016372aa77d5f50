//! One lease as read from its file, and the importer-side judgement of it.

use kv_descriptor::{EngineId, OwnerLease, Role};

use crate::lease_clock::LeaseInstant;
use crate::BankError;

/// One lease as read from its file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LeaseRecord {
    /// Lease name (`/...lease`).
    pub name: String,
    /// Owner engine incarnation.
    pub engine_id: EngineId,
    /// Bank generation.
    pub generation: u64,
    /// Owner role.
    pub role: Role,
    /// TP rank of the bank part this lease covers.
    pub tp_rank: u32,
    /// Owner process id (advisory: expiry decides).
    pub pid: u32,
    /// Lease duration in µs.
    pub duration_us: u64,
    /// Creation time, lease-clock µs ([`LeaseInstant::as_micros`]).
    pub created_at_us: u64,
    /// Expiry, lease-clock µs; 0 when revoked (closed or reclaimed).
    pub expires_at_us: u64,
    /// Last renewal, lease-clock µs.
    pub renewed_at_us: u64,
    /// Renewals so far.
    pub renewals: u64,
}

impl LeaseRecord {
    /// True when not revoked and `now` is before the expiry.
    pub fn is_live(&self, now: LeaseInstant) -> bool {
        self.expires_at_us != 0 && now.as_micros() < self.expires_at_us
    }

    /// The lease names exactly this owner and rank, and is live at `now`.
    ///
    /// # Errors
    /// [`BankError::LeaseMismatch`] naming `engine_id`, `bank_generation`,
    /// `role` or `tp_rank`; [`BankError::LeaseRevoked`]; [`BankError::LeaseExpired`].
    pub fn check(
        &self,
        owner: &OwnerLease,
        tp_rank: u32,
        now: LeaseInstant,
    ) -> Result<(), BankError> {
        let mismatch = |field: &'static str, requested: String, actual: String| {
            Err(BankError::LeaseMismatch {
                lease: self.name.clone(),
                field,
                requested,
                actual,
            })
        };
        if owner.engine_id != self.engine_id {
            return mismatch(
                "engine_id",
                owner.engine_id.to_string(),
                self.engine_id.to_string(),
            );
        }
        if owner.generation != self.generation {
            return mismatch(
                "bank_generation",
                owner.generation.to_string(),
                self.generation.to_string(),
            );
        }
        if owner.role != self.role {
            return mismatch(
                "role",
                format!("{:?}", owner.role),
                format!("{:?}", self.role),
            );
        }
        if tp_rank != self.tp_rank {
            return mismatch("tp_rank", tp_rank.to_string(), self.tp_rank.to_string());
        }
        self.check_live(now)
    }

    /// # Errors
    /// [`BankError::LeaseRevoked`]; [`BankError::LeaseExpired`].
    pub(crate) fn check_live(&self, now: LeaseInstant) -> Result<(), BankError> {
        let now_us = now.as_micros();
        if self.expires_at_us == 0 {
            return Err(BankError::LeaseRevoked {
                lease: self.name.clone(),
            });
        }
        if now_us >= self.expires_at_us {
            return Err(BankError::LeaseExpired {
                lease: self.name.clone(),
                expires_at_us: self.expires_at_us,
                now_us,
            });
        }
        Ok(())
    }
}
