//! Python exceptions mirroring the Rust error enums: a class per cause under
//! the base `KvReuseError`, the message is the Rust error's `Display` (which
//! names the field), and the int-argument extraction every module uses
//! (`uint` / `uints`: a negative or too large int, or a bool for a single
//! int, is `BadArgument` naming the argument, not pyo3's unnamed
//! `OverflowError` or a silent 0 / 1).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyBool;

use kv_router_glue::{FetchError, SettingsError};

// Module `kv_reuse`, not `kv_reuse._native` where they are made: users
// import them from `kv_reuse` (its `__init__` re-exports them), and the
// module is what a traceback, a repr and pickle name. A `_native` module
// printed `kv_reuse._native.AdviseRefused`, an internal path; pickle finds
// `kv_reuse.AdviseRefused` as well, through the re-export.
create_exception!(
    kv_reuse,
    KvReuseError,
    PyException,
    "Base of every kv_reuse error."
);
create_exception!(
    kv_reuse,
    SettingsRefused,
    KvReuseError,
    "A setting was refused (unknown key, bad or out-of-range value); the message names the key."
);
create_exception!(kv_reuse, BadArgument, KvReuseError, "An argument was refused (dtype, shape, strides, contiguity, range); the message names the argument.");
create_exception!(
    kv_reuse,
    BankFailed,
    KvReuseError,
    "The donor bank refused an operation (kv_bank::BankError)."
);
create_exception!(
    kv_reuse,
    DescriptorRefused,
    KvReuseError,
    "A manifest, event or hint did not decode or validate (kv_descriptor::DescriptorError)."
);
create_exception!(
    kv_reuse,
    LookupFailed,
    KvReuseError,
    "The router index refused a worker or event (kv_lookup::LookupError)."
);
create_exception!(
    kv_reuse,
    PinServiceFailed,
    KvReuseError,
    "The pin service could not bind or serve (PinServiceError)."
);
create_exception!(
    kv_reuse,
    HintRefused,
    KvReuseError,
    "The fetch hint was refused before anything was touched (FetchError other than Fallback)."
);
create_exception!(
    kv_reuse,
    PromptMismatch,
    HintRefused,
    "The hint is for another prompt (FetchError::PromptMismatch / HintBeyondPrompt)."
);
create_exception!(kv_reuse, FetchFellBack, KvReuseError, "The fetch fell back after validation (FetchError::Fallback): args are (message, stage, cause label). Recompute the prefix.");

create_exception!(kv_reuse, RouterUnavailable, KvReuseError, "No router service answered (NATS unreachable, no replica listening, or no reply within the timeout): advise locally or recompute.");
create_exception!(kv_reuse, AdviseRefused, KvReuseError, "The router service refused the advise request (kv_router_glue::service::AdviseRefusal); the message names the field or cause.");

create_exception!(kv_reuse, PublishFailed, KvReuseError, "A worker publisher could not reach NATS / JetStream or a publish, put or delete failed (kv_router_glue::PlaneError / AgentError); the message names the URL or the step.");

create_exception!(kv_reuse, CudaUnavailable, KvReuseError, "The GPU path was asked for where no CUDA driver or device is (kv_transfer / kv_bank CUDA errors); the message names the argument.");

/// Registers the exception classes on the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvReuseError", py.get_type::<KvReuseError>())?;
    m.add("SettingsRefused", py.get_type::<SettingsRefused>())?;
    m.add("BadArgument", py.get_type::<BadArgument>())?;
    m.add("BankFailed", py.get_type::<BankFailed>())?;
    m.add("DescriptorRefused", py.get_type::<DescriptorRefused>())?;
    m.add("LookupFailed", py.get_type::<LookupFailed>())?;
    m.add("PinServiceFailed", py.get_type::<PinServiceFailed>())?;
    m.add("HintRefused", py.get_type::<HintRefused>())?;
    m.add("PromptMismatch", py.get_type::<PromptMismatch>())?;
    m.add("FetchFellBack", py.get_type::<FetchFellBack>())?;
    m.add("RouterUnavailable", py.get_type::<RouterUnavailable>())?;
    m.add("AdviseRefused", py.get_type::<AdviseRefused>())?;
    m.add("CudaUnavailable", py.get_type::<CudaUnavailable>())?;
    m.add("PublishFailed", py.get_type::<PublishFailed>())?;
    Ok(())
}

