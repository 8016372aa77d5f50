//! One TP rank's part of a retained bank: its memory and its descriptor.

use std::sync::Arc;

use kv_descriptor::{BankDescriptor, MemoryLocation};

use crate::memory::check_range;
use crate::{BankError, BankMemory, DeviceRows};

/// Memory for one rank, as returned by a bank manager's allocator.
#[derive(Debug, Clone)]
pub struct RankMemory {
    /// The region; at least `slot_count x slot_bytes` long, and exportable.
    pub memory: Arc<dyn BankMemory>,
    /// Where it lives (host, or which GPU): goes into the rank's descriptor.
    pub location: MemoryLocation,
}

/// One rank's retained bank: `slot_count` fixed-size slots of one block part
/// each (`slot_bytes` = the layout's rank block bytes), slot `s` at byte
/// offset `s x slot_bytes` of the memory. Which block a slot holds is decided
/// by the owning [`crate::BankManager`], identically for every rank.
///
/// A store's slots are filled only through
/// [`crate::BankManager::write_pending`] (host bytes) and
/// [`crate::BankManager::write_pending_from_device`] (device rows): they
/// check the slot is pending for that store and record which entries each
/// rank wrote, and [`crate::BankManager::ack`] refuses a rank until it wrote
/// every entry ([`BankError::Unwritten`]). Those are the only public
/// writers: the raw slot writers they call are crate-private (a write
/// through them would be unchecked and not recorded), and a copy to
/// [`RankBank::slot_addr`] is not recorded either: a slot filled that way
/// does not let its rank ack.
#[derive(Debug, Clone)]
pub struct RankBank {
    descriptor: BankDescriptor,
    memory: Arc<dyn BankMemory>,
}

impl RankBank {
    pub(crate) fn new(descriptor: BankDescriptor, memory: Arc<dyn BankMemory>) -> Self {
        Self { descriptor, memory }
    }
    /// The published descriptor of this rank.
    pub fn descriptor(&self) -> &BankDescriptor {
        &self.descriptor
    }
    /// The memory behind the slots.
    pub fn memory(&self) -> &Arc<dyn BankMemory> {
        &self.memory
    }
    fn slot_offset(&self, slot: u32) -> Result<usize, BankError> {
        if slot >= self.descriptor.slot_count() {
            return Err(BankError::arg(
                "slot",
                format!(
                    "{slot} is not below slot_count {}",
                    self.descriptor.slot_count()
                ),
            ));
        }
        Ok(slot as usize * self.descriptor.slot_bytes() as usize)
    }
    /// Address of slot `slot` in this process (host pointer or `CUdeviceptr`).
    ///
    /// For reading and for diagnostics: a copy written to this address is
    /// not recorded as written (see the type's docs), so storing a block goes
    /// through [`crate::BankManager::write_pending`] or
    /// [`crate::BankManager::write_pending_from_device`], never a direct
    /// write here.
    ///
    /// # Errors
    /// `slot` not below `slot_count`.
    pub fn slot_addr(&self, slot: u32) -> Result<u64, BankError> {
        Ok(self.memory.base_addr() + self.slot_offset(slot)? as u64)
    }
    /// Copies `bytes` (exactly `slot_bytes` long) into slot `slot`.
    ///
    /// Unchecked against the slot's state and not recorded as a store's
    /// write, hence crate-private: a rank that filled its slots with this
    /// could not ack. Stores use [`crate::BankManager::write_pending`], which
    /// checks the slot, records the write and calls this.
    ///
    /// # Errors
    /// `slot` out of range, `bytes` of the wrong length, or the memory's copy error.
    pub(crate) fn write_slot(&self, slot: u32, bytes: &[u8]) -> Result<(), BankError> {
        let off = self.slot_offset(slot)?;
        if bytes.len() as u64 != self.descriptor.slot_bytes() {
            return Err(BankError::arg(
                "bytes",
                format!(
                    "{} bytes given, a slot holds {}",
                    bytes.len(),
                    self.descriptor.slot_bytes()
                ),
            ));
        }
        check_range("slot", off, bytes.len(), self.memory.len())?;
        self.memory.write_bytes(off, bytes)
    }
    /// Copies row `i` of `src` (device memory) into slot `slots[i]`, for
    /// every `i`, device to device; synchronous (see
    /// [`BankMemory::copy_from_device`]).
    ///
    /// Unchecked and unrecorded, hence crate-private, as
    /// [`RankBank::write_slot`] (stores use
    /// [`crate::BankManager::write_pending_from_device`], which checks,
    /// records the write and calls this).
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] naming `slot` (out of range) or
    /// `source` (`row_bytes` is not the slot size, `rows` is not
    /// `slots.len()`); the memory's copy error ([`BankError::Unsupported`]
    /// on a host bank).
    pub(crate) fn write_slots_from_device(
        &self,
        slots: &[u32],
        src: DeviceRows,
    ) -> Result<(), BankError> {
        if src.row_bytes as u64 != self.descriptor.slot_bytes() {
            return Err(BankError::arg(
                "source",
                format!(
                    "rows of {} bytes, a slot holds {}",
                    src.row_bytes,
                    self.descriptor.slot_bytes()
                ),
            ));
        }
        if src.rows != slots.len() {
            return Err(BankError::arg(
                "source",
                format!("{} rows for {} slots", src.rows, slots.len()),
            ));
        }
        let copies = slots
            .iter()
            .enumerate()
            .map(|(i, s)| Ok((self.slot_offset(*s)?, src.row_addr(i))))
            .collect::<Result<Vec<_>, BankError>>()?;
        if copies.is_empty() {
            return Ok(());
        }
        self.memory
            .copy_from_device(&copies, src.row_bytes, src.ordinal)
    }

    /// Copies slot `slot` into `out` (exactly `slot_bytes` long).
    ///
    /// # Errors
    /// [`BankError::InvalidArgument`] naming `slot` (not below `slot_count`)
    /// or `out` (not `slot_bytes` long); the memory's copy error.
    pub fn read_slot(&self, slot: u32, out: &mut [u8]) -> Result<(), BankError> {
        let off = self.slot_offset(slot)?;
        if out.len() as u64 != self.descriptor.slot_bytes() {
            return Err(BankError::arg(
                "out",
                format!(
                    "{} bytes given, a slot holds {}",
                    out.len(),
                    self.descriptor.slot_bytes()
                ),
            ));
        }
        self.memory.read_bytes(off, out)
    }
}
