//! A local cluster of separate processes serving multi-turn conversations
//! with decode-to-prefill reuse (issue 18, "Local cluster"; `docs/cluster.md`):
//! a `nats-server` with JetStream, a router service process, two decode
//! and two prefill worker processes, each running kv-testkit's reference
//! model, all started by [`run`] (the harness, which plays the frontend).
//!
//! - Decode workers ([`worker`], role [`DECODE_ROLE`]) hold a
//!   [`kv_router_glue::DonorAgent`]: a host-shm bank on the CPU profile, a
//!   CUDA device bank (served to the prefill over CUDA IPC) on the GPU
//!   profile; its record goes to the NATS directory, its KV events and
//!   announcements to the NATS event plane.
//! - Prefill workers (role [`PREFILL_ROLE`]) ask the router for advice
//!   over NATS request/reply (`kv_reuse.advise`, msgpack
//!   [`kv_router_glue::service::AdviseRequest`]), fetch the hinted prefix
//!   through a [`kv_router_glue::TargetAgent`] and compute the rest.
//! - The router ([`router`], role [`ROUTER_ROLE`]) builds its index, donor
//!   directory and worker registry only from what NATS carries, and serves
//!   advise with [`kv_router_glue::service::RouterService`].
//!
//! Every request's first logits (bitwise) and output tokens are compared
//! with OFF, computed by the harness with the same model and no reuse. In
//! the same run the harness injects, between phases of fresh
//! conversations: a donor restarted under its worker key (new
//! incarnation), a decode process SIGKILLed while a prefill is inside a
//! fetch from it, the router SIGKILLed and restarted, and nats-server
//! restarted; after each, the previous phase's conversations take one more
//! turn (their donors may be gone) and a new phase must fetch again.
//!
//! Every child is a [`kv_bank::child_process::ChildProcess`] (killed when
//! the harness drops it or dies, `PR_SET_PDEATHSIG`; stdin is a lifeline).

pub mod control;
mod harness;
pub mod router;
pub mod worker;

use std::time::Duration;

use kv_descriptor::{GpuIdentity, KvLayout};
use kv_router_glue::{EnvSnapshot, ReuseSettings, SettingsLoader};
use serde::{Deserialize, Serialize};

pub use harness::{run, ClusterOptions, RouterProcess, ROUTER_BIN_ENV};

use crate::model::ModelConfig;

/// `kvq child cluster-decode ...`: a decode worker process.
pub const DECODE_ROLE: &str = "cluster-decode";
/// `kvq child cluster-prefill ...`: a prefill worker process.
pub const PREFILL_ROLE: &str = "cluster-prefill";
/// `kvq child cluster-router ...`: the router service process.
pub const ROUTER_ROLE: &str = "cluster-router";

/// Namespace of every subject of the cluster (`kv.cluster.*`).
pub const NAMESPACE: &str = "cluster";
/// JetStream key-value bucket of the donor directory.
pub const DIRECTORY_BUCKET: &str = "kv_cluster_donors";
/// Bank owner lease of the decode workers: short, so a SIGKILLed decode's
/// bank lapses (and is reclaimed) within the run.
pub const BANK_LEASE: Duration = Duration::from_secs(3);
/// How long one put of a donor record is valid (at most [`BANK_LEASE`]).
pub const RECORD_TTL: Duration = Duration::from_secs(3);
/// Workers announce (and donors tick) this often.
pub const ANNOUNCE_PERIOD: Duration = Duration::from_millis(250);

/// Why the cluster could not run (a failed check is not an error: it is in
/// the [`ClusterReport`]).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Something the cluster needs is absent here (nats-server): skip.
    #[error("skipped: {0}")]
    Skipped(String),
    /// A child process did not start or did not say hello.
    #[error("process `{process}`: {reason}")]
    Process {
        /// Worker key or `router`, `nats-server`.
        process: String,
        /// What happened.
        reason: String,
    },
    /// The control channel to a worker failed at `step`.
    #[error("control `{step}`: {reason}")]
    Control {
        /// `encode`, `write`, `read`, `decode`, `connect`.
        step: &'static str,
        /// The error.
        reason: String,
    },
    /// A worker answered a command with an error or the wrong reply.
    #[error("worker `{worker}`: {reason}")]
    Worker {
        /// Worker key.
        worker: String,
        /// Its message.
        reason: String,
    },
    /// A child role was started with bad arguments.
    #[error("bad argument `{field}`: {reason}")]
    Argument {
        /// The argument.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Fetches after one recovery (record.json `cluster.recoveries[]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// `donor_restarted_new_incarnation`, `decode_killed_mid_fetch`,
    /// `router_restarted`, `nats_server_restarted`.
    pub fault: String,
    /// Completed fetches in the requests after the recovery (until the next fault).
    pub fetches_after: u64,
    /// Requests in that span.
    pub requests_after: u64,
    /// Fetches admitted in that span that fell back.
    pub fallbacks_after: u64,
    /// The fault itself happened as meant (e.g. the kill landed inside a fetch).
    pub injected: bool,
    /// What the harness saw (which process, how long recovery took).
    pub detail: String,
}

