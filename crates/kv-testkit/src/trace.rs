//! The Mooncake conversation trace: loading, validation and synthetic tokens.
//!
//! Format (Mooncake FAST'25 trace release, see `data/traces/README.md`): one
//! JSON object per line with `timestamp` (ms from the first request),
//! `input_length` and `output_length` (tokens) and `hash_ids` (one id per
//! 512-token prompt block; equal ids at the same position mean the same
//! prefix, each id covering its block and everything before it).
//!
//! The trace carries no text. [`synthetic_tokens`] expands every id into 512
//! deterministic token ids derived from `(id, position in block)`, so that an
//! engine with any block size can re-hash the prompt (with
//! [`kv_descriptor::sequence_hashes`]) and equal trace prefixes give equal
//! engine block hashes.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Tokens covered by one trace hash id (the trace's block size).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Why a trace could not be loaded. Nothing is returned on error: a trace is
/// loaded whole or not at all.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// File that failed.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A line is not a JSON object with the four trace fields.
    #[error("trace line {line}: not a trace record: {reason}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// Decoder message (names the missing or mistyped field).
        reason: String,
    },
    /// A record is well formed but inconsistent.
    #[error("trace line {line}: invalid `{field}`: {reason}")]
    Field {
        /// 1-based line number.
        line: usize,
        /// Offending field (`hash_ids`, `timestamp`, `input_length`).
        field: &'static str,
        /// What is wrong, with the values seen.
        reason: String,
    },
    /// A [`TraceError::Parse`] or [`TraceError::Field`] error of the file
    /// [`MooncakeTrace::load`] read.
    #[error("{path}: {source}", path = path.display())]
    InFile {
        /// File the bad line is in.
        path: PathBuf,
        /// The line's error.
        source: Box<TraceError>,
    },
}

/// One request of the trace.
///
/// ```
/// use kv_testkit::trace::TraceRequest;
/// let r: TraceRequest = serde_json::from_str(
///     r#"{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [0, 1]}"#,
/// ).unwrap();
/// assert_eq!((r.timestamp_ms, r.input_length, r.hash_ids.len()), (5, 600, 2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in ms after the first request (`timestamp` in the file).
    #[serde(rename = "timestamp", alias = "timestamp_ms")]
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// One id per 512-token prompt block, `ceil(input_length / 512)` of them.
    pub hash_ids: Vec<u64>,
}

/// Largest `input_length` or `output_length` a trace request may have, in
/// tokens (4 Mi: 32x the longest context of the models the traces come
/// from). Bounds what the replay allocates per request, so one hostile line
/// cannot make it build gigabytes of block ids.
pub const MAX_REQUEST_TOKENS: u32 = 1 << 22;

impl TraceRequest {
    /// The request's prompt as synthetic tokens (see [`synthetic_tokens`]).
    pub fn prompt_tokens(&self) -> Vec<u32> {
        synthetic_tokens(&self.hash_ids, self.input_length as usize)
    }

    fn validate(&self, line: usize) -> Result<(), TraceError> {
        if self.input_length == 0 {
            return Err(TraceError::Field {
                line,
                field: "input_length",
                reason: "must be at least 1".into(),
            });
        }
        if self.input_length > MAX_REQUEST_TOKENS || self.output_length > MAX_REQUEST_TOKENS {
            let (field, v) = if self.input_length > MAX_REQUEST_TOKENS {
                ("input_length", self.input_length)
            } else {
                ("output_length", self.output_length)
            };
            return Err(TraceError::Field {
                line,
                field,
                reason: format!("{v} tokens, above the limit of {MAX_REQUEST_TOKENS}"),
            });
        }
        let want = (self.input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
        if self.hash_ids.len() != want {
            return Err(TraceError::Field {
                line,
                field: "hash_ids",
                reason: format!(
                    "{} ids for input_length {} (expected ceil(input_length / {TRACE_BLOCK_TOKENS}) = {want})",
                    self.hash_ids.len(),
                    self.input_length
                ),
            });
        }
        Ok(())
    }
}

/// A loaded, validated trace: requests in file order, timestamps non-decreasing.
///
/// ```
/// use kv_testkit::trace::{default_trace_path, MooncakeTrace};
/// let t = MooncakeTrace::load(default_trace_path()).unwrap();
/// assert_eq!(t.len(), 12_031);
/// assert_eq!(t.requests()[0].hash_ids[0], 0);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MooncakeTrace {
    requests: Vec<TraceRequest>,
}

