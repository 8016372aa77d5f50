"""Timed-region hygiene and per-phase timing (stand-in torch, no GPU).

What the H200 runs lacked: where ON's time goes (phases), a garbage
collector kept out of timed requests, the device drained before a timer
starts, repeated samples with the minimum reported, the checksum work out
of ON's timed request, and the allocator setting in the workers'
environment before they import torch.
"""

import gc
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stubs  # noqa: E402


@pytest.fixture
def mods():
    saved = stubs.install()
    from gpu_serving import engine, prefill_worker, timing

    yield types.SimpleNamespace(engine=engine, prefill_worker=prefill_worker, timing=timing, torch=sys.modules["torch"])
    stubs.restore(saved)
    gc.enable()


def test_stopwatch_syncs_around_laps_and_keeps_gc_off_until_stop(mods, monkeypatch):
    torch = mods.torch
    torch.cuda.synced.clear()
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    sw = mods.engine.Stopwatch("cuda:0")
    assert collected == []  # no full collection on the client's clock: quiesce did it
    assert torch.cuda.synced == ["cuda:0"]  # drained before the clock started
    assert not gc.isenabled()
    sw.lap("fetch")
    sw.lap("forward")
    sw.lap("fetch")  # a repeated phase adds up
    assert list(sw.phases) == ["fetch", "forward"] and all(v >= 0.0 for v in sw.phases.values())
    assert len(torch.cuda.synced) == 4
    total = sw.stop()
    assert gc.isenabled() and len(torch.cuda.synced) == 5
    assert total >= sum(sw.phases.values())


def test_stopwatch_leaves_gc_off_when_the_caller_had_it_off(mods):
    gc.disable()
    mods.engine.Stopwatch("cpu").stop()
    assert not gc.isenabled()


def test_prefill_laps_forward_then_readback(mods):
    torch = mods.torch
    order = []

    class Logits:
        def __getitem__(self, k):
            return self

    class Model:
        device = "cpu"

        def __call__(self, **kw):
            order.append("forward")
            return types.SimpleNamespace(logits=Logits(), past_key_values="cache")

    class Arg:
        def item(self):
            order.append("item")
            return 7

    torch.argmax = lambda x: Arg()

    class SW:
        def lap(self, name):
            order.append(name)

    r = mods.engine.prefill(Model(), [1, 2, 3], cache="given", sw=SW())
    assert r.first_token == 7 and order == ["forward", "forward", "item", "readback"]


class Worker:
    """A fake rpc.Worker recording each call and whether gc was on during it."""

    def __init__(self, replies):
        self.calls, self.replies = [], replies

    def call(self, op, **kw):
        self.calls.append((op, kw, gc.isenabled()))
        return dict(self.replies.get(op, {})), 10.0


def test_timed_quiesces_first_keeps_gc_off_and_splits_advise_and_rpc(mods):
    w = Worker({"on": {"worker_ms": 7.5, "phases_ms": {"fetch": 2.0, "forward": 5.0}}})
    reply, adv, s = mods.timing.timed(w, "on", lambda h: {"hint": h}, before=lambda: "H")
    assert [c[0] for c in w.calls] == ["quiesce", "on"]
    assert w.calls[1][1] == {"hint": "H"} and w.calls[1][2] is False  # gc off during the timed call
    assert gc.isenabled() and adv == "H"
    assert s["worker_ms"] == 7.5 and s["ms"] >= 10.0
    assert s["phases_ms"]["fetch"] == 2.0 and s["phases_ms"]["rpc"] == 2.5 and s["phases_ms"]["advise"] >= 0.0


class StagingWorker(Worker):
    """A fake rpc.Worker that also takes one-way sends."""

    def send(self, op, **kw):
        self.calls.append((op, kw, gc.isenabled()))
        return 0.25


