//! The forged hints row: a bank whose memory counts every read
//! ([`TripwireMemory`]), hints built from its inventory and their forged
//! variants, each of which `pin_hint` must refuse without a read.

use super::*;

/// Host shared memory that counts every read of its bytes or address, so a
/// check can prove it never touched memory.
#[derive(Debug)]
pub struct TripwireMemory {
    inner: HostShmMemory,
    reads: Arc<AtomicU64>,
}

impl TripwireMemory {
    /// A fresh `len`-byte shm region under `prefix`, counting into `reads`.
    ///
    /// # Errors
    /// As [`HostShmMemory::create_unique`].
    pub fn new(prefix: &str, len: usize, reads: Arc<AtomicU64>) -> Result<Self, BankError> {
        Ok(Self {
            inner: HostShmMemory::create_unique(prefix, len)?,
            reads,
        })
    }
}

impl BankMemory for TripwireMemory {
    fn kind(&self) -> MemoryKind {
        self.inner.kind()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    /// Counted: handing out the address is how a transfer would read it.
    fn base_addr(&self) -> u64 {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.base_addr()
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        self.inner.export_handle()
    }
    fn mapped_export(&self) -> Option<ExportHandle> {
        self.inner.mapped_export()
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        self.inner.write_bytes(offset, src)
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.read_bytes(offset, dst)
    }
}

/// A TP2 bank on [`TripwireMemory`]; `reads` counts memory touches.
///
/// # Errors
/// As [`BankManager::new`].
pub fn tripwire_bank(reads: Arc<AtomicU64>) -> Result<BankManager, BankError> {
    let layout = small_layout()?;
    let mut cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        8 * layout.block_bytes() as u64,
    );
    cfg.shm_prefix = unique_prefix("f");
    let prefix = cfg.shm_prefix.clone();
    BankManager::new(cfg, move |_, len| {
        Ok(RankMemory {
            memory: Arc::new(TripwireMemory::new(&prefix, len, reads.clone())?),
            location: MemoryLocation::Host {
                host_id: "fault-host".into(),
            },
        })
    })
}

/// The honest hint for `entries` (all ranks, fetch from 0).
pub fn hint_for(bank: &BankManager, entries: &[(SequenceHash, u32)]) -> FetchGpuHint {
    let m = bank.manifest();
    let slots: Vec<u32> = entries.iter().map(|e| e.1).collect();
    FetchGpuHint {
        donor_engine_id: bank.owner().engine_id,
        bank_generation: bank.owner().generation,
        layout_fingerprint: m.layout().fingerprint(),
        tp_size: m.tp_size(),
        sequence_hashes: entries.iter().map(|e| e.0).collect(),
        fetch_from: 0,
        parts: (0..m.tp_size())
            .map(|r| FetchPart {
                tp_rank: r,
                slot_ids: slots.clone(),
                expected_bytes: slots.len() as u64 * m.parts()[0].slot_bytes(),
            })
            .collect(),
        donor_control_endpoint: "local".into(),
    }
}

/// The forged variants of an honest hint: (name, hint).
pub fn forged_variants(
    bank: &BankManager,
    good: &FetchGpuHint,
) -> Vec<(&'static str, FetchGpuHint)> {
    let mut v = Vec::new();
    let mut h = good.clone();
    h.donor_engine_id = kv_descriptor::EngineId::fresh();
    v.push(("wrong_engine_id", h));
    let mut h = good.clone();
    h.bank_generation += 1;
    v.push(("wrong_generation", h));
    let mut h = good.clone();
    for p in &mut h.parts {
        p.slot_ids[0] = bank.manifest().slot_count();
    }
    v.push(("out_of_range_slot", h));
    let mut h = good.clone();
    for p in &mut h.parts {
        p.slot_ids.reverse();
    }
    v.push(("slot_holds_another_block", h));
    let mut h = good.clone();
    h.layout_fingerprint = LayoutFingerprint(good.layout_fingerprint.0 ^ 1);
    v.push(("wrong_layout", h));
    v
}

pub(super) fn forged_hints() -> FaultRow {
    forged_hints_with(BankManager::pin_hint)
}

/// The `forged_hint` row with `pin` standing for [`BankManager::pin_hint`].
pub(super) fn forged_hints_with(
    pin: impl Fn(&BankManager, &FetchGpuHint) -> Result<crate::ManagerPin, BankError>,
) -> FaultRow {
    const FAULT: &str = "forged_hint";
    let before = leaks::snapshot();
    let reads = Arc::new(AtomicU64::new(0));
    let r = (|| -> Result<(u32, u32, u64, bool, String), BankError> {
        let bank = tripwire_bank(reads.clone())?;
        let entries = fill(&bank, 300, 3)?;
        let good = hint_for(&bank, &entries);
        let base = reads.load(Ordering::Relaxed);
        let mut refused = 0;
        let mut accepted = 0;
        let mut seen = Vec::new();
        for (name, h) in forged_variants(&bank, &good) {
            match pin(&bank, &h) {
                Ok(_) => accepted += 1,
                Err(e) => {
                    refused += 1;
                    seen.push(format!("{name}: {e}"));
                }
            }
        }
        let touched = reads.load(Ordering::Relaxed) - base;
        let pins = bank.pins_outstanding();
        // Control: the honest hint pins, so the refusals were not blanket.
        let honest = pin(&bank, &good).map(|p| p.slots().len());
        let control = honest.as_ref().is_ok_and(|&n| n == entries.len());
        let detail = format!(
            "{refused} refused, {accepted} accepted, {touched} memory reads, {pins} pins left; \
             honest hint pinned {honest:?}; {seen:?}"
        );
        bank.close(Duration::from_secs(1))?;
        Ok((refused, accepted, touched + pins, control, detail))
    })();
    match r {
        Err(e) => FaultRow::failed_setup(FAULT, e),
        Ok((refused, accepted, touched, control, detail)) => {
            let leaked = leaks::snapshot().leaks_since(&before);
            FaultRow {
                fault: FAULT.into(),
                runs: refused + accepted,
                // Refusals count only when the honest hint pinned: a pin_hint
                // that refuses everything is no fallback to credit.
                fallbacks: if control { refused } else { 0 },
                false_completions: accepted,
                leaks: touched as u32 + leaked.len() as u32,
                detail: if leaked.is_empty() {
                    detail
                } else {
                    format!("{detail}; leaked {leaked:?}")
                },
            }
        }
    }
}

// ------------------------------------------------------ stale generation ---
