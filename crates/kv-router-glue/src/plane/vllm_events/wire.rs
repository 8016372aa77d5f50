//! vLLM's KV event wire format: decoding (and encoding, for test publishers).
//!
//! Accepted shapes (vLLM `vllm/distributed/kv_events.py`, msgspec structs with
//! `tag=True`; older releases also `array_like=True`):
//!
//! - batch, array-like: `[ts: float, events: [event...], data_parallel_rank: int|nil]`
//!   (the third element may be absent);
//! - batch, map: `{"ts": float, "events": [...], "data_parallel_rank": int|nil}`;
//! - event, array-like: `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
//!   ...]`, `["BlockRemoved", block_hashes, medium, group_idx, ...]`,
//!   `["AllBlocksCleared", ...]`;
//!   positions after `block_size` (resp. `block_hashes`) may be absent and
//!   further trailing elements are ignored;
//! - event, map: the same field names plus `"type": "<class name>"`; unknown
//!   keys are ignored. vLLM 0.33.0 sends this shape (tagged structs,
//!   `omit_defaults=True`: `extra_keys`, `group_idx` and the other newer
//!   fields are absent when unset) inside an array-like batch; its further
//!   fields (`kv_cache_spec_kind`, `locality`, `session_id`,
//!   `lookahead_token_ids`, ...) are ignored.
//!
//! A block hash is an integer (signed or unsigned 64-bit: vLLM's default,
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) or a byte string (the full digest,
//! with that variable set to 0), folded to its last 8 bytes read big-endian,
//! which is the integer vLLM would have sent. vLLM block hashes are only used
//! as names of blocks within one publisher's stream; the inventory is keyed by
//! our own sequence hashes (see [`super::VllmIngest`]).

use rmpv::Value;

use super::VllmEventError;

/// Largest payload accepted, bytes. vLLM batches are one scheduler step's
/// events: a few KiB to a few MiB.
pub const MAX_VLLM_PAYLOAD_BYTES: usize = 64 << 20;

/// Nesting accepted by the decoder (a batch is at most 5 deep; `extra_keys`
/// adds 2). Deeper input is refused rather than recursed into.
const MAX_DEPTH: usize = 16;

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmEventBatch {
    /// Publisher wall-clock time, seconds since the Unix epoch.
    pub ts: f64,
    /// Events in the order the engine produced them.
    pub events: Vec<VllmEvent>,
    /// Data-parallel rank of the publishing engine, when it sent one.
    pub data_parallel_rank: Option<i64>,
}

/// One vLLM KV cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum VllmEvent {
    /// `BlockStored`: full blocks entered a cache tier.
    BlockStored {
        /// vLLM's names of the stored blocks, root-most first.
        block_hashes: Vec<u64>,
        /// vLLM's name of the parent of the first block (`None`: a root block).
        parent_block_hash: Option<u64>,
        /// Token ids of the stored blocks, `block_hashes.len() * block_size` of them.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter id (deprecated upstream field), `None` without LoRA.
        lora_id: Option<i64>,
        /// Storage medium (`"GPU"`, `"CPU"`, ...); `None` means GPU.
        medium: Option<String>,
        /// LoRA adapter name, `None` without LoRA.
        lora_name: Option<String>,
        /// vLLM's `extra_keys`: one entry per block (`None`: the block has
        /// none), each the untagged keys vLLM mixed into that block's hash.
        /// Empty when the event carries none.
        extra_keys: Vec<Option<Vec<VllmExtraKey>>>,
        /// KV cache group (vLLM 0.33 `group_idx`; hybrid models have one
        /// group per attention kind). `None`: the engine's only group.
        group_idx: Option<u32>,
    },
    /// `BlockRemoved`: blocks left a cache tier.
    BlockRemoved {
        /// vLLM's names of the removed blocks.
        block_hashes: Vec<u64>,
        /// Storage medium; `None` means GPU.
        medium: Option<String>,
        /// KV cache group that freed them; `None`: the engine's only group.
        group_idx: Option<u32>,
    },
    /// `AllBlocksCleared`: the engine dropped its whole prefix cache.
    AllBlocksCleared,
}

