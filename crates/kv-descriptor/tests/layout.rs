//! KvLayout: geometry arithmetic, every rejection, fingerprint stability.

mod common;

use common::assert_field;
use kv_descriptor::*;

fn llama8b(tp: u32) -> Result<KvLayout, DescriptorError> {
    KvLayout::new(32, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, tp)
}

#[test]
fn llama_geometry_per_rank_and_group() {
    let l = llama8b(2).unwrap();
    assert_eq!(l.heads_per_rank(), 4);
    // 2 x 32 layers x 16 tokens x 4 heads x 128 dims x 2 bytes = 1 MiB
    assert_eq!(l.rank_block_bytes(), 1_048_576);
    assert_eq!(l.block_bytes(), 2_097_152);
    // 128 KiB per token over the group: 2 (K, V) x 32 layers x 8 KV heads x
    // 128 dims x 2 bytes, the Llama-3.1-8B figure.
    assert_eq!(l.rank_token_bytes() * 2, 128 * 1024);
    let l8 = llama8b(8).unwrap();
    assert_eq!(l8.heads_per_rank(), 1);
    assert_eq!(l8.rank_block_bytes(), 262_144);
    assert_eq!(l8.block_bytes(), l.block_bytes());
}

#[test]
fn dtype_sizes() {
    let sizes: Vec<usize> = [DType::Bf16, DType::Fp16, DType::Fp8E4m3, DType::F32]
        .iter()
        .map(|d| d.size_bytes())
        .collect();
    assert_eq!(sizes, vec![2, 2, 1, 4]);
}

#[test]
fn zero_counts_name_their_field() {
    let o = TensorOrder::BlockMajor;
    assert_field(
        KvLayout::new(0, 8, 128, DType::Bf16, 16, o, 1),
        "layout.num_layers",
    );
    assert_field(
        KvLayout::new(32, 0, 128, DType::Bf16, 16, o, 1),
        "layout.num_kv_heads",
    );
    assert_field(
        KvLayout::new(32, 8, 0, DType::Bf16, 16, o, 1),
        "layout.head_dim",
    );
    assert_field(
        KvLayout::new(32, 8, 128, DType::Bf16, 0, o, 1),
        "layout.tokens_per_block",
    );
    assert_field(
        KvLayout::new(32, 8, 128, DType::Bf16, 16, o, 0),
        "layout.tp_size",
    );
}

#[test]
fn head_partition_rule() {
    for tp in [1, 2, 4, 8] {
        assert!(llama8b(tp).is_ok(), "tp {tp}");
    }
    let e = assert_field(llama8b(3), "layout.tp_size");
    assert!(e.to_string().contains("not divisible"), "{e}");
    // More ranks than KV heads would need head replication: refused.
    let e = assert_field(llama8b(16), "layout.tp_size");
    assert!(e.to_string().contains("replication"), "{e}");
}

#[test]
fn oversized_rank_block_is_refused() {
    // 2 x 1024 x 1024 x 1 x 1024 x 4 = 8 GiB per rank block.
    let e = assert_field(
        KvLayout::new(1024, 1, 1024, DType::F32, 1024, TensorOrder::BlockMajor, 1),
        "layout",
    );
    assert!(e.to_string().contains("8589934592"), "{e}");
    // Exactly MAX_RANK_BLOCK_BYTES is still accepted: 2 x 512 x 1024 x 1 x 1024 x 1 = 1 GiB.
    let at_limit = KvLayout::new(
        512,
        1,
        1024,
        DType::Fp8E4m3,
        1024,
        TensorOrder::BlockMajor,
        1,
    )
    .unwrap();
    assert_eq!(at_limit.rank_block_bytes() as u64, MAX_RANK_BLOCK_BYTES);
}

