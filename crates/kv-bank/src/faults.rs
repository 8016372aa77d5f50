//! placeholder
use serde::Serialize;
/// A row.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRow {}
/// Runs.
pub fn qualify_faults() -> Vec<FaultRow> {
    Vec::new()
}
