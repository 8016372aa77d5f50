//! CUDA C source of the converting gather and where its block table lives.
//!
//! The block table (`2n` u64: donor block bases, then target block bases)
//! reaches the kernel one of three ways ([`TablePlacement`]):
//! - **inline, small**: `n <= INLINE_SMALL_BLOCKS`, the table is a
//!   `__grid_constant__` kernel parameter of [`INLINE_SMALL_ENTRIES`] u64
//!   (2 KiB, under the classic 4 KiB parameter limit);
//! - **inline, large**: a parameter of [`INLINE_LARGE_ENTRIES`] u64 (32,512
//!   bytes; CUDA 12.1+ drivers and NVRTC accept up to 32,764 bytes of
//!   parameters on Volta and later): compiled, but not chosen, since on the
//!   H200 it slowed the kernel more than the upload it saves (129..=2,032
//!   blocks use the device table);
//! - **inline, packed**: `2,032 < n <= INLINE_PACKED_BLOCKS` and every block id
//!   below 65,536 with one block stride per side: one u32 per block (donor
//!   id << 16 | target id), [`INLINE_PACKED_ENTRIES`] of them (32,512 bytes),
//!   the bases and strides as scalars;
//! - **device**: a device buffer filled by one `cuMemcpyHtoDAsync` of `2n`
//!   entries from a page-locked staging buffer (older drivers, no inline
//!   module, or more blocks).
//!
//! Inline tables travel with the launch itself: no DMA, no event, nothing
//! the kernel waits on. The H200 qualification measured the separate upload
//! at 10.8-13.1 µs of a 23.9-90 µs fetch (`docs/cuda-kernel.md`).
//!
//! The inline variants are compiled apart from the table-pointer entry
//! points (NVRTC option [`INLINE_KERNEL_DEFINE`] and the device's own
//! `compute_XY`, 7.0 or newer, which `__grid_constant__` and large
//! parameters need), so an NVRTC or driver without them still gets the
//! device-table kernel.

/// CUDA C source of the converting gather. Compiled as is: the table-pointer
/// entry points `kv_convert_16` (`uint4`), `kv_convert_8`, `kv_convert_4`,
/// `kv_convert_2`, `kv_convert_1` with arguments `(const u64* blocks,
/// const u64* pieces, u32 n, u32 num_pieces, u32 piece_shift, u32
/// piece_elems, u32 group_shift)`, where `piece_shift` is `log2(num_pieces)`
/// when that is a power of two and `0xFFFFFFFF` otherwise (then the block
/// index is a division). Compiled with [`INLINE_KERNEL_DEFINE`]: the inline
/// entry points [`INLINE_SMALL_NAMES`] / [`INLINE_LARGE_NAMES`], the same
/// arguments except that `blocks` is the table itself, passed by value.
/// Every variant runs the same loop (`KV_LOOP`), so one CPU mirror covers all;
/// the 16-byte entry points also come as `NAME_w` ([`TablePlacement::wide_name`])
/// whose loop first steps eight elements a lane (`KV_STEP8`).
pub const CONVERT_KERNEL_SRC: &str = r#"
/* The eight-wide step runs only in the `_w` entry points (16-byte elements,
   pieces of at least WIDE_PIECE_BYTES): compiled into every entry point it
   took the HF 256-byte-row fetch from 0.890 to 0.722 of the raw copy on the
   H200 although it never executes for those rows (G = a quarter of 16
   elements), so the four-wide entry points keep the loop they had. */
#define KV_NO_STEP8(T)
#define KV_STEP8(T)                                                                      \
        for (; w + 7u * G < pe; w += 8u * G) {                                           \
            T a0 = __ldg(sp + w), a1 = __ldg(sp + w + G);                                \
            T a2 = __ldg(sp + w + 2u * G), a3 = __ldg(sp + w + 3u * G);                  \
            T a4 = __ldg(sp + w + 4u * G), a5 = __ldg(sp + w + 5u * G);                  \
            T a6 = __ldg(sp + w + 6u * G), a7 = __ldg(sp + w + 7u * G);                  \
            __stcg(dp + w, a0); __stcg(dp + w + G, a1);                                  \
            __stcg(dp + w + 2u * G, a2); __stcg(dp + w + 3u * G, a3);                    \
            __stcg(dp + w + 4u * G, a4); __stcg(dp + w + 5u * G, a5);                    \
            __stcg(dp + w + 6u * G, a6); __stcg(dp + w + 7u * G, a7);                    \
        }

