//! The documented feature sets of the product crates (docs/architecture.md),
//! each built on its own by `cargo xtask test`: `cargo test --workspace`
//! unifies features (kv-testkit turns every one on), so only a separate
//! build shows that a set compiles and that its graph stays free of CUDA and
//! NIXL.

use std::collections::BTreeSet;

use serde::Deserialize;

use crate::error::{Result, XtaskError};
use crate::{command, workspace};

/// One feature set: `cargo check -p <package> --no-default-features
/// [--features <features>]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureSet {
    /// Workspace package.
    pub package: &'static str,
    /// Features turned on besides none of the defaults (empty: none at all).
    pub features: &'static [&'static str],
}

/// The sets that need neither CUDA nor NIXL: a router, a CPU-only worker.
///
/// kv-router-glue's `router` feature is listed even before the crate defines
/// it (its feature split is a separate change): [`run`] skips a set whose
/// feature `cargo metadata` does not list, saying so, instead of failing.
pub const FEATURE_SETS: [FeatureSet; 3] = [
    FeatureSet {
        package: "kv-bank",
        features: &[],
    },
    FeatureSet {
        package: "kv-transfer",
        features: &[],
    },
    FeatureSet {
        package: "kv-router-glue",
        features: &["router"],
    },
];

/// Crates none of [`FEATURE_SETS`] may have in its normal dependency graph:
/// the CUDA driver bindings and NIXL with its build-time bindgen / libclang.
pub const FORBIDDEN: [&str; 4] = ["cudarc", "nixl-sys", "bindgen", "clang-sys"];

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    features: std::collections::BTreeMap<String, serde_json::Value>,
}

/// The features of every package in `cargo metadata --format-version 1
/// --no-deps` JSON whose name is `package`; `None` when no such package.
///
/// # Errors
/// [`XtaskError::Metadata`] for JSON without `packages[].name` /
/// `packages[].features`.
pub fn package_features(metadata_json: &str, package: &str) -> Result<Option<BTreeSet<String>>> {
    let meta: Metadata = serde_json::from_str(metadata_json).map_err(|e| XtaskError::Metadata {
        field: "packages[].features".into(),
        reason: e.to_string(),
    })?;
    Ok(meta
        .packages
        .into_iter()
        .find(|p| p.name == package)
        .map(|p| p.features.into_keys().collect()))
}

/// The [`FORBIDDEN`] crates named in `cargo tree --prefix none` output (one
/// `name vX.Y.Z [(path)] [(*)]` per line), each once, sorted.
pub fn forbidden_in_tree(tree: &str) -> Vec<String> {
    tree.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| FORBIDDEN.contains(name))
        .map(str::to_string)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn cargo_args(verb: &str, set: &FeatureSet) -> Vec<String> {
    let mut a = vec![
        verb.to_string(),
        "-p".into(),
        set.package.into(),
        "--no-default-features".into(),
    ];
    if !set.features.is_empty() {
        a.push("--features".into());
        a.push(set.features.join(","));
    }
    a
}

/// Builds each of [`FEATURE_SETS`] and checks its normal dependency graph
/// for [`FORBIDDEN`] crates; returns one line per failed set (empty: all
/// passed). A set naming a feature its package does not define is skipped
/// with a printed line, not failed.
///
/// # Errors
/// `cargo metadata` failing to run or returning unexpected JSON.
pub fn run(apply_env: impl Fn(&mut std::process::Command)) -> Result<Vec<String>> {
    let metadata = command::capture(workspace::cargo().args([
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
    ]))?;
    let mut failures = Vec::new();
    for set in &FEATURE_SETS {
        let label = cargo_args("check", set).join(" ");
        let Some(defined) = package_features(&metadata, set.package)? else {
            failures.push(format!(
                "{label}: no package `{}` in the workspace",
                set.package
            ));
            continue;
        };
        if let Some(missing) = set.features.iter().find(|f| !defined.contains(**f)) {
            eprintln!(
                "feature sets: skipped `{label}`: {} defines no feature `{missing}` yet",
                set.package
            );
            continue;
        }
        let mut check = workspace::cargo();
        check.args(cargo_args("check", set));
        apply_env(&mut check);
        if let Err(e) = command::run(&mut check) {
            failures.push(format!("{label}: {e}"));
            continue;
        }
        let mut tree = workspace::cargo();
        tree.args(cargo_args("tree", set))
            .args(["-e", "normal", "--prefix", "none"]);
        let found = forbidden_in_tree(&command::capture(&mut tree)?);
        if found.is_empty() {
            eprintln!("feature sets: `{label}` builds; none of {FORBIDDEN:?} in its graph");
        } else {
            failures.push(format!("{label}: its graph holds {}", found.join(", ")));
        }
    }
    Ok(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_forbidden_crates_in_a_tree_once_each() {
        // Shape of `cargo tree -p kv-transfer -e normal --prefix none` before
        // kv-transfer had features.
        let tree = "kv-transfer v0.1.0 (/w/crates/kv-transfer)\n\
                    cudarc v0.19.10\n\
                    kv-bank v0.1.0 (/w/crates/kv-bank)\n\
                    cudarc v0.19.10 (*)\n\
                    nixl-sys v1.5.1\n\
                    libc v0.2.177\n";
        assert_eq!(forbidden_in_tree(tree), vec!["cudarc", "nixl-sys"]);
        assert!(forbidden_in_tree("kv-bank v0.1.0 (/w)\nlibc v0.2.177\n").is_empty());
        // A crate whose name merely contains a forbidden one is not it.
        assert!(forbidden_in_tree("cudarc-extra v1.0.0\n").is_empty());
    }

    #[test]
    fn reads_a_packages_features_from_metadata() {
        let json = r#"{"packages":[
            {"name":"kv-bank","features":{"default":["cuda"],"cuda":["dep:cudarc"],"qualify":["cuda"]}},
            {"name":"kv-router-glue","features":{}}]}"#;
        let bank = package_features(json, "kv-bank").unwrap().unwrap();
        assert_eq!(
            bank.into_iter().collect::<Vec<_>>(),
            vec!["cuda", "default", "qualify"]
        );
        assert!(package_features(json, "kv-router-glue")
            .unwrap()
            .unwrap()
            .is_empty());
        assert!(package_features(json, "kv-lookup").unwrap().is_none());
        assert!(matches!(
            package_features(r#"{"packages":[{"name":"x"}]}"#, "x"),
            Err(XtaskError::Metadata { .. })
        ));
    }

    #[test]
    fn cargo_arguments_name_the_set() {
        assert_eq!(
            cargo_args("check", &FEATURE_SETS[0]).join(" "),
            "check -p kv-bank --no-default-features"
        );
        assert_eq!(
            cargo_args("tree", &FEATURE_SETS[2]).join(" "),
            "tree -p kv-router-glue --no-default-features --features router"
        );
    }
}
