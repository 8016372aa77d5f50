//! GPU checks: skip with a printed reason when no CUDA device is visible
//! (`cudarc` is probed with `is_culib_present` before any call).
//! On a GPU machine these run the oracle's GPU profile, a quick GPU bench and
//! the converting gather into every target layout (every byte checked).

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
        sweep: false,
    })
    .unwrap();
    for r in &rows {
        println!("{}", serde_json::to_string(r).unwrap());
        assert!(r.gbps > 0.0 && r.raw_gbps > 0.0, "{}", r.name);
        // Phases on exactly the gather and convert rows, with a real kernel time.
        let gather = r.name.contains("/cuda_ipc/scattered/") || r.name.contains("cuda_convert");
        assert_eq!(r.phases.is_some(), gather, "{}", r.name);
        if let Some(p) = r.phases {
            assert!(
                p.kernel_us > 0.0 && p.kernel_ratio > 0.0,
                "{}: {p:?}",
                r.name
            );
            assert!(
                p.host_plan_us > 0.0 && p.upload_us >= 0.0,
                "{}: {p:?}",
                r.name
            );
        }
    }
    assert!(rows.iter().any(|r| r.name.contains("scattered")));
    // The converting rows: one per target layout, 32 blocks of the quick 8B shape.
    for label in ["block_major", "vllm_kv_first", "hf_tokens_at_48"] {
        let name = format!("gpu/cuda_convert/8b_scattered_to_{label}/32x256KiB");
        let r = rows.iter().find(|r| r.name == name).expect(&name);
        assert_eq!(r.bytes, 32 * (256 << 10), "{name}");
    }
}

