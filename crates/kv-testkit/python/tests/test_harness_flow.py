"""harness.run end to end on fake workers, a fake router and stand-in modules (no torch).

Checks the control flow the real engines go through (test_harness.py with
torch, and the GPU): churn OFF / ON / ideal, the donor reference and
checksums, the warm regime's turns and reports, the donor-killed turn, the
summary; and that a failing warm request stops the warm regime only.
"""

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stubs  # noqa: E402

B = 16
LOGITS = bytes(8)  # 4 bf16 zeros


def seq_hashes(tokens, tpb):
    out, h = [], 7
    for i in range(len(tokens) // tpb):
        h = (h * 1000003 + hash(tuple(tokens[i * tpb : (i + 1) * tpb]))) % (1 << 63)
        out.append(h)
    return out


class FakeRouter:
    def __init__(self, settings, tokens_per_block):
        # The cost model refuses a CUDA donor without the GPU path setting.
        assert settings["enable_decode_to_prefill_gpu_reuse"] is True
        self.held, self.workers, self.events = set(), {}, 0

    def register_worker(self, key, engine, role, layout):
        self.workers[engine] = role

    def apply_event(self, e):
        self.events += 1

    def report_donor(self, manifest, endpoint, slots):
        self.held |= set(slots)

    def advise(self, request_id, hashes, target):
        assert target in self.workers
        ok = bool(hashes) and hashes[0] in self.held
        return stubs.advice(b"hint" if ok else None)


class Decode:
    def __init__(self):
        self.proc = types.SimpleNamespace(pid=424242)
        self.totals_ms = {}
        self.events = []

    def call(self, op, **kw):
        from gpu_serving import prefix_events as pe

        if op == "hello":
            r = {"engine_id": "d", "endpoint": "unix:/x", "weights_checksum": 1, "device_bytes": 0, "build_s": 1.0}
        elif op == "turn":
            out = list(range(kw["gen"]))
            toks = (kw["prompt"] + out)[:-1]
            hs = seq_hashes(toks, B)
            ev = pe.pack({"publisher": "d", "event_id": 1, "role": "decode", "layout_fingerprint": 5, "tp_size": 1,
                          "tier": "retained_gpu_direct",
                          "data": {"stored": {"parent": None, "blocks": [{"sequence_hash": h, "token_hash": h ^ 1} for h in hs]}}})
            r = {"output": out, "computed_tokens": 1, "decode_ms": 1.0, "retain_ms": 1.0, "events": [ev],
                 "manifest": b"m", "slots": {h: i for i, h in enumerate(hs)}}
        elif op == "reference":
            r = {"logits": LOGITS, "first_token": 1, "greedy": []}
        elif op == "checksums":
            r = {"checksums": [11] * len(kw["hashes"])}
        elif op == "stats":
            r = {"store_failures": [], "pins_outstanding": 0, "leaks": {}, "device_bytes": 0}
        return r, 2.0


class Prefill:
    def __init__(self, fail_warm_at=None):
        self.totals_ms, self.calls, self.fail_warm_at = {}, [], fail_warm_at
        self.staged = None
        self.effective = []

    def send(self, op, **kw):
        assert op == "stage" and kw["prompt"]
        self.calls.append((op, kw))
        self.staged = kw["prompt"]
        return 0.1

    def call(self, op, **kw):
        from gpu_serving import rpc

        self.calls.append((op, kw))  # as sent
        if op in ("on", "warm_on") and kw["prompt"] is None:  # the worker's _prompt_ids
            assert self.staged is not None, "no prompt given and none staged"
            kw = {**kw, "prompt": self.staged}
        self.staged = None
        self.effective.append((op, kw))  # with the staged prompt in place
        first = {"first_token": 1, "logits": LOGITS}
        if op == "hello":
            return {"engine_id": "p", "warm_engine_id": "pw", "weights_checksum": 1, "device_bytes": 0, "build_s": 1.0}, 1.0
        if op in ("off", "ideal", "warm_off"):
            return {"worker_ms": 1.0, "held_tokens": 0, **first}, 3.0
        if op == "warmup":
            return {"worker_ms": 5.0}, 5.0
        if op == "quiesce":
            return {}, 0.1
        if op == "fetched_checksums":
            last = next(c for c in reversed(self.calls) if c[0] in ("on", "warm_on"))
            n_on = sum(1 for c in self.calls if c[0] == "on")
            return {"checksums": [11] * 2 if last[1].get("hint") and not last[1].get("kill_donor") else [],
                    # What after_reply read for the last "on": numbered, so a row shows which ON it got.
                    "device_bytes": {"before": 1000 * n_on, "after": 1000 * n_on + 7}}, 0.1
        if op == "greedy":
            return {"greedy": [1] * kw["n"]}, 1.0
        if op == "warm_commit":
            return {"tokens": 1}, 0.1
        if op == "stats":
            return {"free_rows": 9, "leaks_grown": {}, "device_bytes": 0}, 0.1
        if op == "warm_on" and self.fail_warm_at is not None and len([c for c in self.calls if c[0] == "warm_on"]) > self.fail_warm_at:
            raise rpc.WorkerError("warm_on", "boom")
        hint = kw.get("hint")
        if kw.get("kill_donor"):
            fetch = {"fetched_tokens": 0, "fell_back": ["gone", "transfer", "dead"]}
        elif hint:
            fetch = {"fetched_tokens": 2 * B, "fell_back": None}
        else:
            fetch = {"fetched_tokens": 0, "fell_back": None}
        fetch.update(bytes=fetch["fetched_tokens"] * 10, host_payload_bytes=0, transport="cuda_same_device_copy", fetch_ms=0.5)
        if op == "warm_on":
            fetch.update(held_tokens=10, fetch_from=1 if hint else 0)
        # Later ON samples are faster: the row must report the minimum.
        ms = 2.0 - 0.5 * len([c for c in self.effective if c[0] == op and c[1].get("session") == kw.get("session")
                               and c[1]["prompt"] == kw["prompt"]][1:])
        return {"worker_ms": 1.0, "phases_ms": {"fetch": 0.25, "forward": 0.5}, **fetch, **first}, ms


@pytest.fixture
def harness_mods():
    saved = stubs.install()
    kv = sys.modules["kv_reuse"]
    kv.sequence_hashes = seq_hashes
    kv.Settings = lambda d, env: d
    kv.Router = FakeRouter
    from gpu_serving import harness

    yield harness, kv
    stubs.restore(saved)


def run(harness, kv, prefill, *extra):
    from gpu_serving.workload import Workload

    argv = ["--out", "x", "--model", "tiny", "--prefill-device", "cpu", "--decode-device", "cpu", "--transport", "host",
            "--sessions", "8", "--turns", "3", "--history-max", "1024", "--turn-tokens", "40", "60",
            "--gen-tokens", "8", "16", "--tokens-per-block", str(B), "--greedy-every", "2",
            "--regime", "both", *extra]  # main's choice on a CPU device (nothing to fit)
    a = harness.parse(argv)
    w = Workload(a.sessions, a.turns, a.history_max, tuple(a.turn_tokens), tuple(a.gen_tokens), 256, a.seed)
    return harness.run(a, w, w.build(), Decode(), prefill, kv, [], 100, 70, 0.0)


def test_every_part_of_a_turn_runs_and_lands_in_the_summary(harness_mods):
    harness, kv = harness_mods
    prefill = Prefill()
    r = run(harness, kv, prefill)
    assert r["regime"] == "churn+warm" and len(r["turns"]) == 24 and r["warm_error"] is None
    assert r["fetched_turns"] == 16 and r["logits_bit_equal_to_donor"] is True
    assert r["false_completions"] == 0 and r["leaks"] == 0 and r["fallbacks"] == 0
    assert r["warm"]["later_turns"] == 16 and r["warm"]["fetched_turns"] == 16
    assert all(t["warm"]["checksums_equal"] for t in r["turns"] if t["turn"] > 0)
    # Each advice is recorded by its stable code and words, never the deprecated `verdict`.
    refused = [t for t in r["turns"] if not t["admitted"]]
    assert len(refused) == 8 and all(t["turn"] == 0 for t in refused)
    assert all((t["reason"], t["detail"]) == ("no_donor", "no donor holds the prefix") for t in refused)
    assert all(t["reason"] is None and t["detail"] is None for t in r["turns"] if t["admitted"])
    assert all((t["warm"]["reason"], t["warm"]["detail"]) == (None, None) for t in r["turns"] if t["turn"] > 0)
    assert not any("verdict" in t or "verdict" in t.get("warm", {}) for t in r["turns"])
    k = r["donor_kill"]
    assert k["ok"] and k["advised"] and k["fell_back"][1] == "transfer"
    assert (k["reason"], k["detail"]) == (None, None) and "verdict" not in k
    (kill,) = [c for c in prefill.calls if c[1].get("kill_donor")]
    assert kill[1]["kill_donor"] == 424242
    assert [c[0] for c in prefill.calls[-3:]] == ["on", "stats", "stats"]  # the kill turn comes last
    # Untimed warm-ups: the largest prompt once, then before each turn's churn and warm pairs.
    warmups = [c[1]["tokens"] for c in prefill.calls if c[0] == "warmup"]
    assert warmups == [1024 + 60] + [64] * 48
    assert prefill.calls[1][0] == "warmup" and all(t["warmup_ms"] == 5.0 for t in r["turns"])
    # A request without a hint carries no hashes (nothing is fetched); one with a hint carries them.
    ons = [kw for op, kw in prefill.calls if op in ("on", "warm_on")]
    assert any(kw["hint"] is None for kw in ons) and any(kw["hint"] is not None for kw in ons)
    assert all((kw["hashes"] is None) == (kw["hint"] is None) for kw in ons)


def test_stage_prompt_off_sends_each_prompt_with_its_request(harness_mods):
    harness, kv = harness_mods
    staged, plain = Prefill(), Prefill()
    r_on, r_off = run(harness, kv, staged, "--stage-prompt", "on"), run(harness, kv, plain)  # off: the default
    assert r_on["prompt_staged"] is True and r_off["prompt_staged"] is False
    assert not any(op == "stage" for op, _ in plain.calls)
    assert all(kw["prompt"] for op, kw in plain.calls if op in ("on", "warm_on"))
    # Staged: every timed ON and ON-warm request (not the donor-kill turn's) had its prompt sent ahead.
    timed_ons = [kw for op, kw in staged.calls if op in ("on", "warm_on") and not kw.get("kill_donor")]
    assert sum(op == "stage" for op, _ in staged.calls) == len(timed_ons) == 48
    # Same flow and outcome either way.
    for k in ("fetched_turns", "fallbacks", "false_completions", "leaks", "logits_bit_equal_to_donor"):
        assert r_on[k] == r_off[k], k
    assert "forward_on_minus_off_p50_ms" in r_on["first_turns"]
    # The fakes' ON and OFF forwards both take 0.5 ms, OFF has no phases (its
    # forward reads as 0): ON adds its own time minus its forward, minus OFF's.
    for r in (r_on, r_off):
        ft = r["first_turns"]
        first = [t for t in r["turns"] if t["turn"] == 0]
        want = sorted((t["on_ms"] - t["on_phases_ms"]["forward"]) - t["off_ms"] for t in first)
        assert ft["added_p50_ms"] == want[(len(want) + 1) // 2 - 1]
        assert ft["off_spread_p50_ms"] == 0.0  # one OFF sample per turn
        pairs = sorted(on - off for t in first for on, off in zip(t["samples_ms"]["on"], t["samples_ms"]["off"]))
        assert ft["pairs"] == len(first) and ft["paired_p50_ms"] == pairs[(len(pairs) + 1) // 2 - 1]


def test_a_failing_warm_request_stops_warm_only(harness_mods):
    harness, kv = harness_mods
    r = run(harness, kv, Prefill(fail_warm_at=3))
    assert "warm_on: boom" in r["warm_error"]
    assert len(r["turns"]) == 24 and r["fetched_turns"] == 16  # churn measured throughout
    assert sum(1 for t in r["turns"] if "warm" in t) == 3


def test_repeats_report_the_minimum_keep_every_sample_and_time_per_phase(harness_mods):
    harness, kv = harness_mods
    prefill = Prefill()
    r = run(harness, kv, prefill, "--repeats", "3", "--stage-prompt", "on")
    assert r["repeats"] == 3 and r["logits_bit_equal_to_donor"] is True and r["false_completions"] == 0
    t = next(x for x in r["turns"] if x["turn"] > 0 and x["fetched_tokens"] > 0)
    assert len(t["samples_ms"]["on"]) == 3 and len(t["samples_ms"]["off"]) == 3 and len(t["samples_ms"]["ideal"]) == 3
    assert t["on_ms"] == min(t["samples_ms"]["on"]) < t["samples_ms"]["on"][0]
    assert t["on_phases_ms"]["fetch"] == 0.25 and t["on_phases_ms"]["rpc"] == 0.0  # the min sample: 1.0 ms call, 1.0 in the worker
    assert set(t["on_phases_ms"]) == {"fetch", "forward", "stage", "advise", "rpc"} and t["on_phases_ms"]["stage"] == 0.1
    assert r["phase_p50_ms"]["on"]["forward"] == 0.5 and "advise" in r["phase_p50_ms"]["on"]
    assert "advise" not in r["phase_p50_ms"]["ideal"] and r["phase_p50_ms"]["off"] == {"rpc": 2.0}
    assert len(t["warm"]["samples_ms"]["on"]) == 3 and t["warm"]["on_repeats_bit_equal"] is True
    # Every timed request was preceded by an untimed quiesce; checksums asked once per ON turn, untimed.
    ops = [c[0] for c in prefill.calls]
    for i, op in enumerate(ops):
        if op in ("on", "warm_on") and not prefill.calls[i][1].get("kill_donor"):
            # ON's prompt was staged (--stage-prompt on) inside the timed region: quiesce, stage, request
            # without a prompt; the staged prompt is this turn's (its OFF's, sent with the request).
            assert ops[i - 2 : i] == ["quiesce", "stage"], (i, op)
            assert prefill.calls[i][1]["prompt"] is None
            off = "off" if op == "on" else "warm_off"
            # The nearest such OFF, before or after (OFF and ON alternate which runs first).
            same_turn = min(((abs(j - i), kw) for j, (o, kw) in enumerate(prefill.calls) if o == off),
                            key=lambda x: x[0])[1]
            assert prefill.calls[i - 1][1]["prompt"] == same_turn["prompt"]
        elif op in ("off", "ideal", "warm_off"):
            assert ops[i - 1] == "quiesce", (i, op)
    assert ops.count("fetched_checksums") == 2 * 24  # one per churn turn and one per warm turn


def test_first_turns_take_their_own_repeats_and_rows_get_their_on_device_bytes(harness_mods):
    harness, kv = harness_mods
    prefill = Prefill()
    r = run(harness, kv, prefill, "--repeats", "2", "--first-turn-repeats", "5")
    assert r["repeats"] == 2 and r["first_turn_repeats"] == 5
    for t in r["turns"]:
        n = 5 if t["turn"] == 0 else 2
        assert (len(t["samples_ms"]["off"]), len(t["samples_ms"]["on"])) == (n, n), t["turn"]
    # Each row's device bytes are those fetched_checksums handed out right after
    # that turn's first ON (rep 0): count the ONs sent up to it.
    ons = 0
    seen = []
    for op, kw in prefill.calls:
        if op == "on":
            ons += 1
        if op == "fetched_checksums" and (not seen or seen[-1] != ons):
            seen.append(ons)
    churn_rows = [t["device_bytes"] for t in r["turns"]]
    assert churn_rows[0] == {"before": 1000 * seen[0], "after": 1000 * seen[0] + 7}
    assert all(d["after"] - d["before"] == 7 for d in churn_rows)
    assert r["turns"][0]["device_bytes"] != r["turns"][1]["device_bytes"]
    assert harness.main(["--out", "x", "--first-turn-repeats", "0"]) == 2
