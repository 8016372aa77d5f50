//! Fault matrix of the serving path (issue #11): every fault is injected for
//! real into a fetch between a decode donor's retained bank and a prefill
//! target, and each run is checked, not assumed:
//!
//! - **fell back**: the fetch was refused or abandoned and the request
//!   recomputed its prompt;
//! - **correct outputs**: output tokens and first logits (bit for bit) equal
//!   the OFF run's (the same prompt computed from scratch);
//! - **no false completion**: the executor never reported a completed fetch;
//! - **destination untouched**: no fetched row reached the request's cache,
//!   every destination row is free again (none reserved or orphaned) and,
//!   for faults that strike before the first byte, the staging rows still
//!   hold their poison pattern byte for byte;
//! - **no leaks**: a [`kv_bank::leaks`] snapshot (file descriptors, this
//!   process's `/dev/shm/kv*` entries, shm and IPC mappings, device
//!   allocations, pins, reserved rows, leases, background threads) taken
//!   before the run's setup equals one taken after its teardown, and no
//!   `/dev/shm` entry of the run's unique name prefix survives (that also
//!   covers a child donor's segments).
//!
//! | fault | injected by | expected |
//! | --- | --- | --- |
//! | `donor_killed_mid_transfer` | SIGKILL of a child process owning the TP2 host-shm bank (the target pinned its slots through the child's pin service), from inside the rank-1 copy | liveness probe fails after the last byte; lease lapses; [`kv_bank::reclaim_stale`] removes its segments |
//! | `sigterm_during_transfer` | SIGTERM to that child from inside the rank-1 copy; it stops its pin service (the target's pin is dropped after a 100 ms drain), closes its bank (lease revoked, segments unlinked) and exits 0 | delivery refused (lease gone), nothing left in `/dev/shm` |
//! | `cancel_at_lookup` | the request's token fires the first time the donor lookup asks, inside its walk of the index | lookup stops (`NoDonorReason::Cancelled`), refused as `Cancelled`, no hint, nothing reserved |
//! | `cancel_at_reserve` | cancelled right after destination rows were reserved (when the donor is asked to pin) | refused before the first byte |
//! | `cancel_at_transfer` | cancelled from inside the rank-1 copy | refused after the parts |
//! | `cancel_at_verify` | cancelled after the last byte of the last part landed | refused by the final check |
//! | `deadline_passed` | 30 ms deadline, rank 1 stalls 60 ms | `DeadlineExceeded` |
//! | `rank_part_fails` | rank 1's part errors | whole delivery fails |
//! | `missing_keys` | the donor evicted the hinted blocks between advice and fetch | pin refused (slot holds another block) |
//! | `fetch_stale_generation` | the donor closed its bank and opened the next generation between advice and fetch | hint refused before memory (`StaleGeneration`) |
//! | `allocation_failure` | the target's destination pool cannot supply the rows | refused at `reserve` |
//! | `duplicated_events` | a `Stored` event delivered again after the blocks were removed | the duplicate is ignored: no hint for removed blocks |
//! | `reordered_events` | `Removed` delivered before the `Stored` it follows | gap: donor excluded until resync; the late `Stored` is ignored |
//! | `gapped_events` | one `Stored` event lost | gap: donor excluded (no hint) until resync, then the fetch completes |
//! | `nats_server_restart` | a real `nats-server` killed and restarted on the same port while the donor publishes | clients reconnect, the receiver's gap resync (or a full resync on `Lost`) restores the whole inventory, then the fetch completes |
//! | `link_cut_mid_transfer` | donor child in its own network namespace ([`crate::netns`]), read through NIXL with UCX over TCP on a veth pair; the link goes down when rank 1's part starts | after a control fetch over the link completes: `DeadlineExceeded`; the stalled reads stay in flight, so their rows stay orphaned until the link is back and the reads end, then return to the pool (see [`link_cut`]) |
//! | `none` (control) | nothing | the fetch completes: proves the checks can see a completion |
//!
//! For the event-plane rows (`*_events`, `nats_server_restart`) "fell back"
//! means the router did not trust the damaged inventory: while it was
//! damaged the request got no hint for blocks the donor does not hold and
//! recomputed (the row's `fallbacks`); each run also requires the repair to
//! work: the index equals the bank's inventory afterwards and a fetch then
//! completes correctly (the row's `fetches`, see [`Expected`]).
//!
//! GPU memory: the rows above move host shared memory on every profile; on
//! the GPU profile kvq adds the device rows of [`gpu`] (donor killed
//! mid-transfer over CUDA IPC, cancel, deadline, control), which move CUDA
//! device memory and also check device free bytes and IPC mappings.
//!
//! Runs are serialized by a process-wide lock, because leak snapshots are
//! process-wide.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use kv_bank::{
    check_descriptor_lease, sealed_blocks, BankConfig, BankManager, BankMemory, DestinationPool,
    LeaseConfig, StoreStatus,
};
use kv_descriptor::{
    BankManifest, EngineId, FetchGpuHint, FetchPart, HintEnvelope, KvEvent, KvLayout, OwnerLease,
    Role, SequenceHash, StorageTier, Wire,
};
use kv_lookup::{EventOutcome, InventoryIndex, WorkerKey};
use kv_router_glue::nats_server::{find_nats_server, NatsServer};
use kv_router_glue::{
    Advice, DonorPin, DonorSource, EventPlane, FetchExecutor, KvEventPublisher, KvEventReceiver,
    KvStreamItem, NatsOptions, NatsPlane, PinError, PublisherHeader, ReuseSettings, Subject,
};
use kv_transfer::plan::PartPlan;
use kv_transfer::{
    CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, PartOutcome, RankIo, TransferError,
};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::engines::{prompt_hashes, EngineError, Router};
use crate::model::{KvCache, ModelConfig, ModelError, ReferenceModel};
use crate::trace::splitmix64;

