//! The bank rows of the qualify fault table, run as kvq runs them (the
//! test binary is the lease-owner child). One test in this binary besides
//! the child role, so the rows' leak snapshots are undisturbed.

use kv_bank::faults;

#[test]
fn lease_owner_child_role() {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == faults::CHILD_SUBCOMMAND) else {
        return;
    };
    std::process::exit(faults::child_main(&args[at + 1..]));
}

#[test]
fn every_bank_fault_falls_back_without_false_completion_or_leak() {
    let exe = std::env::current_exe().unwrap();
    let prefix: Vec<String> = ["--exact", "lease_owner_child_role", "--nocapture"]
        .map(String::from)
        .to_vec();
    let rows = kv_bank::qualify_faults(&exe, &prefix);
    for r in &rows {
        println!("{}", serde_json::to_string(r).unwrap());
    }
    let names: Vec<&str> = rows.iter().map(|r| r.fault.as_str()).collect();
    assert_eq!(
        names,
        [
            "bank_owner_killed",
            "bank_owner_stalled",
            "forged_hint",
            "stale_bank_generation",
            "bank_allocation_failure"
        ]
    );
    let runs: Vec<u32> = rows.iter().map(|r| r.runs).collect();
    assert_eq!(runs, [1, 1, 5, 2, 5]);
    for r in &rows {
        assert!(r.passed(), "{r:#?}");
    }
}
