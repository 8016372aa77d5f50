//! Multimodal exclusion lineage: blocks whose content depends on excluded
//! multimodal inputs, which must never be exported.
//!
//! Sequence hashes cover token ids only (Dynamo's scheme, no multimodal
//! info), so two requests with the same placeholder tokens but different
//! images share hashes while their K/V differ. An engine marks such blocks
//! here; every descendant of a marked block is marked too when it is stored
//! (its K/V attends to the excluded input). The lineage is owned by the
//! engine, outside both its native cache and any bank generation, so a native
//! clear or a bank reopen never forgets it.

use std::collections::HashSet;

use kv_descriptor::SequenceHash;
use parking_lot::RwLock;

/// Set of sequence hashes that must never be exported. Shared (`Arc`) by an
/// engine and its bank managers; marks are permanent for the engine's life.
///
/// ```
/// use kv_bank::ExclusionLineage;
/// use kv_descriptor::SequenceHash;
/// let l = ExclusionLineage::default();
/// l.mark(&[SequenceHash(7)]);
/// assert!(l.is_excluded(&SequenceHash(7)));
/// assert!(!l.is_excluded(&SequenceHash(8)));
/// ```
#[derive(Debug, Default)]
pub struct ExclusionLineage {
    excluded: RwLock<HashSet<SequenceHash>>,
}

impl ExclusionLineage {
    /// Marks blocks as depending on excluded multimodal input.
    pub fn mark(&self, hashes: &[SequenceHash]) {
        self.excluded.write().extend(hashes.iter().copied());
    }
    /// True when `hash` (or, once stored, an ancestor of it) was marked.
    pub fn is_excluded(&self, hash: &SequenceHash) -> bool {
        self.excluded.read().contains(hash)
    }
    /// Index of the first `(block, parent)` pair whose block or parent is
    /// marked: where a store must stop, since that block and every later
    /// one (its descendants) depend on excluded input. One read lock for
    /// the whole walk. `store` applies it when called and `ack` again at
    /// commit, for marks made while the store was pending.
    pub(crate) fn first_tainted(
        &self,
        pairs: impl IntoIterator<Item = (SequenceHash, Option<SequenceHash>)>,
    ) -> Option<usize> {
        let marked = self.excluded.read();
        pairs.into_iter().position(|(h, parent)| {
            marked.contains(&h) || parent.is_some_and(|p| marked.contains(&p))
        })
    }
    /// Number of marked hashes.
    pub fn len(&self) -> usize {
        self.excluded.read().len()
    }
    /// True when nothing is marked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
