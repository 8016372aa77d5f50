//! The harness's control channel to one worker process: a Unix stream
//! socket the worker binds (its path is in the worker's hello line), one
//! request at a time, each frame a 4-byte big-endian length followed by a
//! MessagePack ([`rmp_serde`], named fields) [`Command`] or [`Reply`].
//!
//! Why not NATS: the control traffic must survive the faults this module
//! injects on the NATS server and the router, so it travels beside them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use kv_descriptor::EngineId;
use serde::{Deserialize, Serialize};

use super::ClusterError;

/// Largest frame either side accepts (a 4k-token prompt's sealed KV at the
/// reference model's 12 KiB per block and rank is well below).
pub const MAX_FRAME_BYTES: usize = 64 << 20;

/// What the harness asks a worker to do.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Command {
    /// Prefill worker: advise through the router, fetch the hinted prefix
    /// (if any), compute the rest of `prompt`.
    Prefill {
        /// Request id (also the advise request id and the hint's message id).
        request_id: String,
        /// Prompt token ids.
        prompt: Vec<u32>,
        /// When the hint's donor is this engine, stop inside the fetch (after
        /// the pin, at the delivery's first liveness probe): create
        /// `<hold>.in`, wait for `<hold>.go` (at most 20 s), then probe.
        hold_if_donor: Option<(EngineId, PathBuf)>,
    },
    /// Decode worker: continue from the prefilled sealed blocks, generate,
    /// retain every sealed block of prompt + output in the bank.
    Decode {
        /// Prompt token ids.
        prompt: Vec<u32>,
        /// Sealed blocks of the prompt's cache from the prefill, one byte
        /// vector per TP rank (`blocks x rank_block_bytes`).
        parts: Vec<serde_bytes::ByteBuf>,
        /// First output token (the prefill's argmax).
        first_token: u32,
        /// Output tokens in total.
        max_new: u32,
    },
    /// Close the agent (record deleted, bank closed), report leaks, exit.
    Shutdown,
}

/// How the advise round trip of one prefill ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AdviseStatus {
    /// The router decided; `admitted` when it attached a hint.
    Decided {
        /// A `kv.fetch_gpu@1.0` hint came back.
        admitted: bool,
    },
    /// The router refused the request (unknown target, draining, ...).
    Refused(String),
    /// No reply (router or NATS down, timeout): the prefill recomputed.
    Unavailable(String),
}

/// A worker's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Reply {
    /// Result of [`Command::Prefill`].
    Prefilled {
        /// Argmax of the last prompt token's logits.
        first_token: u32,
        /// Those logits (compared bit for bit against OFF).
        first_logits: Vec<f32>,
        /// Sealed blocks of the prompt's cache, one byte vector per rank.
        parts: Vec<serde_bytes::ByteBuf>,
        /// Prompt tokens computed here.
        computed_tokens: u64,
        /// Prompt tokens whose K/V was fetched from a donor (0: none).
        fetched_tokens: u64,
        /// Why an admitted hint did not complete (the prefill recomputed).
        fallback: Option<String>,
        /// The advise round trip.
        advise: AdviseStatus,
        /// Its duration in microseconds.
        advise_us: u64,
        /// Donor of the hint, when one came back.
        donor: Option<EngineId>,
        /// The fetch stopped at `hold_if_donor`'s probe.
        held: bool,
    },
    /// Result of [`Command::Decode`].
    Decoded {
        /// Output tokens (the first is the prefill's).
        output: Vec<u32>,
    },
    /// Result of [`Command::Shutdown`]: what grew in the worker since its
    /// agent opened (`kv_bank::leaks`), one line each; empty is no leak.
    Closed {
        /// Leak descriptions.
        leaks: Vec<String>,
    },
    /// The command failed (the message names the step).
    Error(String),
}

/// Writes one frame.
///
/// # Errors
/// [`ClusterError::Control`] for an encoding or socket error.
pub fn write_frame<T: Serialize>(s: &mut UnixStream, msg: &T) -> Result<(), ClusterError> {
    let bytes = rmp_serde::to_vec_named(msg).map_err(|e| ClusterError::Control {
        step: "encode",
        reason: e.to_string(),
    })?;
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME_BYTES)
        .ok_or(ClusterError::Control {
            step: "encode",
            reason: format!("frame of {} bytes over {MAX_FRAME_BYTES}", bytes.len()),
        })?;
    let io = |e: std::io::Error| ClusterError::Control {
        step: "write",
        reason: e.to_string(),
    };
    s.write_all(&len.to_be_bytes()).map_err(io)?;
    s.write_all(&bytes).map_err(io)
}

/// Reads one frame; `Ok(None)` at a clean end of stream.
///
/// # Errors
/// [`ClusterError::Control`] for a socket error, an oversized length or a
/// payload that does not decode as `T`.
pub fn read_frame<T: for<'de> Deserialize<'de>>(
    s: &mut UnixStream,
) -> Result<Option<T>, ClusterError> {
    let io = |e: std::io::Error| ClusterError::Control {
        step: "read",
        reason: e.to_string(),
    };
    let mut len = [0u8; 4];
    match s.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io(e)),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_FRAME_BYTES {
        return Err(ClusterError::Control {
            step: "read",
            reason: format!("frame length {n} over {MAX_FRAME_BYTES}"),
        });
    }
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).map_err(io)?;
    rmp_serde::from_slice(&buf)
        .map(Some)
        .map_err(|e| ClusterError::Control {
            step: "decode",
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_lengths_are_refused() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let cmd = Command::Decode {
            prompt: vec![1, 2, 3],
            parts: vec![serde_bytes::ByteBuf::from(vec![7u8; 5])],
            first_token: 9,
            max_new: 4,
        };
        write_frame(&mut a, &cmd).unwrap();
        match read_frame::<Command>(&mut b).unwrap() {
            Some(Command::Decode {
                prompt,
                parts,
                first_token,
                max_new,
            }) => {
                assert_eq!(prompt, [1, 2, 3]);
                assert_eq!(parts[0].as_slice(), [7u8; 5]);
                assert_eq!((first_token, max_new), (9, 4));
            }
            other => panic!("{other:?}"),
        }
        a.write_all(&(MAX_FRAME_BYTES as u32 + 1).to_be_bytes())
            .unwrap();
        let e = read_frame::<Command>(&mut b).unwrap_err();
        assert!(
            matches!(e, ClusterError::Control { step: "read", .. }),
            "{e}"
        );
        drop(a);
        assert!(read_frame::<Command>(&mut b).unwrap().is_none());
    }
}
