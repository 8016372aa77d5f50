use super::*;
use crate::oracle::pattern;
use crate::PartOutcome;
use kv_descriptor::{DType, SequenceHash, TensorOrder};
use proptest::prelude::*;

/// A region layout of kind `k` (0 block-major at 0, 1 vLLM kv-first,
/// 2 vLLM block-first, 3 HF at `token_offset` for sequence `batch_index` of
/// 3, 4 block-major at a non-zero base) with `blocks` blocks.
fn layout_of(
    k: u8,
    g: KvLayout,
    rank: u32,
    blocks: u32,
    token_offset: u64,
    seq: u32,
) -> KvRegionLayout {
    let bb = g.rank_block_bytes() as u64;
    let b = u64::from(blocks);
    let layers = u64::from(g.num_layers());
    let layer = b * bb / layers;
    match k {
        0 => KvRegionLayout::block_major(g, rank, 0, blocks, b * bb),
        1 => KvRegionLayout::vllm_kv_first(g, rank, 8, layer + 8, blocks, 8 + layers * (layer + 8)),
        2 => KvRegionLayout::vllm_block_first(g, rank, 0, layer, blocks, layers * layer),
        3 => {
            let max_tokens = token_offset + b * u64::from(g.tokens_per_block()) + 1;
            let elem = g.dtype().size_bytes() as u64;
            let lb =
                2 * 3 * u64::from(g.heads_per_rank()) * max_tokens * u64::from(g.head_dim()) * elem;
            KvRegionLayout::hf_tokens(
                g,
                rank,
                0,
                lb,
                3,
                seq,
                max_tokens,
                token_offset,
                blocks,
                layers * lb,
            )
        }
        _ => KvRegionLayout::block_major(g, rank, 64, blocks, 64 + b * bb + 16),
    }
    .unwrap()
}

/// Deterministic shuffle of `0..n` (64-bit LCG).
fn shuffled(n: u32, mut seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        v.swap(i, (seed >> 33) as usize % (i + 1));
    }
    v
}

/// Fetches `moves` from donors of kind `dk` into targets of kind `tk` with
/// the host backend; returns the delivery result and every rank's check.
#[allow(clippy::too_many_arguments)]
fn land(
    g: KvLayout,
    dk: u8,
    tk: u8,
    nd: u32,
    nt: u32,
    token_offset: u64,
    seq: u32,
    moves: &[BlockMove],
) -> (
    Result<crate::DeliveryReport, TransferError>,
    Vec<LandingCheck>,
) {
    let tp = g.tp_size();
    let dls: Vec<_> = (0..tp)
        .map(|r| layout_of(dk, g, r, nd, token_offset, seq))
        .collect();
    let tls: Vec<_> = (0..tp)
        .map(|r| layout_of(tk, g, r, nt, token_offset, seq))
        .collect();
    let mut donors = Vec::new();
    for (r, l) in dls.iter().enumerate() {
        let mut b = HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
        b.as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = pattern(r as u32, SequenceHash(7), i));
        donors.push(b);
    }
    let targets: Vec<_> = tls
        .iter()
        .map(|l| {
            let mut b = HostBuffer::zeroed(l.region_bytes() as usize).unwrap();
            b.as_mut_slice().fill(POISON);
            b
        })
        .collect();
    let plan = TransferPlan::converting(&dls, &tls, moves).unwrap();
    let io: Vec<RankIo> = donors
        .iter()
        .zip(&targets)
        .map(|(d, t)| RankIo {
            src: SourceRegion::Mapped(d),
            dst: t,
        })
        .collect();
    let res = deliver(&plan, &HostCopyBackend, &io, &DeliveryControl::new());
    let checks = (0..tp as usize)
        .map(|r| {
            let d = donors[r].read_vec(0, donors[r].len()).unwrap();
            let t = targets[r].read_vec(0, targets[r].len()).unwrap();
            check_landing(&dls[r], &d, &tls[r], &t, moves, POISON)
        })
        .collect();
    (res, checks)
}

