//! Fuzzing support for `kv-descriptor`'s decoders.
//!
//! [`checks`] holds the properties every decoder must keep on arbitrary bytes
//! (no panic; an accepted value is valid and round-trips); [`seeds`] holds
//! valid encodings used as the seed corpus. The same two files are compiled
//! into `crates/kv-descriptor/tests/decoder_robustness.rs`, which replays the
//! corpus under stable Rust, so fuzzing needs nightly but its findings do not.

pub mod checks;
pub mod seeds;
