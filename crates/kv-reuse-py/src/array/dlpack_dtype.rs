//! Which DLPack dtypes (dlpack.h `DLDataType` code and bits) carry a
//! layout dtype's bytes, and their names in refusals. Pure lookups: the
//! capsule itself is read in `array.rs`.

use kv_descriptor::DType;

/// DLPack dtype codes (dlpack.h `DLDataTypeCode`).
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
/// `kDLFloat8_e4m3fn` (dlpack.h v1.1): torch's `float8_e4m3fn`, the E4M3
/// format of vLLM's `fp8` KV cache and of the layout's `fp8_e4m3`.
const DL_FLOAT8_E4M3FN: u8 = 10;

/// True when DLPack dtype (code, bits) carries `dtype`'s bytes: the
/// format itself, or the unsigned int of its width (the raw bytes, as the
/// typestr has it).
pub(super) fn dlpack_dtype_ok(dtype: DType, code: u8, bits: u8) -> bool {
    match dtype {
        DType::F32 => (code, bits) == (DL_FLOAT, 32),
        DType::Fp16 => (code, bits) == (DL_FLOAT, 16),
        DType::Bf16 => (code, bits) == (DL_BFLOAT, 16) || (code, bits) == (DL_UINT, 16),
        DType::Fp8E4m3 => (code, bits) == (DL_FLOAT8_E4M3FN, 8) || (code, bits) == (DL_UINT, 8),
    }
}

/// What a DLPack tensor for `dtype` may be, for a dtype refusal.
pub(super) fn dlpack_expected(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "<f4 (DLPack float32)",
        DType::Fp16 => "<f2 (DLPack float16)",
        DType::Bf16 => "<u2 (DLPack bfloat16 or uint16)",
        DType::Fp8E4m3 => "|u1 (DLPack float8_e4m3fn or uint8)",
    }
}

/// The torch / dlpack.h name of DLPack dtype (code, bits), when known.
pub(super) fn dlpack_type_name(code: u8, bits: u8) -> Option<String> {
    let base = match code {
        0 => "int",
        1 => "uint",
        2 => "float",
        4 => "bfloat",
        5 => "complex",
        6 => return Some("bool".into()),
        8 => return Some("float8_e4m3".into()),
        10 => return Some("float8_e4m3fn".into()),
        11 => return Some("float8_e4m3fnuz".into()),
        12 => return Some("float8_e5m2".into()),
        13 => return Some("float8_e5m2fnuz".into()),
        _ => return None,
    };
    Some(format!("{base}{bits}"))
}
