//! Error types of this crate, one enum per concern.

/// Why settings were refused. Every variant names the offending key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    /// A key that no registered setting has.
    #[error("unknown setting `{key}` (from {origin})")]
    UnknownKey {
        /// Key as written.
        key: String,
        /// Layer (`cli`, `json`, file name, env variable).
        origin: String,
    },
    /// A key (or mode) that was removed.
    #[error("setting `{key}` was removed: {reason}")]
    Removed {
        /// Removed key.
        key: String,
        /// What to use instead.
        reason: &'static str,
    },
    /// A value of the wrong type or syntax.
    #[error("invalid value {value:?} for `{key}`: expected {expected}")]
    InvalidValue {
        /// Setting key.
        key: &'static str,
        /// Value as written.
        value: String,
        /// Type and range expected.
        expected: String,
    },
    /// A value outside the allowed range (NaN and infinities included).
    #[error("`{key}` = {value} is out of range {range}")]
    OutOfRange {
        /// Setting key.
        key: &'static str,
        /// Value seen.
        value: String,
        /// Allowed range.
        range: String,
    },
    /// A flag without its value.
    #[error("flag for `{key}` needs a value")]
    MissingValue {
        /// Setting key.
        key: &'static str,
    },
    /// A CLI token that is not `--flag`.
    #[error("unexpected argument {arg:?}: settings flags start with `--`")]
    UnexpectedArgument {
        /// The token.
        arg: String,
    },
    /// Values that are individually valid but contradict each other.
    #[error("`{key}` {reason}")]
    Inconsistent {
        /// Key whose value is refused.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// Settings the cost model cannot use, whether it is being built or
    /// retuned live (the message says neither: it reaches operators through
    /// the router binary and Python, where both happen).
    #[error("unusable setting `{key}` {reason}")]
    Unusable {
        /// Key whose value makes the model unusable.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// An argument given next to the settings (not a setting key) is out
    /// of its range, e.g. the cost model's `tokens_per_block`.
    #[error("invalid `{argument}`: {reason}")]
    InvalidArgument {
        /// Argument name, as the constructor and its callers spell it.
        argument: &'static str,
        /// The value seen and the range allowed.
        reason: String,
    },
    /// A settings file could not be read.
    #[error("cannot read settings file {path}: {reason}")]
    Io {
        /// File path.
        path: String,
        /// OS error.
        reason: String,
    },
    /// A setting of a file refused ([`SettingsError::InvalidValue`],
    /// [`SettingsError::OutOfRange`], [`SettingsError::Removed`]), naming
    /// the file: environment variables and flags layer over it, so the
    /// key alone does not say where to fix the value.
    #[error("{error} (from {file})")]
    InFile {
        /// File name, as given.
        file: String,
        /// The refusal.
        error: Box<SettingsError>,
    },
    /// TOML syntax error or nested table.
    #[error("invalid TOML in {file}: {reason}")]
    Toml {
        /// File name.
        file: String,
        /// Parser message.
        reason: String,
    },
    /// Malformed JSON.
    #[error("invalid settings JSON: {reason}")]
    Json {
        /// Parser message.
        reason: String,
    },
}

impl SettingsError {
    /// The refusal itself, without the file [`SettingsError::InFile`]
    /// names (any other error is its own root).
    ///
    /// ```
    /// use kv_router_glue::{SettingsError, SettingsLoader};
    /// let e = SettingsLoader::new()
    ///     .toml_str("minimum_transfer_prefix_blocks = -1", "s3.toml")
    ///     .unwrap_err();
    /// assert!(e.to_string().ends_with("(from s3.toml)"), "{e}");
    /// assert!(matches!(e.root(), SettingsError::OutOfRange { .. }));
    /// ```
    pub fn root(&self) -> &SettingsError {
        match self {
            SettingsError::InFile { error, .. } => error.root(),
            other => other,
        }
    }
}

/// Why calibration could not fit a model (a fit that shows no gain is not an
/// error: it is a [`crate::CalibrationVerdict::KeepOff`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    /// Fewer samples than the model needs for an uncertainty estimate.
    #[error("`samples`: {got} samples, need at least {need} (parameters + 2)")]
    TooFewSamples {
        /// Samples given.
        got: usize,
        /// Samples needed.
        need: usize,
    },
    /// A sample with a non-finite or negative measurement.
    #[error("`samples[{index}].{field}` is not a finite non-negative number: {value}")]
    BadSample {
        /// Sample index.
        index: usize,
        /// Field name.
        field: &'static str,
        /// Value seen.
        value: f64,
    },
    /// Inputs of mismatched shape (a row without one value per column, or
    /// responses not one per row).
    #[error("`{field}`{}: {got} values, expected {want}", index.map(|i| format!("[{i}]")).unwrap_or_default())]
    Shape {
        /// `rows` or `y`.
        field: &'static str,
        /// Row index, for `rows`.
        index: Option<usize>,
        /// Length seen.
        got: usize,
        /// Length expected.
        want: usize,
    },
    /// The design matrix is singular (e.g. every sample has the same block count).
    #[error("`samples`: design is singular in `{column}` (vary it across samples)")]
    Singular {
        /// Column that is constant or collinear.
        column: &'static str,
    },
}