pub mod gpu;
pub use link_cut::{net_child_main, CUT_DEADLINE, NET_CHILD_ROLE, QUIESCE_WINDOW};

pub mod link_cut;
mod scenario;
use self::scenario::{
    conversation, generate, host_bank, retain, run_lock, shared_model, text, unique_prefix,
    Conversation, FaultRouter, Target,
};
mod injection;
use self::injection::{
    deadline_from_now, shm_entries, stall, Action, FaultBackend, HookedDonor, LeakProbe, Strike,
};
mod runners;
use self::runners::outcome;
pub use self::runners::run_fault;
mod nats_restart;
use self::nats_restart::nats_restart;
mod donor_child;
pub use self::donor_child::child_main;
use self::donor_child::{
    child_exit, child_fault, child_runtime, pid_alive, retained_hint_envelope, spawn_with_hello,
    terminate, wait_exit, wait_for_sigterm, ChildHello, HelloChild,
};
mod table;
use self::table::leak_note;
pub use self::table::{
    fault_rows, fault_table, fault_table_rows, fault_table_with, FaultTable, SkippedFault,
};
pub use self::table::{Expected, FaultRow, RunTally};
mod soak;
pub use self::soak::{soak, soak_with, SoakReport};

/// The `kvq child` role of the donor child process ([`child_main`]).
pub const CHILD_ROLE: &str = "fault-donor";

/// TP size of every scenario (two parts, so one can fail alone).
const TP: u32 = 2;
/// Output tokens per turn.
const OUTPUT_TOKENS: usize = 12;
/// Byte every staging row holds before a fetch (to prove rows untouched).
const POISON: u8 = 0xA5;
/// Lease of the child donor's bank: short, so a killed owner lapses fast.
const CHILD_LEASE_MS: u64 = 300;
/// A child never outlives this, even if the parent dies without killing it.
const CHILD_MAX_LIFE: Duration = Duration::from_secs(60);

/// Why a fault run could not be set up (a fallback is not an error).
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// Setting up the engines failed (model, bank or router): the same
    /// failures the engines report.
    #[error(transparent)]
    Setup(#[from] EngineError),
    /// The donor child process failed to start or to report.
    #[error("donor child: {0}")]
    Child(String),
    /// NATS setup failed (including a missing `nats-server` under `CI=true`).
    #[error("nats: {0}")]
    Nats(String),
    /// The fault cannot run here (e.g. no `nats-server` outside CI), with the reason.
    #[error("skipped: {0}")]
    Skipped(String),
}

impl From<ModelError> for FaultError {
    fn from(e: ModelError) -> Self {
        Self::Setup(EngineError::Model(e))
    }
}

fn bank_err(op: &'static str) -> impl Fn(kv_bank::BankError) -> FaultError {
    move |e| {
        FaultError::Setup(EngineError::Bank {
            op,
            reason: e.to_string(),
        })
    }
}

fn router_err(op: &'static str) -> impl Fn(String) -> FaultError {
    move |reason| FaultError::Setup(EngineError::Router { op, reason })
}

