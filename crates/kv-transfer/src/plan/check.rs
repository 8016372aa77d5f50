//! The moves check of [`super::TransferPlan`]: the first refused move and
//! its first failing check, exactly as the check it replaced (three SipHash
//! `HashSet`s filled in one pass, then a sort) reported them, and the
//! present rows sorted by donor slot; linear in the moves.
//!
//! Each check (key listed twice; target block out of range or written twice;
//! donor slot out of range or listed twice) is its own tight pass over the
//! moves, each later one stopping at the first refusal found so far
//! ([`check_moves`] says why that is the same answer). What a duplicate
//! check remembers:
//! - donor slots and target blocks: a bitmap over `0..limit` where
//!   [`bitmap_words`] allows (at most [`BITMAP_WORDS_PER_MOVE`] words per
//!   move plus [`BITMAP_MIN_WORDS`]: every range of up to 65,536 rows), else
//!   a [`Buckets`] table. The slots' bitmap also sorts the rows without a
//!   sort ([`Ids::rows`]: read out of a slot table in bit order, or placed
//!   by rank);
//! - keys ([`kv_descriptor::SequenceHash`], any `u64`): a [`Buckets`] table,
//!   placed by a folded multiply of the key and a per-table random seed, so
//!   colliding keys cannot be prepared without the seed; past a probe budget
//!   of 4 steps per bucket its keys move into a `BTreeSet`, so even a flood
//!   of collisions costs O(n log n), never O(n^2).
//!
//! `TransferPlan::new` of 1,024 / 4,096 scattered moves on the 2-core CPU
//! build machine: 152-243 / 625-1045 us with the `HashSet`s, 13-20 / 54-89
//! us now (~13 / ~55 at load ~2), of which this check is ~8 / ~34 us
//! (`crates/kv-transfer/MEASURED.md`).

use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::hash::BuildHasher;

use super::{BlockMove, MissingKey, SlotToBlock};
use crate::TransferError;

/// Bitmap words (64 ids each) allowed per move for a slot / block range
/// before the check hashes the ids instead.
const BITMAP_WORDS_PER_MOVE: usize = 4;
/// Bitmap words always allowed (8 KiB: ranges of up to 65,536 ids).
const BITMAP_MIN_WORDS: usize = 1024;
/// Slot ids per move up to which the sorted rows are read out of a table
/// by slot (4 bytes per id) rather than placed by rank.
const TABLE_IDS_PER_MOVE: usize = 16;
/// Slot ids always allowed a table (16 KiB).
const TABLE_MIN_IDS: usize = 4096;

/// How the checks remember ids: the product's choice ([`Sets::AUTO`]), or
/// (tests) hashing only, with a given probe budget.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sets {
    /// Bitmaps over bounded slot / block ranges.
    pub(super) bitmaps: bool,
    /// Steps to a next bucket allowed per bucket of a [`Buckets`] table
    /// before its ids move into a `BTreeSet`.
    pub(super) probes_per_bucket: usize,
}

impl Sets {
    /// Bitmaps where [`bitmap_words`] allows them, a probe budget of 4 per
    /// bucket.
    pub(super) const AUTO: Self = Self {
        bitmaps: true,
        probes_per_bucket: 4,
    };
}

