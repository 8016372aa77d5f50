//! [`RouterInventory`]'s liveness: which workers count as silent (and
//! when none does: while the router's own NATS connection is down), and
//! the one check of each donor layout against the settings. A child of
//! `follow.rs`, so it reads `Tracked` and the counters directly.

use std::sync::atomic::Ordering;

use kv_descriptor::Role;

use super::super::follow_stats::bump;
use super::{RouterInventory, Tracked};

impl RouterInventory {
    /// Drops workers silent too long at `now_ms`; returns how many.
    pub async fn tick(&self, now_ms: u64) -> usize {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let dead = st.registry.tick(now_ms);
        for (key, engine) in &dead {
            tracing::info!(worker = %key, engine = %engine, "worker silent: dropped");
            self.drop_engine(st, *engine);
        }
        if !dead.is_empty() {
            self.release_unnamed_subjects(st);
        }
        dead.len()
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