#[test]
fn a_product_past_u64_is_refused_not_wrapped_or_panicking() {
    // 2 x 2^31 x 2^31 x 1 x 4 x 4 = 2^67: wrapped to 0 in release builds
    // (accepted with rank_block_bytes() == 0) and panicked in debug builds.
    let e = assert_field(
        KvLayout::new(
            1 << 31,
            1,
            4,
            DType::F32,
            1 << 31,
            TensorOrder::BlockMajor,
            1,
        ),
        "layout",
    );
    assert!(e.to_string().contains("more than 2^64 bytes"), "{e}");
    // As `kv_reuse.Layout(2**31, 2**31, 2**31, "f32", 64, 1)` from Python.
    assert_field(
        KvLayout::new(
            1 << 31,
            1 << 31,
            1 << 31,
            DType::F32,
            64,
            TensorOrder::BlockMajor,
            1,
        ),
        "layout",
    );
    // Every field at its maximum: 2 x 4 x (2^32 - 1)^4, past u128 too.
    assert_field(
        KvLayout::new(
            u32::MAX,
            u32::MAX,
            u32::MAX,
            DType::F32,
            u32::MAX,
            TensorOrder::BlockMajor,
            1,
        ),
        "layout",
    );
}

#[test]
fn the_wire_decoder_refuses_an_overflowing_layout_without_panicking() {
    let raw = RawLayout {
        num_layers: 1 << 31,
        num_kv_heads: 1,
        head_dim: 4,
        dtype: DType::F32,
        tokens_per_block: 1 << 31,
        tensor_order: TensorOrder::BlockMajor,
        tp_size: 1,
    };
    let bytes = rmp_serde::to_vec_named(&raw).unwrap();
    let e = rmp_serde::from_slice::<KvLayout>(&bytes).unwrap_err();
    assert!(e.to_string().contains("invalid `layout`"), "{e}");
}

