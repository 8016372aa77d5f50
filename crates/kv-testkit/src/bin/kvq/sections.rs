//! The qualification sections in run order, and the adapters that turn
//! other crates' check functions into [`SectionResult`]s.

use crate::section::{Ctx, Profile, Section, SectionResult, Stop};
use crate::{
    child, cluster_section, descriptor_wire, fault_section, gpu_serving_section, replay_section,
    smoke_section, transfer,
};

const BOTH: &[Profile] = &[Profile::Cpu, Profile::Gpu];
const GPU: &[Profile] = &[Profile::Gpu];

/// Every section, in run order.
pub const ALL: &[Section] = &[
    Section {
        name: "descriptor_wire",
        profiles: BOTH,
        body: descriptor_wire::run,
    },
    Section {
        name: "reuse_settings",
        profiles: BOTH,
        body: reuse_settings,
    },
    Section {
        name: "bank_lifecycle",
        profiles: BOTH,
        body: bank_lifecycle,
    },
    Section {
        name: "bank_cuda_ipc",
        profiles: GPU,
        body: bank_cuda_ipc,
    },
    Section {
        name: "transfer_oracle",
        profiles: BOTH,
        body: transfer::oracle_native,
    },
    Section {
        name: "transfer_oracle_nixl",
        profiles: BOTH,
        body: transfer::oracle_nixl,
    },
    Section {
        name: "transfer_cuda_ipc",
        profiles: GPU,
        body: transfer::cuda_ipc,
    },
    Section {
        name: "trace_replay",
        profiles: BOTH,
        body: replay_section::trace,
    },
    Section {
        name: "session_replay",
        profiles: BOTH,
        body: replay_section::sessions,
    },
    Section {
        name: "serving_smoke",
        profiles: BOTH,
        body: smoke_section::run,
    },
    Section {
        name: fault_section::NAME,
        profiles: BOTH,
        body: fault_section::run,
    },
    Section {
        name: cluster_section::NAME,
        profiles: BOTH,
        body: cluster_section::run,
    },
    Section {
        name: gpu_serving_section::NAME,
        profiles: BOTH,
        body: gpu_serving_section::run,
    },
];

/// Sections of `profile`, optionally only those named in `only`.
pub fn selected(profile: Profile, only: &[String]) -> Vec<&'static Section> {
    ALL.iter()
        .filter(|s| s.profiles.contains(&profile))
        .filter(|s| only.is_empty() || only.iter().any(|o| o == s.name))
        .collect()
}

/// Copies a JSON object's scalar fields into the section's metrics.
fn metrics_from(r: &mut SectionResult, v: &serde_json::Value, skip: &[&str]) {
    if let Some(map) = v.as_object() {
        for (k, v) in map.iter().filter(|(k, _)| !skip.contains(&k.as_str())) {
            if !v.is_array() && !v.is_object() {
                r.metric(k, v.clone());
            }
        }
    }
}

/// kv-router-glue's settings in force (defaults < `KV_REUSE_*` environment)
/// and sample admission decisions with every cost term, plus its CPU fetch checks.
fn reuse_settings(_: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    use kv_router_glue::{EnvSnapshot, SettingsLoader};
    let loaded = SettingsLoader::new()
        .env(&EnvSnapshot::capture())
        .and_then(|l| l.build())
        .map_err(|e| Stop::Error(format!("reuse settings: {e}")))?;
    let s = kv_router_glue::qualify_section(&loaded);
    print!("{}", s.render());
    for (name, passed, detail) in &s.checks {
        r.check(name.clone(), *passed, detail.clone());
    }
    let settings: serde_json::Map<String, serde_json::Value> = s
        .settings
        .iter()
        .map(|(k, v, origin)| {
            (
                k.clone(),
                serde_json::json!({ "value": v, "origin": origin }),
            )
        })
        .collect();
    r.metric("settings", serde_json::Value::Object(settings));
    let decisions: Vec<String> = s
        .decisions
        .iter()
        .chain(&s.decisions_if_enabled)
        .map(|d| d.to_string())
        .collect();
    r.metric("decisions", decisions);
    Ok(())
}

/// kv-bank's CPU lifecycle: TP2 host-shm bank, acks, rollback, pins, lineage, close.
fn bank_lifecycle(_: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let s = kv_bank::qualify_section();
    for c in &s.checks {
        r.check(c.name, c.passed, c.detail.clone());
    }
    metrics_from(r, &s.to_json(), &["passed", "checks"]);
    Ok(())
}

/// kv-bank's two-process CUDA IPC check: the child is this binary
/// (`kvq child bank-ipc-child ...`).
fn bank_cuda_ipc(ctx: &Ctx, r: &mut SectionResult) -> Result<(), Stop> {
    let report = kv_bank::gpu_check::run(&ctx.exe, &[child::SUBCOMMAND.to_owned()])
        .map_err(|e| Stop::Error(format!("bank gpu_check: {e}")))?;
    let c = &report.child;
    r.check(
        "bytes_match",
        c.mismatched_bytes == 0 && c.bytes == report.bytes,
        format!("{} of {} bytes differ", c.mismatched_bytes, c.bytes),
    );
    r.check(
        "first_import_opens",
        c.first_was_miss,
        format!("first import {} µs", c.first_import_us),
    );
    r.check(
        "second_import_cached",
        c.second_was_hit && c.same_mapping,
        format!(
            "second import {} µs, same mapping {}",
            c.second_import_us, c.same_mapping
        ),
    );
    r.check("child_ok", report.ok, format!("device {}", report.device));
    let json = serde_json::to_value(&report).unwrap_or_default();
    metrics_from(r, &json, &["ok"]);
    metrics_from(r, &json["child"], &[]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_profiles_select() {
        let mut names: Vec<_> = ALL.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        assert!(selected(Profile::Cpu, &[])
            .iter()
            .all(|s| s.profiles.contains(&Profile::Cpu)));
        assert!(!selected(Profile::Cpu, &[])
            .iter()
            .any(|s| s.name == "bank_cuda_ipc"));
        assert!(selected(Profile::Gpu, &[])
            .iter()
            .any(|s| s.name == "bank_cuda_ipc"));
        let only = selected(Profile::Cpu, &["descriptor_wire".into()]);
        assert_eq!(
            only.iter().map(|s| s.name).collect::<Vec<_>>(),
            ["descriptor_wire"]
        );
    }
}
