//! Whether a Stored event chains from what the index knows of its publisher.
//!
//! The index keys entries by sequence hash alone, and a lookup trusts that a
//! sequence hash names its whole prefix. A Stored event that names a parent
//! the publisher does not hold, or whose blocks do not chain one from the
//! next, breaks that trust: its blocks would be indexed as if their prefix
//! were known, and a request whose hashes happen to start at one of them would
//! match it "from the root". Such an event is not stored at all and the
//! publisher is resynced (the same rule as Dynamo's `RadixTree`, which refuses
//! a store whose parent it does not know with `ParentBlockNotFound`).

use kv_descriptor::{chain_sequence_hash, SequenceHash, StoredBlock};

/// Why a Stored event was not stored: its blocks do not chain from what the
/// index knows of the publisher ([`crate::EventOutcome::Unchained`]).
///
/// ```
/// # use kv_descriptor::*;
/// # use kv_lookup::*;
/// # let index = InventoryIndex::new();
/// # let fp = LayoutFingerprint(42);
/// # let worker = |role| WorkerInfo { engine: EngineId::fresh(), role, layout_fingerprint: fp, tp_size: 1 };
/// # let tokens: Vec<u32> = (0..64).collect();
/// # let hashes = sequence_hashes(&tokens, 16);
/// # let blocks: Vec<StoredBlock> = hashes.iter().zip(token_block_hashes(&tokens, 16))
/// #     .map(|(&sequence_hash, token_hash)| StoredBlock { sequence_hash, token_hash, slot: None }).collect();
/// # let event = |w: &WorkerInfo, event_id, tier, data| KvEvent { publisher: w.engine, event_id, role: w.role,
/// #     layout_fingerprint: w.layout_fingerprint, tp_size: w.tp_size, tier, data };
/// use kv_lookup::{EventOutcome, UnchainedStore};
/// let d = worker(Role::Decode);
/// // Blocks 2 and 3, announced as children of block 1, which `d` never stored.
/// let orphan = KvEventData::Stored { parent: Some(hashes[1]), blocks: blocks[2..].to_vec() };
/// let out = index.apply_event(&event(&d, 1, StorageTier::RetainedGpuDirect, orphan))?;
/// let cause = UnchainedStore::ParentNotHeld { parent: hashes[1] };
/// assert_eq!(out, EventOutcome::Unchained { cause });
/// assert!(index.holds(d.engine, hashes[2]).is_empty()); // nothing stored
/// assert_eq!(index.workers_needing_resync(), vec![d.engine]);
/// # Ok::<(), LookupError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnchainedStore {
    /// `parent` is not held by the publisher in the event's tier (it was never
    /// stored, or it was removed): the blocks have no known prefix.
    ParentNotHeld {
        /// The event's `parent`.
        parent: SequenceHash,
    },
    /// `blocks[index].sequence_hash` is not the chained hash of its parent
    /// (the event's `parent` for block 0, block `index - 1` otherwise) and its
    /// own `token_hash` ([`kv_descriptor::chain_sequence_hash`]).
    BrokenLink {
        /// Position in the event's `blocks`.
        index: usize,
        /// The block's `sequence_hash` as sent.
        sequence_hash: SequenceHash,
        /// What it should be.
        expected: SequenceHash,
    },
}

/// First block of `blocks` that does not chain from its parent, `parent`
/// being the parent of block 0.
///
/// A root block (block 0 with `parent: None`) is not checked: its sequence
/// hash depends on the engine's hash namespace (adapter, cache salt), which
/// the index does not know; every later link uses the fixed chaining rule.
/// Costs one XXH3 of 16 bytes per checked block.
pub(crate) fn first_broken_link(
    parent: Option<SequenceHash>,
    blocks: &[StoredBlock],
) -> Option<UnchainedStore> {
    let mut prev = parent;
    for (index, b) in blocks.iter().enumerate() {
        if let Some(p) = prev {
            let expected = chain_sequence_hash(Some(p), b.token_hash);
            if expected != b.sequence_hash {
                return Some(UnchainedStore::BrokenLink {
                    index,
                    sequence_hash: b.sequence_hash,
                    expected,
                });
            }
        }
        prev = Some(b.sequence_hash);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_descriptor::{chain_stored_blocks, token_block_hash, TokenBlockHash};

    fn blocks(parent: Option<SequenceHash>, n: u32) -> Vec<StoredBlock> {
        chain_stored_blocks(parent, (0..n).map(|i| token_block_hash(&[i, i + 1])))
    }

    #[test]
    fn a_true_chain_passes_and_the_first_broken_link_is_named() {
        let p = SequenceHash(77);
        let mut b = blocks(Some(p), 4);
        assert_eq!(first_broken_link(Some(p), &b), None);
        // The same blocks under another stated parent break at block 0.
        let other = SequenceHash(78);
        assert_eq!(
            first_broken_link(Some(other), &b),
            Some(UnchainedStore::BrokenLink {
                index: 0,
                sequence_hash: b[0].sequence_hash,
                expected: chain_sequence_hash(Some(other), b[0].token_hash),
            })
        );
        b[2].token_hash = TokenBlockHash(5);
        assert!(matches!(
            first_broken_link(Some(p), &b),
            Some(UnchainedStore::BrokenLink { index: 2, .. })
        ));
    }

    #[test]
    fn a_root_block_is_not_checked_but_its_children_are() {
        let mut b = blocks(None, 3);
        b[0].sequence_hash = SequenceHash(1); // any root hash is accepted
        assert!(matches!(
            first_broken_link(None, &b),
            Some(UnchainedStore::BrokenLink { index: 1, .. })
        ));
        assert_eq!(first_broken_link(None, &b[..1]), None);
    }
}
