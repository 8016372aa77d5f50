//! The one error type of this crate.

use kv_descriptor::{DescriptorError, SequenceHash};

/// Why a bank, memory, store, pin or reservation operation was refused.
///
/// Every variant names the offending field or handle so that an operator can
/// find it without reading source code. Whenever an operation returns an
/// error, it has left nothing half-registered: allocations are freed, slots
/// are rolled back, no event was emitted.
#[derive(Debug, thiserror::Error)]
pub enum BankError {
    /// An argument had a value outside its allowed range.
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument {
        /// Name of the argument or field, e.g. `len`, `shm.name`.
        field: &'static str,
        /// Human-readable reason, including the value seen.
        reason: String,
    },
    /// A host system call on shared memory failed.
    #[error("host shared memory `{name}`: {op} failed: {source}")]
    HostMemory {
        /// Shared-memory object name (`/...`).
        name: String,
        /// The failing call (`shm_open`, `ftruncate`, `fstatvfs`, `fallocate`,
        /// `mmap`, `fstat`).
        op: &'static str,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The host's shared-memory filesystem ([`crate::SHM_DIR`], a tmpfs)
    /// cannot hold a new segment: its pages are reserved when it is created
    /// (`fallocate`), and that failed with `ENOSPC`. Nothing was left
    /// behind. (Unreserved, the segment would be created and the first write
    /// past the free space would kill the process with `SIGBUS`.)
    #[error(
        "`{field}`: {bytes} bytes of host shared memory do not fit in {dir} ({free}); \
         ask for less or enlarge {dir} (docker: --shm-size)",
        dir = crate::SHM_DIR,
        free = free_text(.free_bytes)
    )]
    ShmNoSpace {
        /// What asked for the bytes: `len` (one segment,
        /// [`crate::HostShmMemory::create`]), `budget_bytes` (a host bank,
        /// every rank together, [`crate::BankManager::new_host_shm`]),
        /// `lease` (a lease file).
        field: &'static str,
        /// Bytes asked for (for `budget_bytes`, every rank's segment; their
        /// lease files take a page each on top).
        bytes: u64,
        /// Bytes free there after the refusal (`statvfs`), `None` when that
        /// could not be read or the filesystem reports no size limit.
        free_bytes: Option<u64>,
    },
    /// A call that writes a bank's shared memory or renews its lease, made
    /// in another process than the one that created the bank: a forked
    /// child inherits the bank's mappings but not its ownership, and its
    /// copy of the slot table goes stale at once, so a store there would
    /// overwrite blocks the creator retains (and serves to targets).
    #[error(
        "`{op}` refused in process {pid}: the bank belongs to process {creator_pid} \
         (a forked child inherits the bank's memory, not its ownership); \
         open a bank of its own in this process"
    )]
    NotCreator {
        /// The refused call (`store`, `write_pending`, `renew_lease`, ...).
        op: &'static str,
        /// This process.
        pid: u32,
        /// The process that created the bank.
        creator_pid: u32,
    },
    /// No usable CUDA driver or device: GPU memory cannot be used here.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// Why (no `libcuda`, no device with that ordinal, ...).
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {reason}")]
    Cuda {
        /// Driver API call (`cuMemAlloc`, `cuIpcOpenMemHandle`, ...).
        op: &'static str,
        /// Driver error name and message.
        reason: String,
    },
    /// A memory region does not support the requested operation.
    #[error("memory of kind {kind} does not support {op}")]
    Unsupported {
        /// The operation (`write_bytes`, `export`, ...).
        op: &'static str,
        /// Memory kind as text.
        kind: String,
    },
    /// Byte range outside a memory region.
    #[error("range `{field}` [{offset}, {offset}+{len}) exceeds region of {region_len} bytes")]
    OutOfRange {
        /// Which range (`offset`, `slot`).
        field: &'static str,
        /// Start in bytes.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Region length in bytes.
        region_len: u64,
    },
    /// A descriptor could not be built or was invalid.
    #[error("descriptor: {0}")]
    Descriptor(#[from] DescriptorError),
    /// The bank's budget leaves no room: every other slot is pinned,
    /// pending (an open store), quarantined after a rollback, or holds the
    /// store's own prefix.
    #[error(
        "bank full: need {needed} slots, {available} free or evictable of {slot_count} \
         ({pinned} pinned, {pending} pending in open stores{})",
        quarantine_text(*.quarantined, .quarantine_release_ms)
    )]
    BankFull {
        /// Slots the store needs.
        needed: usize,
        /// Slots free or evictable now.
        available: usize,
        /// Total slots.
        slot_count: u32,
        /// Slots with at least one pin.
        pinned: usize,
        /// Slots of stores not yet acknowledged by every rank.
        pending: usize,
        /// Slots of rolled-back stores held back until a rank that may
        /// still be writing them can no longer land a copy (see
        /// [`crate::BankManager::fail`]; [`crate::BankManager::abort`]
        /// does not quarantine).
        quarantined: usize,
        /// Milliseconds until the first quarantined slots are released,
        /// `None` when none are.
        quarantine_release_ms: Option<u64>,
    },
    /// A block's sequence hash does not chain from its parent and token hash.
    #[error("`blocks[{index}].sequence_hash` {got:#018x} does not chain from its parent (expected {expected:#018x})")]
    BrokenChain {
        /// Index of the first bad block.
        index: usize,
        /// Hash given.
        got: u64,
        /// Hash computed from the parent and token hash.
        expected: u64,
    },
    /// A block is not retained (or not ready yet).
    #[error("block {0:?} is not retained and ready")]
    NotRetained(SequenceHash),
    /// A block in the multimodal exclusion lineage: never exported.
    #[error("block {0:?} depends on excluded multimodal input and is never exported")]
    Excluded(SequenceHash),
    /// A pending store id that does not exist (already ready, rolled back or never made).
    #[error("`store_id` {0} is not pending")]
    UnknownStore(u64),
    /// A rank number outside `0..tp_size`.
    #[error("`tp_rank` {rank} is not below tp_size {tp_size}")]
    BadRank {
        /// Rank given.
        rank: u32,
        /// TP size.
        tp_size: u32,
    },
    /// A pending store passed its deadline before every rank acknowledged
    /// (found by an ack or a write of the store); it was rolled back.
    #[error(
        "store {store_id} timed out: not acked by every rank within the store timeout of \
         {timeout_ms} ms ({waited_ms} ms since it began; ranks {missing:?} had not acked); \
         rolled back"
    )]
    StoreTimedOut {
        /// Store id.
        store_id: u64,
        /// The bank's store timeout (`BankConfig::store_timeout`), ms.
        timeout_ms: u64,
        /// Milliseconds since the store began.
        waited_ms: u64,
        /// Ranks that had not acknowledged.
        missing: Vec<u32>,
    },
    /// A rank acknowledged a pending store while some of its entries were
    /// never written (or their last write failed): acking them would publish
    /// whatever the slots held before (another block's bytes). The store stays
    /// pending: the rank may write the entries and ack again, or fail it; the
    /// store timeout rolls it back otherwise.
    #[error(
        "store {store_id}: `rank` {rank} acked with {missing} unwritten entries \
         (first `index` {first}); write them (write_pending / write_pending_from_device) \
         before acking, or fail the store"
    )]
    Unwritten {
        /// Store id.
        store_id: u64,
        /// Rank that acked.
        rank: u32,
        /// How many of the rank's entries are unwritten.
        missing: usize,
        /// Index (in the store's entries) of the first unwritten entry.
        first: usize,
    },
    /// A write to a pending store by a rank that already acked it: that
    /// rank's part is sealed, its bytes may not change under a block that is
    /// (or is about to be) ready.
    #[error(
        "store {store_id}: `rank` {rank} already acked, its entries are sealed \
         (write to `index` {index} refused)"
    )]
    RankAcked {
        /// Store id.
        store_id: u64,
        /// Rank that wrote after its ack.
        rank: u32,
        /// First entry index of the refused write.
        index: usize,
    },
    /// The bank is closing or closed: no new pins or stores.
    #[error("bank generation {generation} is closed")]
    Closed {
        /// Generation of the closed bank.
        generation: u64,
    },
    /// A request named another owner or a dead generation.
    #[error("`{field}` mismatch: request names {requested}, bank is {actual}")]
    StaleOwner {
        /// Field (`engine_id`, `bank_generation`, `layout_fingerprint`, `tp_size`).
        field: &'static str,
        /// Value in the request.
        requested: String,
        /// Value of this bank.
        actual: String,
    },
    /// A fetch request names a slot that does not hold the expected block.
    #[error("`parts[{rank}].slot_ids[{index}]` = {slot} does not hold block {expected:?}")]
    SlotMismatch {
        /// Rank part.
        rank: u32,
        /// Index in the slot list.
        index: usize,
        /// Slot id given.
        slot: u32,
        /// Block the request expects there.
        expected: SequenceHash,
    },
    /// Close waited for pins to drain and gave up.
    #[error("close timed out after {waited_ms} ms with {pins} pins outstanding; memory is freed when they drop")]
    CloseTimedOut {
        /// Pins still held.
        pins: usize,
        /// Milliseconds waited.
        waited_ms: u64,
    },
    /// A destination block, in range and listed once, that is not free: held
    /// by another fetch (reserved, orphaned, or completed and still held).
    /// Contention: the caller may fall back and retry later.
    #[error("destination block {block} is already reserved")]
    AlreadyReserved {
        /// Native block id.
        block: u32,
    },
    /// A destination block id at or above the pool's capacity: no such
    /// block exists. A caller bug (the engine's allocator), not contention.
    #[error("`blocks[{index}]` = {block} is not below the destination pool's capacity {capacity}")]
    BlockOutOfRange {
        /// Index of the id in the list given.
        index: usize,
        /// Block id given.
        block: u32,
        /// Blocks of the pool (ids `0..capacity`).
        capacity: u32,
    },
    /// A destination block id listed twice in one reservation request. A
    /// caller bug (one block cannot hold two fetched blocks), not contention.
    #[error("`blocks[{index}]` = {block} repeats `blocks[{first}]`")]
    DuplicateBlock {
        /// Index of the repeated id in the list given.
        index: usize,
        /// Block id given.
        block: u32,
        /// Index of its first occurrence.
        first: usize,
    },
    /// Not enough free destination blocks.
    #[error("destination pool has {free} free blocks, {needed} requested")]
    DestinationFull {
        /// Blocks requested.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A fetch request names a slot id at or above the bank's slot count.
    #[error("`parts[{rank}].slot_ids[{index}]` = {slot} is not below slot_count {slot_count}")]
    SlotOutOfRange {
        /// Rank part.
        rank: u32,
        /// Index in the slot list.
        index: usize,
        /// Slot id given.
        slot: u32,
        /// Slots of the bank.
        slot_count: u32,
    },
    /// A bank's owner lease passed its expiry without renewal: its owner is
    /// dead or stalled, and the bank may be reclaimed at any moment.
    #[error("lease `{lease}` expired at {expires_at_us} µs (boot clock), now {now_us} µs")]
    LeaseExpired {
        /// Lease name (`/...lease`).
        lease: String,
        /// Expiry, lease-clock µs ([`crate::LeaseInstant`]).
        expires_at_us: u64,
        /// The time it was checked at, lease-clock µs.
        now_us: u64,
    },
    /// A bank's lease was revoked (bank closed, or reclaimed).
    #[error("lease `{lease}` is revoked: the bank was closed or reclaimed")]
    LeaseRevoked {
        /// Lease name.
        lease: String,
    },
    /// No lease exists for a bank (never created, closed, or reclaimed).
    #[error("lease `{lease}` does not exist: the bank was closed or reclaimed, or never existed")]
    LeaseMissing {
        /// Lease name.
        lease: String,
    },
    /// A lease names another owner than the descriptor or hint does.
    #[error(
        "lease `{lease}`: `{field}` mismatch, request names {requested}, lease holds {actual}"
    )]
    LeaseMismatch {
        /// Lease name.
        lease: String,
        /// Field (`engine_id`, `bank_generation`, `role`, `tp_rank`).
        field: &'static str,
        /// Value in the request.
        requested: String,
        /// Value in the lease.
        actual: String,
    },
    /// A lease file is not a valid lease (short, not fully written, bad checksum).
    #[error("lease `{lease}` is invalid: {reason}")]
    LeaseInvalid {
        /// Lease name.
        lease: String,
        /// What is wrong.
        reason: String,
    },
    /// Owner side: the bank's lease cannot be renewed any more (it lapsed,
    /// was revoked or reclaimed); the bank generation is dead.
    #[error("lease `{lease}` lost: {reason}")]
    LeaseLost {
        /// Lease name(s).
        lease: String,
        /// Why.
        reason: String,
    },
    /// A child process of a cross-process check failed.
    #[error("child process: {0}")]
    Child(String),
}

/// The free-space part of [`BankError::ShmNoSpace`]'s message.
fn free_text(free: &Option<u64>) -> String {
    match free {
        Some(b) => format!("{b} bytes free"),
        None => "free space unknown".into(),
    }
}

/// The quarantine part of [`BankError::BankFull`]'s message: empty when no
/// slot is quarantined.
fn quarantine_text(quarantined: usize, release_ms: &Option<u64>) -> String {
    match (quarantined, release_ms) {
        (0, _) => String::new(),
        (n, Some(ms)) => format!(
            ", {n} quarantined after a rolled-back store (failed rank or store timeout) \
             until {ms} ms from now"
        ),
        (n, None) => format!(", {n} quarantined after a rolled-back store"),
    }
}

impl BankError {
    /// [`BankError::ShmNoSpace`] with its `free_bytes` read now (other
    /// errors unchanged): called once the refused object was removed, so the
    /// figure is what a smaller request could use.
    pub(crate) fn with_free_space(self) -> Self {
        match self {
            Self::ShmNoSpace { field, bytes, .. } => Self::ShmNoSpace {
                field,
                bytes,
                free_bytes: crate::shm::shm_free_bytes(),
            },
            other => other,
        }
    }

    pub(crate) fn arg(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }
}
