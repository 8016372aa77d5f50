"""The warm regime's and the donor-killed turn's harness logic, pure Python (fake workers and router).

The events written here are checked against the real router in
test_prefix_events.py; the real engines run them in test_harness.py
(with torch) and on the GPU.
"""

import os
import subprocess
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stubs  # noqa: E402
from gpu_serving import prefix_events as pe  # noqa: E402
from gpu_serving.regimes import WarmRegime, donor_kill, warm_summary  # noqa: E402
from gpu_serving.workload import Workload  # noqa: E402

B = 4
WARM = "00000000-0000-4000-8000-0000000000aa"


class FakeRouter:
    def __init__(self, hint=b"hint"):
        self.events, self.advised, self.hint = [], [], hint

    def apply_event(self, e):
        self.events.append(pe.unpack(e))

    def advise(self, request_id, hashes, target):
        self.advised.append((request_id, target))
        return stubs.advice(self.hint, "saving_below_minimum", "saving 1.0 ms below the minimum 2.0 ms")


class FakePrefill:
    def __init__(self, replies):
        self.calls, self.replies = [], replies

    def call(self, op, **kw):
        self.calls.append((op, kw))
        return dict(self.replies.get(op, {})), 10.0


def decode_event(hashes, token_hashes):
    blocks = [{"sequence_hash": h, "token_hash": t, "slot": i} for i, (h, t) in enumerate(zip(hashes, token_hashes))]
    return pe.pack({"publisher": "00000000-0000-4000-8000-0000000000dd", "event_id": 1, "role": "decode",
                    "layout_fingerprint": 77, "tp_size": 1, "tier": "retained_gpu_direct",
                    "data": {"stored": {"parent": None, "blocks": blocks}}})


def test_report_tells_the_router_each_sealed_block_once_in_chain_order():
    router = FakeRouter()
    warm = WarmRegime(router, WARM, B)
    hashes = [101, 102, 103, 104, 105, 106]
    warm.learn([decode_event(hashes[:5], [201, 202, 203, 204, 205])])
    warm.report("s0", list(range(14)), hashes)  # 3 sealed blocks
    warm.report("s0", list(range(14)), hashes)  # nothing new
    warm.report("s0", list(range(24)), hashes)  # blocks 3, 4 known; 5 has no token hash
    assert len(router.events) == 2
    first, second = router.events
    assert first["publisher"] == WARM and first["role"] == "prefill" and first["tier"] == "device"
    assert first["layout_fingerprint"] == 77 and first["event_id"] == 1 and second["event_id"] == 2
    assert first["data"]["stored"] == {"parent": None, "blocks": [
        {"sequence_hash": 101, "token_hash": 201}, {"sequence_hash": 102, "token_hash": 202},
        {"sequence_hash": 103, "token_hash": 203}]}
    assert second["data"]["stored"]["parent"] == 103
    assert [b["sequence_hash"] for b in second["data"]["stored"]["blocks"]] == [104, 105]
    assert warm.reported == {"s0": 5} and warm.unreported == 1


def test_a_warm_turn_advises_the_warm_engine_and_commits_after_both_runs():
    on = {"fetch_ms": 1.0, "held_tokens": 8, "fetch_from": 2, "fetched_tokens": 4, "bytes": 64,
          "host_payload_bytes": 0, "transport": "cuda_same_device_copy", "fell_back": None,
          "logits": b"on"}
    for on_first, order in ((True, ["warm_on", "warm_off"]), (False, ["warm_off", "warm_on"])):
        router = FakeRouter()
        prefill = FakePrefill({"warm_on": on, "warm_off": {"logits": b"off"}, "fetched_checksums": {"checksums": [5]}})
        row = WarmRegime(router, WARM, B).turn(prefill, "s1", 2, [1] * 12, [9, 8, 7], b"m", on_first)
        timed = [c[0] for c in prefill.calls if c[0] != "quiesce"]
        assert timed == [x for o in order for x in ([o, "fetched_checksums"] if o == "warm_on" else [o])] + ["warm_commit"]
        assert row["_checksums"] == [5]
        assert router.advised == [("s1-t2-warm", WARM)]
        assert next(c for c in prefill.calls if c[0] == "warm_on")[1]["hint"] == b"hint"
        assert row["on_ms"] > 10.0 and row["off_ms"] == 10.0  # ON includes the advise
        assert row["fetch_from"] == 2 and row["advised"] and row["_logits"] == (b"on", b"off")
        assert (row["reason"], row["detail"]) == (None, None) and "verdict" not in row
    # A refused warm turn records the router's code and words.
    prefill = FakePrefill({"warm_on": {**on, "fetched_tokens": 0}, "warm_off": {"logits": b"off"},
                           "fetched_checksums": {"checksums": []}})
    row = WarmRegime(FakeRouter(hint=None), WARM, B).turn(prefill, "s1", 2, [1] * 12, [9, 8, 7], b"m", True)
    assert not row["advised"] and row["reason"] == "saving_below_minimum"
    assert row["detail"] == "saving 1.0 ms below the minimum 2.0 ms"


