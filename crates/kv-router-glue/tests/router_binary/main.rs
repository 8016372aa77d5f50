//! The `kv-reuse-router` binary as a process, against a real nats-server:
//! ready line, typed refusals over NATS, a prefill worker's announcement
//! making it an advise target, `/healthz`, `/metrics`, SIGTERM drain, and
//! the inventory rebuild of a router started (or SIGKILLed and restarted)
//! after a donor went idle (issue 18).
//!
//! `process.rs` runs the binary (spawn, HTTP, signals); `lifecycle.rs` has
//! the tests of start, serve, stop and configuration errors; `donors.rs`
//! those with worker and donor processes (rebuild, outage, vLLM, TLS);
//! `vllm_endpoint.rs` a `--vllm-events` endpoint lost after the start;
//! `advise_subject.rs` routers of two namespaces on their own advise subjects;
//! `env_names.rs` an unknown `KV_ROUTER_*` variable refused at start;
//! `directory_bucket.rs` the directory bucket deleted under a router, or
//! absent at start for a router that may not create it.

#[path = "../agents_common/mod.rs"]
mod agents_common;

mod advise_subject;
mod directory_bucket;
mod donors;
mod env_names;
mod lifecycle;
mod process;
mod vllm_endpoint;