def test_timed_sends_the_staged_prompt_before_the_advise_and_times_it(mods):
    w = StagingWorker({"on": {"worker_ms": 7.5, "phases_ms": {"forward": 5.0}}})
    seen = []
    reply, adv, s = mods.timing.timed(w, "on", lambda h: {"prompt": None, "hint": h},
                                      before=lambda: seen.append([c[0] for c in w.calls]) or "H",
                                      stage={"prompt": [1, 2, 3]})
    assert seen == [["quiesce", "stage"]]  # the prompt left before the router was asked
    assert [c[0] for c in w.calls] == ["quiesce", "stage", "on"] and w.calls[1][1] == {"prompt": [1, 2, 3]}
    assert w.calls[1][2] is False  # inside the timed region
    assert s["phases_ms"]["stage"] == 0.25 and s["phases_ms"]["rpc"] == 2.5
    # The total holds the stage's send, the advise and the request, nothing else.
    assert s["ms"] == pytest.approx(10.25 + s["phases_ms"]["advise"], abs=2e-3)
    assert "stage_worker" not in s["phases_ms"]
    w.replies["on"]["stage_worker_ms"] = 1.5  # the worker's staging time: reported, not added
    _, _, s2 = mods.timing.timed(w, "on", lambda h: {"prompt": None, "hint": h}, before=lambda: "H",
                                 stage={"prompt": [1, 2, 3]})
    assert s2["phases_ms"]["stage_worker"] == 1.5
    assert s2["ms"] == pytest.approx(10.25 + s2["phases_ms"]["advise"], abs=2e-3)


def test_a_staged_prompt_feeds_the_next_on_once_as_device_ids(mods):
    P = mods.prefill_worker.PrefillWorker
    me, calls = fake_self(mods, Rows([0, 1, 2]), 12)
    P.op_stage(me, list(range(20)))
    res = P.op_on(me, None, b"hint", [1, 2, 3], None)
    assert res["fetched_tokens"] == 12
    # The suffix forward read the staged ids from token 12 on (a view, no new upload).
    assert calls[-1] == ("prefill", 8, "cache") and me.ids_seen == [8]
    assert me.staged is None  # consumed
    with pytest.raises(mods.engine.EngineError, match="none staged"):
        P.op_on(me, None, None, None, None)
    with pytest.raises(mods.engine.EngineError, match="prompt"):
        P.op_stage(me, [])
    # A prompt sent with the request wins over (and drops) a staged one.
    P.op_stage(me, list(range(20)))
    res = P.op_on(me, list(range(16)), None, None, None)
    assert calls[-1] == ("prefill", 16, None) and me.staged is None and me.ids_seen == [8]
    assert res["stage_worker_ms"] is None  # it used no staged prompt
    # A failed stage leaves no earlier prompt behind for the next request.
    P.op_stage(me, list(range(20)))
    with pytest.raises(mods.engine.EngineError):
        P.op_stage(me, [])
    with pytest.raises(mods.engine.EngineError, match="none staged"):
        P.op_on(me, None, None, None, None)


def test_a_staged_prompt_reports_its_worker_time_and_drops_the_last_block_like_a_sent_one(mods):
    P = mods.prefill_worker.PrefillWorker
    me, calls = fake_self(mods, Rows([0, 1, 2, 3, 4]), 20)
    P.op_stage(me, list(range(100, 120)))
    res = P.op_on(me, None, b"hint", [1], None)
    # All 20 tokens fetched: the last block is dropped so one block is computed, from its own ids.
    assert res["fetched_tokens"] == 16 and calls[-1] == ("prefill", 4, "cache") and me.ids_seen == [4]
    assert res["stage_worker_ms"] is not None and res["stage_worker_ms"] >= 0.0


def test_best_and_phase_medians(mods):
    t = mods.timing
    assert t.best([{"ms": 3.0, "i": 0}, {"ms": 1.0, "i": 1}, {"ms": 1.0, "i": 2}])["i"] == 1
    with pytest.raises(ValueError):
        t.best([])
    rows = [{"p": {"a": 1.0, "b": 4.0}}, {"p": {"a": 3.0}}, {"p": {"a": 2.0, "b": 6.0}}, {}]
    assert t.phase_medians(rows, "p") == {"a": 2.0, "b": 4.0}


