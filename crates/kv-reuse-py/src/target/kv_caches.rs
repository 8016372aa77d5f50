//! The engine's `kv_caches` argument of `Target(...)`: one rank's HF
//! cache as its `2 * L` tensors, and the bytes each destination tensor
//! claims (two ranks or layers may not share memory).

use kv_bank::MemoryKind;
use pyo3::prelude::*;

use crate::errors::bad_argument;

/// Byte ranges of the destination tensors seen so far, by memory kind.
#[derive(Default)]
pub(super) struct Claimed(Vec<(String, MemoryKind, usize, usize)>);

impl Claimed {
    /// Records `len` bytes at `addr` for `argument`; `BadArgument` naming
    /// `argument` when they overlap an earlier tensor's (the same tensor
    /// passed twice, or views sharing bytes): a fetch for one rank would
    /// overwrite another's rows.
    pub(super) fn claim(
        &mut self,
        argument: &str,
        kind: MemoryKind,
        addr: usize,
        len: usize,
    ) -> PyResult<()> {
        let end = addr.saturating_add(len);
        if let Some((other, ..)) = self
            .0
            .iter()
            .find(|(_, k, a, e)| *k == kind && addr < *e && *a < end)
        {
            return Err(bad_argument(
                argument,
                format!(
                    "overlaps the memory of {other} (the same tensor, or views sharing bytes); \
                     each destination needs its own memory"
                ),
            ));
        }
        self.0.push((argument.to_owned(), kind, addr, end));
        Ok(())
    }
}

/// The `2 * L` tensors of one rank's HF cache: a list of `2 * L` tensors
/// (K0, V0, K1, ...) or of `L` (K, V) pairs; `BadArgument` names
/// `kv_caches[r]` for another count.
pub(super) fn hf_tensors<'py>(
    list: &Bound<'py, PyAny>,
    r: usize,
    layers: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let arg = format!("kv_caches[{r}]");
    let items: Vec<Bound<'py, PyAny>> = list
        .extract()
        .map_err(|_| bad_argument(&arg, "is not a list of tensors or (K, V) pairs"))?;
    let flat: Vec<Bound<'py, PyAny>> = if items.len() == layers
        && items.iter().all(|i| {
            i.extract::<(Bound<'py, PyAny>, Bound<'py, PyAny>)>()
                .is_ok()
        }) {
        items
            .iter()
            .flat_map(|i| {
                let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) =
                    i.extract().expect("checked above");
                [k, v]
            })
            .collect()
    } else {
        items
    };
    if flat.len() != 2 * layers {
        return Err(bad_argument(
            &arg,
            format!(
                "{} tensors, expected 2 * num_layers = {} (K0, V0, K1, ...) or {layers} (K, V) pairs",
                flat.len(),
                2 * layers
            ),
        ));
    }
    Ok(flat)
}