/// The documented fingerprint encoding, re-derived here independently.
fn documented_fingerprint(fields: [u32; 5], dtype_code: u8, order_code: u8) -> u64 {
    let mut buf = b"kvlayout1".to_vec();
    for v in fields {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    buf.push(dtype_code);
    buf.push(order_code);
    xxhash_rust::xxh3::xxh3_64_with_seed(&buf, 1337)
}

#[test]
fn fingerprint_follows_documented_encoding_and_is_pinned() {
    let l = llama8b(2).unwrap();
    // Field order: layers, kv heads, head dim, tokens per block, tp size.
    assert_eq!(
        l.fingerprint().0,
        documented_fingerprint([32, 8, 128, 16, 2], 1, 2)
    );
    // Pinned so that a change of the encoding (which would split a fleet of
    // mixed releases into incompatible halves) fails loudly.
    assert_eq!(
        l.fingerprint().to_string(),
        format!("{:016x}", l.fingerprint().0)
    );
    insta::assert_snapshot!("llama8b_tp2_fingerprint", l.fingerprint().to_string());
}

#[test]
fn fingerprint_changes_with_every_field() {
    let base = KvLayout::new(4, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
    let variants = [
        KvLayout::new(5, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 2),
        KvLayout::new(4, 16, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 2),
        KvLayout::new(4, 8, 128, DType::Bf16, 16, TensorOrder::BlockMajor, 2),
        KvLayout::new(4, 8, 64, DType::Fp16, 16, TensorOrder::BlockMajor, 2),
        KvLayout::new(4, 8, 64, DType::Bf16, 32, TensorOrder::BlockMajor, 2),
        KvLayout::new(4, 8, 64, DType::Bf16, 16, TensorOrder::VllmPerLayer, 2),
        KvLayout::new(4, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 4),
    ];
    let mut seen = std::collections::HashSet::from([base.fingerprint()]);
    for v in variants {
        let v = v.unwrap();
        assert!(seen.insert(v.fingerprint()), "collision for {v:?}");
    }
    let again = KvLayout::new(4, 8, 64, DType::Bf16, 16, TensorOrder::BlockMajor, 2).unwrap();
    assert_eq!(again.fingerprint(), base.fingerprint());
}

#[derive(serde::Serialize)]
struct RawLayout {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: DType,
    tokens_per_block: u32,
    tensor_order: TensorOrder,
    tp_size: u32,
}

#[test]
fn decoder_runs_the_constructor_checks() {
    let raw = RawLayout {
        num_layers: 32,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: DType::Bf16,
        tokens_per_block: 16,
        tensor_order: TensorOrder::BlockMajor,
        tp_size: 3,
    };
    let bytes = rmp_serde::to_vec_named(&raw).unwrap();
    let e = rmp_serde::from_slice::<KvLayout>(&bytes).unwrap_err();
    assert!(e.to_string().contains("layout.tp_size"), "{e}");
    let ok = RawLayout { tp_size: 4, ..raw };
    let l: KvLayout = rmp_serde::from_slice(&rmp_serde::to_vec_named(&ok).unwrap()).unwrap();
    assert_eq!(l, llama8b(4).unwrap());
}

/// A non-zero count: half small (products near the bound), half anywhere in `u32`.
fn count(small: u32) -> impl proptest::strategy::Strategy<Value = u32> {
    proptest::prop_oneof![1..small, 1..=u32::MAX]
}

fn dtype() -> impl proptest::strategy::Strategy<Value = DType> {
    proptest::sample::select(vec![DType::Bf16, DType::Fp16, DType::Fp8E4m3, DType::F32])
}

proptest::proptest! {
    /// `new` accepts exactly the layouts the documented rules allow, and a
    /// refusal names the first rule broken, in documented order.
    #[test]
    fn accepted_iff_rules_hold(
        layers in 0u32..2048, heads in 0u32..=64, dim in 0u32..2048,
        dt in dtype(), tpb in 0u32..1024, tp in 0u32..=16,
    ) {
        let r = KvLayout::new(layers, heads, dim, dt, tpb, TensorOrder::BlockMajor, tp);
        let expected_field = if layers == 0 {
            Some("layout.num_layers")
        } else if heads == 0 {
            Some("layout.num_kv_heads")
        } else if dim == 0 {
            Some("layout.head_dim")
        } else if tpb == 0 {
            Some("layout.tokens_per_block")
        } else if tp == 0 || heads % tp != 0 {
            Some("layout.tp_size")
        } else if 2 * u64::from(layers) * u64::from(tpb) * u64::from(heads / tp) * u64::from(dim) * dt.size_bytes() as u64
            > MAX_RANK_BLOCK_BYTES
        {
            Some("layout")
        } else {
            None
        };
        match (r, expected_field) {
            (Ok(l), None) => {
                proptest::prop_assert_eq!(l.heads_per_rank() * l.tp_size(), heads);
                proptest::prop_assert_eq!(l.block_bytes(), l.rank_block_bytes() * tp as usize);
            }
            (Err(e), Some(f)) => proptest::prop_assert_eq!(common::field_of(&e), f),
            (r, f) => proptest::prop_assert!(false, "got {:?}, expected refusal of {:?}", r, f),
        }
    }

    /// Over the whole `u32` range (where the product passes `u64`), `new`
    /// never panics and accepts exactly the layouts whose exact product,
    /// computed here in `u128` (saturating: 2^131 passes it too), is within
    /// the bound; an accepted layout's sizes are that product.
    #[test]
    fn size_bound_holds_over_the_whole_u32_range(
        layers in count(64),
        heads in count(64),
        dim in count(256),
        dt in dtype(),
        tpb in count(64),
    ) {
        let r = KvLayout::new(layers, heads, dim, dt, tpb, TensorOrder::BlockMajor, 1);
        let exact = [layers, tpb, heads, dim, dt.size_bytes() as u32]
            .iter()
            .fold(2u128, |acc, &v| acc.saturating_mul(u128::from(v)));
        if exact <= u128::from(MAX_RANK_BLOCK_BYTES) {
            let l = r.unwrap();
            proptest::prop_assert_eq!(l.rank_block_bytes() as u128, exact);
            proptest::prop_assert_eq!(l.block_bytes() as u128, exact);
        } else {
            proptest::prop_assert_eq!(common::field_of(&r.unwrap_err()), "layout");
        }
    }
}
