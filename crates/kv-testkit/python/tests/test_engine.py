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
    assert a.config._attn_implementation == "sdpa"
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