/// A refused argument: `argument` is the Python parameter name.
pub(crate) fn bad_argument(argument: &str, reason: impl std::fmt::Display) -> PyErr {
    BadArgument::new_err(format!("{argument}: {reason}"))
}

pub(crate) fn settings(e: SettingsError) -> PyErr {
    SettingsRefused::new_err(e.to_string())
}

/// A bank's refusal as `BankFailed`, in the words of the Python API where
/// they differ from kv_bank's: a host bank too large for `/dev/shm` names
/// `slots` (its budget, kv_bank's `budget_bytes`, is what `slots` made).
pub(crate) fn bank(e: kv_bank::BankError) -> PyErr {
    match e {
        kv_bank::BankError::ShmNoSpace {
            field: "budget_bytes",
            bytes,
            free_bytes,
        } => {
            let free = free_bytes.map_or_else(
                || "free space unknown".to_owned(),
                |f| format!("{f} bytes free"),
            );
            BankFailed::new_err(format!(
                "slots: the bank needs {bytes} bytes of host shared memory for its slots \
                 (every TP rank's) and a page per rank for its lease, more than {dir} can \
                 hold ({free}); lower `slots` or enlarge {dir} (docker: --shm-size)",
                dir = kv_bank::SHM_DIR
            ))
        }
        other => BankFailed::new_err(other.to_string()),
    }
}

pub(crate) fn descriptor(e: kv_descriptor::DescriptorError) -> PyErr {
    DescriptorRefused::new_err(e.to_string())
}

pub(crate) fn lookup(e: kv_lookup::LookupError) -> PyErr {
    LookupFailed::new_err(e.to_string())
}

/// Maps a fetch error to its class; a fallback carries (stage, cause label).
/// The caller's bad `dst_blocks` ([`FetchError::is_argument_error`]: an
/// allocator bug, not a fallback) is `BadArgument` naming `dst_blocks` (a
/// wrong count) or `dst_blocks[i]` (the first bad id), in the words of the
/// Python API (`rows`: the `Target`'s rows, which are its pool's blocks).
pub(crate) fn fetch(e: FetchError) -> PyErr {
    let msg = e.to_string();
    match e {
        FetchError::DstBlocksCount {
            given,
            fetched,
            fetch_from,
        } => bad_argument(
            "dst_blocks",
            format!(
                "{given} ids given, the hint fetches {fetched} blocks (from block {fetch_from})"
            ),
        ),
        FetchError::DstBlockOutOfRange {
            index,
            block,
            capacity,
        } => bad_argument(
            &format!("dst_blocks[{index}]"),
            format!("{block} is not below rows {capacity}"),
        ),
        FetchError::DstBlockRepeated { index, block, .. } => bad_argument(
            &format!("dst_blocks[{index}]"),
            format!("{block} is given twice"),
        ),
        FetchError::Fallback { stage, cause } => {
            FetchFellBack::new_err((msg, stage, cause.label()))
        }
        FetchError::PromptMismatch { .. } | FetchError::HintBeyondPrompt { .. } => {
            PromptMismatch::new_err(msg)
        }
        _ => HintRefused::new_err(msg),
    }
}

/// Unsigned integer types an argument is extracted as ([`uint`], [`uints`]).
pub(crate) trait Unsigned: for<'py> FromPyObject<'py> + Copy {
    /// The largest value, for the refusal's range.
    const MAX: u64;
    /// The value as u64 (lossless: every implementor fits).
    fn as_u64(self) -> u64;
}

impl Unsigned for u8 {
    const MAX: u64 = u8::MAX as u64;
    fn as_u64(self) -> u64 {
        self.into()
    }
}

impl Unsigned for u32 {
    const MAX: u64 = u32::MAX as u64;
    fn as_u64(self) -> u64 {
        self.into()
    }
}

impl Unsigned for u64 {
    const MAX: u64 = u64::MAX;
    fn as_u64(self) -> u64 {
        self
    }
}

