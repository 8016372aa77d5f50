//! KV events for publishers that are not a [`crate::donor::DonorBank`]
//! (e.g. a prefill engine's own prefix cache): the same `KvEvent` wire form
//! (`kv_descriptor::KvEvent`, named-field MessagePack, docs/wire-formats.md),
//! written and read by kv-descriptor's codec, so Python never re-implements
//! it. The Python side speaks JSON of the same field names (serde's
//! representation is the same in both formats).

use kv_descriptor::{KvEvent, Wire};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{bad_argument, descriptor};

/// Encodes one KV event given as JSON of `KvEvent`'s fields (`publisher`,
/// `event_id`, `role`, `layout_fingerprint`, `tp_size`, `tier`, `data`) into
/// its wire bytes, validated as a decoder would.
///
/// Raises `BadArgument` naming `event_json` for JSON that is not a `KvEvent`,
/// `DescriptorRefused` when encoding fails.
///
/// ```python
/// import json, kv_reuse
/// ev = {"publisher": "00000000-0000-4000-8000-000000000001", "event_id": 1, "role": "prefill",
///       "layout_fingerprint": 7, "tp_size": 1, "tier": "device", "data": "cleared"}
/// assert json.loads(kv_reuse.decode_kv_event(kv_reuse.encode_kv_event(json.dumps(ev)))) == ev
/// ```
#[pyfunction]
pub fn encode_kv_event<'py>(py: Python<'py>, event_json: &str) -> PyResult<Bound<'py, PyBytes>> {
    let event: KvEvent =
        serde_json::from_str(event_json).map_err(|e| bad_argument("event_json", e))?;
    let wire = event.to_wire().map_err(descriptor)?;
    // Decoding validates what serde alone does not (bounds, field checks).
    KvEvent::from_wire(&wire).map_err(descriptor)?;
    Ok(PyBytes::new(py, &wire))
}

/// Decodes one KV event's wire bytes into JSON of its fields (the inverse of
/// `encode_kv_event`).
///
/// Raises `DescriptorRefused` for bytes that are not one valid `KvEvent`
/// (trailing bytes included).
#[pyfunction]
pub fn decode_kv_event(event: &[u8]) -> PyResult<String> {
    let event = KvEvent::from_wire(event).map_err(descriptor)?;
    serde_json::to_string(&event).map_err(|e| bad_argument("event", e))
}
