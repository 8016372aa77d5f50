"""Engine tests on the tiny shape, CPU. Skipped (with the reason) without torch/transformers."""

import os
import random
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch cannot be imported")
pytest.importorskip("transformers", reason="transformers cannot be imported")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving import engine  # noqa: E402

B = 16  # tokens per block


@pytest.fixture(scope="module")
def models():
    # Two instances, as the donor and the target live in two processes.
    return engine.build_model("tiny", "cpu", seed=3), engine.build_model("tiny", "cpu", seed=3)


def tokens(rng, n, vocab=256):
    return [rng.randrange(vocab) for _ in range(n)]


def test_same_seed_same_weights_other_seed_differs(models):
    a, b = models
    assert engine.weights_checksum(a) == engine.weights_checksum(b)
    assert engine.weights_checksum(engine.build_model("tiny", "cpu", seed=4)) != engine.weights_checksum(a)
    assert a.config._attn_implementation == engine.ATTENTION == "sdpa_lower_right"
    assert next(a.parameters()).dtype == torch.bfloat16


def test_block_major_round_trip_and_order(models):
    donor, _ = models
    rng = random.Random(1)
    r = engine.prefill(donor, tokens(rng, 3 * B + 5))
    rows = engine.to_blocks(r.cache, 0, 3, B)
    s = engine.shape("tiny")
    assert rows.shape == (3, s.num_layers * 2 * B * s.num_kv_heads * s.head_dim)
    assert rows.dtype == torch.int16
    kv = engine.from_blocks(rows, s, B)
    for (k, v), (k0, v0) in zip(kv, engine.layer_kv(r.cache)):
        assert torch.equal(k, k0[:, :, : 3 * B]) and torch.equal(v, v0[:, :, : 3 * B])
    # Block 1 alone equals the middle of the three.
    assert torch.equal(engine.to_blocks(r.cache, 1, 1, B)[0], rows[1])
    sums = engine.block_checksums(rows)
    assert len(set(sums)) == 3
    assert engine.block_checksums(rows.flip(0)) == sums[::-1]
    changed = rows.clone()
    changed[2, 7] += 1
    assert engine.block_checksums(changed)[2] != sums[2]


def test_suffix_on_fetched_kv_is_bit_equal_to_donor_continuing(models):
    donor, target = models
    rng = random.Random(7)
    prompt = tokens(rng, 40)
    first = engine.prefill(donor, prompt)
    out, cache = engine.greedy(donor, first, 8)
    assert engine.cache_len(cache) == 40 + 7  # the last token's KV is not computed yet
    nxt = prompt + out + tokens(rng, 20)
    fetched_tokens = (engine.cache_len(cache) // B) * B
    assert fetched_tokens == 32

    # The donor continues on its own KV with the same split.
    ref = engine.prefill(donor, nxt[fetched_tokens:], engine.cropped(cache, fetched_tokens))
    # The target gets the bank rows as uint16 bytes (what the wheel moves) and
    # computes only the suffix.
    rows = engine.to_blocks(cache, 0, fetched_tokens // B, B).numpy().view("<u2").copy()
    back = torch.from_numpy(rows.view("<i2"))
    on = engine.prefill(target, nxt[fetched_tokens:], engine.cache_from_kv(engine.from_blocks(back, engine.shape("tiny"), B)))
    assert torch.equal(on.logits, ref.logits)
    assert on.first_token == ref.first_token
    # The crop copied: the donor's own cache still holds its 47 tokens.
    assert engine.cache_len(cache) == 47

    off = engine.prefill(target, nxt)
    diff = (off.logits.float() - on.logits.float()).abs().max().item()
    print(f"max |logit OFF - ON| = {diff:.4g} (bf16, recomputed vs decoded KV)")
    assert diff == diff and diff < 10.0  # finite, same order as the logits


def test_bad_input_names_the_field(models):
    donor, _ = models
    with pytest.raises(engine.EngineError) as e:
        engine.prefill(donor, [])
    assert e.value.field == "tokens"
    with pytest.raises(engine.EngineError) as e:
        engine.shape("llama-9")
    assert e.value.field == "model"
    r = engine.prefill(donor, list(range(B)))
    with pytest.raises(engine.EngineError) as e:
        engine.to_blocks(r.cache, 0, 2, B)
    assert e.value.field == "num_blocks"
    with pytest.raises(engine.EngineError) as e:
        engine.from_blocks(torch.zeros((1, 3), dtype=torch.int16), engine.shape("tiny"), B)
    assert e.value.field == "rows"


def test_lower_right_attention_equals_the_explicit_mask(models):
    # A turn of 5 queries over 12 keys, 4 query heads on 2 KV heads: query i
    # sees keys 0 ..= 7 + i. Reference: the mask written out, KV heads repeated.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k = torch.randn(1, 2, 12, 16, generator=g)
    v = torch.randn(1, 2, 12, 16, generator=g)
    out, w = engine.sdpa_lower_right(None, q, k, v, None, scaling=0.25)
    assert w is None and out.shape == (1, 5, 4, 16)
    mask = torch.arange(12)[None, :] <= (torch.arange(5)[:, None] + 7)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert (out - ref).abs().max().item() < 1e-5
    # Square and single-query cases too.
    sq, _ = engine.sdpa_lower_right(None, q, k[:, :, :5], v[:, :, :5], None, scaling=0.25)
    ref_sq = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :5].repeat_interleave(2, 1), v[:, :, :5].repeat_interleave(2, 1), is_causal=True, scale=0.25
    ).transpose(1, 2)
    assert (sq - ref_sq).abs().max().item() < 1e-5
    with pytest.raises(engine.EngineError) as e:
        engine.sdpa_lower_right(None, q, k, v, mask, scaling=0.25)
    assert e.value.field == "attention_mask"
    with pytest.raises(engine.EngineError) as e:
        engine.sdpa_lower_right(None, q, k[:, :, :3], v[:, :, :3], None)
    assert e.value.field == "key"