/// Why an event plane operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaneError {
    /// A subject token that is empty or holds `.`, `*`, `>` or whitespace.
    #[error("invalid subject `{field}` token {value:?}: must be non-empty without '.', '*', '>' or whitespace")]
    InvalidSubject {
        /// `namespace`, `component` or `topic`.
        field: &'static str,
        /// Token seen.
        value: String,
    },
    /// A JetStream key-value bucket name NATS would refuse (checked before
    /// any request, so the error names the bucket, not the connection).
    #[error("invalid key-value bucket name {bucket:?}: {reason}")]
    InvalidBucket {
        /// Name seen.
        bucket: String,
        /// Why ([`crate::bucket_name_problem`]).
        reason: &'static str,
    },
    /// The key-value bucket does not exist and the caller asked not to
    /// create it ([`crate::NatsDirectory::open_existing`], feature `nats`):
    /// a reader's mistyped name, or nothing (no donor, no router) created
    /// the bucket yet.
    #[error("key-value bucket {bucket:?} does not exist on the server")]
    NoSuchBucket {
        /// Name seen.
        bucket: String,
    },
    /// Connected to the NATS server, but the key-value bucket could be
    /// neither opened nor created (feature `nats`): most often a server
    /// without JetStream (`reason` then starts with what to change), else a
    /// JetStream timeout (on a bare client, a missing permission, which
    /// `reason` then says: [`PlaneError::BucketCreateRefused`] where the
    /// refusal is seen). Distinct from
    /// [`PlaneError::Connect`] so that a message never says "cannot connect"
    /// to a server the client did reach.
    #[error("NATS at {url} is reachable, but key-value bucket `{bucket}` cannot be opened or created: {reason}")]
    BucketUnavailable {
        /// Server URL (a password or token replaced by `***`).
        url: String,
        /// Bucket name.
        bucket: String,
        /// Why, with the JetStream hint first when it applies.
        reason: String,
    },
    /// The key-value bucket is absent and the server refused this
    /// connection's request to create it for want of a permission (feature
    /// `nats`): it sent `-ERR 'Permissions Violation for Publish to
    /// "<subject>"'` (`server`), and the request, which it dropped, would
    /// only have timed out. Reported as soon as the refusal arrives.
    #[error("NATS at {url} refused to create key-value bucket `{bucket}`, which is absent: this connection's user may not publish to `{subject}` (server: {server}); allow it that subject, or create the bucket as an operator (`nats kv add {bucket}`)")]
    BucketCreateRefused {
        /// Server URL (a password or token replaced by `***`).
        url: String,
        /// Bucket name.
        bucket: String,
        /// The subject refused: `$JS.API.STREAM.CREATE.KV_<bucket>`, or
        /// `$JS.API.INFO`, asked first.
        subject: String,
        /// The server's error text.
        server: String,
    },
    /// Connecting to the NATS server failed.
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect {
        /// Server URL.
        url: String,
        /// Client message.
        reason: String,
    },
    /// Publishing failed.
    #[error("publish on `{subject}` failed: {reason}")]
    Publish {
        /// Subject.
        subject: String,
        /// Client message.
        reason: String,
    },
    /// Subscribing failed.
    #[error("subscribe to `{subject}` failed: {reason}")]
    Subscribe {
        /// Subject.
        subject: String,
        /// Client message.
        reason: String,
    },
    /// The readiness barrier timed out before enough subscribers answered.
    #[error("readiness barrier on `{subject}`: {ready} of {wanted} subscribers ready after {waited_ms} ms")]
    NotReady {
        /// Subject.
        subject: String,
        /// Subscribers that answered.
        ready: usize,
        /// Subscribers wanted.
        wanted: usize,
        /// Time waited, in ms.
        waited_ms: u64,
    },
    /// A message could not be encoded or decoded.
    #[error("cannot encode/decode `{what}`: {reason}")]
    Codec {
        /// Message type.
        what: &'static str,
        /// Codec message.
        reason: String,
    },
    /// The plane was closed.
    #[error("event plane closed")]
    Closed,
    /// A TTL below nats-server's floor for a key-value bucket's `max_age`
    /// (`NATS_MIN_MAX_AGE`, 100 ms, feature `nats`): the server would
    /// refuse to create the bucket. Refused before any request.
    #[error(
        "`{field}` {ttl:?} is below nats-server's {floor:?} floor for a key-value bucket's max_age"
    )]
    TtlBelowFloor {
        /// The argument (`lease_ttl`).
        field: &'static str,
        /// The TTL given.
        ttl: std::time::Duration,
        /// The floor (`NATS_MIN_MAX_AGE`).
        floor: std::time::Duration,
    },
}

