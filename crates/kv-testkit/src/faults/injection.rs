//! Where faults strike: copy backends and donor sources with hooks inside a
//! rank's part, and the leak probe every run is judged by.

use super::*;

pub(super) type Action = Arc<dyn Fn() + Send + Sync>;

/// The deadline-passed rows' stall inside a rank's part: twice the
/// [`deadline_from_now`] budget.
pub(super) fn stall() -> Action {
    Arc::new(|| std::thread::sleep(Duration::from_millis(60)))
}

/// `control` with a 30 ms deadline starting now, so only the stalled rank
/// ([`stall`]) can miss it.
pub(super) fn deadline_from_now(control: DeliveryControl) -> DeliveryControl {
    let now = Instant::now();
    DeliveryControl {
        started: now,
        deadline: Some(now + Duration::from_millis(30)),
        ..control
    }
}

/// Where a [`FaultBackend`] strikes.
#[derive(Clone)]
pub(super) enum Strike {
    /// Nothing: a plain host copy.
    Never,
    /// Run the action, then copy, when rank `r`'s part starts.
    BeforeRank(u32, Action),
    /// Copy, then run the action once every part has copied.
    AfterAll(Action),
    /// Rank `r`'s part fails without copying.
    FailRank(u32),
}

/// A copy backend with one injected fault around its parts.
pub(super) struct FaultBackend {
    pub(super) inner: Arc<dyn CopyBackend>,
    pub(super) strike: Strike,
    pub(super) parts_done: AtomicU32,
    pub(super) tp: u32,
}

impl FaultBackend {
    pub(super) fn new(inner: Arc<dyn CopyBackend>, strike: Strike, tp: u32) -> Self {
        Self {
            inner,
            strike,
            parts_done: AtomicU32::new(0),
            tp,
        }
    }

    /// Host memcpy with `strike` (the CPU profile's rows).
    pub(super) fn host(strike: Strike) -> Self {
        Self::new(Arc::new(HostCopyBackend), strike, TP)
    }
}

impl CopyBackend for FaultBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        io: &RankIo<'_>,
        control: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        match &self.strike {
            Strike::FailRank(r) if *r == part.tp_rank() => {
                return Err(TransferError::Host(format!("injected failure of rank {r}")))
            }
            Strike::BeforeRank(r, act) if *r == part.tp_rank() => act(),
            _ => {}
        }
        let out = self.inner.copy_part(part, io, control)?;
        if let Strike::AfterAll(act) = &self.strike {
            if self.parts_done.fetch_add(1, Ordering::AcqRel) + 1 == self.tp {
                act();
            }
        }
        Ok(out)
    }
}

/// A donor whose `pin` first runs a hook (to inject between reserve and pin).
pub(super) struct HookedDonor<'a> {
    pub(super) inner: &'a dyn DonorSource,
    pub(super) on_pin: Action,
}

impl DonorSource for HookedDonor<'_> {
    fn manifest(&self) -> &BankManifest {
        self.inner.manifest()
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        (self.on_pin)();
        self.inner.pin(hint)
    }
}

/// Leak snapshot plus the run's `/dev/shm` prefix.
pub(super) struct LeakProbe {
    pub(super) before: kv_bank::LeakSnapshot,
    pub(super) prefix: String,
}

impl LeakProbe {
    pub(super) fn start(prefix: &str) -> Self {
        Self {
            before: kv_bank::leaks::snapshot(),
            prefix: prefix.to_string(),
        }
    }

    /// Leaks now; retries for up to 1 s so that a resource released by a
    /// thread that is exiting is not counted, while one that stays is.
    pub(super) fn finish(self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let mut leaks: Vec<String> = kv_bank::leaks::snapshot()
                .leaks_since(&self.before)
                .iter()
                .map(|l| l.to_string())
                .collect();
            let left = shm_entries(&self.prefix);
            if !left.is_empty() {
                leaks.push(format!("shm entries of the run: {left:?}"));
            }
            if leaks.is_empty() || Instant::now() >= deadline {
                return leaks;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub(super) fn shm_entries(prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(kv_bank::SHM_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
