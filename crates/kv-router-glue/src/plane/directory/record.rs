//! The directory entry a donor publishes: [`DonorRecord`], MessagePack with
//! named fields through [`kv_descriptor::Wire`] (`WHAT` = `donor_record`).

// The same metadata bound as a bank descriptor's NIXL export.
use kv_descriptor::{BankManifest, DescriptorError, EngineId, Wire, MAX_NIXL_METADATA_BYTES};
use serde::{Deserialize, Serialize};

use super::NixlRankRegion;

/// Longest accepted encoded [`DonorRecord`], in bytes. A TP8 manifest is a
/// few KiB; the NIXL agent metadata dominates.
pub const MAX_DONOR_RECORD_BYTES: usize = 256 * 1024;
/// Longest accepted worker key, pin endpoint or subject, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest accepted NIXL agent name, in bytes (the bound of a bank
/// descriptor's `ExportHandle::NixlAgent::agent_name`).
pub const MAX_NIXL_AGENT_NAME_BYTES: usize = 255;

/// One donor's bank as the directory serves it, keyed by `engine_id`.
///
/// Wire form (MessagePack map, named fields, in this order): `engine_id`
/// (hyphenated UUID string), `worker_key` (string, 1..=256 bytes),
/// `generation` (u64, equal to the manifest owner's), `manifest`
/// ([`BankManifest`] wire form), `pin_endpoint` (string, 1..=256 bytes,
/// e.g. `unix:/run/kv/pin.sock`), `nixl_agent_name` (string, 1..=
/// [`MAX_NIXL_AGENT_NAME_BYTES`] bytes, absent when none),
/// `nixl_agent_metadata` (bin, at most [`MAX_NIXL_METADATA_BYTES`], absent
/// when none; present exactly when the name is), `nixl_rank_regions`
/// (array of [`NixlRankRegion`], one per TP rank in rank order, absent when
/// none; only with a NIXL agent: the memory that agent registered, so a
/// target addresses its READs from the record alone), `lease_expires_unix_ms`
/// and `published_unix_ms` (u64, Unix epoch milliseconds; expiry after
/// publish). The whole encoding is at most [`MAX_DONOR_RECORD_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireDonorRecord")]
pub struct DonorRecord {
    engine_id: EngineId,
    worker_key: String,
    generation: u64,
    manifest: BankManifest,
    pin_endpoint: String,
    // Skipped when absent: a record without NIXL encodes as before the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nixl_agent_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "opt_bytes")]
    nixl_agent_metadata: Option<Vec<u8>>,
    // Skipped when absent: a record of a donor that predates the field
    // encodes (and decodes) as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nixl_rank_regions: Option<Vec<NixlRankRegion>>,
    lease_expires_unix_ms: u64,
    published_unix_ms: u64,
}

#[derive(Deserialize)]
struct WireDonorRecord {
    engine_id: EngineId,
    worker_key: String,
    generation: u64,
    manifest: BankManifest,
    pin_endpoint: String,
    #[serde(default)]
    nixl_agent_name: Option<String>,
    #[serde(default, with = "opt_bytes")]
    nixl_agent_metadata: Option<Vec<u8>>,
    #[serde(default)]
    nixl_rank_regions: Option<Vec<NixlRankRegion>>,
    lease_expires_unix_ms: u64,
    published_unix_ms: u64,
}

/// `Option<Vec<u8>>` as MessagePack bin (not an array of integers).
mod opt_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_some(serde_bytes::Bytes::new(b)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<serde_bytes::ByteBuf>::deserialize(d)?.map(|b| b.into_vec()))
    }
}

/// Why a [`DonorRecord`] is refused, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DonorRecordError {
    /// A field is out of range.
    #[error("invalid `donor_record.{field}`: {reason}")]
    InvalidField {
        /// The field (`worker_key`, `generation`, ...).
        field: &'static str,
        /// What is wrong, with the value seen.
        reason: String,
    },
    /// The encoding exceeds [`MAX_DONOR_RECORD_BYTES`].
    #[error("`donor_record` encodes to {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// Encoded size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// Bytes that do not decode (the decoder's message, which names the
    /// field and already starts with "cannot decode `donor_record`").
    #[error("{0}")]
    Decode(DescriptorError),
}