/// Why a fetch hint was refused, the caller's destination blocks were
/// refused, or a fetch fell back. Hint errors and the caller's argument
/// errors ([`FetchError::is_argument_error`]) are raised before any memory
/// is reserved or read.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The hint is internally inconsistent (field named by the descriptor error).
    #[error("malformed hint: {0}")]
    Malformed(#[from] kv_descriptor::DescriptorError),
    /// The hint names another engine incarnation than the manifest.
    #[error("stale hint: `hint.donor_engine_id` {hint} but the donor bank belongs to {manifest}")]
    WrongEngine {
        /// Engine in the hint.
        hint: String,
        /// Engine owning the manifest.
        manifest: String,
    },
    /// The hint names another bank generation (closed or not yet opened).
    #[error(
        "stale hint: `hint.bank_generation` {hint} but the donor bank is generation {manifest}"
    )]
    StaleGeneration {
        /// Generation in the hint.
        hint: u64,
        /// Generation of the manifest.
        manifest: u64,
    },
    /// The donor bank is not a decode worker's.
    #[error("`manifest.owner.role` is {role}: a donor must be a decode worker")]
    NotADonor {
        /// Role found.
        role: String,
    },
    /// Layout or TP mismatch between hint, donor and target.
    #[error("layout mismatch in `{field}`: {detail}")]
    LayoutMismatch {
        /// `hint.layout_fingerprint` or `hint.tp_size`.
        field: &'static str,
        /// Values compared.
        detail: String,
    },
    /// A slot id at or beyond the donor's slot count.
    #[error("`hint.parts[{rank}].slot_ids` holds slot {slot}, donor has {slot_count} slots")]
    SlotOutOfRange {
        /// TP rank.
        rank: u32,
        /// Offending slot id.
        slot: u32,
        /// Donor slot count.
        slot_count: u32,
    },
    /// Ranks disagree on slot ids, or a slot repeats.
    #[error("`hint.parts[{rank}].slot_ids`: {detail}")]
    InconsistentSlots {
        /// TP rank.
        rank: u32,
        /// What is wrong.
        detail: String,
    },
    /// The hint's `sequence_hashes` differ from the prompt's at `block`
    /// (the first differing index): it was written for another prompt.
    #[error("`hint.sequence_hashes[{block}]` differs from the prompt's block {block}: the hint is for another prompt")]
    PromptMismatch {
        /// First block index where hint and prompt differ.
        block: usize,
    },
    /// The hint names more blocks than the prompt has.
    #[error("`hint.sequence_hashes` holds {hint_blocks} blocks, the prompt only {prompt_blocks}")]
    HintBeyondPrompt {
        /// Blocks in the hint.
        hint_blocks: usize,
        /// Sealed blocks of the prompt.
        prompt_blocks: usize,
    },
    /// `dst_blocks` ([`crate::FetchExecutor::execute_at`]) does not hold one
    /// block id per fetched block. A caller bug (the engine's allocator),
    /// refused before the pool or the donor is touched; not a fallback.
    #[error("`dst_blocks` holds {given} block ids, the hint fetches {fetched} blocks (from block {fetch_from})")]
    DstBlocksCount {
        /// Ids given.
        given: usize,
        /// Blocks the hint fetches (`sequence_hashes` from `fetch_from` on).
        fetched: usize,
        /// The hint's `fetch_from`.
        fetch_from: u32,
    },
    /// An id of `dst_blocks` at or above the executor's destination blocks
    /// (its pool's capacity). A caller bug, refused before the pool or the
    /// donor is touched; not a fallback.
    #[error("`dst_blocks[{index}]` = {block} is not below the destination's {capacity} blocks")]
    DstBlockOutOfRange {
        /// Index in `dst_blocks`.
        index: usize,
        /// Block id given.
        block: u32,
        /// Destination blocks (ids `0..capacity`).
        capacity: u32,
    },
    /// An id of `dst_blocks` listed twice. A caller bug, refused before the
    /// pool or the donor is touched; not a fallback.
    #[error("`dst_blocks[{index}]` = {block} repeats `dst_blocks[{first}]`")]
    DstBlockRepeated {
        /// Index in `dst_blocks` of the repeat.
        index: usize,
        /// Block id given.
        block: u32,
        /// Index of its first occurrence.
        first: usize,
    },
    /// The transfer or a step around it failed; the request recomputes.
    #[error("fetch fell back at `{stage}`: {cause}")]
    Fallback {
        /// Stage (`reserve`, `pin`, `plan`, `transfer`, `verify`).
        stage: &'static str,
        /// What failed, typed ([`FallbackCause::label`] is its metrics label).
        cause: FallbackCause,
    },
}

