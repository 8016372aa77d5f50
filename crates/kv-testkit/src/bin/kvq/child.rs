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
        other => {
            eprintln!(
                "kvq child: unknown role {other:?} (known: {})",
                [kv_bank::gpu_check::CHILD_SUBCOMMAND].join(", ")
            );
            2
        }
    }
}
