//! Runs the bank's runnable checks and prints them as JSON lines:
//! `cargo run -p kv-bank --example bank_check` (CPU lifecycle, then the CUDA
//! IPC check, which reports why it cannot run on a machine without a GPU).
//! `bank_check bank-ipc-child <hex> <bytes>` is the IPC check's child role,
//! `bank_check bank-lease-owner ...` the fault table's lease-owner child.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(kv_bank::gpu_check::CHILD_SUBCOMMAND) {
        std::process::exit(kv_bank::gpu_check::child_main(&args[1..]));
    }
    if args.first().map(String::as_str) == Some(kv_bank::faults::CHILD_SUBCOMMAND) {
        std::process::exit(kv_bank::faults::child_main(&args[1..]));
    }
    let q = kv_bank::qualify_section();
    println!(
        "{}",
        serde_json::json!({ "section": "bank", "result": q.to_json() })
    );
    let exe = std::env::current_exe().expect("current exe");
    match kv_bank::gpu_check::run(&exe, &[]) {
        Ok(r) => println!(
            "{}",
            serde_json::json!({ "section": "bank_gpu_ipc", "result": r })
        ),
        Err(e) => println!(
            "{}",
            serde_json::json!({ "section": "bank_gpu_ipc", "error": e.to_string() })
        ),
    }
    let faults = kv_bank::qualify_faults(&exe, &[]);
    for row in &faults {
        println!(
            "{}",
            serde_json::json!({ "section": "bank_faults", "row": row, "passed": row.passed() })
        );
    }
    let ok = q.passed && faults.iter().all(kv_bank::FaultRow::passed);
    std::process::exit(if ok { 0 } else { 1 });
}
