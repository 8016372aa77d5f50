//! CUDA IPC across two real processes, through `kv_bank::gpu_check`: the test
//! binary re-executes itself as the child (`ipc_child_role` with the child
//! arguments as extra filters). Skips, saying why, without a CUDA driver.

use kv_bank::gpu_check;

#[test]
fn ipc_child_role() {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == gpu_check::CHILD_SUBCOMMAND) else {
        return; // not started as the child
    };
    std::process::exit(gpu_check::child_main(&args[at + 1..]));
}

#[test]
fn device_bank_is_imported_byte_exact_and_cached_in_another_process() {
    // SAFETY: only a dlopen probe; cudarc panics on CUDA calls without libcuda.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("SKIP gpu ipc test: no CUDA driver (libcuda) on this machine");
        return;
    }
    if let Err(e) = kv_bank::cuda_probe(0) {
        println!("SKIP gpu ipc test: {e}");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let prefix: Vec<String> = [
        "--exact",
        "ipc_child_role",
        "--nocapture",
        "--test-threads=1",
    ]
    .map(String::from)
    .to_vec();
    let r = gpu_check::run(&exe, &prefix).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    assert_eq!(r.child.mismatched_bytes, 0);
    assert!(
        r.child.first_was_miss && r.child.second_was_hit && r.child.same_mapping,
        "{r:?}"
    );
    assert_eq!((r.child.cache_opens, r.child.cache_hits), (1, 1));
    assert!(r.ok);
}
