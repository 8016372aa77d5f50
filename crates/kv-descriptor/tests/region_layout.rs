//! Region layouts: validation names the field, every layout addresses each
//! element exactly once inside its region, compatibility refuses other geometries.

use std::collections::HashSet;

use kv_descriptor::{
    DType, ElementStrides, KvLayout, KvRegionLayout, RegionLayoutError, RegionOrder, TensorOrder,
};

fn geo(dtype: DType) -> KvLayout {
    KvLayout::new(3, 4, 8, dtype, 4, TensorOrder::BlockMajor, 2).unwrap()
}

/// Every (layer, block, kv, token, head) run is inside the region and no two share a byte.
fn assert_bijective(r: &KvRegionLayout) {
    let g = *r.geometry();
    let run = u64::from(g.head_dim()) * g.dtype().size_bytes() as u64;
    let mut seen = HashSet::new();
    for l in 0..g.num_layers() {
        for b in 0..r.num_blocks() {
            for kv in 0..2 {
                for t in 0..g.tokens_per_block() {
                    for h in 0..g.heads_per_rank() {
                        let o = r.run_offset(l, b, kv, t, h).unwrap();
                        assert!(o + run <= r.region_bytes());
                        for x in 0..run {
                            assert!(seen.insert(o + x), "byte {} addressed twice", o + x);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn constructors_address_each_byte_once() {
    let g = geo(DType::Bf16);
    let blk = g.rank_block_bytes() as u64; // 3 layers x 2 x 4 tokens x 2 heads x 8 x 2 B
    assert_eq!(blk, 768);
    let bm = KvRegionLayout::block_major(g, 1, 0, 5, 5 * blk).unwrap();
    assert_bijective(&bm);
    // block 2, layer 1, V, token 3, head 1 in block-major order.
    assert_eq!(
        bm.run_offset(1, 2, 1, 3, 1),
        Some(2 * 768 + 256 + 128 + 3 * 32 + 16)
    );
    let layer = 5 * blk / 3; // one layer tensor of 5 blocks
    let kvf = KvRegionLayout::vllm_kv_first(g, 1, 0, layer, 5, 5 * blk).unwrap();
    assert_bijective(&kvf);
    // [2, nb, t, h, d]: V of block 2 token 3 head 1 in layer 1.
    assert_eq!(
        kvf.run_offset(1, 2, 1, 3, 1),
        Some(layer + (5 * 64 + 2 * 64 + 3 * 16 + 8) * 2)
    );
    let bf = KvRegionLayout::vllm_block_first(g, 1, 0, layer, 5, 5 * blk).unwrap();
    assert_bijective(&bf);
    assert_eq!(
        bf.run_offset(1, 2, 1, 3, 1),
        Some(layer + (2 * 128 + 64 + 3 * 16 + 8) * 2)
    );
    // HF [2, batch 2, h 2, 32 tokens, d 8] per layer, sequence 1 from token 6.
    let hf_layer = 2 * 2 * 2 * 32 * 8 * 2;
    let hf = KvRegionLayout::hf_tokens(g, 1, 0, hf_layer, 2, 1, 32, 6, 5, 3 * hf_layer).unwrap();
    assert_bijective(&hf);
    assert_eq!(hf.order(), RegionOrder::HfTokens { token_offset: 6 });
    // layer 1, block 2 token 3 = token 6+11 = 17, V, head 1, seq 1.
    let e = 2 * 2 * 32 * 8 + 2 * 32 * 8 + 32 * 8 + 17 * 8;
    assert_eq!(hf.run_offset(1, 2, 1, 3, 1), Some(hf_layer + e * 2));
    assert_eq!(hf.run_offset(0, 5, 0, 0, 0), None);
}

#[test]
fn refusals_name_the_field() {
    let g = geo(DType::Bf16);
    let blk = g.rank_block_bytes() as u64;
    assert_eq!(
        KvRegionLayout::block_major(g, 0, 0, 0, blk).unwrap_err(),
        RegionLayoutError::Zero {
            field: "region.num_blocks"
        }
    );
    assert_eq!(
        KvRegionLayout::block_major(g, 2, 0, 1, blk).unwrap_err(),
        RegionLayoutError::TpRank {
            tp_rank: 2,
            tp_size: 2
        }
    );
    assert_eq!(
        KvRegionLayout::block_major(g, 0, 0, 4, 4 * blk - 1).unwrap_err(),
        RegionLayoutError::OutOfBounds {
            field: "region.layer_offsets",
            end: 4 * blk,
            region_bytes: 4 * blk - 1
        }
    );
    assert!(matches!(
        KvRegionLayout::block_major(g, 0, 1, 1, 2 * blk).unwrap_err(),
        RegionLayoutError::Misaligned {
            field: "region.layer_offsets",
            offset: 1,
            elem: 2
        }
    ));
    // vLLM layers closer than one layer tensor overlap each other.
    let layer = 5 * blk / 3;
    assert_eq!(
        KvRegionLayout::vllm_kv_first(g, 0, 0, layer - 2, 5, 5 * blk).unwrap_err(),
        RegionLayoutError::Overlap {
            field: "region.layer_offsets",
            other: "region.strides"
        }
    );
    // A head stride smaller than head_dim makes heads share elements.
    let s = ElementStrides {
        block: 128,
        kv: 64,
        token: 16,
        head: 4,
        dim: 1,
    };
    assert_eq!(
        KvRegionLayout::new(
            g,
            0,
            RegionOrder::VllmBlockFirst,
            vec![0, 4096, 8192],
            s,
            2,
            1 << 20
        )
        .unwrap_err(),
        RegionLayoutError::Overlap {
            field: "region.strides.head",
            other: "region.strides.dim"
        }
    );
    assert_eq!(
        KvRegionLayout::new(g, 0, RegionOrder::BlockMajor, vec![0, 1], s, 2, 1 << 20).unwrap_err(),
        RegionLayoutError::LayerCount {
            expected: 3,
            got: 2
        }
    );
    assert_eq!(
        KvRegionLayout::hf_tokens(g, 0, 0, 1 << 12, 2, 0, 32, 20, 4, 1 << 20).unwrap_err(),
        RegionLayoutError::OutOfBounds {
            field: "region.token_offset",
            end: 36,
            region_bytes: 32
        }
    );
}

#[test]
fn compatibility_is_geometry_not_order() {
    let g = geo(DType::Bf16);
    let blk = g.rank_block_bytes() as u64;
    let donor = KvRegionLayout::block_major(g, 1, 0, 5, 5 * blk).unwrap();
    let vg = KvLayout::new(3, 4, 8, DType::Bf16, 4, TensorOrder::VllmPerLayer, 2).unwrap();
    let target = KvRegionLayout::vllm_kv_first(vg, 1, 0, 5 * blk / 3, 5, 5 * blk).unwrap();
    donor.check_compatible(&target).unwrap();
    let fp = KvRegionLayout::block_major(geo(DType::Fp16), 1, 0, 5, 5 * blk).unwrap();
    assert_eq!(
        donor.check_compatible(&fp).unwrap_err(),
        RegionLayoutError::Incompatible {
            field: "geometry.dtype",
            donor: "Bf16".into(),
            target: "Fp16".into()
        }
    );
    let rank0 = KvRegionLayout::block_major(g, 0, 0, 5, 5 * blk).unwrap();
    assert!(matches!(
        donor.check_compatible(&rank0).unwrap_err(),
        RegionLayoutError::Incompatible {
            field: "region.tp_rank",
            ..
        }
    ));
}

/// The wire identity of a layout is unchanged by region layouts (value pinned).
#[test]
fn fingerprint_value_is_stable() {
    let l = KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
    assert_eq!(l.fingerprint().0, EXPECTED_LLAMA8B_TP2);
}
const EXPECTED_LLAMA8B_TP2: u64 = 0xb1ec_71f1_a9d3_c544;

#[test]
fn an_hf_cache_whose_strides_pass_u64_is_refused_not_wrapped() {
    let g = geo(DType::Bf16);
    // head stride = max_tokens x head_dim: u64::MAX x 8 overflowed (a panic
    // in debug builds, a wrapped stride in release builds).
    assert_eq!(
        KvRegionLayout::hf_tokens(g, 0, 0, 1 << 12, 2, 0, u64::MAX, 0, 1, u64::MAX).unwrap_err(),
        RegionLayoutError::Overflow {
            field: "region.max_tokens"
        }
    );
    // head x heads fits, the batch stride does not: 2^59 x 2 heads x u32::MAX.
    assert_eq!(
        KvRegionLayout::hf_tokens(g, 0, 0, 1 << 12, u32::MAX, 0, 1 << 56, 0, 1, u64::MAX)
            .unwrap_err(),
        RegionLayoutError::Overflow {
            field: "region.batch"
        }
    );
}

proptest::proptest! {
    /// Whatever the caller's numbers, the constructors refuse or build; they
    /// never panic on arithmetic (tests run with overflow checks on), and
    /// what they build addresses only bytes inside the region.
    #[test]
    fn constructors_never_panic_on_any_numbers(
        base in proptest::num::u64::ANY,
        stride in proptest::num::u64::ANY,
        batch in proptest::num::u32::ANY,
        batch_index in proptest::num::u32::ANY,
        max_tokens in proptest::num::u64::ANY,
        token_offset in proptest::num::u64::ANY,
        num_blocks in proptest::num::u32::ANY,
        region_bytes in proptest::num::u64::ANY,
    ) {
        let g = geo(DType::Bf16);
        let built = [
            KvRegionLayout::block_major(g, 0, base, num_blocks, region_bytes),
            KvRegionLayout::vllm_kv_first(g, 0, base, stride, num_blocks, region_bytes),
            KvRegionLayout::vllm_block_first(g, 0, base, stride, num_blocks, region_bytes),
            KvRegionLayout::hf_tokens(
                g, 0, base, stride, batch, batch_index, max_tokens, token_offset, num_blocks,
                region_bytes,
            ),
        ];
        for r in built.into_iter().flatten() {
            let last = r
                .run_offset(2, r.num_blocks() - 1, 1, 3, 1)
                .expect("indices in range");
            proptest::prop_assert!(last < r.region_bytes());
        }
    }
}
