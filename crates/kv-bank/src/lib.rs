//! Retained KV banks (in progress).

pub mod memory;
pub use memory::{BankMemory, MemoryKind};