def fake_self(mods, rows, fetched_tokens):
    """A PrefillWorker's state for op_on with engine calls replaced by recorders."""
    e = mods.engine
    calls, ids_seen = [], []
    e.cache_from_blocks = lambda r, s, b: calls.append("cache_from_blocks") or "cache"

    def prefill(model, toks, cache=None, sw=None, ids=None):
        calls.append(("prefill", len(toks), cache))
        if ids is not None:  # ids given with the tokens are exactly those tokens
            assert list(ids.numpy()[0]) == list(toks)
            ids_seen.append(len(toks))
        sw.lap("forward")
        sw.lap("readback")
        return e.PrefillResult(3, "logits", "cache")

    e.prefill = prefill
    e.block_checksums = lambda r: calls.append("block_checksums") or [len(r)] * len(r)
    fetch = {"fetched_tokens": fetched_tokens, "bytes": 1, "host_payload_bytes": 0, "transport": "cuda_ipc"}
    me = types.SimpleNamespace(device="cpu", tpb=4, shape=None, model=None, landing=None, resident=None, fetched=None,
                               overlap=False, _fetch=lambda *a: (rows, dict(fetch), None, 0),
                               _first=lambda r: {"first_token": r.first_token}, staged=None, ids_seen=ids_seen,
                               quiesced_device_bytes=None, on_device_bytes=None, layer_groups=None)
    P = mods.prefill_worker.PrefillWorker
    me._prompt_ids = lambda p: P._prompt_ids(me, p)
    me._on_reply = lambda *a: P._on_reply(me, *a)
    me._on_overlapped = lambda *a: P._on_overlapped(me, *a)
    return me, calls


class Rows(list):
    @property
    def shape(self):
        return (len(self),)


def test_on_reply_carries_phases_and_no_checksums_which_come_untimed_after(mods):
    P = mods.prefill_worker.PrefillWorker
    me, calls = fake_self(mods, Rows([0, 1, 2]), 12)
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    assert "checksums" not in res and "block_checksums" not in calls
    assert list(res["phases_ms"]) == ["fetch", "relayout", "forward", "readback"]
    assert res["fetch_ms"] == res["phases_ms"]["fetch"] and res["fetched_tokens"] == 12
    assert calls[-1] == ("prefill", 8, "cache")
    assert P.op_fetched_checksums(me) == {"checksums": [3, 3, 3], "device_bytes": None}
    assert P.op_fetched_checksums(me) == {"checksums": [], "device_bytes": None}  # consumed


def test_on_without_a_fetch_has_no_relayout_and_no_checksums(mods):
    P = mods.prefill_worker.PrefillWorker
    me, calls = fake_self(mods, None, 0)
    res = P.op_on(me, list(range(20)), None, [], None)
    assert list(res["phases_ms"]) == ["fetch", "forward", "readback"]
    assert P.op_fetched_checksums(me) == {"checksums": [], "device_bytes": None}


def test_on_reads_no_device_memory_in_its_timed_path_quiesce_and_after_reply_do(mods, monkeypatch):
    """``torch.cuda.memory_allocated`` costs ~0.1-0.3 ms of Python: ON must not pay it (OFF does not)."""
    P = mods.prefill_worker.PrefillWorker
    reads = []
    allocated = iter([100, 250, 999])
    monkeypatch.setattr(mods.prefill_worker, "_device_bytes", lambda dev: reads.append(dev) or next(allocated))
    monkeypatch.setattr(mods.engine, "sync", lambda dev: None, raising=False)
    me, _ = fake_self(mods, Rows([0, 1, 2]), 12)
    P.op_quiesce(me)
    assert reads == ["cpu"] and me.quiesced_device_bytes == 100
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    assert reads == ["cpu"], "on read the device memory inside its own (client-timed) request"
    assert "device_bytes" not in res
    P.after_reply(me, "greedy")  # another op's reply: nothing read
    assert reads == ["cpu"]
    P.after_reply(me, "on")
    assert P.op_fetched_checksums(me) == {"checksums": [3, 3, 3], "device_bytes": {"before": 100, "after": 250}}
    assert P.op_fetched_checksums(me)["device_bytes"] is None  # handed out once
    P.after_reply(me, "on")  # an on without its own quiesce: no stale "before"
    assert P.op_fetched_checksums(me)["device_bytes"] == {"before": None, "after": 999}


class FakeGate:
    """A StreamGate stand-in: opens (or not) when the fetch thread starts, naming its blocks."""

    def __init__(self, opens: bool, blocks: int) -> None:
        self.opens, self.blocks, self.fetch_from = opens, blocks, 0
        self.made = None
        self.times_us = {"armed": 5, "enqueued": 9, "ended": 30}

    def __call__(self, stream, device, layer_groups=None):
        self.made = (stream, device) if layer_groups is None else (stream, device, layer_groups)
        self.waited, self.groups_issued = [], [(0, 2), (2, 4)]
        return self

    def wait(self):
        return self.opens

    def wait_layer(self, layer):
        self.waited.append(layer)
        return layer == 0  # a False (the fetch ended) must not reach torch either


