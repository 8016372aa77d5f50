//! Source pins of a bank manager: which ready slots a fetch may read, and the
//! RAII guard that keeps them alive.

use super::*;

impl BankManager {
    /// Pins every block of `hashes` (all must be ready) on all ranks.
    ///
    /// # Errors
    /// [`BankError::Closed`]; [`BankError::NotRetained`] naming the first
    /// block not ready; [`BankError::Excluded`] for a block in the exclusion
    /// lineage; [`BankError::LeaseExpired`] / [`BankError::LeaseLost`] when
    /// the lease lapsed. Nothing is pinned on error.
    pub fn pin_prefix(&self, hashes: &[SequenceHash]) -> Result<ManagerPin, BankError> {
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        let mut slots = Vec::with_capacity(hashes.len());
        for h in hashes {
            if self.shared.config.lineage.is_excluded(h) {
                return Err(BankError::Excluded(*h));
            }
            slots.push(st.table.lookup(h).ok_or(BankError::NotRetained(*h))?);
        }
        Ok(self.pin_locked(&mut st, hashes.to_vec(), slots))
    }

    fn pin_locked(&self, st: &mut State, hashes: Vec<SequenceHash>, slots: Vec<u32>) -> ManagerPin {
        st.table.pin(&slots);
        st.stats.pins += 1;
        let banks = st.banks.clone().expect("open bank has memory");
        ManagerPin {
            shared: self.shared.clone(),
            hashes,
            slots,
            banks,
            _live: crate::leaks::Live::new(&crate::leaks::PINS),
        }
    }

    /// Checks a descriptor received from elsewhere against this live bank.
    ///
    /// # Errors
    /// [`BankError::StaleOwner`] for another engine or generation;
    /// [`BankError::Closed`] when this generation is closed;
    /// [`BankError::LeaseExpired`] / [`BankError::LeaseLost`] when its lease lapsed.
    pub fn check_descriptor(&self, d: &BankDescriptor) -> Result<(), BankError> {
        self.check_owner(d.owner().engine_id, d.owner().generation)?;
        {
            let mut st = self.shared.state.lock();
            self.enforce_lease_locked(&mut st)?;
            if st.phase != Phase::Open {
                return Err(self.closed());
            }
        }
        if self.shared.manifest.parts().get(d.tp_rank() as usize) != Some(d) {
            return Err(BankError::StaleOwner {
                field: "descriptor",
                requested: format!("rank {} checksum {:#x}", d.tp_rank(), d.checksum()),
                actual: "a different descriptor for that rank".into(),
            });
        }
        Ok(())
    }

    fn check_owner(
        &self,
        engine: kv_descriptor::EngineId,
        generation: u64,
    ) -> Result<(), BankError> {
        let o = &self.shared.config.owner;
        if engine != o.engine_id {
            return Err(BankError::StaleOwner {
                field: "engine_id",
                requested: engine.to_string(),
                actual: o.engine_id.to_string(),
            });
        }
        if generation != o.generation {
            return Err(BankError::StaleOwner {
                field: "bank_generation",
                requested: generation.to_string(),
                actual: o.generation.to_string(),
            });
        }
        Ok(())
    }

