//! Per-block checksums of a pin grant: the donor hashes every pinned KV
//! block while it holds the pin ([`of_pinned`]), the target hashes the rows
//! it received and compares before the fetch completes ([`verify`]).
//!
//! Why: a target that reads by address (NIXL: the donor's registered
//! `base_addr` from its record) cannot tell a wrong-but-registered address
//! from the right one: the READ succeeds, every byte count matches, and
//! without this the fetch would complete with another block's bytes. The
//! hashes are XXH3-64 (seed 0) of each rank's `rank_block_bytes` per block
//! (about 30 GB/s per core on host memory; a device bank pays a copy to
//! the host first), so they are asked for only where addresses are not
//! bound to an export handle ([`kv_descriptor::PinRequest::want_block_checksums`]).

#[cfg(feature = "worker")]
use kv_bank::{BankError, BankMemory, ManagerPin};
#[cfg(feature = "worker")]
use kv_descriptor::PinRequest;

/// Why the bytes of a fetch do not match the donor's block checksums (a
/// [`crate::FallbackCause::BlockChecksum`] at stage `verify`: recompute).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockChecksumError {
    /// The grant carries another number of checksums than blocks x TP
    /// ranks read (none: a donor that predates them, or could not read its
    /// memory).
    #[error("the pin grant carries {got} block checksums, the read needs {expected}")]
    Missing {
        /// Blocks x TP ranks of the read.
        expected: usize,
        /// Checksums in the grant.
        got: usize,
    },
    /// A block's bytes here are not the donor's.
    #[error(
        "rank {rank} block {block} (row {row}): checksum {got:#018x}, the donor's is {expected:#018x}"
    )]
    Mismatch {
        /// TP rank.
        rank: u32,
        /// Index of the block among the fetched ones (prefix order).
        block: usize,
        /// Destination row (target block id) that holds it.
        row: u32,
        /// The donor's checksum.
        expected: u64,
        /// The checksum of the bytes received.
        got: u64,
    },
    /// The received rows cannot be hashed here: the destination memory
    /// refuses read-back (an engine-registered device pointer), or pool
    /// rows of another rank block size than the donor's. Engine regions in
    /// host memory, or CUDA memory this process owns, are gathered back
    /// into block-major order and checked (never this variant).
    #[error("the received rows cannot be checked: {reason}")]
    Unverifiable {
        /// Why, with the value seen.
        reason: String,
    },
}

/// XXH3-64 (seed 0) of `len` bytes of `memory` at `offset`.
#[cfg(feature = "worker")]
fn hash_range(memory: &dyn BankMemory, offset: usize, len: usize) -> Result<u64, BankError> {
    Ok(xxhash_rust::xxh3::xxh3_64(&memory.read_vec(offset, len)?))
}

/// The donor's side: the checksums of every block `req` pinned, rank-major
/// (entry `r * n + i`: rank `r`'s slot `req.parts[r].slot_ids[i]`, the
/// first `rank_block_bytes` of that slot where the bank keeps it, at
/// `slot * slot_bytes`; so a target whose plan read elsewhere fails the
/// check), read under `pin` so no slot can be reused meanwhile.
///
/// # Errors
/// The bank's error when a rank or its memory cannot be read (a device
/// bank without read-back): the caller grants without checksums.
#[cfg(feature = "worker")]
pub(crate) fn of_pinned(
    pin: &ManagerPin,
    req: &PinRequest,
    rank_block_bytes: usize,
) -> Result<Vec<u64>, BankError> {
    let mut out = Vec::with_capacity(req.parts.len() * req.sequence_hashes.len());
    for part in &req.parts {
        let bank = pin.rank(part.tp_rank)?;
        let slot_bytes = bank.descriptor().slot_bytes() as usize;
        for &slot in &part.slot_ids {
            out.push(hash_range(
                bank.memory().as_ref(),
                slot as usize * slot_bytes,
                rank_block_bytes,
            )?);
        }
    }
    Ok(out)
}