/// One injectable fault (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Control run: no fault; the fetch must complete.
    None,
    /// SIGKILL of the donor child process while rank 1 copies.
    DonorKilledMidTransfer,
    /// SIGTERM of the donor child process while rank 1 copies.
    SigtermDuringTransfer,
    /// Cancelled during donor lookup.
    CancelAtLookup,
    /// Cancelled once destination rows are reserved.
    CancelAtReserve,
    /// Cancelled while rank 1 copies.
    CancelAtTransfer,
    /// Cancelled after the last byte landed.
    CancelAtVerify,
    /// The delivery's deadline passes while rank 1 stalls.
    DeadlinePassed,
    /// Rank 1's part fails.
    RankPartFails,
    /// The donor evicted the hinted blocks.
    MissingKeys,
    /// The donor moved to its next bank generation.
    StaleBankGeneration,
    /// The destination pool is exhausted.
    AllocationFailure,
    /// A stale `Stored` event delivered twice.
    DuplicatedEvents,
    /// `Removed` delivered before the `Stored` it follows.
    ReorderedEvents,
    /// A `Stored` event lost.
    GappedEvents,
    /// The NATS server restarted mid-run.
    NatsServerRestart,
    /// The donor is another host (network namespace, NIXL over UCX/TCP) and
    /// the link is cut between the rank parts of a fetch.
    LinkCutMidTransfer,
}

impl Fault {
    /// Every fault of the matrix, control run last.
    pub const ALL: [Fault; 17] = [
        Fault::DonorKilledMidTransfer,
        Fault::SigtermDuringTransfer,
        Fault::CancelAtLookup,
        Fault::CancelAtReserve,
        Fault::CancelAtTransfer,
        Fault::CancelAtVerify,
        Fault::DeadlinePassed,
        Fault::RankPartFails,
        Fault::MissingKeys,
        Fault::StaleBankGeneration,
        Fault::AllocationFailure,
        Fault::DuplicatedEvents,
        Fault::ReorderedEvents,
        Fault::GappedEvents,
        Fault::NatsServerRestart,
        Fault::LinkCutMidTransfer,
        Fault::None,
    ];

    /// Faults that run in this process alone (no child, no server): the soak's pool.
    pub const IN_PROCESS: [Fault; 13] = [
        Fault::None,
        Fault::CancelAtLookup,
        Fault::CancelAtReserve,
        Fault::CancelAtTransfer,
        Fault::CancelAtVerify,
        Fault::DeadlinePassed,
        Fault::RankPartFails,
        Fault::MissingKeys,
        Fault::StaleBankGeneration,
        Fault::AllocationFailure,
        Fault::DuplicatedEvents,
        Fault::ReorderedEvents,
        Fault::GappedEvents,
    ];

    /// Row name in the fault table (`record.json` `faults[].fault`).
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::DonorKilledMidTransfer => "donor_killed_mid_transfer",
            Fault::SigtermDuringTransfer => "sigterm_during_transfer",
            Fault::CancelAtLookup => "cancel_at_lookup",
            Fault::CancelAtReserve => "cancel_at_reserve",
            Fault::CancelAtTransfer => "cancel_at_transfer",
            Fault::CancelAtVerify => "cancel_at_verify",
            Fault::DeadlinePassed => "deadline_passed",
            Fault::RankPartFails => "rank_part_fails",
            Fault::MissingKeys => "missing_keys",
            Fault::StaleBankGeneration => "fetch_stale_generation",
            Fault::AllocationFailure => "allocation_failure",
            Fault::DuplicatedEvents => "duplicated_events",
            Fault::ReorderedEvents => "reordered_events",
            Fault::GappedEvents => "gapped_events",
            Fault::NatsServerRestart => "nats_server_restart",
            Fault::LinkCutMidTransfer => "link_cut_mid_transfer",
        }
    }

    /// What its row requires of every run (see [`Expected`]).
    pub fn expected(self) -> Expected {
        match self {
            Fault::None => Expected::Fetch,
            Fault::DuplicatedEvents
            | Fault::ReorderedEvents
            | Fault::GappedEvents
            | Fault::NatsServerRestart => Expected::FallbackThenFetch,
            _ => Expected::Fallback,
        }
    }

    /// True when the fault needs a donor child process ([`ChildCommand`]).
    pub fn needs_child(self) -> bool {
        matches!(
            self,
            Fault::DonorKilledMidTransfer
                | Fault::SigtermDuringTransfer
                | Fault::LinkCutMidTransfer
        )
    }

    /// True when no payload byte may have been written to the staging rows.
    fn strikes_before_first_byte(self) -> bool {
        matches!(
            self,
            Fault::CancelAtLookup
                | Fault::CancelAtReserve
                | Fault::MissingKeys
                | Fault::StaleBankGeneration
                | Fault::AllocationFailure
        )
    }
}

/// How to start the donor child: `exe args... <role args>` must reach
/// [`child_main`] (kvq: `kvq child fault-donor ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildCommand {
    /// Executable.
    pub exe: PathBuf,
    /// Arguments placed before the role's own arguments.
    pub args: Vec<String>,
}

