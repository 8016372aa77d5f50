//! Checking a `kv.fetch_gpu@1.0` hint against the donor's manifest and the
//! target's own layout ([`validate_hint`]), and against the prompt the
//! prefill worker is about to run ([`check_prompt_prefix`]), before anything
//! is reserved or read.
//!
//! The hint travels through the router and may be stale (the donor restarted
//! or reopened its bank) or forged. Every check here uses only values the
//! target trusts: the manifest it imported from the donor's control plane and
//! its own layout.

use std::collections::HashSet;

use kv_descriptor::{BankManifest, FetchGpuHint, KvLayout, Role, SequenceHash};

use crate::FetchError;

/// A hint that passed [`validate_hint`]: the slots to read and the bytes to expect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedFetch {
    /// The hint as validated.
    pub hint: FetchGpuHint,
    /// Donor slot ids, in fetched-block order (identical on every rank).
    pub slot_ids: Vec<u32>,
    /// Bytes per rank: `slot_ids.len() x rank_block_bytes`.
    pub rank_bytes: u64,
    /// Bytes over all ranks.
    pub total_bytes: u64,
}

/// Validates `hint` against the donor `manifest` and the `target` layout.
///
/// Checks, in order: internal consistency with the donor's block size
/// ([`FetchGpuHint::validate`]); donor role; engine incarnation; bank
/// generation; layout fingerprint equal on hint, donor and target; TP size;
/// every slot id below the donor's slot count; all ranks listing the same
/// slot ids (logical slots are shared); no slot listed twice.
///
/// # Errors
/// The first failing check as a [`FetchError`] naming the field.
///
/// ```
/// use kv_descriptor::*;
/// use kv_router_glue::validate_hint;
/// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// let owner = OwnerLease::fresh(Role::Decode);
/// let d = BankDescriptor::new(BankParts { layout, tp_rank: 0,
///     location: MemoryLocation::Host { host_id: "h".into() }, owner,
///     export: ExportHandle::HostShm { name: "/b".into() }, slot_count: 8,
///     slot_bytes: layout.rank_block_bytes() as u64 }).unwrap();
/// let manifest = BankManifest::new(vec![d]).unwrap();
/// let mut hint = FetchGpuHint {
///     donor_engine_id: owner.engine_id, bank_generation: 1,
///     layout_fingerprint: layout.fingerprint(), tp_size: 1,
///     sequence_hashes: vec![SequenceHash(1), SequenceHash(2)], fetch_from: 0,
///     parts: vec![FetchPart { tp_rank: 0, slot_ids: vec![5, 7],
///                            expected_bytes: 2 * layout.rank_block_bytes() as u64 }],
///     donor_control_endpoint: "kv.ns.decode.control".into(),
/// };
/// assert!(validate_hint(&hint, &manifest, &layout).is_ok());
/// hint.parts[0].slot_ids[1] = 8; // out of range
/// assert!(validate_hint(&hint, &manifest, &layout).is_err());
/// ```
pub fn validate_hint(
    hint: &FetchGpuHint,
    manifest: &BankManifest,
    target: &KvLayout,
) -> Result<ValidatedFetch, FetchError> {
    let donor_layout = manifest.layout();
    let rank_block_bytes = donor_layout.rank_block_bytes() as u64;
    hint.validate(rank_block_bytes)?;
    let owner = manifest.owner();
    if owner.role != Role::Decode {
        return Err(FetchError::NotADonor {
            role: format!("{:?}", owner.role),
        });
    }
    if hint.donor_engine_id != owner.engine_id {
        return Err(FetchError::WrongEngine {
            hint: hint.donor_engine_id.to_string(),
            manifest: owner.engine_id.to_string(),
        });
    }
    if hint.bank_generation != owner.generation {
        return Err(FetchError::StaleGeneration {
            hint: hint.bank_generation,
            manifest: owner.generation,
        });
    }
    let (donor_fp, target_fp) = (donor_layout.fingerprint(), target.fingerprint());
    if hint.layout_fingerprint != donor_fp || donor_fp != target_fp {
        return Err(FetchError::LayoutMismatch {
            field: "hint.layout_fingerprint",
            detail: format!(
                "hint {}, donor {donor_fp}, target {target_fp}",
                hint.layout_fingerprint
            ),
        });
    }
    if hint.tp_size != manifest.tp_size() || hint.tp_size != target.tp_size() {
        return Err(FetchError::LayoutMismatch {
            field: "hint.tp_size",
            detail: format!(
                "hint {}, donor {}, target {}",
                hint.tp_size,
                manifest.tp_size(),
                target.tp_size()
            ),
        });
    }
    let slot_count = manifest.slot_count();
    let first = &hint.parts[0].slot_ids;
    for part in &hint.parts {
        if let Some(&slot) = part.slot_ids.iter().find(|&&s| s >= slot_count) {
            return Err(FetchError::SlotOutOfRange {
                rank: part.tp_rank,
                slot,
                slot_count,
            });
        }
        if &part.slot_ids != first {
            return Err(FetchError::InconsistentSlots {
                rank: part.tp_rank,
                detail: "differs from rank 0 (logical slot ids are shared by all ranks)".into(),
            });
        }
    }
    let mut seen = HashSet::with_capacity(first.len());
    if let Some(dup) = first.iter().find(|s| !seen.insert(**s)) {
        return Err(FetchError::InconsistentSlots {
            rank: 0,
            detail: format!("slot {dup} is listed twice"),
        });
    }
    let rank_bytes = first.len() as u64 * rank_block_bytes;
    Ok(ValidatedFetch {
        hint: hint.clone(),
        slot_ids: first.clone(),
        rank_bytes,
        total_bytes: rank_bytes * u64::from(hint.tp_size),
    })
}

