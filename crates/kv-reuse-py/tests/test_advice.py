"""Advice's typed fields from the in-process Router: `admitted`, the stable
`reason` code, its `detail` and the cost `terms`, for an admitted advice and
each refusal this process can provoke (a GPU-memory donor, for
`gpu_path_disabled`, needs CUDA: test_gpu.py; `cancelled` needs Rust's
advise_cancellable: test_router_client.py decodes it from a service reply)."""

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TOKENS_PER_BLOCK

TARGET = "00000000-0000-4000-8000-0000000000a1"
ENDPOINT = "unix:/tmp/kv-reuse-test-advice.sock"  # never dialled: advise only reads it


def stored(layout):
    """A donor bank holding the BLOCKS blocks of one prompt: (bank, prompt
    hashes). Called in the test, not a fixture: pytest keeps fixture values
    until after conftest's leak check, and the bank must be gone by then."""
    bank = kv_reuse.DonorBank(layout, slots=8)
    tokens = list(range(TOKENS_PER_BLOCK * BLOCKS))
    store = bank.store(tokens)
    for rank in range(layout.tp_size):
        store.write(rank, np.zeros((BLOCKS, layout.rank_block_elems), np.float32))
        store.ack(rank)
    return bank, kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)


def router(bank, layout, prompt, values, slots_of=None):
    """A router that knows `bank` (its events, and the slots of `slots_of`,
    default the whole prompt) and the target, deciding with settings `values`."""
    r = kv_reuse.Router(kv_reuse.Settings(values, env={}), TOKENS_PER_BLOCK)
    r.register_worker(1, bank.engine_id, "decode", layout)
    r.register_worker(2, TARGET, "prefill", layout)
    for e in bank.drain_events():
        r.apply_event(e)
    hashes = prompt if slots_of is None else slots_of
    r.report_donor(bank.manifest(), ENDPOINT, dict(zip(hashes, bank.slots(hashes))))
    return r


ON = {"enable_decode_to_prefill_reuse": True}


def test_an_admitted_advice_carries_every_cost_term(layout):
    bank, prompt = stored(layout)
    advice = router(bank, layout, prompt, ON).advise("req-ok", prompt, TARGET)
    assert advice.admitted and advice.hint is not None
    assert advice.reason is None and advice.detail is None
    assert advice.verdict == "Admit"  # the deprecated Debug text, unchanged
    # The donor the hint names: the key of its DonorDirectory record.
    assert advice.donor_engine_id == bank.engine_id
    t = advice.terms
    assert isinstance(t, kv_reuse.CostTerms)
    assert t.path == "host"
    assert (t.transfer_blocks, t.reused_tokens) == (BLOCKS, BLOCKS * TOKENS_PER_BLOCK)
    # The defaults (docs/operator-guide.md): 30 µs a token, 400 µs a host block,
    # at least 4 blocks and 2 ms.
    assert (t.prefill_token_us, t.block_us) == (30.0, 400.0)
    assert (t.minimum_blocks, t.minimum_saving_us) == (4, 2000.0)
    assert t.recompute_saved_us == t.reused_tokens * t.prefill_token_us == 11520.0
    assert t.transfer_cost_us == t.transfer_blocks * t.block_us == 2400.0
    assert 0.0 < t.lookup_us < 1e6
    # The same float operations in the same order: exactly equal.
    assert t.saving_us == t.recompute_saved_us - t.transfer_cost_us - t.lookup_us
    assert t.saving_us >= t.minimum_saving_us
    text = repr(advice)
    assert text.startswith(f"Advice(admitted=True, donor_engine_id='{bank.engine_id}', "
                           "terms=CostTerms(path='host', reused_tokens=384, ")
    assert "minimum_blocks=4))" in text and "reason" not in text
    with pytest.raises(AttributeError):
        t.saving_us = 0.0  # frozen


