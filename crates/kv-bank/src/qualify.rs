//! The bank section of `cargo xtask qualify`: a CPU bank lifecycle (host
//! shared memory, TP2) with counts and pass/fail checks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_descriptor::{DType, KvEventData, KvLayout, OwnerLease, Role, SequenceHash, TensorOrder};

use crate::{
    sealed_blocks, BankConfig, BankError, BankManager, ExclusionLineage, PendingStore, StoreStatus,
};

/// One named check of the section.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QualifyCheck {
    /// Short name (`readiness_after_all_acks`, ...).
    pub name: &'static str,
    /// True when the observed behaviour matched.
    pub passed: bool,
    /// What was observed.
    pub detail: String,
}

/// Result of [`qualify_section`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QualifySection {
    /// True when every check passed.
    pub passed: bool,
    /// Checks in the order run.
    pub checks: Vec<QualifyCheck>,
    /// Stores that became ready.
    pub stores_ready: u64,
    /// Stores rolled back.
    pub stores_rolled_back: u64,
    /// Blocks stored.
    pub blocks_stored: u64,
    /// Blocks evicted.
    pub blocks_evicted: u64,
    /// Pins taken.
    pub pins: u64,
    /// KV events emitted.
    pub events: usize,
    /// Wall time of the section in microseconds.
    pub elapsed_us: u64,
}

impl QualifySection {
    /// The section as JSON, for the qualify record.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Runs the CPU bank lifecycle: a TP2 bank of 6 slots in host shared memory;
/// stores with per-rank acks, a failed rank, a timed-out rank, pins against
/// eviction, byte round trips through the slots, the exclusion lineage, a
/// native clear, and close. Never panics; a setup failure is a failed check.
///
/// ```
/// let s = kv_bank::qualify_section();
/// assert!(s.passed, "{:#?}", s.checks);
/// assert!(s.to_json()["checks"].as_array().unwrap().len() >= 8);
/// ```
pub fn qualify_section() -> QualifySection {
    let t0 = Instant::now();
    let mut checks = Vec::new();
    let mut events = 0;
    let stats = match lifecycle(&mut checks, &mut events) {
        Ok(s) => Some(s),
        Err(e) => {
            checks.push(QualifyCheck {
                name: "setup",
                passed: false,
                detail: e.to_string(),
            });
            None
        }
    };
    let s = stats.unwrap_or_default();
    QualifySection {
        passed: !checks.is_empty() && checks.iter().all(|c| c.passed),
        checks,
        stores_ready: s.stores_ready,
        stores_rolled_back: s.stores_rolled_back,
        blocks_stored: s.blocks_stored,
        blocks_evicted: s.blocks_evicted,
        pins: s.pins,
        events,
        elapsed_us: t0.elapsed().as_micros() as u64,
    }
}

fn check(
    checks: &mut Vec<QualifyCheck>,
    name: &'static str,
    passed: bool,
    detail: impl Into<String>,
) {
    checks.push(QualifyCheck {
        name,
        passed,
        detail: detail.into(),
    });
}

fn hashes(b: &[kv_descriptor::StoredBlock]) -> Vec<SequenceHash> {
    b.iter().map(|b| b.sequence_hash).collect()
}

/// Writes rank `rank`'s pattern into every entry of pending store `p`.
fn fill(bank: &BankManager, p: &PendingStore, rank: u32) -> Result<(), BankError> {
    let len = bank.manifest().parts()[rank as usize].slot_bytes() as usize;
    for (index, (h, _)) in p.entries.iter().enumerate() {
        bank.write_pending(p.store_id, rank, index, &pattern(h, rank, len))?;
    }
    Ok(())
}

fn pattern(h: &SequenceHash, rank: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (h.0.rotate_left(i as u32 % 64) as u8) ^ (rank as u8).wrapping_mul(77) ^ (i as u8))
        .collect()
}