impl Unsigned for usize {
    const MAX: u64 = usize::MAX as u64;
    fn as_u64(self) -> u64 {
        self as u64
    }
}

/// An int argument as `T`: `BadArgument` naming `argument` when it is
/// negative or above `T::MAX` (pyo3's own extraction raises an unnamed
/// `OverflowError`) or a bool, `TypeError` naming it when it is not an int.
///
/// A bool is an int to Python (`True == 1`), so pyo3 takes it: a count,
/// size or id given as `True` (`Layout(..., tp_size=True)`) is a caller's
/// mistake that would otherwise pass as 1. Sequences ([`uints`]) are not
/// checked element by element: a prompt's token ids would pay a second
/// pass for it.
pub(crate) fn uint<T: Unsigned>(argument: &str, v: &Bound<'_, PyAny>) -> PyResult<T> {
    if v.is_instance_of::<PyBool>() {
        return Err(bad_argument(argument, format!("{v} is a bool, not an int")));
    }
    v.extract().map_err(|e| int_refusal::<T>(argument, v, e))
}

/// [`uint`] for an argument whose real range is `range`, narrower than
/// `T`'s: every value outside it (negative, past `T`, or past the range) is
/// refused naming that range, `{v} is not in {lo}..={hi}`. Before, a count
/// that must be at least 1 said `-1 is not in 0..=4294967295` (the width of
/// its type) while 0 was refused as well.
pub(crate) fn uint_in<T: Unsigned>(
    argument: &str,
    v: &Bound<'_, PyAny>,
    range: std::ops::RangeInclusive<u64>,
) -> PyResult<T> {
    if v.is_instance_of::<PyBool>() {
        return Err(bad_argument(argument, format!("{v} is a bool, not an int")));
    }
    let n: T = v
        .extract()
        .map_err(|e| int_refusal_in(argument, v, e, &range))?;
    if !range.contains(&n.as_u64()) {
        return Err(bad_argument(
            argument,
            format!(
                "{} is not in {}..={}",
                n.as_u64(),
                range.start(),
                range.end()
            ),
        ));
    }
    Ok(n)
}

/// An index into something of `bound` elements (a rank below `tp_size`, a
/// row below `rows`): every value outside `0..bound`, negative and past
/// u64 included, is refused naming that bound, `{v} is not below
/// {bound_name} {bound}`, rather than the width of the index's type, which
/// is not what the caller got wrong.
pub(crate) fn index_below(
    argument: &str,
    v: &Bound<'_, PyAny>,
    bound: u32,
    bound_name: &str,
) -> PyResult<u32> {
    if v.is_instance_of::<PyBool>() {
        return Err(bad_argument(argument, format!("{v} is a bool, not an int")));
    }
    let py = v.py();
    let not_below = || {
        bad_argument(
            argument,
            format!("{} is not below {bound_name} {bound}", shown(v)),
        )
    };
    match v.extract::<u64>() {
        Ok(n) if n < u64::from(bound) => Ok(n as u32),
        Ok(_) => Err(not_below()),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(not_below()),
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            Err(PyTypeError::new_err(format!("{argument}: {}", e.value(py))))
        }
        Err(e) => Err(e),
    }
}

/// An optional int argument read by `#[pyo3(from_py_with = ...)]`: None
/// is `default`, anything else [`uint_in`] over `range`, named once
/// ([`named_by_pyo3`]).
pub(crate) fn uint_in_or<T: Unsigned>(
    argument: &str,
    v: &Bound<'_, PyAny>,
    range: std::ops::RangeInclusive<u64>,
    default: T,
) -> PyResult<T> {
    if v.is_none() {
        return Ok(default);
    }
    named_by_pyo3(argument, uint_in(argument, v, range))
}