#[test]
fn gpu_quick_sweep_covers_the_grid_and_picks_a_best_per_case() {
    if !gpu_or_skip() {
        return;
    }
    let rows = bench::run(&BenchOpts {
        profile: Profile::Gpu,
        repeats: 2,
        quick: true,
        nixl: false,
        sweep: true,
    })
    .unwrap();
    let grid = kv_transfer::bench_sweep::GRID.len();
    let swept = rows.iter().filter(|r| r.name.starts_with("sweep/")).count();
    let best: Vec<_> = rows
        .iter()
        .filter(|r| r.name.starts_with("sweep_best/"))
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(swept, 3 * grid, "{rows:#?}");
    assert_eq!(best.len(), 3, "{best:?}");
    assert!(rows
        .iter()
        .all(|r| r.phases.is_some_and(|p| p.kernel_us > 0.0)));
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

/// Target regions of every order for geometry `g` and `blocks` blocks, each
/// starting `base` bytes into its region (a base that is not 16-byte aligned
/// drives the narrower kernel entry points).
fn convert_targets(
    g: &kv_descriptor::KvLayout,
    blocks: u32,
    base: u64,
) -> Vec<(&'static str, kv_descriptor::KvRegionLayout)> {
    use kv_descriptor::KvRegionLayout;
    let e = g.dtype().size_bytes() as u64;
    let (t, h, d) = (
        u64::from(g.tokens_per_block()),
        u64::from(g.heads_per_rank()),
        u64::from(g.head_dim()),
    );
    let (layers, nb) = (u64::from(g.num_layers()), u64::from(blocks));
    let bm = base + nb * g.rank_block_bytes() as u64;
    let vstride = 2 * nb * t * h * d * e + 64;
    let max_tokens = 3 + nb * t + 5;
    let hstride = 2 * 2 * h * max_tokens * d * e;
    vec![
        (
            "block_major",
            KvRegionLayout::block_major(*g, 0, base, blocks, bm).unwrap(),
        ),
        (
            "vllm_kv_first",
            KvRegionLayout::vllm_kv_first(*g, 0, base, vstride, blocks, base + layers * vstride)
                .unwrap(),
        ),
        (
            "vllm_block_first",
            KvRegionLayout::vllm_block_first(*g, 0, base, vstride, blocks, base + layers * vstride)
                .unwrap(),
        ),
        (
            "hf_tokens_at_3",
            KvRegionLayout::hf_tokens(
                *g,
                0,
                base,
                hstride,
                2,
                1,
                max_tokens,
                3,
                blocks,
                base + layers * hstride,
            )
            .unwrap(),
        ),
    ]
}

#[test]
fn convert_kernel_lands_every_byte_of_every_layout() {
    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::cuda_gather::{reference_convert, ConvertPlan};
    use kv_transfer::DeliveryControl;

    if !gpu_or_skip() {
        return;
    }
    // SAFETY: only probes whether libnvrtc can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("SKIP convert kernel: libnvrtc not loadable");
        return;
    }
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    let peers = kv_transfer::cuda::device_count().min(2) as u32;
    // bf16 head_dim 64 (16-byte rows), fp8 head_dim 4 (4-byte rows).
    let shapes = [(3, 2, 64, DType::Bf16, 16), (2, 3, 4, DType::Fp8E4m3, 5)];
    for (layers, heads, dim, dt, tokens) in shapes {
        let g = KvLayout::new(layers, heads, dim, dt, tokens, TensorOrder::BlockMajor, 1).unwrap();
        let bb = g.rank_block_bytes() as u64;
        let donor = KvRegionLayout::block_major(g, 0, 0, 16, 16 * bb).unwrap();
        let pattern: Vec<u8> = (0..donor.region_bytes())
            .map(|i| (i * 31 + i / 509) as u8 | 1)
            .collect();
        let moves = [(5, 0), (1, 3), (14, 1), (9, 2), (0, 5), (7, 6)];
        for dst_dev in 0..peers {
            let src = kv_bank::CudaDeviceMemory::new(0, pattern.len()).unwrap();
            src.write_bytes(0, &pattern).unwrap();
            // Base 0: 16-byte rows; 1 and 4 elements in: the 1/2/4/8-byte entry points.
            for base in [0u64, 1, 4] {
                for (label, target) in convert_targets(&g, 8, base * dt.size_bytes() as u64) {
                    let len = target.region_bytes() as usize;
                    let dst = kv_bank::CudaDeviceMemory::new(dst_dev, len).unwrap();
                    dst.write_bytes(0, &vec![0xEE; len]).unwrap();
                    let plan = ConvertPlan::new(&donor, &target, &moves).unwrap();
                    let out = backend
                        .convert_blocks(&plan, &src, &dst, &DeliveryControl::new())
                        .unwrap();
                    let mut want = vec![0xEE; len];
                    reference_convert(&donor, &target, &moves, &pattern, &mut want).unwrap();
                    let got = dst.read_vec(0, len).unwrap();
                    let first_bad = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert_eq!(
                        first_bad, None,
                        "{label} {dt:?} base {base} device 0 -> {dst_dev}: first differing byte"
                    );
                    assert_eq!(out.bytes, moves.len() as u64 * bb);
                    assert_eq!((out.copies, out.host_payload_bytes), (1, 0));
                    println!(
                        "convert {label} {dt:?} base {base} 0 -> {dst_dev}: {} bytes, {}",
                        out.bytes, out.transport
                    );
                }
            }
        }
    }
}