fn lifecycle(
    checks: &mut Vec<QualifyCheck>,
    events: &mut usize,
) -> Result<crate::BankStats, BankError> {
    let layout = KvLayout::new(2, 4, 16, DType::Bf16, 4, TensorOrder::BlockMajor, 2)?;
    let lineage = Arc::new(ExclusionLineage::default());
    let mut cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        6 * layout.block_bytes() as u64,
    );
    cfg.store_timeout = Duration::from_millis(50);
    cfg.lineage = lineage.clone();
    let bank = BankManager::new_host_shm(cfg, "qualify-host")?;
    check(
        checks,
        "budget_divided_across_ranks",
        bank.manifest().tp_size() == 2 && bank.manifest().slot_count() == 6,
        format!(
            "tp_size {} slot_count {}",
            bank.manifest().tp_size(),
            bank.manifest().slot_count()
        ),
    );

    let tokens: Vec<u32> = (100..118).collect(); // 4 sealed blocks + 2 unsealed tokens
    let a = sealed_blocks(None, &tokens, 4);
    let p = bank.store(None, &a)?;
    // An ack before the rank wrote would publish whatever the slots held.
    let unwritten = bank.ack(p.store_id, 0);
    fill(&bank, &p, 0)?;
    let after_one = bank.ack(p.store_id, 0)?;
    let sealed = bank.write_pending(
        p.store_id,
        0,
        0,
        &vec![0; bank.manifest().parts()[0].slot_bytes() as usize],
    );
    check(
        checks,
        "ack_only_after_the_rank_wrote_and_writes_sealed_by_it",
        matches!(
            unwritten,
            Err(BankError::Unwritten {
                rank: 0,
                missing: 4,
                first: 0,
                ..
            })
        ) && matches!(sealed, Err(BankError::RankAcked { rank: 0, .. })),
        format!("ack before writing: {unwritten:?}; write after ack: {sealed:?}"),
    );
    let hidden = bank.inventory().ready.is_empty() && bank.pin_prefix(&hashes(&a)[..1]).is_err();
    fill(&bank, &p, 1)?;
    let ready = bank.ack(p.store_id, 1)? == StoreStatus::Ready;
    check(
        checks,
        "ready_only_after_every_rank_acked",
        matches!(after_one, StoreStatus::Waiting { ref missing } if missing == &[1])
            && hidden
            && ready,
        format!("after rank 0: {after_one:?}; hidden {hidden}; ready after rank 1: {ready}"),
    );
    check(
        checks,
        "only_sealed_blocks",
        a.len() == 4 && bank.inventory().ready.len() == 4,
        format!(
            "18 tokens / 4 per block -> {} blocks retained",
            bank.inventory().ready.len()
        ),
    );

    let mut roundtrip_ok = true;
    for rank in 0..2 {
        let rb = bank.rank(rank)?;
        for (h, slot) in &p.entries {
            let mut out = vec![0u8; rb.descriptor().slot_bytes() as usize];
            rb.read_slot(*slot, &mut out)?;
            roundtrip_ok &= out == pattern(h, rank, out.len());
        }
    }
    check(
        checks,
        "slot_bytes_round_trip",
        roundtrip_ok,
        "every rank's part of every slot read back equal",
    );

    let b = sealed_blocks(None, &(500..508).collect::<Vec<u32>>(), 4);
    let pb = bank.store(None, &b)?;
    fill(&bank, &pb, 0)?;
    bank.ack(pb.store_id, 0)?;
    bank.fail(pb.store_id, 1)?;
    let rolled = bank.inventory().ready.len() == 4 && bank.lookup(&b[0].sequence_hash).is_none();
    let pc = bank.store(None, &b)?;
    fill(&bank, &pc, 0)?;
    bank.ack(pc.store_id, 0)?;
    std::thread::sleep(Duration::from_millis(60));
    let timed_out = matches!(
        bank.ack(pc.store_id, 1),
        Err(BankError::StoreTimedOut { .. })
    );
    // Rank 1 never answered: its slots wait one more timeout before reuse.
    let quarantined = bank.inventory().quarantined_slots;
    std::thread::sleep(Duration::from_millis(60));
    bank.expire_overdue();
    let released = bank.inventory().quarantined_slots;
    check(
        checks,
        "failed_or_timed_out_rank_rolls_back",
        rolled
            && timed_out
            && bank.inventory().pending_slots == 0
            && quarantined == 2
            && released == 0,
        format!(
            "fail rolled back: {rolled}; timeout rolled back: {timed_out}; \
             quarantined {quarantined} slots, {released} after one more timeout"
        ),
    );

    let pin = bank.pin_prefix(&hashes(&a))?;
    let full = bank.store(
        None,
        &sealed_blocks(None, &(900..912).collect::<Vec<u32>>(), 4),
    );
    check(
        checks,
        "eviction_never_touches_pins",
        matches!(full, Err(BankError::BankFull { .. })) && bank.ready_prefix_len(&hashes(&a)) == 4,
        format!(
            "3 new blocks with 4 of 6 slots pinned: {:?}",
            full.map(|p| p.entries.len())
        ),
    );
    drop(pin);
    let pd = bank.store(
        None,
        &sealed_blocks(None, &(900..912).collect::<Vec<u32>>(), 4),
    )?;
    for r in 0..2 {
        fill(&bank, &pd, r)?;
        bank.ack(pd.store_id, r)?;
    }
    let kept = bank.ready_prefix_len(&hashes(&a));
    check(
        checks,
        "lru_evicts_prefix_tail_first",
        kept == 3,
        format!("after unpinning, a 3-block store evicted 1 block; root prefix kept {kept} of 4"),
    );

    let before = bank.inventory();
    let mm = sealed_blocks(
        Some(a[2].sequence_hash),
        &(7000..7008).collect::<Vec<u32>>(),
        4,
    );
    bank.exclude(&[mm[0].sequence_hash]);
    let after_clear = bank.native_cleared();
    let pe = bank.store(Some(a[2].sequence_hash), &mm)?;
    check(
        checks,
        "exclusion_lineage_survives_native_clear",
        pe.is_empty()
            && pe.excluded == 2
            && lineage.is_excluded(&mm[1].sequence_hash)
            && after_clear == before,
        format!(
            "excluded {} of 2 descendants; inventory unchanged by native clear: {}",
            pe.excluded,
            after_clear == before
        ),
    );

    let evs = bank.drain_events();
    *events = evs.len();
    let ids_ok = evs
        .iter()
        .enumerate()
        .all(|(i, e)| e.event_id == i as u64 + 1);
    let stored: usize = evs
        .iter()
        .map(|e| match &e.data {
            KvEventData::Stored { blocks, .. } => blocks.len() as i64,
            KvEventData::Removed { sequence_hashes } => -(sequence_hashes.len() as i64),
            KvEventData::Cleared => 0,
        })
        .sum::<i64>() as usize;
    check(
        checks,
        "events_match_inventory",
        ids_ok && stored == bank.inventory().ready.len(),
        format!(
            "{} events, ids consecutive {ids_ok}, net stored {stored}",
            evs.len()
        ),
    );

    let pin = bank.pin_prefix(&hashes(&a)[..1])?;
    let timed = bank.close(Duration::from_millis(20));
    let refused = bank.pin_prefix(&hashes(&a)[..1]).is_err() && bank.store(None, &a).is_err();
    drop(pin);
    let freed = bank.rank(0).is_err() && bank.pins_outstanding() == 0;
    let desc_refused = bank.check_descriptor(&bank.manifest().parts()[0]).is_err();
    check(
        checks,
        "close_refuses_and_frees_after_pins_drain",
        matches!(timed, Err(BankError::CloseTimedOut { pins: 1, .. })) && refused && freed && desc_refused,
        format!("close with a pin: {timed:?}; new pins refused {refused}; freed after drain {freed}; descriptor refused {desc_refused}"),
    );
    let stats = bank.stats();
    *events += bank.drain_events().len();
    Ok(stats)
}