impl TryFrom<WireDonorRecord> for DonorRecord {
    type Error = DonorRecordError;
    fn try_from(w: WireDonorRecord) -> Result<Self, Self::Error> {
        DonorRecord::new(DonorRecordParts {
            worker_key: w.worker_key,
            manifest: w.manifest,
            pin_endpoint: w.pin_endpoint,
            nixl_agent_name: w.nixl_agent_name,
            nixl_agent_metadata: w.nixl_agent_metadata,
            nixl_rank_regions: w.nixl_rank_regions,
            lease_expires_unix_ms: w.lease_expires_unix_ms,
            published_unix_ms: w.published_unix_ms,
        })
        .and_then(|r| {
            // Engine and generation are carried redundantly so a reader can
            // key and order entries without parsing the manifest; they must agree.
            if r.engine_id != w.engine_id {
                return Err(field(
                    "engine_id",
                    format!(
                        "{} is not the manifest owner {}",
                        w.engine_id.0, r.engine_id.0
                    ),
                ));
            }
            if r.generation != w.generation {
                return Err(field(
                    "generation",
                    format!(
                        "{} is not the manifest generation {}",
                        w.generation, r.generation
                    ),
                ));
            }
            Ok(r)
        })
    }
}

fn field(field: &'static str, reason: impl Into<String>) -> DonorRecordError {
    DonorRecordError::InvalidField {
        field,
        reason: reason.into(),
    }
}

fn check_name(name: &'static str, v: &str) -> Result<(), DonorRecordError> {
    if v.is_empty() || v.len() > MAX_NAME_BYTES {
        return Err(field(
            name,
            format!("must be 1..={MAX_NAME_BYTES} bytes, got {}", v.len()),
        ));
    }
    Ok(())
}

/// What a donor fills in to build a [`DonorRecord`]; engine id and
/// generation come from the manifest's owner.
#[derive(Debug, Clone)]
pub struct DonorRecordParts {
    /// Stable name of the worker across incarnations.
    pub worker_key: String,
    /// The bank's current manifest.
    pub manifest: BankManifest,
    /// Where targets reach the donor's pin service.
    pub pin_endpoint: String,
    /// The donor's NIXL agent name (`NixlAgent::name`), when it serves NIXL
    /// reads; given exactly when `nixl_agent_metadata` is.
    pub nixl_agent_name: Option<String>,
    /// The donor's NIXL agent metadata (`NixlAgent::metadata`, the
    /// `getLocalMD` bytes a target loads with `load_remote`), when it serves
    /// NIXL reads.
    pub nixl_agent_metadata: Option<Vec<u8>>,
    /// Rank `r`'s bank memory as that NIXL agent registered it, one entry
    /// per TP rank; only with `nixl_agent_name`. `None` from a donor that
    /// does not publish it: a target then cannot read it over NIXL.
    pub nixl_rank_regions: Option<Vec<NixlRankRegion>>,
    /// Lease expiry, Unix epoch ms: past it the entry is never used.
    pub lease_expires_unix_ms: u64,
    /// When the donor published this, Unix epoch ms.
    pub published_unix_ms: u64,
}

impl DonorRecord {
    /// Validates and builds a record.
    ///
    /// # Errors
    /// [`DonorRecordError::InvalidField`] naming `worker_key`,
    /// `pin_endpoint`, `nixl_agent_name` (empty, too long, or given without
    /// metadata), `nixl_agent_metadata` (over the bound, or given without a
    /// name), `nixl_rank_regions` (given without a NIXL agent, or not one
    /// per TP rank) or one of its fields (`nixl_rank_regions.base_addr`,
    /// `.len`, `.mem`, `.device_id`: not the manifest part's memory), or
    /// `lease_expires_unix_ms`;
    /// [`DonorRecordError::TooLarge`] past [`MAX_DONOR_RECORD_BYTES`].
    pub fn new(p: DonorRecordParts) -> Result<Self, DonorRecordError> {
        check_name("worker_key", &p.worker_key)?;
        check_name("pin_endpoint", &p.pin_endpoint)?;
        match (&p.nixl_agent_name, &p.nixl_agent_metadata) {
            (Some(n), Some(_)) => {
                if n.is_empty() || n.len() > MAX_NIXL_AGENT_NAME_BYTES {
                    return Err(field(
                        "nixl_agent_name",
                        format!(
                            "must be 1..={MAX_NIXL_AGENT_NAME_BYTES} bytes, got {}",
                            n.len()
                        ),
                    ));
                }
            }
            (Some(_), None) => {
                return Err(field(
                    "nixl_agent_metadata",
                    "absent while nixl_agent_name is given (a target cannot load the agent)",
                ))
            }
            (None, Some(_)) => return Err(field(
                "nixl_agent_name",
                "absent while nixl_agent_metadata is given (a target cannot check what it loaded)",
            )),
            (None, None) => {}
        }
        if let Some(m) = &p.nixl_agent_metadata {
            if m.len() > MAX_NIXL_METADATA_BYTES {
                return Err(field(
                    "nixl_agent_metadata",
                    format!(
                        "{} bytes, above the limit of {MAX_NIXL_METADATA_BYTES}",
                        m.len()
                    ),
                ));
            }
        }
        if let Some(regions) = &p.nixl_rank_regions {
            if p.nixl_agent_name.is_none() {
                return Err(field(
                    "nixl_rank_regions",
                    "given without nixl_agent_name (no agent registered them)",
                ));
            }
            super::nixl_regions::check(regions, &p.manifest)?;
        }
        if p.lease_expires_unix_ms <= p.published_unix_ms {
            return Err(field(
                "lease_expires_unix_ms",
                format!(
                    "{} is not after published_unix_ms {}",
                    p.lease_expires_unix_ms, p.published_unix_ms
                ),
            ));
        }
        let owner = *p.manifest.owner();
        let r = Self {
            engine_id: owner.engine_id,
            worker_key: p.worker_key,
            generation: owner.generation,
            manifest: p.manifest,
            pin_endpoint: p.pin_endpoint,
            nixl_agent_name: p.nixl_agent_name,
            nixl_agent_metadata: p.nixl_agent_metadata,
            nixl_rank_regions: p.nixl_rank_regions,
            lease_expires_unix_ms: p.lease_expires_unix_ms,
            published_unix_ms: p.published_unix_ms,
        };
        let size = rmp_serde::to_vec_named(&r)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        if size > MAX_DONOR_RECORD_BYTES {
            return Err(DonorRecordError::TooLarge {
                size,
                limit: MAX_DONOR_RECORD_BYTES,
            });
        }
        Ok(r)
    }

