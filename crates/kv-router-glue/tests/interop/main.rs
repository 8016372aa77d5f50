//! Interop and observability tests of kv-router-glue: vLLM KV events over
//! real ZMQ between processes, Dynamo's readers on our wire types, metrics
//! scraped over HTTP, tracing spans, and the wire-format reference.
//!
//! One test binary (one link) for all of them; the vLLM tests re-execute it
//! as the publisher child process.

mod child;
mod dynamo;
mod vllm_ingest;
mod vllm_real;
mod vllm_recorded;
mod vllm_wire;
mod vllm_zmq;
mod wire_doc;