impl FetchError {
    /// The stage label of `kv_reuse_fallbacks_total`: `hint` for a hint
    /// refused before anything was touched, `argument` for the caller's
    /// `dst_blocks` refused ([`FetchError::is_argument_error`]), else the
    /// failing stage (`reserve`, `pin`, `plan`, `transfer`, `verify`).
    pub fn stage(&self) -> &'static str {
        match self {
            Self::Fallback { stage, .. } => stage,
            _ if self.is_argument_error() => "argument",
            _ => "hint",
        }
    }

    /// True for the caller's own mistakes ([`FetchError::DstBlocksCount`],
    /// [`FetchError::DstBlockOutOfRange`], [`FetchError::DstBlockRepeated`]):
    /// a bug to report, not a hint refusal or a fallback to recompute quietly.
    pub fn is_argument_error(&self) -> bool {
        matches!(
            self,
            Self::DstBlocksCount { .. }
                | Self::DstBlockOutOfRange { .. }
                | Self::DstBlockRepeated { .. }
        )
    }

    /// The cause label of `kv_reuse_fallbacks_total`: one stable
    /// `snake_case` value per hint-error variant (`malformed`,
    /// `wrong_engine`, `stale_generation`, `not_a_donor`, `layout_mismatch`,
    /// `slot_out_of_range`, `inconsistent_slots`, `prompt_mismatch`,
    /// `hint_beyond_prompt`; `dst_blocks_count`, `dst_block_out_of_range`,
    /// `dst_block_repeated` for the argument errors), else
    /// [`FallbackCause::label`].
    pub fn cause_label(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "malformed",
            Self::WrongEngine { .. } => "wrong_engine",
            Self::StaleGeneration { .. } => "stale_generation",
            Self::NotADonor { .. } => "not_a_donor",
            Self::LayoutMismatch { .. } => "layout_mismatch",
            Self::SlotOutOfRange { .. } => "slot_out_of_range",
            Self::InconsistentSlots { .. } => "inconsistent_slots",
            Self::PromptMismatch { .. } => "prompt_mismatch",
            Self::HintBeyondPrompt { .. } => "hint_beyond_prompt",
            Self::DstBlocksCount { .. } => "dst_blocks_count",
            Self::DstBlockOutOfRange { .. } => "dst_block_out_of_range",
            Self::DstBlockRepeated { .. } => "dst_block_repeated",
            Self::Fallback { cause, .. } => cause.label(),
        }
    }

    /// The cause of a [`FetchError::Fallback`], `None` for a hint error.
    pub fn fallback_cause(&self) -> Option<&FallbackCause> {
        match self {
            Self::Fallback { cause, .. } => Some(cause),
            _ => None,
        }
    }
}