/// Checks `moves` against the donor's `src_limit` slots and the target's
/// `dst_limit` blocks; returns the present `(slot, block)` pairs sorted by
/// slot and the missing keys in input order. O(moves), plus one bit per id
/// of a range kept as a bitmap.
///
/// # Errors
/// [`TransferError::InvalidInput`] for the first refused move, naming
/// `moves` (empty), `moves.key` (listed twice), `moves.dst_block` (not below
/// `dst_limit`, or written twice) or `moves.src_slot` (not below
/// `src_limit`, or listed twice), checked in that order per move.
pub(super) fn check_moves(
    moves: &[BlockMove],
    src_limit: u32,
    dst_limit: u32,
    sets: Sets,
) -> Result<(Vec<SlotToBlock>, Vec<MissingKey>), TransferError> {
    if moves.is_empty() {
        return Err(TransferError::input(
            "moves",
            "at least one block must be requested",
        ));
    }
    // Whether move `i` fails a check depends on the input alone: when no
    // move before `i` was refused, each set holds exactly the ids of moves
    // `0..i`. So each check's first refusal is found by its own pass, and a
    // later check only looks at the moves before the first refusal found so
    // far (at the same move the earlier check is reported).
    let key = first_repeat(moves, |m| Some(m.key.0), sets.probes_per_bucket);
    let end = key.unwrap_or(moves.len());
    let (dst, _) = first_refused(&moves[..end], |m| Some(m.dst_block), dst_limit, sets);
    let end = dst.map_or(end, |(i, _)| i);
    let (src, slots) = first_refused(&moves[..end], |m| m.src_slot, src_limit, sets);
    if let Some((i, why)) = src {
        return Err(refused_src(moves, i, why, src_limit));
    }
    if let Some((i, why)) = dst {
        return Err(refused_dst(moves, i, why, dst_limit));
    }
    if let Some(i) = key {
        return Err(refused_key(moves, i));
    }
    Ok(slots.rows(moves))
}

/// Words of a bitmap over `0..limit` for `moves` moves, when it is at most
/// [`BITMAP_WORDS_PER_MOVE`] per move plus [`BITMAP_MIN_WORDS`].
fn bitmap_words(limit: u32, moves: usize) -> Option<usize> {
    let words = (limit as usize).div_ceil(64);
    (words <= BITMAP_WORDS_PER_MOVE * moves + BITMAP_MIN_WORDS).then_some(words)
}

/// Sets bit `id` (below the bitmap's range); false when it was set.
#[inline(always)]
fn set_bit(bits: &mut [u64], id: u32) -> bool {
    let (w, bit) = (&mut bits[id as usize / 64], 1u64 << (id % 64));
    let new = *w & bit == 0;
    *w |= bit;
    new
}

fn refused_key(moves: &[BlockMove], i: usize) -> TransferError {
    TransferError::input(
        "moves.key",
        format!("move {i}: key {:?} listed twice", moves[i].key),
    )
}

fn refused_dst(moves: &[BlockMove], i: usize, why: Refused, limit: u32) -> TransferError {
    let d = moves[i].dst_block;
    TransferError::input(
        "moves.dst_block",
        match why {
            Refused::Range => {
                format!("move {i}: block {d} is not below the target's {limit} blocks")
            }
            Refused::Repeat => format!("move {i}: block {d} is written twice"),
        },
    )
}

fn refused_src(moves: &[BlockMove], i: usize, why: Refused, limit: u32) -> TransferError {
    let s = moves[i].src_slot.unwrap_or_default();
    TransferError::input(
        "moves.src_slot",
        match why {
            Refused::Range => format!("move {i}: slot {s} is not below the donor's {limit} slots"),
            Refused::Repeat => format!("move {i}: slot {s} listed twice"),
        },
    )
}

/// Why a move's id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// Not below the limit.
    Range,
    /// Equal to an earlier move's.
    Repeat,
}

/// The first move whose id (`id`, `None` skipped) is not below `limit` or
/// equals an earlier move's, and how the ids were remembered: a bitmap over
/// `0..limit` where [`bitmap_words`] allows one, else by [`first_repeat`].
fn first_refused(
    moves: &[BlockMove],
    id: impl Fn(&BlockMove) -> Option<u32>,
    limit: u32,
    sets: Sets,
) -> (Option<(usize, Refused)>, Ids) {
    let Some(words) = bitmap_words(limit, moves.len()).filter(|_| sets.bitmaps) else {
        // Every id before the first out of range is below the limit.
        let range = moves.iter().position(|m| id(m).is_some_and(|v| v >= limit));
        let moves = &moves[..range.unwrap_or(moves.len())];
        let refused = match first_repeat(moves, |m| id(m).map(u64::from), sets.probes_per_bucket) {
            Some(i) => Some((i, Refused::Repeat)),
            None => range.map(|i| (i, Refused::Range)),
        };
        return (refused, Ids::Hashed);
    };
    let mut bits = vec![0u64; words];
    for (i, m) in moves.iter().enumerate() {
        let Some(v) = id(m) else { continue };
        if v >= limit {
            return (Some((i, Refused::Range)), Ids::Bits(bits));
        }
        if !set_bit(&mut bits, v) {
            return (Some((i, Refused::Repeat)), Ids::Bits(bits));
        }
    }
    (None, Ids::Bits(bits))
}

