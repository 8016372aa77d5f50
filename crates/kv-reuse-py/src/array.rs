//! Zero-copy views of engine tensors through the array protocols: the only
//! module of this crate with unsafe code.
//!
//! Protocols read (abi3 for Python 3.9 has no buffer-protocol API, since
//! `PyBuffer` needs 3.11):
//! - NumPy `__array_interface__` (version 3): `data` = (address, read_only),
//!   `typestr` (`<f4`, `|u1`, ...), `shape`, `strides` in bytes (absent or
//!   None = C contiguous);
//! - `__cuda_array_interface__` (version 2/3, Numba's definition; CuPy,
//!   torch): the same fields for device memory;
//! - DLPack (`__dlpack__()` returning a `dltensor` capsule around a
//!   `DLManagedTensor`, dlpack.h v0.8: `data`, `device` (type, id), `ndim`,
//!   `dtype` (code, bits, lanes), `shape`, `strides` in elements (NULL = C
//!   contiguous), `byte_offset`), with `__dlpack_device__()` for the device.
//!
//! A view checks dtype, shape, C-contiguity and device, and refuses naming
//! the Python argument. The capsule is not consumed (not renamed to
//! `used_dltensor`): the exporter's destructor frees the tensor when the
//! capsule, held by the view, is dropped.

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};
use pyo3::{PyTraverseError, PyVisit};

use kv_bank::{BankError, BankMemory, MemoryKind};
use kv_descriptor::{DType, ExportHandle};

use crate::errors::bad_argument;

mod dlpack_dtype;
use dlpack_dtype::{dlpack_dtype_ok, dlpack_expected, dlpack_type_name};

/// DLPack device types (dlpack.h `DLDeviceType`) this crate accepts.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

/// Where a view's memory must live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// Host memory of this process (numpy, a CPU torch tensor).
    Host,
    /// CUDA device memory on this device ordinal.
    Cuda(u32),
    /// CUDA device memory on this ordinal that a store copies from (the
    /// source of `PendingStore.write` on a CUDA bank). The copy runs on the
    /// legacy default stream (kv_bank's device-source store), so the view
    /// prefers DLPack and asks `__dlpack__(stream=1)`: the producer makes
    /// that stream wait for its own, and the rows are complete when copied.
    /// A `__cuda_array_interface__` only tensor must name no stream or a
    /// default one (v3 `stream` None, 1 or 2), which the legacy stream
    /// orders after; another stream is refused.
    CudaSource(u32),
}

/// True when `obj` is a CUDA tensor: it has `__cuda_array_interface__` or
/// its `__dlpack_device__()` is CUDA (torch, CuPy).
pub(crate) fn on_cuda(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<bool> {
    Ok(has(obj, "__cuda_array_interface__", argument)?
        || matches!(dlpack_device(obj, argument)?, Some((DL_CUDA, _))))
}

/// A C-contiguous tensor checked against an expected dtype, shape and device.
pub(crate) struct ArrayView<'py> {
    /// Keeps the exporter (and so its memory) alive while `ptr` is used.
    owner: Bound<'py, PyAny>,
    /// The DLPack capsule, when read through DLPack: dropping it frees the
    /// exporter's `DLManagedTensor`.
    capsule: Option<Bound<'py, PyAny>>,
    ptr: usize,
    len: usize,
    readonly: bool,
    kind: MemoryKind,
    /// Shape as exported.
    shape: Vec<usize>,
    /// Strides in bytes (C-contiguous ones when the exporter gave none).
    strides: Vec<isize>,
}

/// Which strides a view accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dense {
    /// C-contiguous (length-1 axes may have any stride).
    All,
    /// Only the last axis dense; the others any positive stride (an HF
    /// cache slice `[1, H, capacity, D]` of a larger buffer).
    LastDim,
}

