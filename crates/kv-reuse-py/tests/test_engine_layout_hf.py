"""Fetches into HF-style per-layer caches (kv_layout="hf"): the engine's K and
V tensors [1, H, capacity, D] per layer, blocks landing at token positions,
converted inside the copy; every byte checked against the donor's
block-major pattern, every other token untouched."""

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TP
from donor_proc import pattern
from test_roles import donor, router_for  # noqa: F401  (fixture)

ROWS = 16
SENTINEL = np.float32(-1.5)


def dims(layout):
    # Layout(2 layers, 2 KV heads, head dim 8, f32, 64 tokens/block, TP 2).
    return 2, layout.tokens_per_block, 2 // TP, 8


def buffers(layout, capacity, extra_tokens=0):
    """Per rank one buffer [L, 2, 1, H, capacity + extra, D]; the caches are
    views buf[l, kv, :, :, :capacity] (token stride D, head stride as sliced)."""
    L, T, H, D = dims(layout)
    bufs = [np.full((L, 2, 1, H, capacity + extra_tokens, D), SENTINEL, dtype=np.float32) for _ in range(TP)]
    caches = [[b[l, kv, :, :, :capacity] for l in range(L) for kv in range(2)] for b in bufs]
    return bufs, caches


def expected(layout, capacity, extra, rank, start_token, n):
    L, T, H, D = dims(layout)
    want = np.full((L, 2, 1, H, capacity + extra, D), SENTINEL, dtype=np.float32)
    for j in range(n):
        # A bank block is [layer][K/V][token][head][dim]; HF is [head][token][dim].
        b = pattern(layout, rank, j).reshape(L, 2, T, H, D)
        t0 = start_token + j * T
        want[:, :, 0, :, t0:t0 + T, :] = b.transpose(0, 1, 3, 2, 4)
    return want


@pytest.mark.parametrize("offset_blocks", [None, 0, 3])
@pytest.mark.parametrize("extra", [0, 40])
def test_hf_fetch_lands_at_token_positions_every_byte(donor, layout, enabled, offset_blocks, extra):  # noqa: F811
    _, report = donor
    T = layout.tokens_per_block
    cap = ROWS * T
    bufs, caches = buffers(layout, cap, extra)
    target = kv_reuse.Target(layout, rows=ROWS, kv_caches=caches, kv_layout="hf")
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-hf", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    kw = {} if offset_blocks is None else {"dst_token_offset": offset_blocks * T}
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]), **kw) as out:
        assert out.fetch_from == 0
        first = offset_blocks or 0
        assert out.rows == list(range(first, first + BLOCKS))
        for r in range(TP):
            assert bufs[r].tobytes() == expected(layout, cap, extra, r, first * T, BLOCKS).tobytes()
    assert target.free_rows == ROWS


def test_hf_accepts_kv_pairs(donor, layout, enabled):  # noqa: F811
    _, report = donor
    T = layout.tokens_per_block
    bufs, caches = buffers(layout, ROWS * T)
    pairs = [[(c[2 * l], c[2 * l + 1]) for l in range(len(c) // 2)] for c in caches]
    target = kv_reuse.Target(layout, rows=ROWS, kv_caches=pairs, kv_layout="hf")
    advice = router_for(report, layout, enabled, target).advise("req-hf-pairs", report["hashes"], target.engine_id)
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"])):
        for r in range(TP):
            assert bufs[r].tobytes() == expected(layout, ROWS * T, 0, r, 0, BLOCKS).tobytes()


def test_hf_refusals_name_the_argument(donor, layout, enabled):  # noqa: F811
    _, report = donor
    L, T, H, D = dims(layout)
    cap = ROWS * T
    _, caches = buffers(layout, cap)
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: 3 tensors, expected 2 \* num_layers = 4"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=[caches[0], caches[1][:3]], kv_layout="hf")
    _, short = buffers(layout, cap - 1)
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]\[0\]: capacity 1023 tokens < rows"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=short, kv_layout="hf")
    wrong_h = [[np.zeros((1, H + 1, cap, D), np.float32) for _ in range(2 * L)] for _ in range(TP)]
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]\[0\]: shape \[1, 2, 1024, 8\], expected \[1, 1, capacity, 8\]"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=wrong_h, kv_layout="hf")
    f16 = [[c.astype(np.float16) for c in cs] for cs in caches]
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]\[0\]: dtype <f2, expected <f4"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=f16, kv_layout="hf")
    big = [np.zeros((L, 2, 1, H, cap, 2 * D), np.float32) for _ in range(TP)]
    not_dense = [[b[l, kv, :, :, :, ::2] for l in range(L) for kv in range(2)] for b in big]
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]\[0\]: strides .* need a dense last axis"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=not_dense, kv_layout="hf")
    # K / V at another distance in layer 1 than in layer 0 (as separately
    # allocated tensors are): kv_descriptor's region has one K-to-V stride.
    slots = np.zeros((TP, 6, 1, H, cap, D), np.float32)
    separate = [[slots[r, i] for i in (0, 1, 2, 4)] for r in range(TP)]
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]\[3\]: V lies 65536 bytes from its K, layer 0's 32768"):
        kv_reuse.Target(layout, rows=ROWS, kv_caches=separate, kv_layout="hf")
    bufs, caches = buffers(layout, cap)
    target = kv_reuse.Target(layout, rows=ROWS, kv_caches=caches, kv_layout="hf")
    advice = router_for(report, layout, enabled, target).advise("req-hf-bad", report["hashes"], target.engine_id)
    manifest = bytes.fromhex(report["manifest"])
    for kw, why in (({"dst_token_offset": 5}, "dst_token_offset: 5 is not a multiple of tokens_per_block 64"),
                    ({"dst_token_offset": (ROWS - BLOCKS + 1) * T}, "dst_token_offset: 6 blocks from token 704 end at 1088, past the cache's 1024 tokens"),
                    ({"dst_token_offset": 0, "dst_blocks": [0, 1, 2, 3, 4, 5]}, "dst_token_offset: give dst_blocks or dst_token_offset, not both")):
        with pytest.raises(kv_reuse.BadArgument, match=why):
            target.fetch(advice.hint, report["hashes"], manifest, **kw)
    other = kv_reuse.Target(layout, rows=ROWS)
    with pytest.raises(kv_reuse.BadArgument, match=r"dst_token_offset: only with kv_layout=\"hf\""):
        other.fetch(advice.hint, report["hashes"], manifest, dst_token_offset=0)
    assert all((b == SENTINEL).all() for b in bufs)
    assert target.free_rows == ROWS