/// How the slots were remembered.
enum Ids {
    /// Bit `id % 64` of word `id / 64` is set for every id seen.
    Bits(Vec<u64>),
    /// In a [`Buckets`] table, gone.
    Hashed,
}

impl Ids {
    /// The present `(slot, block)` rows of `moves` sorted by slot, and the
    /// missing keys in move order, when these are the slot ids seen (each
    /// once). With a bitmap over at most [`TABLE_IDS_PER_MOVE`] ids per move
    /// plus [`TABLE_MIN_IDS`], each slot's block goes into a table by slot
    /// and the set bits are read out in order; with a larger bitmap, each row
    /// goes straight to its slot's rank (the set bits below it: a count per
    /// bitmap byte, then a table lookup within the byte); both O(moves +
    /// words). Without a bitmap the rows are sorted.
    fn rows(self, moves: &[BlockMove]) -> (Vec<SlotToBlock>, Vec<MissingKey>) {
        let mut missing = Vec::new();
        let mut gone = |i: usize, m: &BlockMove| {
            missing.push(MissingKey {
                index: i,
                key: m.key,
                dst_block: m.dst_block,
            })
        };
        let words = match self {
            Self::Bits(words) => words,
            Self::Hashed => {
                let mut rows = Vec::with_capacity(moves.len());
                for (i, m) in moves.iter().enumerate() {
                    match m.src_slot {
                        Some(s) => rows.push((s, m.dst_block)),
                        None => gone(i, m),
                    }
                }
                rows.sort_unstable();
                return (rows, missing);
            }
        };
        let ids = 64 * words.len();
        if ids <= TABLE_IDS_PER_MOVE * moves.len() + TABLE_MIN_IDS {
            let mut block = vec![0u32; ids];
            for (i, m) in moves.iter().enumerate() {
                match m.src_slot {
                    Some(s) => block[s as usize] = m.dst_block,
                    None => gone(i, m),
                }
            }
            let mut rows = Vec::with_capacity(moves.len() - missing.len());
            for (w, &bits) in words.iter().enumerate() {
                let mut bits = bits;
                while bits != 0 {
                    let s = 64 * w + bits.trailing_zeros() as usize;
                    rows.push((s as u32, block[s]));
                    bits &= bits - 1;
                }
            }
            return (rows, missing);
        }
        // Set bits below each byte of the bitmap (little-endian bytes: byte
        // `id / 8` holds id's bit at `id % 8`).
        let mut below = Vec::with_capacity(8 * words.len());
        let mut acc = 0u32;
        for w in &words {
            for b in w.to_le_bytes() {
                below.push(acc);
                acc += u32::from(ONES[usize::from(b)]);
            }
        }
        let mut rows = vec![(0, 0); acc as usize];
        for (i, m) in moves.iter().enumerate() {
            let Some(s) = m.src_slot else {
                gone(i, m);
                continue;
            };
            let byte = (words[s as usize / 64] >> ((s % 64) & !7)) as u8;
            let under = byte & ((1u8 << (s % 8)) - 1);
            let rank = below[s as usize / 8] + u32::from(ONES[usize::from(under)]);
            rows[rank as usize] = (s, m.dst_block);
        }
        (rows, missing)
    }
}

/// Set bits of each byte value.
const ONES: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = (b as u8).count_ones() as u8;
        b += 1;
    }
    t
};

/// Entries per bucket of a [`Buckets`] table (32 bytes).
const WAYS: usize = 4;

/// What [`Buckets::insert`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    New,
    Seen,
    /// The probe budget is spent; the id was not inserted.
    Spent,
}

