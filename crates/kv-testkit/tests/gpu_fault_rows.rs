//! GPU fault rows (`kv_testkit::faults::gpu`) on a real device: the donor
//! child (`kvq child fault-donor-gpu`) is killed mid-delivery over CUDA IPC,
//! and the in-process rows cancel or miss the deadline with device
//! destination rows. Skips, saying why, without `libcuda` or a device.

use kv_testkit::faults::gpu::{
    child_command, gpu_fault_table, gpu_ordinals, run_gpu_fault, GpuFault,
    DEVICE_FREE_TOLERANCE_BYTES,
};
use kv_testkit::faults::FaultError;

fn skip_reason() -> Option<String> {
    match gpu_ordinals() {
        Ok(_) => None,
        Err(FaultError::Skipped(r)) => Some(r),
        Err(e) => panic!("probing the GPU failed: {e}"),
    }
}

#[test]
fn gpu_rows_fall_back_without_leaking_device_memory() {
    if let Some(r) = skip_reason() {
        println!("SKIP gpu fault rows: {r}");
        return;
    }
    let t = gpu_fault_table(true, &child_command(env!("CARGO_BIN_EXE_kvq"))).unwrap();
    for o in t.warmup.iter().chain(&t.runs) {
        eprintln!(
            "{} passed {}: {}",
            o.fault,
            o.passed(),
            kv_testkit::faults::gpu::summary(o)
        );
    }
    assert_eq!(t.rows.len(), GpuFault::ALL.len());
    for row in &t.rows {
        assert!(row.passed(), "{row:?}");
    }
    for o in &t.runs {
        assert!(o.device_check_sensitive, "{o:?}");
        for d in &o.devices {
            assert!(d.after + DEVICE_FREE_TOLERANCE_BYTES >= d.before, "{o:?}");
        }
    }
    let killed = t
        .runs
        .iter()
        .find(|o| o.fault == GpuFault::DonorKilledMidTransfer.name())
        .expect("child row ran");
    let ipc = killed
        .ipc
        .as_ref()
        .expect("child row observes the IPC cache");
    assert_eq!(ipc.after.live, ipc.before.live, "{ipc:?}");
    assert!(!ipc.reimport.contains("hit"), "{ipc:?}");
}

#[test]
fn control_row_completes_from_device_memory() {
    if let Some(r) = skip_reason() {
        println!("SKIP gpu fault rows: {r}");
        return;
    }
    let ordinals = gpu_ordinals().unwrap();
    let o = run_gpu_fault(GpuFault::None, 7, &ordinals, None, 0).unwrap();
    assert!(o.completed && o.outputs_match, "{o:?}");
}
