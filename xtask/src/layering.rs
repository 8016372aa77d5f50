//! The dependency rule: workspace crates depend strictly downward in
//! [`ORDER`], checked from `cargo metadata --format-version 1 --no-deps`
//! for normal, dev and build dependencies alike.

use serde::Deserialize;

use crate::error::{Result, XtaskError};

/// Workspace crates, lowest first: a crate may depend only on crates to its left.
pub const ORDER: [&str; 8] = [
    "kv-descriptor",
    "kv-bank",
    "kv-transfer",
    "kv-lookup",
    "kv-router-glue",
    // The Python wheel: above the role crates, below the test kit (which it
    // must not need).
    "kv-reuse-py",
    "kv-testkit",
    "xtask",
];

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    dependencies: Vec<Dependency>,
}

#[derive(Deserialize)]
struct Dependency {
    name: String,
    kind: Option<String>,
}

/// Checks `cargo metadata` JSON against [`ORDER`]; returns the number of
/// workspace-internal edges checked.
///
/// # Errors
/// [`XtaskError::Metadata`] for JSON without `packages[].name` /
/// `dependencies[].name`, or naming a workspace package absent from
/// [`ORDER`]; [`XtaskError::Layering`] listing every upward or sideways edge
/// (`kv-bank -> kv-lookup (dev)`).
///
/// For `{"packages":[{"name":"kv-bank","dependencies":[{"name":"kv-descriptor","kind":null}]}]}`
/// the answer is `Ok(1)`; with `kv-lookup` as a dependency it is an error.
pub fn check(metadata_json: &str) -> Result<usize> {
    let meta: Metadata = serde_json::from_str(metadata_json).map_err(|e| XtaskError::Metadata {
        field: "packages".into(),
        reason: e.to_string(),
    })?;
    let rank = |name: &str| ORDER.iter().position(|c| *c == name);
    let mut violations = Vec::new();
    let mut edges = 0;
    for (i, p) in meta.packages.iter().enumerate() {
        let Some(own) = rank(&p.name) else {
            return Err(XtaskError::Metadata {
                field: format!("packages[{i}].name"),
                reason: format!(
                    "workspace crate `{}` has no place in the layering order {ORDER:?}",
                    p.name
                ),
            });
        };
        for d in &p.dependencies {
            let Some(dep) = rank(&d.name) else { continue };
            edges += 1;
            if dep >= own {
                let kind = d.kind.as_deref().unwrap_or("normal");
                violations.push(format!("{} -> {} ({kind})", p.name, d.name));
            }
        }
    }
    if violations.is_empty() {
        Ok(edges)
    } else {
        Err(XtaskError::Layering(violations))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A package and its dependencies (name, optional `kind`).
    type Package<'a> = (&'a str, &'a [(&'a str, Option<&'a str>)]);

    fn meta(pkgs: &[Package<'_>]) -> String {
        let packages: Vec<_> = pkgs
            .iter()
            .map(|(name, deps)| {
                let deps: Vec<_> = deps
                    .iter()
                    .map(|(d, k)| serde_json::json!({"name": d, "kind": k, "req": "*", "path": "/x"}))
                    .collect();
                serde_json::json!({"name": name, "version": "0.1.0", "dependencies": deps})
            })
            .collect();
        serde_json::json!({"packages": packages, "workspace_members": []}).to_string()
    }

    #[test]
    fn downward_edges_pass_and_external_crates_are_ignored() {
        let j = meta(&[
            ("kv-descriptor", &[("serde", None)]),
            ("kv-bank", &[("kv-descriptor", None), ("libc", None)]),
            (
                "kv-testkit",
                &[("kv-bank", Some("dev")), ("kv-descriptor", Some("build"))],
            ),
            ("xtask", &[("clap", None)]),
        ]);
        assert_eq!(check(&j).unwrap(), 3);
    }

    #[test]
    fn upward_dev_and_self_edges_fail_naming_each_edge() {
        let j = meta(&[
            ("kv-bank", &[("kv-lookup", Some("dev")), ("kv-bank", None)]),
            ("kv-descriptor", &[("kv-transfer", Some("build"))]),
        ]);
        let XtaskError::Layering(v) = check(&j).unwrap_err() else {
            panic!("expected a layering error")
        };
        assert_eq!(
            v,
            [
                "kv-bank -> kv-lookup (dev)",
                "kv-bank -> kv-bank (normal)",
                "kv-descriptor -> kv-transfer (build)"
            ]
        );
    }

    #[test]
    fn unknown_workspace_crate_and_bad_json_are_metadata_errors() {
        let e = check(&meta(&[("kv-extra", &[])])).unwrap_err();
        assert!(
            e.to_string().contains("packages[0].name") && e.to_string().contains("kv-extra"),
            "{e}"
        );
        assert!(matches!(
            check("{}").unwrap_err(),
            XtaskError::Metadata { .. }
        ));
    }

    #[test]
    fn this_workspace_obeys_the_order() {
        let out =
            std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args([
                    "metadata",
                    "--format-version",
                    "1",
                    "--no-deps",
                    "--offline",
                ])
                .current_dir(crate::workspace::root())
                .output()
                .expect("cargo runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let edges = check(&String::from_utf8(out.stdout).unwrap()).unwrap();
        assert!(
            edges >= 6,
            "only {edges} internal edges: is the workspace intact?"
        );
    }
}
