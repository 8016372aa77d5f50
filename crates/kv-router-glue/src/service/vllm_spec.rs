//! [`VllmEndpointSpec`]: one `--vllm-events` value of the router binary.
//!
//! Syntax: `ENDPOINT[,key=value]...`, e.g.
//! `tcp://decode-0:5557,replay=tcp://decode-0:5558,fingerprint=1234,role=decode,tp=2,block=16,worker=decode-0`.
//!
//! | key | meaning | default |
//! | --- | --- | --- |
//! | `replay` | the engine's ROUTER replay endpoint | none (every gap is a loss) |
//! | `fingerprint` | KV layout fingerprint (u64, decimal or `0x` hex) | required |
//! | `role` | `decode` or `prefill` | `decode` |
//! | `tp` | tensor-parallel size | `1` |
//! | `block` | tokens per KV block | `16` |
//! | `worker` | stable worker name (no whitespace, `=` or `"`) | the endpoint |
//!
//! vLLM does not publish an engine id, so the engine id is derived from the
//! worker name (XXH3-128): the same worker gets the same id after a router
//! restart.

use std::str::FromStr;

use kv_descriptor::{EngineId, LayoutFingerprint, Role};
use kv_lookup::WorkerKey;

use crate::vllm_events::{VllmSubscriberConfig, VllmWorker};

/// A parsed `--vllm-events` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmEndpointSpec {
    /// PUB endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// ROUTER replay endpoint.
    pub replay: Option<String>,
    /// The engine as the index sees it.
    pub worker: VllmWorker,
    /// Worker name the key and engine id derive from.
    pub worker_name: String,
}

/// Why a `--vllm-events` value was refused, naming the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VllmSpecError {
    /// The endpoint before the first comma is empty.
    #[error("`--vllm-events`: the endpoint is empty")]
    EmptyEndpoint,
    /// A `key=value` item without `=` or with a key not in the table.
    #[error("`--vllm-events`: unknown item `{item}` (keys: replay, fingerprint, role, tp, block, worker)")]
    UnknownKey {
        /// The item as written.
        item: String,
    },
    /// A value that does not parse.
    #[error("`--vllm-events` key `{key}`: invalid value {value:?} ({expected})")]
    InvalidValue {
        /// Key.
        key: &'static str,
        /// Value as written.
        value: String,
        /// What is expected.
        expected: &'static str,
    },
    /// A required key is absent.
    #[error("`--vllm-events`: key `{key}` is required")]
    Missing {
        /// Key.
        key: &'static str,
    },
    /// A key given more than once (which one was meant is unknown).
    #[error("`--vllm-events` key `{key}` is given more than once")]
    Repeated {
        /// Key.
        key: &'static str,
    },
}

/// Keys of a `--vllm-events` value, in the order of the module table.
const KEYS: [&str; 6] = ["replay", "fingerprint", "role", "tp", "block", "worker"];

/// `value` checked as a ZeroMQ endpoint (what the subscriber connects to),
/// so a typo is a flag error before the router connects to anything.
/// Only `tcp://`: zeromq is built with its TCP transport alone, and an
/// `ipc://` endpoint, which it parses, panicked at connect (trial h39, 5).
fn zmq_endpoint(key: &'static str, value: &str) -> Result<String, VllmSpecError> {
    match zeromq::Endpoint::from_str(value) {
        // vLLM's own endpoint setting is a bind address (`tcp://*:5557`);
        // copied here, `*` failed at start as a DNS lookup (trial h47, 6).
        Ok(zeromq::Endpoint::Tcp(zeromq::Host::Domain(host), _)) if host == "*" => {
            Err(VllmSpecError::InvalidValue {
                key,
                value: value.to_string(),
                expected: "the engine's host: `*` is the address vLLM binds (tcp://*:5557); \
                           connect to where it runs (tcp://127.0.0.1:5557, tcp://decode-0:5557)",
            })
        }
        Ok(zeromq::Endpoint::Tcp(..)) => Ok(value.to_string()),
        _ => Err(VllmSpecError::InvalidValue {
            key,
            value: value.to_string(),
            expected: "a ZeroMQ TCP endpoint: tcp://HOST:PORT (ipc:// is not built in)",
        }),
    }
}