impl MooncakeTrace {
    /// Reads and validates a JSONL trace file. Blank lines are skipped.
    ///
    /// # Errors
    /// [`TraceError::Io`] if the file cannot be read; otherwise
    /// [`TraceError::InFile`] naming `path`, around a [`TraceError::Parse`]
    /// for a line that is not a record or a [`TraceError::Field`] for a record
    /// whose `hash_ids` count is not `ceil(input_length / 512)`, an
    /// `input_length` of 0, or a `timestamp` smaller than the previous line's.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, TraceError> {
        let path = path.as_ref();
        let io = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        Self::from_reader(std::io::BufReader::new(file)).map_err(|e| match e {
            TraceError::Io { source, .. } => io(source),
            other => TraceError::InFile {
                path: path.to_path_buf(),
                source: Box::new(other),
            },
        })
    }

    /// Same as [`MooncakeTrace::load`] over any reader (errors name no path).
    ///
    /// # Errors
    /// As [`MooncakeTrace::load`].
    pub fn from_reader(reader: impl BufRead) -> Result<Self, TraceError> {
        let mut requests = Vec::new();
        let mut last_ts = 0u64;
        for (i, line) in reader.lines().enumerate() {
            let line_no = i + 1;
            let line = line.map_err(|source| TraceError::Io {
                path: PathBuf::new(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let r: TraceRequest = serde_json::from_str(&line).map_err(|e| TraceError::Parse {
                line: line_no,
                reason: e.to_string(),
            })?;
            r.validate(line_no)?;
            if r.timestamp_ms < last_ts {
                return Err(TraceError::Field {
                    line: line_no,
                    field: "timestamp",
                    reason: format!(
                        "{} is before the previous request's {last_ts}",
                        r.timestamp_ms
                    ),
                });
            }
            last_ts = r.timestamp_ms;
            requests.push(r);
        }
        Ok(Self { requests })
    }

    /// Builds a trace from requests already in memory (validated the same way;
    /// `line` in errors is the 1-based index).
    ///
    /// # Errors
    /// As [`MooncakeTrace::load`].
    pub fn from_requests(requests: Vec<TraceRequest>) -> Result<Self, TraceError> {
        let mut last_ts = 0u64;
        for (i, r) in requests.iter().enumerate() {
            r.validate(i + 1)?;
            if r.timestamp_ms < last_ts {
                return Err(TraceError::Field {
                    line: i + 1,
                    field: "timestamp",
                    reason: format!(
                        "{} is before the previous request's {last_ts}",
                        r.timestamp_ms
                    ),
                });
            }
            last_ts = r.timestamp_ms;
        }
        Ok(Self { requests })
    }

    /// Requests in arrival order.
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }
    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }
    /// True when the trace holds no request.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
    /// The first `n` requests (all if fewer): a slice for fast tests.
    pub fn head(&self, n: usize) -> Self {
        Self {
            requests: self.requests[..n.min(self.requests.len())].to_vec(),
        }
    }
}

/// Variable naming a folder laid out like the workspace's `data/` (the trace
/// at [`TRACE_IN_DATA_DIR`] below it). The GPU bundle's `run.sh` sets it to
/// the bundle's own copy, so kvq finds its data outside a checkout and
/// independently of the working directory.
pub const DATA_DIR_ENV: &str = "KVQ_DATA_DIR";

/// The project's trace, relative to the data folder (`data/` of the workspace,
/// or [`DATA_DIR_ENV`]).
pub const TRACE_IN_DATA_DIR: &str = "traces/mooncake_conversation_trace.jsonl";

/// The project's copy of the trace: `data/traces/mooncake_conversation_trace.jsonl`
/// at the workspace root (resolved from this crate's manifest directory at
/// compile time, so it works from any working directory of this checkout).
pub fn default_trace_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data")
        .join(TRACE_IN_DATA_DIR)
        .components()
        .collect()
}

/// The trace a run reads when none is given: [`TRACE_IN_DATA_DIR`] below
/// `data_dir` (the value of [`DATA_DIR_ENV`]) when that is set and not empty,
/// else [`default_trace_path`]. Never the working directory: a binary copied
/// out of the checkout must not read whatever `data/` happens to be there.
///
/// ```
/// use std::path::{Path, PathBuf};
/// use kv_testkit::trace::{default_trace_path, trace_path_in};
/// assert_eq!(
///     trace_path_in(Some(Path::new("/b/data").as_os_str())),
///     PathBuf::from("/b/data/traces/mooncake_conversation_trace.jsonl")
/// );
/// assert_eq!(trace_path_in(None), default_trace_path());
/// ```
pub fn trace_path_in(data_dir: Option<&std::ffi::OsStr>) -> PathBuf {
    match data_dir {
        Some(d) if !d.is_empty() => Path::new(d).join(TRACE_IN_DATA_DIR),
        _ => default_trace_path(),
    }
}

/// SplitMix64 finalizer (Steele, Lea, Flood 2014): a cheap bijective mixer
/// whose output bits all depend on every input bit.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The synthetic token at `position` (0..512) of the block named `hash_id`:
/// the low 32 bits of `splitmix64(splitmix64(hash_id) ^ position)`.
pub fn synthetic_token(hash_id: u64, position: usize) -> u32 {
    splitmix64(splitmix64(hash_id) ^ position as u64) as u32
}

