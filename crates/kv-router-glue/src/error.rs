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
    /// A live retune the cost model cannot use.
    #[error("retune refused: `{key}` {reason}")]
    Unusable {
        /// Key whose value makes the model unusable.
        key: &'static str,
        /// Why.
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
}

/// Why a fetch hint was refused or a fetch fell back. Hint errors are raised
/// before any memory is reserved or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// The transfer or a step around it failed; the request recomputes.
    #[error("fetch fell back at `{stage}`: {reason}")]
    Fallback {
        /// Stage (`reserve`, `pin`, `transfer`, `verify`, `commit`).
        stage: &'static str,
        /// Cause.
        reason: String,
    },
}

/// Why a [`crate::RemoteDonor`] could not be built. Nothing was pinned or
/// read: every check runs before the donor is contacted.
#[derive(Debug, thiserror::Error)]
pub enum RemoteDonorError {
    /// The control endpoint is not `unix:<path>` with a usable path.
    #[error("invalid `endpoint`: {reason}")]
    Endpoint {
        /// What is wrong, with the endpoint as given.
        reason: String,
    },
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
