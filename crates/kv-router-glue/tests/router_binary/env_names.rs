//! `KV_ROUTER_*` variables the router does not read: a typo exits 2 at
//! start naming it and the closest variable it reads (trial h44, 10: it was
//! silently ignored, while a `KV_REUSE_*` typo exited 2).

use std::process::{Command, Stdio};

use crate::process::NO_NATS;

/// Runs the binary against [`NO_NATS`] with `vars` set; (exit code, stderr).
fn run_with_env(vars: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kv-reuse-router"))
        .args(["--nats-url", NO_NATS, "--metrics-addr", "127.0.0.1:0"])
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "{vars:?}: no ready line");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unknown_kv_router_variable_exits_2_naming_it_and_the_closest_known_one() {
    for (typo, closest) in [
        ("KV_ROUTER_ADVISE_SUBJET", "KV_ROUTER_ADVISE_SUBJECT"),
        ("KV_ROUTER_NATS_UR", "KV_ROUTER_NATS_URL"),
        ("KV_ROUTER_LOGS", "KV_ROUTER_LOG"),
    ] {
        let (code, err) = run_with_env(&[(typo, "kv_reuse.prod.advise")]);
        assert_eq!(code, Some(2), "{typo}: {err}");
        assert!(
            err.starts_with(&format!(
                "kv-reuse-router: `{typo}` (environment variable) is not a variable kv-reuse-router reads (did you mean `{closest}`?)"
            )),
            "{typo}: {err}"
        );
        assert!(
            !err.contains("cannot connect"),
            "{typo}: refused first: {err}"
        );
    }
    // The known ones pass the check: the router goes on to connect (exit 1).
    let (code, err) = run_with_env(&[
        ("KV_ROUTER_ADVISE_SUBJECT", "kv_reuse.prod.advise"),
        ("KV_ROUTER_LOG", "info"),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot connect to NATS"), "{err}");
}