/// What one cluster run saw (record.json `cluster`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterReport {
    /// Requests served through the router (warm-up excluded).
    pub requests: u64,
    /// Fetches that completed (prefix imported from a decode process).
    pub fetches: u64,
    /// Admitted hints whose fetch did not complete (the prefill recomputed).
    pub fallbacks: u64,
    /// Requests whose advise got no reply (router or NATS down): recomputed.
    pub advise_unavailable: u64,
    /// Fetches reported complete whose outputs differ from OFF, or that
    /// completed although their donor was killed inside the fetch.
    pub false_completions: u64,
    /// Requests whose first logits or output differ from OFF.
    pub wrong_outputs: u64,
    /// Leaked segments, fds, pins and mappings: each worker's own count at
    /// shutdown plus the shared-memory entries of cluster processes left
    /// after the run (a killed decode's bank once its lease lapsed and was
    /// reclaimed).
    pub leaks: u64,
    /// The leaks, one line each.
    pub leak_details: Vec<String>,
    /// Advise round trip (prefill worker -> NATS -> router -> back), p50, µs.
    pub advise_p50_us: u64,
    /// Same, p99, µs.
    pub advise_p99_us: u64,
    /// One entry per fault, in run order.
    pub recoveries: Vec<Recovery>,
    /// Tokens the prefill workers computed.
    pub computed_tokens: u64,
    /// Tokens they fetched instead.
    pub fetched_tokens: u64,
    /// Memory of the banks: `host_shm` or `cuda_ipc`.
    pub memory: String,
    /// TP size of every worker.
    pub tp: u32,
    /// The router process: the path of the product binary
    /// `kv-reuse-router`, or `kvq stand-in` ([`router`]).
    pub router: String,
    /// Wall time of the run, seconds.
    pub seconds: f64,
}

impl ClusterReport {
    /// Every acceptance condition of issue 18's local cluster: >= 200
    /// requests, fetches > 0, no wrong output, no false completion, no
    /// leak, and every fault injected with fetches after its recovery.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.requests < 200 {
            f.push(format!("{} requests, need >= 200", self.requests));
        }
        if self.fetches == 0 {
            f.push("no fetch completed".into());
        }
        if self.wrong_outputs > 0 {
            f.push(format!("{} outputs differ from OFF", self.wrong_outputs));
        }
        if self.false_completions > 0 {
            f.push(format!("{} false completions", self.false_completions));
        }
        if self.leaks > 0 {
            f.push(format!("{} leaks: {:?}", self.leaks, self.leak_details));
        }
        for r in &self.recoveries {
            if !r.injected {
                f.push(format!("{}: not injected ({})", r.fault, r.detail));
            }
            if r.fetches_after == 0 {
                f.push(format!("{}: no fetch after the recovery", r.fault));
            }
        }
        f
    }
}

/// The model every process runs (the reference model's defaults).
pub fn model_config() -> ModelConfig {
    ModelConfig::default()
}

/// The cluster's cache layout at `tp`.
///
/// # Errors
/// [`ClusterError::Argument`] (`tp`) when the model cannot shard to `tp`.
pub fn layout(tp: u32) -> Result<KvLayout, ClusterError> {
    model_config()
        .layout(tp)
        .map_err(|e| ClusterError::Argument {
            field: "tp",
            reason: e.to_string(),
        })
}

