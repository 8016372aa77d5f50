//! Bank descriptors: one rank's retained bank, bound atomically to its layout,
//! memory location, owner lease and export handle.

use serde::{Deserialize, Serialize};

use crate::{DescriptorError, GpuIdentity, KvLayout, OwnerLease};

/// Bytes in a CUDA IPC memory handle (`CUipcMemHandle`) and in a CUDA fabric
/// handle (`CUmemFabricHandle`).
pub const CUDA_HANDLE_BYTES: usize = 64;

/// Where a bank's memory lives. The domain of a TP group must be uniform.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryLocation {
    /// Host memory shareable between processes on `host_id` (CPU profile).
    Host {
        /// Host identifier, non-empty.
        host_id: String,
    },
    /// CUDA device memory on one GPU.
    Gpu(GpuIdentity),
}

impl MemoryLocation {
    /// True for [`MemoryLocation::Gpu`].
    pub fn is_gpu(&self) -> bool {
        matches!(self, MemoryLocation::Gpu(_))
    }
    /// Host the memory is attached to.
    pub fn host_id(&self) -> &str {
        match self {
            MemoryLocation::Host { host_id } => host_id,
            MemoryLocation::Gpu(g) => &g.host_id,
        }
    }
}

/// How another process reaches the bank's memory.
///
/// Byte fields travel as MessagePack `bin` (one byte per byte), not as arrays
/// of integers, so that NIXL metadata near [`MAX_NIXL_METADATA_BYTES`] still
/// fits a [`crate::BankManifest`]; decoders also accept the array form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExportHandle {
    /// `cuIpcGetMemHandle` bytes (64) of the bank's single device allocation.
    /// Same-host only; the default GPU export.
    CudaIpc {
        /// The 64 handle bytes.
        #[serde(with = "serde_bytes")]
        handle: Vec<u8>,
    },
    /// `CU_MEM_HANDLE_TYPE_FABRIC` handle bytes (64), for multi-node NVLink.
    CudaFabric {
        /// The 64 handle bytes.
        #[serde(with = "serde_bytes")]
        handle: Vec<u8>,
    },
    /// POSIX shared-memory object name (`/name`), host banks only.
    HostShm {
        /// Name passed to `shm_open`, starting with `/`, at most 255 bytes.
        name: String,
    },
    /// A NIXL agent that registered the bank's memory; `metadata` is the
    /// agent's serialized metadata (`getLocalMD`), at most 48 KiB.
    NixlAgent {
        /// NIXL agent name.
        agent_name: String,
        /// Opaque agent metadata.
        #[serde(with = "serde_bytes")]
        metadata: Vec<u8>,
    },
}

/// Largest NIXL agent metadata a descriptor may carry (keeps TP8 manifests under 64 KiB
/// only when smaller; the manifest bound is checked separately).
pub const MAX_NIXL_METADATA_BYTES: usize = 48 * 1024;

