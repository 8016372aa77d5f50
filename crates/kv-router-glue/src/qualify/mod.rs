//! The router-glue section of `qualify`: the settings in force and a sample
//! of real decisions with their terms, from a CPU scenario that runs the whole
//! router path (events → index → advisor → hint → fetch executor → bytes
//! checked) on host shared memory.

//!
//! With it, [`nats_server`]: a throwaway `nats-server` for tests and the
//! qualification, and [`test_pki`]: certificates for its TLS tests (harness
//! code, not used by the roles).

pub mod nats_server;
#[cfg(feature = "nats")]
pub mod test_pki;

use std::sync::Arc;
use std::time::Instant;

use kv_bank::{sealed_blocks, BankConfig, BankManager, BankMemory, DestinationPool, StoreStatus};
use kv_descriptor::{
    DType, EngineId, KvEvent, KvEventData, KvLayout, OwnerLease, Role, SequenceHash, StorageTier,
    TensorOrder,
};
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend};

use crate::{
    AdmissionDecision, Advisor, CostModel, DecisionLog, FetchError, FetchExecutor, LiveCostModel,
    LoadedSettings, LocalDonorDirectory, ReuseSettings,
};

/// Blocks of the conversation the decode donor retains.
pub(crate) const DONOR_BLOCKS: usize = 48;
/// Blocks the prefill target already holds in its native cache.
pub(crate) const TARGET_BASELINE: usize = 2;
/// Destination rows of the target.
pub(crate) const TARGET_ROWS: u32 = 64;

/// Reuse on, with pricing that admits a [`Scenario`] request whatever the
/// test machine's load: the advisor prices the lookup's measured wall time
/// (`saving = reused x prefill_token_us - blocks x block_us - lookup_us`),
/// and a debug-build lookup preempted on a loaded 2-core runner took 1 to
/// 5.4 ms, past the 1 ms default budget and the default 3.68 ms margin.
/// Here the lookup budget is at its maximum (1 s) and a token costs 2 ms to
/// recompute, so 46 blocks (736 tokens) save 1.47 s - 18.4 ms of transfer,
/// more than any lookup within the budget takes; no minimum saving. Tests of
/// the thresholds and of the default pricing set their own values.
#[cfg(test)]
pub(crate) fn admitting_settings() -> ReuseSettings {
    ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        transfer_source_lookup_budget_ms: 1_000.0,
        minimum_estimated_ttft_saving_ms: 0.0,
        transfer_source_prefill_token_us: 2_000.0,
        ..ReuseSettings::default()
    }
}

/// A decode donor with a retained TP2 host bank, a prefill target, and an
/// index that saw the donor's events.
pub(crate) struct Scenario {
    pub layout: KvLayout,
    pub donor: Arc<BankManager>,
    pub target: EngineId,
    pub index: Arc<InventoryIndex>,
    pub directory: Arc<LocalDonorDirectory>,
    /// Root-aligned hashes of the donor's conversation.
    pub hashes: Vec<SequenceHash>,
    /// Target rows per rank.
    pub target_rows: Vec<Arc<HostBuffer>>,
}

/// Byte `i` of rank `rank`'s copy of block `block` (distinct per rank and block).
pub(crate) fn pattern(rank: u32, block: usize, i: usize) -> u8 {
    (block * 7 + rank as usize * 131 + i) as u8
}