#[test]
fn convert_blocks_refuses_a_region_shorter_than_its_layout_before_any_launch() {
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::cuda_gather::ConvertPlan;
    use kv_transfer::{DeliveryControl, TransferError};

    if !gpu_or_skip() {
        return;
    }
    let g = KvLayout::new(2, 2, 16, DType::Bf16, 4, TensorOrder::BlockMajor, 1).unwrap();
    let bb = g.rank_block_bytes() as u64;
    let donor = KvRegionLayout::block_major(g, 0, 0, 8, 8 * bb).unwrap();
    let target = KvRegionLayout::block_major(g, 0, 0, 4, 4 * bb).unwrap();
    let plan = ConvertPlan::new(&donor, &target, &[(3, 0)]).unwrap();
    // Fake regions: never dereferenced, the refusal comes first.
    let src = FakeDeviceRegion {
        ordinal: 0,
        len: (8 * bb) as usize,
        import: false,
    };
    let dst = FakeDeviceRegion {
        ordinal: 0,
        len: (4 * bb - 1) as usize,
        import: false,
    };
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    let e = backend
        .convert_blocks(&plan, &src, &dst, &DeliveryControl::new())
        .unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::InvalidInput {
                field: "dst.len",
                ..
            }
        ),
        "{e:?}"
    );
}

/// A GPU with the converting kernel (libnvrtc loadable), else prints why
/// `what` is skipped.
fn kernel_or_skip(what: &str) -> bool {
    if !gpu_or_skip() {
        return false;
    }
    // SAFETY: only probes whether libnvrtc can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("SKIP {what}: libnvrtc not loadable");
        return false;
    }
    true
}

/// `len` donor bytes on device 0 with no zero byte (`i * mul + i / div`,
/// odd), and their host copy.
fn donor_rows(len: u64, mul: u64, div: u64) -> (Vec<u8>, kv_bank::CudaDeviceMemory) {
    use kv_bank::BankMemory;
    let pattern: Vec<u8> = (0..len).map(|i| (i * mul + i / div) as u8 | 1).collect();
    let src = kv_bank::CudaDeviceMemory::new(0, pattern.len()).unwrap();
    src.write_bytes(0, &pattern).unwrap();
    (pattern, src)
}

/// 40 pool rows gathered from scattered donor slots (enough runs for the
/// kernel path): key `i + 1`, slot `(11 i + 5) % slots`, row `7 i % rows`.
fn scattered_pool_moves(slots: u32, rows: u32) -> Vec<kv_transfer::plan::BlockMove> {
    (0..40u32)
        .map(|i| kv_transfer::plan::BlockMove {
            key: kv_descriptor::SequenceHash(u64::from(i) + 1),
            src_slot: Some((i * 11 + 5) % slots),
            dst_block: (i * 7) % rows,
        })
        .collect()
}

