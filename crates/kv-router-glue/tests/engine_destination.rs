//! Engine-chosen destinations: a fetch lands at the block ids the engine's
//! allocator chose, inside the engine's own tensors (an [`EngineRegion`] per
//! TP rank), with the reservation, quiescence and no-false-completion rules
//! of the executor's own rows; the pool path is unchanged beside it.
//!
//! Tests share one lock: host shm segments and leases are process-wide names.

mod common;
use common::*;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kv_bank::{BankError, BankManager, BankMemory, DestinationPool};
use kv_descriptor::*;
use kv_router_glue::*;
use kv_transfer::plan::PartPlan;
use kv_transfer::{
    CopyBackend, DeliveryControl, HostBuffer, HostCopyBackend, PartOutcome, RankIo, TransferError,
};

const POISON: u8 = 0xA5;
const BLOCKS: u32 = 16;

fn envelope(bank: &BankManager, entries: &[(SequenceHash, u32)]) -> HintEnvelope {
    HintEnvelope::fetch_gpu("req-e", "a0", &hint(bank, entries, "unix:/nonexistent")).unwrap()
}

/// Rank `r`'s engine layout: 0 vLLM kv-first (layers 4 KiB apart),
/// 1 vLLM block-first, 2 HF at token offset 3 (sequence 1 of 2), 3 bank rows.
fn engine_layout(kind: u8, r: u32) -> KvRegionLayout {
    let g = layout();
    let layer = u64::from(BLOCKS) * rbb() as u64 / 2;
    match kind {
        0 => KvRegionLayout::vllm_kv_first(g, r, 0, layer + 4096, BLOCKS, 2 * (layer + 4096)),
        1 => KvRegionLayout::vllm_block_first(g, r, 0, layer, BLOCKS, 2 * layer),
        2 => {
            let max_tokens = 3 + u64::from(BLOCKS) * BLOCK_TOKENS as u64;
            let lb = 2 * 2 * 2 * max_tokens * 8 * 4;
            KvRegionLayout::hf_tokens(g, r, 0, lb, 2, 1, max_tokens, 3, BLOCKS, 2 * lb)
        }
        _ => KvRegionLayout::block_major(g, r, 0, BLOCKS, 2 * layer),
    }
    .unwrap()
}

/// Poisoned engine memory of `kind` for every rank.
fn engine_regions(kind: u8) -> (Vec<Arc<HostBuffer>>, Vec<EngineRegion>) {
    let mut mems = Vec::new();
    let mut regions = Vec::new();
    for r in 0..TP {
        let layout = engine_layout(kind, r);
        let mut b = HostBuffer::zeroed(layout.region_bytes() as usize).unwrap();
        b.as_mut_slice().fill(POISON);
        let b = Arc::new(b);
        mems.push(b.clone());
        regions.push(EngineRegion { memory: b, layout });
    }
    (mems, regions)
}

fn engine_executor(
    kind: u8,
    backend: Arc<dyn CopyBackend>,
) -> (Vec<Arc<HostBuffer>>, FetchExecutor) {
    let (mems, regions) = engine_regions(kind);
    let exec = FetchExecutor::with_engine_regions(
        layout(),
        DestinationPool::new(BLOCKS),
        regions,
        backend,
    )
    .unwrap();
    (mems, exec)
}

/// What rank `r`'s engine memory must hold after `keys` landed at `dst`:
/// poison everywhere but each element of each block, which is the donor's
/// element of the same (layer, kv, token, head, d) by [`pattern`].
fn expected_image(kind: u8, r: u32, keys: &[SequenceHash], dst: &[u32]) -> Vec<u8> {
    let g = layout();
    let tl = engine_layout(kind, r);
    let bank_block = KvRegionLayout::block_major(g, r, 0, 1, rbb() as u64).unwrap();
    let mut img = vec![POISON; tl.region_bytes() as usize];
    for (k, &b) in keys.iter().zip(dst) {
        for l in 0..g.num_layers() {
            for kv in 0..2 {
                for t in 0..g.tokens_per_block() {
                    for h in 0..g.heads_per_rank() {
                        let s = bank_block.run_offset(l, 0, kv, t, h).unwrap() as usize;
                        let o = tl.run_offset(l, b, kv, t, h).unwrap() as usize;
                        for i in 0..32 {
                            img[o + i] = pattern(*k, r, s + i);
                        }
                    }
                }
            }
        }
    }
    img
}