fn geometry(tp: u32, layers: u32, heads: u32, dim: u32, dtype: u8, tpb: u32) -> KvLayout {
    let dt = [DType::Bf16, DType::F32, DType::Fp8E4m3][dtype as usize % 3];
    KvLayout::new(
        layers,
        heads * tp,
        dim,
        dt,
        tpb,
        TensorOrder::BlockMajor,
        tp,
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]
    /// Layouts x geometries x engine block ids: every element of every
    /// present block lands at the target's address of the same
    /// (layer, kv, token, head, d), nothing else is written, and the
    /// delivery completes exactly when no key is missing.
    #[test]
    fn every_layout_lands_every_element_at_engine_chosen_blocks(
        tp in 1u32..=2, layers in 1u32..=3, heads in 1u32..=3, dim in 1u32..=5,
        dtype in 0u8..3, tpb in 1u32..=4,
        dk in 0u8..5, tk in 0u8..5,
        nd in 1u32..8, nt in 1u32..10, n in 1usize..7,
        token_offset in 0u64..40, seq in 0u32..3,
        seed in any::<u64>(), drop_mask in any::<u8>(),
    ) {
        let g = geometry(tp, layers, heads, dim, dtype, tpb);
        let (src, dst) = (shuffled(nd, seed), shuffled(nt, seed ^ 0x5555));
        let n = n.min(nd as usize).min(nt as usize);
        let moves: Vec<BlockMove> = (0..n)
            .map(|i| BlockMove {
                key: SequenceHash(i as u64 + 1),
                src_slot: (drop_mask >> i & 1 == 0).then_some(src[i]),
                dst_block: dst[i],
            })
            .collect();
        let present = moves.iter().filter(|m| m.src_slot.is_some()).count() as u64;
        let (res, checks) = land(g, dk, tk, nd, nt, token_offset, seq, &moves);
        let report = res.unwrap();
        prop_assert_eq!(report.is_complete(), present == n as u64);
        prop_assert_eq!(report.counters.bytes, present * g.rank_block_bytes() as u64 * u64::from(tp));
        for c in checks {
            prop_assert!(c.bytes_ok && c.untouched_ok, "{:?}", c);
            let per_block = u64::from(layers) * 2 * u64::from(tpb) * u64::from(heads) * u64::from(dim);
            prop_assert_eq!(c.elements, present * per_block);
        }
    }
}

#[test]
fn hf_at_a_token_offset_and_vllm_block_first_land_every_byte() {
    // Named cases of the property, so they run whatever the random draw.
    let g = geometry(2, 2, 2, 4, 0, 4);
    let moves = [
        BlockMove {
            key: SequenceHash(1),
            src_slot: Some(3),
            dst_block: 5,
        },
        BlockMove {
            key: SequenceHash(2),
            src_slot: None,
            dst_block: 0,
        },
        BlockMove {
            key: SequenceHash(3),
            src_slot: Some(0),
            dst_block: 2,
        },
    ];
    for tk in [2u8, 3] {
        let (res, checks) = land(g, 0, tk, 4, 6, 7, 2, &moves);
        let r = res.unwrap();
        assert!(!r.is_complete(), "a missing key must not complete");
        assert_eq!(r.counters.bytes, 2 * 2 * g.rank_block_bytes() as u64);
        for c in checks {
            assert!(c.bytes_ok && c.untouched_ok, "kind {tk}: {c:?}");
            assert_eq!(c.elements, 2 * 2 * 2 * 4 * 2 * 4);
        }
    }
}

