//! Retained KV banks (in progress).

mod error;
pub mod memory;
mod shm;

pub use error::BankError;
pub use memory::{BankMemory, MemoryKind};
pub use shm::HostShmMemory;
