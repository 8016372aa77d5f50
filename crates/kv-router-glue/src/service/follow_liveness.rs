//! [`RouterInventory`]'s liveness: which workers count as silent (and
//! when none does: while the router's own NATS connection is down), how a
//! worker that was dropped comes back into the index, what the registry
//! forgot (forgotten in the index too), and the one check of each donor
//! layout against the settings. A child of `follow.rs`, so it reads
//! `Tracked` and the counters directly.

use std::sync::atomic::Ordering;

use kv_descriptor::Role;
use kv_lookup::{LookupError, WorkerInfo, WorkerKey};

use super::super::follow_stats::bump;
use super::{RouterInventory, Tracked};
use crate::{Registration, WorkerAnnouncement};

impl RouterInventory {
    /// Drops workers silent too long at `now_ms`; returns how many.
    pub async fn tick(&self, now_ms: u64) -> usize {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let dead = st.registry.tick(now_ms);
        for (key, engine) in &dead {
            tracing::info!(worker = ?key, engine = %engine, "worker silent: dropped");
            self.drop_engine(st, *engine);
        }
        // After the drops: an id the registry forgot in this tick is one
        // the index has removed already, so the index forgets it too.
        self.note_forgotten(st);
        if !dead.is_empty() {
            self.release_unnamed_subjects(st);
        }
        dead.len()
    }

    /// Registers announced `a` with the index after the registry answered
    /// `registration` (not [`Registration::Retired`]). A readmitted worker's
    /// inventory is unknown (its events while it was away were missed): the
    /// index takes it back excluded as a donor until its snapshot is
    /// applied (`workers_readmitted`).
    ///
    /// An incarnation the registry forgot (not heard of for its retention,
    /// or past its cap) was forgotten by the index too
    /// ([`RouterInventory::note_forgotten`]), so when it announces again it
    /// registers as a new worker: empty (the index dropped its entries when
    /// it was removed), and its first event, its ids having gone on while
    /// it was away, is a gap that excludes it as a donor until its
    /// snapshot. Should the index still know it as removed (one the index
    /// did not forget), it is taken back as a readmitted one instead.
    pub(super) fn register_in_index(&self, a: &WorkerAnnouncement, registration: &Registration) {
        let info = WorkerInfo {
            engine: a.engine_id,
            role: a.role,
            layout_fingerprint: a.layout_fingerprint,
            tp_size: a.tp_size,
        };
        let key = WorkerKey(xxhash_rust::xxh3::xxh3_64(a.worker_key.as_bytes()));
        let registered = if *registration == Registration::Readmitted {
            bump(&self.counters.workers_readmitted);
            tracing::info!(
                worker = ?a.worker_key,
                engine = %a.engine_id,
                "worker dropped for silence announced again: taken back (no donor until its inventory snapshot)"
            );
            self.index.readmit_worker(key, info)
        } else {
            match self.index.register_worker(key, info) {
                Err(LookupError::RetiredIncarnation { .. }) => {
                    bump(&self.counters.workers_readmitted);
                    let replaced = match registration {
                        Registration::Replaced { dropped } => Some(*dropped),
                        _ => None,
                    };
                    tracing::warn!(
                        worker = ?a.worker_key,
                        engine = %a.engine_id,
                        replaced = ?replaced,
                        "incarnation removed long ago (forgotten by the registry) announced again: taken back (no donor until its inventory snapshot)"
                    );
                    self.index.readmit_worker(key, info)
                }
                other => other,
            }
        };
        if let Err(e) = registered {
            // Throttled: a worker whose identity changed under one engine id
            // (its role, layout or TP) is refused at every announcement
            // (trial h44, 6: a line per announcement period).
            if let Some(suppressed) = self.index_refused_log.admit(std::time::Instant::now()) {
                tracing::warn!(worker = ?a.worker_key, error = %e, suppressed, "index refused the worker");
            }
        }
    }

