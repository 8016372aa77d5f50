//! `cargo xtask loom`: the loom model tests of kv-lookup's left-right twin
//! (`crates/kv-lookup/src/twin/model_tests.rs`: readers never share a copy
//! with the writer and see whole batches, combined submitters get their own
//! results in call order, an inspection inside a read never deadlocks with a
//! writer waiting for that copy), every interleaving up to loom's preemption
//! bound.
//!
//! Owns: the command line. The models need `--cfg kv_loom` (the twin's
//! primitives become loom's), which must not reach the workspace build: they
//! build in their own target directory, `<target>/loom`, release profile
//! (loom runs tens of thousands of interleavings). `cargo xtask test` runs
//! this as one of its steps and adds the counts to its closing line.

use std::process::Command;

use crate::workspace;

/// The test filter naming the model tests (`twin::model_tests::model_*`).
pub const FILTER: &str = "twin::model";

/// `cargo test -p kv-lookup --lib --release twin::model -- --nocapture`
/// with `--cfg kv_loom` added to `RUSTFLAGS` (kept, if set) and
/// `CARGO_TARGET_DIR=<target>/loom`.
pub fn command() -> Command {
    let mut c = workspace::cargo();
    c.args(["test", "-p", "kv-lookup", "--lib", "--release", FILTER])
        .args(["--", "--nocapture"]);
    let flags = match std::env::var("RUSTFLAGS") {
        Ok(f) if !f.trim().is_empty() => format!("{f} --cfg kv_loom"),
        _ => "--cfg kv_loom".to_string(),
    };
    c.env("RUSTFLAGS", flags)
        .env("CARGO_TARGET_DIR", workspace::target_dir().join("loom"));
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_apart_with_the_loom_cfg_and_runs_only_the_models() {
        let c = command();
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "test",
                "-p",
                "kv-lookup",
                "--lib",
                "--release",
                FILTER,
                "--",
                "--nocapture"
            ]
        );
        let env: std::collections::HashMap<String, String> = c
            .get_envs()
            .filter_map(|(k, v)| {
                Some((
                    k.to_string_lossy().into_owned(),
                    v?.to_string_lossy().into_owned(),
                ))
            })
            .collect();
        assert!(env["RUSTFLAGS"].ends_with("--cfg kv_loom"), "{env:?}");
        assert!(env["CARGO_TARGET_DIR"].ends_with("loom"), "{env:?}");
        assert_ne!(
            std::path::PathBuf::from(&env["CARGO_TARGET_DIR"]),
            workspace::target_dir()
        );
    }
}