/// A set of `u64` ids for at most the capacity given: buckets of [`WAYS`]
/// ids, at most half full. An id goes to the first bucket with room from the
/// one picked by the top bits of [`mix`] of the id and a per-table random
/// seed (from [`RandomState`]), and is compared with a whole bucket at once:
/// no branch per entry, so few mispredicted branches whatever the ids
/// (linear probing one entry at a time took ~40% longer here). Each step to
/// a next bucket spends one of `probes_per_bucket x buckets`.
struct Buckets {
    /// 0 is an empty entry (a bucket fills from its first entry on); id 0
    /// is `zero`.
    table: Vec<[u64; WAYS]>,
    zero: bool,
    seed: u64,
    /// `64 - log2(buckets)`: the mix's top bits pick the bucket.
    shift: u32,
    budget: usize,
}

impl Buckets {
    fn new(capacity: usize, probes_per_bucket: usize) -> Self {
        let buckets = (2 * capacity).div_ceil(WAYS).next_power_of_two().max(4);
        Self {
            table: vec![[0; WAYS]; buckets],
            zero: false,
            seed: RandomState::new().hash_one(0x6b76_7472_u64),
            shift: 64 - buckets.trailing_zeros(),
            budget: probes_per_bucket.saturating_mul(buckets),
        }
    }

    #[inline(always)]
    fn insert(&mut self, v: u64) -> Probe {
        if v == 0 {
            return match std::mem::replace(&mut self.zero, true) {
                true => Probe::Seen,
                false => Probe::New,
            };
        }
        let mask = self.table.len() - 1;
        let mut at = (mix(v ^ self.seed) >> self.shift) as usize;
        loop {
            let bucket = &mut self.table[at & mask];
            if bucket.iter().fold(false, |seen, &e| seen | (e == v)) {
                return Probe::Seen;
            }
            let used: usize = bucket.iter().map(|&e| usize::from(e != 0)).sum();
            if used < WAYS {
                bucket[used] = v;
                return Probe::New;
            }
            if self.budget == 0 {
                return Probe::Spent;
            }
            self.budget -= 1;
            at += 1;
        }
    }
}

/// The first move whose id (`id`, `None` skipped; any `u64`) equals an
/// earlier move's, found with a [`Buckets`] table, which past its probe
/// budget hands its ids to a `BTreeSet` ([`first_repeat_in_tree`]).
fn first_repeat(
    moves: &[BlockMove],
    id: impl Fn(&BlockMove) -> Option<u64>,
    probes_per_bucket: usize,
) -> Option<usize> {
    let mut seen = Buckets::new(moves.len(), probes_per_bucket);
    for (i, m) in moves.iter().enumerate() {
        let Some(v) = id(m) else { continue };
        match seen.insert(v) {
            Probe::New => {}
            Probe::Seen => return Some(i),
            Probe::Spent => {
                return first_repeat_in_tree(seen, &moves[i..], id).map(|j| i + j);
            }
        }
    }
    None
}

/// [`first_repeat`] past its probe budget: the first of `rest` whose id is
/// in `seen` or equals an earlier one of `rest`, found with a `BTreeSet`
/// (O(log n) per id, whatever the ids).
#[cold]
#[inline(never)]
fn first_repeat_in_tree(
    seen: Buckets,
    rest: &[BlockMove],
    id: impl Fn(&BlockMove) -> Option<u64>,
) -> Option<usize> {
    let mut tree: BTreeSet<u64> = seen
        .table
        .iter()
        .flatten()
        .copied()
        .filter(|&e| e != 0)
        .collect();
    if seen.zero {
        tree.insert(0);
    }
    rest.iter()
        .position(|m| id(m).is_some_and(|v| !tree.insert(v)))
}

/// A folded multiply by the 64-bit golden ratio: the high and low halves of
/// the 128-bit product, xored (as foldhash and wyhash mix); every input bit
/// reaches the high output bits that pick a bucket. One multiply (with
/// MurmurHash3's two-multiply finalizer the keys took ~40% longer).
fn mix(x: u64) -> u64 {
    let p = u128::from(x) * 0x9e37_79b9_7f4a_7c15_u128;
    (p as u64) ^ (p >> 64) as u64
}

#[cfg(test)]
mod tests;