@pytest.mark.parametrize(
    "values, reason, detail",
    [
        ({}, "reuse_disabled", "enable_decode_to_prefill_reuse is off"),
        ({**ON, "minimum_transfer_prefix_blocks": BLOCKS + 1}, "too_few_blocks",
         f"{BLOCKS} blocks to fetch, fewer than minimum_transfer_prefix_blocks = {BLOCKS + 1}"),
        ({**ON, "minimum_estimated_ttft_saving_ms": 60_000.0}, "saving_below_minimum",
         "is below minimum_estimated_ttft_saving_ms (60000000.0 µs)"),
    ],
)
def test_a_refusal_by_the_settings_names_its_code(layout, values, reason, detail):
    bank, prompt = stored(layout)
    advice = router(bank, layout, prompt, values).advise(f"req-{reason}", prompt, TARGET)
    assert not advice.admitted and advice.hint is None
    assert advice.reason == reason
    assert detail in advice.detail, advice.detail
    if reason == "reuse_disabled":
        assert advice.terms is None  # no lookup, no estimate
        assert advice.verdict == "Refuse(ReuseDisabled)"
    else:
        # A threshold refusal keeps its estimate: how far off it was.
        t = advice.terms
        assert t.transfer_blocks == BLOCKS
        assert t.saving_us == t.recompute_saved_us - t.transfer_cost_us - t.lookup_us
        assert (t.transfer_blocks < t.minimum_blocks) == (reason == "too_few_blocks")
        assert (t.saving_us < t.minimum_saving_us) == (reason == "saving_below_minimum")
    assert repr(advice).startswith(f"Advice(admitted=False, reason='{reason}', detail=")


def test_a_prompt_of_no_block_is_no_donor_in_process_as_through_the_client(layout):
    # The same advice RouterClient gives without a round trip
    # (test_router_client.py): a short prompt is not an error.
    bank, prompt = stored(layout)
    r = router(bank, layout, prompt, ON)
    advice = r.advise("req-empty", [], TARGET)
    assert (advice.admitted, advice.reason, advice.terms, advice.hint) == (
        False, "no_donor", None, None)
    assert advice.detail == "`sequence_hashes` is empty"


def test_no_donor_and_a_record_missing_a_block_are_refused_by_code(layout):
    bank, prompt = stored(layout)
    # A prompt no donor holds.
    other = kv_reuse.sequence_hashes(list(range(10_000, 10_000 + TOKENS_PER_BLOCK * BLOCKS)),
                                     TOKENS_PER_BLOCK)
    r = router(bank, layout, prompt, ON, slots_of=prompt[:2])
    advice = r.advise("req-none", other, TARGET)
    assert (advice.admitted, advice.reason, advice.terms) == (False, "no_donor", None)
    assert advice.donor_engine_id is None
    assert advice.detail and advice.detail in advice.verdict  # the lookup's own words
    # The index holds the prompt, the donor's report only its first 2 blocks.
    advice = r.advise("req-gone", prompt, TARGET)
    assert (advice.admitted, advice.reason, advice.terms) == (False, "hint_unavailable", None)
    assert advice.detail and advice.verdict.startswith("Refuse(HintUnavailable(")


def test_a_fetch_given_no_manifest_is_refused_after_the_prompt_check(layout):
    # DonorDirectory.manifest answers None once the donor's record is gone;
    # passed on to fetch it raised TypeError, which an engine catching
    # KvReuseError to fall back did not catch.
    bank, prompt = stored(layout)
    advice = router(bank, layout, prompt, ON).advise("req-gone", prompt, TARGET)
    assert advice.admitted
    target = kv_reuse.Target(layout, rows=8)
    no_record = rf"^manifest: None: donor {advice.donor_engine_id} has no directory record"
    with pytest.raises(kv_reuse.HintRefused, match=no_record):
        target.fetch(advice.hint, prompt, None)
    assert issubclass(kv_reuse.HintRefused, kv_reuse.KvReuseError)
    with pytest.raises(kv_reuse.HintRefused, match=no_record):
        target.fetch_async(advice.hint, prompt, None)
    # A hint for another prompt is still a mismatch first, donor gone or not.
    with pytest.raises(kv_reuse.PromptMismatch):
        target.fetch(advice.hint, [h ^ 1 for h in prompt], None)
    # Nothing was fetched: every row is still free.
    assert target.free_rows == 8