#define KV_LOOP(T, SRC, DST, STEP8)                                                      \
    const unsigned int G = 1u << gshift;                                                 \
    const unsigned int lane = threadIdx.x & (G - 1u);                                    \
    const unsigned int total = n * np;                                                   \
    const unsigned int ngroups = (gridDim.x * blockDim.x) >> gshift;                     \
    for (unsigned int r = (blockIdx.x * blockDim.x + threadIdx.x) >> gshift; r < total;  \
         r += ngroups) {                                                                 \
        const unsigned int i = pshift == 0xFFFFFFFFu ? r / np : r >> pshift;             \
        const unsigned int p = r - i * np;                                               \
        const T* __restrict__ sp = (const T*)(SRC(i) + __ldg(pieces + p));               \
        T* __restrict__ dp = (T*)(DST(i) + __ldg(pieces + np + p));                      \
        unsigned int w = lane;                                                           \
        STEP8(T)                                                                         \
        for (; w + 3u * G < pe; w += 4u * G) {                                           \
            T a = __ldg(sp + w), b = __ldg(sp + w + G);                                  \
            T c = __ldg(sp + w + 2u * G), d = __ldg(sp + w + 3u * G);                    \
            __stcg(dp + w, a); __stcg(dp + w + G, b);                                    \
            __stcg(dp + w + 2u * G, c); __stcg(dp + w + 3u * G, d);                      \
        }                                                                                \
        for (; w < pe; w += G) __stcg(dp + w, __ldg(sp + w));                            \
    }

#define KV_ARGS const unsigned long long* __restrict__ pieces, unsigned int n,           \
    unsigned int np, unsigned int pshift, unsigned int pe, unsigned int gshift

#ifndef KV_INLINE
#define KV_TABLE_SRC(k) __ldg(blocks + (k))
#define KV_TABLE_DST(k) __ldg(blocks + n + (k))
#define KV_CONVERT(NAME, T, STEP8)                                                       \
extern "C" __global__ void NAME(const unsigned long long* __restrict__ blocks, KV_ARGS) { \
    KV_LOOP(T, KV_TABLE_SRC, KV_TABLE_DST, STEP8)                                        \
}
KV_CONVERT(kv_convert_16, uint4, KV_NO_STEP8)
KV_CONVERT(kv_convert_16_w, uint4, KV_STEP8)
KV_CONVERT(kv_convert_8, unsigned long long, KV_NO_STEP8)
KV_CONVERT(kv_convert_4, unsigned int, KV_NO_STEP8)
KV_CONVERT(kv_convert_2, unsigned short, KV_NO_STEP8)
KV_CONVERT(kv_convert_1, unsigned char, KV_NO_STEP8)
#else
/* Sizes: INLINE_SMALL_ENTRIES / INLINE_LARGE_ENTRIES on the host. */
struct KvInlineSmall { unsigned long long b[256]; };
struct KvInlineLarge { unsigned long long b[4064]; };
/* INLINE_PACKED_ENTRIES: one u32 per block, donor id << 16 | target id;
   PACKED_TIERS: the smaller tables, so a launch sends no more parameter
   bytes than the fetch's tier needs. */
struct KvInlinePacked { unsigned int w[8128]; };
struct KvInlinePacked1024 { unsigned int w[1024]; };
struct KvInlinePacked2048 { unsigned int w[2048]; };
struct KvInlinePacked4096 { unsigned int w[4096]; };
/* __grid_constant__: the table is read in place from the parameter bank
   (constant cache), never copied to local memory by a dynamic index. */