/// A consumer released layer group by layer group
/// ([`kv_transfer::ConsumerStream::with_layer_groups`]): a converting part
/// is launched per group and each group's `LayersReady` arrives in layer
/// order; work enqueued on the consumer stream behind a group's wait (a
/// copy of the whole target taken right then) sees every byte of that
/// group's layers and the earlier ones landed. A block-major part on the
/// same consumer is one group of every layer. The part notice comes once.
#[test]
fn a_layered_consumer_reads_each_group_after_its_copies() {
    use std::sync::{Arc, Mutex};

    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, SequenceHash, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::cuda_gather::reference_convert;
    use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
    use kv_transfer::{
        deliver, layer_group_ranges, ConsumerStream, DeliveryControl, LayersReady, RankIo,
        SourceRegion,
    };

    if !kernel_or_skip("layered consumer") {
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let consumer = ctx.new_stream().unwrap();
    let cs = consumer.cu_stream() as u64;
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    // 6 layers in 4 groups (2, 2, 1, 1 layers): uneven groups covered.
    let g = KvLayout::new(6, 2, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let bb = g.rank_block_bytes() as u64;
    let slots = 64u32;
    let (pattern, src) = donor_rows(u64::from(slots) * bb, 31, 1019);
    let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).unwrap();

    for (name, target) in convert_targets(&g, 24, 0)
        .into_iter()
        .filter(|(l, _)| *l != "block_major")
    {
        let len = target.region_bytes() as usize;
        let dst = kv_bank::CudaDeviceMemory::new(0, len).unwrap();
        dst.write_bytes(0, &vec![0u8; len]).unwrap();
        let checks: Arc<Vec<kv_bank::CudaDeviceMemory>> = Arc::new(
            (0..4)
                .map(|_| kv_bank::CudaDeviceMemory::new(0, len).unwrap())
                .collect(),
        );
        let seen: Arc<Mutex<Vec<std::ops::Range<u32>>>> = Arc::default();
        let parts: Arc<Mutex<Vec<u32>>> = Arc::default();
        let (s2, c2, d2) = (seen.clone(), checks.clone(), dst.base_addr());
        let on_group = Arc::new(move |r: LayersReady| {
            let k = s2.lock().unwrap().len();
            // SAFETY: `consumer` is a live stream of device 0's primary
            // context for the whole test.
            let on = unsafe { ConsumerStream::new(0, cs, Arc::new(|_| {})) };
            r.enqueue_wait(&on).unwrap();
            // SAFETY: both are live device allocations of `len` bytes.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    c2[k].base_addr(),
                    d2,
                    len,
                    cs as cudarc::driver::sys::CUstream,
                )
            }
            .unwrap();
            s2.lock().unwrap().push(r.layers());
        });
        let p2 = parts.clone();
        // SAFETY: as above.
        let c =
            unsafe { ConsumerStream::new(0, cs, Arc::new(move |r| p2.lock().unwrap().push(r))) }
                .with_layer_groups(4, on_group)
                .unwrap();
        let control = DeliveryControl {
            consumer: Some(c),
            ..DeliveryControl::new()
        };
        let moves: Vec<BlockMove> = (0..24u32)
            .map(|i| BlockMove {
                key: SequenceHash(u64::from(i) + 1),
                src_slot: Some((i * 7 + 3) % slots),
                dst_block: i,
            })
            .collect();
        let plan = TransferPlan::converting(
            std::slice::from_ref(&donor),
            std::slice::from_ref(&target),
            &moves,
        )
        .unwrap();
        let io = [RankIo {
            src: SourceRegion::Mapped(&src),
            dst: &dst,
        }];
        let report = deliver(&plan, &backend, &io, &control).unwrap();
        assert!(report.is_complete(), "{name}");
        consumer.synchronize().unwrap();
        let ranges = layer_group_ranges(6, 4);
        assert_eq!(*seen.lock().unwrap(), ranges, "{name}");
        assert_eq!(*parts.lock().unwrap(), vec![0], "{name}");
        let pairs: Vec<(u32, u32)> = moves
            .iter()
            .map(|m| (m.src_slot.unwrap(), m.dst_block))
            .collect();
        let mut want = vec![0u8; len];
        reference_convert(&donor, &target, &pairs, &pattern, &mut want).unwrap();
        for (k, r) in ranges.iter().enumerate() {
            // The reference of layers ..r.end only: a donor with later layers zeroed.
            let mut part_src = vec![0u8; pattern.len()];
            // One head_dim run (64 bf16, dense) per (layer, block, K/V, token, head).
            let run = 64 * 2;
            for l in 0..r.end {
                for b in 0..slots {
                    for kv in 0..2 {
                        for t in 0..16 {
                            for h in 0..2 {
                                let at = donor.run_offset(l, b, kv, t, h).unwrap() as usize;
                                part_src[at..at + run].copy_from_slice(&pattern[at..at + run]);
                            }
                        }
                    }
                }
            }
            let mut landed = vec![0u8; len];
            reference_convert(&donor, &target, &pairs, &part_src, &mut landed).unwrap();
            let got = checks[k].read_vec(0, len).unwrap();
            let bad = (0..len).find(|&i| landed[i] != 0 && got[i] != want[i]);
            assert_eq!(
                bad, None,
                "{name}: group {k} ({r:?}) read before its layers landed"
            );
        }
        assert_eq!(checks[3].read_vec(0, len).unwrap(), want, "{name}");
    }

    // Block-major pool rows on a layered consumer: one group of every layer.
    let seen: Arc<Mutex<Vec<std::ops::Range<u32>>>> = Arc::default();
    let s2 = seen.clone();
    // SAFETY: as above.
    let c = unsafe { ConsumerStream::new(0, cs, Arc::new(|_| {})) }
        .with_layer_groups(
            4,
            Arc::new(move |r: LayersReady| s2.lock().unwrap().push(r.layers())),
        )
        .unwrap();
    let control = DeliveryControl {
        consumer: Some(c),
        ..DeliveryControl::new()
    };
    let rows = 48u32;
    let moves = scattered_pool_moves(slots, rows);
    let geo_src = RegionGeometry::dense(&g, slots);
    let geo_dst = RegionGeometry::dense(&g, rows);
    let plan = TransferPlan::new(&g, &g, &moves, &[geo_src], &[geo_dst]).unwrap();
    let dst = kv_bank::CudaDeviceMemory::new(0, geo_dst.region_bytes() as usize).unwrap();
    let io = [RankIo {
        src: SourceRegion::Mapped(&src),
        dst: &dst,
    }];
    assert!(deliver(&plan, &backend, &io, &control)
        .unwrap()
        .is_complete());
    consumer.synchronize().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0..u32::MAX]);
    println!("layered consumer: 4 groups per converting part, each read after its layers landed");
}