impl Scenario {
    /// Builds the scenario; errors are setup failures with a message.
    pub(crate) fn new() -> Result<Self, String> {
        // 16-token blocks so that the default costs are usable (16 x 30 µs > 400 µs).
        let layout = KvLayout::new(2, 4, 8, DType::F32, 16, TensorOrder::BlockMajor, 2)
            .map_err(|e| e.to_string())?;
        let rbb = layout.rank_block_bytes();
        let owner = OwnerLease::fresh(Role::Decode);
        let config = BankConfig::new(layout, owner, 64 * 2 * rbb as u64);
        let donor =
            Arc::new(BankManager::new_host_shm(config, "glue-qualify").map_err(|e| e.to_string())?);
        let tokens: Vec<u32> = (0..(DONOR_BLOCKS * 16) as u32).collect();
        let blocks = sealed_blocks(None, &tokens, 16);
        let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence_hash).collect();
        let store = donor.store(None, &blocks).map_err(|e| e.to_string())?;
        for rank in 0..2u32 {
            for (index, _) in store.entries.iter().enumerate() {
                let bytes: Vec<u8> = (0..rbb).map(|i| pattern(rank, index, i)).collect();
                donor
                    .write_pending(store.store_id, rank, index, &bytes)
                    .map_err(|e| e.to_string())?;
            }
        }
        donor.ack(store.store_id, 0).map_err(|e| e.to_string())?;
        if donor.ack(store.store_id, 1).map_err(|e| e.to_string())? != StoreStatus::Ready {
            return Err("donor store not ready after both acks".into());
        }
        let index = Arc::new(InventoryIndex::new());
        let fp = layout.fingerprint();
        let target = EngineId::fresh();
        for (key, engine, role) in [
            (1, owner.engine_id, Role::Decode),
            (2, target, Role::Prefill),
        ] {
            index
                .register_worker(
                    WorkerKey(key),
                    WorkerInfo {
                        engine,
                        role,
                        layout_fingerprint: fp,
                        tp_size: 2,
                    },
                )
                .map_err(|e| e.to_string())?;
        }
        for e in donor.drain_events() {
            index.apply_event(&e).map_err(|e| e.to_string())?;
        }
        index
            .apply_event(&KvEvent {
                publisher: target,
                event_id: 1,
                role: Role::Prefill,
                layout_fingerprint: fp,
                tp_size: 2,
                tier: StorageTier::Device,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: blocks[..TARGET_BASELINE].to_vec(),
                },
            })
            .map_err(|e| e.to_string())?;
        let directory = Arc::new(LocalDonorDirectory::new());
        directory.insert(donor.clone(), "kv.qualify.decode.control");
        let target_rows = (0..2)
            .map(|_| {
                HostBuffer::zeroed(TARGET_ROWS as usize * rbb)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            layout,
            donor,
            target,
            index,
            directory,
            hashes,
            target_rows,
        })
    }

    /// An advisor over this scenario with `settings`.
    ///
    /// # Errors
    /// The cost model's refusal of `settings`.
    pub(crate) fn advisor(&self, settings: ReuseSettings) -> Result<Advisor, String> {
        let model =
            CostModel::new(settings, self.layout.tokens_per_block()).map_err(|e| e.to_string())?;
        Ok(Advisor::new(
            self.index.clone(),
            self.directory.clone(),
            LiveCostModel::new(model),
            Arc::new(DecisionLog::new(64)),
            16_384,
        ))
    }

    /// A host-memcpy executor writing into the target rows.
    pub(crate) fn executor(&self) -> Result<FetchExecutor, FetchError> {
        let regions: Vec<Arc<dyn BankMemory>> = self
            .target_rows
            .iter()
            .map(|b| b.clone() as Arc<dyn BankMemory>)
            .collect();
        FetchExecutor::new(
            self.layout,
            DestinationPool::new(TARGET_ROWS),
            regions,
            TARGET_ROWS,
            Arc::new(HostCopyBackend),
        )
    }

    /// True when target row `row` of every rank holds donor block `block`'s bytes.
    pub(crate) fn row_holds_block(&self, row: u32, block: usize) -> bool {
        let rbb = self.layout.rank_block_bytes();
        (0..2u32).all(|rank| {
            let mut buf = vec![0u8; rbb];
            self.target_rows[rank as usize]
                .read_bytes(row as usize * rbb, &mut buf)
                .is_ok()
                && buf
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == pattern(rank, block, i))
        })
    }
}

/// Result of [`qualify_section`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct GlueQualifySection {
    /// True when every check passed.
    pub passed: bool,
    /// `(key, value, origin)` of every setting in force.
    pub settings: Vec<(String, String, String)>,
    /// Sample decisions under the settings in force.
    pub decisions: Vec<AdmissionDecision>,
    /// When reuse is off in force: the same requests with only the master
    /// switch turned on, to show what the costs would decide. Empty otherwise.
    pub decisions_if_enabled: Vec<AdmissionDecision>,
    /// `(name, passed, detail)` checks of the CPU fetch path.
    pub checks: Vec<(String, bool, String)>,
    /// Wall time of the section, µs.
    pub elapsed_us: u64,
}

impl GlueQualifySection {
    /// Human-readable text: settings table, decisions with terms, checks.
    pub fn render(&self) -> String {
        let mut out = String::from("== kv-router-glue ==\nsettings in force:\n");
        for (k, v, o) in &self.settings {
            out.push_str(&format!("  {k:<40} = {v:<10} ({o})\n"));
        }
        out.push_str("decisions (settings in force):\n");
        for d in &self.decisions {
            out.push_str(&format!("  {d}\n"));
        }
        if !self.decisions_if_enabled.is_empty() {
            out.push_str("decisions (same costs, reuse switched on):\n");
            for d in &self.decisions_if_enabled {
                out.push_str(&format!("  {d}\n"));
            }
        }
        for (name, ok, detail) in &self.checks {
            out.push_str(&format!(
                "  [{}] {name}: {detail}\n",
                if *ok { "PASS" } else { "FAIL" }
            ));
        }
        out
    }
}