#[test]
fn the_check_sees_one_wrong_byte_and_one_stray_write() {
    let g = geometry(1, 1, 1, 2, 1, 2);
    let d = layout_of(0, g, 0, 2, 0, 0);
    let t = layout_of(3, g, 0, 2, 5, 1);
    let donor: Vec<u8> = (0..d.region_bytes()).map(|i| i as u8 | 1).collect();
    let mut target = vec![POISON; t.region_bytes() as usize];
    let m = [BlockMove {
        key: SequenceHash(1),
        src_slot: Some(1),
        dst_block: 0,
    }];
    // Land by hand through run_offset, as the oracle addresses it.
    for kv in 0..2 {
        for tok in 0..2 {
            let (s, o) = (
                d.run_offset(0, 1, kv, tok, 0).unwrap(),
                t.run_offset(0, 0, kv, tok, 0).unwrap(),
            );
            target[o as usize..o as usize + 8].copy_from_slice(&donor[s as usize..s as usize + 8]);
        }
    }
    assert_eq!(
        check_landing(&d, &donor, &t, &target, &m, POISON),
        LandingCheck {
            bytes_ok: true,
            untouched_ok: true,
            elements: 8
        }
    );
    let o = t.run_offset(0, 0, 1, 1, 0).unwrap() as usize + 5;
    target[o] ^= 0xFF;
    assert!(!check_landing(&d, &donor, &t, &target, &m, POISON).bytes_ok);
    target[o] ^= 0xFF;
    let stray = t.run_offset(0, 1, 0, 0, 0).unwrap() as usize;
    target[stray] = 0;
    let c = check_landing(&d, &donor, &t, &target, &m, POISON);
    assert!(c.bytes_ok && !c.untouched_ok, "{c:?}");
}

/// A backend that does not convert, recording whether it was called.
struct RowsOnly(std::sync::atomic::AtomicBool);
impl CopyBackend for RowsOnly {
    fn name(&self) -> &'static str {
        "rows_only"
    }
    fn copy_part(
        &self,
        _: &crate::plan::PartPlan,
        _: &RankIo<'_>,
        _: &DeliveryControl,
    ) -> Result<PartOutcome, TransferError> {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(PartOutcome {
            bytes: 0,
            copies: 0,
            host_payload_bytes: 0,
            transport: "none".into(),
        })
    }
}

#[test]
fn a_backend_that_does_not_convert_is_refused_before_a_byte_moves() {
    let g = geometry(1, 1, 1, 2, 1, 2);
    let d = [layout_of(0, g, 0, 2, 0, 0)];
    let t = [layout_of(1, g, 0, 2, 0, 0)];
    let m = [BlockMove {
        key: SequenceHash(1),
        src_slot: Some(1),
        dst_block: 0,
    }];
    let plan = TransferPlan::converting(&d, &t, &m).unwrap();
    let (src, dst) = (
        HostBuffer::zeroed(d[0].region_bytes() as usize).unwrap(),
        HostBuffer::zeroed(t[0].region_bytes() as usize).unwrap(),
    );
    let b = RowsOnly(Default::default());
    let e = deliver(
        &plan,
        &b,
        &[RankIo {
            src: SourceRegion::Mapped(&src),
            dst: &dst,
        }],
        &DeliveryControl::new(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::UnsupportedLayout {
                backend: "rows_only",
                rank: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        !b.0.load(std::sync::atomic::Ordering::SeqCst),
        "the backend must not be called"
    );
}

#[test]
fn a_target_region_smaller_than_its_layout_is_refused() {
    let g = geometry(1, 1, 1, 2, 1, 2);
    let d = [layout_of(0, g, 0, 2, 0, 0)];
    let t = [layout_of(2, g, 0, 4, 0, 0)];
    let m = [BlockMove {
        key: SequenceHash(1),
        src_slot: Some(1),
        dst_block: 3,
    }];
    let plan = TransferPlan::converting(&d, &t, &m).unwrap();
    let src = HostBuffer::zeroed(d[0].region_bytes() as usize).unwrap();
    let dst = HostBuffer::zeroed(t[0].region_bytes() as usize - 1).unwrap();
    let e = deliver(
        &plan,
        &HostCopyBackend,
        &[RankIo {
            src: SourceRegion::Mapped(&src),
            dst: &dst,
        }],
        &DeliveryControl::new(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("io.dst"), "{e}");
}

#[test]
fn cpu_layout_oracle_passes_for_every_layout() {
    let r = run(Profile::Cpu).unwrap();
    assert!(r.passed(), "{r:#?}");
    assert_eq!(
        (r.tp_size, r.backend.as_str(), r.cases.len()),
        (2, "host_memcpy", 4)
    );
    for c in &r.cases {
        assert!(
            c.positive_ok && c.missing_ok && c.refused.is_none(),
            "{c:?}"
        );
        assert_eq!(c.bytes, 2 * 7 * 65_536, "{c:?}");
        assert_eq!(c.host_payload_bytes, c.bytes + 2 * 5 * 65_536, "{c:?}");
    }
}
