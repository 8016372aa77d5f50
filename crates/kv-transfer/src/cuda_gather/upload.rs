//! How a block-major gather's block table reaches the kernel
//! ([`GatherUpload`], `KV_GATHER_UPLOAD`) and, for the pipelined variant,
//! where a part's runs are cut into launches ([`PipelineChunks`]).
//!
//! A scattered fetch's host work before the first byte moves is, per run,
//! the bounds pass of `deliver` and the one pass of [`super::RunsGather`]
//! that checks the runs and packs the ids (5.3 / 11.4 µs for 1024 / 4096
//! runs on the H200's host, against a 44-45 µs kernel). The pipelined
//! variant packs and launches only a first chunk of the runs (by default
//! 16 MiB of rows), then packs chunk `k + 1` while chunk `k`'s kernel runs:
//! only the first chunk's packing is exposed, at the price of one kernel
//! boundary per extra launch on the stream. Every chunk is the same launch
//! as an unchunked fetch of its runs (its own [`super::RunsGather`], its own
//! inline table), on the same stream, and the part synchronizes the stream
//! once after the last, so quiescence and byte accounting are unchanged.
//!
//! Nothing here calls CUDA.

use crate::plan::CopyRun;

use super::INLINE_PACKED_BLOCKS;

/// Environment variable selecting [`GatherUpload`] (`params`, `pipelined`,
/// `pipelined2`, `copy`), read by `CudaCopyBackend::new`.
pub const UPLOAD_ENV: &str = "KV_GATHER_UPLOAD";
/// Environment variable overriding [`Pipeline::first_bytes`] (KiB).
pub const PIPELINE_FIRST_ENV: &str = "KV_GATHER_PIPELINE_FIRST_KIB";
/// Environment variable overriding [`Pipeline::growth`].
pub const PIPELINE_GROWTH_ENV: &str = "KV_GATHER_PIPELINE_GROWTH";

/// How the block table of a gather launch reaches the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GatherUpload {
    /// The table as a kernel parameter whenever it fits (small u64 table up
    /// to 128 blocks, packed ids in 4-32 KiB tiers up to 8,128), one launch
    /// per part (per 65,536 blocks); otherwise the device table.
    Params,
    /// As [`GatherUpload::Params`], and a block-major part of more than
    /// [`Pipeline::first_bytes`] is cut into launches of growing size
    /// ([`PipelineChunks`]) so the host packs chunk `k + 1` while chunk `k`
    /// runs. One stream: chunk `k + 1` starts when chunk `k` has finished.
    Pipelined,
    /// As [`GatherUpload::Pipelined`], odd chunks on a second stream of the
    /// device, so chunk `k + 1`'s CTAs can start while chunk `k` drains
    /// (a small first chunk leaves SMs free). Chunks write disjoint target
    /// rows (a `TransferPlan` writes no block twice); the part
    /// synchronizes both streams before it returns. The default: best or
    /// tied of the four on every row of the H200 comparison
    /// (`docs/qualification/h200-s13/call2/`).
    #[default]
    Pipelined2,
    /// Always the device table: the block table written into page-locked
    /// memory and copied with one `cuMemcpyHtoDAsync` before the launch
    /// (the path of drivers older than CUDA 12.1), for comparison.
    Copy,
}

impl GatherUpload {
    /// Every variant, in the order the benchmark documents them.
    pub const ALL: [Self; 4] = [Self::Params, Self::Pipelined, Self::Pipelined2, Self::Copy];

    /// `params`, `pipelined`, `pipelined2` or `copy`: the value of
    /// [`UPLOAD_ENV`].
    pub fn label(self) -> &'static str {
        match self {
            Self::Params => "params",
            Self::Pipelined => "pipelined",
            Self::Pipelined2 => "pipelined2",
            Self::Copy => "copy",
        }
    }

    /// True for the variants that cut a part into [`PipelineChunks`].
    pub fn pipelines(self) -> bool {
        matches!(self, Self::Pipelined | Self::Pipelined2)
    }

    /// The variant named `s` (case-insensitive, surrounding space ignored).
    ///
    /// # Errors
    /// The accepted names, when `s` is none of them.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Self::ALL
            .into_iter()
            .find(|v| v.label().eq_ignore_ascii_case(t))
            .ok_or_else(|| format!("`{s}` is not one of params, pipelined, pipelined2, copy"))
    }

    /// True when an inline (kernel parameter) table may be used.
    pub fn inline_allowed(self) -> bool {
        self != Self::Copy
    }
}

/// Fewest runs of a chunk of [`PipelineChunks`] (unless the part ends):
/// packing fewer costs the host under a microsecond (128 x 2 MiB: 0.85 µs
/// on the H200), less than the kernel boundary a cut adds. A remainder of
/// fewer runs joins the chunk before it (block cap permitting).
pub const PIPELINE_MIN_RUNS: usize = 128;

