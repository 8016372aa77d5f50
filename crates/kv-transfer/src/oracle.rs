//! The native oracle: real banks, real pins, every copied byte checked.
//!
//! Two cases over a TP2 group (TP1 on a single-GPU machine, reported in
//! [`OracleReport::tp_size`]):
//! 1. **positive**: 7 keys retained by a decode bank, pinned, fetched into
//!    scattered, poisoned destination rows; every byte of every rank must
//!    equal the pattern written at store time, and the delivery must be
//!    complete;
//! 2. **missing keys**: the same fetch with 2 of the 7 keys absent on the
//!    donor; the present rows must be correct, the absent rows must still hold
//!    the poison, and no completion may be reported.
//!
//! Afterwards every pin must be released and the donor bank must close.
//!
//! Profiles: [`Profile::Cpu`] uses host shared-memory banks, the target
//! mapping the donor's shm object by name as another process would.
//! [`Profile::Gpu`] uses CUDA device banks (one GPU per rank) and the CUDA
//! backend, in one process (cross-process IPC mapping is checked by kv-bank's
//! `gpu_check`); its host payload must be 0. [`OracleBackend::Nixl`] runs the
//! same cases through two NIXL agents (DRAM on CPU, VRAM on GPU).
//!
//! On the GPU profile a NIXL delivery whose transport is not verified
//! device-direct is refused ([`TransferError::TransportUnverified`],
//! [`TransferError::HostStaged`]): two agents in one process get no GPU lane
//! from UCX (it moves VRAM over `tcp/lo`). That refusal is the required
//! outcome, recorded in [`OracleReport::fail_closed`]; the oracle then checks
//! that nothing completed and every pin and bank was released.

use std::sync::Arc;
use std::time::Duration;

use kv_bank::{sealed_blocks, BankConfig, BankManager, BankMemory, DestinationPool, HostShmMemory};
use kv_descriptor::{DType, ExportHandle, KvLayout, OwnerLease, Role, SequenceHash, TensorOrder};
use serde::{Deserialize, Serialize};

use crate::cuda::{CudaCopyBackend, CudaMode};
use crate::nixl::{NixlAgent, NixlBackend, NixlMode};
use crate::plan::{BlockMove, RegionGeometry, TransferPlan};
use crate::{
    deliver, CopyBackend, DeliveryControl, DeliveryReport, HostCopyBackend, NixlRemoteRegion,
    RankIo, SourceRegion, TransferError,
};

/// Which memory the oracle runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Host shared memory, host memcpy (or NIXL DRAM).
    Cpu,
    /// CUDA device memory, device copies / gather kernel (or NIXL VRAM).
    Gpu,
}

impl std::str::FromStr for Profile {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Profile::Cpu),
            "gpu" => Ok(Profile::Gpu),
            other => Err(TransferError::input(
                "profile",
                format!("expected `cpu` or `gpu`, got `{other}`"),
            )),
        }
    }
}

/// Which backend moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OracleBackend {
    /// Host memcpy on CPU, the CUDA backend on GPU.
    Native,
    /// Two NIXL agents (UCX), prepared descriptor lists.
    Nixl,
}

/// Outcome of both oracle cases. `passed()` is the verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OracleReport {
    /// Profile run.
    pub profile: Profile,
    /// TP size of the banks.
    pub tp_size: u32,
    /// Keys requested per case (7).
    pub keys: usize,
    /// Keys absent in the missing-key case (2).
    pub missing_keys: usize,
    /// Payload bytes of the positive case, all ranks.
    pub bytes: u64,
    /// Copy operations of the positive case, all ranks.
    pub copies: u64,
    /// Host payload bytes over both cases (must be 0 on GPU).
    pub host_payload_bytes: u64,
    /// Every byte of every delivered row equals the donor's pattern (both cases).
    pub bytes_ok: bool,
    /// Absent keys' rows (and rows outside the fetch) still hold the poison.
    pub untouched_rows_ok: bool,
    /// The positive case reported completion.
    pub positive_complete: bool,
    /// The missing-key case reported completion (must be false).
    pub false_completion: bool,
    /// No pin outstanding on the donor after both cases.
    pub pins_released: bool,
    /// The donor bank closed (generation dead, memory freed).
    pub banks_closed: bool,
    /// Backend name.
    pub backend: String,
    /// Transport that actually ran (`unknown` for NIXL, see [`crate::nixl`]).
    pub transport: String,
    /// Wall time of the positive delivery, µs.
    pub positive_us: u64,
    /// GPU profile only: why the delivery was refused because its transport
    /// could not be verified device-direct (see the module docs); `None` when
    /// the fetch ran.
    #[serde(default)]
    pub fail_closed: Option<String>,
}

