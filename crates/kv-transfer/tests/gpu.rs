//! GPU checks: skip with a printed reason when no CUDA device is visible
//! (`cudarc` is probed with `is_culib_present` before any call).
//! On a GPU machine these run the oracle's GPU profile and a quick GPU bench.

use kv_transfer::bench::{self, BenchOpts};
use kv_transfer::oracle::{self, Profile};

fn gpu_or_skip() -> bool {
    if !kv_transfer::cuda::driver_present() {
        println!("SKIP gpu test: libcuda not loadable");
        return false;
    }
    if kv_transfer::cuda::device_count() == 0 {
        println!("SKIP gpu test: no CUDA device visible");
        return false;
    }
    true
}

#[test]
fn gpu_oracle_passes_with_zero_host_payload() {
    if !gpu_or_skip() {
        return;
    }
    let r = oracle::run(Profile::Gpu).unwrap();
    println!("{}", serde_json::to_string(&r).unwrap());
    assert!(r.passed(), "{r:#?}");
    assert_eq!(r.host_payload_bytes, 0);
    assert_eq!(r.backend, "cuda_ipc");
}

#[test]
fn gpu_quick_bench_rows_verify_their_bytes() {
    if !gpu_or_skip() {
        return;
    }
    let rows = bench::run(&BenchOpts {
        profile: Profile::Gpu,
        repeats: 3,
        quick: true,
        nixl: false,
    })
    .unwrap();
    for r in &rows {
        println!("{}", serde_json::to_string(r).unwrap());
        assert!(r.gbps > 0.0 && r.raw_gbps > 0.0, "{}", r.name);
    }
    assert!(rows.iter().any(|r| r.name.contains("scattered")));
}

/// A region that claims to be a device-local import on `ordinal`; its
/// address is never dereferenced (the backend must refuse before any launch).
#[derive(Debug)]
struct FakeDeviceRegion {
    ordinal: u32,
    len: usize,
    import: bool,
}

impl kv_bank::BankMemory for FakeDeviceRegion {
    fn kind(&self) -> kv_bank::MemoryKind {
        kv_bank::MemoryKind::Cuda {
            ordinal: self.ordinal,
        }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn base_addr(&self) -> u64 {
        // Non-null and 256-aligned, like a device allocation; never read.
        0x7f00_0000_0000
    }
    fn export_handle(&self) -> Option<kv_descriptor::ExportHandle> {
        None
    }
    fn device_local_mapping(&self) -> bool {
        self.import
    }
}

#[test]
fn an_import_mapped_for_another_device_is_refused_before_any_launch() {
    use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
    use kv_transfer::{deliver, DeliveryControl, RankIo, SourceRegion, TransferError};

    if !gpu_or_skip() {
        return;
    }
    let l = KvLayout::new(2, 2, 16, DType::Bf16, 4, TensorOrder::BlockMajor, 1).unwrap();
    let geom = RegionGeometry::dense(&l, 8);
    let moves = [BlockMove {
        key: SequenceHash(1),
        src_slot: Some(3),
        dst_block: 0,
    }];
    let plan = TransferPlan::new(&l, &l, &moves, &[geom], &[geom]).unwrap();
    let len = geom.region_bytes() as usize;
    // Source mapped for device 0 only, destination on device 1: whether or not
    // this machine has a device 1, the refusal must come first.
    let src = FakeDeviceRegion {
        ordinal: 0,
        len,
        import: true,
    };
    let dst = FakeDeviceRegion {
        ordinal: 1,
        len,
        import: false,
    };
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    let io = [RankIo {
        src: SourceRegion::Mapped(&src),
        dst: &dst,
    }];
    let err = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap_err();
    let text = err.to_string();
    println!("refused: {text}");
    // `deliver` may wrap the part's error with its rank.
    assert!(
        text.contains("backend `cuda_ipc` cannot copy cuda:0 (an import mapped for device 0 only"),
        "{err:?}"
    );
    assert!(
        text.contains("open it on the destination device 1"),
        "{text}"
    );
    assert!(!matches!(err, TransferError::Cuda { .. }), "{err:?}");
}