/// The target's side: checks that row `rows[i]` of `regions[r]` (dense,
/// `rank_block_bytes` per row) holds the block whose donor checksum is
/// `expected[r * rows.len() + i]`, for every rank and fetched block.
///
/// # Errors
/// [`BlockChecksumError::Missing`] when `expected` does not hold one
/// checksum per block and rank; [`BlockChecksumError::Mismatch`] for the
/// first block (rank order, then prefix order) whose bytes differ;
/// [`BlockChecksumError::Unverifiable`] when a row cannot be read back.
#[cfg(feature = "worker")]
pub(crate) fn verify(
    expected: &[u64],
    regions: &[std::sync::Arc<dyn BankMemory>],
    rows: &[u32],
    rank_block_bytes: usize,
) -> Result<(), BlockChecksumError> {
    verify_with(expected, regions.len(), rows, |rank, row| {
        hash_range(
            regions[rank].as_ref(),
            row as usize * rank_block_bytes,
            rank_block_bytes,
        )
        .map_err(|e| e.to_string())
    })
}

/// [`verify`] for engine regions: block `rows[i]` of `layouts[r]` in
/// `regions[r]` is gathered back into the bank's block-major byte order
/// ([`kv_transfer::block_readback::read_block_major`], the order the donor
/// hashed) and hashed, so a fetch into vLLM or HF per-layer tensors is
/// checked exactly like pool rows.
///
/// # Errors
/// As [`verify`]; [`BlockChecksumError::Unverifiable`] only where the
/// memory has no read-back: an engine-registered device pointer
/// ([`kv_transfer::EngineMemory`] of kind CUDA refuses `read_bytes`).
/// Host memory and CUDA memory this process allocated (device-to-host
/// copy) are read.
#[cfg(feature = "worker")]
pub(crate) fn verify_engine(
    expected: &[u64],
    regions: &[std::sync::Arc<dyn BankMemory>],
    layouts: &[kv_descriptor::KvRegionLayout],
    rows: &[u32],
) -> Result<(), BlockChecksumError> {
    verify_with(expected, regions.len(), rows, |rank, row| {
        kv_transfer::block_readback::read_block_major(regions[rank].as_ref(), &layouts[rank], row)
            .map(|b| xxhash_rust::xxh3::xxh3_64(&b))
            .map_err(|e| e.to_string())
    })
}

/// Compares `hash(rank, row)` with `expected` (rank-major) for `ranks` TP
/// ranks and every row, first difference reported.
#[cfg(feature = "worker")]
fn verify_with(
    expected: &[u64],
    ranks: usize,
    rows: &[u32],
    hash: impl Fn(usize, u32) -> Result<u64, String>,
) -> Result<(), BlockChecksumError> {
    let n = rows.len();
    if expected.len() != n * ranks {
        return Err(BlockChecksumError::Missing {
            expected: n * ranks,
            got: expected.len(),
        });
    }
    for rank in 0..ranks {
        for (block, &row) in rows.iter().enumerate() {
            let got = hash(rank, row).map_err(|e| BlockChecksumError::Unverifiable {
                reason: format!("rank {rank} row {row}: {e}"),
            })?;
            let want = expected[rank * n + block];
            if got != want {
                return Err(BlockChecksumError::Mismatch {
                    rank: rank as u32,
                    block,
                    row,
                    expected: want,
                    got,
                });
            }
        }
    }
    Ok(())
}

#[cfg(all(test, feature = "worker"))]
mod tests {
    use std::sync::Arc;

    use kv_bank::BankMemory;

    use super::*;

    fn region(rows: &[&[u8]]) -> Arc<dyn BankMemory> {
        let m = kv_transfer::HostBuffer::zeroed(rows.len() * 4).unwrap();
        for (i, r) in rows.iter().enumerate() {
            m.write_bytes(i * 4, r).unwrap();
        }
        Arc::new(m)
    }

