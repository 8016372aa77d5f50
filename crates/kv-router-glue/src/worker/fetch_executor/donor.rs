//! What the executor needs of a donor: its manifest, a pin of a hint's
//! slots, and each pinned rank's memory (the in-process [`BankManager`]
//! and the remote donor of `remote_donor.rs` both provide it).

use kv_bank::{BankManager, BankMemory, ManagerPin};
use kv_descriptor::{BankManifest, FetchGpuHint};
use kv_transfer::SourceRegion;

use crate::PinError;

/// Pinned donor slots; the pin is released on drop.
pub trait DonorPin {
    /// Rank `rank`'s donor region (offset 0 = slot 0), mapped in this process.
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory>;

    /// Where rank `rank`'s donor bytes are read from. Defaults to the mapped
    /// [`DonorPin::rank_memory`]; a donor reached through a NIXL agent (another
    /// host) returns [`SourceRegion::Nixl`] instead, with `rank_memory` `None`.
    fn rank_source(&self, rank: u32) -> Option<SourceRegion<'_>> {
        self.rank_memory(rank).map(SourceRegion::Mapped)
    }

    /// Releases the pin, reporting whether it held from grant to now.
    ///
    /// The executor calls this after the delivery and completes the fetch
    /// only on `Ok`: a pin the donor dropped early (a remote pin past its
    /// hold bound, or whose connection failed) may have let the slots be
    /// reused while they were read. An in-process [`ManagerPin`] cannot end
    /// early, so the default (drop, `Ok`) is right for it.
    ///
    /// # Errors
    /// Why the pin cannot be trusted to have held throughout (e.g.
    /// [`PinError::Expired`], or a transport [`PinError::Io`] /
    /// [`PinError::Timeout`] after which the donor may have dropped it).
    fn release(self: Box<Self>) -> Result<(), PinError> {
        Ok(())
    }

    /// The donor's checksums of the pinned blocks, rank-major (see
    /// [`kv_descriptor::PinGrant::block_checksums`]), when this pin's
    /// reads must be verified against them; the executor then completes
    /// only if every received block matches. `None` (the default): the
    /// source is bound to the donor's memory by its export handle (a
    /// mapping or an in-process pin), nothing to check. A `Some` holding
    /// the wrong count (e.g. empty from a donor that sends none) falls back.
    fn block_checksums(&self) -> Option<&[u64]> {
        None
    }
}

/// A donor bank the target can read.
pub trait DonorSource {
    /// The donor's manifest, as the target trusts it (imported from the donor).
    fn manifest(&self) -> &BankManifest;
    /// Pins the hinted slots, checking that they still hold the hinted blocks.
    ///
    /// # Errors
    /// A [`PinError`]: a refusal carrying its
    /// [`kv_descriptor::PinRefusalReason`] (stale generation, slot reused,
    /// closed, ...; [`PinError::refusal_reason`]), or a transport, timeout
    /// or protocol failure. Nothing is pinned on error.
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError>;
}

impl DonorPin for ManagerPin {
    fn rank_memory(&self, rank: u32) -> Option<&dyn BankMemory> {
        self.rank(rank).ok().map(|b| b.memory().as_ref())
    }
}

impl DonorSource for BankManager {
    fn manifest(&self) -> &BankManifest {
        BankManager::manifest(self)
    }
    fn pin<'a>(&'a self, hint: &FetchGpuHint) -> Result<Box<dyn DonorPin + 'a>, PinError> {
        self.pin_hint(hint)
            .map(|p| Box::new(p) as Box<dyn DonorPin>)
            .map_err(PinError::Bank)
    }
}