/// The raw fields every protocol yields, checked by [`ArrayView::check`].
struct Raw {
    ptr: usize,
    itemsize: usize,
    shape: Vec<usize>,
    /// Strides in bytes; None = C-contiguous.
    strides: Option<Vec<isize>>,
    readonly: bool,
    dtype_ok: bool,
    dtype_name: String,
    /// Read through DLPack: a dtype refusal then lists the DLPack types
    /// accepted ([`dlpack_expected`]), not only the typestr.
    dlpack: bool,
}

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// The `__array_interface__` typestr of a layout dtype (FP8 and bf16 travel
/// as raw bytes / uint16 since numpy has no such dtypes).
pub(crate) fn typestr(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "<f4",
        DType::Fp16 => "<f2",
        DType::Bf16 => "<u2",
        DType::Fp8E4m3 => "|u1",
    }
}

/// True when `obj` offers protocol attribute `name`. An attribute that
/// raises `TypeError` counts as absent: torch's `__cuda_array_interface__`
/// raises it for bf16 tensors (the interface has no bf16 typestr), which
/// `hasattr` does not swallow; such a tensor is then read through DLPack,
/// which carries bf16.
///
/// Any other exception of the attribute (a property that raises) is the
/// exporter's failure: `BadArgument` naming `argument` and the attribute,
/// with the exporter's exception as `__cause__` ([`exporter_failed`]), as
/// a failing `__dlpack__()` is, not a bare `RuntimeError` from inside.
fn has(obj: &Bound<'_, PyAny>, name: &str, argument: &str) -> PyResult<bool> {
    match obj.hasattr(name) {
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(obj.py()) => Ok(false),
        Err(e) => Err(exporter_failed(obj.py(), argument, name, e)),
        other => other,
    }
}

/// `BadArgument` for an exporter whose protocol attribute or call `what`
/// raised `e`: the message names `argument`, `what` and `e`, and `e` is
/// kept as its `__cause__` (its traceback shows where the exporter failed).
fn exporter_failed(py: Python<'_>, argument: &str, what: &str, e: PyErr) -> PyErr {
    let err = bad_argument(argument, format!("{what} failed: {e}"));
    err.set_cause(py, Some(e));
    err
}

/// `obj.<name>`, an attribute [`has`] found: read again, it may raise this
/// time (a property), refused as [`exporter_failed`].
fn protocol_attr<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    argument: &str,
) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr(name)
        .map_err(|e| exporter_failed(obj.py(), argument, name, e))
}

/// `(device_type, device_id)` from `__dlpack_device__()`, when the object has it.
fn dlpack_device(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<Option<(i32, i32)>> {
    if !has(obj, "__dlpack_device__", argument)? {
        return Ok(None);
    }
    // An exporter that cannot say (torch raises ValueError for a `meta`
    // tensor, which has no memory) is refused naming the argument, as a
    // failing `__dlpack__()` is.
    let d = obj
        .call_method0("__dlpack_device__")
        .map_err(|e| exporter_failed(obj.py(), argument, "__dlpack_device__()", e))?;
    let (t, id): (i32, i32) = d
        .extract()
        .map_err(|_| bad_argument(argument, "__dlpack_device__() is not (type, id)"))?;
    Ok(Some((t, id)))
}

/// Reads an `__array_interface__` / `__cuda_array_interface__` dict.
fn interface(dict: &Bound<'_, PyAny>, argument: &str, proto: &str, dtype: DType) -> PyResult<Raw> {
    let ai = dict
        .downcast::<PyDict>()
        .map_err(|_| bad_argument(argument, format!("{proto} is not a dict")))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| bad_argument(argument, format!("{proto} lacks `{k}`")))
    };
    let ts: String = get("typestr")?
        .extract()
        .map_err(|_| bad_argument(argument, format!("{proto} typestr is not a str")))?;
    // `=` and `<` are both little-endian on x86-64 (the only wheel target).
    let norm = |s: &str| s.replace('=', "<");
    let itemsize: usize = ts.get(2..).and_then(|s| s.parse().ok()).ok_or_else(|| {
        bad_argument(
            argument,
            format!(
                "{proto} typestr {ts:?} is not a supported typestr (byte order, kind and \
                     size in bytes, as numpy writes them); this layout takes {:?}",
                typestr(dtype)
            ),
        )
    })?;
    let shape: Vec<usize> = get("shape")?
        .extract()
        .map_err(|_| bad_argument(argument, format!("{proto} shape is not a tuple of ints")))?;
    // Optional in both protocols: absent or None means C-contiguous (NumPy's
    // array interface spec; numpy itself puts None there, other exporters
    // leave the key out).
    let strides = match ai.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract::<Vec<isize>>().map_err(|_| {
            bad_argument(argument, format!("{proto} strides are not a tuple of ints"))
        })?),
        _ => None,
    };
    let (ptr, readonly): (usize, bool) = get("data")?.extract().map_err(|_| {
        bad_argument(
            argument,
            format!("{proto} data is not (address, read_only)"),
        )
    })?;
    Ok(Raw {
        ptr,
        itemsize,
        shape,
        strides,
        readonly,
        dtype_ok: norm(&ts) == norm(typestr(dtype)),
        dtype_name: ts,
        dlpack: false,
    })
}