/// The router's reuse settings: on, any saving admitted (the reference
/// model's prompts are short), GPU path allowed when `gpu`; then the
/// `KV_REUSE_*` environment on top, as the product router reads it.
///
/// # Errors
/// [`ClusterError::Argument`] (`KV_REUSE_*`) when the environment is refused.
pub fn settings(gpu: bool) -> Result<ReuseSettings, ClusterError> {
    let defaults = format!(
        "enable_decode_to_prefill_reuse = true\n\
         minimum_estimated_ttft_saving_ms = 0.0\n\
         minimum_transfer_prefix_blocks = 1\n\
         enable_decode_to_prefill_gpu_reuse = {gpu}\n"
    );
    let bad = |e: kv_router_glue::SettingsError| ClusterError::Argument {
        field: "KV_REUSE_*",
        reason: e.to_string(),
    };
    let loaded = SettingsLoader::new()
        .toml_str(&defaults, "cluster defaults")
        .and_then(|l| l.env(&EnvSnapshot::capture()))
        .and_then(|l| l.build())
        .map_err(bad)?;
    Ok(loaded.settings)
}

/// Placeholder GPU identities of a CPU worker (one per rank; the
/// announcement needs one per TP rank), or the ordinals of a GPU worker.
pub fn gpu_identities(tp: u32, host: &str, ordinals: Option<&[u32]>) -> Vec<GpuIdentity> {
    (0..tp)
        .filter_map(|r| {
            let ordinal = ordinals
                .and_then(|o| o.get(r as usize).copied())
                .unwrap_or(r);
            GpuIdentity::new(
                uuid::Uuid::from_u128(u128::from(ordinal) + 1),
                ordinal,
                host,
            )
            .ok()
        })
        .collect()
}

/// Runs cluster child `role` (`kvq child ROLE ARGS`); returns its exit code
/// (2 for bad arguments or an unknown role).
pub fn child_main(role: &str, args: &[String]) -> i32 {
    let r = match role {
        DECODE_ROLE => worker::main(worker::Role::Decode, args),
        PREFILL_ROLE => worker::main(worker::Role::Prefill, args),
        ROUTER_ROLE => router::main(args),
        other => Err(ClusterError::Argument {
            field: "role",
            reason: format!("unknown cluster role {other:?}"),
        }),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{role}: {e}");
            2
        }
    }
}

/// `--name value` pairs of a child's arguments.
pub(crate) fn arg<'a>(args: &'a [String], name: &'static str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// A required `--name value`.
pub(crate) fn required<'a>(
    args: &'a [String],
    name: &'static str,
) -> Result<&'a str, ClusterError> {
    arg(args, name).ok_or(ClusterError::Argument {
        field: name,
        reason: "missing".into(),
    })
}

/// Exits the process when its lifeline (stdin) reaches end of file: the
/// harness closed it or died.
pub(crate) fn watch_lifeline() {
    std::thread::spawn(|| {
        use std::io::Read;
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => std::process::exit(0),
                Ok(_) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_fails_on_each_missing_condition() {
        let ok = ClusterReport {
            requests: 200,
            fetches: 5,
            recoveries: vec![Recovery {
                fault: "router_restarted".into(),
                fetches_after: 1,
                requests_after: 10,
                fallbacks_after: 0,
                injected: true,
                detail: String::new(),
            }],
            ..Default::default()
        };
        assert!(ok.failures().is_empty(), "{:?}", ok.failures());
        let mut r = ok.clone();
        r.requests = 199;
        r.false_completions = 1;
        r.recoveries[0].fetches_after = 0;
        assert_eq!(r.failures().len(), 3, "{:?}", r.failures());
        let mut r = ok;
        r.leaks = 1;
        r.recoveries[0].injected = false;
        assert_eq!(r.failures().len(), 2, "{:?}", r.failures());
    }

    #[test]
    fn settings_admit_short_prefixes_and_args_are_named() {
        let s = settings(false).unwrap();
        assert!(s.enable_decode_to_prefill_reuse);
        assert_eq!(s.minimum_transfer_prefix_blocks, 1);
        let args: Vec<String> = ["--nats", "nats://x"].map(String::from).to_vec();
        assert_eq!(arg(&args, "--nats"), Some("nats://x"));
        let e = required(&args, "--dir").unwrap_err();
        assert!(
            matches!(e, ClusterError::Argument { field: "--dir", .. }),
            "{e}"
        );
        assert_eq!(child_main("cluster-nope", &[]), 2);
        assert_eq!(gpu_identities(2, "h", None).len(), 2);
    }
}