def test_warm_summary_compares_on_with_the_prefills_own_cache():
    w = Workload(history_max=1024, turn_tokens=(40, 60), gen_tokens=(8, 16), vocab=256)
    def turn(t, off, on, fetched, advised=True):
        return {"turn": t, "bucket": 256, "warm": {"off_ms": off, "on_ms": on, "fetched_tokens": fetched,
                "held_tokens": 100, "advised": advised, "bytes": fetched * 10, "host_payload_bytes": 0,
                "samples_ms": {"off": [off], "on": [on]}}}
    rows = [turn(0, 50.0, 50.0, 0, False), turn(1, 5.0, 5.5, 16), turn(2, 6.0, 6.2, 0)]
    s = warm_summary(w, rows, 0)
    assert s["later_turns"] == 2 and s["fetched_turns"] == 1 and s["fallbacks"] == 1
    assert s["within_1ms"] is True and s["buckets"][0]["turns"] == 2
    rows.append(turn(3, 5.0, 9.0, 16))
    rows.append(turn(4, 5.0, 9.0, 16))
    rows.append(turn(5, 5.0, 9.0, 16))
    s = warm_summary(w, rows, 0)
    assert s["within_1ms"] is False and s["p50_within_1ms"] is False
    assert s["buckets"][0]["paired_p50_ms"] == 4.0
    assert warm_summary(w, [{"turn": 1, "bucket": 256}], 0) is None


def test_warm_goal_is_the_median_of_paired_repetitions_whole():
    w = Workload(history_max=1024, turn_tokens=(40, 60), gen_tokens=(8, 16), vocab=256)

    def turn(t, offs, ons, fetched=0):
        return {"turn": t, "bucket": 256, "warm": {
            "off_ms": min(offs), "on_ms": min(ons), "fetched_tokens": fetched, "held_tokens": 100,
            "advised": fetched > 0, "bytes": 0, "host_payload_bytes": 0,
            "samples_ms": {"off": offs, "on": ons}}}
    # One slow OFF sample moves each turn's minimum comparison nowhere, and the
    # pairs' median is the typical difference: +0.5 ms.
    rows = [turn(1, [30.0, 40.0, 30.0], [30.5, 30.5, 30.5]), turn(2, [30.0, 30.0, 30.0], [30.5, 90.0, 30.5])]
    s = warm_summary(w, rows, 0)
    b = s["buckets"][0]
    assert b["pairs"] == 6 and b["paired_p50_ms"] == pytest.approx(0.5)
    assert s["within_1ms"] is True and s["p50_within_1ms"] is True
    # A cost ON pays in every repetition shows, wherever in the request it lies.
    rows = [turn(1, [30.0, 31.0, 30.0], [32.0, 33.0, 32.0])] * 2
    s = warm_summary(w, rows, 0)
    assert s["buckets"][0]["paired_p50_ms"] == pytest.approx(2.0) and s["within_1ms"] is False


def test_donor_kill_turn_passes_the_pid_and_fails_on_a_fetch_or_a_leak():
    sess = types.SimpleNamespace(id="s3", history=[1] * 20)
    def run(on, after_leaks, free_after=9, hint=b"hint"):
        prefill = FakePrefill({"on": on})
        stats = iter([{"leaks_grown": {}, "free_rows": 9}, {"leaks_grown": after_leaks, "free_rows": free_after}])
        prefill.call = (lambda orig: lambda op, **kw: (next(stats), 1.0) if op == "stats" else orig(op, **kw))(prefill.call)
        r = donor_kill(prefill, FakeRouter(hint), "tgt", 4242, sess, [2] * 5, lambda toks: [len(toks)], b"m")
        return r, prefill
    fell = {"fell_back": ["donor gone", "transfer", "dead"], "fetched_tokens": 0, "first_token": 7}
    r, prefill = run(fell, {})
    assert r["ok"] and r["first_token_produced"] and r["history"] == 20
    assert (r["reason"], r["detail"]) == (None, None) and "verdict" not in r
    refused = run(fell, {}, hint=None)[0]
    assert not refused["ok"] and not refused["advised"]
    assert (refused["reason"], refused["detail"]) == ("saving_below_minimum", "saving 1.0 ms below the minimum 2.0 ms")
    (op, kw), = [c for c in prefill.calls if c[0] == "on"]
    assert kw["kill_donor"] == 4242 and kw["prompt"] == [1] * 20 + [2] * 5 and kw["hashes"] == [25]
    assert not run(fell, {"open_fds": 2})[0]["ok"]
    assert not run(fell, {}, free_after=8)[0]["ok"]  # a row kept by the fallen-back fetch
    assert not run({"fell_back": None, "fetched_tokens": 16, "first_token": 7}, {})[0]["ok"]


def test_the_donor_alive_probe_sigkills_the_donor_once():
    saved = stubs.install()
    try:
        from gpu_serving import prefill_worker

        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        alive = prefill_worker._killer(proc.pid)
        assert alive() is False
        assert proc.wait(timeout=10) == -9
        assert alive() is False  # no second signal to a pid that may be reused
    finally:
        stubs.restore(saved)
