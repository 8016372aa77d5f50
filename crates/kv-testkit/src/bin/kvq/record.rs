//! The reproduction record `record.json`: what ran, where, from which
//! commit, and every failure, so that a result can be traced and re-run.
//!
//! Provenance comes from `KVQ_*` variables that `cargo xtask` sets (a GPU
//! machine running the bundle has no git or rustc), else from
//! `$KVQ_BUILD_INFO` (the bundle's `build-info.json`), else from running
//! `git` and `rustc` here, else `unknown`.

use std::path::Path;
use std::process::Command;

use serde::Serialize;

use crate::section::{Profile, SectionResult, Status};

/// Record format name and version.
pub const RECORD_SCHEMA: &str = "kvq.record@1";

/// One GPU as `nvidia-smi` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// Ordinal.
    pub index: u32,
    /// Product name.
    pub name: String,
    /// Driver UUID.
    pub uuid: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Driver version.
    pub driver: String,
}

/// One failed check, kept with its section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    /// Section name.
    pub section: String,
    /// Check name.
    pub check: String,
    /// What was observed.
    pub detail: String,
}

/// The whole record.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Always [`RECORD_SCHEMA`].
    pub schema: &'static str,
    /// Profile run.
    pub profile: Profile,
    /// Commit built (`unknown` when not known).
    pub git_sha: String,
    /// True when the working tree had uncommitted changes at build time.
    pub dirty: bool,
    /// `rustc -V` of the build.
    pub rustc: String,
    /// Host name.
    pub host: String,
    /// GPUs visible (empty on CPU machines).
    pub devices: Vec<Device>,
    /// Commands that produced this record: the build, then this run.
    pub commands: Vec<String>,
    /// Start time, seconds since the Unix epoch.
    pub started_unix_s: u64,
    /// Total wall time in seconds.
    pub duration_s: f64,
    /// True when no section failed.
    pub passed: bool,
    /// Section results in run order.
    pub sections: Vec<SectionResult>,
    /// Every failed check of every section, in run order.
    pub failures: Vec<Failure>,
    /// Native transfer oracle (`transfer_oracle` section):
    /// `{positive{keys,bytes,copies,host_payload_bytes,bytes_ok}, missing_key{keys,untouched_rows_ok,false_completion}}`.
    pub oracle: Option<serde_json::Value>,
    /// The same oracle through NIXL (`transfer_oracle_nixl` section).
    pub oracle_nixl: Option<serde_json::Value>,
    /// `{off_computed_tokens, on_computed_tokens, on_reused_tokens, outputs_match, fallback_outputs_match, ..}`.
    pub serving_smoke: Option<serde_json::Value>,
    /// Mooncake trace replay, OFF vs ON (`trace, requests, off/on_prefill_tokens, ttft_p50/p99_off/on_ms, slower_than_off, ..`).
    pub trace_replay: Option<serde_json::Value>,
    /// Multi-turn session replay: the trace_replay fields plus `later_turn_ttft_mean_off_ms/on_ms`.
    pub session_replay: Option<serde_json::Value>,
    /// The local cluster (`cluster` section): `{requests, fetches,
    /// fallbacks, false_completions, leaks, advise_p50_us, advise_p99_us,
    /// recoveries[{fault, fetches_after}]}`.
    pub cluster: Option<serde_json::Value>,
    /// Real-engine later-turn TTFT OFF vs ON vs ideal (`gpu_serving` section):
    /// `{model, regime, turns[], buckets[{history, off_p50_ms, on_p50_ms,
    /// ideal_p50_ms, ratio, ..}], bytes_moved, host_payload_bytes,
    /// logits_bit_equal_to_donor, max_logit_diff_vs_off, greedy_agreement,
    /// fallbacks, false_completions, leaks, goals, ..}` (docs/gpu-serving.md).
    pub gpu_serving: Option<serde_json::Value>,
    /// The fault table (`[{fault, expected, runs, fetches, fallbacks,
    /// false_completions, leaks, detail}]`, `kv_testkit::faults::FaultRow`),
    /// lifted from the `faults` section; empty when it did not run.
    pub faults: Vec<serde_json::Value>,
    /// Faults that could not run on this machine (`[{fault, reason}]`, e.g.
    /// no `nats-server`, no network namespaces); empty when none or when the
    /// `faults` section did not run.
    pub faults_skipped: Vec<serde_json::Value>,
}

impl Record {
    /// Builds the record from finished sections and the GPUs probed at the
    /// start (see [`devices`]); `failures` and `passed` are derived.
    pub fn new(
        profile: Profile,
        started_unix_s: u64,
        duration_s: f64,
        sections: Vec<SectionResult>,
        devices: Vec<Device>,
    ) -> Self {
        let failures: Vec<Failure> = sections
            .iter()
            .flat_map(|s| {
                s.failed_checks().map(|c| Failure {
                    section: s.name.clone(),
                    check: c.name.clone(),
                    detail: c.detail.clone(),
                })
            })
            .collect();
        let p = Provenance::probe();
        let mut commands = Vec::new();
        if let Some(b) = p.build_command {
            commands.push(b);
        }
        commands.push(std::env::args().collect::<Vec<_>>().join(" "));
        let fault_metric = |metric: &str| {
            sections
                .iter()
                .find(|s| s.name == crate::fault_section::NAME)
                .and_then(|s| s.metrics.get(metric))
                .and_then(|v| v.as_array().cloned())
                .unwrap_or_default()
        };
        let faults = fault_metric(crate::fault_section::ROWS_METRIC);
        let faults_skipped = fault_metric(crate::fault_section::SKIPPED_METRIC);
        let lift = |name: &str| {
            sections
                .iter()
                .find(|s| s.name == name)
                .and_then(|s| s.record.clone())
        };
        let (oracle, oracle_nixl) = (lift("transfer_oracle"), lift("transfer_oracle_nixl"));
        let (serving_smoke, trace_replay) = (lift("serving_smoke"), lift("trace_replay"));
        let session_replay = lift("session_replay");
        let cluster = lift(crate::cluster_section::NAME);
        let gpu_serving = lift(crate::gpu_serving_section::NAME);
        Self {
            schema: RECORD_SCHEMA,
            profile,
            git_sha: p.git_sha,
            dirty: p.dirty,
            rustc: p.rustc,
            host: hostname(),
            devices,
            commands,
            started_unix_s,
            duration_s,
            passed: failures.is_empty() && sections.iter().all(|s| s.status != Status::Failed),
            oracle,
            oracle_nixl,
            serving_smoke,
            trace_replay,
            session_replay,
            cluster,
            gpu_serving,
            sections,
            failures,
            faults,
            faults_skipped,
        }
    }

