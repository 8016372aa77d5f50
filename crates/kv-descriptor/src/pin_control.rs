//! Messages of the donor control endpoint's source-pin protocol.
//!
//! A prefill target that reads a donor bank owned by another process asks
//! the donor to pin the hinted slots first ([`PinRequest`]), reads them while
//! the donor holds the pin ([`PinGrant`]), then releases it ([`PinRelease`],
//! acknowledged by [`PinReleased`]). A donor that will not pin answers
//! [`PinRefusal`] with a [`PinRefusalReason`].
//!
//! On a stream each message is one frame: a 4-byte big-endian body length
//! ([`PIN_FRAME_HEADER_BYTES`]) followed by that many bytes of MessagePack
//! (named fields, like every [`Wire`] type). A declared length of 0 or above
//! [`MAX_PIN_FRAME_BYTES`] is refused from the header alone, before any body
//! byte is buffered. [`encode_pin_frame`] writes a frame and
//! [`split_pin_frame`] cuts one off a buffer; the transport (a Unix socket
//! in `kv-router-glue`) lives elsewhere, this module does no I/O.
//!
//! ```
//! use kv_descriptor::*;
//! let req = PinRequest {
//!     request_id: 7,
//!     donor_engine_id: EngineId(uuid::Uuid::from_u128(1)),
//!     bank_generation: 1,
//!     layout_fingerprint: LayoutFingerprint(9),
//!     tp_size: 1,
//!     sequence_hashes: vec![SequenceHash(10), SequenceHash(11)],
//!     parts: vec![PinPart { tp_rank: 0, slot_ids: vec![3, 4] }],
//!     want_block_checksums: false,
//! };
//! let frame = encode_pin_frame(&PinClientMessage::Pin(req.clone())).unwrap();
//! let (body, used) = split_pin_frame(&frame).unwrap().expect("whole frame");
//! assert_eq!(used, frame.len());
//! assert_eq!(PinClientMessage::from_wire(body).unwrap(), PinClientMessage::Pin(req));
//! // A header declaring more than the limit is refused, naming the field.
//! let e = split_pin_frame(&[0xff, 0xff, 0xff, 0xff]).unwrap_err();
//! assert!(e.to_string().contains("pin_frame.length"));
//! ```

use serde::{Deserialize, Serialize};

use crate::wire::decode_bounded;
use crate::{
    DescriptorError, EngineId, FetchGpuHint, FetchPart, LayoutFingerprint, SequenceHash, Wire,
    MAX_HINT_BLOCKS, MAX_SLOTS,
};

/// Bytes of a frame's length prefix (big-endian `u32`).
pub const PIN_FRAME_HEADER_BYTES: usize = 4;

/// Largest frame body accepted or written (4 MiB).
///
/// A pin request costs about 9 bytes per block hash plus up to 5 bytes per
/// slot id per rank: 4 MiB holds 64k blocks (1M tokens at 16 tokens per
/// block) at TP8. Anything larger is hostile or corrupt and is refused from
/// the header, so a peer cannot make the reader buffer more than this.
pub const MAX_PIN_FRAME_BYTES: usize = 4 << 20;

/// One rank's slots in a [`PinRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinPart {
    /// TP rank, equal to the part's index in [`PinRequest::parts`].
    pub tp_rank: u32,
    /// Donor logical slot ids, one per entry of [`PinRequest::sequence_hashes`].
    pub slot_ids: Vec<u32>,
}

/// Target -> donor: pin these slots, which must hold these blocks.
///
/// Carries exactly what the donor needs to decide from its slot table alone:
/// the incarnation and generation the target's hint names, the layout, and
/// for every rank the slot holding each fetched block. `sequence_hashes`
/// lists only the blocks to pin (a hint's `sequence_hashes[fetch_from..]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRequest {
    /// Chosen by the target; echoed in the grant or refusal.
    pub request_id: u64,
    /// Donor engine incarnation the target expects.
    pub donor_engine_id: EngineId,
    /// Donor bank generation the target expects (at least 1).
    pub bank_generation: u64,
    /// Fingerprint of the layout the target expects.
    pub layout_fingerprint: LayoutFingerprint,
    /// TP size; equals `parts.len()`.
    pub tp_size: u32,
    /// Blocks to pin, in slot order (1..=[`MAX_HINT_BLOCKS`]).
    pub sequence_hashes: Vec<SequenceHash>,
    /// One part per rank, in rank order.
    pub parts: Vec<PinPart>,
    /// Ask the donor to put [`PinGrant::block_checksums`] in its grant (a
    /// target that reads by address, e.g. over NIXL, verifies the bytes it
    /// got against them). Omitted from the encoding when false, so a
    /// request without it encodes as before the field; a donor that
    /// predates it ignores it and grants without checksums.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub want_block_checksums: bool,
}