impl ExportHandle {
    fn validate(&self, location: &MemoryLocation) -> Result<(), DescriptorError> {
        match self {
            ExportHandle::CudaIpc { handle } | ExportHandle::CudaFabric { handle } => {
                if handle.len() != CUDA_HANDLE_BYTES {
                    return Err(DescriptorError::field(
                        "export.handle",
                        format!("must be {CUDA_HANDLE_BYTES} bytes, got {}", handle.len()),
                    ));
                }
                if !location.is_gpu() {
                    return Err(DescriptorError::field(
                        "export",
                        "a CUDA handle needs a GPU location, got host",
                    ));
                }
            }
            ExportHandle::HostShm { name } => {
                if !name.starts_with('/')
                    || name.len() < 2
                    || name.len() > 255
                    || name[1..].contains('/')
                {
                    return Err(DescriptorError::field(
                        "export.name",
                        format!("must be `/` followed by 1..=254 bytes without `/`, got {name:?}"),
                    ));
                }
                if location.is_gpu() {
                    return Err(DescriptorError::field(
                        "export",
                        "a host shared-memory name needs a host location, got GPU",
                    ));
                }
            }
            ExportHandle::NixlAgent {
                agent_name,
                metadata,
            } => {
                if agent_name.is_empty() || agent_name.len() > 255 {
                    return Err(DescriptorError::field(
                        "export.agent_name",
                        format!("must be 1..=255 bytes, got {}", agent_name.len()),
                    ));
                }
                if metadata.len() > MAX_NIXL_METADATA_BYTES {
                    return Err(DescriptorError::field(
                        "export.metadata",
                        format!("{} bytes, above {MAX_NIXL_METADATA_BYTES}", metadata.len()),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Content of a [`BankDescriptor`] before validation (and its wire form minus checksum).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BankParts {
    /// Geometry of the whole TP group.
    pub layout: KvLayout,
    /// This bank's TP rank, `< layout.tp_size()`.
    pub tp_rank: u32,
    /// Where the memory lives.
    pub location: MemoryLocation,
    /// Owner incarnation, role and bank generation.
    pub owner: OwnerLease,
    /// How to reach the memory.
    pub export: ExportHandle,
    /// Number of slots; slot ids `0..slot_count` are shared by all ranks.
    pub slot_count: u32,
    /// Bytes of one slot; must equal `layout.rank_block_bytes()`.
    pub slot_bytes: u64,
}

/// One rank's retained bank, as published to other processes.
///
/// Immutable; only [`BankDescriptor::new`] and the wire decoder make one, and
/// both validate every field. The wire form carries an XXH3-64 checksum of the
/// content (seed 1337 over the MessagePack of [`BankParts`]) that the decoder
/// recomputes, so a corrupted or edited descriptor is refused.
///
/// Slot `s` occupies bytes `[s * slot_bytes, (s + 1) * slot_bytes)` of the
/// exported region; the block-major order makes each slot one contiguous run.
///
/// ```
/// use kv_descriptor::*;
/// let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// let d = BankDescriptor::new(BankParts {
///     layout,
///     tp_rank: 0,
///     location: MemoryLocation::Host { host_id: "h".into() },
///     owner: OwnerLease::fresh(Role::Decode),
///     export: ExportHandle::HostShm { name: "/kvbank-1".into() },
///     slot_count: 16,
///     slot_bytes: layout.rank_block_bytes() as u64,
/// }).unwrap();
/// let bytes = d.to_wire().unwrap();
/// assert_eq!(BankDescriptor::from_wire(&bytes).unwrap(), d);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "WireBankDescriptor", into = "WireBankDescriptor")]
pub struct BankDescriptor {
    parts: BankParts,
    checksum: u64,
}

#[derive(Serialize, Deserialize)]
struct WireBankDescriptor {
    parts: BankParts,
    checksum: u64,
}

impl From<BankDescriptor> for WireBankDescriptor {
    fn from(d: BankDescriptor) -> Self {
        Self {
            parts: d.parts,
            checksum: d.checksum,
        }
    }
}

impl TryFrom<WireBankDescriptor> for BankDescriptor {
    type Error = DescriptorError;
    fn try_from(w: WireBankDescriptor) -> Result<Self, Self::Error> {
        let d = BankDescriptor::new(w.parts)?;
        if d.checksum != w.checksum {
            return Err(DescriptorError::Checksum {
                what: "bank_descriptor",
                stored: w.checksum,
                computed: d.checksum,
            });
        }
        Ok(d)
    }
}

/// Most slots one bank may have (2^24): bounds every slot-id check.
pub const MAX_SLOTS: u32 = 1 << 24;

impl BankDescriptor {
    /// Validates `parts` and seals them with a checksum.
    ///
    /// # Errors
    /// [`DescriptorError::InvalidField`] naming the field: `tp_rank` out of
    /// range, `slot_count` 0 or above [`MAX_SLOTS`], `slot_bytes` not equal to
    /// the layout's rank block bytes, an export handle that does not fit the
    /// location (CUDA handle on host memory, shm name on a GPU), bad handle
    /// length, invalid GPU identity or owner lease.
    pub fn new(parts: BankParts) -> Result<Self, DescriptorError> {
        if parts.tp_rank >= parts.layout.tp_size() {
            return Err(DescriptorError::field(
                "tp_rank",
                format!(
                    "{} is not below tp_size {}",
                    parts.tp_rank,
                    parts.layout.tp_size()
                ),
            ));
        }
        if parts.slot_count == 0 || parts.slot_count > MAX_SLOTS {
            return Err(DescriptorError::field(
                "slot_count",
                format!("must be in 1..={MAX_SLOTS}, got {}", parts.slot_count),
            ));
        }
        let expect = parts.layout.rank_block_bytes() as u64;
        if parts.slot_bytes != expect {
            return Err(DescriptorError::field(
                "slot_bytes",
                format!(
                    "{} does not match the layout's rank block bytes {expect}",
                    parts.slot_bytes
                ),
            ));
        }
        match &parts.location {
            MemoryLocation::Host { host_id } => {
                if let Some(why) = crate::host_id_refusal(host_id) {
                    return Err(DescriptorError::field("location.host_id", why));
                }
            }
            MemoryLocation::Gpu(g) => g.validate()?,
        }
        parts.owner.validate()?;
        parts.export.validate(&parts.location)?;
        let checksum = checksum_of(&parts)?;
        Ok(Self { parts, checksum })
    }

    /// The validated content.
    pub fn parts(&self) -> &BankParts {
        &self.parts
    }
    /// Geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.parts.layout
    }
    /// TP rank of this part.
    pub fn tp_rank(&self) -> u32 {
        self.parts.tp_rank
    }
    /// Memory location.
    pub fn location(&self) -> &MemoryLocation {
        &self.parts.location
    }
    /// Owner lease.
    pub fn owner(&self) -> &OwnerLease {
        &self.parts.owner
    }
    /// Export handle.
    pub fn export(&self) -> &ExportHandle {
        &self.parts.export
    }
    /// Slot count.
    pub fn slot_count(&self) -> u32 {
        self.parts.slot_count
    }
    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.parts.slot_bytes
    }
    /// Total bytes of the exported region: `slot_count x slot_bytes`.
    pub fn region_bytes(&self) -> u64 {
        u64::from(self.parts.slot_count) * self.parts.slot_bytes
    }
    /// The stored checksum.
    pub fn checksum(&self) -> u64 {
        self.checksum
    }
}

fn checksum_of(parts: &BankParts) -> Result<u64, DescriptorError> {
    let bytes = rmp_serde::to_vec_named(parts).map_err(|e| DescriptorError::Encode {
        what: "bank_descriptor",
        reason: e.to_string(),
    })?;
    Ok(xxhash_rust::xxh3::xxh3_64_with_seed(
        &bytes,
        crate::XXH3_SEED,
    ))
}
