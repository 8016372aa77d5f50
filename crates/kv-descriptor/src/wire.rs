//! MessagePack encoding shared by every wire type.
//!
//! Structs are written as maps with field names (`rmp_serde::to_vec_named`) so
//! that other readers (Dynamo's, Python's `msgpack`) see named fields, and so
//! that the format is stable under field reordering. Decoding validates: the
//! types' `serde(try_from)` run the same checks as their constructors.
//!
//! The decoder is hardened for hostile input: nesting deeper than
//! [`MAX_WIRE_DEPTH`] is refused before it can exhaust the stack, declared
//! lengths never allocate more than the input holds (the reader copies at most
//! the bytes present), and trailing bytes after the value are an error so that
//! one encoding has exactly one meaning.

use serde::{de::DeserializeOwned, Serialize};

use crate::DescriptorError;

/// Deepest MessagePack nesting (maps and arrays) a decoder accepts.
///
/// Our own types nest at most 8 levels (envelope -> actions -> action ->
/// payload -> parts -> part -> slot ids); 32 leaves room for foreign hint
/// payloads while keeping recursion far from the 2 MiB stack of a test thread.
pub const MAX_WIRE_DEPTH: usize = 32;

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
    /// [`DescriptorError::Decode`] wrapping the decoder's or validator's
    /// message (a validation failure keeps its field name in `reason`), for
    /// nesting deeper than [`MAX_WIRE_DEPTH`], and for trailing bytes.
    fn from_wire(bytes: &[u8]) -> Result<Self, DescriptorError> {
        decode_bounded(Self::WHAT, bytes)
    }
}

/// The one MessagePack decoder of the crate: bounded depth, no trailing bytes.
pub(crate) fn decode_bounded<T: DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<T, DescriptorError> {
    let decode_err = |field, reason: String| DescriptorError::Decode {
        what,
        field,
        reason,
    };
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
    de.set_max_depth(MAX_WIRE_DEPTH);
    let value = T::deserialize(&mut de)
        .map_err(|e| decode_err(failing_field::<T>(bytes), e.to_string()))?;
    let used = de.position();
    if used != bytes.len() as u64 {
        return Err(decode_err(
            None,
            format!(
                "{} trailing bytes after the value (read {used} of {})",
                bytes.len() as u64 - used,
                bytes.len()
            ),
        ));
    }
    Ok(value)
}

/// The field path where decoding `bytes` as `T` fails (`target`,
/// `data.blocks[3].slot`), found by decoding again through
/// `serde_path_to_error`; `None` when the failure is at the top. Only
/// called after a failed decode, so a well-formed value pays nothing for it.
fn failing_field<T: DeserializeOwned>(bytes: &[u8]) -> Option<String> {
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(bytes));
    de.set_max_depth(MAX_WIRE_DEPTH);
    let e = serde_path_to_error::deserialize::<_, T>(&mut de).err()?;
    let path = e.path().to_string();
    (path != "." && !path.is_empty()).then_some(path)
}

impl Wire for crate::BankDescriptor {
    const WHAT: &'static str = "bank_descriptor";
}
impl Wire for crate::BankManifest {
    const WHAT: &'static str = "bank_manifest";

    /// Refuses input above [`crate::MAX_MANIFEST_BYTES`] before decoding it,
    /// then decodes and validates like every other type.
    fn from_wire(bytes: &[u8]) -> Result<Self, DescriptorError> {
        if bytes.len() > crate::MAX_MANIFEST_BYTES {
            return Err(DescriptorError::TooLarge {
                what: Self::WHAT,
                size: bytes.len(),
                limit: crate::MAX_MANIFEST_BYTES,
            });
        }
        decode_bounded(Self::WHAT, bytes)
    }
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