/// One untagged extra key of a block, as vLLM publishes it
/// (`vllm/v1/core/kv_cache_utils.py` `to_event_extra_keys`): per block, in
/// order, the LoRA name (when `lora_name` is set), `(mm_identifier, offset)`
/// pairs, the cache salt (first block of a request only) and prompt-embedding
/// digests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmExtraKey {
    /// A bare string: the LoRA name or the cache salt, by position.
    Text(String),
    /// A multimodal input overlapping the block: its identifier (vLLM's
    /// `mm_hash`, a hex digest or a user-given uuid) and where it starts,
    /// in tokens from the block start (negative: before the block).
    Multimodal {
        /// vLLM's `mm_feature.identifier`.
        identifier: String,
        /// Start offset relative to the block, tokens.
        offset: i64,
    },
    /// A byte string: a prompt-embeddings digest.
    Digest(Vec<u8>),
    /// Any other shape (kept so the block is skipped, never misnamed).
    Other,
}

/// Encoding used by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmEncoding {
    /// msgspec `array_like=True`: batches and events as positional arrays.
    ArrayLike,
    /// msgspec default: batches and events as maps, events tagged by `"type"`.
    Map,
}

/// Decodes one ZMQ payload frame (a msgpack `KVEventBatch`).
///
/// # Errors
/// [`VllmEventError::Payload`] naming the offending field when the bytes are
/// not a batch of the shapes listed in the module documentation, exceed
/// [`MAX_VLLM_PAYLOAD_BYTES`], nest deeper than 16 levels, or carry trailing
/// bytes. Never panics.
///
/// ```
/// use kv_router_glue::vllm_events::{decode_batch, encode_batch, VllmEncoding, VllmEvent, VllmEventBatch};
/// let batch = VllmEventBatch { ts: 1.5, events: vec![VllmEvent::AllBlocksCleared], data_parallel_rank: Some(0) };
/// for enc in [VllmEncoding::ArrayLike, VllmEncoding::Map] {
///     assert_eq!(decode_batch(&encode_batch(&batch, enc)).unwrap(), batch);
/// }
/// ```
pub fn decode_batch(payload: &[u8]) -> Result<VllmEventBatch, VllmEventError> {
    if payload.len() > MAX_VLLM_PAYLOAD_BYTES {
        return Err(err(
            "payload",
            format!(
                "{} bytes exceed the limit of {MAX_VLLM_PAYLOAD_BYTES}",
                payload.len()
            ),
        ));
    }
    let mut rd = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| err("payload", format!("not msgpack: {e}")))?;
    if !rd.is_empty() {
        return Err(err(
            "payload",
            format!("{} trailing bytes after the batch", rd.len()),
        ));
    }
    let (ts, events, dp) = match value {
        Value::Array(items) => {
            if !(2..=3).contains(&items.len()) {
                return Err(err(
                    "batch",
                    format!("array of {} elements, expected 2 or 3", items.len()),
                ));
            }
            let mut it = items.into_iter();
            let ts = it.next().unwrap_or(Value::Nil);
            let events = it.next().unwrap_or(Value::Nil);
            (ts, events, it.next().unwrap_or(Value::Nil))
        }
        Value::Map(entries) => {
            let mut ts = None;
            let mut events = None;
            let mut dp = Value::Nil;
            for (k, v) in entries {
                match k.as_str() {
                    Some("ts") => ts = Some(v),
                    Some("events") => events = Some(v),
                    Some("data_parallel_rank") => dp = v,
                    _ => {}
                }
            }
            (
                ts.ok_or_else(|| err("batch.ts", "missing".into()))?,
                events.ok_or_else(|| err("batch.events", "missing".into()))?,
                dp,
            )
        }
        other => return Err(err("batch", format!("expected array or map, got {other}"))),
    };
    let ts = as_f64(&ts).ok_or_else(|| err("batch.ts", format!("not a number: {ts}")))?;
    let data_parallel_rank = opt(&dp)
        .map(|v| {
            v.as_i64()
                .ok_or_else(|| err("batch.data_parallel_rank", format!("not an integer: {v}")))
        })
        .transpose()?;
    let Value::Array(raw_events) = events else {
        return Err(err("batch.events", format!("not an array: {events}")));
    };
    let events = raw_events
        .into_iter()
        .enumerate()
        .map(|(i, e)| decode_event(e).map_err(|e| e.at_event(i)))
        .collect::<Result<_, _>>()?;
    Ok(VllmEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Encodes a batch as vLLM does (for test publishers and tools that emit
/// vLLM-format events). Block hashes are written as unsigned integers;
/// `extra_keys` and `group_idx` as nil when absent.
pub fn encode_batch(batch: &VllmEventBatch, encoding: VllmEncoding) -> Vec<u8> {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|e| encode_event(e, encoding))
        .collect();
    let dp = batch.data_parallel_rank.map_or(Value::Nil, Value::from);
    let value = match encoding {
        VllmEncoding::ArrayLike => Value::Array(vec![batch.ts.into(), events.into(), dp]),
        VllmEncoding::Map => Value::Map(vec![
            ("ts".into(), batch.ts.into()),
            ("events".into(), events.into()),
            ("data_parallel_rank".into(), dp),
        ]),
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("writing to a Vec cannot fail");
    out
}

fn encode_event(e: &VllmEvent, encoding: VllmEncoding) -> Value {
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|&x| Value::from(x)).collect());
    let opt_str = |s: &Option<String>| s.as_deref().map_or(Value::Nil, Value::from);
    let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
        VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
        } => (
            "BlockStored",
            vec![
                ("block_hashes", hashes(block_hashes)),
                (
                    "parent_block_hash",
                    parent_block_hash.map_or(Value::Nil, Value::from),
                ),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                ("medium", opt_str(medium)),
                ("lora_name", opt_str(lora_name)),
                ("extra_keys", encode_extra_keys(extra_keys)),
                ("group_idx", group_idx.map_or(Value::Nil, Value::from)),
            ],
        ),
        VllmEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => (
            "BlockRemoved",
            vec![
                ("block_hashes", hashes(block_hashes)),
                ("medium", opt_str(medium)),
                ("group_idx", group_idx.map_or(Value::Nil, Value::from)),
            ],
        ),
        VllmEvent::AllBlocksCleared => ("AllBlocksCleared", vec![]),
    };
    match encoding {
        VllmEncoding::ArrayLike => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect(),
        ),
        VllmEncoding::Map => Value::Map(
            std::iter::once(("type".into(), Value::from(tag)))
                .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                .collect(),
        ),
    }
}

