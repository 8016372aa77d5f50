//! MessagePack encoding shared by every wire type.
//!
//! Structs are written as maps with field names (`rmp_serde::to_vec_named`) so
//! that other readers (Dynamo's, Python's `msgpack`) see named fields, and so
//! that the format is stable under field reordering. Decoding validates: the
//! types' `serde(try_from)` run the same checks as their constructors.

use serde::{de::DeserializeOwned, Serialize};

use crate::DescriptorError;

/// A type with a MessagePack wire form.
pub trait Wire: Serialize + DeserializeOwned {
    /// Name used in errors (`bank_descriptor`, `kv_event`, ...).
    const WHAT: &'static str;

    /// Encodes to MessagePack (named fields).
    ///
    /// # Errors
    /// [`DescriptorError::Encode`] (not expected for validated values).
    fn to_wire(&self) -> Result<Vec<u8>, DescriptorError> {
        rmp_serde::to_vec_named(self).map_err(|e| DescriptorError::Encode {
            what: Self::WHAT,
            reason: e.to_string(),
        })
    }

    /// Decodes and validates. Never panics on arbitrary input.
    ///
    /// # Errors
    /// [`DescriptorError::Decode`] wrapping the decoder's or validator's message.
    fn from_wire(bytes: &[u8]) -> Result<Self, DescriptorError> {
        rmp_serde::from_slice(bytes).map_err(|e| DescriptorError::Decode {
            what: Self::WHAT,
            reason: e.to_string(),
        })
    }
}

impl Wire for crate::BankDescriptor {
    const WHAT: &'static str = "bank_descriptor";
}
impl Wire for crate::BankManifest {
    const WHAT: &'static str = "bank_manifest";
}
impl Wire for crate::HintEnvelope {
    const WHAT: &'static str = "hint_envelope";
}
impl Wire for crate::KvEvent {
    const WHAT: &'static str = "kv_event";
}
impl Wire for crate::FetchGpuHint {
    const WHAT: &'static str = "fetch_gpu_hint";
}