def overlapped_self(mods, fetch_result, opens=True, blocks=3):
    """fake_self for op_on with fetch overlap on: the gate and the fetch's start and finish replaced.

    The fetch's finish (taking the job's result) is recorded in ``calls``, so
    tests see it relative to the forward."""
    me, calls = fake_self(mods, None, 0)
    order = []
    gate = FakeGate(opens, blocks)
    me.overlap, me.gpu = True, 0
    me.kv = types.SimpleNamespace(StreamGate=gate)
    me.landing = types.SimpleNamespace(cache=types.SimpleNamespace(set_length=lambda n: calls.append(("set_length", n))))

    def begin(landing, hint, hashes, manifest, kill_donor, g, run_async):
        order.append(("begin", g is gate, run_async))
        return "started"

    def finish(landing, held, started):
        assert started == "started"
        calls.append(("finish",))
        return fetch_result

    me._fetch_begin, me._fetch_finish = begin, finish
    return me, calls, order, gate


def test_overlapped_on_enqueues_the_forward_before_the_fetch_completes(mods):
    P = mods.prefill_worker.PrefillWorker
    fetch = {"fetched_tokens": 12, "bytes": 1, "host_payload_bytes": 0, "transport": "cuda_same_device_convert_kernel"}
    me, calls, order, gate = overlapped_self(mods, (3, dict(fetch), None, 0))
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    assert gate.made == (0x51, 0)  # the worker's current stream, its GPU
    # Started on the target's own thread with the gate; the suffix forward
    # (8 of 20 tokens on 12 fetched) ran before the fetch's result was taken.
    assert order == [("begin", True, True)]
    assert calls[:3] == [("set_length", 12), ("prefill", 8, me.landing.cache), ("finish",)]
    assert list(res["phases_ms"]) == ["fetch_launch", "forward", "readback", "fetch_join"]
    assert res["fetched_tokens"] == 12 and res["fell_back"] is None and res["first_token"] == 3
    assert me.fetched == (me.landing.cache, 0, 3)
    o = res["overlap_us"]
    assert (o["gate_armed"], o["gate_enqueued"], o["gate_ended"]) == (5, 9, 30)
    assert 0 <= o["opened"] <= o["forward_done"]


class FakeLayer:
    """A decoder layer that keeps its forward pre-hooks (torch's ``register_forward_pre_hook``)."""

    def __init__(self) -> None:
        self.hooks = []

    def register_forward_pre_hook(self, fn):
        self.hooks.append(fn)
        return types.SimpleNamespace(remove=lambda: self.hooks.remove(fn))


def test_layered_overlap_waits_for_each_group_before_its_first_layer(mods):
    P = mods.prefill_worker.PrefillWorker
    fetch = {"fetched_tokens": 12, "bytes": 1, "host_payload_bytes": 0, "transport": "cuda_same_device_convert_kernel"}
    me, calls, order, gate = overlapped_self(mods, (3, dict(fetch), None, 0))
    layers = [FakeLayer() for _ in range(4)]
    me.model = types.SimpleNamespace(model=types.SimpleNamespace(layers=layers))
    me.layer_groups = 2
    me.kv.layer_group_ranges = lambda n, g: [range(0, 2), range(2, 4)] if (n, g) == (4, 2) else None
    inner, hooked = mods.engine.prefill, []

    def prefill(model, toks, cache=None, sw=None, ids=None):
        # The forward runs every layer: each pre-hook fires before its layer.
        hooked.append([len(layer.hooks) for layer in layers])
        for layer in layers:
            for h in list(layer.hooks):
                assert h(layer, ()) is None  # torch would replace the layer's arguments otherwise
        return inner(model, toks, cache, sw=sw, ids=ids)

    mods.engine.prefill = prefill
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    assert gate.made == (0x51, 0, 2)
    assert hooked == [[1, 0, 1, 0]]  # one hook on each group's first layer, during the forward
    assert gate.waited == [0, 2]
    assert all(not layer.hooks for layer in layers)  # removed after it
    assert res["fetched_tokens"] == 12 and res["layer_groups_issued"] == 2