fn image(m: &HostBuffer) -> Vec<u8> {
    m.read_vec(0, m.len()).unwrap()
}

#[test]
fn a_fetch_lands_at_engine_chosen_blocks_in_every_engine_layout() {
    let _g = lock();
    for kind in 0..4u8 {
        let bank = bank(16, &format!("eng-land-{kind}"));
        store_chain(&bank, 7, 2).unwrap(); // the prefix sits mid-bank
        let a = store(&bank, 3);
        let (mems, exec) = engine_executor(kind, Arc::new(HostCopyBackend));
        let dst = [9, 2, 5];
        let out = exec
            .execute_at(
                &envelope(&bank, &a),
                &dst,
                bank.as_ref(),
                &DeliveryControl::new(),
            )
            .unwrap();
        assert_eq!(&out.target_blocks[..], &dst);
        assert!(out.report.is_complete());
        assert_eq!(out.report.counters.bytes, 3 * 2 * rbb() as u64);
        let keys: Vec<_> = a.iter().map(|e| e.0).collect();
        for r in 0..TP {
            assert!(
                image(&mems[r as usize]) == expected_image(kind, r, &keys, &dst),
                "kind {kind} rank {r}: every element at its engine address, nothing else written"
            );
        }
        // Held while the outcome lives, free after.
        assert_eq!(exec.pool().free_blocks(), BLOCKS as usize - 3);
        drop(out);
        assert_eq!(exec.pool().free_blocks(), BLOCKS as usize);
        assert_eq!(bank.pins_outstanding(), 0);
    }
}

/// A caller's bad `dst_blocks` (an allocator bug) is an argument error,
/// typed and naming the entry, not a fallback: refused before the pool or
/// the donor is touched, with its own metrics labels.
#[test]
fn repeated_out_of_range_or_miscounted_block_ids_are_argument_errors_before_a_pin() {
    let _g = lock();
    let bank = bank(8, "eng-refuse");
    let a = store(&bank, 3);
    let (mems, exec) = engine_executor(0, Arc::new(HostCopyBackend));
    let check = |dst: &[u32], e: &FetchError| match (dst, e) {
        (
            [3, 3, 4],
            FetchError::DstBlockRepeated {
                index: 1,
                block: 3,
                first: 0,
            },
        ) => "dst_block_repeated",
        (
            [1, 2, BLOCKS],
            FetchError::DstBlockOutOfRange {
                index: 2,
                block: BLOCKS,
                capacity: BLOCKS,
            },
        ) => "dst_block_out_of_range",
        (
            [1, 2],
            FetchError::DstBlocksCount {
                given: 2,
                fetched: 3,
                fetch_from: 0,
            },
        ) => "dst_blocks_count",
        _ => panic!("{dst:?}: {e:?}"),
    };
    for (dst, message) in [
        (
            &[3u32, 3, 4][..],
            "`dst_blocks[1]` = 3 repeats `dst_blocks[0]`",
        ),
        (
            &[1, 2, BLOCKS][..],
            "`dst_blocks[2]` = 16 is not below the destination's 16 blocks",
        ),
        (
            &[1, 2][..],
            "`dst_blocks` holds 2 block ids, the hint fetches 3 blocks (from block 0)",
        ),
    ] {
        let e = exec
            .execute_at(
                &envelope(&bank, &a),
                dst,
                bank.as_ref(),
                &DeliveryControl::new(),
            )
            .unwrap_err();
        let cause = check(dst, &e);
        assert_eq!(e.to_string(), message);
        assert!(e.is_argument_error() && e.fallback_cause().is_none(), "{e}");
        assert_eq!(metrics::fallback_labels(&e), ("argument", cause));
        // The same answer from the early check, before any fetch.
        let hint = &envelope(&bank, &a).fetch_gpu_actions().unwrap()[0];
        check(dst, &exec.check_dst_blocks(hint, dst).unwrap_err());
        assert_eq!(
            exec.pool().free_blocks(),
            BLOCKS as usize,
            "nothing reserved"
        );
        assert_eq!(bank.pins_outstanding(), 0, "the donor was not asked");
    }
    assert!(mems.iter().all(|m| image(m).iter().all(|&b| b == POISON)));
}