/// A [`kv_transfer::ConsumerStream`]: the engine's stream is made to wait for
/// the delivery's copies before the delivery returns, and work the notice
/// enqueues on it (a copy of the destination into a check buffer) runs after
/// every byte landed. Both the converting kernel and the scattered gather of
/// pool rows are covered; each notice comes exactly once per part.
#[test]
fn a_consumer_stream_waits_for_the_copies_it_was_released_behind() {
    use std::sync::{Arc, Mutex};

    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::cuda_gather::{reference_convert, ConvertPlan};
    use kv_transfer::plan::{RegionGeometry, TransferPlan};
    use kv_transfer::{deliver, ConsumerStream, DeliveryControl, RankIo, SourceRegion};

    if !kernel_or_skip("consumer stream") {
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let consumer = ctx.new_stream().unwrap();
    let backend = CudaCopyBackend::new(CudaMode::Auto).unwrap();
    let g = KvLayout::new(4, 2, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let bb = g.rank_block_bytes() as u64;
    let slots = 64u32;
    let (pattern, src) = donor_rows(u64::from(slots) * bb, 29, 1021);

    // The notice copies the whole destination into `check` on the consumer
    // stream: ordered after the copies only by the wait the backend enqueued.
    let control_for = |dst: u64, check: u64, len: usize, seen: Arc<Mutex<Vec<u32>>>| {
        let stream = consumer.cu_stream() as u64;
        let notice = Arc::new(move |rank: u32| {
            seen.lock().unwrap().push(rank);
            // SAFETY: `dst` and `check` are live device allocations of `len`
            // bytes on device 0, and `stream` a live stream of its context.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    check,
                    dst,
                    len,
                    stream as cudarc::driver::sys::CUstream,
                )
            }
            .unwrap();
        });
        // SAFETY: `consumer` is a stream of device 0's primary context and
        // outlives every delivery of this test.
        let c = unsafe { ConsumerStream::new(0, consumer.cu_stream() as u64, notice) };
        DeliveryControl {
            consumer: Some(c),
            ..DeliveryControl::new()
        }
    };

    // Converting kernel: donor block-major -> HF tokens at offset 3.
    let donor = KvRegionLayout::block_major(g, 0, 0, slots, u64::from(slots) * bb).unwrap();
    let moves: Vec<(u32, u32)> = (0..24).map(|i| ((i * 7 + 3) % slots, i)).collect();
    let (_, target) = convert_targets(&g, 24, 0)
        .into_iter()
        .find(|(l, _)| *l == "hf_tokens_at_3")
        .unwrap();
    let len = target.region_bytes() as usize;
    let dst = kv_bank::CudaDeviceMemory::new(0, len).unwrap();
    dst.write_bytes(0, &vec![0xEE; len]).unwrap();
    let check = kv_bank::CudaDeviceMemory::new(0, len).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let control = control_for(dst.base_addr(), check.base_addr(), len, seen.clone());
    let plan = ConvertPlan::new(&donor, &target, &moves).unwrap();
    backend.convert_blocks(&plan, &src, &dst, &control).unwrap();
    consumer.synchronize().unwrap();
    let mut want = vec![0xEE; len];
    reference_convert(&donor, &target, &moves, &pattern, &mut want).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0]);
    let got = check.read_vec(0, len).unwrap();
    assert_eq!(got.iter().zip(&want).position(|(a, b)| a != b), None);

    // Scattered gather of pool rows (enough runs for the kernel path).
    let rows = 48u32;
    let geo_src = RegionGeometry::dense(&g, slots);
    let geo_dst = RegionGeometry::dense(&g, rows);
    let moves = scattered_pool_moves(slots, rows);
    let plan = TransferPlan::new(&g, &g, &moves, &[geo_src], &[geo_dst]).unwrap();
    let len = geo_dst.region_bytes() as usize;
    let dst = kv_bank::CudaDeviceMemory::new(0, len).unwrap();
    dst.write_bytes(0, &vec![0xEE; len]).unwrap();
    let check = kv_bank::CudaDeviceMemory::new(0, len).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let control = control_for(dst.base_addr(), check.base_addr(), len, seen.clone());
    let io = [RankIo {
        src: SourceRegion::Mapped(&src),
        dst: &dst,
    }];
    let report = deliver(&plan, &backend, &io, &control).unwrap();
    assert!(report.is_complete());
    consumer.synchronize().unwrap();
    let mut want = vec![0xEE; len];
    for m in &moves {
        let (s, d) = (
            (u64::from(m.src_slot.unwrap()) * bb) as usize,
            (u64::from(m.dst_block) * bb) as usize,
        );
        want[d..d + bb as usize].copy_from_slice(&pattern[s..s + bb as usize]);
    }
    assert_eq!(*seen.lock().unwrap(), vec![0]);
    let got = check.read_vec(0, len).unwrap();
    assert_eq!(got.iter().zip(&want).position(|(a, b)| a != b), None);
    println!(
        "consumer stream: converting and gathering deliveries released it behind their copies ({})",
        report.counters.transport
    );
}

