//! Host reference of the converting gather: one element at a time through
//! [`KvRegionLayout::run_offset`], independent of the piece tables.

use kv_descriptor::KvRegionLayout;

use super::{ConvertError, ConvertPlan};

/// Host reference of a converting gather: for every moved block, every
/// element `(layer, kv, token, head, d)` is copied from
/// `donor.run_offset(..)` in `src` to `target.run_offset(..)` in `dst` (plus
/// `d` times the head_dim stride), one element at a time. Independent of the
/// piece tables, so tests and the benchmark check the kernel against it.
/// `src` / `dst` are the whole regions (layout byte 0 = index 0).
///
/// # Errors
/// As [`ConvertPlan::new`]; [`ConvertError::ShortRegion`] naming `src` /
/// `dst` when a slice is shorter than its layout's region.
pub fn reference_convert(
    donor: &KvRegionLayout,
    target: &KvRegionLayout,
    moves: &[(u32, u32)],
    src: &[u8],
    dst: &mut [u8],
) -> Result<(), ConvertError> {
    ConvertPlan::new(donor, target, moves)?;
    for (field, have, need) in [
        ("src", src.len() as u64, donor.region_bytes()),
        ("dst", dst.len() as u64, target.region_bytes()),
    ] {
        if have < need {
            return Err(ConvertError::ShortRegion {
                field,
                len: have,
                need,
            });
        }
    }
    let g = donor.geometry();
    let e = g.dtype().size_bytes();
    let (sd, td) = (
        donor.strides().dim as usize * e,
        target.strides().dim as usize * e,
    );
    for &(sb, db) in moves {
        for l in 0..g.num_layers() {
            for kv in 0..2 {
                for t in 0..g.tokens_per_block() {
                    for h in 0..g.heads_per_rank() {
                        let so = donor.run_offset(l, sb, kv, t, h).expect("in range") as usize;
                        let to = target.run_offset(l, db, kv, t, h).expect("in range") as usize;
                        for d in 0..g.head_dim() as usize {
                            let (s, t) = (so + d * sd, to + d * td);
                            dst[t..t + e].copy_from_slice(&src[s..s + e]);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