impl<'py> ArrayView<'py> {
    /// Views `obj` as a C-contiguous tensor of `dtype` with `shape` in the
    /// memory `want` names, refusing (naming `argument`): no protocol, the
    /// wrong dtype, shape or strides, non-contiguous strides, a tensor on
    /// another device, a CUDA tensor on the host path or a CPU tensor on
    /// the GPU path, a null pointer.
    pub(crate) fn new(
        obj: &Bound<'py, PyAny>,
        argument: &str,
        dtype: DType,
        shape: &[usize],
        want: Want,
    ) -> PyResult<Self> {
        Self::open(obj, argument, dtype, Some(shape), want, Dense::All)
    }

    /// Views `obj` as a tensor of `dtype` whose last axis is dense and whose
    /// other axes have any positive stride (read [`ArrayView::shape`] and
    /// [`ArrayView::strides`]); refuses as [`ArrayView::new`] does.
    pub(crate) fn new_strided(
        obj: &Bound<'py, PyAny>,
        argument: &str,
        dtype: DType,
        want: Want,
    ) -> PyResult<Self> {
        Self::open(obj, argument, dtype, None, want, Dense::LastDim)
    }

    /// The exported shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in bytes, one per axis.
    pub(crate) fn strides(&self) -> &[isize] {
        &self.strides
    }

    /// Bytes from the first element to one past the last.
    pub(crate) fn span_bytes(&self) -> usize {
        self.len
    }

    /// First byte address (host pointer or `CUdeviceptr`).
    pub(crate) fn addr(&self) -> usize {
        self.ptr
    }

    /// Where the memory lives.
    pub(crate) fn memory_kind(&self) -> MemoryKind {
        self.kind
    }

