//! What a completed fetch returns: its rows, what it fetched, the
//! delivery's report and where its wall time went.

use kv_bank::CompletedBlocks;
use kv_descriptor::SequenceHash;
use kv_transfer::DeliveryReport;

/// A completed fetch: the target blocks now hold the fetched prefix.
#[derive(Debug, PartialEq, Eq)]
pub struct FetchOutcome {
    /// Target block ids, one per fetched block, in prefix order. They stay
    /// out of the executor's pool, so no later fetch overwrites them, until
    /// this outcome (or the moved-out guard) is dropped: keep it while the
    /// request's cache reads them.
    pub target_blocks: CompletedBlocks,
    /// Index of the first fetched block in the request.
    pub fetch_from: u32,
    /// Sequence hashes of the fetched blocks.
    pub fetched: Vec<SequenceHash>,
    /// The delivery's report (bytes, copies, host payload, transport).
    pub report: DeliveryReport,
    /// Where the fetch's wall time went, stage by stage.
    pub stages: FetchStages,
}

/// Wall time of one fetch's stages, in µs, in the order they run (each
/// measured on the executor's thread with `Instant`). Their sum is the
/// executor's share of a fetch; what a caller adds (donor import, argument
/// parsing) is outside.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchStages {
    /// Hint checks and reserving the destination rows.
    pub reserve_us: u64,
    /// Building the copy plan from the manifest's and the target's layouts.
    pub plan_us: u64,
    /// The donor's pin grant (a round trip to its pin service).
    pub pin_us: u64,
    /// The delivery: copies issued and completed, donor probed
    /// ([`DeliveryReport::elapsed_us`] plus the backend's return).
    pub transfer_us: u64,
    /// Pin release, checksum verification and committing the rows.
    pub verify_commit_us: u64,
}
