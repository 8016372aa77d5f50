//! The per-TP-rank memory a donor's NIXL agent registered, as its
//! [`super::DonorRecord`] advertises it (`nixl_rank_regions`): what a target
//! on another host needs to address NIXL READs without being told by hand.

use kv_descriptor::{BankManifest, MemoryLocation};
use serde::{Deserialize, Serialize};

use super::record::DonorRecordError;

/// NIXL memory segment type of a registered region (`DRAM_SEG` /
/// `VRAM_SEG` in NIXL's `nixl_mem_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NixlMemKind {
    /// Host memory (`DRAM_SEG`): a host part of the manifest.
    Dram,
    /// CUDA device memory (`VRAM_SEG`): a GPU part of the manifest.
    Vram,
}

/// One TP rank's bank memory as the donor's NIXL agent registered it: the
/// region a NIXL READ of rank `r` addresses in the donor's address space
/// (slot `s` starts at `base_addr + s * slot_bytes`).
///
/// Wire form (MessagePack map, named fields): `base_addr` (u64, the
/// registered virtual address in the donor process, not 0), `len` (u64,
/// bytes registered, at least the part's `region_bytes`), `mem` (`"dram"` /
/// `"vram"`, the part's location), `device_id` (u32, NIXL's `devId`: the
/// CUDA ordinal on the donor for `vram`, 0 for `dram`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlRankRegion {
    /// Registered virtual address in the donor process (not 0).
    pub base_addr: u64,
    /// Registered length in bytes.
    pub len: u64,
    /// Segment type.
    pub mem: NixlMemKind,
    /// NIXL device id: the donor's CUDA ordinal for VRAM, 0 for DRAM.
    pub device_id: u32,
}

impl NixlRankRegion {
    /// The region of `memory` (a donor bank rank's memory, registered with
    /// the donor's NIXL agent at its `base_addr`, `len` bytes long).
    pub fn of_memory(memory: &dyn kv_bank::BankMemory) -> Self {
        let (mem, device_id) = match memory.kind() {
            kv_bank::MemoryKind::Host => (NixlMemKind::Dram, 0),
            kv_bank::MemoryKind::Cuda { ordinal } => (NixlMemKind::Vram, ordinal),
        };
        Self {
            base_addr: memory.base_addr(),
            len: memory.len() as u64,
            mem,
            device_id,
        }
    }

    /// The kv-bank memory kind a NIXL READ of this region declares.
    pub fn memory_kind(&self) -> kv_bank::MemoryKind {
        match self.mem {
            NixlMemKind::Dram => kv_bank::MemoryKind::Host,
            NixlMemKind::Vram => kv_bank::MemoryKind::Cuda {
                ordinal: self.device_id,
            },
        }
    }
}

fn field(field: &'static str, reason: String) -> DonorRecordError {
    DonorRecordError::InvalidField { field, reason }
}

/// Checks `regions` against `manifest`: one per TP rank (rank order), each
/// non-null, at least its part's region long, of its part's location (and,
/// for VRAM, on its part's GPU ordinal).
///
/// # Errors
/// [`DonorRecordError::InvalidField`] naming `nixl_rank_regions` (count),
/// `nixl_rank_regions.base_addr`, `nixl_rank_regions.len`,
/// `nixl_rank_regions.mem` or `nixl_rank_regions.device_id`, with the rank.
pub(super) fn check(
    regions: &[NixlRankRegion],
    manifest: &BankManifest,
) -> Result<(), DonorRecordError> {
    if regions.len() != manifest.parts().len() {
        return Err(field(
            "nixl_rank_regions",
            format!(
                "{} regions for a bank of TP size {}",
                regions.len(),
                manifest.tp_size()
            ),
        ));
    }
    for (rank, (region, part)) in regions.iter().zip(manifest.parts()).enumerate() {
        if region.base_addr == 0 {
            return Err(field(
                "nixl_rank_regions.base_addr",
                format!("rank {rank}: 0 is not a registered address"),
            ));
        }
        if region.len < part.region_bytes() {
            return Err(field(
                "nixl_rank_regions.len",
                format!(
                    "rank {rank}: {} bytes registered, its part's region holds {}",
                    region.len,
                    part.region_bytes()
                ),
            ));
        }
        let want_device = match (part.location(), region.mem) {
            (MemoryLocation::Host { .. }, NixlMemKind::Dram) => 0,
            (MemoryLocation::Gpu(g), NixlMemKind::Vram) => g.ordinal,
            (loc, mem) => {
                return Err(field(
                    "nixl_rank_regions.mem",
                    format!("rank {rank}: {mem:?} for a part located on {loc:?}"),
                ))
            }
        };
        if region.device_id != want_device {
            return Err(field(
                "nixl_rank_regions.device_id",
                format!(
                    "rank {rank}: device {}, its part is on device {want_device}",
                    region.device_id
                ),
            ));
        }
    }
    Ok(())
}
