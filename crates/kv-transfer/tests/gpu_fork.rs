//! A child forked from a process that used the CUDA copy backend (Python's
//! `os.fork`, multiprocessing's default start method on Linux) inherits the
//! backend, its devices' streams, events and gather module, but CUDA does
//! not support using them after `fork()`. In the child a copy through the
//! inherited backend is refused before any CUDA call, naming both
//! processes, and dropping the backend returns (it forgets those objects
//! instead of destroying them); the parent's backend keeps copying. Skips
//! with a printed reason without a GPU.
//!
//! One test in this binary: `fork` copies only the calling thread, and no
//! other test thread may hold a lock the child would need.

use kv_bank::{BankMemory, CudaDeviceMemory};
use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
use kv_transfer::cuda::{device_count, driver_present, CudaCopyBackend, CudaMode};
use kv_transfer::cuda_gather::{reference_convert, ConvertPlan};
use kv_transfer::{DeliveryControl, TransferError};

/// What the child reports through its exit status.
const CHILD_OK: i32 = 0;
const CHILD_COPIED: i32 = 3;
const CHILD_OTHER_ERROR: i32 = 4;
const CHILD_PANICKED: i32 = 5;

/// Runs in the forked child: the copy must be refused as
/// `CudaUnavailable` naming `parent` and this process, then the drops of the
/// backend and of the inherited device memory must return; never returns.
fn child(
    parent: u32,
    backend: CudaCopyBackend,
    plan: &ConvertPlan,
    (src, dst): (CudaDeviceMemory, CudaDeviceMemory),
) -> ! {
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        match backend.convert_blocks(plan, &src, &dst, &DeliveryControl::new()) {
            Ok(_) => return CHILD_COPIED,
            Err(TransferError::CudaUnavailable { reason })
                if reason.contains(&format!("by process {parent}, "))
                    && reason.contains(&format!("this process ({})", std::process::id())) => {}
            Err(e) => {
                eprintln!("child: {e}");
                return CHILD_OTHER_ERROR;
            }
        }
        // The drops an exiting helper runs.
        drop(backend);
        drop((src, dst));
        CHILD_OK
    }))
    .unwrap_or(CHILD_PANICKED);
    // SAFETY: `_exit` ends the forked child at once, without running the
    // test harness's exit path (atexit handlers, CUDA's own among them,
    // buffers copied from the parent) a second time; it takes a plain int.
    unsafe { libc::_exit(code) }
}

/// Converts with `backend` and checks every target byte against the host
/// reference.
fn converts_every_byte(
    backend: &CudaCopyBackend,
    plan: &ConvertPlan,
    (donor, target, moves): (&KvRegionLayout, &KvRegionLayout, &[(u32, u32)]),
    (src, dst): (&CudaDeviceMemory, &CudaDeviceMemory),
) {
    let host: Vec<u8> = (0..src.len())
        .map(|i| (i * 7 + i / 251) as u8 | 1)
        .collect();
    src.write_bytes(0, &host).unwrap();
    dst.write_bytes(0, &vec![0; dst.len()]).unwrap();
    backend
        .convert_blocks(plan, src, dst, &DeliveryControl::new())
        .unwrap();
    let mut want = vec![0u8; dst.len()];
    reference_convert(donor, target, moves, &host, &mut want).unwrap();
    let mut got = vec![0u8; dst.len()];
    dst.read_bytes(0, &mut got).unwrap();
    assert!(got == want, "target bytes differ from the reference");
}

#[test]
fn a_forked_child_neither_uses_nor_destroys_the_inherited_backends_cuda_objects() {
    if !driver_present() || device_count() == 0 {
        println!("SKIP fork after CUDA: no CUDA device visible");
        return;
    }
    let g = KvLayout::new(2, 1, 16, DType::Bf16, 2, TensorOrder::BlockMajor, 1).unwrap();
    let (n, bb) = (8u32, g.rank_block_bytes() as u64);
    let donor = KvRegionLayout::block_major(g, 0, 0, 2 * n, u64::from(2 * n) * bb).unwrap();
    let target = KvRegionLayout::block_major(g, 0, 0, n, u64::from(n) * bb).unwrap();
    // Scattered (more than 4 runs): the gather kernel, so the module is loaded.
    let moves: Vec<(u32, u32)> = (0..n).map(|i| (2 * (n - i) - 1, i)).collect();
    let plan = ConvertPlan::new(&donor, &target, &moves).unwrap();
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    let src = CudaDeviceMemory::new(0, donor.region_bytes() as usize).unwrap();
    let dst = CudaDeviceMemory::new(0, target.region_bytes() as usize).unwrap();
    // The device's stream, events and kernels exist before the fork.
    converts_every_byte(&backend, &plan, (&donor, &target, &moves), (&src, &dst));

    let parent = std::process::id();
    // SAFETY: this test binary runs this one test, so the other threads are
    // the harness's main thread (waiting for this one) and the CUDA driver's
    // own, none of which the child needs: it calls no CUDA (the point of the
    // test), only drops values and calls `_exit` (see `child`).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // The child's copies of the parent's values (the parent keeps its own).
        child(parent, backend, &plan, (src, dst));
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above; `status` is a valid int.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        CHILD_OK,
        "child: 3 the inherited backend copied, 4 refused otherwise (its stderr says how), \
         5 panicked"
    );
    // The parent's backend and memory are its own still.
    converts_every_byte(&backend, &plan, (&donor, &target, &moves), (&src, &dst));
}
