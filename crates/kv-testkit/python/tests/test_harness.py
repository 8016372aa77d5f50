"""The harness end to end on the tiny shape, CPU, two worker processes.

Skipped (with the reason) without torch, transformers or the kv_reuse wheel.
"""

import json
import os
import sys

import pytest

pytest.importorskip("torch", reason="torch cannot be imported")
pytest.importorskip("transformers", reason="transformers cannot be imported")
pytest.importorskip("kv_reuse", reason="the kv_reuse wheel is not installed (cargo xtask wheel)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving import harness  # noqa: E402

TINY = ["--model", "tiny", "--prefill-device", "cpu", "--decode-device", "cpu", "--tokens-per-block", "16"]
TINY += ["--transport", "host"]


def test_tiny_run_fetches_bit_equal_kv_and_leaks_nothing(tmp_path):
    out = tmp_path / "r.json"
    argv = TINY + ["--out", str(out), "--sessions", "8", "--turns", "3", "--history-max", "1024"]
    argv += ["--turn-tokens", "40", "60", "--gen-tokens", "8", "16", "--greedy-every", "2", "--repeats", "2"]
    argv += ["--stage-prompt", "on"]  # through real worker processes (the cuda run below: the default, off)
    assert harness.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "tiny" and r["regime"] == "churn+warm" and r["prompt_staged"] is True
    assert len(r["turns"]) == 24
    fetched = [t for t in r["turns"] if t["fetched_tokens"] > 0]
    assert fetched, "the cost model admitted no fetch: nothing was checked"
    assert all(t["turn"] > 0 for t in fetched)  # first turns have no donor
    # Every fetched block's checksum equals the donor's at retention, on turns
    # whose store re-stored an already retained prefix too (turn 2).
    assert all(t["checksums_equal"] for t in fetched)
    assert any(t["turn"] == 2 for t in fetched)
    assert all(t["logits_bit_equal_to_donor"] for t in fetched)
    assert r["logits_bit_equal_to_donor"] is True
    assert r["false_completions"] == 0 and r["leaks"] == 0 and r["fallbacks"] == 0
    # Today's wheel moves the bytes through host shared memory: honest host payload.
    assert r["transport"] == ["memcpy"] and r["transport_path"] == "host_shm"
    assert r["truncated"] is None
    assert r["prefill_trim"] is False and "prefill.trim" not in r["phases_s"]  # device decode cache: no trim
    # Two samples of each timed request, the minimum reported, ON split per phase.
    assert r["repeats"] == 2
    for t in fetched:
        assert len(t["samples_ms"]["on"]) == 2 and t["on_ms"] == min(t["samples_ms"]["on"])
        # ON's prompt was staged ahead of its advise: its send is the stage phase.
        assert set(t["on_phases_ms"]) == {"stage", "stage_worker", "advise", "fetch", "relayout", "forward", "readback",
                                          "rpc"}
        assert set(t["ideal_phases_ms"]) == {"relayout", "forward", "readback", "rpc"}
        # The fetch's own split (µs) adds up within the whole; no device bytes on the CPU.
        assert set(t["fetch_us"]) == {"import", "transfer", "rest"} and min(t["fetch_us"].values()) >= 0
        assert t["device_bytes"] == {"before": None, "after": None}
    assert set(r["phase_p50_ms"]["on"]) >= {"fetch", "forward"} and r["phase_p50_ms"]["on"]["forward"] > 0
    # Every request kind of both workers is in the phase budget, and the phases add up.
    assert {"start", "advise", "prefill.on", "prefill.off", "decode.turn"} <= set(r["phases_s"])
    assert abs(sum(r["phases_s"].values()) - r["wall_s"]) < 0.5
    assert r["bytes_moved"] == sum(t["fetched_tokens"] for t in fetched) * (2 * 2 * 2 * 16 * 2)
    assert r["host_payload_bytes"] == r["bytes_moved"] > 0
    assert 0.0 <= r["max_logit_diff_vs_off"] < 10.0
    assert r["greedy_agreement"] is not None and 0.0 <= r["greedy_agreement"] <= 1.0
    assert [b["history"] for b in r["buckets"]] == [256, 512, 1024][: len(r["buckets"])]
    for b in r["buckets"]:
        assert b["off_p50_ms"] > 0 and b["on_p50_ms"] > 0
    # Warm regime, same run: every later turn measured against the prefill's own cache;
    # what was fetched starts past what the prefill held, and its checksums match.
    warm = r["warm"]
    assert warm["later_turns"] == 16 and warm["buckets"]
    for t in r["turns"]:
        if t["turn"] > 0:
            assert t["warm"]["held_tokens"] > 0
        if t["warm"]["fetched_tokens"] > 0:
            assert t["warm"]["fetch_from"] * 16 <= t["warm"]["held_tokens"] and t["warm"]["checksums_equal"]
    # The donor SIGKILLed mid-fetch: fell back, first token produced, nothing kept.
    k = r["donor_kill"]
    assert k["ok"] and k["first_token_produced"] and k["fell_back"] and k["prefill_leaks_grown"] == {}
    # --decode-cache auto on a CPU device: nothing to estimate against, the caches stay where they are.
    assert r["decode_cache"] == "device" and r["decode_prefill_chunk"] == 0
    assert set(r["memory_estimate_bytes"]) == {"device", "host"}
    assert 0 < r["memory_estimate_bytes"]["host"] < r["memory_estimate_bytes"]["device"]


def test_tiny_run_with_the_decode_caches_on_the_host(tmp_path):
    """--decode-cache host: the decode worker keeps idle sessions' KV in host
    memory and prefills its own first turns in chunks; what it retains and
    what a reference continues on are still its own KV, bit for bit."""
    out = tmp_path / "r.json"
    argv = TINY + ["--out", str(out), "--sessions", "4", "--turns", "3", "--history-max", "1024", "--regime", "churn"]
    argv += ["--turn-tokens", "40", "60", "--gen-tokens", "8", "16", "--decode-cache", "host"]
    argv += ["--decode-prefill-chunk", "48", "--donor-kill", "off", "--share-weights", "on"]
    assert harness.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["decode_cache"] == "host" and r["decode_prefill_chunk"] == 48
    # The prefill ran on the decode's parameters (shared memory on the CPU).
    assert r["shared_weights"] is True and r["shared_weights_freed_bytes"] > 0
    # The host decode cache trims the prefill's allocator before the decode's
    # requests: one trim before each reference and each decode turn.
    assert r["prefill_trim"] is True and r["phases_s"]["prefill.trim"] >= 0
    assert r["decode_cache"] == "host"
    fetched = [t for t in r["turns"] if t["fetched_tokens"] > 0]
    assert fetched, "the cost model admitted no fetch: nothing was checked"
    assert all(t["checksums_equal"] and t["logits_bit_equal_to_donor"] for t in fetched)
    assert r["false_completions"] == 0 and r["leaks"] == 0 and r["fallbacks"] == 0
    assert r["store_failures"] == 0


def test_a_workload_the_flags_cannot_build_is_a_usage_error_naming_the_flag(tmp_path, capsys):
    """A history too short for the turn sizes: exit 2 naming --history-max, no traceback, no JSON."""
    out = tmp_path / "r.json"
    assert harness.main(TINY + ["--out", str(out), "--history-max", "64"]) == 2
    err = capsys.readouterr().err
    assert "--history-max: " in err and "Traceback" not in err
    assert not out.exists()


def test_bad_decode_prefill_chunk_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert harness.main(TINY + ["--out", str(out), "--decode-prefill-chunk", "-1"]) == 2
    assert "--decode-prefill-chunk" in capsys.readouterr().err


def test_tiny_cuda_run_lands_fetches_in_the_engine_cache(tmp_path):
    """The cuda transport end to end on the tiny model: fetches land in the
    prefill's own KV cache (kv_layout="hf"), no re-layout phase, no host
    payload, every fetched block's checksum and the first-token logits equal
    to the donor's, in churn and warm alike; nothing leaks."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("SKIP cuda landing: no CUDA device")
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--prefill-device", "cuda:0", "--decode-device", "cuda:0", "--tokens-per-block", "16",
            "--transport", "cuda", "--out", str(out), "--sessions", "4", "--turns", "3", "--history-max", "1024",
            "--turn-tokens", "40", "60", "--gen-tokens", "8", "16", "--greedy-every", "2", "--repeats", "2",
            ]  # --stage-prompt off, the default: the prompt goes with the request
    assert harness.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["landing"] == "cache" and r["host_payload_bytes"] == 0 and r["prompt_staged"] is False
    assert not any("stage" in t["on_phases_ms"] for t in r["turns"])
    fetched = [t for t in r["turns"] if t["fetched_tokens"] > 0]
    assert fetched, "the cost model admitted no fetch: nothing was checked"
    assert all(t["checksums_equal"] and t["logits_bit_equal_to_donor"] for t in fetched)
    for t in fetched:
        assert "relayout" not in t["on_phases_ms"] and "relayout" not in t["ideal_phases_ms"]
        # torch's allocation counter around ON: the landing cache and model are resident.
        assert t["device_bytes"]["before"] > 0 and t["device_bytes"]["after"] > 0
    # The kept donor imports were dropped before the final leak count.
    assert r["leaks"] == 0 and r["leaks_detail"]["prefill_imported_donors"] is not None
    warm = [t["warm"] for t in r["turns"] if t.get("warm", {}).get("fetched_tokens", 0) > 0]
    assert all(w["checksums_equal"] for w in warm)
    assert r["false_completions"] == 0 and r["leaks"] == 0
    k = r["donor_kill"]
    assert k["ok"] and k["first_token_produced"] and k["fell_back"] and k["prefill_leaks_grown"] == {}


def test_missing_cuda_device_skips_with_reason(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = tmp_path / "r.json"
    assert harness.main(["--out", str(out), "--model", "tiny"]) == 0
    assert "SKIP gpu_serving: device cuda:0 requested" in capsys.readouterr().out
    assert json.loads(out.read_text())["skipped"].startswith("device cuda:0")


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_tiny_run_through_the_router_service(tmp_path, device):
    """``--router service``: nats-server and kv-reuse-router as processes, the
    decode a donor agent publishing its directory record and KV events, the
    prefill resolving the donor from the directory and its warm target
    publishing its own prefix; advice over NATS. Fetches happen, bytes and
    logits equal the donor's, the warm fetch starts past the prefill's own
    blocks, the killed donor falls back, both servers exit cleanly."""
    import torch

    from gpu_serving import service

    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("SKIP service cuda: no CUDA device")
    missing = [n for n, f in (("nats-server", service.find_nats_server), ("kv-reuse-router", service.find_router)) if f() is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing} not found under CI=true (cargo xtask install; cargo build --bin kv-reuse-router)")
        pytest.skip(f"SKIP service: {missing} not found")
    out = tmp_path / "r.json"
    transport = "cuda" if device.startswith("cuda") else "host"
    argv = ["--model", "tiny", "--prefill-device", device, "--decode-device", device, "--tokens-per-block", "16",
            "--transport", transport, "--router", "service", "--out", str(out), "--sessions", "4", "--turns", "3",
            "--history-max", "1024", "--turn-tokens", "40", "60", "--gen-tokens", "8", "16", "--repeats", "2",
            # Router and client both spin briefly for replies (the flag reaches both).
            "--advise-busy-poll-us", "300"]
    assert harness.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["router_service"]["exit_codes"]["router"] == 0  # drained on SIGTERM
    assert r["router_service"]["advise_busy_poll_us"] == 300
    first = r["first_turns"]
    diffs = sorted(t["on_ms"] - t["off_ms"] for t in r["turns"] if t["turn"] == 0)
    assert first["turns"] == 4 and first["on_minus_off_p50_ms"] == diffs[1]  # nearest-rank p50 of 4
    assert first["advise_p50_ms"] > 0
    fetched = [t for t in r["turns"] if t["fetched_tokens"] > 0]
    assert fetched, "the router service admitted no fetch"
    assert all(t["checksums_equal"] and t["logits_bit_equal_to_donor"] for t in fetched)
    assert r["false_completions"] == 0 and r["leaks"] == 0 and r["fallbacks"] == 0
    later = [t for t in r["turns"] if t["turn"] > 0]
    assert all(t["warm"]["held_tokens"] > 0 for t in later)
    for t in later:
        if t["warm"]["fetched_tokens"] > 0:
            assert t["warm"]["fetch_from"] > 0 and t["warm"]["checksums_equal"]
    k = r["donor_kill"]
    assert k["ok"] and k["first_token_produced"] and k["fell_back"] and k["prefill_leaks_grown"] == {}


def test_the_default_regime_is_both_unless_the_estimate_exceeds_the_card(monkeypatch, tmp_path):
    """Without --regime: both regimes where the workload fits the decode
    device by harness.memory_estimate (a CPU device always), else churn with
    a note saying why; an explicit --regime is never changed."""
    out = tmp_path / "r.json"
    base = TINY + ["--out", str(out), "--sessions", "2", "--turns", "2", "--history-max", "1024",
                   "--turn-tokens", "40", "60", "--gen-tokens", "8", "16", "--donor-kill", "off"]
    assert harness.main(base) == 0
    r = json.loads(out.read_text())
    assert r["regime"] == "churn+warm" and not any("warm regime" in n for n in r["notes"])
    # A card smaller than the smaller estimate with both regimes, larger than the churn one.
    a = harness.parse(base)
    from gpu_serving import engine
    from gpu_serving.workload import Workload

    s = engine.shape("tiny")
    w = Workload(a.sessions, a.turns, a.history_max, tuple(a.turn_tokens), tuple(a.gen_tokens), s.vocab, a.seed)
    sessions, bb = w.build(), s.kv_bytes_per_token() * 16
    # The bank and landing sizes main() derives (bank: every session's final history; landing: the longest prompt).
    slots = sum(x.target_history + 60 + 16 for x in sessions) // 16 + 2 * len(sessions)
    rows = (1024 + 60 + 16) // 16 + 2
    est = {}
    for regime in ("both", "churn"):
        a.regime = regime
        est[regime] = min(harness.memory_estimate(s, sessions, a, slots * bb, rows * bb).values())
    assert est["churn"] < est["both"]
    card = (est["churn"] + est["both"]) // 2
    monkeypatch.setattr(harness, "device_total_bytes", lambda device: card)
    assert harness.main(base) == 0
    r = json.loads(out.read_text())
    assert r["regime"] == "churn"
    assert any(n.startswith("warm regime not run: both regimes need an estimated") for n in r["notes"])
    assert harness.main(base + ["--regime", "both"]) == 0
    assert json.loads(out.read_text())["regime"] == "churn+warm"


def full_8b_workload(regime):
    """The 8B shape, the default arguments with ``--regime regime``, and a
    function giving ``memory_estimate`` of the issue's full workload with
    the bank and landing sizes ``main`` derives for it (every session's
    final history; the longest prompt, 33,152 tokens)."""
    from gpu_serving import engine
    from gpu_serving.workload import Workload

    s = engine.shape("llama-3.1-8b")
    a = harness.parse(["--out", "x", "--regime", regime])
    sessions = Workload(a.sessions, a.turns, a.history_max, tuple(a.turn_tokens), tuple(a.gen_tokens), s.vocab,
                        a.seed).build()
    bb = s.kv_bytes_per_token() * a.tokens_per_block
    slots = sum(x.target_history + 256 + 128 for x in sessions) // 64 + 16
    return s, a, lambda: harness.memory_estimate(s, sessions, a, slots * bb, (33152 // 64 + 2) * bb)


def test_the_memory_estimate_counts_the_decode_prefill_pass_in_use():
    """Each mode's estimate counts the decode prefill's pass it will run:
    the flag when given (0: one pass), else one pass on device and 8192
    tokens on host; the 8B full workload's figures of docs/gpu-serving.md."""
    s, a, est = full_8b_workload("churn")
    act = (16 * s.hidden + 4 * s.intermediate) * 2
    default = est()
    assert [round(default[k] / 2**30, 1) for k in ("device", "host")] == [87.1, 70.6]
    a.decode_prefill_chunk = 0
    one_pass = est()
    assert one_pass["device"] == default["device"]
    assert one_pass["host"] - default["host"] == (33152 - 8192) * act
    a.decode_prefill_chunk = 4096
    chunked = est()
    assert default["device"] - chunked["device"] == (33152 - 4096) * act
    assert default["host"] - chunked["host"] == (8192 - 4096) * act
    a.regime = "both"
    a.decode_prefill_chunk = None
    assert [round(v / 2**30, 1) for v in est().values()] == [106.1, 89.5]


def test_share_weights_resolves_by_device_and_refuses_two_devices(tmp_path, capsys):
    """auto shares only on one CUDA device; on shares on any one device and
    is refused across two (exit 2 naming the flag); off never shares."""
    sw = harness.share_weights
    assert sw("auto", "cuda", "cuda:0") and sw("auto", "cuda:1", "cuda:1")
    assert not sw("auto", "cpu", "cpu") and not sw("auto", "cuda:0", "cuda:1")
    assert sw("on", "cpu", "cpu") and not sw("off", "cuda:0", "cuda:0")
    with pytest.raises(ValueError, match="--share-weights on"):
        sw("on", "cuda:0", "cuda:1")
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--prefill-device", "cuda:0", "--decode-device", "cuda:1", "--share-weights", "on"]
    assert harness.main(argv) == 2
    assert "--share-weights on" in capsys.readouterr().err


def test_share_weights_names_a_device_it_cannot_read_and_off_reads_none(tmp_path, capsys):
    """A CUDA device string that is not cuda / cuda:N was int()'s bare
    "invalid literal" (exit 2, naming nothing), even with --share-weights
    off, which shares nothing."""
    sw = harness.share_weights
    assert sw("off", "cuda:0", "cuda:x") is False
    for asked in ("auto", "on"):
        with pytest.raises(ValueError, match=r"^--share-weights: device 'cuda:x' is not `cuda` or `cuda:N`$"):
            sw(asked, "cuda:0", "cuda:x")
    out = tmp_path / "r.json"
    argv = ["--out", str(out), "--prefill-device", "cuda:0", "--decode-device", "cuda:x"]
    assert harness.main(argv) == 2
    assert "device 'cuda:x' is not `cuda` or `cuda:N`" in capsys.readouterr().err


def test_shared_weights_leave_the_prefill_estimate_without_its_copy():
    """Both regimes of the full 8B workload on the host cache: 89.5 GiB with
    two copies of the weights, one copy (14.96 GiB) less when shared (74.6), which
    fits an 80 GB card."""
    s, a, est = full_8b_workload("both")
    a.share_weights = False
    two = est()
    a.share_weights = True
    one = est()
    assert {k: two[k] - one[k] for k in two} == {"device": s.weight_bytes(), "host": s.weight_bytes()}
    assert round(two["host"] / 2**30, 1) == 89.5 and round(one["host"] / 2**30, 1) == 74.6