impl ChildCommand {
    /// `exe child fault-donor` (the kvq convention).
    pub fn kvq(exe: impl Into<PathBuf>) -> Self {
        Self {
            exe: exe.into(),
            args: vec!["child".into(), CHILD_ROLE.into()],
        }
    }
    /// [`ChildCommand::kvq`] of the running executable (call it from kvq).
    pub fn current_kvq() -> Self {
        Self::kvq(std::env::current_exe().unwrap_or_else(|_| PathBuf::from("kvq")))
    }

    /// [`ChildCommand::args`] with the donor role ([`CHILD_ROLE`]) replaced
    /// by `role` (e.g. [`NET_CHILD_ROLE`]); appended when absent.
    pub fn args_for_role(&self, role: &str) -> Vec<String> {
        let mut args = self.args.clone();
        match args.iter_mut().find(|a| *a == CHILD_ROLE) {
            Some(a) => *a = role.to_string(),
            None => args.push(role.to_string()),
        }
        args
    }
}

/// What one injected run observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunOutcome {
    /// The fault.
    pub fault: Fault,
    /// The request recomputed instead of using fetched blocks (for event
    /// faults: got no hint while the inventory was damaged).
    pub fell_back: bool,
    /// The executor reported a completed fetch (for event faults: while the
    /// inventory was damaged, which is a false completion).
    pub completed: bool,
    /// The fetch the row expects completed ([`Expected::Fetch`]: the control
    /// run's fetch; [`Expected::FallbackThenFetch`]: the fetch after the
    /// repair, which needs the index to equal the bank's inventory again).
    pub fetched: bool,
    /// Output tokens and first logits equal the OFF run's.
    pub outputs_match: bool,
    /// Destination rows free, nothing imported, poison intact where required.
    pub destination_untouched: bool,
    /// Leaked resources (`resource: before -> after`).
    pub leaks: Vec<String>,
    /// Fallback reason or what went wrong.
    pub detail: String,
}

impl RunOutcome {
    /// The run as its table row counts it: a fallback counts with correct
    /// outputs and the destination untouched, a fetch with correct outputs.
    pub fn tally(&self) -> RunTally {
        RunTally {
            fetched: self.fetched && self.outputs_match,
            fell_back: self.fell_back
                && !self.completed
                && self.destination_untouched
                && self.outputs_match,
            false_completion: self.completed && self.fault.expected() != Expected::Fetch,
            leaks: self.leaks.len() as u32,
        }
    }

    /// The run ended as its fault requires ([`Fault::expected`]): fallback,
    /// fetch, or both, with correct outputs, the destination untouched on
    /// fallback, no false completion and nothing leaked.
    pub fn passed(&self) -> bool {
        self.tally().is(self.fault.expected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_names_are_unique_and_the_soak_pool_needs_no_child() {
        let mut names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Fault::ALL.len());
        assert!(Fault::IN_PROCESS.iter().all(|f| Fault::ALL.contains(f)));
        assert!(!Fault::IN_PROCESS.iter().any(|f| f.needs_child()));
        assert!(!Fault::IN_PROCESS.contains(&Fault::NatsServerRestart));
        let with_child: Vec<Fault> = Fault::ALL
            .iter()
            .copied()
            .filter(|f| f.needs_child())
            .collect();
        assert_eq!(
            with_child,
            [
                Fault::DonorKilledMidTransfer,
                Fault::SigtermDuringTransfer,
                Fault::LinkCutMidTransfer
            ],
            "killed, SIGTERMed and network-cut donor"
        );
    }

    #[test]
    fn passed_requires_the_expected_end_and_no_leak() {
        let fallback = RunOutcome {
            fault: Fault::RankPartFails,
            fell_back: true,
            completed: false,
            fetched: false,
            outputs_match: true,
            destination_untouched: true,
            leaks: Vec::new(),
            detail: String::new(),
        };
        assert!(fallback.passed());
        let completed = RunOutcome {
            fell_back: false,
            completed: true,
            fetched: true,
            ..fallback.clone()
        };
        assert!(!completed.passed(), "a completion under a fault is false");
        assert!(RunOutcome {
            fault: Fault::None,
            ..completed.clone()
        }
        .passed());
        assert!(!RunOutcome {
            leaks: vec!["pins: 0 -> 1".into()],
            ..fallback.clone()
        }
        .passed());
        assert!(!RunOutcome {
            outputs_match: false,
            ..fallback.clone()
        }
        .passed());
        assert!(!RunOutcome {
            destination_untouched: false,
            ..fallback
        }
        .passed());
    }

    #[test]
    fn pid_alive_tells_a_running_process_from_a_reaped_one() {
        assert!(pid_alive(std::process::id()));
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn unique_prefixes_differ_and_parse_as_bank_prefixes() {
        let (a, b) = (unique_prefix(), unique_prefix());
        assert_ne!(a, b);
        assert!(a.starts_with("kvfault") && !a.contains('-') && !a.contains('/'));
    }
}