impl PinRequest {
    /// The request pinning what `hint` fetches (`sequence_hashes[fetch_from..]`).
    ///
    /// The hint should have passed [`FetchGpuHint::validate`]; a hint whose
    /// `fetch_from` is beyond its hashes gives an empty request, which
    /// [`PinRequest::validate`] refuses.
    pub fn for_hint(request_id: u64, hint: &FetchGpuHint) -> Self {
        Self {
            request_id,
            donor_engine_id: hint.donor_engine_id,
            bank_generation: hint.bank_generation,
            layout_fingerprint: hint.layout_fingerprint,
            tp_size: hint.tp_size,
            sequence_hashes: hint
                .sequence_hashes
                .get(hint.fetch_from as usize..)
                .unwrap_or_default()
                .to_vec(),
            parts: hint
                .parts
                .iter()
                .map(|p| PinPart {
                    tp_rank: p.tp_rank,
                    slot_ids: p.slot_ids.clone(),
                })
                .collect(),
            want_block_checksums: false,
        }
    }

    /// [`PinRequest::for_hint`] asking for [`PinGrant::block_checksums`].
    pub fn with_block_checksums(mut self) -> Self {
        self.want_block_checksums = true;
        self
    }

    /// The equivalent fetch hint (`fetch_from` 0, `expected_bytes` =
    /// slots x `rank_block_bytes`), for a donor whose pin check takes hints.
    pub fn to_hint(&self, rank_block_bytes: u64, endpoint: &str) -> FetchGpuHint {
        FetchGpuHint {
            donor_engine_id: self.donor_engine_id,
            bank_generation: self.bank_generation,
            layout_fingerprint: self.layout_fingerprint,
            tp_size: self.tp_size,
            sequence_hashes: self.sequence_hashes.clone(),
            fetch_from: 0,
            parts: self
                .parts
                .iter()
                .map(|p| FetchPart {
                    tp_rank: p.tp_rank,
                    slot_ids: p.slot_ids.clone(),
                    expected_bytes: (p.slot_ids.len() as u64).saturating_mul(rank_block_bytes),
                })
                .collect(),
            donor_control_endpoint: endpoint.to_owned(),
        }
    }

    /// Checks the request's shape (not whether the donor holds the blocks).
    ///
    /// # Errors
    /// [`DescriptorError::InvalidField`] naming `pin_request.bank_generation`
    /// (0), `pin_request.sequence_hashes` (empty or more than
    /// [`MAX_HINT_BLOCKS`]), `pin_request.parts` (count differs from a
    /// non-zero `tp_size`), `pin_request.parts.tp_rank` (out of order),
    /// `pin_request.parts.slot_ids` (count differs from the hashes, or an id
    /// at or above [`MAX_SLOTS`]).
    pub fn validate(&self) -> Result<(), DescriptorError> {
        if self.bank_generation == 0 {
            return Err(DescriptorError::field(
                "pin_request.bank_generation",
                "must be at least 1",
            ));
        }
        let n = self.sequence_hashes.len();
        if n == 0 || n > MAX_HINT_BLOCKS {
            return Err(DescriptorError::field(
                "pin_request.sequence_hashes",
                format!("must hold 1..={MAX_HINT_BLOCKS} hashes, got {n}"),
            ));
        }
        if self.tp_size == 0 || self.parts.len() != self.tp_size as usize {
            return Err(DescriptorError::field(
                "pin_request.parts",
                format!("tp_size {} but {} parts", self.tp_size, self.parts.len()),
            ));
        }
        for (i, p) in self.parts.iter().enumerate() {
            if p.tp_rank as usize != i {
                return Err(DescriptorError::field(
                    "pin_request.parts.tp_rank",
                    format!("part {i} is rank {}", p.tp_rank),
                ));
            }
            if p.slot_ids.len() != n {
                return Err(DescriptorError::field(
                    "pin_request.parts.slot_ids",
                    format!("rank {i} lists {} slots for {n} blocks", p.slot_ids.len()),
                ));
            }
            if let Some(&bad) = p.slot_ids.iter().find(|&&s| s >= MAX_SLOTS) {
                return Err(DescriptorError::field(
                    "pin_request.parts.slot_ids",
                    format!("rank {i} names slot {bad}, at or above {MAX_SLOTS}"),
                ));
            }
        }
        Ok(())
    }
}