#define KV_PARAM_SRC(k) tab.b[(k)]
#define KV_PARAM_DST(k) tab.b[n + (k)]
#define KV_CONVERT_INLINE(NAME, TAB, T, STEP8)                                           \
extern "C" __global__ void NAME(const __grid_constant__ TAB tab, KV_ARGS) {              \
    KV_LOOP(T, KV_PARAM_SRC, KV_PARAM_DST, STEP8)                                        \
}
#define KV_PACKED_SRC(k) (sbase + (unsigned long long)(tab.w[(k)] >> 16) * sstride)
#define KV_PACKED_DST(k) (dbase + (unsigned long long)(tab.w[(k)] & 0xFFFFu) * dstride)
#define KV_CONVERT_PACKED(NAME, TAB, T, STEP8)                                           \
extern "C" __global__ void NAME(const __grid_constant__ TAB tab,                         \
    unsigned long long sbase, unsigned long long dbase, unsigned long long sstride,      \
    unsigned long long dstride, KV_ARGS) {                                               \
    KV_LOOP(T, KV_PACKED_SRC, KV_PACKED_DST, STEP8)                                      \
}
KV_CONVERT_INLINE(kv_convert_s16, KvInlineSmall, uint4, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_s16_w, KvInlineSmall, uint4, KV_STEP8)
KV_CONVERT_INLINE(kv_convert_s8, KvInlineSmall, unsigned long long, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_s4, KvInlineSmall, unsigned int, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_s2, KvInlineSmall, unsigned short, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_s1, KvInlineSmall, unsigned char, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_l16, KvInlineLarge, uint4, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_l16_w, KvInlineLarge, uint4, KV_STEP8)
KV_CONVERT_INLINE(kv_convert_l8, KvInlineLarge, unsigned long long, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_l4, KvInlineLarge, unsigned int, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_l2, KvInlineLarge, unsigned short, KV_NO_STEP8)
KV_CONVERT_INLINE(kv_convert_l1, KvInlineLarge, unsigned char, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p16, KvInlinePacked, uint4, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p16_w, KvInlinePacked, uint4, KV_STEP8)
KV_CONVERT_PACKED(kv_convert_p8, KvInlinePacked, unsigned long long, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4, KvInlinePacked, unsigned int, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2, KvInlinePacked, unsigned short, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1, KvInlinePacked, unsigned char, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_16, KvInlinePacked1024, uint4, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_16_w, KvInlinePacked1024, uint4, KV_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_8, KvInlinePacked1024, unsigned long long, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_4, KvInlinePacked1024, unsigned int, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_2, KvInlinePacked1024, unsigned short, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p1024_1, KvInlinePacked1024, unsigned char, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_16, KvInlinePacked2048, uint4, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_16_w, KvInlinePacked2048, uint4, KV_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_8, KvInlinePacked2048, unsigned long long, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_4, KvInlinePacked2048, unsigned int, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_2, KvInlinePacked2048, unsigned short, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p2048_1, KvInlinePacked2048, unsigned char, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_16, KvInlinePacked4096, uint4, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_16_w, KvInlinePacked4096, uint4, KV_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_8, KvInlinePacked4096, unsigned long long, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_4, KvInlinePacked4096, unsigned int, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_2, KvInlinePacked4096, unsigned short, KV_NO_STEP8)
KV_CONVERT_PACKED(kv_convert_p4096_1, KvInlinePacked4096, unsigned char, KV_NO_STEP8)
#endif
"#;

/// NVRTC option that compiles the inline entry points of
/// [`CONVERT_KERNEL_SRC`] (with the device's `--gpu-architecture=compute_XY`,
/// 7.0 or newer).
pub const INLINE_KERNEL_DEFINE: &str = "-DKV_INLINE";

/// Table-pointer entry points of [`CONVERT_KERNEL_SRC`], widest first, with
/// their element bytes.
pub const KERNEL_NAMES: [(u32, &str); 5] = [
    (16, "kv_convert_16"),
    (8, "kv_convert_8"),
    (4, "kv_convert_4"),
    (2, "kv_convert_2"),
    (1, "kv_convert_1"),
];

/// Table-pointer 16-byte entry point with the eight-wide step (pieces of at
/// least [`super::WIDE_PIECE_BYTES`]); same arguments as `kv_convert_16`.
pub const WIDE_KERNEL_NAME: &str = "kv_convert_16_w";

/// Entry points taking the small inline table, widest first.
pub const INLINE_SMALL_NAMES: [(u32, &str); 5] = [
    (16, "kv_convert_s16"),
    (8, "kv_convert_s8"),
    (4, "kv_convert_s4"),
    (2, "kv_convert_s2"),
    (1, "kv_convert_s1"),
];

/// Entry points taking the large inline table, widest first.
pub const INLINE_LARGE_NAMES: [(u32, &str); 5] = [
    (16, "kv_convert_l16"),
    (8, "kv_convert_l8"),
    (4, "kv_convert_l4"),
    (2, "kv_convert_l2"),
    (1, "kv_convert_l1"),
];