    fn open(
        obj: &Bound<'py, PyAny>,
        argument: &str,
        dtype: DType,
        shape: Option<&[usize]>,
        want: Want,
        dense: Dense,
    ) -> PyResult<Self> {
        let device = dlpack_device(obj, argument)?;
        let mut capsule = None;
        let (raw, kind) = match want {
            Want::Host => {
                let cuda = has(obj, "__cuda_array_interface__", argument)?
                    || matches!(device, Some((DL_CUDA, _)));
                if cuda {
                    return Err(bad_argument(
                        argument,
                        "a CUDA tensor on the host path; pass a host (numpy) array",
                    ));
                }
                if let Some((t, _)) = device.filter(|(t, _)| *t != DL_CPU && *t != DL_CUDA_HOST) {
                    return Err(bad_argument(
                        argument,
                        format!("DLPack device type {t} is not host memory"),
                    ));
                }
                let raw = if has(obj, "__array_interface__", argument)? {
                    let ai = protocol_attr(obj, "__array_interface__", argument)?;
                    interface(&ai, argument, "__array_interface__", dtype)?
                } else if has(obj, "__dlpack__", argument)? {
                    let (raw, cap, dev) = read_dlpack(obj, argument, dtype, None)?;
                    if dev.0 != DL_CPU && dev.0 != DL_CUDA_HOST {
                        return Err(bad_argument(
                            argument,
                            format!("DLPack device type {} is not host memory", dev.0),
                        ));
                    }
                    capsule = Some(cap);
                    raw
                } else {
                    return Err(bad_argument(
                        argument,
                        "has no __array_interface__ or __dlpack__ (pass a numpy array)",
                    ));
                };
                (raw, MemoryKind::Host)
            }
            Want::Cuda(ordinal) | Want::CudaSource(ordinal) => {
                let source = matches!(want, Want::CudaSource(_));
                if let Some((t, id)) = device {
                    if t != DL_CUDA {
                        return Err(bad_argument(
                            argument,
                            format!("a CPU tensor on the GPU path (DLPack device type {t}); pass a CUDA tensor"),
                        ));
                    }
                    if id as i64 != i64::from(ordinal) {
                        return Err(bad_argument(
                            argument,
                            format!("on cuda:{id}, expected cuda:{ordinal}"),
                        ));
                    }
                }
                let cai = has(obj, "__cuda_array_interface__", argument)?;
                let dlpack = has(obj, "__dlpack__", argument)?;
                let raw = if cai && !(source && dlpack) {
                    let ai = protocol_attr(obj, "__cuda_array_interface__", argument)?;
                    if source {
                        check_cai_stream(&ai, argument)?;
                    }
                    interface(&ai, argument, "__cuda_array_interface__", dtype)?
                } else if dlpack {
                    let stream = source.then_some(DLPACK_LEGACY_STREAM);
                    let (raw, cap, dev) = read_dlpack(obj, argument, dtype, stream)?;
                    if dev.0 != DL_CUDA {
                        return Err(bad_argument(
                            argument,
                            format!("a CPU tensor on the GPU path (DLPack device type {}); pass a CUDA tensor", dev.0),
                        ));
                    }
                    if dev.1 as i64 != i64::from(ordinal) {
                        return Err(bad_argument(
                            argument,
                            format!("on cuda:{}, expected cuda:{ordinal}", dev.1),
                        ));
                    }
                    capsule = Some(cap);
                    raw
                } else if has(obj, "__array_interface__", argument)? {
                    return Err(bad_argument(
                        argument,
                        "a CPU tensor on the GPU path; pass a CUDA tensor",
                    ));
                } else {
                    return Err(bad_argument(
                        argument,
                        "has no __cuda_array_interface__ or __dlpack__ (pass a CUDA tensor)",
                    ));
                };
                (raw, MemoryKind::Cuda { ordinal })
            }
        };
        let (len, strides) = Self::check(&raw, argument, dtype, shape, dense)?;
        Ok(Self {
            owner: obj.clone(),
            capsule,
            ptr: raw.ptr,
            len,
            readonly: raw.readonly,
            kind,
            shape: raw.shape,
            strides,
        })
    }