impl OracleReport {
    /// Verdict: every check holds.
    pub fn passed(&self) -> bool {
        if self.fail_closed.is_some() {
            return self.profile == Profile::Gpu
                && !self.positive_complete
                && !self.false_completion
                && self.pins_released
                && self.banks_closed;
        }
        self.bytes_ok
            && self.untouched_rows_ok
            && self.positive_complete
            && !self.false_completion
            && self.pins_released
            && self.banks_closed
            && (self.profile == Profile::Cpu || self.host_payload_bytes == 0)
    }
}

pub(crate) const KEYS: usize = 7;
const POISON: u8 = 0xA5;
/// Target rows of the fetch: two runs and three singles.
const DST_BLOCKS: [u32; KEYS] = [3, 4, 9, 10, 11, 20, 30];
/// Indices of the keys replaced by absent ones in the missing-key case.
const ABSENT: [usize; 2] = [2, 5];

/// Byte `i` of `key`'s part on `rank`: what the donor stored.
pub(crate) fn pattern(rank: u32, key: SequenceHash, i: usize) -> u8 {
    let x = key.0 ^ (u64::from(rank) << 56) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

/// The donor both oracles fetch from: a decode bank of 32 slots per rank on
/// a TP2 group (TP1 on a single-GPU machine), 64 KiB per block and rank,
/// holding the filler sequences first (so the fetched blocks sit mid-bank),
/// then [`KEYS`] blocks, every byte written with [`pattern`] through
/// `write_pending` (the ack counts only its writes).
pub(crate) struct OracleDonor {
    /// TP size of the group.
    pub(crate) tp: u32,
    /// The donor's geometry: 4 layers, `4 x tp` KV heads, head_dim 64, bf16,
    /// 16-token blocks, block-major.
    pub(crate) layout: KvLayout,
    /// Bytes of one block on one rank.
    pub(crate) block_bytes: usize,
    /// Slots per rank.
    pub(crate) slots: u32,
    /// The bank (host shm on [`Profile::Cpu`], CUDA device memory on
    /// [`Profile::Gpu`], one GPU per rank).
    pub(crate) bank: BankManager,
    /// The [`KEYS`] stored keys, root first.
    pub(crate) wanted: Vec<SequenceHash>,
    /// [`KEYS`] keys the donor never stored.
    pub(crate) absent: Vec<SequenceHash>,
}

impl OracleDonor {
    /// Builds the bank named `name` and stores `fillers` (`(token seed,
    /// blocks)` each, root chains) and then the keys.
    ///
    /// # Errors
    /// [`TransferError::Cuda`] when [`Profile::Gpu`] sees no CUDA device; bank
    /// and memory errors.
    pub(crate) fn new(
        profile: Profile,
        name: &str,
        fillers: &[(u32, usize)],
    ) -> Result<Self, TransferError> {
        let tp = match profile {
            Profile::Cpu => 2,
            Profile::Gpu => match crate::cuda::device_count() {
                0 => {
                    return Err(TransferError::Cuda {
                        op: "cuDeviceGetCount",
                        reason: "no CUDA device visible".into(),
                    })
                }
                n => n.min(2) as u32,
            },
        };
        // 64 KiB per block per rank: 2 x 4 layers x 16 tokens x (8/tp) heads x 64 dims x 2 bytes x tp/2.
        let layout = KvLayout::new(4, 4 * tp, 64, DType::Bf16, 16, TensorOrder::BlockMajor, tp)
            .map_err(|e| TransferError::input("layout", e.to_string()))?;
        let bb = layout.rank_block_bytes();
        let slots = 32u32;
        let config = BankConfig::new(
            layout,
            OwnerLease::fresh(Role::Decode),
            u64::from(tp) * u64::from(slots) * bb as u64,
        );
        let bank = match profile {
            Profile::Cpu => BankManager::new_host_shm(config, name)?,
            Profile::Gpu => BankManager::new_cuda(config, name, &(0..tp).collect::<Vec<_>>())?,
        };
        let tpb = layout.tokens_per_block() as usize;
        let mut wanted = Vec::new();
        for &(seed, blocks) in fillers.iter().chain([(0, KEYS)].iter()) {
            let tokens: Vec<u32> = (0..(blocks * tpb) as u32).map(|t| t + seed).collect();
            let sealed = sealed_blocks(None, &tokens, tpb);
            let pending = bank.store(None, &sealed)?;
            for r in 0..tp {
                for (index, &(h, _)) in pending.entries.iter().enumerate() {
                    let bytes: Vec<u8> = (0..bb).map(|i| pattern(r, h, i)).collect();
                    bank.write_pending(pending.store_id, r, index, &bytes)?;
                }
                bank.ack(pending.store_id, r)?;
            }
            wanted = sealed.iter().map(|b| b.sequence_hash).collect();
        }
        let absent_tokens: Vec<u32> = (0..(KEYS * tpb) as u32).map(|t| t + 9_000).collect();
        let absent = sealed_blocks(None, &absent_tokens, tpb)
            .iter()
            .map(|b| b.sequence_hash)
            .collect();
        Ok(Self {
            tp,
            layout,
            block_bytes: bb,
            slots,
            bank,
            wanted,
            absent,
        })
    }
}

/// Runs the oracle with the native backend of `profile`.
///
/// # Errors
/// Setup failures (no GPU on [`Profile::Gpu`], bank or memory errors) and a
/// positive-case delivery error. Check failures are not errors: they are
/// `false` fields and `passed() == false`.
pub fn run(profile: Profile) -> Result<OracleReport, TransferError> {
    run_backend(profile, OracleBackend::Native)
}

/// Runs the oracle with `backend`; see the module docs.
///
/// # Errors
/// As [`run`]; [`TransferError::NixlUnavailable`] for NIXL without its runtime.
pub fn run_backend(
    profile: Profile,
    backend: OracleBackend,
) -> Result<OracleReport, TransferError> {
    let OracleDonor {
        tp,
        layout,
        block_bytes: bb,
        slots,
        bank: donor,
        wanted,
        absent,
    } = OracleDonor::new(profile, "oracle-host", &[(1_000, 3), (2_000, 2)])?;

    // Target rows: one region per rank, 64 rows, poisoned before each case.
    let target_rows = 64u32;
    let dst_geom = RegionGeometry::dense(&layout, target_rows);
    let targets: Vec<Arc<dyn BankMemory>> = (0..tp)
        .map(|r| -> Result<Arc<dyn BankMemory>, TransferError> {
            let len = dst_geom.region_bytes() as usize;
            Ok(match profile {
                Profile::Cpu => Arc::new(HostShmMemory::create_unique("kvx-oracle-dst", len)?),
                Profile::Gpu => Arc::new(kv_bank::CudaDeviceMemory::new(r, len)?),
            })
        })
        .collect::<Result<_, _>>()?;
    let pool = DestinationPool::new(target_rows);

    let nixl = match backend {
        OracleBackend::Native => None,
        OracleBackend::Nixl => {
            let tag = format!("{}-{}", std::process::id(), uuid_like());
            let d = NixlAgent::new(&format!("kvx-oracle-donor-{tag}"))?;
            let t = Arc::new(NixlAgent::new(&format!("kvx-oracle-target-{tag}"))?);
            for r in 0..tp {
                d.register(donor.rank(r)?.memory().as_ref())?;
                t.register(targets[r as usize].as_ref())?;
            }
            let name = t.load_remote(&d.metadata()?)?;
            Some((d, t, name))
        }
    };
    let engine: Box<dyn CopyBackend> = match (&nixl, profile) {
        (Some((_, t, _)), _) => Box::new(NixlBackend::new(t.clone(), NixlMode::Prepared)),
        (None, Profile::Cpu) => Box::new(HostCopyBackend),
        (None, Profile::Gpu) => Box::new(CudaCopyBackend::new(CudaMode::Auto)?),
    };

    let mut bytes_ok = true;
    let mut untouched_ok = true;
    let mut host_payload = 0;
    let mut results: Vec<DeliveryReport> = Vec::new();
    let mut fail_closed = None;
    for case in 0..2 {
        let keys = case_keys(&wanted, &absent, &ABSENT, case == 1);
        for t in &targets {
            t.write_bytes(0, &vec![POISON; t.len()])?;
        }
        let reservation = pool.reserve_exact(&DST_BLOCKS)?;
        let (pin, moves) = pin_moves(&donor, &keys, reservation.blocks())?;
        let src_geom = RegionGeometry::dense(&layout, slots);
        let plan = TransferPlan::new(
            &layout,
            &layout,
            &moves,
            &vec![src_geom; tp as usize],
            &vec![dst_geom; tp as usize],
        )?;
        // The source as the target sees it: the shm object mapped by name
        // (CPU), the device allocation (GPU), or the remote NIXL region.
        let mut opened: Vec<Arc<dyn BankMemory>> = Vec::new();
        let mut remotes: Vec<NixlRemoteRegion> = Vec::new();
        for r in 0..tp {
            let bank = pin.rank(r)?;
            let len = bank.descriptor().region_bytes() as usize;
            match (&nixl, bank.descriptor().export()) {
                (Some((_, _, name)), _) => remotes.push(NixlRemoteRegion {
                    agent_name: name.clone(),
                    base_addr: bank.memory().base_addr(),
                    len: len as u64,
                    kind: bank.memory().kind(),
                }),
                (None, ExportHandle::HostShm { name }) => {
                    opened.push(Arc::new(HostShmMemory::open(name, len)?))
                }
                (None, _) => opened.push(bank.memory().clone()),
            }
        }
        let io: Vec<RankIo> = (0..tp as usize)
            .map(|r| RankIo {
                src: match &nixl {
                    Some(_) => SourceRegion::Nixl(&remotes[r]),
                    None => SourceRegion::Mapped(opened[r].as_ref()),
                },
                dst: targets[r].as_ref(),
            })
            .collect();
        let result = deliver(
            &plan,
            engine.as_ref(),
            &io,
            &DeliveryControl::with_timeout(Duration::from_secs(30)),
        );
        drop(io);
        drop(opened);
        drop(pin);
        let report = match result {
            Ok(r) => {
                reservation.complete();
                r
            }
            // `deliver` wraps a part's error in PartFailed: match its cause.
            Err(e)
                if profile == Profile::Gpu
                    && case == 0
                    && matches!(
                        e.part_cause(),
                        TransferError::TransportUnverified { .. }
                            | TransferError::HostStaged { .. }
                    ) =>
            {
                reservation.cancel().quiesced();
                fail_closed = Some(e.to_string());
                break;
            }
            Err(e) => {
                reservation.cancel().quiesced();
                return Err(e);
            }
        };
        host_payload += report.counters.host_payload_bytes;
        for r in 0..tp {
            let mut row = vec![0u8; bb];
            for (i, k) in keys.iter().enumerate() {
                targets[r as usize].read_bytes(DST_BLOCKS[i] as usize * bb, &mut row)?;
                if case == 1 && ABSENT.contains(&i) {
                    untouched_ok &= row.iter().all(|&b| b == POISON);
                } else {
                    bytes_ok &= row.iter().enumerate().all(|(j, &b)| b == pattern(r, *k, j));
                }
            }
            // A row outside the fetch must be untouched as well.
            targets[r as usize].read_bytes(0, &mut row)?;
            untouched_ok &= row.iter().all(|&b| b == POISON);
        }
        results.push(report);
    }
    let pins_released = donor.pins_outstanding() == 0;
    let engine_name = engine.name().to_string();
    drop(engine);
    drop(nixl);
    let banks_closed = donor.close(Duration::from_secs(5)).is_ok() && donor.is_closed();
    if let Some(why) = fail_closed {
        return Ok(OracleReport {
            profile,
            tp_size: tp,
            keys: KEYS,
            missing_keys: ABSENT.len(),
            bytes: 0,
            copies: 0,
            host_payload_bytes: host_payload,
            bytes_ok: false,
            untouched_rows_ok: false,
            positive_complete: false,
            false_completion: false,
            pins_released,
            banks_closed,
            backend: engine_name,
            transport: String::new(),
            positive_us: 0,
            fail_closed: Some(why),
        });
    }
    let (pos, neg) = (&results[0], &results[1]);
    Ok(OracleReport {
        profile,
        tp_size: tp,
        keys: KEYS,
        missing_keys: ABSENT.len(),
        bytes: pos.counters.bytes,
        copies: pos.counters.copies,
        host_payload_bytes: host_payload,
        bytes_ok,
        untouched_rows_ok: untouched_ok,
        positive_complete: pos.is_complete()
            && pos.counters.bytes == (KEYS * bb) as u64 * u64::from(tp),
        false_completion: neg.is_complete(),
        pins_released,
        banks_closed,
        backend: pos.counters.backend.clone(),
        transport: pos.counters.transport.clone(),
        positive_us: pos.elapsed_us,
        fail_closed: None,
    })
}

/// A short random tag so two oracle runs never share a NIXL agent name.
fn uuid_like() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{t:08x}")
}