/// Chunk sizes of [`GatherUpload::Pipelined`]: the first launch covers at
/// least `first_bytes` of rows, each later one up to `growth` times the
/// bytes of the one before, every one at least [`PIPELINE_MIN_RUNS`] runs
/// and none more than [`INLINE_PACKED_BLOCKS`] blocks (so every chunk can go
/// as an inline table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pipeline {
    first_bytes: u64,
    growth: u64,
}

impl Default for Pipeline {
    /// 16 MiB first (256 x 64 KiB or 1024 x 16 KiB rows: about 11 µs of
    /// kernel on an H200, longer than packing the rest and launching it),
    /// growth 4: 1024 x 64 KiB goes as 256 + 768 rows, 4096 x 16 KiB as
    /// 1024 + 3072, two launches on the two streams of
    /// [`GatherUpload::Pipelined2`]. Measured on an H100 (session 27,
    /// `docs/qualification/s27/`, two rounds each, ratio to the raw copy):
    /// 1024 x 64 KiB 0.939 / 0.927 against 0.892 / 0.901 at the former 8 MiB
    /// (three launches) and 0.901 / 0.902 as one launch (`params`);
    /// 4096 x 16 KiB 0.914 / 0.917 against 0.887 / 0.887 and 0.868 / 0.872.
    fn default() -> Self {
        Self {
            first_bytes: 16 << 20,
            growth: 4,
        }
    }
}

impl Pipeline {
    /// A first chunk of at least `first_bytes` (>= 64 KiB), later ones up
    /// to `growth` (2..=64) times the previous.
    ///
    /// # Errors
    /// Naming `first_bytes` or `growth` when out of range.
    pub fn new(first_bytes: u64, growth: u64) -> Result<Self, String> {
        if first_bytes < 64 << 10 {
            return Err(format!("first_bytes {first_bytes} is below 65536"));
        }
        if !(2..=64).contains(&growth) {
            return Err(format!("growth {growth} is not in 2..=64"));
        }
        Ok(Self {
            first_bytes,
            growth,
        })
    }

    /// Bytes of rows the first launch covers at least.
    pub fn first_bytes(&self) -> u64 {
        self.first_bytes
    }

    /// Most bytes of a chunk over the bytes of the chunk before it.
    pub fn growth(&self) -> u64 {
        self.growth
    }

    /// The launches of `runs` (each run `blocks` rows of its `len` bytes).
    pub fn chunks<'a>(&self, runs: &'a [CopyRun]) -> PipelineChunks<'a> {
        PipelineChunks {
            runs,
            next: 0,
            target: self.first_bytes,
            growth: self.growth,
        }
    }

    /// The launches of `blocks` rows of `block_bytes` each, as `(first
    /// row, rows)`: the chunks [`Pipeline::chunks`] cuts from as many
    /// single-row runs, found by arithmetic (a part launched from its
    /// [`super::PackedRows`] reads no run). A merged run of the plan is
    /// rows like any other here: a launch only needs its rows' ids.
    pub fn block_chunks(&self, blocks: usize, block_bytes: u64) -> BlockChunks {
        BlockChunks {
            blocks,
            block_bytes,
            next: 0,
            target: self.first_bytes,
            growth: self.growth,
        }
    }
}

/// Consecutive row ranges of a part, one launch each: [`Pipeline::block_chunks`].
#[derive(Debug, Clone)]
pub struct BlockChunks {
    blocks: usize,
    block_bytes: u64,
    next: usize,
    /// Bytes the next chunk covers at least (as [`PipelineChunks`]).
    target: u64,
    growth: u64,
}

impl Iterator for BlockChunks {
    /// `(first row, rows)`.
    type Item = (usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.next;
        let left = self.blocks.checked_sub(start).filter(|&l| l > 0)?;
        // `PipelineChunks` adds one row at a time while the chunk is short
        // of the target bytes or of the fewest runs, stopping at the block
        // cap (the first row always goes) or the end: the smallest count
        // meeting both, capped.
        let to_target = match self.block_bytes {
            0 => usize::MAX,
            b => usize::try_from(self.target.div_ceil(b)).unwrap_or(usize::MAX),
        };
        let mut rows = to_target
            .clamp(PIPELINE_MIN_RUNS, INLINE_PACKED_BLOCKS)
            .min(left);
        // A short remainder joins this chunk when the cap allows.
        let rest = left - rows;
        if rest > 0 && rest < PIPELINE_MIN_RUNS && rows + rest <= INLINE_PACKED_BLOCKS {
            rows += rest;
        }
        self.next = start + rows;
        let bytes = rows as u64 * self.block_bytes;
        self.target = bytes.max(1).saturating_mul(self.growth);
        Some((start, rows))
    }
}

