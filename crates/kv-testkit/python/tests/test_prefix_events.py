"""The warm regime's prefill prefix events, against the real kv_reuse wheel (no torch needed).

The router's cost model counts the blocks the prefill worker already holds
(its baseline) only from that worker's own ``stored`` events; these tests
check that the events ``prefix_events.PrefixEvents`` writes are read that
way: the hint then asks only for the rest, and a ``removed`` event takes
the baseline away again.
"""

import os
import sys
import tempfile

import pytest

np = pytest.importorskip("numpy", reason="numpy cannot be imported")
kv_reuse = pytest.importorskip("kv_reuse", reason="the kv_reuse wheel is not installed (cargo xtask wheel)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving import harness  # noqa: E402
from gpu_serving import prefix_events as pe  # noqa: E402

B = 16
SETTINGS = {
    "enable_decode_to_prefill_reuse": True,
    "minimum_estimated_ttft_saving_ms": 0,
    "minimum_transfer_prefix_blocks": 1,
}


def test_pack_round_trips_the_wheels_own_events_byte_for_byte():
    layout = kv_reuse.Layout(2, 2, 16, "bf16", B, 1)
    bank = kv_reuse.DonorBank(layout, slots=8)
    st = bank.store(list(range(B * 3)))
    st.write(0, np.ones((3, layout.rank_block_elems), dtype=np.uint16))
    st.ack(0)
    (ev,) = bank.drain_events()
    assert pe.pack(pe.unpack(ev)) == ev
    assert pe.unpack(ev)["data"]["stored"]["blocks"][2]["slot"] == 2
    with pytest.raises(pe.EventError) as e:
        pe.unpack(ev + b"\x00")
    # kv-descriptor's decoder refuses the trailing byte (no second codec here).
    assert e.value.field == "event" and "trailing bytes" in str(e.value)


def test_the_cost_model_fetches_only_what_the_warm_prefill_lacks():
    layout = kv_reuse.Layout(2, 2, 16, "bf16", B, 1)
    tokens = list(range(1000, 1000 + B * 6))
    hashes = kv_reuse.sequence_hashes(tokens, B)
    donor = kv_reuse.DonorBank(layout, slots=8)
    st = donor.store(tokens)
    rows = np.arange(6, dtype=np.uint16)[:, None].repeat(layout.rank_block_elems, 1)
    st.write(0, rows)
    st.ack(0)
    endpoint = "unix:" + os.path.join(tempfile.mkdtemp(), "pins.sock")
    with donor.serve_pins(endpoint):
        target = kv_reuse.Target(layout, rows=8)
        router = kv_reuse.Router(kv_reuse.Settings(SETTINGS, env={}), B)
        router.register_worker(1, donor.engine_id, "decode", layout)
        router.register_worker(2, target.engine_id, "prefill", layout)
        warm = pe.PrefixEvents(target.engine_id)
        events = donor.drain_events()
        for e in events:
            router.apply_event(e)
            warm.learn(e)
        router.report_donor(donor.manifest(), endpoint, dict(zip(hashes, donor.slots(hashes))))
        # The harness's own settings (defaults but the two switches): a warm
        # top-up of 2 blocks is under the default minimum of 4 blocks (the
        # cost model, not the harness, says no: at 64 tokens per block the
        # decode's 64-128 output tokens are 1-3 blocks).
        hr = kv_reuse.Router(kv_reuse.Settings(harness.router_settings(), env={}), B)
        hr.register_worker(1, donor.engine_id, "decode", layout)
        hr.register_worker(2, target.engine_id, "prefill", layout)
        hw = pe.PrefixEvents(target.engine_id)
        for ev in events:
            hr.apply_event(ev)
            hw.learn(ev)
        hr.report_donor(donor.manifest(), endpoint, dict(zip(hashes, donor.slots(hashes))))
        hr.apply_event(hw.stored(None, hashes[:4]))
        assert hr.advise("warm-h", hashes, target.engine_id).reason == "too_few_blocks"
        with pytest.raises(pe.EventError) as e:
            warm.stored(None, [12345])
        assert e.value.field == "token_hash"
        # The prefill computed the first 4 blocks itself and kept them.
        router.apply_event(warm.stored(None, hashes[:4]))
        advice = router.advise("warm-1", hashes, target.engine_id)
        assert advice.admitted, (advice.reason, advice.detail)
        with target.fetch(advice.hint, hashes, donor.manifest()) as out:
            assert out.fetch_from == 4 and list(out.fetched) == hashes[4:]
            assert [target.read_row(0, r)[0] for r in out.rows] == [4, 5]
        # Evicted from the prefill's cache: the whole prefix is fetched again.
        router.apply_event(warm.removed(hashes[:4]))
        advice = router.advise("warm-2", hashes, target.engine_id)
        with target.fetch(advice.hint, hashes, donor.manifest()) as out:
            assert out.fetch_from == 0 and len(out.rows) == 6
    assert warm.next_id == 3


def test_the_harness_router_settings_turn_the_gpu_path_on():
    # A CUDA donor bank is the GPU path; without this setting every advice on
    # the H200 was refused (`gpu_path_disabled`) and nothing was fetched.
    from gpu_serving import harness

    entries = kv_reuse.Settings(harness.router_settings(), env={}).entries()
    assert entries["enable_decode_to_prefill_reuse"][0] == "true"
    assert entries["enable_decode_to_prefill_gpu_reuse"][0] == "true"
