//! Who holds memory: the GPU it lives on and the engine incarnation that owns it.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::DescriptorError;

/// Longest host identifier (bytes) a GPU identity or a bank location carries.
pub const MAX_HOST_ID_BYTES: usize = 255;

/// Why `host_id` cannot name a host in a [`GpuIdentity`] or a bank's
/// [`crate::MemoryLocation`]: empty, longer than [`MAX_HOST_ID_BYTES`], or
/// holding a control character (a NUL or newline is a caller's mistake that
/// would travel in every manifest and directory record). `None` when it can.
/// One rule for every constructor, decoder and the Python binding.
///
/// ```
/// use kv_descriptor::host_id_refusal;
/// assert_eq!(host_id_refusal("node-a"), None);
/// assert!(host_id_refusal("").is_some());
/// assert!(host_id_refusal(&"h".repeat(256)).is_some());
/// assert!(host_id_refusal("a\0b").unwrap().contains("control character"));
/// ```
pub fn host_id_refusal(host_id: &str) -> Option<String> {
    if host_id.is_empty() || host_id.len() > MAX_HOST_ID_BYTES {
        return Some(format!(
            "must be 1..={MAX_HOST_ID_BYTES} bytes, got {}",
            host_id.len()
        ));
    }
    host_id
        .chars()
        .any(char::is_control)
        .then(|| format!("{host_id:?} holds a control character"))
}

/// NVLink fabric membership for multi-node NVLink (MNNVL): GPUs in the same
/// cluster and clique can map each other's memory through fabric handles.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NvlinkFabric {
    /// Fabric cluster UUID as reported by the driver (`nvmlGpuFabricInfo`).
    #[serde(with = "uuid::serde::hyphenated")]
    pub cluster_uuid: Uuid,
    /// Clique id inside the cluster.
    pub clique_id: u32,
}

/// Identity of one GPU: enough to decide "same GPU" and "same NVLink fabric".
///
/// ```
/// use kv_descriptor::GpuIdentity;
/// let g = GpuIdentity::new(uuid::Uuid::from_u128(7), 0, "node-a").unwrap();
/// assert!(g.same_gpu(&g.clone()));
/// assert!(GpuIdentity::new(uuid::Uuid::from_u128(7), 0, "").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuIdentity {
    /// Driver UUID of the GPU (`cuDeviceGetUuid`), unique across hosts.
    #[serde(with = "uuid::serde::hyphenated")]
    pub uuid: Uuid,
    /// CUDA device ordinal on its host (informative: UUID is authoritative).
    pub ordinal: u32,
    /// Host identifier (hostname or machine id), non-empty.
    pub host_id: String,
    /// NVLink fabric membership, when the GPU is part of an MNNVL domain.
    pub fabric: Option<NvlinkFabric>,
}

impl GpuIdentity {
    /// Builds an identity without fabric membership.
    ///
    /// # Errors
    /// `gpu.host_id` empty, or `gpu.uuid` nil.
    pub fn new(
        uuid: Uuid,
        ordinal: u32,
        host_id: impl Into<String>,
    ) -> Result<Self, DescriptorError> {
        let g = Self {
            uuid,
            ordinal,
            host_id: host_id.into(),
            fabric: None,
        };
        g.validate()?;
        Ok(g)
    }

    /// Checks the fields; used by every constructor and decoder.
    ///
    /// # Errors
    /// `gpu.host_id` refused by [`host_id_refusal`], `gpu.uuid` nil.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        if let Some(why) = host_id_refusal(&self.host_id) {
            return Err(DescriptorError::field("gpu.host_id", why));
        }
        if self.uuid.is_nil() {
            return Err(DescriptorError::field(
                "gpu.uuid",
                "must not be the nil UUID",
            ));
        }
        Ok(())
    }

    /// True when both name the same physical GPU (UUID equality).
    pub fn same_gpu(&self, other: &GpuIdentity) -> bool {
        self.uuid == other.uuid
    }
}

/// Serving role of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes prompts; the *target* of a decode-to-prefill fetch.
    Prefill,
    /// Generates tokens; the *donor* of a decode-to-prefill fetch.
    Decode,
}

/// Per-incarnation engine id. A restarted engine gets a new one, so stale
/// state of the old incarnation can never be mistaken for the new one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EngineId(#[serde(with = "uuid::serde::hyphenated")] pub Uuid);

impl EngineId {
    /// A fresh random (v4) id: the default for every engine start.
    pub fn fresh() -> Self {
        Self(Uuid::new_v4())
    }
}

impl std::fmt::Display for EngineId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Owner lifetime of a bank: which engine incarnation, in which role, and which
/// generation of its bank. The generation grows by one each time the engine
/// closes and reopens a bank; a closed generation is dead forever.
///
/// ```
/// use kv_descriptor::{OwnerLease, Role};
/// let a = OwnerLease::fresh(Role::Decode);
/// let b = a.next_generation();
/// assert_eq!(b.generation, a.generation + 1);
/// assert_eq!(a.engine_id, b.engine_id);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OwnerLease {
    /// Engine incarnation.
    pub engine_id: EngineId,
    /// Role of that engine.
    pub role: Role,
    /// Bank generation, starting at 1.
    pub generation: u64,
}

impl OwnerLease {
    /// New engine incarnation (fresh UUID), generation 1.
    pub fn fresh(role: Role) -> Self {
        Self {
            engine_id: EngineId::fresh(),
            role,
            generation: 1,
        }
    }

    /// Same incarnation, next generation.
    pub fn next_generation(&self) -> Self {
        Self {
            generation: self.generation + 1,
            ..*self
        }
    }

    pub(crate) fn validate(&self) -> Result<(), DescriptorError> {
        if self.engine_id.0.is_nil() {
            return Err(DescriptorError::field(
                "owner.engine_id",
                "must not be the nil UUID",
            ));
        }
        if self.generation == 0 {
            return Err(DescriptorError::field(
                "owner.generation",
                "must be at least 1, got 0",
            ));
        }
        Ok(())
    }
}