impl FromStr for VllmEndpointSpec {
    type Err = VllmSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut items = s.split(',');
        let endpoint = items.next().unwrap_or("").trim().to_string();
        if endpoint.is_empty() {
            return Err(VllmSpecError::EmptyEndpoint);
        }
        let endpoint = zmq_endpoint("endpoint", &endpoint)?;
        let (mut replay, mut fingerprint, mut role, mut tp, mut block, mut name) =
            (None, None, Role::Decode, 1u32, 16u32, None);
        let mut seen: Vec<&str> = Vec::new();
        for item in items {
            let Some((k, v)) = item.split_once('=') else {
                return Err(VllmSpecError::UnknownKey { item: item.into() });
            };
            if let Some(key) = KEYS.into_iter().find(|key| *key == k.trim()) {
                if seen.contains(&key) {
                    return Err(VllmSpecError::Repeated { key });
                }
                seen.push(key);
            }
            let invalid = |key, expected| VllmSpecError::InvalidValue {
                key,
                value: v.to_string(),
                expected,
            };
            let positive = |key| {
                v.parse::<u32>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| invalid(key, "an integer >= 1"))
            };
            match k.trim() {
                "replay" => replay = Some(zmq_endpoint("replay", v)?),
                "fingerprint" => {
                    let parsed = match v.strip_prefix("0x") {
                        Some(hex) => u64::from_str_radix(hex, 16),
                        None => v.parse(),
                    };
                    fingerprint = Some(parsed.map_err(|_| invalid("fingerprint", "a u64"))?);
                }
                "role" => {
                    role = match v {
                        "decode" => Role::Decode,
                        "prefill" => Role::Prefill,
                        _ => return Err(invalid("role", "decode or prefill")),
                    }
                }
                "tp" => tp = positive("tp")?,
                "block" => block = positive("block")?,
                // A name a log line can carry as one logfmt field (trial
                // h42, 5: `worker=decode 0 restarts=99` read as two fields).
                "worker"
                    if !v.is_empty()
                        && !v.contains(|c: char| c.is_whitespace() || c == '=' || c == '"') =>
                {
                    name = Some(v.to_string())
                }
                "worker" => {
                    return Err(invalid(
                        "worker",
                        "a non-empty name without spaces, `=` or `\"`",
                    ))
                }
                _ => return Err(VllmSpecError::UnknownKey { item: item.into() }),
            }
        }
        let fingerprint = fingerprint.ok_or(VllmSpecError::Missing { key: "fingerprint" })?;
        let worker_name = name.unwrap_or_else(|| endpoint.clone());
        let engine = EngineId(uuid::Uuid::from_u128(xxhash_rust::xxh3::xxh3_128(
            worker_name.as_bytes(),
        )));
        Ok(Self {
            worker: VllmWorker {
                key: vllm_worker_key(&worker_name),
                engine,
                role,
                layout_fingerprint: LayoutFingerprint(fingerprint),
                tp_size: tp,
                tokens_per_block: block,
            },
            endpoint,
            replay,
            worker_name,
        })
    }
}

/// The index's worker key of a `--vllm-events` stream named `worker_name`:
/// XXH3-64 of the name with seed [`VLLM_WORKER_KEY_SEED`], apart from the
/// key of an announced worker (XXH3-64 of its `worker_key`, seed 0) of any
/// name but by a 64-bit hash collision. With the bare name, a NATS-announced
/// worker of the same name replaced the vLLM engine in the index for good,
/// silently (trial h42, 11); with a `vllm:` prefix, one named `vllm:` plus
/// the name did (trial h44, 2).
pub fn vllm_worker_key(worker_name: &str) -> WorkerKey {
    WorkerKey(xxhash_rust::xxh3::xxh3_64_with_seed(
        worker_name.as_bytes(),
        VLLM_WORKER_KEY_SEED,
    ))
}

/// Seed of [`vllm_worker_key`] (`"vllm"` in ASCII).
pub const VLLM_WORKER_KEY_SEED: u64 = 0x766c_6c6d;

