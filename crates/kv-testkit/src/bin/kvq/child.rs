//! Hidden `kvq child ROLE ARGS...`: the second process of multi-process
//! checks. Sections start this same binary so that a GPU machine needs only
//! the bundle; each role is dispatched to the library that owns the check.

/// The subcommand word that precedes the role (`kvq child bank-ipc-child ...`).
pub const SUBCOMMAND: &str = "child";

/// Runs child `role` with its arguments; returns the process exit code
/// (2 for an unknown role, with the known ones on stderr).
pub fn main(role: &str, args: &[String]) -> i32 {
    match role {
        kv_bank::gpu_check::CHILD_SUBCOMMAND => kv_bank::gpu_check::child_main(args),
        kv_bank::faults::CHILD_SUBCOMMAND => kv_bank::faults::child_main(args),
        kv_testkit::faults::CHILD_ROLE => kv_testkit::faults::child_main(args),
        kv_testkit::faults::gpu::GPU_CHILD_ROLE => kv_testkit::faults::gpu::child_main(args),
        kv_testkit::faults::NET_CHILD_ROLE => kv_testkit::faults::net_child_main(args),
        kv_testkit::cluster::DECODE_ROLE
        | kv_testkit::cluster::PREFILL_ROLE
        | kv_testkit::cluster::ROUTER_ROLE => kv_testkit::cluster::child_main(role, args),
        kv_transfer::nixl_two_process::DONOR_ROLE => {
            kv_transfer::nixl_two_process::donor_main(args)
        }
        kv_transfer::ipc_check::CHILD_SUBCOMMAND => {
            match kv_transfer::ipc_check::child_main(args) {
                // The parent reads the last JSON line of stdout.
                Ok(report) => match serde_json::to_string(&report) {
                    Ok(line) => {
                        println!("{line}");
                        i32::from(!(report.bytes_ok && report.host_payload_bytes == 0))
                    }
                    Err(e) => {
                        eprintln!(
                            "{}: cannot encode report: {e}",
                            kv_transfer::ipc_check::CHILD_SUBCOMMAND
                        );
                        2
                    }
                },
                Err(e) => {
                    eprintln!("{}: {e}", kv_transfer::ipc_check::CHILD_SUBCOMMAND);
                    2
                }
            }
        }
        other => {
            eprintln!(
                "kvq child: unknown role {other:?} (known: {})",
                [
                    kv_bank::gpu_check::CHILD_SUBCOMMAND,
                    kv_transfer::ipc_check::CHILD_SUBCOMMAND,
                    kv_transfer::nixl_two_process::DONOR_ROLE,
                ]
                .join(", ")
            );
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_role_and_bad_child_arguments_exit_2() {
        assert_eq!(main("no-such-role", &[]), 2);
        // Argument errors come before any CUDA call, so this holds without a GPU.
        assert_eq!(main(kv_transfer::ipc_check::CHILD_SUBCOMMAND, &[]), 2);
        assert_eq!(main(kv_transfer::nixl_two_process::DONOR_ROLE, &[]), 2);
        assert_eq!(
            main(kv_bank::gpu_check::CHILD_SUBCOMMAND, &["zz".into()]),
            2
        );
    }
}
