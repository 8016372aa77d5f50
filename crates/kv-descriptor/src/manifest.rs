//! TP-N bank manifests: the parts of one logical bank, one per TP rank.

use serde::{Deserialize, Serialize};

use crate::{BankDescriptor, DescriptorError, ExportHandle, MemoryLocation, Wire};

/// Bound on a manifest's encoded size (MessagePack), in bytes.
pub const MAX_MANIFEST_BYTES: usize = 64 * 1024;

/// One logical retained bank over a TP group: `parts[r]` is rank `r`'s bank.
/// All parts share slot ids: logical slot `s` holds the same block on every rank.
///
/// Only [`BankManifest::new`] and the wire decoder make one. Rejected:
/// a part count other than `tp_size`; missing, duplicated or permuted ranks
/// (`parts[i].tp_rank != i`); two ranks on one GPU; two ranks exporting one
/// handle or shm object; mixed domains (some host, some GPU, or GPUs in
/// different NVLink fabrics); mixed export kinds; layouts, owners or slot
/// counts that differ between parts; an encoding larger than
/// [`MAX_MANIFEST_BYTES`] (the error carries the size in bytes).
///
/// ```
/// # use kv_descriptor::*;
/// # let layout = KvLayout::new(2, 2, 8, DType::F32, 4, TensorOrder::BlockMajor, 1).unwrap();
/// # let d = BankDescriptor::new(BankParts { layout, tp_rank: 0,
/// #   location: MemoryLocation::Host { host_id: "h".into() }, owner: OwnerLease::fresh(Role::Decode),
/// #   export: ExportHandle::HostShm { name: "/b".into() }, slot_count: 4,
/// #   slot_bytes: layout.rank_block_bytes() as u64 }).unwrap();
/// let m = BankManifest::new(vec![d]).unwrap();
/// assert_eq!(m.tp_size(), 1);
/// assert!(BankManifest::new(vec![]).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireManifest")]
pub struct BankManifest {
    parts: Vec<BankDescriptor>,
}

#[derive(Deserialize)]
struct WireManifest {
    parts: Vec<BankDescriptor>,
}

impl TryFrom<WireManifest> for BankManifest {
    type Error = DescriptorError;
    fn try_from(w: WireManifest) -> Result<Self, Self::Error> {
        BankManifest::new(w.parts)
    }
}

impl BankManifest {
    /// Validates the parts as one TP group, including the encoded-size bound.
    ///
    /// # Errors
    /// [`DescriptorError::InvalidField`] naming `manifest.parts[..]` fields, or
    /// [`DescriptorError::TooLarge`] with the encoded size.
    pub fn new(parts: Vec<BankDescriptor>) -> Result<Self, DescriptorError> {
        let Some(first) = parts.first() else {
            return Err(DescriptorError::field(
                "manifest.parts",
                "must hold one part per TP rank, got none",
            ));
        };
        let tp = first.layout().tp_size() as usize;
        if parts.len() != tp {
            return Err(DescriptorError::field(
                "manifest.parts",
                format!(
                    "tp_size is {tp} but {} parts were given (missing or extra ranks)",
                    parts.len()
                ),
            ));
        }
        let mut seen = vec![false; tp];
        for (i, p) in parts.iter().enumerate() {
            let r = p.tp_rank() as usize;
            // Layout first: equal layouts mean equal `tp_size`, so `r < tp` below
            // (a part from a larger TP group must not index past `seen`).
            if p.layout() != first.layout() {
                return Err(DescriptorError::field(
                    "manifest.parts.layout",
                    format!("part {i} (rank {r}) layout differs from rank 0"),
                ));
            }
            if seen[r] {
                return Err(DescriptorError::field(
                    "manifest.parts.tp_rank",
                    format!("rank {r} appears twice"),
                ));
            }
            seen[r] = true;
            if r != i {
                return Err(DescriptorError::field(
                    "manifest.parts.tp_rank",
                    format!("part {i} is rank {r}: parts must be in rank order"),
                ));
            }
            if p.owner() != first.owner() {
                return Err(DescriptorError::field(
                    "manifest.parts.owner",
                    format!("rank {r} owner lease differs from rank 0"),
                ));
            }
            if p.slot_count() != first.slot_count() {
                return Err(DescriptorError::field(
                    "manifest.parts.slot_count",
                    format!(
                        "rank {r} has {} slots, rank 0 has {}",
                        p.slot_count(),
                        first.slot_count()
                    ),
                ));
            }
            if p.location().is_gpu() != first.location().is_gpu() {
                return Err(DescriptorError::field(
                    "manifest.parts.location",
                    format!("mixed domains: rank {r} and rank 0 differ in host/GPU memory"),
                ));
            }
            if let (MemoryLocation::Gpu(g), MemoryLocation::Gpu(g0)) =
                (p.location(), first.location())
            {
                if g.fabric != g0.fabric {
                    return Err(DescriptorError::field(
                        "manifest.parts.location.fabric",
                        format!(
                            "mixed domains: rank {r} and rank 0 are in different NVLink fabrics"
                        ),
                    ));
                }
            }
            if std::mem::discriminant(p.export()) != std::mem::discriminant(first.export()) {
                return Err(DescriptorError::field(
                    "manifest.parts.export",
                    format!("mixed export kinds between rank {r} and rank 0"),
                ));
            }
            for q in &parts[..i] {
                if let (MemoryLocation::Gpu(g), MemoryLocation::Gpu(h)) =
                    (p.location(), q.location())
                {
                    if g.same_gpu(h) {
                        return Err(DescriptorError::field(
                            "manifest.parts.location.uuid",
                            format!(
                                "ranks {} and {r} claim the same GPU {}",
                                q.tp_rank(),
                                g.uuid
                            ),
                        ));
                    }
                }
                if same_region(p.export(), q.export()) {
                    return Err(DescriptorError::field(
                        "manifest.parts.export",
                        format!(
                            "ranks {} and {r} export the same memory handle",
                            q.tp_rank()
                        ),
                    ));
                }
            }
        }
        let m = Self { parts };
        let size = m.to_wire()?.len();
        if size > MAX_MANIFEST_BYTES {
            return Err(DescriptorError::TooLarge {
                what: "bank_manifest",
                size,
                limit: MAX_MANIFEST_BYTES,
            });
        }
        Ok(m)
    }

    /// Parts in rank order.
    pub fn parts(&self) -> &[BankDescriptor] {
        &self.parts
    }
    /// TP size (number of parts).
    pub fn tp_size(&self) -> u32 {
        self.parts.len() as u32
    }
    /// Shared slot count.
    pub fn slot_count(&self) -> u32 {
        self.parts[0].slot_count()
    }
    /// Owner lease shared by all parts.
    pub fn owner(&self) -> &crate::OwnerLease {
        self.parts[0].owner()
    }
    /// Layout shared by all parts.
    pub fn layout(&self) -> &crate::KvLayout {
        self.parts[0].layout()
    }
}

/// True when two exports name one memory region (same CUDA handle bytes or
/// same shm object). NIXL agents are not compared: one agent may register
/// several ranks' memory.
fn same_region(a: &ExportHandle, b: &ExportHandle) -> bool {
    match (a, b) {
        (ExportHandle::CudaIpc { handle: x }, ExportHandle::CudaIpc { handle: y })
        | (ExportHandle::CudaFabric { handle: x }, ExportHandle::CudaFabric { handle: y }) => {
            x == y
        }
        (ExportHandle::HostShm { name: x }, ExportHandle::HostShm { name: y }) => x == y,
        _ => false,
    }
}