/// Entry points taking the packed inline table, widest first. Arguments:
/// `(table, u64 src_base, u64 dst_base, u64 src_stride, u64 dst_stride,
/// const u64* pieces, u32 n, ..)`; block `i`'s donor base is `src_base +
/// (w[i] >> 16) x src_stride`, its target base `dst_base + (w[i] & 0xFFFF) x
/// dst_stride`.
pub const INLINE_PACKED_NAMES: [(u32, &str); 5] = [
    (16, "kv_convert_p16"),
    (8, "kv_convert_p8"),
    (4, "kv_convert_p4"),
    (2, "kv_convert_p2"),
    (1, "kv_convert_p1"),
];

/// Entry points of the smaller packed tables (`KvInlinePacked1024` /
/// `2048` / `4096`: 4, 8 and 16 KiB), widest first, same arguments as
/// [`INLINE_PACKED_NAMES`]: a 1024-block fetch sends a 4 KiB parameter, not
/// 32 KiB (the driver copies the whole struct with every launch).
pub const PACKED_TIER_NAMES: [(usize, [(u32, &str); 5]); 3] = [
    (
        1024,
        [
            (16, "kv_convert_p1024_16"),
            (8, "kv_convert_p1024_8"),
            (4, "kv_convert_p1024_4"),
            (2, "kv_convert_p1024_2"),
            (1, "kv_convert_p1024_1"),
        ],
    ),
    (
        2048,
        [
            (16, "kv_convert_p2048_16"),
            (8, "kv_convert_p2048_8"),
            (4, "kv_convert_p2048_4"),
            (2, "kv_convert_p2048_2"),
            (1, "kv_convert_p2048_1"),
        ],
    ),
    (
        4096,
        [
            (16, "kv_convert_p4096_16"),
            (8, "kv_convert_p4096_8"),
            (4, "kv_convert_p4096_4"),
            (2, "kv_convert_p4096_2"),
            (1, "kv_convert_p4096_1"),
        ],
    ),
];

/// Whether pieces of `piece_bytes` copied as `width`-byte elements launch
/// the eight-wide entry point ([`TablePlacement::wide_name`]): 16-byte
/// elements and pieces of at least [`super::WIDE_PIECE_BYTES`]. The eight-wide
/// step is compiled only into those entry points because its mere presence
/// in the loop cost the HF fetch (256-byte pieces, where it never runs)
/// 0.890 -> 0.722 of the raw copy on the H200 (bisect of 7d474c0).
pub fn wide_piece(piece_bytes: u64, width: u32) -> bool {
    width == 16 && piece_bytes >= super::WIDE_PIECE_BYTES
}

/// u32 entries of the packed inline table (`KvInlinePacked`, 32,512 bytes;
/// one per block).
pub const INLINE_PACKED_ENTRIES: usize = 8128;
/// Blocks the packed table holds.
pub const INLINE_PACKED_BLOCKS: usize = INLINE_PACKED_ENTRIES;
/// Block ids the packed table can name (16 bits each side).
pub const PACKED_MAX_BLOCK_ID: u32 = u16::MAX as u32;

/// u64 entries of the small inline table (`KvInlineSmall`, 2 KiB).
pub const INLINE_SMALL_ENTRIES: usize = 256;
/// Blocks the small inline table holds (two entries each).
pub const INLINE_SMALL_BLOCKS: usize = INLINE_SMALL_ENTRIES / 2;
/// u64 entries of the large inline table (`KvInlineLarge`, 32,512 bytes:
/// with the pointer and five u32 scalars the parameters are 32,540 bytes,
/// under the 32,764-byte limit).
pub const INLINE_LARGE_ENTRIES: usize = 4064;
/// Blocks the large inline table holds.
pub const INLINE_LARGE_BLOCKS: usize = INLINE_LARGE_ENTRIES / 2;

// Parameters: the table, the piece-table pointer, five u32 scalars; the
// small table fits the classic 4 KiB limit, the large one CUDA 12.1's.
const _: () = assert!(INLINE_SMALL_ENTRIES * 8 + 8 + 5 * 4 <= 4096);
const _: () = assert!(INLINE_LARGE_ENTRIES * 8 + 8 + 5 * 4 <= 32_764);
const _: () = assert!(INLINE_PACKED_ENTRIES * 4 + 4 * 8 + 8 + 5 * 4 <= 32_764);
// The first packed tier starts right past the small table.
const _: () = assert!(INLINE_SMALL_BLOCKS == 128);