fn encode_extra_keys(keys: &[Option<Vec<VllmExtraKey>>]) -> Value {
    if keys.is_empty() {
        return Value::Nil;
    }
    let key = |k: &VllmExtraKey| match k {
        VllmExtraKey::Text(s) => Value::from(s.as_str()),
        VllmExtraKey::Multimodal { identifier, offset } => {
            Value::Array(vec![identifier.as_str().into(), (*offset).into()])
        }
        VllmExtraKey::Digest(b) => Value::Binary(b.clone()),
        VllmExtraKey::Other => Value::Map(vec![]),
    };
    Value::Array(
        keys.iter()
            .map(|b| {
                b.as_ref()
                    .map_or(Value::Nil, |ks| Value::Array(ks.iter().map(key).collect()))
            })
            .collect(),
    )
}

fn decode_extra_keys(v: Value) -> Result<Vec<Option<Vec<VllmExtraKey>>>, VllmEventError> {
    let blocks = match v {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(blocks) => blocks,
        other => return Err(err("extra_keys", format!("not an array: {other}"))),
    };
    let key = |k: Value| match k {
        Value::String(s) => s.into_str().map_or(VllmExtraKey::Other, VllmExtraKey::Text),
        Value::Binary(b) => VllmExtraKey::Digest(b),
        Value::Array(pair) => match pair.as_slice() {
            [Value::String(id), Value::Integer(off)] => match (id.as_str(), off.as_i64()) {
                (Some(id), Some(offset)) => VllmExtraKey::Multimodal {
                    identifier: id.to_owned(),
                    offset,
                },
                _ => VllmExtraKey::Other,
            },
            _ => VllmExtraKey::Other,
        },
        _ => VllmExtraKey::Other,
    };
    blocks
        .into_iter()
        .map(|b| match b {
            Value::Nil => Ok(None),
            Value::Array(keys) => Ok(Some(keys.into_iter().map(key).collect())),
            other => Err(err(
                "extra_keys",
                format!("a block's keys are not an array: {other}"),
            )),
        })
        .collect()
}

fn group_of(v: &Value) -> Result<Option<u32>, VllmEventError> {
    opt(v)
        .map(|g| {
            g.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| err("group_idx", format!("not a u32: {g}")))
        })
        .transpose()
}

/// Field values of one event, by name, whichever shape it came in.
struct Fields {
    tag: String,
    named: Vec<(String, Value)>,
}

impl Fields {
    fn take(&mut self, name: &str) -> Value {
        self.named
            .iter()
            .position(|(k, _)| k == name)
            .map_or(Value::Nil, |i| self.named.swap_remove(i).1)
    }
}

/// Positional field names after the tag (vLLM's declaration order).
const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];

