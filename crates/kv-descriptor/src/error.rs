//! The one error type of this crate.

/// Why a descriptor, manifest, hint or event was refused.
///
/// Every variant names the offending field so that an operator can find it in
/// the input without reading source code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// A field had a value outside its allowed range.
    #[error("invalid `{field}`: {reason}")]
    InvalidField {
        /// Dotted path of the field, e.g. `layout.tp_size`.
        field: &'static str,
        /// Human-readable reason, including the value seen.
        reason: String,
    },
    /// The stored checksum does not match the content.
    #[error("checksum mismatch in `{what}`: stored {stored:#018x}, computed {computed:#018x}")]
    Checksum {
        /// Which object failed (`bank_descriptor`).
        what: &'static str,
        /// Checksum carried on the wire.
        stored: u64,
        /// Checksum recomputed from the content.
        computed: u64,
    },
    /// An encoded object exceeds its size bound.
    #[error("`{what}` encodes to {size} bytes, above the limit of {limit} bytes")]
    TooLarge {
        /// Which object (`bank_manifest`).
        what: &'static str,
        /// Encoded size in bytes.
        size: usize,
        /// Limit in bytes.
        limit: usize,
    },
    /// A hint action that this reader does not implement.
    #[error(
        "unsupported hint action `{action_type}@{action_version}` (this reader knows {known})"
    )]
    UnsupportedAction {
        /// `action_type` as received.
        action_type: String,
        /// `action_version` as received.
        action_version: String,
        /// The `type@version` pairs this reader accepts.
        known: &'static str,
    },
    /// MessagePack bytes that do not decode into the expected type.
    #[error("cannot decode `{what}`{}: {reason}", at_field(.field))]
    Decode {
        /// Target type (`bank_descriptor`, `kv_event`, ...).
        what: &'static str,
        /// Where in the value decoding failed, as a path of field names and
        /// indices (`target`, `data.blocks[3].slot`); `None` when the value
        /// itself is wrong (not a map, trailing bytes, too deep).
        field: Option<String>,
        /// Decoder message.
        reason: String,
    },
    /// A value could not be encoded (should not happen for valid objects).
    #[error("cannot encode `{what}`: {reason}")]
    Encode {
        /// Source type.
        what: &'static str,
        /// Encoder message.
        reason: String,
    },
}

impl DescriptorError {
    pub(crate) fn field(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidField {
            field,
            reason: reason.into(),
        }
    }
}

/// ` at `FIELD`` for [`DescriptorError::Decode`]'s message, or nothing.
fn at_field(field: &Option<String>) -> String {
    field
        .as_deref()
        .map(|f| format!(" at `{f}`"))
        .unwrap_or_default()
}