/// `r`, an int argument's extraction run by `#[pyo3(from_py_with = ...)]`
/// (a signature with a literal default, which `inspect.signature` shows):
/// pyo3 prefixes a `TypeError` from there with `argument '<name>': `, so a
/// `TypeError` of [`uint`] / [`uint_in`], which names the argument itself,
/// is made again without its own prefix (not named twice). `BadArgument`
/// passes unchanged.
pub(crate) fn named_by_pyo3<T>(argument: &str, r: PyResult<T>) -> PyResult<T> {
    r.map_err(|e| {
        Python::with_gil(|py| {
            if !e.is_instance_of::<PyTypeError>(py) {
                return e;
            }
            let msg = e.value(py).to_string();
            match msg.strip_prefix(&format!("{argument}: ")) {
                Some(rest) => PyTypeError::new_err(rest.to_owned()),
                None => e,
            }
        })
    })
}

/// A sequence of ints as `Vec<T>`; a refused element is named
/// `argument[i]` (as [`uint`]), a non-sequence `argument` (`TypeError`).
/// The common case costs what pyo3's `Vec<T>` extraction costs.
pub(crate) fn uints<T: Unsigned>(argument: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<T>> {
    v.extract::<Vec<T>>().map_err(|e| {
        // pyo3 refuses a str as a Vec ("Can't extract `str` to `Vec`"),
        // which does not say what to pass instead (a prompt's text where
        // its token ids were due).
        if v.is_instance_of::<pyo3::types::PyString>() {
            return PyTypeError::new_err(format!(
                "{argument}: must be a sequence of ints, not str"
            ));
        }
        if let Ok(items) = v.try_iter() {
            for (i, item) in items.enumerate() {
                let Ok(item) = item else { break };
                if let Err(e) = item.extract::<T>() {
                    return int_refusal::<T>(&format!("{argument}[{i}]"), &item, e);
                }
            }
        }
        int_refusal::<T>(argument, v, e)
    })
}

/// A number of seconds from Python (`#[pyo3(from_py_with = "errors::seconds")]`):
/// an int or a float, never a bool.
///
/// A bool is a number to Python (`True == 1`), so pyo3 takes it as 1.0: a
/// `lease_s=True` is a caller's mistake, refused as a `TypeError` (pyo3
/// prefixes `argument 'lease_s':`). An int too large for a float (past
/// ~1.8e308, `10**400`) is ±infinity here, so the caller's range check
/// refuses it with `BadArgument` naming the argument; pyo3's own extraction
/// raised an `OverflowError` that named nothing. Every caller checks its
/// range (finite, within bounds) before use.
pub(crate) fn seconds(v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{v} is a bool, not a number of seconds"
        )));
    }
    match v.extract::<f64>() {
        Ok(s) => Ok(s),
        // Only an int overflows (a float already is one).
        Err(e) if e.is_instance_of::<PyOverflowError>(v.py()) => Ok(if v.lt(0)? {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        }),
        Err(e) => Err(e),
    }
}

/// [`seconds`] for an optional argument (`None` passes through).
pub(crate) fn seconds_or_none(v: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if v.is_none() {
        Ok(None)
    } else {
        seconds(v).map(Some)
    }
}

/// pyo3's extraction error `e` for int argument `v` as a refusal naming
/// `argument`: an overflow (negative, too large) as `BadArgument` with the
/// range, a type error as `TypeError`, anything else unchanged.
fn int_refusal<T: Unsigned>(argument: &str, v: &Bound<'_, PyAny>, e: PyErr) -> PyErr {
    int_refusal_in(argument, v, e, &(0..=T::MAX))
}

/// [`int_refusal`] naming `range` (the argument's real range) in an
/// overflow's refusal.
/// An int as a refusal shows it: its digits, cut to 24 and a count past 40.
fn shown(v: &Bound<'_, PyAny>) -> String {
    let s = v
        .str()
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "the value".into());
    if s.len() > 40 {
        format!("{}... ({} digits)", &s[..24], s.len())
    } else {
        s
    }
}

fn int_refusal_in(
    argument: &str,
    v: &Bound<'_, PyAny>,
    e: PyErr,
    range: &std::ops::RangeInclusive<u64>,
) -> PyErr {
    let py = v.py();
    if e.is_instance_of::<PyOverflowError>(py) {
        bad_argument(
            argument,
            format!("{} is not in {}..={}", shown(v), range.start(), range.end()),
        )
    } else if e.is_instance_of::<PyTypeError>(py) {
        PyTypeError::new_err(format!("{argument}: {}", e.value(py)))
    } else {
        e
    }
}
