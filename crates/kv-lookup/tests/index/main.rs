//! Event application, donor rules, budgets and concurrency of `InventoryIndex`.
//!
//! `common.rs` holds the shared builders; each other module is one area.

mod common;
mod concurrency;
mod donors;
mod events;
mod layouts;