/// Where one launch's block table lives (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TablePlacement {
    /// A 2 KiB kernel parameter.
    InlineSmall,
    /// A 32,512-byte kernel parameter.
    InlineLarge,
    /// A 32,512-byte kernel parameter of packed 16-bit block ids, with the
    /// region bases and block strides as scalars (4,097..=8,128 blocks).
    InlinePacked,
    /// Packed ids in a 4 KiB parameter (129..=1,024 blocks).
    InlinePacked1024,
    /// Packed ids in an 8 KiB parameter (1,025..=2,048 blocks).
    InlinePacked2048,
    /// Packed ids in a 16 KiB parameter (2,049..=4,096 blocks).
    InlinePacked4096,
    /// A device buffer uploaded before the launch.
    #[default]
    Device,
}

impl TablePlacement {
    /// The placement for a launch of `blocks` blocks; `inline_loaded` is
    /// whether the inline entry points are loaded on the device (CUDA 12.1+
    /// driver, compute capability 7.0+, the inline module compiled),
    /// `packable` whether the plan has packed ids
    /// ([`super::ConvertPlan::packed`]). The smallest inline table that
    /// holds the fetch is used: the whole parameter struct goes out with
    /// every launch, whatever `n` is.
    pub fn for_blocks(blocks: usize, inline_loaded: bool, packable: bool) -> Self {
        // Past 128 blocks the table goes as packed 16-bit ids in the
        // smallest parameter that holds them: the device table's separate
        // upload cost 6.7-7.3 us of a 45-90 us fetch on the H200 (1024 x
        // 64 KiB, 512-block 8B rows), and a 32 KiB u64 parameter slowed the
        // kernel by more than that (1024 x 64 KiB: 52.2 us against 41.6),
        // so the parameter stays at 4 bytes a block in 4 / 8 / 16 / 32 KiB
        // tiers. Fetches whose ids are not packable (ids past 65,535,
        // irregular strides) use the device table; `InlineLarge` stays
        // compiled for measurements.
        if !inline_loaded {
            return Self::Device;
        }
        if blocks <= INLINE_SMALL_BLOCKS {
            return Self::InlineSmall;
        }
        match blocks {
            _ if !packable => Self::Device,
            129..=1024 => Self::InlinePacked1024,
            1025..=2048 => Self::InlinePacked2048,
            2049..=4096 => Self::InlinePacked4096,
            4097..=INLINE_PACKED_BLOCKS => Self::InlinePacked,
            _ => Self::Device,
        }
    }

    /// Ids the placement's packed table holds; `None` when it is not a
    /// packed table.
    pub fn packed_capacity(self) -> Option<usize> {
        match self {
            Self::InlinePacked1024 => Some(1024),
            Self::InlinePacked2048 => Some(2048),
            Self::InlinePacked4096 => Some(4096),
            Self::InlinePacked => Some(INLINE_PACKED_ENTRIES),
            _ => None,
        }
    }