/// Target -> donor: end pin `pin_id` (the id of its [`PinGrant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRelease {
    /// The grant's pin id (at least 1).
    pub pin_id: u64,
}

/// Donor -> target: the slots are pinned until released, until the
/// connection closes, or for at most `max_hold_ms`, whichever comes first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinGrant {
    /// The request's id.
    pub request_id: u64,
    /// Donor-chosen id (at least 1), unique per connection; echo it in [`PinRelease`].
    pub pin_id: u64,
    /// Milliseconds (from the grant) after which the donor drops the pin
    /// on its own; a release after that reports `expired`.
    pub max_hold_ms: u64,
    /// Only when the request set [`PinRequest::want_block_checksums`]
    /// (empty, and omitted from the encoding, otherwise): XXH3-64 (seed 0)
    /// of every pinned block's bytes as the donor holds them under this
    /// pin, rank-major: entry `r * n + i` (n = the request's block count)
    /// covers rank `r`'s `rank_block_bytes` at slot `parts[r].slot_ids[i]`.
    /// A donor that cannot read its memory grants with none; the target
    /// then treats the read as unverified. 9 bytes each on the wire: a
    /// grant stays within [`MAX_PIN_FRAME_BYTES`] up to ~460k blocks x TP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_checksums: Vec<u64>,
}

/// Why a donor refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinRefusalReason {
    /// The request names another engine incarnation or bank generation.
    StaleGeneration,
    /// A slot no longer holds the named block (evicted and reused, never
    /// stored, out of range, or excluded): the target's keys are missing.
    SlotReused,
    /// The bank generation is closed (closed, lease lapsed, or the donor's
    /// pin service is shutting down).
    BankClosed,
    /// The donor holds as many pins or connections as it allows.
    TooManyPins,
    /// The message did not decode or failed validation.
    Malformed,
    /// The request's layout or TP size differs from the bank's.
    Incompatible,
    /// A release named a pin id this connection does not hold.
    UnknownPin,
}

impl PinRefusalReason {
    /// The `snake_case` wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StaleGeneration => "stale_generation",
            Self::SlotReused => "slot_reused",
            Self::BankClosed => "bank_closed",
            Self::TooManyPins => "too_many_pins",
            Self::Malformed => "malformed",
            Self::Incompatible => "incompatible",
            Self::UnknownPin => "unknown_pin",
        }
    }
}

impl std::fmt::Display for PinRefusalReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Donor -> target: the request (or release) was refused; nothing is pinned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinRefusal {
    /// The refused request's id; 0 when the refusal answers no request (a
    /// malformed frame, a release, or a connection over the donor's limit).
    pub request_id: u64,
    /// Machine-readable reason.
    pub reason: PinRefusalReason,
    /// Human-readable detail (the donor's error text).
    pub detail: String,
}

/// Donor -> target: pin `pin_id` is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinReleased {
    /// The released pin.
    pub pin_id: u64,
    /// Microseconds the donor held it.
    pub held_us: u64,
    /// True when the donor had already dropped it at `max_hold_ms`: the
    /// slots were not protected for the whole time the target held it.
    pub expired: bool,
}

/// Every message a target sends on the control endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinClientMessage {
    /// Pin slots.
    Pin(PinRequest),
    /// Release a granted pin.
    Release(PinRelease),
}

