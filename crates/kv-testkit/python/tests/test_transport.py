"""The cuda and host transports' wiring, on stand-in torch / transformers / kv_reuse (tests/stubs.py).

Runs everywhere (no torch needed): what the decode and prefill workers hand
the wheel (a CUDA bank on the decode's GPU, the prefill's own CUDA tensor as
the fetch destination, DLPack only) and what a landing returns (the fetched
rows, in prefix order, on the device). The real wheel's CUDA IPC copy is
checked on the GPU (crates/kv-reuse-py/tests/test_gpu.py, and the
gpu_serving section's ``device_direct`` check).
"""

import os
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stubs  # noqa: E402

ELEMS = 2 * 2 * 16 * 2 * 16  # layers x (K, V) x tokens/block x kv heads x head dim


@pytest.fixture
def mods():
    saved = stubs.install()
    from gpu_serving import transport

    yield types.SimpleNamespace(torch=sys.modules["torch"], kv=sys.modules["kv_reuse"], transport=transport)
    stubs.restore(saved)


def layout(kv):
    return kv.Layout(2, 2, 16, "bf16", 16, 1)


def test_cuda_transport_opens_a_device_bank_and_lands_in_a_cuda_tensor(mods):
    kv, t = mods.kv, mods.transport
    bank = t.open_bank(kv, layout(kv), 10, "cuda:1", "cuda")
    assert bank.kwargs == {"slots": 10, "gpus": [1], "store_timeout_s": 60.0}
    landing = t.Landing(kv, layout(kv), 8, "cuda:0", "cuda")
    target = landing.target
    assert target.kwargs["rows"] == 8 and target.kwargs["gpus"] == [0]
    (dst,) = target.kwargs["kv_caches"]
    assert isinstance(dst, t.DlpackView) and dst.tensor is landing.kv_cache
    # Only DLPack is shown: torch's __cuda_array_interface__ raises TypeError for bf16.
    assert not hasattr(dst, "__cuda_array_interface__")
    assert dst.__dlpack_device__() == (2, 0)
    assert landing.kv_cache.dtype is mods.torch.bfloat16
    assert landing.kv_cache.shape == (8, ELEMS) and landing.kv_cache.device == "cuda:0"
    assert mods.torch.cuda.synced == ["cuda:0"]  # the zero fill lands before the wheel maps it


def test_host_transport_keeps_the_shm_bank_and_the_targets_own_rows(mods):
    kv, t = mods.kv, mods.transport
    assert t.open_bank(kv, layout(kv), 10, "cpu", "host").kwargs == {"slots": 10, "store_timeout_s": 60.0}
    landing = t.Landing(kv, layout(kv), 8, "cpu", "host")
    assert landing.target.kwargs == {"rows": 8} and landing.kv_cache is None
    assert landing.staging.shape == (8, ELEMS)


def test_land_gives_the_fetched_rows_in_prefix_order_without_leaving_the_device(mods):
    kv, t = mods.kv, mods.transport
    landing = t.Landing(kv, layout(kv), 8, "cuda:0", "cuda")
    for i in range(8):
        landing.kv_cache.a[i] = i + 1
    got = landing.land(types.SimpleNamespace(rows=[2, 3, 4]))
    assert got.device == "cuda:0" and got.dtype is mods.torch.int16 and got.shape == (3, ELEMS)
    assert [int(r[0]) for r in got.a] == [3, 4, 5]
    assert np.shares_memory(got.a, landing.kv_cache.a)  # consecutive rows: a view, no copy
    got = landing.land(types.SimpleNamespace(rows=[5, 1, 3]))
    assert [int(r[0]) for r in got.a] == [6, 2, 4] and got.device == "cuda:0"
    assert landing.land(types.SimpleNamespace(rows=[])).shape == (0, ELEMS)


class FakeCache:
    """What CacheLanding reads of an engine.PreallocCache: capacity, pin, per-layer (K, V) buffers."""

    def __init__(self, torch, layers, capacity):
        self.cap, self.pinned = capacity, False
        self.kv = [(torch.zeros((1, 2, capacity, 16), dtype=torch.bfloat16, device="cuda:0"),
                    torch.zeros((1, 2, capacity, 16), dtype=torch.bfloat16, device="cuda:0")) for _ in range(layers)]

    def capacity(self):
        return self.cap

    def pin(self):
        self.pinned = True

    def buffers(self):
        return self.kv


def test_cache_landing_hands_the_engine_cache_over_as_hf_views_and_pins_it(mods):
    kv, t = mods.kv, mods.transport
    cache = FakeCache(mods.torch, 2, 8 * 16 + 1024)
    landing = t.CacheLanding(kv, layout(kv), cache, 8, "cuda:0", "cuda")
    k = landing.target.kwargs
    assert k["kv_layout"] == "hf" and k["rows"] == 8 and k["gpus"] == [0]
    (views,) = k["kv_caches"]
    # K0, V0, K1, V1: every layer's buffers, DLPack only, the cache's own tensors.
    assert [v.tensor for v in views] == [b for pair in cache.kv for b in pair]
    assert all(isinstance(v, t.DlpackView) for v in views)
    assert cache.pinned  # it must never reallocate under the target
    assert mods.torch.cuda.synced == ["cuda:0"]
    # Blocks landed at their prompt positions: their count; anywhere else: refused.
    assert landing.land(types.SimpleNamespace(rows=[3, 4, 5], fetch_from=3)) == 3
    assert landing.land(types.SimpleNamespace(rows=[], fetch_from=0)) == 0
    with pytest.raises(t.TransportError) as e:
        landing.land(types.SimpleNamespace(rows=[0, 1], fetch_from=2))
    assert e.value.field == "rows"