    /// Checks dtype, shape (when given) and strides; returns the byte
    /// length spanned (first to one past the last element) and the strides
    /// in bytes.
    fn check(
        raw: &Raw,
        argument: &str,
        dtype: DType,
        shape: Option<&[usize]>,
        dense: Dense,
    ) -> PyResult<(usize, Vec<isize>)> {
        if !raw.dtype_ok || raw.itemsize != dtype.size_bytes() {
            let expected = if raw.dlpack {
                dlpack_expected(dtype)
            } else {
                typestr(dtype)
            };
            return Err(bad_argument(
                argument,
                format!("dtype {}, expected {expected}", raw.dtype_name),
            ));
        }
        if let Some(shape) = shape {
            if raw.shape != shape {
                return Err(bad_argument(
                    argument,
                    format!("shape {:?}, expected {shape:?}", raw.shape),
                ));
            }
        }
        let shape = &raw.shape;
        let mut c = vec![0isize; shape.len()];
        let mut acc = raw.itemsize as isize;
        for (i, dim) in shape.iter().enumerate().rev() {
            c[i] = acc;
            acc *= *dim as isize;
        }
        let strides = raw.strides.clone().unwrap_or_else(|| c.clone());
        if strides.len() != shape.len() {
            return Err(bad_argument(
                argument,
                format!("strides {strides:?} for {} axes", shape.len()),
            ));
        }
        let ok = match dense {
            // A length-1 axis may have any stride (numpy, torch).
            Dense::All => shape
                .iter()
                .zip(strides.iter().zip(&c))
                .all(|(dim, (s, want))| *dim <= 1 || s == want),
            Dense::LastDim => {
                let last = shape.len().saturating_sub(1);
                shape.iter().zip(&strides).enumerate().all(|(i, (dim, s))| {
                    *dim <= 1
                        || if i == last {
                            *s == raw.itemsize as isize
                        } else {
                            *s > 0
                        }
                })
            }
        };
        if !ok {
            let what = match dense {
                Dense::All => "are not C-contiguous",
                Dense::LastDim => "need a dense last axis and positive strides",
            };
            return Err(bad_argument(
                argument,
                format!("strides {strides:?} {what}"),
            ));
        }
        let len = if shape.contains(&0) {
            0
        } else {
            shape
                .iter()
                .zip(&strides)
                .map(|(d, s)| (*d as isize - 1) * s.max(&0))
                .sum::<isize>() as usize
                + raw.itemsize
        };
        if raw.ptr == 0 && len > 0 {
            return Err(bad_argument(argument, "null data pointer"));
        }
        Ok((len, strides))
    }

    /// The view's bytes (host memory only), borrowed for as long as `self`
    /// (and the GIL) lives.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 || self.kind != MemoryKind::Host {
            return &[];
        }
        // SAFETY: the exporter promised `len` readable host bytes at `ptr`
        // (C contiguous with the checked shape and itemsize). `owner` (and
        // the DLPack capsule) hold references to the tensor for the slice's
        // whole borrow, so its memory is not freed; numpy refuses to resize
        // an array that has other references, and a DLPack exporter keeps
        // the memory for the capsule's life. This holds also while the GIL
        // is released for a copy (`PendingStore.write`): the engine must not
        // write the tensor until that call returned (docs/python.md).
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The view's CUDA ordinal and device address (`CUdeviceptr`), None
    /// for host memory. `owner` and the capsule keep the memory allocated
    /// for as long as `self` lives.
    pub(crate) fn device_ptr(&self) -> Option<(u32, u64)> {
        match self.kind {
            MemoryKind::Cuda { ordinal } => Some((ordinal, self.ptr as u64)),
            MemoryKind::Host => None,
        }
    }

    /// Refuses a read-only view as a destination, naming `argument`.
    pub(crate) fn writable(self, argument: &str) -> PyResult<Self> {
        if self.readonly {
            return Err(bad_argument(
                argument,
                "is read-only; a destination must be writable",
            ));
        }
        Ok(self)
    }

    /// The view as bank memory a fetch may write (the engine's own KV
    /// tensor as a destination region), holding the exporter alive.
    pub(crate) fn into_memory(self) -> ExternalMemory {
        ExternalMemory {
            ptr: self.ptr,
            len: self.len,
            kind: self.kind,
            owners: vec![(self.owner.unbind(), self.capsule.map(Bound::unbind))],
        }
    }
}