/// What made a validated fetch fall back to recompute. The destination
/// reservation was cancelled and the donor pin released in every case.
#[derive(Debug, thiserror::Error)]
pub enum FallbackCause {
    /// The destination pool refused the reservation (stage `reserve`).
    #[error("{0}")]
    Bank(#[source] kv_bank::BankError),
    /// The copy plan was refused (stage `plan`) or the delivery failed
    /// (stage `transfer`).
    #[error("{0}")]
    Transfer(#[source] kv_transfer::TransferError),
    /// The donor did not pin the hinted slots (stage `pin`).
    #[error("{0}")]
    Pin(#[source] PinError),
    /// The donor pin did not hold from grant to release, so the slots may
    /// have been reused while read (stage `verify`).
    #[error("donor pin not held throughout: {0}")]
    PinNotHeld(#[source] PinError),
    /// The pin gave no source memory for a TP rank the plan reads (stage `pin`).
    #[error("donor pin has no memory for rank {rank}")]
    MissingRankMemory {
        /// TP rank.
        rank: u32,
    },
    /// The delivery returned without moving every expected byte (stage `verify`).
    #[error("delivery {status:?} moved {moved} of {expected} bytes")]
    ShortDelivery {
        /// The delivery's status.
        status: kv_transfer::DeliveryStatus,
        /// Payload bytes moved.
        moved: u64,
        /// Payload bytes the validated hint names (all ranks).
        expected: u64,
    },
    /// The received bytes are not the donor's blocks, or cannot be shown
    /// to be (stage `verify`): checked against the pin grant's block
    /// checksums, which a read by address (NIXL) asks for.
    #[error("{0}")]
    BlockChecksum(#[source] crate::BlockChecksumError),
}

impl FallbackCause {
    /// Stable `snake_case` metrics label: `bank`, `transfer_cancelled`,
    /// `transfer_deadline`, `transfer` (any other transfer error), the
    /// [`PinError::label`] of a pin refusal or failure, `pin_not_held`,
    /// `missing_rank_memory`, `short_delivery`, `block_checksum`.
    pub fn label(&self) -> &'static str {
        use kv_transfer::TransferError as T;
        match self {
            Self::Bank(_) => "bank",
            Self::Transfer(T::Cancelled) => "transfer_cancelled",
            Self::Transfer(T::DeadlineExceeded { .. }) => "transfer_deadline",
            Self::Transfer(_) => "transfer",
            Self::Pin(p) => p.label(),
            Self::PinNotHeld(_) => "pin_not_held",
            Self::MissingRankMemory { .. } => "missing_rank_memory",
            Self::ShortDelivery { .. } => "short_delivery",
            Self::BlockChecksum(_) => "block_checksum",
        }
    }

    /// Whether an abandoned read may still write the destination rows
    /// ([`kv_transfer::TransferError::may_still_write`]); only a transfer
    /// error can say so.
    pub fn may_still_write(&self) -> bool {
        matches!(self, Self::Transfer(e) if e.may_still_write())
    }
}

/// Why a donor did not pin ([`crate::DonorSource::pin`]) or a pin cannot be
/// trusted to have held ([`crate::DonorPin::release`]). Nothing is pinned
/// after an error.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// The donor's pin service refused (`kv.pin@1.0` refusal, reason as on the wire).
    #[error("refused ({reason}): {detail}")]
    Refused {
        /// The refusal's reason.
        reason: kv_descriptor::PinRefusalReason,
        /// The donor's detail text.
        detail: String,
    },
    /// An in-process donor bank refused the pin ([`kv_bank::BankManager::pin_hint`]).
    #[error("{0}")]
    Bank(#[source] kv_bank::BankError),
    /// The source knows the donor process or its lease is gone, so it did not ask.
    #[error("donor unavailable: {detail}")]
    DonorUnavailable {
        /// What the source saw.
        detail: String,
    },
    /// The control endpoint is not a usable `unix:<path>` or `tcp:<host>:<port>`.
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong.
        reason: String,
    },
    /// Connecting, sending or receiving failed (`op` says which).
    #[error("{op}: {source}")]
    Io {
        /// `connect`, `send`, `receive` or `release`.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The donor did not answer within the reply timeout.
    #[error("{op}: no reply within {timeout_ms} ms")]
    Timeout {
        /// `receive` (a pin reply) or `release` (its acknowledgement).
        op: &'static str,
        /// The timeout, ms.
        timeout_ms: u64,
    },
    /// The donor's reply did not decode or was not the expected message.
    #[error("protocol: {detail}")]
    Protocol {
        /// What was received instead.
        detail: String,
    },
    /// The donor dropped the pin at its hold bound before the release: the
    /// slots may have been reused while read.
    #[error("pin {pin_id} expired at the donor's bound of {max_hold_ms} ms before release")]
    Expired {
        /// The pin.
        pin_id: u64,
        /// The grant's hold bound, ms.
        max_hold_ms: u64,
    },
    /// The pin was already released.
    #[error("already released")]
    AlreadyReleased,
    /// A TCP pin endpoint's key exchange failed or no key is configured
    /// (nothing was pinned; see [`crate::PinAuthKey`]).
    #[cfg(feature = "worker")]
    #[error("{0}")]
    Auth(#[source] crate::PinAuthError),
}

impl PinError {
    /// The [`kv_descriptor::PinRefusalReason`] of a refusal (a donor's, or
    /// an in-process bank error mapped as the pin service maps it); `None`
    /// for transport, timeout and protocol failures.
    pub fn refusal_reason(&self) -> Option<kv_descriptor::PinRefusalReason> {
        match self {
            Self::Refused { reason, .. } => Some(*reason),
            Self::Bank(e) => Some(bank_refusal_reason(e)),
            _ => None,
        }
    }

    /// Stable `snake_case` metrics label: `pin_refused` (a donor or bank
    /// refusal), `pin_donor_unavailable`, `pin_transport` (endpoint, I/O),
    /// `pin_timeout`, `pin_protocol`, `pin_expired`, `pin_released`, `pin_auth`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Refused { .. } | Self::Bank(_) => "pin_refused",
            Self::DonorUnavailable { .. } => "pin_donor_unavailable",
            Self::Endpoint { .. } | Self::Io { .. } => "pin_transport",
            #[cfg(feature = "worker")]
            Self::Auth(_) => "pin_auth",
            Self::Timeout { .. } => "pin_timeout",
            Self::Protocol { .. } => "pin_protocol",
            Self::Expired { .. } => "pin_expired",
            Self::AlreadyReleased => "pin_released",
        }
    }

    /// An I/O error of `op`, as [`PinError::Timeout`] when the socket's
    /// timeout (`timeout`) elapsed.
    #[cfg(feature = "worker")]
    pub(crate) fn io(
        op: &'static str,
        source: std::io::Error,
        timeout: std::time::Duration,
    ) -> Self {
        match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Self::Timeout {
                op,
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            },
            _ => Self::Io { op, source },
        }
    }
}

/// Why a [`crate::DonorDirectory`] could not resolve a donor's slots; the
/// advisor then attaches no hint ([`crate::RefuseReason::HintUnavailable`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The directory does not know the donor (it closed its bank or died).
    #[error("donor {donor} is not in the directory")]
    UnknownDonor {
        /// The donor engine.
        donor: kv_descriptor::EngineId,
    },
    /// The donor no longer holds block `index` of the asked hashes.
    #[error("donor no longer holds block {index} ({hash:?})")]
    BlockGone {
        /// Index into the asked hashes.
        index: usize,
        /// Its sequence hash.
        hash: kv_descriptor::SequenceHash,
    },
    /// The donor's directory lease expired: its entry is never used (the
    /// donor may be dead or partitioned; its bank may be gone).
    #[error("donor {donor}'s lease expired at {expired_unix_ms} ms (now {now_unix_ms} ms)")]
    LeaseLapsed {
        /// The donor engine.
        donor: kv_descriptor::EngineId,
        /// Lease expiry, Unix epoch ms.
        expired_unix_ms: u64,
        /// The reader's clock, Unix epoch ms.
        now_unix_ms: u64,
    },
    /// A record of an older bank generation than one already seen.
    #[error(
        "donor {donor} generation {generation} is older than generation {newest_seen} already seen"
    )]
    StaleGeneration {
        /// The donor engine.
        donor: kv_descriptor::EngineId,
        /// Generation of the refused record.
        generation: u64,
        /// Newest generation seen for the engine.
        newest_seen: u64,
    },
    /// A directory entry that is not a valid donor record.
    #[error("directory entry `{key}` refused: {reason}")]
    InvalidRecord {
        /// The directory key.
        key: String,
        /// Why, naming the field.
        reason: String,
    },
    /// The directory could not reach its source of truth (a remote directory).
    #[error("directory unavailable: {detail}")]
    Unavailable {
        /// What failed.
        detail: String,
    },
}

