//! The donor agent's inventory: what its published KV events say it holds,
//! and the snapshot pages it answers with.
//!
//! The mirror is fed by the very events the agent publishes, under the lock
//! that assigns their ids, so a page built under that lock is exactly the
//! state after events `1..=last_event_id`. Each listed block is checked
//! against the bank itself (still ready, in the same slot), so a block the
//! bank dropped but whose `Removed` is not yet published is left out: a
//! router then misses it, which is safe; it never gets a slot that holds
//! something else.

use std::collections::{BTreeMap, HashMap};

use kv_bank::BankManager;
use kv_descriptor::{KvEventData, SequenceHash};

use crate::plane::inventory::all_ranks;
use crate::{InventoryRequest, InventorySnapshot, SnapshotBlock};

/// Ready blocks by slot, as the published events left them.
#[derive(Debug, Default)]
pub(super) struct Mirror {
    by_slot: BTreeMap<u32, SnapshotBlock>,
    by_hash: HashMap<SequenceHash, u32>,
    /// Id of the last event published (ids count from 1).
    pub(super) last_event_id: u64,
}

impl Mirror {
    /// Applies one published event (its id was the next one).
    pub(super) fn apply(&mut self, data: &KvEventData, tp_size: u32) {
        self.last_event_id += 1;
        match data {
            KvEventData::Stored { parent, blocks } => {
                let mut parent = *parent;
                for b in blocks {
                    if let Some(slot) = b.slot {
                        self.remove_hash(&b.sequence_hash);
                        if let Some(old) = self.by_slot.remove(&slot) {
                            self.by_hash.remove(&old.sequence_hash);
                        }
                        self.by_slot.insert(
                            slot,
                            SnapshotBlock {
                                sequence_hash: b.sequence_hash,
                                token_hash: b.token_hash,
                                parent,
                                slot,
                                rank_acks: all_ranks(tp_size),
                            },
                        );
                        self.by_hash.insert(b.sequence_hash, slot);
                    }
                    parent = Some(b.sequence_hash);
                }
            }
            KvEventData::Removed { sequence_hashes } => {
                for h in sequence_hashes {
                    self.remove_hash(h);
                }
            }
            KvEventData::Cleared => {
                self.by_slot.clear();
                self.by_hash.clear();
            }
        }
    }

    fn remove_hash(&mut self, h: &SequenceHash) {
        if let Some(slot) = self.by_hash.remove(h) {
            self.by_slot.remove(&slot);
        }
    }

    /// The page `req` asks for, each block checked against `bank`.
    pub(super) fn page(&self, req: &InventoryRequest, bank: &BankManager) -> InventorySnapshot {
        let owner = bank.owner();
        let layout = bank.config().layout;
        let mut blocks = Vec::new();
        let mut next_slot = None;
        for (&slot, b) in self.by_slot.range(req.from_slot..) {
            if blocks.len() == req.max_blocks as usize {
                next_slot = Some(slot);
                break;
            }
            if bank.lookup(&b.sequence_hash) == Some(slot) {
                blocks.push(*b);
            }
        }
        InventorySnapshot {
            engine_id: owner.engine_id,
            bank_generation: owner.generation,
            layout_fingerprint: layout.fingerprint(),
            tp_size: layout.tp_size(),
            last_event_id: self.last_event_id,
            blocks,
            next_slot,
        }
    }
}