/// The bound is the pool's capacity, which may be below the regions'
/// blocks: an id between the two used to reach `reserve_exact` and come
/// back as `AlreadyReserved` (contention, a fallback); it is the caller's
/// out-of-range id. And a list holding both a held block and a repeat is
/// the repeat (the caller's bug), not contention.
#[test]
fn block_ids_past_a_smaller_pool_or_repeated_beside_a_held_one_are_not_contention() {
    let _g = lock();
    let bank = bank(8, "eng-smallpool");
    let a = store(&bank, 3);
    let (_mems, regions) = engine_regions(3);
    let exec = FetchExecutor::with_engine_regions(
        layout(),
        DestinationPool::new(BLOCKS / 2),
        regions,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    let run = |dst: &[u32]| {
        exec.execute_at(
            &envelope(&bank, &a),
            dst,
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap_err()
    };
    let e = run(&[1, BLOCKS / 2 + 2, 3]);
    assert!(
        matches!(
            e,
            FetchError::DstBlockOutOfRange {
                index: 1,
                block: 10,
                capacity: 8
            }
        ),
        "{e:?}"
    );
    let held = exec.pool().reserve_exact(&[5]).unwrap();
    let e = run(&[5, 2, 2]);
    assert!(
        matches!(
            e,
            FetchError::DstBlockRepeated {
                index: 2,
                block: 2,
                first: 1
            }
        ),
        "{e:?}"
    );
    assert_eq!(exec.pool().free_blocks(), BLOCKS as usize / 2 - 1);
    assert_eq!(bank.pins_outstanding(), 0);
    held.cancel().quiesced();
}

#[test]
fn an_engine_block_another_fetch_holds_is_refused_and_nothing_else_is_reserved() {
    let _g = lock();
    let bank = bank(8, "eng-held");
    let a = store(&bank, 3);
    let (mems, exec) = engine_executor(1, Arc::new(HostCopyBackend));
    let other = exec.pool().reserve_exact(&[5]).unwrap();
    let e = exec
        .execute_at(
            &envelope(&bank, &a),
            &[9, 5, 2],
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::Fallback {
                stage: "reserve",
                cause: FallbackCause::Bank(BankError::AlreadyReserved { block: 5 })
            }
        ),
        "{e}"
    );
    assert_eq!(exec.pool().free_blocks(), BLOCKS as usize - 1);
    assert!(!exec.pool().is_reserved(9) && !exec.pool().is_reserved(2));
    assert_eq!(bank.pins_outstanding(), 0);
    assert!(mems.iter().all(|m| image(m).iter().all(|&b| b == POISON)));
    other.cancel().quiesced();
}

/// A converting backend whose part fails: `Cancelled` on rank 0; on rank 1
/// `NotQuiesced` (a read that may still land) when `stall`, else `Cancelled`.
struct Failing {
    stall: bool,
    in_flight: AtomicUsize,
}

impl CopyBackend for Failing {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn converts(&self) -> bool {
        true
    }
    fn copy_part(
        &self,
        part: &PartPlan,
        _: &RankIo<'_>,
        _: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        assert!(
            part.conversion().is_some(),
            "a vLLM target is a converting part"
        );
        if part.tp_rank() == 1 && self.stall {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            return Err(TransferError::NotQuiesced {
                rank: 1,
                reason: "injected".into(),
            });
        }
        Err(TransferError::Cancelled)
    }
    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

#[test]
fn a_failed_engine_fetch_completes_nothing_and_keeps_blocks_a_read_may_write() {
    let _g = lock();
    let bank = bank(8, "eng-fail");
    let a = store(&bank, 3);
    for stall in [false, true] {
        let backend = Arc::new(Failing {
            stall,
            in_flight: AtomicUsize::new(0),
        });
        let (_mems, exec) = engine_executor(0, backend.clone());
        let e = exec
            .execute_at(
                &envelope(&bank, &a),
                &[9, 2, 5],
                bank.as_ref(),
                &DeliveryControl::new(),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                FetchError::Fallback {
                    stage: "transfer",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(bank.pins_outstanding(), 0);
        if stall {
            // The engine must not reuse these blocks: the read may still land.
            assert!([9, 2, 5].iter().all(|&b| exec.pool().is_reserved(b)));
            assert_eq!(exec.reclaim_quiesced(), 0, "still in flight");
            backend.in_flight.store(0, Ordering::SeqCst);
            assert_eq!(exec.reclaim_quiesced(), 3);
        }
        assert_eq!(exec.pool().free_blocks(), BLOCKS as usize);
    }
}

/// A backend that converts in name only: reports success without bytes.
struct Idle;
impl CopyBackend for Idle {
    fn name(&self) -> &'static str {
        "idle"
    }
    fn converts(&self) -> bool {
        true
    }
    fn copy_part(
        &self,
        _: &PartPlan,
        _: &RankIo<'_>,
        _: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        Ok(PartOutcome {
            bytes: 0,
            copies: 0,
            host_payload_bytes: 0,
            transport: "none".into(),
        })
    }
}

#[test]
fn a_short_engine_delivery_is_no_completion() {
    let _g = lock();
    let bank = bank(8, "eng-short");
    let a = store(&bank, 2);
    let (_mems, exec) = engine_executor(2, Arc::new(Idle));
    let e = exec
        .execute_at(
            &envelope(&bank, &a),
            &[4, 11],
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            FetchError::Fallback {
                stage: "transfer",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(exec.pool().free_blocks(), BLOCKS as usize);
}

#[test]
fn the_pool_path_is_unchanged_and_bank_rows_need_no_conversion() {
    let _g = lock();
    let bank = bank(8, "eng-rows");
    let a = store(&bank, 3);
    let (rows, pool_exec) = host_executor(BLOCKS);
    let out = pool_exec
        .execute(&envelope(&bank, &a), bank.as_ref(), &DeliveryControl::new())
        .unwrap();
    assert_eq!(&out.target_blocks[..], &[0, 1, 2]);
    // One run per rank: consecutive slots to consecutive rows.
    assert_eq!(out.report.counters.copies, 2);
    // Bank-row engine regions with a backend that does not convert: accepted,
    // and the same fetch moves the same bytes in the same copies.
    struct RowsOnly;
    impl CopyBackend for RowsOnly {
        fn name(&self) -> &'static str {
            "rows_only"
        }
        fn copy_part(
            &self,
            p: &PartPlan,
            io: &RankIo<'_>,
            c: &DeliveryControl,
        ) -> Result<PartOutcome, TransferError> {
            assert!(p.conversion().is_none());
            HostCopyBackend.copy_part(p, io, c)
        }
    }
    let (mems, exec) = engine_executor(3, Arc::new(RowsOnly));
    let out2 = exec
        .execute(&envelope(&bank, &a), bank.as_ref(), &DeliveryControl::new())
        .unwrap();
    assert_eq!(&out2.target_blocks[..], &[0, 1, 2]);
    assert_eq!(out2.report.counters.copies, 2);
    for r in 0..TP as usize {
        let n = 3 * rbb();
        assert_eq!(
            rows[r].read_vec(0, n).unwrap(),
            mems[r].read_vec(0, n).unwrap()
        );
    }
}

#[test]
fn engine_regions_are_checked_when_registered() {
    let _g = lock();
    let make = |regions: Vec<EngineRegion>, pool: u32, backend: Arc<dyn CopyBackend>| {
        FetchExecutor::with_engine_regions(layout(), DestinationPool::new(pool), regions, backend)
            .map(|_| ())
            .unwrap_err()
    };
    let field = |e: FetchError| match e {
        FetchError::LayoutMismatch { field, .. } => field,
        other => panic!("{other}"),
    };
    let host: Arc<dyn CopyBackend> = Arc::new(HostCopyBackend);
    let (_, mut swapped) = engine_regions(0);
    swapped.swap(0, 1);
    assert_eq!(
        field(make(swapped, BLOCKS, host.clone())),
        "regions.layout.tp_rank"
    );
    let (_, one) = engine_regions(0);
    assert_eq!(
        field(make(one[..1].to_vec(), BLOCKS, host.clone())),
        "regions"
    );
    // Same bytes per block, another geometry (head_dim 16, 2 tokens): refused.
    let other = KvLayout::new(2, 4, 16, DType::F32, 2, TensorOrder::BlockMajor, TP).unwrap();
    let (m, _) = engine_regions(0);
    let wrong: Vec<EngineRegion> = (0..TP)
        .map(|r| EngineRegion {
            memory: m[r as usize].clone(),
            layout: KvRegionLayout::vllm_kv_first(other, r, 0, 8192, BLOCKS, 16384).unwrap(),
        })
        .collect();
    let e = make(wrong, BLOCKS, host.clone());
    assert!(e.to_string().contains("geometry.head_dim"), "{e}");
    let (_, small) = engine_regions(1);
    let small: Vec<EngineRegion> = small
        .into_iter()
        .map(|r| EngineRegion {
            memory: Arc::new(HostBuffer::zeroed(r.layout.region_bytes() as usize - 4).unwrap()),
            ..r
        })
        .collect();
    assert_eq!(field(make(small, BLOCKS, host.clone())), "regions.memory");
    let (_, ok) = engine_regions(2);
    assert_eq!(field(make(ok.clone(), BLOCKS + 1, host.clone())), "pool");
    struct NoConvert;
    impl CopyBackend for NoConvert {
        fn name(&self) -> &'static str {
            "no_convert"
        }
        fn copy_part(
            &self,
            _: &PartPlan,
            _: &RankIo<'_>,
            _: &DeliveryControl,
        ) -> Result<PartOutcome, TransferError> {
            unreachable!("refused at registration")
        }
    }
    assert_eq!(field(make(ok, BLOCKS, Arc::new(NoConvert))), "backend");
}

#[test]
fn a_hint_for_another_prompt_is_refused_before_engine_blocks_are_reserved() {
    let _g = lock();
    let bank = bank(8, "eng-prompt");
    let a = store(&bank, 2);
    let (_mems, exec) = engine_executor(0, Arc::new(HostCopyBackend));
    let prompt = [a[0].0, SequenceHash(12345)];
    let e = exec
        .execute_for_prompt_at(
            &envelope(&bank, &a),
            &prompt,
            &[3, 4],
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap_err();
    assert!(matches!(e, FetchError::PromptMismatch { block: 1 }), "{e}");
    assert_eq!(exec.pool().free_blocks(), BLOCKS as usize);
    let keys: Vec<_> = a.iter().map(|e| e.0).collect();
    let out = exec
        .execute_for_prompt_at(
            &envelope(&bank, &a),
            &keys,
            &[3, 4],
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap();
    assert_eq!(&out.target_blocks[..], &[3, 4]);
}

#[test]
fn a_fetch_lands_in_engine_memory_registered_by_base_pointer() {
    let _g = lock();
    let bank = bank(8, "eng-raw");
    let a = store(&bank, 2);
    // The engine's own allocations (one per rank), poisoned.
    let mut tensors: Vec<Vec<u8>> = (0..TP)
        .map(|r| vec![POISON; engine_layout(1, r).region_bytes() as usize])
        .collect();
    let regions: Vec<EngineRegion> = tensors
        .iter_mut()
        .enumerate()
        .map(|(r, t)| EngineRegion {
            // SAFETY: `tensors` outlives the executor (dropped first below)
            // and is not touched while it lives.
            memory: Arc::new(
                unsafe {
                    kv_transfer::EngineMemory::from_raw_parts(
                        kv_bank::MemoryKind::Host,
                        t.as_mut_ptr() as u64,
                        t.len(),
                    )
                }
                .unwrap(),
            ),
            layout: engine_layout(1, r as u32),
        })
        .collect();
    let exec = FetchExecutor::with_engine_regions(
        layout(),
        DestinationPool::new(BLOCKS),
        regions,
        Arc::new(HostCopyBackend),
    )
    .unwrap();
    let out = exec
        .execute_at(
            &envelope(&bank, &a),
            &[15, 0],
            bank.as_ref(),
            &DeliveryControl::new(),
        )
        .unwrap();
    assert!(out.report.is_complete());
    drop(out);
    drop(exec);
    let keys: Vec<_> = a.iter().map(|e| e.0).collect();
    for r in 0..TP {
        assert!(
            tensors[r as usize] == expected_image(1, r, &keys, &[15, 0]),
            "rank {r}"
        );
    }
}