/// Expands trace hash ids into `input_length` synthetic prompt tokens.
///
/// Id `k` of `hash_ids` yields tokens `k*512 .. (k+1)*512`, token `j` of the
/// block being [`synthetic_token`]`(id, j)`; the result is truncated to
/// `input_length` (the last trace block is usually partial). Token ids span
/// the whole `u32` range; map them into a model's vocabulary before feeding
/// a model. If `input_length` exceeds `hash_ids.len() * 512` the output is
/// only `hash_ids.len() * 512` long.
///
/// ```
/// use kv_testkit::trace::synthetic_tokens;
/// let a = synthetic_tokens(&[0, 1], 600);
/// let b = synthetic_tokens(&[0, 2], 600);
/// assert_eq!(a.len(), 600);
/// assert_eq!(a[..512], b[..512]); // same first id, same first block
/// assert_ne!(a[512..], b[512..]);
/// ```
pub fn synthetic_tokens(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let n = input_length.min(hash_ids.len() * TRACE_BLOCK_TOKENS);
    let mut out = Vec::with_capacity(n);
    for &id in hash_ids {
        let seed = splitmix64(id);
        let take = (n - out.len()).min(TRACE_BLOCK_TOKENS);
        out.extend((0..take).map(|j| splitmix64(seed ^ j as u64) as u32));
        if out.len() == n {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_whole_project_trace() {
        let t = MooncakeTrace::load(default_trace_path()).unwrap();
        assert_eq!(t.len(), 12_031);
        let r0 = &t.requests()[0];
        assert_eq!(
            (r0.timestamp_ms, r0.input_length, r0.output_length),
            (0, 6758, 500)
        );
        assert_eq!(r0.hash_ids, (0..14).collect::<Vec<u64>>());
        let total: u64 = t.requests().iter().map(|r| u64::from(r.input_length)).sum();
        assert_eq!(total, 144_793_823);
        assert_eq!(t.requests().last().unwrap().timestamp_ms, 3_536_999);
    }

    #[test]
    fn rejects_inconsistent_hash_ids_naming_field_and_line() {
        let text = "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":1,\"input_length\":513,\"output_length\":1,\"hash_ids\":[1]}\n";
        let e = MooncakeTrace::from_reader(text.as_bytes()).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("line 2") && msg.contains("hash_ids"), "{msg}");
    }

    #[test]
    fn rejects_a_hostile_output_length_before_allocating() {
        // One line with a 4-billion-token output once made the replay build
        // gigabytes of block ids before any check.
        let text = "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":1,\"input_length\":10,\"output_length\":4294967295,\"hash_ids\":[1]}\n";
        let msg = MooncakeTrace::from_reader(text.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("line 2") && msg.contains("output_length") && msg.contains("limit"),
            "{msg}"
        );
    }

    #[test]
    fn rejects_decreasing_timestamp_and_missing_field() {
        let text = "{\"timestamp\":5,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n\
                    {\"timestamp\":4,\"input_length\":1,\"output_length\":1,\"hash_ids\":[1]}\n";
        let e = MooncakeTrace::from_reader(text.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("`timestamp`"), "{e}");
        let e = MooncakeTrace::from_reader("{\"timestamp\":5,\"input_length\":1}".as_bytes())
            .unwrap_err();
        assert!(e.to_string().contains("output_length"), "{e}");
        let e = MooncakeTrace::load("/nonexistent/trace.jsonl").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/trace.jsonl"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(
            &bad,
            "{\"timestamp\":5,\"input_length\":0,\"output_length\":1,\"hash_ids\":[]}\n",
        )
        .unwrap();
        let e = MooncakeTrace::load(&bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: trace line 1: invalid `input_length`: must be at least 1",
                bad.display()
            )
        );
    }

    #[test]
    fn synthetic_tokens_are_deterministic_prefix_preserving_and_truncated() {
        let a = synthetic_tokens(&[7, 8, 9], 1100);
        assert_eq!(a.len(), 1100);
        assert_eq!(a, synthetic_tokens(&[7, 8, 9], 1100));
        assert_eq!(a[..1024], synthetic_tokens(&[7, 8], 1024)[..]);
        assert_eq!(a[1024], synthetic_token(9, 0));
        assert_eq!(a[5], synthetic_token(7, 5));
        // Different ids give different blocks (no accidental equality).
        assert_ne!(synthetic_tokens(&[1], 512), synthetic_tokens(&[2], 512));
        // Positions inside one block differ.
        let b = synthetic_tokens(&[3], 512);
        let distinct: std::collections::HashSet<_> = b.iter().collect();
        assert!(distinct.len() > 500);
        // Asking for more than the ids cover stops at the ids.
        assert_eq!(synthetic_tokens(&[1], 2000).len(), 512);
    }

    #[test]
    fn shared_trace_prefix_gives_shared_engine_block_hashes() {
        let a = synthetic_tokens(&[0, 1, 2], 1500);
        let b = synthetic_tokens(&[0, 1, 5], 1500);
        let ha = kv_descriptor::sequence_hashes(&a, 16);
        let hb = kv_descriptor::sequence_hashes(&b, 16);
        // 1024 shared tokens = 64 shared 16-token blocks, then divergence.
        assert_eq!(ha[..64], hb[..64]);
        assert_ne!(ha[64], hb[64]);
    }
}
