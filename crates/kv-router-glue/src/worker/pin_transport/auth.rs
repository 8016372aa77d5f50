//! Authentication of a TCP pin connection: an HMAC-SHA256 challenge-response
//! over a pre-shared key (`kv.pin-auth@1`), run before the donor reads any
//! pin frame, and mutual, so that a target also knows the donor it trusts
//! with its pin holds the key.
//!
//! Exchange (fixed sizes, so every read is bounded; all within the donor's
//! `io_timeout` / the target's reply timeout as one deadline):
//! 1. donor -> target: [`AUTH_MAGIC`] (8 bytes) + donor nonce (32 random bytes);
//! 2. target -> donor: target nonce (32) + `HMAC(key, "kv.pin-auth@1 target" || donor nonce || target nonce)` (32);
//! 3. donor -> target: [`STATUS_REFUSED`] and close, or [`STATUS_OK`] +
//!    `HMAC(key, "kv.pin-auth@1 donor" || donor nonce || target nonce)` (32).
//!
//! MACs are compared in constant time (`hmac`'s `verify_slice`). Nonces come
//! from the OS RNG, so a recorded exchange cannot be replayed to another
//! connection. The key authenticates only: frames after the exchange are
//! neither encrypted nor MACed (they carry slot ids and pin ids, no KV
//! bytes); a network path where an attacker can inject into an established
//! TCP stream needs TLS or a private network (docs/security.md).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::PinStream;

/// First bytes a donor sends on a TCP pin connection (names the exchange
/// and its version).
pub const AUTH_MAGIC: [u8; 8] = *b"kvpinA1\n";

/// Donor status byte: the target's proof verified, the donor's follows.
pub const STATUS_OK: u8 = 1;

/// Donor status byte: the target's proof did not verify; the donor closes.
pub const STATUS_REFUSED: u8 = 0;

/// Shortest accepted pre-shared key, bytes (the HMAC-SHA256 output size:
/// a shorter key gives less than 256 bits of security).
pub const MIN_KEY_BYTES: usize = 32;

const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;

/// Why a pin connection's authentication failed, or a key is unusable.
#[derive(Debug, thiserror::Error)]
pub enum PinAuthError {
    /// The key file could not be read.
    #[error("pin auth `key_file` {path}: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The key file is readable or writable by group or others (mode shown
    /// in octal): any local user who reads it could authenticate as a
    /// target (pin donor slots) or pose as a donor.
    #[error("pin auth `key_file` {path}: mode {mode:o} grants group/other access; chmod 600")]
    KeyFileMode {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key (file content without trailing whitespace) is shorter than
    /// [`MIN_KEY_BYTES`].
    #[error("pin auth `key`: {len} bytes, at least {min} needed", min = MIN_KEY_BYTES)]
    KeyLength {
        /// Bytes given.
        len: usize,
    },
    /// A `tcp:` endpoint was used without a key (TCP pins require one).
    #[error("pin endpoint {endpoint}: TCP requires a pre-shared key and none is configured")]
    KeyMissing {
        /// The endpoint.
        endpoint: String,
    },
    /// The donor refused this side's proof (wrong key), or, on the donor,
    /// the target's proof did not verify.
    #[error("pin auth refused: the peer's proof does not verify (wrong or missing key)")]
    Refused,
    /// The donor's proof did not verify: it does not hold the key.
    #[error("pin auth: the donor's proof does not verify (it does not hold the key)")]
    DonorProof,
    /// The peer does not speak `kv.pin-auth@1` (bad magic or status byte).
    #[error("pin auth handshake: {detail}")]
    Handshake {
        /// What was received instead.
        detail: String,
    },
    /// Reading or writing the exchange failed or timed out (`op` names the step).
    #[error("pin auth {op}: {source}")]
    Io {
        /// `challenge`, `proof` or `verdict`.
        op: &'static str,
        /// OS error (`TimedOut` / `WouldBlock` when the deadline passed).
        #[source]
        source: std::io::Error,
    },
}

/// A pre-shared key of the TCP pin protocol. `Debug` never prints it.
#[derive(Clone)]
pub struct PinAuthKey {
    key: Vec<u8>,
}

impl std::fmt::Debug for PinAuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinAuthKey({} bytes)", self.key.len())
    }
}

impl PinAuthKey {
    /// A key from its bytes.
    ///
    /// # Errors
    /// [`PinAuthError::KeyLength`] when shorter than [`MIN_KEY_BYTES`].
    pub fn from_bytes(key: Vec<u8>) -> Result<Self, PinAuthError> {
        if key.len() < MIN_KEY_BYTES {
            return Err(PinAuthError::KeyLength { len: key.len() });
        }
        Ok(Self { key })
    }

