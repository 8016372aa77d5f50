//! `Layout`: the KV layout a bank, router and target agree on, and engine ids.

use pyo3::prelude::*;

use kv_descriptor::{DType, DescriptorError, EngineId, KvLayout, TensorOrder};

use crate::errors::{bad_argument, descriptor, uint_in};

/// A block-major KV layout (kv_descriptor::KvLayout).
///
/// `dtype` is one of `"f32"`, `"fp16"`, `"bf16"`, `"fp8_e4m3"`. One TP rank's
/// part of one KV block is `rank_block_bytes` bytes; numpy arrays for it have
/// `rank_block_elems` elements of `typestr`.
///
/// A value: two layouts built from the same arguments are equal (`==`) and
/// hash alike, so a layout can be compared with an engine's or used as a
/// dict key.
#[pyclass(frozen, eq, hash, module = "kv_reuse")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Layout {
    pub(crate) inner: KvLayout,
}

pub(crate) fn parse_dtype(s: &str) -> PyResult<DType> {
    Ok(match s {
        "f32" | "float32" => DType::F32,
        "fp16" | "float16" => DType::Fp16,
        "bf16" | "bfloat16" => DType::Bf16,
        "fp8_e4m3" => DType::Fp8E4m3,
        other => {
            return Err(bad_argument(
                "dtype",
                format!("`{other}` is not one of f32, fp16, bf16, fp8_e4m3"),
            ))
        }
    })
}

#[pymethods]
impl Layout {
    /// A layout of `num_layers` layers, `num_kv_heads` KV heads of
    /// `head_dim` elements of `dtype`, `tokens_per_block` tokens per block,
    /// split over `tp_size` TP ranks.
    ///
    /// Raises `BadArgument` naming `dtype`, or the int argument that is
    /// negative, past u32, zero or a bool (`True` would pass as 1), or
    /// `tp_size` when `num_kv_heads` is not
    /// divisible by it; `DescriptorRefused` when kv_descriptor refuses the
    /// layout as a whole (one rank's block part past its size bound).
    #[new]
    #[pyo3(signature = (num_layers, num_kv_heads, head_dim, dtype, tokens_per_block, tp_size))]
    fn new(
        num_layers: &Bound<'_, PyAny>,
        num_kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: &str,
        tokens_per_block: &Bound<'_, PyAny>,
        tp_size: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let inner = KvLayout::new(
            count("num_layers", num_layers)?,
            count("num_kv_heads", num_kv_heads)?,
            count("head_dim", head_dim)?,
            parse_dtype(dtype)?,
            count("tokens_per_block", tokens_per_block)?,
            TensorOrder::BlockMajor,
            count("tp_size", tp_size)?,
        )
        .map_err(|e| match e {
            // The one per-argument rule kv_descriptor checks beyond `count`:
            // the Python argument it names, as the other argument errors.
            DescriptorError::InvalidField {
                field: "layout.tp_size",
                reason,
            } => bad_argument("tp_size", reason),
            other => descriptor(other),
        })?;
        Ok(Self { inner })
    }
    /// Bytes of one TP rank's part of one block.
    #[getter]
    fn rank_block_bytes(&self) -> usize {
        self.inner.rank_block_bytes()
    }
    /// Elements of one TP rank's part of one block (numpy arrays' last axis).
    #[getter]
    fn rank_block_elems(&self) -> usize {
        self.inner.rank_block_bytes() / self.inner.dtype().size_bytes()
    }
    /// The `__array_interface__` typestr arrays must have (`<f4`, ...).
    #[getter]
    fn typestr(&self) -> &'static str {
        crate::array::typestr(self.inner.dtype())
    }
    /// Tokens per KV block.
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.tokens_per_block()
    }
    /// TP ranks.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.tp_size()
    }
    /// Model layers.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers()
    }
    /// KV heads of the whole model (all TP ranks).
    #[getter]
    fn num_kv_heads(&self) -> u32 {
        self.inner.num_kv_heads()
    }
    /// KV heads one TP rank holds (`num_kv_heads / tp_size`).
    #[getter]
    fn heads_per_rank(&self) -> u32 {
        self.inner.heads_per_rank()
    }
    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim()
    }
    /// Element type: `f32`, `fp16`, `bf16` or `fp8_e4m3` (the names `Layout` takes).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.inner.dtype())
    }
    /// `Layout(num_layers=.., num_kv_heads=.., head_dim=.., dtype='..',
    /// tokens_per_block=.., tp_size=..)`: the constructor's arguments.
    pub(crate) fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Layout(num_layers={}, num_kv_heads={}, head_dim={}, dtype='{}', tokens_per_block={}, tp_size={})",
            l.num_layers(),
            l.num_kv_heads(),
            l.head_dim(),
            dtype_name(l.dtype()),
            l.tokens_per_block(),
            l.tp_size()
        )
    }
}

/// A count argument of `Layout` as u32: `BadArgument` naming `argument` and
/// its real range `1..=4294967295` when it is zero, negative or past u32,
/// or a bool ([`uint_in`]), the same class for every invalid count.
fn count(argument: &str, v: &Bound<'_, PyAny>) -> PyResult<u32> {
    uint_in(argument, v, 1..=u64::from(u32::MAX))
}

/// The name `Layout` takes for `d` (the inverse of [`parse_dtype`]'s first names).
fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::Fp16 => "fp16",
        DType::Bf16 => "bf16",
        DType::Fp8E4m3 => "fp8_e4m3",
    }
}

/// Parses an engine id (hyphenated UUID), naming `argument` on error.
pub(crate) fn engine_id(s: &str, argument: &str) -> PyResult<EngineId> {
    uuid::Uuid::parse_str(s)
        .map(EngineId)
        .map_err(|e| bad_argument(argument, format!("`{s}` is not a UUID: {e}")))
}