/// Every `KV_GATHER_UPLOAD` variant delivers a scattered fetch byte for
/// byte through `deliver`: 3,000 blocks of 4 KiB (ids packable), then the
/// same rows with donor ids past 16 bits (no packed table), with the
/// pipeline cut small so many chunks (and the device-table fallback) run;
/// every target byte against the donor, untouched rows still zero.
#[test]
fn every_upload_variant_lands_every_byte_of_a_scattered_fetch() {
    use kv_bank::BankMemory;
    use kv_descriptor::{DType, KvLayout, SequenceHash, TensorOrder};
    use kv_transfer::cuda::{CudaCopyBackend, CudaMode};
    use kv_transfer::cuda_gather::{GatherUpload, Pipeline};
    use kv_transfer::plan::{BlockMove, RegionGeometry, TransferPlan};
    use kv_transfer::{deliver, DeliveryControl, RankIo, SourceRegion};
    if !gpu_or_skip() {
        return;
    }
    // 2 layers x 2 (K,V) x 16 tokens x 1 head x 32 dims x bf16 = 4 KiB.
    let l = KvLayout::new(2, 1, 32, DType::Bf16, 16, TensorOrder::BlockMajor, 1).unwrap();
    let bb = l.rank_block_bytes();
    assert_eq!(bb, 4096);
    let n = 3000u32;
    // Ids below 65,536 (the plan packs them: launched from its packed rows),
    // past it (from the runs), and runs of 5 merged rows (packed rows whose
    // chunks cut through runs).
    for (slot_base, merged) in [(0u32, false), (70_000, false), (0, true)] {
        let slots = slot_base + 2 * n + 2;
        let src = kv_bank::CudaDeviceMemory::new(0, slots as usize * bb).unwrap();
        let pattern: Vec<u8> = (0..src.len())
            .map(|i| (i * 7 + i / 4093) as u8 | 1)
            .collect();
        src.write_bytes(0, &pattern).unwrap();
        // Every other donor slot, reversed; every target block but the last.
        let moves: Vec<BlockMove> = (0..n)
            .map(|i| BlockMove {
                key: SequenceHash(u64::from(i)),
                src_slot: Some(if merged {
                    i + 2 * (i / 5)
                } else {
                    slot_base + 2 * (n - i) - 1
                }),
                dst_block: i,
            })
            .collect();
        let plan = TransferPlan::new(
            &l,
            &l,
            &moves,
            &[RegionGeometry::dense(&l, slots)],
            &[RegionGeometry::dense(&l, n + 1)],
        )
        .unwrap();
        let part = &plan.parts()[0];
        assert_eq!(part.packed_rows().is_some(), slot_base == 0);
        assert_eq!(part.runs().len(), if merged { 600 } else { 3000 });
        for (upload, pipeline) in [
            (GatherUpload::Params, Pipeline::default()),
            (GatherUpload::Copy, Pipeline::default()),
            (GatherUpload::Pipelined, Pipeline::default()),
            (GatherUpload::Pipelined, Pipeline::new(64 << 10, 2).unwrap()),
            (GatherUpload::Pipelined2, Pipeline::default()),
            (GatherUpload::Pipelined2, Pipeline::new(8 << 20, 4).unwrap()),
            (
                GatherUpload::Pipelined2,
                Pipeline::new(64 << 10, 2).unwrap(),
            ),
        ] {
            let backend = CudaCopyBackend::new(CudaMode::Auto)
                .unwrap()
                .with_upload(upload, pipeline);
            let dst = kv_bank::CudaDeviceMemory::new(0, (n as usize + 1) * bb).unwrap();
            dst.write_bytes(0, &vec![0; dst.len()]).unwrap();
            let io = [RankIo {
                src: SourceRegion::Mapped(&src),
                dst: &dst,
            }];
            let rep = deliver(&plan, &backend, &io, &DeliveryControl::new()).unwrap();
            assert!(rep.is_complete());
            assert_eq!(rep.counters.bytes, u64::from(n) * bb as u64);
            assert_eq!(rep.counters.host_payload_bytes, 0);
            let got = dst.read_vec(0, dst.len()).unwrap();
            for m in &moves {
                let (s, d) = (m.src_slot.unwrap() as usize * bb, m.dst_block as usize * bb);
                assert!(
                    got[d..d + bb] == pattern[s..s + bb],
                    "{upload:?} {pipeline:?} slots from {slot_base}: block {} differs",
                    m.dst_block
                );
            }
            assert!(got[n as usize * bb..].iter().all(|&b| b == 0));
            // 3,000 x 4 KiB is 11.7 MiB: one launch unpipelined or under
            // the default 16 MiB first chunk, 2,048 + 952 rows under an
            // 8 MiB one, many chunks when cut small.
            let launches = rep.counters.copies;
            let first = pipeline.first_bytes();
            match (upload.pipelines(), first) {
                (true, f) if f == 8 << 20 => assert_eq!(launches, 2),
                (true, f) if f == 64 << 10 => assert!(launches > 3, "{launches}"),
                _ => assert_eq!(launches, 1),
            }
            println!(
                "{upload:?} first {} KiB growth {}, slots from {slot_base}, merged {merged}: {launches} launches, every byte matches",
                pipeline.first_bytes() >> 10,
                pipeline.growth()
            );
        }
    }
}