    #[test]
    fn verify_names_the_first_block_that_differs_or_a_missing_checksum() {
        let h = |b: &[u8]| xxhash_rust::xxh3::xxh3_64(b);
        let regions = vec![
            region(&[b"aaaa", b"bbbb", b"cccc"]),
            region(&[b"dddd", b"eeee", b"ffff"]),
        ];
        // Fetched blocks landed in rows 2 and 0 (prefix order).
        let rows = [2, 0];
        let good = vec![h(b"cccc"), h(b"aaaa"), h(b"ffff"), h(b"dddd")];
        assert_eq!(verify(&good, &regions, &rows, 4), Ok(()));
        let mut bad = good.clone();
        bad[3] = h(b"eeee");
        assert_eq!(
            verify(&bad, &regions, &rows, 4),
            Err(BlockChecksumError::Mismatch {
                rank: 1,
                block: 1,
                row: 0,
                expected: h(b"eeee"),
                got: h(b"dddd"),
            })
        );
        assert_eq!(
            verify(&good[..3], &regions, &rows, 4),
            Err(BlockChecksumError::Missing {
                expected: 4,
                got: 3
            })
        );
        assert_eq!(
            verify(&[], &regions, &rows, 4),
            Err(BlockChecksumError::Missing {
                expected: 4,
                got: 0
            })
        );
    }

    /// Device memory without read-back (what an engine-registered device
    /// pointer is): `read_bytes` keeps the trait's refusal.
    #[derive(Debug)]
    struct NoReadBack(usize);

    impl BankMemory for NoReadBack {
        fn kind(&self) -> kv_bank::MemoryKind {
            kv_bank::MemoryKind::Cuda { ordinal: 0 }
        }
        fn len(&self) -> usize {
            self.0
        }
        fn base_addr(&self) -> u64 {
            0x1000
        }
        fn export_handle(&self) -> Option<kv_descriptor::ExportHandle> {
            None
        }
    }

    #[test]
    fn engine_blocks_are_hashed_in_block_major_order_unless_memory_cannot_be_read() {
        use kv_descriptor::{DType, KvLayout, KvRegionLayout, TensorOrder};
        // 2 layers, 1 head, head_dim 2, 1-byte elements, 2 tokens: 16-byte
        // blocks; vLLM [2, 3 blocks, 2, 1, 2] per layer = 24 bytes a layer.
        let g = KvLayout::new(2, 1, 2, DType::Fp8E4m3, 2, TensorOrder::BlockMajor, 1).unwrap();
        let l = KvRegionLayout::vllm_kv_first(g, 0, 0, 24, 3, 48).unwrap();
        let m = kv_transfer::HostBuffer::zeroed(48).unwrap();
        m.write_bytes(0, &(0..48).collect::<Vec<u8>>()).unwrap();
        let regions: Vec<Arc<dyn BankMemory>> = vec![Arc::new(m)];
        let layouts = [l];
        // Block 1 in block-major order: layer 0 K, V, then layer 1 K, V.
        let block1: Vec<u8> = [4..8, 16..20, 28..32, 40..44]
            .into_iter()
            .flatten()
            .collect();
        let h = xxhash_rust::xxh3::xxh3_64(&block1);
        assert_eq!(verify_engine(&[h], &regions, &layouts, &[1]), Ok(()));
        assert!(matches!(
            verify_engine(&[h], &regions, &layouts, &[2]),
            Err(BlockChecksumError::Mismatch { row: 2, .. })
        ));
        let device: Vec<Arc<dyn BankMemory>> = vec![Arc::new(NoReadBack(48))];
        match verify_engine(&[h], &device, &layouts, &[1]) {
            Err(BlockChecksumError::Unverifiable { reason }) => {
                assert!(reason.contains("read_bytes"), "{reason}")
            }
            other => panic!("expected Unverifiable, got {other:?}"),
        }
    }
}