    /// Donor side of a fetch: validates a `kv.fetch_gpu@1.0` hint against
    /// this bank and pins the slots it names.
    ///
    /// Checked before anything is pinned, from the slot table alone (bank
    /// memory is never read): engine id, generation (a closed generation is
    /// refused), the bank's own lease (a lapsed lease kills the generation),
    /// layout fingerprint, TP size, as many parts as ranks with identical slot
    /// lists, every slot id below the slot count, and that slot
    /// `parts[r].slot_ids[i]` holds the ready block `sequence_hashes[fetch_from + i]`.
    /// The hint's own shape (parts in `tp_rank` order without duplicates,
    /// `expected_bytes`, a non-empty fetch) is not checked here: that is
    /// [`kv_descriptor::FetchGpuHint::validate`], which the fetching side runs first. The slots
    /// pinned are the same either way.
    ///
    /// # Errors
    /// [`BankError::StaleOwner`], [`BankError::Closed`],
    /// [`BankError::LeaseExpired`], [`BankError::LeaseLost`],
    /// [`BankError::SlotOutOfRange`], [`BankError::SlotMismatch`],
    /// [`BankError::Excluded`], [`BankError::InvalidArgument`] for a malformed hint.
    pub fn pin_hint(&self, hint: &FetchGpuHint) -> Result<ManagerPin, BankError> {
        self.check_owner(hint.donor_engine_id, hint.bank_generation)?;
        let c = &self.shared.config;
        if hint.layout_fingerprint != c.layout.fingerprint() {
            return Err(BankError::StaleOwner {
                field: "layout_fingerprint",
                requested: hint.layout_fingerprint.to_string(),
                actual: c.layout.fingerprint().to_string(),
            });
        }
        if hint.tp_size != c.layout.tp_size() || hint.parts.len() != c.layout.tp_size() as usize {
            return Err(BankError::StaleOwner {
                field: "tp_size",
                requested: format!("{} with {} parts", hint.tp_size, hint.parts.len()),
                actual: c.layout.tp_size().to_string(),
            });
        }
        let from = hint.fetch_from as usize;
        let Some(fetched) = hint.sequence_hashes.get(from..) else {
            return Err(BankError::arg(
                "fetch_from",
                format!("{from} beyond {} hashes", hint.sequence_hashes.len()),
            ));
        };
        let mut st = self.shared.state.lock();
        self.enforce_lease_locked(&mut st)?;
        if st.phase != Phase::Open {
            return Err(self.closed());
        }
        let slot_count = st.table.slot_count();
        for part in &hint.parts {
            if part.slot_ids.len() != fetched.len() {
                return Err(BankError::arg(
                    "parts.slot_ids",
                    format!(
                        "rank {} lists {} slots for {} blocks",
                        part.tp_rank,
                        part.slot_ids.len(),
                        fetched.len()
                    ),
                ));
            }
            for (index, (&slot, h)) in part.slot_ids.iter().zip(fetched).enumerate() {
                if slot >= slot_count {
                    return Err(BankError::SlotOutOfRange {
                        rank: part.tp_rank,
                        index,
                        slot,
                        slot_count,
                    });
                }
                if c.lineage.is_excluded(h) {
                    return Err(BankError::Excluded(*h));
                }
                let holds = matches!(st.table.state(slot), Some(SlotState::Ready { hash, .. }) if hash == *h);
                if !holds {
                    return Err(BankError::SlotMismatch {
                        rank: part.tp_rank,
                        index,
                        slot,
                        expected: *h,
                    });
                }
            }
        }
        let slots = hint.parts[0].slot_ids.clone();
        Ok(self.pin_locked(&mut st, fetched.to_vec(), slots))
    }
}

/// Pins on one fetch's slots, on every rank; released on drop.
///
/// While it lives the slots are never evicted and their memory is never
/// freed (it holds the ranks' memory), even if the bank is closed meanwhile.
#[derive(Debug)]
pub struct ManagerPin {
    shared: Arc<Shared>,
    hashes: Vec<SequenceHash>,
    slots: Vec<u32>,
    banks: Vec<RankBank>,
    _live: crate::leaks::Live,
}

impl ManagerPin {
    /// Logical slot ids, one per pinned block, in the order asked.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }
    /// Pinned blocks.
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }
    /// Rank `rank`'s bank (memory and descriptor), valid while the pin lives.
    ///
    /// # Errors
    /// [`BankError::BadRank`].
    pub fn rank(&self, rank: u32) -> Result<&RankBank, BankError> {
        self.banks.get(rank as usize).ok_or(BankError::BadRank {
            rank,
            tp_size: self.banks.len() as u32,
        })
    }
}

impl Drop for ManagerPin {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        st.table.unpin(&self.slots);
        if st.table.total_pins() == 0 {
            if st.phase != Phase::Open {
                // A close that timed out left the memory for the last pin to free.
                st.phase = Phase::Closed;
                st.banks = None;
            }
            self.shared.drained.notify_all();
        }
    }
}
