//! Zero-copy reads of host arrays through the NumPy `__array_interface__`
//! (version 3): the only module of this crate with unsafe code.
//!
//! abi3 for Python 3.9 has no buffer-protocol API (`PyBuffer` needs 3.11), so
//! the array interface is read instead: `data` = (address, read_only),
//! `typestr` (`<f4`, `|u1`, ...), `shape`, `strides` (None = C-contiguous).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::bad_argument;

/// A C-contiguous host array checked against an expected dtype and shape.
pub(crate) struct HostArray<'py> {
    /// Keeps the array (and so its memory) alive while `ptr` is read.
    _owner: Bound<'py, PyAny>,
    ptr: usize,
    len: usize,
}

impl<'py> HostArray<'py> {
    /// Reads `obj.__array_interface__`, refusing (naming `argument`) an
    /// object without one, a typestr other than `typestr`, a shape other than
    /// `shape`, or non-C-contiguous strides.
    pub(crate) fn new(
        obj: &Bound<'py, PyAny>,
        argument: &str,
        typestr: &str,
        shape: &[usize],
    ) -> PyResult<Self> {
        if obj.hasattr("__cuda_array_interface__")? {
            return Err(bad_argument(
                argument,
                "a CUDA tensor on the host path; pass a host (numpy) array",
            ));
        }
        let ai = obj.getattr("__array_interface__").map_err(|_| {
            bad_argument(argument, "has no __array_interface__ (pass a numpy array)")
        })?;
        let ai = ai
            .downcast::<PyDict>()
            .map_err(|_| bad_argument(argument, "__array_interface__ is not a dict"))?;
        let get = |k: &str| -> PyResult<Bound<'py, PyAny>> {
            ai.get_item(k)?
                .ok_or_else(|| bad_argument(argument, format!("__array_interface__ lacks `{k}`")))
        };
        let ts: String = get("typestr")?.extract()?;
        // `=` and `<` are both little-endian on x86-64 (the only wheel target).
        let norm = |s: &str| s.replace('=', "<");
        if norm(&ts) != norm(typestr) {
            return Err(bad_argument(
                argument,
                format!("dtype {ts}, expected {typestr}"),
            ));
        }
        let got: Vec<usize> = get("shape")?.extract()?;
        if got != shape {
            return Err(bad_argument(
                argument,
                format!("shape {got:?}, expected {shape:?}"),
            ));
        }
        let itemsize: usize = ts[2..]
            .parse()
            .map_err(|_| bad_argument(argument, format!("typestr {ts}")))?;
        let strides = get("strides")?;
        if !strides.is_none() {
            let s: Vec<isize> = strides.extract()?;
            let mut want = itemsize as isize;
            for (dim, st) in shape.iter().zip(&s).rev() {
                if *dim > 1 && *st != want {
                    return Err(bad_argument(
                        argument,
                        format!("strides {s:?} are not C-contiguous"),
                    ));
                }
                want *= *dim as isize;
            }
        }
        let (ptr, _readonly): (usize, bool) = get("data")?.extract()?;
        let len = shape.iter().product::<usize>() * itemsize;
        if ptr == 0 && len > 0 {
            return Err(bad_argument(argument, "null data pointer"));
        }
        Ok(Self {
            _owner: obj.clone(),
            ptr,
            len,
        })
    }

    /// The array's bytes, borrowed for as long as `self` (and the GIL) lives.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the exporter promised `len` readable bytes at `ptr` (C
        // contiguous with the checked shape and itemsize, offset 0); `_owner`
        // holds a reference to the array so its memory is not freed, and the
        // caller holds the GIL (a `Bound<'py>` lives here), so no Python code
        // resizes it while the slice is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// The `__array_interface__` typestr of a layout dtype (FP8 and bf16 travel
/// as raw bytes / uint16 since numpy has no such dtypes).
pub(crate) fn typestr(dtype: kv_descriptor::DType) -> &'static str {
    use kv_descriptor::DType;
    match dtype {
        DType::F32 => "<f4",
        DType::Fp16 => "<f2",
        DType::Bf16 => "<u2",
        DType::Fp8E4m3 => "|u1",
    }
}
