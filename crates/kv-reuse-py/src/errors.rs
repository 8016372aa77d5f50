//! Python exceptions mirroring the Rust error enums: a class per cause under
//! the base `KvReuseError`, the message is the Rust error's `Display` (which
//! names the field).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use kv_router_glue::{FetchError, SettingsError};

create_exception!(
    kv_reuse._native,
    KvReuseError,
    PyException,
    "Base of every kv_reuse error."
);
create_exception!(
    kv_reuse._native,
    SettingsRefused,
    KvReuseError,
    "A setting was refused (unknown key, bad or out-of-range value); the message names the key."
);
create_exception!(kv_reuse._native, BadArgument, KvReuseError, "An argument was refused (dtype, shape, strides, contiguity, range); the message names the argument.");
create_exception!(
    kv_reuse._native,
    BankFailed,
    KvReuseError,
    "The donor bank refused an operation (kv_bank::BankError)."
);
create_exception!(
    kv_reuse._native,
    DescriptorRefused,
    KvReuseError,
    "A manifest, event or hint did not decode or validate (kv_descriptor::DescriptorError)."
);
create_exception!(
    kv_reuse._native,
    LookupFailed,
    KvReuseError,
    "The router index refused a worker or event (kv_lookup::LookupError)."
);
create_exception!(
    kv_reuse._native,
    PinServiceFailed,
    KvReuseError,
    "The pin service could not bind or serve (PinServiceError)."
);
create_exception!(
    kv_reuse._native,
    HintRefused,
    KvReuseError,
    "The fetch hint was refused before anything was touched (FetchError other than Fallback)."
);
create_exception!(
    kv_reuse._native,
    PromptMismatch,
    HintRefused,
    "The hint is for another prompt (FetchError::PromptMismatch / HintBeyondPrompt)."
);
create_exception!(kv_reuse._native, FetchFellBack, KvReuseError, "The fetch fell back after validation (FetchError::Fallback): args are (message, stage, cause label). Recompute the prefix.");

create_exception!(kv_reuse._native, RouterUnavailable, KvReuseError, "No router service answered (NATS unreachable, no replica listening, or no reply within the timeout): advise locally or recompute.");
create_exception!(kv_reuse._native, AdviseRefused, KvReuseError, "The router service refused the advise request (kv_router_glue::service::AdviseRefusal); the message names the field or cause.");

create_exception!(kv_reuse._native, PublishFailed, KvReuseError, "A worker publisher could not reach NATS / JetStream or a publish, put or delete failed (kv_router_glue::PlaneError / AgentError); the message names the URL or the step.");

create_exception!(kv_reuse._native, CudaUnavailable, KvReuseError, "The GPU path was asked for where no CUDA driver or device is (kv_transfer / kv_bank CUDA errors); the message names the argument.");

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

pub(crate) fn bank(e: kv_bank::BankError) -> PyErr {
    BankFailed::new_err(e.to_string())
}

pub(crate) fn descriptor(e: kv_descriptor::DescriptorError) -> PyErr {
    DescriptorRefused::new_err(e.to_string())
}

pub(crate) fn lookup(e: kv_lookup::LookupError) -> PyErr {
    LookupFailed::new_err(e.to_string())
}

/// Maps a fetch error to its class; a fallback carries (stage, cause label).
pub(crate) fn fetch(e: FetchError) -> PyErr {
    let msg = e.to_string();
    match e {
        FetchError::Fallback { stage, cause } => {
            FetchFellBack::new_err((msg, stage, cause.label()))
        }
        FetchError::PromptMismatch { .. } | FetchError::HintBeyondPrompt { .. } => {
            PromptMismatch::new_err(msg)
        }
        _ => HintRefused::new_err(msg),
    }
}