impl ExternalMemory {
    /// One region spanning bytes `base .. base + len` of the memory kind
    /// `kind` that holds several engine tensors (an HF cache's per-layer K
    /// and V), keeping every exporter alive. The caller's region layout
    /// addresses only the tensors' elements, never the gaps between them.
    pub(crate) fn spanning(
        views: Vec<ArrayView<'_>>,
        base: usize,
        len: usize,
        kind: MemoryKind,
    ) -> Self {
        ExternalMemory {
            ptr: base,
            len,
            kind,
            owners: views
                .into_iter()
                .map(|v| (v.owner.unbind(), v.capsule.map(Bound::unbind)))
                .collect(),
        }
    }

    /// Shows the garbage collector each exporter and DLPack capsule this
    /// region holds (one strong reference each), for the `__traverse__` of
    /// the one pyclass that owns the region (`Target`). Without it a
    /// reference cycle through that pyclass (an exporter whose class is
    /// defined in a script: its methods' globals hold the target) is never
    /// collected, and whatever else the cycle holds (a donor bank in the
    /// same globals) outlives interpreter exit with its /dev/shm entries.
    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (exporter, capsule) in &self.owners {
            visit.call(exporter)?;
            if let Some(capsule) = capsule {
                visit.call(capsule)?;
            }
        }
        Ok(())
    }
}

/// DLPack's stream number for the legacy default stream on CUDA (the
/// `stream` argument of the array API standard's `__dlpack__`).
const DLPACK_LEGACY_STREAM: i64 = 1;

/// Refuses a `__cuda_array_interface__` (v3) `stream` the legacy default
/// stream is not ordered after: only None (no pending work), 1 (legacy
/// default) and 2 (per-thread default, which synchronizes with the legacy
/// one) are accepted for a store source.
fn check_cai_stream(ai: &Bound<'_, PyAny>, argument: &str) -> PyResult<()> {
    let Ok(dict) = ai.downcast::<PyDict>() else {
        return Ok(()); // `interface` refuses it by name
    };
    let Some(stream) = dict.get_item("stream")? else {
        return Ok(());
    };
    if stream.is_none() {
        return Ok(());
    }
    match stream.extract::<i64>() {
        Ok(1 | 2) => Ok(()),
        Ok(s) => Err(bad_argument(
            argument,
            format!(
                "__cuda_array_interface__ stream {s:#x} is not a default stream; \
                 synchronize it first or pass the tensor through DLPack"
            ),
        )),
        Err(_) => Err(bad_argument(
            argument,
            "__cuda_array_interface__ stream is not an int",
        )),
    }
}