/// Checks that `hint.sequence_hashes` is a prefix of `prompt`, the sequence
/// hashes of the prompt's sealed blocks (block size as the hint's, e.g. from
/// [`kv_descriptor::sequence_hashes`]).
///
/// Every prefill worker makes this check before it fetches: the router's hint
/// is attached to a request but names blocks by hash, and a hint written for
/// another prompt (a router bug, a replayed or forged envelope) would import
/// another conversation's KV into this request. A hint of fewer blocks than
/// the prompt is fine (the rest is computed).
///
/// # Errors
/// [`FetchError::HintBeyondPrompt`] when the hint names more blocks than the
/// prompt has; [`FetchError::PromptMismatch`] naming the first block index
/// where the hashes differ.
///
/// ```
/// use kv_descriptor::{sequence_hashes, FetchGpuHint, EngineId, LayoutFingerprint};
/// use kv_router_glue::{check_prompt_prefix, FetchError};
/// let prompt = sequence_hashes(&(0..64).collect::<Vec<u32>>(), 16);
/// let other = sequence_hashes(&(1..65).collect::<Vec<u32>>(), 16);
/// let hint = |h: &[kv_descriptor::SequenceHash]| FetchGpuHint {
///     donor_engine_id: EngineId::fresh(), bank_generation: 1,
///     layout_fingerprint: LayoutFingerprint(0), tp_size: 1,
///     sequence_hashes: h.to_vec(), fetch_from: 0, parts: vec![],
///     donor_control_endpoint: String::new(),
/// };
/// assert!(check_prompt_prefix(&hint(&prompt[..2]), &prompt).is_ok());
/// assert!(matches!(check_prompt_prefix(&hint(&other), &prompt),
///                  Err(FetchError::PromptMismatch { block: 0 })));
/// ```
pub fn check_prompt_prefix(hint: &FetchGpuHint, prompt: &[SequenceHash]) -> Result<(), FetchError> {
    if hint.sequence_hashes.len() > prompt.len() {
        return Err(FetchError::HintBeyondPrompt {
            hint_blocks: hint.sequence_hashes.len(),
            prompt_blocks: prompt.len(),
        });
    }
    match hint
        .sequence_hashes
        .iter()
        .zip(prompt)
        .position(|(h, p)| h != p)
    {
        Some(block) => Err(FetchError::PromptMismatch { block }),
        None => Ok(()),
    }
}