def test_cache_landing_refuses_the_host_transport_and_a_cache_too_small(mods):
    kv, t = mods.kv, mods.transport
    with pytest.raises(t.TransportError) as e:
        t.CacheLanding(kv, layout(kv), FakeCache(mods.torch, 2, 4096), 8, "cpu", "host")
    assert e.value.field == "transport"
    small = FakeCache(mods.torch, 2, 8 * 16 - 1)
    with pytest.raises(t.TransportError) as e:
        t.CacheLanding(kv, layout(kv), small, 8, "cuda:0", "cuda")
    assert e.value.field == "rows" and not small.pinned


def test_store_source_hands_cuda_rows_over_as_bf16_dlpack_and_host_rows_as_uint16(mods):
    torch, t = mods.torch, mods.transport
    rows = torch.tensor([[1] * ELEMS, [2] * ELEMS], dtype=torch.int16, device="cuda:0")
    src = t.store_source(rows, "cuda")
    # Device to device: the same memory, shown as bf16 through DLPack only.
    assert isinstance(src, t.DlpackView) and src.tensor.dtype is torch.bfloat16
    assert np.shares_memory(src.tensor.a, rows.a) and src.__dlpack_device__() == (2, 0)
    assert src.__dlpack__(stream=1)[1] is src.tensor
    host = t.store_source(torch.tensor([[1] * ELEMS, [2] * ELEMS], dtype=torch.int16), "host")
    # Exactly the new rows (the wheel's store takes one row per block it lacks).
    assert host.dtype == np.uint16 and host.shape == (2, ELEMS)
    assert host[0, 0] == 1 and host[1, -1] == 2


def test_bad_transport_settings_name_the_field(mods):
    t = mods.transport
    with pytest.raises(t.TransportError) as e:
        t.ordinal("cpu", "cuda")
    assert e.value.field == "device"
    with pytest.raises(t.TransportError) as e:
        t.ordinal("cuda:0", "nvlink")
    assert e.value.field == "transport"
    assert t.ordinal("cuda:3", "cuda") == 3 and t.ordinal("cuda", "cuda") == 0
    assert t.ordinal("cuda:3", "host") is None


def test_workers_open_the_bank_and_target_of_their_transport(mods, monkeypatch):
    from gpu_serving import decode_worker, engine, prefill_worker

    monkeypatch.setattr(engine, "build_model", lambda name, device, seed: object())
    cfg = {"model": "tiny", "seed": 0, "tokens_per_block": 16, "transport": "cuda"}
    d = decode_worker.DecodeWorker({**cfg, "device": "cuda:0", "bank_slots": 12, "answer": "forced"})
    assert d.bank.kwargs["gpus"] == [0] and d.bank.kwargs["slots"] == 12
    assert d.layout.args == (2, 2, 16, "bf16", 16, 1)
    p = prefill_worker.PrefillWorker({**cfg, "device": "cuda:0", "target_rows": 6, "landing": "rows"})
    assert p.target.kwargs["gpus"] == [0] and p.target.kwargs["kv_caches"][0].tensor.shape == (6, ELEMS)
    # The cuda default: fetches land in the engine's own (pinned) cache, HF layout, K0 V0 K1 V1.
    p = prefill_worker.PrefillWorker({**cfg, "device": "cuda:0", "target_rows": 6, "warm": True})
    assert p.landing_kind == "cache" and p.target.kwargs["kv_layout"] == "hf"
    for landing in (p.landing, p.warm_landing):
        assert landing.cache.pinned and landing.cache.capacity() >= 6 * 16 + prefill_worker.GREEDY_HEADROOM
        assert len(landing.target.kwargs["kv_caches"][0]) == 2 * 2
    assert p.landing.cache is not p.warm_landing.cache
    with pytest.raises(engine.EngineError) as e:
        prefill_worker.PrefillWorker({**cfg, "device": "cuda:0", "target_rows": 6, "landing": "pool"})
    assert e.value.field == "landing"
    with pytest.raises(engine.EngineError) as e:
        decode_worker.DecodeWorker({**cfg, "device": "cuda:0", "bank_slots": 12, "answer": "sampled"})
    assert e.value.field == "answer"


def test_harness_skips_the_cuda_transport_on_cpu_devices(mods, tmp_path, capsys):
    from gpu_serving import harness

    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--model", "tiny", "--prefill-device", "cpu", "--decode-device", "cpu"]
    assert harness.main(argv) == 0
    assert "SKIP gpu_serving: --transport cuda needs CUDA devices" in capsys.readouterr().out


def test_cuda_prefill_counts_fds_from_its_first_fetch_and_everything_else_from_start(mods, monkeypatch):
    from gpu_serving import engine, prefill_worker

    monkeypatch.setattr(engine, "build_model", lambda name, device, seed: object())
    cfg = {"model": "tiny", "seed": 0, "tokens_per_block": 16, "target_rows": 6}
    counters = {"open_fds": 10, "pins": 0}
    mods.kv.leak_counters = lambda: dict(counters)
    cuda = prefill_worker.PrefillWorker({**cfg, "device": "cuda:0", "transport": "cuda"})
    host = prefill_worker.PrefillWorker({**cfg, "device": "cpu", "transport": "host"})
    counters["open_fds"] = 40  # the driver's own fds at the first IPC import
    for w in (cuda, host):
        w._steady_fds()
    counters["open_fds"] = 40
    counters["pins"] = 1
    assert cuda.op_stats()["leaks_grown"] == {"pins": 1}
    assert host.op_stats()["leaks_grown"] == {"open_fds": 30, "pins": 1}
    counters["open_fds"] = 41
    cuda._steady_fds()  # re-based once only
    assert cuda.op_stats()["leaks_grown"] == {"open_fds": 1, "pins": 1}