    /// Writes `record.json` into `dir`.
    ///
    /// # Errors
    /// The I/O error, naming the file.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        let path = dir.join("record.json");
        let json = serde_json::to_vec_pretty(self).map_err(|e| format!("record.json: {e}"))?;
        std::fs::write(&path, json).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

struct Provenance {
    git_sha: String,
    dirty: bool,
    rustc: String,
    build_command: Option<String>,
}

impl Provenance {
    fn probe() -> Self {
        let info: serde_json::Value = std::env::var_os("KVQ_BUILD_INFO")
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(serde_json::Value::Null);
        let from = |env: &str, key: &str| {
            std::env::var(env).ok().or_else(|| {
                info[key]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| info[key].as_bool().map(|b| b.to_string()))
            })
        };
        // Without build info (a plain `cargo build`), ask git about the source
        // tree this binary was compiled from, not the working directory, which
        // may be any repository (or none).
        let source_tree = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let git = |args: &[&str]| run(Command::new("git").arg("-C").arg(source_tree).args(args));
        Self {
            git_sha: from("KVQ_GIT_SHA", "git_sha")
                .or_else(|| git(&["rev-parse", "HEAD"]))
                .unwrap_or_else(|| "unknown".into()),
            dirty: from("KVQ_GIT_DIRTY", "dirty")
                .map(|d| d == "true")
                .or_else(|| git(&["status", "--porcelain"]).map(|s| !s.is_empty()))
                .unwrap_or(false),
            rustc: from("KVQ_RUSTC", "rustc")
                .or_else(|| run(Command::new("rustc").arg("-V")))
                .unwrap_or_else(|| "unknown".into()),
            build_command: from("KVQ_BUILD_COMMAND", "build_command"),
        }
    }
}

fn run(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(std::process::Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| run(&mut Command::new("hostname")))
        .unwrap_or_else(|| "unknown".into())
}

/// GPUs from `nvidia-smi` (empty when it is absent or lists none).
pub fn devices() -> Vec<Device> {
    run(Command::new("nvidia-smi").args([
        "--query-gpu=index,name,uuid,memory.total,driver_version",
        "--format=csv,noheader,nounits",
    ]))
    .map(|csv| parse_devices(&csv))
    .unwrap_or_default()
}

/// Parses `nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version
/// --format=csv,noheader,nounits` output; malformed lines are dropped.
pub fn parse_devices(csv: &str) -> Vec<Device> {
    csv.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            let [index, name, uuid, mem, driver] = f[..] else {
                return None;
            };
            Some(Device {
                index: index.parse().ok()?,
                name: name.to_owned(),
                uuid: uuid.to_owned(),
                memory_mib: mem.parse().ok()?,
                driver: driver.to_owned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::section::{Check, SectionResult};

    #[test]
    fn parses_nvidia_smi_csv_and_drops_garbage() {
        let csv = "0, NVIDIA H200, GPU-8a1b, 143771, 580.65\n1, NVIDIA H200, GPU-9c2d, 143771, 580.65\nNo devices were found";
        let d = parse_devices(csv);
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[1].index, d[1].uuid.as_str(), d[1].memory_mib),
            (1, "GPU-9c2d", 143_771)
        );
    }

    #[test]
    fn failures_list_every_failed_check_of_every_section() {
        let mk = |name: &str, checks: &[(&str, bool)], status| SectionResult {
            name: name.into(),
            status,
            skip_reason: None,
            duration_ms: 1.0,
            checks: checks
                .iter()
                .map(|(n, p)| Check {
                    name: (*n).into(),
                    passed: *p,
                    detail: format!("{n} detail"),
                })
                .collect(),
            metrics: Default::default(),
            ttft: None,
            record: None,
        };
        let r = Record::new(
            Profile::Cpu,
            0,
            1.0,
            vec![
                mk(
                    "a",
                    &[("x", true), ("y", false), ("z", false)],
                    Status::Failed,
                ),
                mk("b", &[("w", false)], Status::Failed),
                mk("c", &[("v", true)], Status::Passed),
            ],
            Vec::new(),
        );
        let got: Vec<_> = r
            .failures
            .iter()
            .map(|f| format!("{}.{}", f.section, f.check))
            .collect();
        assert_eq!(got, ["a.y", "a.z", "b.w"]);
        assert!(!r.passed);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["schema"], RECORD_SCHEMA);
        assert_eq!(json["profile"], "cpu");
        assert_eq!(json["failures"][2]["detail"], "w detail");
    }
}
