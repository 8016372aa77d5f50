//! Fuzz target: `kv_descriptor_fuzz::checks::manifest` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kv_descriptor_fuzz::checks::manifest(data));