    /// Decodes and validates bytes from the directory, refusing oversized
    /// input before decoding it.
    ///
    /// # Errors
    /// [`DonorRecordError::TooLarge`], or [`DonorRecordError::Decode`] whose
    /// message names the refused field.
    pub fn decode(bytes: &[u8]) -> Result<Self, DonorRecordError> {
        if bytes.len() > MAX_DONOR_RECORD_BYTES {
            return Err(DonorRecordError::TooLarge {
                size: bytes.len(),
                limit: MAX_DONOR_RECORD_BYTES,
            });
        }
        Self::from_wire(bytes).map_err(DonorRecordError::Decode)
    }

    /// The donor engine incarnation (the directory key).
    pub fn engine_id(&self) -> EngineId {
        self.engine_id
    }
    /// The worker's stable key.
    pub fn worker_key(&self) -> &str {
        &self.worker_key
    }
    /// Bank generation (starts at 1; a newer one supersedes).
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// The bank's manifest.
    pub fn manifest(&self) -> &BankManifest {
        &self.manifest
    }
    /// The donor's pin endpoint.
    pub fn pin_endpoint(&self) -> &str {
        &self.pin_endpoint
    }
    /// NIXL agent metadata, when published.
    pub fn nixl_agent_metadata(&self) -> Option<&[u8]> {
        self.nixl_agent_metadata.as_deref()
    }
    /// NIXL agent name, when published (exactly when the metadata is).
    pub fn nixl_agent_name(&self) -> Option<&str> {
        self.nixl_agent_name.as_deref()
    }
    /// The memory the donor's NIXL agent registered, one region per TP rank
    /// (rank order), when published (only with a NIXL agent).
    pub fn nixl_rank_regions(&self) -> Option<&[NixlRankRegion]> {
        self.nixl_rank_regions.as_deref()
    }
    /// The parts this record was built from (to rebuild it with a change,
    /// e.g. a renewed lease).
    pub fn to_parts(&self) -> DonorRecordParts {
        DonorRecordParts {
            worker_key: self.worker_key.clone(),
            manifest: self.manifest.clone(),
            pin_endpoint: self.pin_endpoint.clone(),
            nixl_agent_name: self.nixl_agent_name.clone(),
            nixl_agent_metadata: self.nixl_agent_metadata.clone(),
            nixl_rank_regions: self.nixl_rank_regions.clone(),
            lease_expires_unix_ms: self.lease_expires_unix_ms,
            published_unix_ms: self.published_unix_ms,
        }
    }
    /// Lease expiry, Unix epoch ms.
    pub fn lease_expires_unix_ms(&self) -> u64 {
        self.lease_expires_unix_ms
    }
    /// Publish time, Unix epoch ms.
    pub fn published_unix_ms(&self) -> u64 {
        self.published_unix_ms
    }
}

impl Wire for DonorRecord {
    const WHAT: &'static str = "donor_record";
}
