//! Fuzz target: `kv_descriptor_fuzz::checks::pin_control` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kv_descriptor_fuzz::checks::pin_control(data));