/// Runs the section with `loaded` settings. Never panics: a setup failure is a failed check.
pub fn qualify_section(loaded: &LoadedSettings) -> GlueQualifySection {
    let t0 = Instant::now();
    let settings = loaded
        .settings
        .entries()
        .into_iter()
        .map(|(k, v)| {
            let origin = loaded
                .origins
                .get(k)
                .map(|o| o.to_string())
                .unwrap_or_else(|| "default".into());
            (k.to_string(), v.to_string(), origin)
        })
        .collect();
    let mut checks = Vec::new();
    let mut decisions = Vec::new();
    let mut decisions_if_enabled = Vec::new();
    match run(
        loaded,
        &mut checks,
        &mut decisions,
        &mut decisions_if_enabled,
    ) {
        Ok(()) => {}
        Err(e) => checks.push(("setup".into(), false, e)),
    }
    GlueQualifySection {
        passed: checks.iter().all(|c| c.1),
        settings,
        decisions,
        decisions_if_enabled,
        checks,
        elapsed_us: t0.elapsed().as_micros() as u64,
    }
}

fn sample(advisor: &Advisor, s: &Scenario) -> Vec<crate::Advice> {
    let other: Vec<SequenceHash> =
        kv_descriptor::sequence_hashes(&(9_000..9_160).collect::<Vec<u32>>(), 16);
    vec![
        advisor.advise("long-conversation", &s.hashes, s.target),
        advisor.advise("short-prefix", &s.hashes[..TARGET_BASELINE + 3], s.target),
        advisor.advise("unrelated-prompt", &other, s.target),
    ]
}

fn run(
    loaded: &LoadedSettings,
    checks: &mut Vec<(String, bool, String)>,
    decisions: &mut Vec<AdmissionDecision>,
    decisions_if_enabled: &mut Vec<AdmissionDecision>,
) -> Result<(), String> {
    let s = Scenario::new()?;
    let in_force = loaded.settings.clone();
    let advisor = s.advisor(in_force.clone())?;
    decisions.extend(sample(&advisor, &s).into_iter().map(|a| a.decision));
    let enabled = ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        ..in_force.clone()
    };
    if !in_force.enable_decode_to_prefill_reuse {
        let all_off = decisions.iter().all(|d| !d.admitted());
        checks.push((
            "off_admits_nothing".into(),
            all_off,
            format!("{} decisions, none admitted", decisions.len()),
        ));
    }
    let advisor_on = s.advisor(enabled)?;
    let advice = sample(&advisor_on, &s);
    if !in_force.enable_decode_to_prefill_reuse {
        decisions_if_enabled.extend(advice.iter().map(|a| a.decision.clone()));
    }
    let exec = s.executor().map_err(|e| e.to_string())?;
    match advice.iter().find_map(|a| a.hint.as_ref()) {
        None => checks.push((
            "fetch_path".into(),
            true,
            "no request admitted under these costs: nothing fetched (recompute)".into(),
        )),
        Some(env) => {
            let hint = env
                .fetch_gpu_actions()
                .map_err(|e| e.to_string())?
                .remove(0);
            let mut forged = hint.clone();
            forged.bank_generation += 1;
            let forged_env = kv_descriptor::HintEnvelope::fetch_gpu("forged", "a", &forged)
                .map_err(|e| e.to_string())?;
            let free_before = exec.pool().free_blocks();
            let refused = exec.execute(&forged_env, s.donor.as_ref(), &DeliveryControl::new());
            checks.push((
                "stale_hint_refused_before_memory".into(),
                matches!(refused, Err(FetchError::StaleGeneration { .. }))
                    && exec.pool().free_blocks() == free_before,
                format!("{:?}", refused.err()),
            ));
            match exec.execute(env, s.donor.as_ref(), &DeliveryControl::new()) {
                Ok(out) => {
                    let from = out.fetch_from as usize;
                    let all_rows = out
                        .target_blocks
                        .iter()
                        .enumerate()
                        .all(|(i, &row)| s.row_holds_block(row, from + i));
                    checks.push((
                        "fetch_bytes_match_donor".into(),
                        all_rows && out.report.is_complete(),
                        format!(
                            "{} blocks from block {from}, {} bytes, {} copies, transport {}",
                            out.target_blocks.len(),
                            out.report.counters.bytes,
                            out.report.counters.copies,
                            out.report.counters.transport
                        ),
                    ));
                    checks.push((
                        "pins_released".into(),
                        s.donor.pins_outstanding() == 0,
                        format!("{} pins outstanding", s.donor.pins_outstanding()),
                    ));
                }
                Err(e) => checks.push(("fetch_bytes_match_donor".into(), false, e.to_string())),
            }
        }
    }
    Ok(())
}