    /// Reads a key file: its bytes with trailing ASCII whitespace removed
    /// (so `head -c 48 /dev/urandom | base64 > key` works). The file must
    /// not be accessible to group or others.
    ///
    /// # Errors
    /// [`PinAuthError::KeyFile`], [`PinAuthError::KeyFileMode`],
    /// [`PinAuthError::KeyLength`].
    pub fn from_file(path: &Path) -> Result<Self, PinAuthError> {
        let file_err = |source| PinAuthError::KeyFile {
            path: path.to_owned(),
            source,
        };
        let mode = std::fs::metadata(path)
            .map_err(file_err)?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            return Err(PinAuthError::KeyFileMode {
                path: path.to_owned(),
                mode,
            });
        }
        let mut key = std::fs::read(path).map_err(file_err)?;
        while key.last().is_some_and(u8::is_ascii_whitespace) {
            key.pop();
        }
        Self::from_bytes(key)
    }

    fn mac(&self, role: &[u8], donor_nonce: &[u8], target_nonce: &[u8]) -> Hmac<Sha256> {
        // new_from_slice accepts any key length for HMAC; the Err arm is unreachable.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(role);
        m.update(donor_nonce);
        m.update(target_nonce);
        m
    }
}

const TARGET_ROLE: &[u8] = b"kv.pin-auth@1 target";
const DONOR_ROLE: &[u8] = b"kv.pin-auth@1 donor";

/// Reads exactly `buf.len()` bytes before `deadline` (a peer that trickles
/// bytes cannot stretch the exchange past it).
fn read_by(s: &mut PinStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// Donor side: challenges the target and verifies its proof within
/// `timeout`. On a bad proof it answers [`STATUS_REFUSED`] and returns
/// [`PinAuthError::Refused`]; the caller closes the connection.
pub(crate) fn donor_handshake(
    s: &mut PinStream,
    key: &PinAuthKey,
    timeout: Duration,
) -> Result<(), PinAuthError> {
    let deadline = Instant::now() + timeout;
    let io = |op| move |source| PinAuthError::Io { op, source };
    let donor_nonce = nonce();
    let mut hello = [0u8; 8 + NONCE_BYTES];
    hello[..8].copy_from_slice(&AUTH_MAGIC);
    hello[8..].copy_from_slice(&donor_nonce);
    s.set_write_timeout(Some(timeout))
        .map_err(io("challenge"))?;
    s.write_all(&hello).map_err(io("challenge"))?;
    let mut proof = [0u8; NONCE_BYTES + MAC_BYTES];
    read_by(s, &mut proof, deadline).map_err(io("proof"))?;
    let (target_nonce, tag) = proof.split_at(NONCE_BYTES);
    if key
        .mac(TARGET_ROLE, &donor_nonce, target_nonce)
        .verify_slice(tag)
        .is_err()
    {
        let _ = s.write_all(&[STATUS_REFUSED]);
        return Err(PinAuthError::Refused);
    }
    let mut verdict = [0u8; 1 + MAC_BYTES];
    verdict[0] = STATUS_OK;
    verdict[1..].copy_from_slice(
        &key.mac(DONOR_ROLE, &donor_nonce, target_nonce)
            .finalize()
            .into_bytes(),
    );
    s.write_all(&verdict).map_err(io("verdict"))
}

/// Target side: answers the donor's challenge and verifies the donor's
/// proof within `timeout`.
pub(crate) fn target_handshake(
    s: &mut PinStream,
    key: &PinAuthKey,
    timeout: Duration,
) -> Result<(), PinAuthError> {
    let deadline = Instant::now() + timeout;
    let io = |op| move |source| PinAuthError::Io { op, source };
    let mut hello = [0u8; 8 + NONCE_BYTES];
    read_by(s, &mut hello, deadline).map_err(io("challenge"))?;
    let (magic, donor_nonce) = hello.split_at(8);
    if magic != AUTH_MAGIC {
        return Err(PinAuthError::Handshake {
            detail: format!("expected the kv.pin-auth@1 challenge, got {magic:02x?}"),
        });
    }
    let target_nonce = nonce();
    let mut proof = [0u8; NONCE_BYTES + MAC_BYTES];
    proof[..NONCE_BYTES].copy_from_slice(&target_nonce);
    proof[NONCE_BYTES..].copy_from_slice(
        &key.mac(TARGET_ROLE, donor_nonce, &target_nonce)
            .finalize()
            .into_bytes(),
    );
    s.write_all(&proof).map_err(io("proof"))?;
    let mut status = [0u8; 1];
    match read_by(s, &mut status, deadline) {
        // The donor closes right after its refusal byte; a reset before we
        // read it is still a refusal only if the byte arrived.
        Ok(()) => {}
        Err(e) => {
            return Err(PinAuthError::Io {
                op: "verdict",
                source: e,
            })
        }
    }
    match status[0] {
        STATUS_OK => {}
        STATUS_REFUSED => return Err(PinAuthError::Refused),
        other => {
            return Err(PinAuthError::Handshake {
                detail: format!("status byte {other}"),
            })
        }
    }
    let mut tag = [0u8; MAC_BYTES];
    read_by(s, &mut tag, deadline).map_err(io("verdict"))?;
    key.mac(DONOR_ROLE, donor_nonce, &target_nonce)
        .verify_slice(&tag)
        .map_err(|_| PinAuthError::DonorProof)
}
