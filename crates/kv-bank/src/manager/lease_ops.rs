//! The owner side of a bank's lease inside the manager: the generation dies
//! with a lapsed lease, renewals, and the lease status.

use super::*;

/// A bank's lease as its owner sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LeaseStatus {
    /// One lease name per rank.
    pub names: Vec<String>,
    /// Earliest expiry over the ranks, lease-clock µs
    /// ([`crate::LeaseInstant::as_micros`]; 0 once revoked).
    pub expires_at_us: u64,
    /// Renewals so far (fewest over the ranks).
    pub renewals: u64,
    /// False once the lease lapsed, was revoked or lost: the generation is dead.
    pub live: bool,
}

impl BankManager {
    /// Ends an open generation (close, or a lapsed lease): no new pins or
    /// stores, pending stores rolled back, `Cleared` queued, renewal stopped,
    /// leases revoked and removed; memory freed now if nothing is pinned,
    /// else when the last pin drops.
    pub(super) fn kill_generation_locked(&self, st: &mut State) {
        if st.phase != Phase::Open {
            return;
        }
        st.phase = Phase::Closing;
        let ids: Vec<u64> = st.pending.keys().copied().collect();
        for id in ids {
            self.rollback_locked(st, id, Rollback::Closing);
        }
        self.push_event(st, KvEventData::Cleared);
        drop(self.shared.renewer.lock().take());
        self.shared.leases.revoke_all();
        if st.table.total_pins() == 0 {
            st.phase = Phase::Closed;
            st.banks = None;
        }
    }

    /// The owner's own view of its lease: once it lapsed (the owner stalled
    /// past it, or a reclaimer revoked it) the generation is dead, because
    /// importers already refuse it and a reclaimer may have removed it.
    pub(super) fn enforce_lease_locked(&self, st: &mut State) -> Result<(), BankError> {
        if st.phase != Phase::Open {
            return Ok(());
        }
        if let Err(e) = self.shared.leases.check_live(crate::LeaseInstant::now()) {
            tracing::warn!(
                "bank generation {} ends: {e}",
                self.shared.config.owner.generation
            );
            self.kill_generation_locked(st);
            return Err(e);
        }
        Ok(())
    }

    /// Renews every rank's lease now (the engine's call under
    /// [`LeaseRenewal::Manual`]; allowed under background renewal too).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_bank::{BankConfig, BankManager, HostShmMemory, LeaseConfig};
    /// use kv_descriptor::*;
    /// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
    /// let mut cfg = BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 4 * layout.block_bytes() as u64);
    /// cfg.lease = LeaseConfig::manual(Duration::from_secs(10));
    /// let bank = BankManager::new_host_shm(cfg, "host-a").unwrap();
    /// let s = bank.renew_lease().unwrap();
    /// assert!(s.live && s.renewals == 1);
    /// let d = bank.manifest().parts()[0].clone();
    /// assert!(HostShmMemory::open_descriptor(&d).is_ok()); // live lease, same incarnation
    /// bank.close(Duration::from_secs(1)).unwrap();
    /// assert!(HostShmMemory::open_descriptor(&d).is_err()); // lease gone with the generation
    /// ```
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::LeaseLost`] or
    /// [`BankError::LeaseExpired`] when the lease already lapsed or was
    /// revoked: a lapsed lease is never renewed, and the generation dies
    /// (as by [`BankManager::close`] without waiting);
    /// [`BankError::NotCreator`] in a process forked from the creator (its
    /// renewals would keep the bank importable after the creator died).
    pub fn renew_lease(&self) -> Result<LeaseStatus, BankError> {
        self.require_creator("renew_lease")?;
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        if let Err(e) = self.shared.leases.renew(crate::LeaseInstant::now()) {
            self.kill_generation_locked(&mut st);
            return Err(e);
        }
        drop(st);
        Ok(self.lease_status())
    }

    /// Lease names, expiry and renewals of this bank.
    pub fn lease_status(&self) -> LeaseStatus {
        let l = &self.shared.leases;
        let expires_at_us = l.expires_at_us();
        LeaseStatus {
            names: l.names(),
            expires_at_us,
            renewals: l.renewals(),
            live: !l.is_lost()
                && expires_at_us != 0
                && crate::LeaseInstant::now().as_micros() < expires_at_us,
        }
    }

    /// The lease settings this bank runs with.
    pub fn lease_config(&self) -> LeaseConfig {
        self.shared.leases.config()
    }
}
