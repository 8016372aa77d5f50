"""Fetches into the engine's own KV tensors at the engine's block ids, in
vLLM's layouts (kv-first, block-first) and block-major: every byte of every
row checked against the donor's block-major pattern, untouched rows intact."""

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TP
from donor_proc import pattern
from test_roles import donor, router_for  # noqa: F401  (fixture)

ROWS = 16
# The engine's allocator gave the prefix these (scattered) block ids.
ENGINE_BLOCKS = [9, 2, 5, 14, 0, 7]
SENTINEL = np.float32(-1.5)


def dims(layout):
    # Layout(2 layers, 2 KV heads, head dim 8, f32, 64 tokens/block, TP 2):
    # one KV head per rank.
    return 2, layout.tokens_per_block, 2 // TP, 8


def expected(layout, kv_layout, rank, rows):
    L, T, H, D = dims(layout)
    if kv_layout == "block_major":
        want = np.full((ROWS, layout.rank_block_elems), SENTINEL, dtype=np.float32)
    elif kv_layout == "vllm_kv_first":
        want = np.full((L, 2, ROWS, T, H, D), SENTINEL, dtype=np.float32)
    else:
        want = np.full((L, ROWS, 2, T, H, D), SENTINEL, dtype=np.float32)
    for block, row in enumerate(rows):
        # A bank block is [layer][K/V][token][head][dim].
        b = pattern(layout, rank, block)
        if kv_layout == "block_major":
            want[row] = b
        elif kv_layout == "vllm_kv_first":
            want[:, :, row] = b.reshape(L, 2, T, H, D)
        else:
            want[:, row] = b.reshape(L, 2, T, H, D)
    return want


@pytest.mark.parametrize("kv_layout", ["block_major", "vllm_kv_first", "vllm_block_first"])
@pytest.mark.parametrize("engine_chosen", [True, False])
def test_fetch_lands_at_the_engines_blocks_every_byte(donor, layout, enabled, kv_layout, engine_chosen):  # noqa: F811
    _, report = donor
    caches = [expected(layout, kv_layout, r, []) for r in range(TP)]
    target = kv_reuse.Target(layout, rows=ROWS, kv_caches=caches, kv_layout=kv_layout)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-engine", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    dst = ENGINE_BLOCKS if engine_chosen else None
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]),
                      dst_blocks=dst) as out:
        if engine_chosen:
            assert out.rows == ENGINE_BLOCKS
        assert len(out.rows) == BLOCKS
        for r in range(TP):
            assert caches[r].tobytes() == expected(layout, kv_layout, r, out.rows).tobytes()
    assert target.free_rows == ROWS


def test_engine_layout_refusals_name_the_argument(donor, layout, enabled):  # noqa: F811
    _, report = donor
    L, T, H, D = dims(layout)
    ok = [np.zeros((L, 2, ROWS, T, H, D), dtype=np.float32) for _ in range(TP)]
    with pytest.raises(kv_reuse.BadArgument, match="kv_layout: `hf_tokens` is not one of"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=ok, kv_layout="hf_tokens")
    with pytest.raises(kv_reuse.BadArgument, match="kv_caches: required with kv_layout"):
        kv_reuse.Target(layout, rows=ROWS, kv_layout="vllm_kv_first")
    # A block-first tensor handed in as kv-first: the shape says so.
    bf = [np.zeros((L, ROWS, 2, T, H, D), dtype=np.float32) for _ in range(TP)]
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]: shape \[2, 16, 2, "):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=bf, kv_layout="vllm_kv_first")
    target = kv_reuse.Target(layout, rows=ROWS, kv_caches=ok, kv_layout="vllm_kv_first")
    with pytest.raises(kv_reuse.BadArgument, match="row: read_row reads block-major rows"):
        target.read_row(0, 0)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-bad-dst", report["hashes"], target.engine_id)
    manifest = bytes.fromhex(report["manifest"])
    # An allocator bug is an argument error, named before anything is touched (not a fallback).
    for dst, why in (([1, 2], r"^dst_blocks: 2 ids given, the hint fetches 6 blocks"),
                     ([1, 1, 2, 3, 4, 5], r"^dst_blocks\[1\]: 1 is given twice$"),
                     ([1, 2, 3, 4, 5, ROWS], rf"^dst_blocks\[5\]: {ROWS} is not below rows {ROWS}$")):
        with pytest.raises(kv_reuse.BadArgument, match=why):
            target.fetch(advice.hint, report["hashes"], manifest, dst_blocks=dst)
    # Nothing was written or kept by the refused fetches.
    assert all(not c.any() for c in ok)
    assert target.free_rows == ROWS
