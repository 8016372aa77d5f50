//! The router side: settings, the cost model and calibration, the advisor,
//! and the receiving side of KV event streams (ids, gaps, resync; Dynamo
//! event conversion).
//!
//! Who may use it: a router process (and anything that only prices or
//! advises fetches). Nothing here maps memory or moves bytes; the advisor's
//! [`LocalDonorDirectory`](crate::LocalDonorDirectory) reads bank managers of
//! this process.

pub(crate) mod advisor;
pub(crate) mod calibration;
pub(crate) mod cost;
pub mod dynamo_events;
pub(crate) mod kv_events;
pub(crate) mod ols;
pub(crate) mod remote_directory;
pub(crate) mod settings;