def test_prealloc_cache_writes_in_place_and_grows(models):
    donor, _ = models
    rng = random.Random(5)
    a = engine.prefill(donor, tokens(rng, 30))
    layer = a.cache.layers[0]
    assert isinstance(a.cache, engine.PreallocCache) and engine.cache_len(a.cache) == 30
    cap = a.cache.capacity()
    assert cap >= 30 + 1024
    buf = layer.kb
    # A turn within the capacity lands in the same buffer (no reallocation, no concatenation).
    b = engine.prefill(donor, tokens(rng, 7), a.cache)
    assert layer.kb is buf and engine.cache_len(b.cache) == 37
    assert layer.keys.data_ptr() == buf.data_ptr()
    # Past the capacity the buffers grow and the held tokens move with them.
    held = layer.keys.clone()
    a.cache.reserve(cap + 1)
    assert layer.kb is not buf and a.cache.capacity() > cap
    assert torch.equal(layer.keys, held)
    # set_length bounds.
    with pytest.raises(engine.EngineError) as e:
        a.cache.set_length(a.cache.capacity() + 1)
    assert e.value.field == "n"
    with pytest.raises(engine.EngineError) as e:
        a.cache.crop(3)
    assert e.value.field == "crop"


def test_cache_from_blocks_equals_the_two_step_relayout(models):
    donor, target = models
    rng = random.Random(9)
    r = engine.prefill(donor, tokens(rng, 4 * B + 3))
    rows = engine.to_blocks(r.cache, 0, 4, B)
    s = engine.shape("tiny")
    direct = engine.cache_from_blocks(rows, s, B)
    two_step = engine.cache_from_kv(engine.from_blocks(rows, s, B))
    assert engine.cache_len(direct) == 4 * B
    for (k, v), (k2, v2) in zip(engine.layer_kv(direct), engine.layer_kv(two_step)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # The same turn on either gives the same logits bit for bit.
    turn = tokens(rng, 9)
    assert torch.equal(engine.prefill(target, turn, direct).logits, engine.prefill(target, turn, two_step).logits)
    with pytest.raises(engine.EngineError) as e:
        engine.cache_from_blocks(rows[:, :5], s, B)
    assert e.value.field == "rows"


def test_pinned_cache_never_moves_and_load_prefix_copies_only_its_range(models):
    donor, _ = models
    rng = random.Random(5)
    r = engine.prefill(donor, tokens(rng, 3 * B + 5))
    c = engine.PreallocCache.for_shape(engine.shape("tiny"), 64, "cpu")
    c.pin()
    arena = c.arena
    engine.load_prefix(c, r.cache, 40)
    assert engine.cache_len(c) == 40
    for (k, v), (k0, v0) in zip(engine.layer_kv(c), engine.layer_kv(r.cache)):
        assert torch.equal(k, k0[:, :, :40]) and torch.equal(v, v0[:, :, :40])
    # first=10: tokens below it are the destination's own, left as they are.
    for kb, vb in c.buffers():
        kb.zero_(), vb.zero_()
    engine.load_prefix(c, r.cache, 40, first=10)
    (kb, _), (k0, _) = c.buffers()[0], engine.layer_kv(r.cache)[0]
    assert not kb[:, :, :10].any() and torch.equal(kb[:, :, 10:40], k0[:, :, 10:40])
    # A suffix prefill writes in place; growth past the pinned arena is refused and it stays put.
    engine.prefill(donor, tokens(rng, 8), c)
    assert engine.cache_len(c) == 48 and c.arena is arena
    with pytest.raises(engine.EngineError) as e:
        c.reserve(c.capacity() + 1)
    assert e.value.field == "capacity" and c.arena is arena
    with pytest.raises(engine.EngineError) as e:
        engine.load_prefix(c, r.cache, engine.cache_len(r.cache) + 1)
    assert e.value.field == "tokens"


def test_host_copy_restores_the_same_bits_with_the_room_asked(models):
    donor, _ = models
    rng = random.Random(11)
    r = engine.prefill(donor, tokens(rng, 50))
    kept = engine.HostCopy()
    kept.update(r.cache)
    assert kept.tokens == 50 and kept.buf.device.type == "cpu"
    back = kept.restore(50, 200, "cpu")
    assert engine.cache_len(back) == 50 and back.capacity() >= 200
    for (k, v), (k0, v0) in zip(engine.layer_kv(back), engine.layer_kv(r.cache)):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # A prefix only: a reference request's cropped restore.
    part = kept.restore(32, 64, "cpu")
    for (k, _), (k0, _) in zip(engine.layer_kv(part), engine.layer_kv(r.cache)):
        assert torch.equal(k, k0[:, :, :32])
    # Continuing on the restored cache equals continuing on the original.
    more = tokens(rng, 9)
    a = engine.prefill(donor, more, back)
    b = engine.prefill(donor, more, engine.cropped(r.cache, 50))
    assert torch.equal(a.logits, b.logits)
    # A longer cache later: the buffer is replaced, its tokens follow.
    kept.update(a.cache)
    assert kept.tokens == 59 and torch.equal(kept.restore(59, 59, "cpu").layers[1].keys, a.cache.layers[1].keys)
    for n, cap in ((60, 100), (0, 10), (40, 39)):
        with pytest.raises(engine.EngineError) as e:
            kept.restore(n, cap, "cpu")
        assert e.value.field == "tokens"
    with pytest.raises(engine.EngineError) as e:
        engine.HostCopy().restore(1, 10, "cpu")
    assert e.value.field == "tokens"


def test_chunked_prefill_holds_every_token_and_the_same_first_token(models):
    donor, _ = models
    rng = random.Random(12)
    prompt = tokens(rng, 100)
    one = engine.prefill(donor, prompt)
    for chunk in (32, 99, 100, 1000):
        r = engine.prefill(donor, prompt, chunk=chunk)
        assert engine.cache_len(r.cache) == 100
        # Chunking changes the kernels' splits, not the maths: close, and the greedy token agrees here.
        assert torch.allclose(r.logits.float(), one.logits.float(), atol=0.1), chunk
        assert r.first_token == one.first_token
        if chunk >= 100:  # one pass: the same bits
            assert torch.equal(r.logits, one.logits)
    # On top of a held prefix, into a cache with room: the cache is extended in place.
    cache = engine.PreallocCache.for_shape(engine.shape("tiny"), 200, "cpu")
    r = engine.prefill(donor, prompt[:40], cache, chunk=16)
    r = engine.prefill(donor, prompt[40:], r.cache, chunk=16)
    assert r.cache is cache and engine.cache_len(cache) == 100
    assert torch.allclose(r.logits.float(), one.logits.float(), atol=0.1)
    for chunk, sw in ((-1, None), (8, engine.Stopwatch("cpu"))):
        with pytest.raises(engine.EngineError) as e:
            engine.prefill(donor, prompt, chunk=chunk, sw=sw)
        assert e.value.field == "chunk"


def test_a_dropped_cache_is_freed_without_the_garbage_collector(models):
    import gc
    import weakref

    donor, _ = models
    gc.disable()
    try:
        r = engine.prefill(donor, tokens(random.Random(13), 20))
        gone = weakref.ref(r.cache)
        arena = weakref.ref(r.cache.arena)
        del r
        # No cycle (cache -> layer -> cache): reference counting frees cache and arena at once.
        assert gone() is None and arena() is None
    finally:
        gc.enable()


def test_adopted_weights_are_the_exporters_own_memory():
    """``adopt_weights`` maps the exporter's parameters (no copy): a change
    made through the exporter is seen by the adopter, the logits stay the
    same bits, and a model of another shape is refused naming ``weights``
    before any parameter is replaced."""
    exporter = engine.build_model("tiny", "cpu", seed=5)
    adopter = engine.build_model("tiny", "cpu", seed=5)
    prompt = list(range(2 * B))
    before = engine.prefill(adopter, prompt).logits.clone()
    own = engine.weights_checksum(adopter)
    freed = engine.adopt_weights(adopter, engine.export_weights(exporter))
    assert freed == sum(p.numel() * 2 for p in adopter.parameters())  # bf16
    assert engine.weights_checksum(adopter) == own
    assert torch.equal(engine.prefill(adopter, prompt).logits, before)
    name, p = next(iter(exporter.named_parameters()))
    with torch.no_grad():
        p.add_(1.0)
    assert torch.equal(dict(adopter.named_parameters())[name], p)
    other = engine.build_model("tiny", "cpu", seed=5)
    other.model.norm.weight = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    kept = other.model.embed_tokens.weight
    with pytest.raises(engine.EngineError) as e:
        engine.adopt_weights(other, engine.export_weights(exporter))
    assert e.value.field == "weights" and "model.norm.weight" in str(e.value)
    assert other.model.embed_tokens.weight is kept and not torch.equal(kept, exporter.model.embed_tokens.weight)