impl VllmEndpointSpec {
    /// The subscriber configuration (defaults of [`VllmSubscriberConfig::new`]).
    pub fn subscriber_config(&self) -> VllmSubscriberConfig {
        VllmSubscriberConfig::new(self.endpoint.clone(), self.replay.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_spec_parses_and_ids_follow_the_worker_name() {
        let a: VllmEndpointSpec =
            "tcp://d0:5557,replay=tcp://d0:5558,fingerprint=0x10,role=prefill,tp=2,block=32,worker=d0"
                .parse()
                .unwrap();
        assert_eq!(a.endpoint, "tcp://d0:5557");
        assert_eq!(a.replay.as_deref(), Some("tcp://d0:5558"));
        assert_eq!(a.worker.layout_fingerprint, LayoutFingerprint(16));
        assert_eq!(a.worker.role, Role::Prefill);
        assert_eq!((a.worker.tp_size, a.worker.tokens_per_block), (2, 32));
        // Same worker name on another endpoint: same identity (restart-stable).
        let b: VllmEndpointSpec = "tcp://d0-new:1,fingerprint=16,worker=d0".parse().unwrap();
        assert_eq!(a.worker.engine, b.worker.engine);
        assert_eq!(a.worker.key, b.worker.key);
        let c: VllmEndpointSpec = "tcp://d1:1,fingerprint=16".parse().unwrap();
        assert_ne!(a.worker.engine, c.worker.engine);
        assert_eq!(c.worker_name, "tcp://d1:1");
        assert_eq!(c.worker.role, Role::Decode);
    }

    /// Trial h42, 11: the index key of a vLLM stream is not the one an
    /// announced worker of the same name gets (XXH3-64 of its
    /// `worker_key`), which used to replace the vLLM engine for good.
    #[test]
    fn a_vllm_worker_key_differs_from_an_announced_workers_of_the_same_name() {
        let a: VllmEndpointSpec = "tcp://d0:1,fingerprint=1,worker=decode-0".parse().unwrap();
        let announced = WorkerKey(xxhash_rust::xxh3::xxh3_64(b"decode-0"));
        assert_ne!(a.worker.key, announced);
        assert_eq!(a.worker.key, vllm_worker_key("decode-0"));
        // Nor of one named with any prefix (trial h44, 2).
        for name in ["vllm:decode-0", "decode-0\0", ""] {
            assert_ne!(
                a.worker.key,
                WorkerKey(xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
            );
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = |s: &str| s.parse::<VllmEndpointSpec>().unwrap_err();
        assert_eq!(err(",fingerprint=1"), VllmSpecError::EmptyEndpoint);
        assert_eq!(
            err("tcp://x:1"),
            VllmSpecError::Missing { key: "fingerprint" }
        );
        assert!(matches!(
            err("tcp://x:1,fingerprint=1,tp=0"),
            VllmSpecError::InvalidValue { key: "tp", .. }
        ));
        assert!(matches!(
            err("tcp://x:1,fingerprint=1,role=router"),
            VllmSpecError::InvalidValue { key: "role", .. }
        ));
        // Trial h42, 5: a name a logfmt line cannot carry as one field.
        for name in ["decode 0", "a=b", "d\"0", "d\t0"] {
            assert!(matches!(
                err(&format!("tcp://x:1,fingerprint=1,worker={name}")),
                VllmSpecError::InvalidValue { key: "worker", .. }
            ));
        }
        assert_eq!(
            err("tcp://x:1,fingerprint=1,colour=red"),
            VllmSpecError::UnknownKey {
                item: "colour=red".into()
            }
        );
    }

    /// A key given twice is refused, not silently taken from its last
    /// occurrence (`tcp://d0:5557,fingerprint=1,fingerprint=2` started a
    /// router with fingerprint 2).
    #[test]
    fn a_repeated_key_is_refused_naming_it() {
        for (spec, key) in [
            ("tcp://x:1,fingerprint=1,fingerprint=2", "fingerprint"),
            ("tcp://x:1,fingerprint=1,role=decode,role=prefill", "role"),
            (
                "tcp://x:1,replay=tcp://x:2,fingerprint=1,replay=tcp://x:3",
                "replay",
            ),
        ] {
            let e = spec
                .parse::<VllmEndpointSpec>()
                .expect_err(&format!("{spec} must be refused"));
            let text = e.to_string();
            assert!(text.contains(&format!("key `{key}`")), "{text}");
            assert!(text.contains("more than once"), "{text}");
        }
    }

    /// An endpoint ZeroMQ cannot parse is a flag error (exit 2 naming the
    /// key), not a failed connection at start (exit 1): `notanendpoint`
    /// got as far as connecting to NATS and exited 1.
    #[test]
    fn an_endpoint_zeromq_cannot_parse_is_refused_naming_the_key() {
        for (spec, key) in [
            ("notanendpoint,fingerprint=1", "endpoint"),
            ("http://x:1,fingerprint=1", "endpoint"),
            ("tcp://x,fingerprint=1", "endpoint"),
            ("tcp://x:99999,fingerprint=1", "endpoint"),
            ("tcp://x:1,replay=x:2,fingerprint=1", "replay"),
            ("tcp://x:1,replay=,fingerprint=1", "replay"),
            // Parsed by zeromq but not built in: it panicked at connect.
            ("ipc:///tmp/vllm.sock,fingerprint=1", "endpoint"),
            ("tcp://x:1,replay=ipc:///tmp/r.sock,fingerprint=1", "replay"),
            // vLLM's bind address, copied (trial h47, 6).
            ("tcp://*:5557,fingerprint=1", "endpoint"),
            ("tcp://x:1,replay=tcp://*:5558,fingerprint=1", "replay"),
        ] {
            match spec.parse::<VllmEndpointSpec>() {
                Err(e @ VllmSpecError::InvalidValue { key: k, .. }) => {
                    assert_eq!(k, key, "{spec}: {e}");
                }
                other => panic!("{spec}: {other:?}"),
            }
        }
        for ok in [
            "tcp://127.0.0.1:5557,fingerprint=1",
            "tcp://decode-0:5557,replay=tcp://decode-0:5558,fingerprint=1",
        ] {
            ok.parse::<VllmEndpointSpec>()
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }
}