    /// The 16-byte entry point of this placement with the eight-wide step
    /// (`KV_STEP8`), launched when [`super::LaunchGeometry::wide`] is set;
    /// the entries of [`TablePlacement::names`] run the four-wide loop only.
    pub fn wide_name(self) -> &'static str {
        match self {
            Self::InlineSmall => "kv_convert_s16_w",
            Self::InlineLarge => "kv_convert_l16_w",
            Self::InlinePacked => "kv_convert_p16_w",
            Self::InlinePacked1024 => "kv_convert_p1024_16_w",
            Self::InlinePacked2048 => "kv_convert_p2048_16_w",
            Self::InlinePacked4096 => "kv_convert_p4096_16_w",
            Self::Device => WIDE_KERNEL_NAME,
        }
    }

    /// Entry points for this placement, widest first.
    pub fn names(self) -> &'static [(u32, &'static str); 5] {
        match self {
            Self::InlineSmall => &INLINE_SMALL_NAMES,
            Self::InlineLarge => &INLINE_LARGE_NAMES,
            Self::InlinePacked => &INLINE_PACKED_NAMES,
            Self::InlinePacked1024 => &PACKED_TIER_NAMES[0].1,
            Self::InlinePacked2048 => &PACKED_TIER_NAMES[1].1,
            Self::InlinePacked4096 => &PACKED_TIER_NAMES[2].1,
            Self::Device => &KERNEL_NAMES,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_picks_the_smallest_table_that_holds_the_fetch() {
        let p = |n| TablePlacement::for_blocks(n, true, false);
        assert_eq!(p(1), TablePlacement::InlineSmall);
        assert_eq!(p(7), TablePlacement::InlineSmall);
        assert_eq!(p(128), TablePlacement::InlineSmall);
        // Ids that do not pack (past 16 bits, irregular strides): the
        // device table past the small inline one.
        assert_eq!(p(129), TablePlacement::Device);
        assert_eq!(p(1024), TablePlacement::Device);
        assert_eq!(p(4096), TablePlacement::Device);
        assert_eq!(
            TablePlacement::for_blocks(7, false, true),
            TablePlacement::Device
        );
        assert_eq!(
            TablePlacement::for_blocks(1024, false, true),
            TablePlacement::Device
        );
        // Packed ids take 129..=8128 blocks in the smallest tier: the
        // 1024 x 64 KiB fetch sends 4 KiB, 4096 x 16 KiB 16 KiB.
        let q = |n| TablePlacement::for_blocks(n, true, true);
        assert_eq!(q(128), TablePlacement::InlineSmall);
        assert_eq!(q(129), TablePlacement::InlinePacked1024);
        assert_eq!(q(512), TablePlacement::InlinePacked1024);
        assert_eq!(q(1024), TablePlacement::InlinePacked1024);
        assert_eq!(q(1025), TablePlacement::InlinePacked2048);
        assert_eq!(q(2048), TablePlacement::InlinePacked2048);
        assert_eq!(q(2049), TablePlacement::InlinePacked4096);
        assert_eq!(q(4096), TablePlacement::InlinePacked4096);
        assert_eq!(q(4097), TablePlacement::InlinePacked);
        assert_eq!(q(8128), TablePlacement::InlinePacked);
        assert_eq!(q(8129), TablePlacement::Device);
        for n in [129, 1024, 1025, 2049, 4097, 8128] {
            let cap = q(n).packed_capacity().unwrap();
            assert!(n <= cap, "{n} blocks in a table of {cap}");
        }
        assert_eq!(TablePlacement::InlineSmall.packed_capacity(), None);
        assert_eq!(
            TablePlacement::InlineLarge.names()[0],
            (16, "kv_convert_l16")
        );
        assert_eq!(
            TablePlacement::InlinePacked1024.names()[4],
            (1, "kv_convert_p1024_1")
        );
    }

    #[test]
    fn inline_tables_match_the_kernel_structs_and_the_parameter_limit() {
        // The C structs are sized by literals; they must match the host.
        let small = format!("b[{INLINE_SMALL_ENTRIES}]");
        let large = format!("b[{INLINE_LARGE_ENTRIES}]");
        let packed = format!("w[{INLINE_PACKED_ENTRIES}]");
        assert!(CONVERT_KERNEL_SRC.contains(&packed), "{packed}");
        assert!(CONVERT_KERNEL_SRC.contains(&small), "{small}");
        assert!(CONVERT_KERNEL_SRC.contains(&large), "{large}");
        for (ids, names) in &PACKED_TIER_NAMES {
            let tier = format!("struct KvInlinePacked{ids} {{ unsigned int w[{ids}]; }}");
            assert!(CONVERT_KERNEL_SRC.contains(&tier), "{tier}");
            let entry = format!("({}, KvInlinePacked{ids},", names[0].1);
            assert!(CONVERT_KERNEL_SRC.contains(&entry), "{entry}");
        }
        for names in [
            &INLINE_SMALL_NAMES,
            &INLINE_LARGE_NAMES,
            &INLINE_PACKED_NAMES,
            &PACKED_TIER_NAMES[0].1,
            &PACKED_TIER_NAMES[1].1,
            &PACKED_TIER_NAMES[2].1,
            &KERNEL_NAMES,
        ] {
            for (_, n) in names {
                assert!(CONVERT_KERNEL_SRC.contains(&format!("({n},")), "{n}");
            }
        }
        for p in [
            TablePlacement::InlineSmall,
            TablePlacement::InlineLarge,
            TablePlacement::InlinePacked,
            TablePlacement::InlinePacked1024,
            TablePlacement::InlinePacked2048,
            TablePlacement::InlinePacked4096,
            TablePlacement::Device,
        ] {
            let (four, wide) = (p.names()[0].1, p.wide_name());
            assert_eq!(wide, format!("{four}_w"), "{p:?}");
            let line = CONVERT_KERNEL_SRC
                .lines()
                .find(|l| l.contains(&format!("({wide},")))
                .unwrap_or_else(|| panic!("no {wide}"));
            assert!(line.ends_with("uint4, KV_STEP8)"), "{line}");
        }
    }
}