/// Consecutive slices of a part's runs, one launch each (see [`Pipeline`]).
/// A slice is found when it is asked for, so finding chunk `k + 1` runs on
/// the host while chunk `k`'s kernel runs. Every run lands in exactly one
/// chunk, in order; a run of more than [`INLINE_PACKED_BLOCKS`] rows is a
/// chunk of its own.
#[derive(Debug, Clone)]
pub struct PipelineChunks<'a> {
    runs: &'a [CopyRun],
    next: usize,
    /// Bytes the next chunk covers at least (unless the runs end or the
    /// block cap is reached first).
    target: u64,
    growth: u64,
}

impl<'a> Iterator for PipelineChunks<'a> {
    type Item = &'a [CopyRun];

    fn next(&mut self) -> Option<Self::Item> {
        let start = self.next;
        if start >= self.runs.len() {
            return None;
        }
        let (mut end, mut bytes, mut blocks) = (start, 0u64, 0usize);
        let len = self.runs.len();
        while end < len && (bytes < self.target || end - start < PIPELINE_MIN_RUNS) {
            let r = &self.runs[end];
            let rows = r.blocks as usize;
            if end > start && blocks + rows > INLINE_PACKED_BLOCKS {
                break;
            }
            bytes += r.len;
            blocks += rows;
            end += 1;
        }
        // A short remainder is not worth a launch of its own.
        if end < len && len - end < PIPELINE_MIN_RUNS {
            let rest: usize = self.runs[end..].iter().map(|r| r.blocks as usize).sum();
            if blocks + rest <= INLINE_PACKED_BLOCKS {
                bytes += self.runs[end..].iter().map(|r| r.len).sum::<u64>();
                end = len;
            }
        }
        self.next = end;
        self.target = bytes.max(1).saturating_mul(self.growth);
        Some(&self.runs[start..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: u32, blocks: u32, bb: u64) -> Vec<CopyRun> {
        (0..n)
            .map(|i| CopyRun {
                src_block: 2 * i * blocks + 1,
                dst_block: i * blocks,
                blocks,
                src_offset: u64::from(2 * i * blocks + 1) * bb,
                dst_offset: u64::from(i * blocks) * bb,
                len: u64::from(blocks) * bb,
            })
            .collect()
    }

    fn sizes(p: &Pipeline, runs: &[CopyRun]) -> Vec<usize> {
        p.chunks(runs).map(<[CopyRun]>::len).collect()
    }

    #[test]
    fn default_chunks_of_the_benchmark_shapes() {
        let p = Pipeline::default();
        assert_eq!((p.first_bytes(), p.growth()), (16 << 20, 4));
        assert_eq!(sizes(&p, &rows(1024, 1, 64 << 10)), [256, 768]);
        assert_eq!(sizes(&p, &rows(4096, 1, 16 << 10)), [1024, 3072]);
        // 128 x 2 MiB: fewer runs than a chunk's minimum, one launch.
        assert_eq!(sizes(&p, &rows(128, 1, 2 << 20)), [128]);
        // A fetch no larger than the first chunk is one launch, and a
        // remainder under 128 runs joins the chunk before it.
        assert_eq!(sizes(&p, &rows(7, 1, 32 << 10)), [7]);
        assert_eq!(sizes(&p, &rows(128, 1, 64 << 10)), [128]);
        assert_eq!(sizes(&p, &rows(255, 1, 64 << 10)), [255]);
        assert_eq!(sizes(&p, &rows(256, 1, 64 << 10)), [256]);
        assert_eq!(sizes(&p, &rows(384, 1, 64 << 10)), [256, 128]);
        assert_eq!(sizes(&p, &rows(383, 1, 64 << 10)), [383]);
        assert_eq!(sizes(&p, &rows(700, 1, 64 << 10)), [256, 444]);
        // 4 KiB rows: the first 16 MiB is 4,096 runs, the rest fits one.
        assert_eq!(sizes(&p, &rows(8128, 1, 4 << 10)), [4096, 4032]);
        assert!(p.chunks(&[]).next().is_none());
    }

    #[test]
    fn chunks_cover_every_run_once_in_order_within_the_block_cap() {
        let p = Pipeline::new(64 << 10, 2).unwrap();
        for (n, blocks, bb) in [(9000u32, 1u32, 64u64), (300, 50, 4096), (3, 9000, 64)] {
            let runs = rows(n, blocks, bb);
            let chunks: Vec<&[CopyRun]> = p.chunks(&runs).collect();
            let joined: Vec<CopyRun> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(joined, runs, "{n} runs of {blocks}");
            for c in &chunks {
                let b: u32 = c.iter().map(|r| r.blocks).sum();
                assert!(
                    b as usize <= INLINE_PACKED_BLOCKS || c.len() == 1,
                    "{b} blocks in {} runs",
                    c.len()
                );
            }
        }
        // 64-byte rows, first 64 KiB (1024 rows), doubling, capped at 8128.
        assert_eq!(sizes(&p, &rows(9000, 1, 64)), [1024, 2048, 4096, 1832]);
        // 9000-row runs: one chunk each, past the cap.
        assert_eq!(sizes(&p, &rows(3, 9000, 64)), [1, 1, 1]);
        // 50-row runs: 128 runs (6,400 blocks) first, then up to the
        // 8,128-block cap (162 runs); the last 10 do not fit it and go
        // alone.
        assert_eq!(sizes(&p, &rows(300, 50, 4096)), [128, 162, 10]);
    }

    /// Row ranges of a packed part are exactly the chunks of as many
    /// single-row runs, for the benchmark shapes and any knobs.
    #[test]
    fn block_chunks_are_the_chunks_of_single_row_runs() {
        let p = Pipeline::default();
        let got: Vec<(usize, usize)> = p.block_chunks(1024, 64 << 10).collect();
        assert_eq!(got, [(0, 256), (256, 768)]);
        let got: Vec<(usize, usize)> = p.block_chunks(4096, 16 << 10).collect();
        assert_eq!(got, [(0, 1024), (1024, 3072)]);
        assert!(p.block_chunks(0, 64).next().is_none());
        for first_kib in [64u64, 1024, 2048, 8192, 65536] {
            for growth in [2u64, 3, 4, 64] {
                let p = Pipeline::new(first_kib << 10, growth).unwrap();
                for n in [
                    1u32, 127, 128, 129, 255, 256, 700, 1024, 4096, 8128, 8129, 9000, 20000,
                ] {
                    for bb in [64u64, 4 << 10, 16 << 10, 64 << 10, 2 << 20, 3 << 20] {
                        let runs = rows(n, 1, bb);
                        let want: Vec<usize> = sizes(&p, &runs);
                        let got: Vec<(usize, usize)> = p.block_chunks(n as usize, bb).collect();
                        let lens: Vec<usize> = got.iter().map(|c| c.1).collect();
                        assert_eq!(
                            lens, want,
                            "{n} x {bb}, first {first_kib} KiB, growth {growth}"
                        );
                        let mut at = 0;
                        for (start, len) in got {
                            assert_eq!(start, at);
                            at += len;
                        }
                        assert_eq!(at, n as usize);
                    }
                }
            }
        }
    }

    #[test]
    fn growth_bounds_each_chunk_by_the_bytes_before_it() {
        let p = Pipeline::new(1 << 20, 3).unwrap();
        let runs = rows(1000, 1, 1 << 20);
        let chunks: Vec<&[CopyRun]> = p.chunks(&runs).collect();
        let bytes: Vec<u64> = chunks
            .iter()
            .map(|c| c.iter().map(|r| r.len).sum())
            .collect();
        // 1 MiB first, but at least 128 runs; then 3x the bytes before.
        assert_eq!(bytes[0], 128 << 20);
        for w in bytes.windows(2) {
            assert!(w[1] <= 3 * w[0], "{bytes:?}");
        }
        assert_eq!(sizes(&p, &runs), [128, 384, 488]);
    }

    #[test]
    fn variants_parse_by_name_and_pipeline_knobs_are_checked() {
        assert_eq!(GatherUpload::default(), GatherUpload::Pipelined2);
        for v in GatherUpload::ALL {
            assert_eq!(GatherUpload::parse(v.label()), Ok(v));
        }
        assert_eq!(GatherUpload::parse(" PARAMS "), Ok(GatherUpload::Params));
        let e = GatherUpload::parse("mapped").unwrap_err();
        assert!(e.contains("params, pipelined, pipelined2, copy"), "{e}");
        assert_eq!(
            GatherUpload::parse("pipelined2"),
            Ok(GatherUpload::Pipelined2)
        );
        assert!(GatherUpload::Pipelined2.pipelines() && GatherUpload::Pipelined.pipelines());
        assert!(!GatherUpload::Params.pipelines() && !GatherUpload::Copy.pipelines());
        assert!(!GatherUpload::Copy.inline_allowed());
        assert!(GatherUpload::Params.inline_allowed());
        assert!(GatherUpload::Pipelined.inline_allowed());
        assert!(Pipeline::new(32 << 10, 4)
            .unwrap_err()
            .contains("first_bytes"));
        assert!(Pipeline::new(8 << 20, 1).unwrap_err().contains("growth"));
        assert!(Pipeline::new(8 << 20, 65).unwrap_err().contains("growth"));
        assert_eq!(Pipeline::new(16 << 20, 4).unwrap(), Pipeline::default());
    }
}