def test_a_fetch_failing_under_the_enqueued_forward_is_recomputed_in_full(mods):
    P = mods.prefill_worker.PrefillWorker
    none = {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}
    me, calls, order, _ = overlapped_self(mods, (None, dict(none), ["donor gone", "transfer", "donor_dead"], 0))
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    # The forward on the fetched rows ran, then the whole prompt was recomputed from scratch.
    assert [c for c in calls if c[0] == "prefill"] == [("prefill", 8, me.landing.cache), ("prefill", 20, None)]
    assert res["fetched_tokens"] == 0 and res["fell_back"][1] == "transfer"
    assert me.fetched is None and me.resident is None


def test_a_gate_that_never_opens_falls_to_the_sequential_path(mods):
    P = mods.prefill_worker.PrefillWorker
    none = {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}
    me, calls, order, _ = overlapped_self(mods, (None, dict(none), ["refused", "pin", "refused"], 0), opens=False)
    res = P.op_on(me, list(range(20)), b"hint", [1, 2, 3], None)
    # No forward before the fetch's result; one full prefill after it.
    assert order == [("begin", True, True)]
    assert [c for c in calls if c[0] in ("prefill", "finish")] == [("finish",), ("prefill", 20, None)]
    assert list(res["phases_ms"]) == ["fetch", "forward", "readback"]
    assert res["fell_back"][1] == "pin"


def probe_env(conn, cfg):
    conn.send(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


@pytest.mark.parametrize("preset", [None, "backend:native"])
def test_worker_processes_start_with_expandable_segments_unless_set(preset, monkeypatch):
    from gpu_serving import rpc

    if preset is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", preset)
    w = rpc.Worker(probe_env, {})
    try:
        got = w.conn.recv()
    finally:
        w.proc.join(30)
    assert got == (preset or "expandable_segments:True")
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == preset  # the harness's own environment is untouched


def test_serve_re_enables_gc_after_a_request_that_raised_with_it_off():
    from gpu_serving import rpc

    class Conn:
        def __init__(self):
            self.reqs, self.sent = [{"op": "boom"}, {"op": "exit"}], []

        def recv(self):
            return self.reqs.pop(0)

        def send(self, m):
            self.sent.append(m)

    class H:
        def op_boom(self):
            gc.disable()
            raise RuntimeError("mid-way")

    c = Conn()
    rpc.serve(c, H())
    assert gc.isenabled() and c.sent[0]["ok"] is False and "mid-way" in c.sent[0]["error"]


def test_repeats_below_one_is_refused(tmp_path, capsys):
    from gpu_serving import harness

    assert harness.main(["--out", str(tmp_path / "r.json"), "--repeats", "0"]) == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


# A staged prompt on the overlapped path: the suffix forward, and the full
# recompute after a late failure or a gate that never opened, read views of
# the staged ids: (fetch result, gate opens, gate blocks, ids lengths seen,
# fetched tokens reported).
FETCHED = {"bytes": 1, "host_payload_bytes": 0, "transport": "x"}
NONE = {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}
OVERLAPPED_STAGED = {
    "suffix_from_the_gate": ((3, {"fetched_tokens": 12, **FETCHED}, None, 0), True, 3, [8], 12),
    "everything_fetched_keeps_the_last_block": ((5, {"fetched_tokens": 20, **FETCHED}, None, 0), True, 5, [4], 16),
    "failed_after_the_forward_recomputes_all": ((None, dict(NONE), ["x", "transfer", "y"], 0), True, 3, [8, 20], 0),
    "gate_never_opened_computes_all": ((None, dict(NONE), ["x", "pin", "y"], 0), False, 3, [20], 0),
}


@pytest.mark.parametrize("case", sorted(OVERLAPPED_STAGED))
def test_overlapped_on_reads_views_of_the_staged_ids(mods, case):
    result, opens, blocks, seen, fetched = OVERLAPPED_STAGED[case]
    P = mods.prefill_worker.PrefillWorker
    me, calls, order, _ = overlapped_self(mods, result, opens=opens, blocks=blocks)
    P.op_stage(me, list(range(100, 120)))
    res = P.op_on(me, None, b"h", [1], None)
    assert me.ids_seen == seen and res["fetched_tokens"] == fetched