impl PinClientMessage {
    /// Validates the message's shape.
    ///
    /// # Errors
    /// [`PinRequest::validate`]'s errors; `pin_release.pin_id` for id 0.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        match self {
            Self::Pin(r) => r.validate(),
            Self::Release(r) if r.pin_id == 0 => Err(DescriptorError::field(
                "pin_release.pin_id",
                "must be at least 1",
            )),
            Self::Release(_) => Ok(()),
        }
    }
}

/// Every message a donor sends on the control endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinDonorMessage {
    /// The request is pinned.
    Granted(PinGrant),
    /// The request or release was refused.
    Refused(PinRefusal),
    /// A release was carried out.
    Released(PinReleased),
}

impl PinDonorMessage {
    /// Validates the message's shape.
    ///
    /// # Errors
    /// `pin_grant.pin_id` or `pin_released.pin_id` for id 0.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        match self {
            Self::Granted(g) if g.pin_id == 0 => Err(DescriptorError::field(
                "pin_grant.pin_id",
                "must be at least 1",
            )),
            Self::Released(r) if r.pin_id == 0 => Err(DescriptorError::field(
                "pin_released.pin_id",
                "must be at least 1",
            )),
            _ => Ok(()),
        }
    }
}

impl Wire for PinClientMessage {
    const WHAT: &'static str = "pin_client_message";

    /// Decodes, then runs [`PinClientMessage::validate`].
    fn from_wire(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let m: Self = decode_bounded(Self::WHAT, bytes)?;
        m.validate()?;
        Ok(m)
    }
}

impl Wire for PinDonorMessage {
    const WHAT: &'static str = "pin_donor_message";

    /// Decodes, then runs [`PinDonorMessage::validate`].
    fn from_wire(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let m: Self = decode_bounded(Self::WHAT, bytes)?;
        m.validate()?;
        Ok(m)
    }
}

/// Encodes `msg` as one frame: length prefix, then its MessagePack body.
///
/// # Errors
/// The encoder's error; [`DescriptorError::InvalidField`] naming
/// `pin_frame.length` when the body exceeds [`MAX_PIN_FRAME_BYTES`].
pub fn encode_pin_frame<T: Wire>(msg: &T) -> Result<Vec<u8>, DescriptorError> {
    let body = msg.to_wire()?;
    check_frame_len(body.len())?;
    let mut frame = Vec::with_capacity(PIN_FRAME_HEADER_BYTES + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// The body length a frame header declares.
///
/// # Errors
/// [`DescriptorError::InvalidField`] naming `pin_frame.length` when it is 0
/// or above [`MAX_PIN_FRAME_BYTES`].
pub fn pin_frame_len(header: [u8; PIN_FRAME_HEADER_BYTES]) -> Result<usize, DescriptorError> {
    let len = u32::from_be_bytes(header) as usize;
    check_frame_len(len)?;
    Ok(len)
}

/// Cuts the first frame off `buf`: `Ok(Some((body, consumed)))` when a whole
/// frame is there, `Ok(None)` when more bytes are needed.
///
/// # Errors
/// [`pin_frame_len`]'s error as soon as the header is complete, so a
/// hostile length is refused before its body is buffered.
pub fn split_pin_frame(buf: &[u8]) -> Result<Option<(&[u8], usize)>, DescriptorError> {
    let Some(header) = buf.first_chunk::<PIN_FRAME_HEADER_BYTES>() else {
        return Ok(None);
    };
    let len = pin_frame_len(*header)?;
    let end = PIN_FRAME_HEADER_BYTES + len;
    Ok(buf.get(PIN_FRAME_HEADER_BYTES..end).map(|body| (body, end)))
}

fn check_frame_len(len: usize) -> Result<(), DescriptorError> {
    if len == 0 {
        return Err(DescriptorError::field(
            "pin_frame.length",
            "an empty frame carries no message",
        ));
    }
    if len > MAX_PIN_FRAME_BYTES {
        return Err(DescriptorError::field(
            "pin_frame.length",
            format!("declares {len} bytes, above the limit of {MAX_PIN_FRAME_BYTES}"),
        ));
    }
    Ok(())
}