/// The keys of one oracle case: `wanted`, with the positions `absent_at`
/// swapped for `absent`'s keys (which no donor holds) when `missing`.
pub(crate) fn case_keys(
    wanted: &[SequenceHash],
    absent: &[SequenceHash],
    absent_at: &[usize],
    missing: bool,
) -> Vec<SequenceHash> {
    (0..wanted.len())
        .map(|i| {
            if missing && absent_at.contains(&i) {
                absent[i]
            } else {
                wanted[i]
            }
        })
        .collect()
}

/// Pins the keys of `keys` that `donor` holds and pairs every key with its
/// destination block in order (`src_slot` is `None` for a key not pinned,
/// which the delivery must report missing, never complete).
///
/// # Errors
/// The bank refusing the pin.
pub(crate) fn pin_moves(
    donor: &BankManager,
    keys: &[SequenceHash],
    dst_blocks: &[u32],
) -> Result<(kv_bank::ManagerPin, Vec<BlockMove>), kv_bank::BankError> {
    let present: Vec<SequenceHash> = keys
        .iter()
        .copied()
        .filter(|k| donor.lookup(k).is_some())
        .collect();
    let pin = donor.pin_prefix(&present)?;
    let moves = keys
        .iter()
        .zip(dst_blocks)
        .map(|(k, &d)| BlockMove {
            key: *k,
            src_slot: pin
                .hashes()
                .iter()
                .position(|h| h == k)
                .map(|i| pin.slots()[i]),
            dst_block: d,
        })
        .collect();
    Ok((pin, moves))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_oracle_passes_with_host_memcpy() {
        let r = run(Profile::Cpu).unwrap();
        assert!(r.passed(), "{r:#?}");
        assert_eq!((r.tp_size, r.keys), (2, 7));
        assert_eq!(r.bytes, 2 * 7 * 65_536);
        // Blocks land in rows 3,4 | 9,10,11 | 20 | 30 from consecutive slots: 4 runs per rank.
        assert_eq!(r.copies, 2 * 4);
        assert_eq!(r.host_payload_bytes, r.bytes + 2 * 5 * 65_536);
        assert_eq!(r.backend, "host_memcpy");
    }

    #[test]
    fn profile_parses_and_names_bad_input() {
        assert_eq!("gpu".parse::<Profile>().unwrap(), Profile::Gpu);
        assert!("tpu"
            .parse::<Profile>()
            .unwrap_err()
            .to_string()
            .contains("profile"));
    }
}