    /// Forgets in the index every incarnation the registry forgot since
    /// the last call ([`crate::WorkerRegistry::take_forgotten`]; each one
    /// was removed from the index when it was dropped), so that the index's
    /// memory of removed engines (`IndexStats::retired_incarnations`) is
    /// bounded as the registry's is, and copies the registry's count into
    /// `incarnations_forgotten` (the follower holds `st`, so one writer).
    /// Called after every announcement and tick.
    pub(super) fn note_forgotten(&self, st: &mut Tracked) {
        let ids = st.registry.take_forgotten();
        for &engine in &ids {
            // The directory kept its newest generation (trial h39, 2).
            self.remote.forget_for_good(engine);
        }
        let in_index = ids
            .iter()
            .filter(|&&engine| self.index.forget_retired(engine))
            .count();
        let total = st.registry.forgotten();
        let before = self
            .counters
            .incarnations_forgotten
            .swap(total, Ordering::Relaxed);
        if total > before {
            let (replaced, silenced) = st.registry.remembered();
            tracing::debug!(
                forgotten = total - before,
                forgotten_in_index = in_index,
                replaced_remembered = replaced,
                silenced_remembered = silenced,
                "replaced or silenced incarnations forgotten: not heard of for the retention, or the oldest past the cap"
            );
        }
    }

    /// Takes in the state of the router's own connection to the event
    /// plane at `now_ms`. Down: no worker is dropped for silence until it
    /// is back (their announcements cannot arrive). Back: every worker's
    /// silence is counted afresh from `now_ms`, and every decode worker is
    /// asked its inventory snapshot again at its next announcement (its
    /// events while the router was away were lost, and a later one need not
    /// show the gap soon). One that has answered a snapshot before is
    /// excluded as a donor until the new one is applied; one that never has
    /// (a worker without an inventory server) stays a donor as before,
    /// repaired only by the gaps its later events show, since excluding it
    /// would exclude it for good. Returns whether the state changed.
    pub async fn on_connection(&self, connected: bool, now_ms: u64) -> bool {
        // The poll's common case (no change) takes no lock.
        if connected != self.connection_down.load(Ordering::SeqCst) {
            return false;
        }
        let mut guard = self.state.lock().await;
        self.connection_down.store(!connected, Ordering::SeqCst);
        let st = &mut *guard;
        match (connected, st.registry.is_paused()) {
            (false, false) => {
                st.registry.pause();
                bump(&self.counters.connection_losses);
                tracing::warn!(
                    workers = st.registry.len(),
                    "router's NATS connection down: no worker is dropped for silence until it is back"
                );
                true
            }
            (true, true) => {
                st.registry.resume(now_ms);
                let decode = st.registry.engines(Role::Decode);
                let mut excluded = 0;
                for &engine in &decode {
                    if st.sync.snapshot_event_id(engine).is_some() {
                        self.index.require_resync(engine);
                        excluded += 1;
                    }
                    st.sync.forget(engine);
                }
                tracing::info!(
                    workers = st.registry.len(),
                    resyncing = decode.len(),
                    excluded,
                    "router's NATS connection back: silence counted from now; decode workers that serve snapshots are donors again after their new one"
                );
                true
            }
            _ => false,
        }
    }

    /// Checks the block size of `record`'s layout against the cost model,
    /// once per layout fingerprint: the advisor prices each decision with
    /// the donor layout's own tokens per block, so the settings must let a
    /// fetch of such blocks save time ([`crate::CostModel::check_block_size`];
    /// warning and `donor_layouts_unprofitable` when not: this layout's
    /// donors are never admitted), and a `--tokens-per-block` given at
    /// start that differs is named (`donor_layouts_block_size_mismatch`).
    pub(super) fn check_layout(&self, st: &mut Tracked, record: &crate::DonorRecord) {
        let layout = record.manifest().layout();
        if !st.checked_layouts.insert(layout.fingerprint()) {
            return;
        }
        let model = self.service.advisor().model().current();
        let block = layout.tokens_per_block();
        let fingerprint = format!("{:#x}", layout.fingerprint().0);
        if let Some(given) = model.tokens_per_block().filter(|&t| t != block) {
            bump(&self.counters.donor_layouts_block_size_mismatch);
            tracing::warn!(
                layout = %fingerprint,
                donor = %record.engine_id(),
                tokens_per_block = block,
                setting = given,
                "donor layout's block size differs from `--tokens-per-block`: decisions price the layout's own blocks"
            );
        }
        if let Err(e) = crate::CostModel::check_block_size(model.settings(), block) {
            bump(&self.counters.donor_layouts_unprofitable);
            tracing::warn!(
                layout = %fingerprint,
                donor = %record.engine_id(),
                tokens_per_block = block,
                error = %e,
                "no fetch from donors of this layout can save time: every one is refused"
            );
        }
    }
}