fn fields_of(v: Value) -> Result<Fields, VllmEventError> {
    match v {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let tag = it
                .next()
                .and_then(|t| t.as_str().map(str::to_owned))
                .ok_or_else(|| err("event", "array does not start with a tag string".into()))?;
            let names: &[&str] = match tag.as_str() {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            let named = names.iter().map(|n| n.to_string()).zip(it).collect();
            Ok(Fields { tag, named })
        }
        Value::Map(entries) => {
            let mut tag = None;
            let mut named = Vec::with_capacity(entries.len());
            for (k, v) in entries {
                match k.as_str() {
                    Some("type") => tag = v.as_str().map(str::to_owned),
                    Some(name) => named.push((name.to_owned(), v)),
                    None => {}
                }
            }
            let tag = tag.ok_or_else(|| err("event.type", "missing or not a string".into()))?;
            Ok(Fields { tag, named })
        }
        other => Err(err("event", format!("expected array or map, got {other}"))),
    }
}

fn decode_event(v: Value) -> Result<VllmEvent, VllmEventError> {
    let mut f = fields_of(v)?;
    match f.tag.as_str() {
        "BlockStored" => {
            let block_hashes = hash_list(&f.take("block_hashes"), "block_hashes")?;
            let parent = f.take("parent_block_hash");
            let parent_block_hash = opt(&parent)
                .map(|p| block_hash(p, "parent_block_hash"))
                .transpose()?;
            let tokens = f.take("token_ids");
            let Value::Array(tokens) = tokens else {
                return Err(err("token_ids", format!("not an array: {tokens}")));
            };
            let token_ids = tokens
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| err("token_ids", format!("not a u32 token id: {t}")))
                })
                .collect::<Result<Vec<u32>, _>>()?;
            let bs = f.take("block_size");
            let block_size = bs
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| err("block_size", format!("not a positive u32: {bs}")))?;
            let lora = f.take("lora_id");
            let lora_id = opt(&lora)
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| err("lora_id", format!("not an integer: {v}")))
                })
                .transpose()?;
            let medium = opt_string(&f.take("medium"), "medium")?;
            let lora_name = opt_string(&f.take("lora_name"), "lora_name")?;
            let extra_keys = decode_extra_keys(f.take("extra_keys"))?;
            if !extra_keys.is_empty() && extra_keys.len() != block_hashes.len() {
                return Err(err(
                    "extra_keys",
                    format!(
                        "{} entries for {} blocks",
                        extra_keys.len(),
                        block_hashes.len()
                    ),
                ));
            }
            let group_idx = group_of(&f.take("group_idx"))?;
            Ok(VllmEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
            })
        }
        "BlockRemoved" => Ok(VllmEvent::BlockRemoved {
            block_hashes: hash_list(&f.take("block_hashes"), "block_hashes")?,
            medium: opt_string(&f.take("medium"), "medium")?,
            group_idx: group_of(&f.take("group_idx"))?,
        }),
        "AllBlocksCleared" => Ok(VllmEvent::AllBlocksCleared),
        other => Err(err("event.type", format!("unknown event class {other:?}"))),
    }
}

fn hash_list(v: &Value, field: &'static str) -> Result<Vec<u64>, VllmEventError> {
    let Value::Array(items) = v else {
        return Err(err(field, format!("not an array: {v}")));
    };
    items.iter().map(|h| block_hash(h, field)).collect()
}

/// A vLLM block hash as `u64` (see the module documentation).
fn block_hash(v: &Value, field: &'static str) -> Result<u64, VllmEventError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| err(field, format!("integer out of 64-bit range: {v}"))),
        Value::Binary(b) if b.len() >= 8 => {
            let tail: [u8; 8] = b[b.len() - 8..].try_into().expect("8 bytes");
            Ok(u64::from_be_bytes(tail))
        }
        _ => Err(err(
            field,
            format!("not an integer or a byte string of at least 8 bytes: {v}"),
        )),
    }
}

fn opt(v: &Value) -> Option<&Value> {
    (!v.is_nil()).then_some(v)
}

fn opt_string(v: &Value, field: &'static str) -> Result<Option<String>, VllmEventError> {
    match v {
        Value::Nil => Ok(None),
        Value::String(s) => s
            .as_str()
            .map(|s| Some(s.to_owned()))
            .ok_or_else(|| err(field, "not UTF-8".into())),
        other => Err(err(field, format!("not a string: {other}"))),
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn err(field: &'static str, reason: String) -> VllmEventError {
    VllmEventError::Payload {
        field,
        event: None,
        reason,
    }
}