/// Why a [`crate::RemoteDonor`] could not be built. Nothing was pinned or
/// read: every check runs before the donor is contacted.
#[derive(Debug, thiserror::Error)]
pub enum RemoteDonorError {
    /// The control endpoint is not `unix:<path>` / `tcp:<host>:<port>`.
    #[cfg(feature = "worker")]
    #[error("invalid `endpoint`: {0}")]
    Endpoint(#[source] crate::PinEndpointError),
    /// Not one mapping per TP rank of the manifest.
    #[error("`maps`: {got} rank memories for a TP{tp_size} manifest")]
    MapCount {
        /// Mappings given.
        got: usize,
        /// The manifest's TP size.
        tp_size: u32,
    },
    /// Mapping `maps[rank]` is not the memory of the manifest's rank `rank`
    /// part: `field` is `export` (it maps another allocation, or has no
    /// export identity), `kind` (host vs device) or `len` (shorter than the
    /// part's region).
    #[error("`maps[{rank}].{field}`: {detail}")]
    MappingMismatch {
        /// TP rank (index into `maps` and the manifest's parts).
        rank: u32,
        /// `export`, `kind` or `len`.
        field: &'static str,
        /// Values compared.
        detail: String,
    },
    /// Rank `rank`'s donor memory could not be mapped in this process
    /// (lease not live, segment or handle gone, no CUDA driver).
    #[error("rank {rank}: cannot map the donor's memory: {source}")]
    Import {
        /// TP rank.
        rank: u32,
        /// The import's error.
        #[source]
        source: kv_bank::BankError,
    },
}

/// The protocol's reason for one of `pin_hint`'s errors (also
/// [`PinError::refusal_reason`] of an in-process pin).
pub(crate) fn bank_refusal_reason(e: &kv_bank::BankError) -> kv_descriptor::PinRefusalReason {
    match e {
        kv_bank::BankError::StaleOwner { field, .. }
            if *field == "layout_fingerprint" || *field == "tp_size" =>
        {
            kv_descriptor::PinRefusalReason::Incompatible
        }
        kv_bank::BankError::StaleOwner { .. } => kv_descriptor::PinRefusalReason::StaleGeneration,
        kv_bank::BankError::SlotMismatch { .. }
        | kv_bank::BankError::SlotOutOfRange { .. }
        | kv_bank::BankError::NotRetained(_)
        | kv_bank::BankError::Excluded(_) => kv_descriptor::PinRefusalReason::SlotReused,
        kv_bank::BankError::Closed { .. }
        | kv_bank::BankError::LeaseExpired { .. }
        | kv_bank::BankError::LeaseLost { .. }
        | kv_bank::BankError::LeaseRevoked { .. }
        | kv_bank::BankError::LeaseMissing { .. } => kv_descriptor::PinRefusalReason::BankClosed,
        _ => kv_descriptor::PinRefusalReason::Malformed,
    }
}