/// Reads a DLPack capsule: the raw fields, the capsule, (device type, id).
/// `stream` is passed as `__dlpack__(stream=...)` (the consumer's stream the
/// producer must order its work before); a producer without that keyword
/// is asked again without it.
fn read_dlpack<'py>(
    obj: &Bound<'py, PyAny>,
    argument: &str,
    dtype: DType,
    stream: Option<i64>,
) -> PyResult<(Raw, Bound<'py, PyAny>, (i32, i32))> {
    let py = obj.py();
    let with_stream = match stream {
        Some(s) => {
            let kw = PyDict::new(py);
            kw.set_item("stream", s)?;
            match obj.call_method("__dlpack__", (), Some(&kw)) {
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => None,
                other => Some(other),
            }
        }
        None => None,
    };
    let cap = with_stream
        .unwrap_or_else(|| obj.call_method0("__dlpack__"))
        .map_err(|e| exporter_failed(py, argument, "__dlpack__()", e))?;
    let capsule = cap
        .downcast::<PyCapsule>()
        .map_err(|_| bad_argument(argument, "__dlpack__() did not return a capsule"))?;
    let named = capsule.name()?.is_some_and(|n| n.to_bytes() == b"dltensor");
    if !named {
        return Err(bad_argument(
            argument,
            "__dlpack__() capsule is not a `dltensor`",
        ));
    }
    let managed = capsule.pointer() as *const DlManagedTensor;
    if managed.is_null() {
        return Err(bad_argument(argument, "__dlpack__() capsule is empty"));
    }
    // SAFETY: a `dltensor` capsule holds a valid `DLManagedTensor` (dlpack.h)
    // that lives until the capsule's destructor runs; `cap` is alive for the
    // whole read. `shape` and (non-null) `strides` point to `ndim` i64s.
    let t = unsafe { &(*managed).dl_tensor };
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| bad_argument(argument, format!("DLPack ndim {}", t.ndim)))?;
    let dims: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: see above; `shape` has `ndim` entries.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape = dims
        .iter()
        .map(|d| usize::try_from(*d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad_argument(argument, format!("DLPack shape {dims:?}")))?;
    let itemsize = usize::from(t.dtype.bits) / 8;
    let strides = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: see above; non-null `strides` has `ndim` entries (elements).
        let s = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        Some(s.iter().map(|e| *e as isize * itemsize as isize).collect())
    };
    let raw = Raw {
        ptr: (t.data as usize).wrapping_add(t.byte_offset as usize),
        itemsize,
        shape,
        strides,
        readonly: false,
        dtype_ok: t.dtype.lanes == 1 && dlpack_dtype_ok(dtype, t.dtype.code, t.dtype.bits),
        dtype_name: format!(
            "dlpack(code={}, bits={}, lanes={}){}",
            t.dtype.code,
            t.dtype.bits,
            t.dtype.lanes,
            dlpack_type_name(t.dtype.code, t.dtype.bits)
                .map(|n| format!(" = {n}"))
                .unwrap_or_default()
        ),
        dlpack: true,
    };
    let device = (t.device.device_type, t.device.device_id);
    Ok((raw, cap, device))
}

/// An engine tensor as a fetch destination region: host memory (numpy, CPU
/// torch) or CUDA device memory (torch / CuPy via the CUDA array interface
/// or DLPack) owned by the Python exporter, which this keeps alive.
#[derive(Debug)]
pub(crate) struct ExternalMemory {
    /// Each exporter and its DLPack capsule, kept alive with the region.
    owners: Vec<(Py<PyAny>, Option<Py<PyAny>>)>,
    ptr: usize,
    len: usize,
    kind: MemoryKind,
}

impl ExternalMemory {
    fn host_range(&self, op: &'static str, offset: usize, n: usize) -> Result<(), BankError> {
        if self.kind != MemoryKind::Host {
            return Err(BankError::Unsupported {
                op,
                kind: self.kind.to_string(),
            });
        }
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(BankError::OutOfRange {
                field: "offset",
                offset: offset as u64,
                len: n as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

impl BankMemory for ExternalMemory {
    fn kind(&self) -> MemoryKind {
        self.kind
    }
    fn len(&self) -> usize {
        self.len
    }
    fn base_addr(&self) -> u64 {
        self.ptr as u64
    }
    fn export_handle(&self) -> Option<ExportHandle> {
        // Process-private: a destination is never exported to a donor.
        None
    }
    fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), BankError> {
        self.host_range("write_bytes", offset, src.len())?;
        // SAFETY: host memory of `len` writable bytes (checked writable
        // when viewed) kept alive by `owners`; the range is in bounds. A
        // spanning region (HF cache) may hold gaps between its tensors: its
        // region layout was built from the tensors' own addresses and
        // strides, so the converting copy writes only their elements. The engine does not touch rows reserved for a fetch (the
        // destination contract, docs/python.md), so nothing aliases them.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), (self.ptr + offset) as *mut u8, src.len())
        };
        Ok(())
    }
    fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), BankError> {
        self.host_range("read_bytes", offset, dst.len())?;
        // SAFETY: as in `write_bytes`; `dst` is a distinct Rust buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.ptr + offset) as *const u8,
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }
}
