"""The `gpu_serving` harness: later-turn TTFT OFF vs ON vs ideal on real engines.

``python -m gpu_serving.harness --out result.json [options]`` (run with
``crates/kv-testkit/python`` on ``sys.path``). Starts a decode worker and a
prefill worker (two processes, any device each), routes every turn through an
in-process ``kv_reuse.Router`` and writes the JSON that kvq's ``gpu_serving``
section puts into ``record.json`` (field list: docs/gpu-serving.md).

Prints ``SKIP gpu_serving: <reason>`` and writes ``{"skipped": reason}`` (exit
0) when torch, transformers or kv_reuse cannot be imported or the requested
CUDA device is absent. Exit 1 on a worker error (the JSON then has ``error``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

from . import rpc
from .regimes import WarmRegime, bucket_table, donor_kill, paired_ms, warm_summary
from .timing import best, phase_medians, timed
from .workload import Workload, WorkloadError, percentile
# What --transport moves the KV through (the JSON's ``transport_path``).
TRANSPORT_PATH = {"cuda": "cuda_ipc", "host": "host_shm"}


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_serving.harness", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default="llama-3.1-8b", help="engine.SHAPES key (tiny for CPU)")
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:0")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--history-max", type=int, default=32768, help="largest final history, tokens")
    p.add_argument("--turn-tokens", type=int, nargs=2, default=(150, 256), metavar=("MIN", "MAX"))
    p.add_argument("--gen-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=16, help="greedy agreement length")
    p.add_argument("--greedy-every", type=int, default=1, help="check greedy agreement every Nth later turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed OFF / ON / ideal measurements per turn (the row reports the minimum, samples_ms keeps all)",
    )
    p.add_argument(
        "--first-turn-repeats",
        type=int,
        default=None,
        help="timed OFF / ON measurements of a session's first turn (no donor yet; default: --repeats). Its goal "
        "(ON within 1 ms of OFF) is a per-turn difference of two forwards of up to 32K tokens, which move by "
        "several ms between samples: more samples give each side's minimum a chance to reach the same floor",
    )
    p.add_argument(
        "--transport",
        choices=("cuda", "host"),
        default="cuda",
        help="cuda: CUDA bank and CUDA-tensor target (CUDA IPC, no host payload); host: host-shm bank and host rows",
    )
    p.add_argument(
        "--landing",
        choices=("cache", "rows"),
        default=None,
        help="where the prefill's fetches land: cache (the engine's KV cache, HF layout, the cuda default) "
        "or rows (block-major rows, then re-laid; the host transport's only choice)",
    )
    p.add_argument(
        "--fetch-overlap",
        choices=("on", "layers", "off"),
        default="on",
        help="on (cache landing only): the fetch runs on a fetch thread and the suffix forward is enqueued behind its "
        "copies (kv_reuse.StreamGate) while the fetch completes; its result is used only once the fetch succeeded. "
        "layers: as on, the fetch released layer group by layer group (--layer-groups), each decoder layer waiting "
        "only for its own group, so the forward's first layers run while later layers are still copied. "
        "off: the fetch returns before the forward starts",
    )
    p.add_argument(
        "--layer-groups",
        type=int,
        default=8,
        help="with --fetch-overlap layers: layer groups a fetch is cut into (2..=1024; kv_reuse.layer_group_ranges)",
    )
    p.add_argument(
        "--stage-prompt",
        choices=("on", "off"),
        default="off",
        help="on: an ON request's prompt goes to the prefill worker (one-way 'stage') before the router is asked, "
        "so the worker receives and uploads it while the advise is in flight; the request then carries the hint "
        "(measured on an H100 in session 21: no gain, slower at 32K; docs/gpu-serving.md). "
        "off: advise first, then one request with prompt and hint (OFF and ideal always send one request)",
    )
    p.add_argument(
        "--answer",
        choices=("greedy", "forced"),
        default="greedy",
        help="decode answer: greedy steps, or first token greedy and the rest seeded with their KV in one pass",
    )
    p.add_argument(
        "--regime",
        choices=("churn", "both"),
        default=None,
        help="churn: the prefill keeps no prefix cache; both: also the warm regime (its own cache kept), same run. "
        "Default: both where the workload fits the card by harness.memory_estimate, else churn with a note "
        "(8 sessions to 32K on an 80 GB card)",
    )
    p.add_argument(
        "--donor-kill",
        choices=("on", "off"),
        default="on",
        help="after the workload, one turn whose donor is SIGKILLed mid-fetch (must fall back, leak nothing)",
    )
    p.add_argument(
        "--router",
        choices=("in-process", "service"),
        default="in-process",
        help="in-process: a kv_reuse.Router in the harness, fed the decode's events; service: nats-server and the "
        "kv-reuse-router binary as processes, the workers publishing on NATS (donor agent, target announcements, "
        "donor directory) and the harness advising through kv_reuse.RouterClient",
    )
    p.add_argument(
        "--advise-busy-poll-us",
        type=int,
        default=0,
        help="--router service: the busy-poll window, µs, of the router's advise thread after each answer "
        "(kv-reuse-router --advise-busy-poll-us) and of the harness's RouterClient while a reply is outstanding "
        "(busy_poll_us); 0, the default, never spins (docs/router-service.md, \"Latency: busy polling\")",
    )
    p.add_argument(
        "--decode-cache",
        choices=("auto", "device", "host"),
        default="auto",
        help="where the decode worker keeps an idle session's KV between its turns: device (beside the bank's copy "
        "of its blocks), host (pinned host memory, restored for the session's next turn, untimed), or auto: host "
        "when the estimated device memory with device caches exceeds the decode device's (an 80 GB card for the "
        "full workload), else device. Decode is never timed",
    )
    p.add_argument(
        "--decode-prefill-chunk",
        type=int,
        default=None,
        help="tokens per chunk of the decode worker's own (untimed) prefill; 0: one pass. Default: 8192 with "
        "--decode-cache host, else 0 (a 32K one-pass prefill of the 8B shape peaks at ~13 GiB of activations)",
    )
    p.add_argument(
        "--share-weights",
        choices=("auto", "on", "off"),
        default="auto",
        help="on: the prefill worker runs on the decode worker's parameters, mapped from its process (CUDA IPC "
        "on a GPU, shared memory on the CPU), so the card holds the weights once; off: each worker keeps its own "
        "copy (same seed, same bits). auto: on when both workers use the same CUDA device. Nothing timed "
        "changes (same kernels on the same bytes); it is what lets both regimes of 8 sessions fit an 80 GB card",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop starting turns after this many seconds since start (0: no limit); the JSON says truncated",
    )
    a = p.parse_args(argv)
    if a.fetch_overlap == "layers" and not 2 <= a.layer_groups <= 1024:
        p.error(f"--layer-groups {a.layer_groups}: 2..=1024 with --fetch-overlap layers")
    return a


def skip(out: str, reason: str) -> int:
    print(f"SKIP gpu_serving: {reason}", flush=True)
    with open(out, "w") as f:
        json.dump({"skipped": reason}, f)
    return 0


def bf16_bits_to_f32(bits: bytes):
    import numpy as np

    return (np.frombuffer(bits, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse(argv)
    if not 0 <= a.advise_busy_poll_us <= 1_000_000:
        print(f"gpu_serving: --advise-busy-poll-us must be in 0..=1000000, got {a.advise_busy_poll_us}", file=sys.stderr)
        return 2
    for flag, v in (("--repeats", a.repeats), ("--first-turn-repeats", a.first_turn_repeats)):
        if v is not None and v < 1:
            print(f"gpu_serving: {flag} must be at least 1, got {v}", file=sys.stderr)
            return 2
    if a.decode_prefill_chunk is not None and a.decode_prefill_chunk < 0:
        print(f"gpu_serving: --decode-prefill-chunk must be >= 0, got {a.decode_prefill_chunk}", file=sys.stderr)
        return 2
    try:
        a.share_weights = share_weights(a.share_weights, a.prefill_device, a.decode_device)
    except ValueError as e:
        print(f"gpu_serving: {e}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return skip(
            a.out,
            f"torch/transformers cannot be imported by {sys.executable} ({e!r}); "
            "set KVQ_PYTHON to an interpreter that has them",
        )
    try:
        import kv_reuse
    except Exception as e:
        return skip(a.out, f"kv_reuse cannot be imported ({e!r}); pip install the wheel (docs/python.md)")
    import torch

    for d in {a.prefill_device, a.decode_device}:
        if d.startswith("cuda") and not torch.cuda.is_available():
            return skip(a.out, f"device {d} requested but torch sees no CUDA device")
        if a.transport == "cuda" and not d.startswith("cuda"):
            return skip(a.out, f"--transport cuda needs CUDA devices for both workers, got {d} (use --transport host)")
    from . import decode_worker, engine, prefill_worker

    w = Workload(a.sessions, a.turns, a.history_max, tuple(a.turn_tokens), tuple(a.gen_tokens), engine.shape(a.model).vocab, a.seed)
    try:
        sessions = w.build()
    except WorkloadError as e:
        # A usage error like the flags' own (exit 2), naming the flag.
        print(f"gpu_serving: --{e.field.replace('_', '-')}: {str(e).split(': ', 1)[1]}", file=sys.stderr)
        return 2
    tpb = a.tokens_per_block
    s = engine.shape(a.model)
    block_bytes = s.kv_bytes_per_token() * tpb
    longest = a.history_max + a.turn_tokens[1] + a.gen_tokens[1]
    target_rows = longest // tpb + 2
    slots = sum(x.target_history + a.turn_tokens[1] + a.gen_tokens[1] for x in sessions) // tpb + 2 * len(sessions)
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    notes = []
    if shm_free is not None and a.transport == "host":
        # The bank and the target's rows both live in /dev/shm; keep 10 % free.
        fit = int(shm_free * 0.9) // block_bytes - target_rows
        if fit < slots:
            notes.append(f"bank cut from {slots} to {max(fit, 1)} slots by /dev/shm ({shm_free} bytes free): LRU eviction")
            slots = max(fit, 1)
    total = device_total_bytes(a.decode_device)
    gib = 1 << 30
    if a.regime is None:
        # The warm regime keeps the prefill's own per-session caches on the
        # card as well: where even the smaller estimate does not fit, the
        # run measures what fits (churn) and says so rather than failing
        # out of memory in its first round.
        a.regime = "both"
        both = min(memory_estimate(s, sessions, a, slots * block_bytes, target_rows * block_bytes).values())
        if total is not None and both > total:
            a.regime = "churn"
            notes.append(f"warm regime not run: both regimes need an estimated {both / gib:.1f} GiB, more than the "
                         f"decode device's {total / gib:.1f} GiB (--regime both runs it anyway)")
    need = memory_estimate(s, sessions, a, slots * block_bytes, target_rows * block_bytes)
    decode_cache = a.decode_cache
    if decode_cache == "auto":
        decode_cache = "host" if total is not None and need["device"] > total else "device"
    chunk = a.decode_prefill_chunk if a.decode_prefill_chunk is not None else (8192 if decode_cache == "host" else 0)
    # Where the decode kept idle sessions' KV, its prefill chunk, and the
    # estimate that chose them (bytes; memory_estimate): into the result.
    # Trim the prefill's allocator cache before the decode's requests where
    # the decode restores caches per request (the card barely fits: op_trim).
    a.prefill_trim = decode_cache == "host"
    memory = {"decode_cache": decode_cache, "decode_prefill_chunk": chunk, "memory_estimate_bytes": need,
              "shared_weights": a.share_weights, "prefill_trim": a.prefill_trim}
    print(f"gpu_serving: device memory estimate {need['device'] / gib:.1f} GiB with the decode's session caches on "
          f"the device, {need['host'] / gib:.1f} GiB on the host; decode device holds "
          f"{'?' if total is None else f'{total / gib:.1f}'} GiB: decode cache {decode_cache}, prefill chunk {chunk}",
          flush=True)
    if total is not None and need[decode_cache] > total:
        notes.append(f"estimated device memory {need[decode_cache] / gib:.1f} GiB exceeds the decode device's "
                     f"{total / gib:.1f} GiB: expect out-of-memory (fewer --sessions, or --regime churn, which keeps "
                     f"no warm caches)")
    cfg = {"model": a.model, "seed": a.seed, "tokens_per_block": tpb, "transport": a.transport}
    t_start = time.perf_counter()
    svc = None
    if a.router == "service":
        from . import service

        try:
            svc = service.RouterService(tpb, [k for k, v in router_settings().items() if v is True],
                                        ["--advise-busy-poll-us", str(a.advise_busy_poll_us)])
        except service.ServiceError as e:
            return skip(a.out, f"--router service: {e}")
        cfg["nats_url"] = a.nats_url = svc.url
        print(f"gpu_serving: router service on {svc.url} ({svc.ready})", flush=True)
    decode = rpc.Worker(decode_worker.main, {**cfg, "device": a.decode_device, "bank_slots": slots, "answer": a.answer,
                                                "decode_cache": decode_cache, "prefill_chunk": chunk})
    prefill = rpc.Worker(
        prefill_worker.main, {**cfg, "device": a.prefill_device, "target_rows": target_rows, "warm": a.regime == "both",
                               "landing": a.landing, "fetch_overlap": a.fetch_overlap != "off",
                               "layer_groups": a.layer_groups if a.fetch_overlap == "layers" else None}
    )
    result: Dict[str, Any] = {}
    try:
        decode.wait_started()
        prefill.wait_started()
        if a.share_weights:
            blob, _ = decode.call("export_weights")
            adopted, _ = prefill.call("adopt_weights", weights=blob["weights"])
            del blob
            memory["shared_weights_freed_bytes"] = adopted["freed_bytes"]
            print(f"gpu_serving: prefill runs on the decode's weights ({adopted['freed_bytes'] / gib:.1f} GiB of "
                  f"its own freed)", flush=True)
        started_s = time.perf_counter() - t_start
        print(f"gpu_serving: phase start {started_s:.1f} s (both workers built their models)", flush=True)
        rpc.freeze_startup_objects()  # this process imported torch too; timed() collects before each sample
        result = run(a, w, sessions, decode, prefill, kv_reuse, notes, slots, target_rows, t_start)
        result.update(memory)
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
        result["phases_s"] = phases(started_s, result.pop("_advise_ms"), decode, prefill, result["wall_s"])
        for k, v in result["phases_s"].items():
            print(f"gpu_serving: phase {k} {v} s", flush=True)
        if result.get("fetch_us_p50"):
            print("gpu_serving: fetch split p50 us (later fetched turns): "
                  + ", ".join(f"{n} {x:.0f}" for n, x in result["fetch_us_p50"].items()), flush=True)
        for k, v in result["phase_p50_ms"].items():
            print(f"gpu_serving: {k} per-phase p50 ms (later fetched turns): "
                  + ", ".join(f"{n} {x:.2f}" for n, x in v.items()), flush=True)
        rc = 0
    except rpc.WorkerError as e:
        result = {"error": str(e)}
        print(f"gpu_serving: {e}", file=sys.stderr)
        rc = 1
    finally:
        # The prefill first: it may map the decode's weights (and fetched
        # from its bank), and an exporter must outlive its importers.
        prefill.close()
        decode.close()
        if svc is not None:
            # The router's own time per advise, before it stops: what the
            # client's advise_ms adds to it is NATS and the client.
            latency = svc.advise_latency()
            codes = svc.stop()
            result["router_service"] = {"url": svc.url, "exit_codes": codes, "advise_service_us": latency,
                                        "advise_busy_poll_us": a.advise_busy_poll_us}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return rc


def share_weights(asked: str, prefill_device: str, decode_device: str) -> bool:
    """Whether the prefill worker adopts the decode's parameters (``--share-weights``).

    ``auto``: only when both workers use the same CUDA device (the case
    where holding them twice costs the card's memory); ``on`` / ``off`` as
    asked. Raises ``ValueError`` naming ``--share-weights`` for ``on``
    across two devices (a mapped tensor stays on its own device), and
    naming the device for ``auto`` / ``on`` with a CUDA device that is not
    ``cuda`` or ``cuda:N``; ``off`` reads neither device.
    """
    if asked == "off":
        return False
    same = prefill_device == decode_device or (
        prefill_device.startswith("cuda") and decode_device.startswith("cuda")
        and _ordinal(prefill_device) == _ordinal(decode_device))
    if asked == "on" and not same:
        raise ValueError(f"--share-weights on: the workers use {prefill_device} and {decode_device}; "
                         "parameters can be shared on one device only")
    return same and (asked == "on" or (asked == "auto" and decode_device.startswith("cuda")))


def _ordinal(device: str) -> int:
    """``cuda`` -> 0, ``cuda:3`` -> 3; ``ValueError`` naming ``device`` for anything else."""
    if device == "cuda":
        return 0
    prefix, _, n = device.partition(":")
    if prefix != "cuda" or not n.isdigit():
        raise ValueError(f"--share-weights: device {device!r} is not `cuda` or `cuda:N`")
    return int(n)


def memory_estimate(s, sessions, a, bank_bytes: int, landing_bytes: int) -> Dict[str, int]:
    """Device bytes both workers hold at their peaks, by where the decode keeps idle sessions' KV.

    ``{"device": ..., "host": ...}`` (``--decode-cache``), summed over both
    workers as if on one device (the worst case, and the harness's default):

    - prefill: weights (none of its own when ``a.share_weights`` is True, as
      resolved by :func:`share_weights`), its landing cache (two in the warm regime), the warm
      regime's per-session caches, OFF's own cache of the longest prompt, and
      the activations of that one-pass prefill;
    - decode: weights, the bank, the rows of one retain (up to the longest
      prompt's blocks), either every session's cache (``device``) or one
      working cache (``host``), and the activations of its own prefill pass:
      ``--decode-prefill-chunk`` tokens when given (0: one pass), else the
      default of each mode (one pass on ``device``, 8192 tokens on ``host``).

    Activations: ``(16 x hidden + 4 x intermediate) x 2`` bytes a token (bf16),
    which puts the 8B shape's 32K prefill at 7.6 GiB; with the caches above it
    lands near the prefill worker's measured 32.4 GiB (session 21, H100). An
    estimate to choose ``--decode-cache auto`` and to warn; the record's
    ``device_bytes`` are measured.
    """
    kv = s.kv_bytes_per_token()
    histories = sum(x.target_history + a.turn_tokens[1] + a.gen_tokens[1] for x in sessions) * kv
    longest = a.history_max + a.turn_tokens[1] + a.gen_tokens[1]
    per_token_act = (16 * s.hidden + 4 * s.intermediate) * 2
    warm = a.regime == "both"
    prefill = (0 if getattr(a, "share_weights", False) is True else s.weight_bytes()) + landing_bytes * (2 if warm else 1) + (histories if warm else 0) + longest * (kv + per_token_act)
    decode = s.weight_bytes() + bank_bytes + longest * kv
    # The decode's prefill pass: --decode-prefill-chunk when given (0: one
    # pass), else the default of each mode (device: one pass, host: 8192).
    def pass_tokens(default: int) -> int:
        chunk = default if a.decode_prefill_chunk is None else a.decode_prefill_chunk
        return min(chunk, longest) if chunk > 0 else longest

    return {
        "device": prefill + decode + histories + pass_tokens(0) * per_token_act,
        "host": prefill + decode + longest * kv + pass_tokens(8192) * per_token_act,
    }


def device_total_bytes(device: str) -> Optional[int]:
    """Total memory of CUDA device ``device`` (None for a CPU device)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def router_settings() -> Dict[str, Any]:
    """The in-process router's reuse settings (docs/settings.md keys).

    Reuse on, and the GPU path too: a CUDA donor bank (``--transport cuda``)
    is the GPU path, which the cost model refuses (``GpuPathDisabled``) unless
    ``enable_decode_to_prefill_gpu_reuse`` is set; it does not affect a host
    donor. Every other setting keeps its default: the cost model decides.
    """
    return {"enable_decode_to_prefill_reuse": True, "enable_decode_to_prefill_gpu_reuse": True}


def phases(started_s: float, advise_ms: float, decode, prefill, wall_s: float) -> Dict[str, float]:
    """Seconds per phase: start (both models built), router advise, each worker request kind, the rest."""
    out = {"start": round(started_s, 1), "advise": round(advise_ms / 1e3, 2)}
    for name, wk in (("prefill", prefill), ("decode", decode)):
        for op, ms in sorted(wk.totals_ms.items()):
            out[f"{name}.{op}"] = round(ms / 1e3, 2)
    out["other"] = round(wall_s - sum(out.values()), 1)
    return out


def run(a, w: Workload, sessions, decode, prefill, kv_reuse, notes, slots, target_rows, t_start) -> Dict[str, Any]:
    import numpy as np

    trim = getattr(a, "prefill_trim", False)

    tpb = a.tokens_per_block
    dh, _ = decode.call("hello")
    ph, _ = prefill.call("hello")
    if dh["weights_checksum"] != ph["weights_checksum"]:
        raise rpc_error("hello", "the two workers built different weights")
    s = __import__("gpu_serving.engine", fromlist=["shape"]).shape(a.model)
    layout = kv_reuse.Layout(s.num_layers, s.num_kv_heads, s.head_dim, "bf16", tpb, 1)
    if a.router == "service":
        router = ServiceRouter(kv_reuse, a.nats_url, prefill, busy_poll_us=a.advise_busy_poll_us)
        router.wait_known([ph["engine_id"]] + ([ph["warm_engine_id"]] if a.regime == "both" else []), tpb)
    else:
        settings = kv_reuse.Settings(router_settings(), env={})
        router = kv_reuse.Router(settings, tokens_per_block=tpb)
        router.register_worker(1, dh["engine_id"], "decode", layout)
        router.register_worker(2, ph["engine_id"], "prefill", layout)
        if a.regime == "both":
            router.register_worker(3, ph["warm_engine_id"], "prefill", layout)
    warm = warm_run = None
    if a.regime == "both":
        warm = warm_run = WarmRegime(router, ph["warm_engine_id"], tpb,
                                     publish=router.publish_prefix if a.router == "service" else None)
    # Once, untimed: the largest prompt's prefill (allocator growth, kernel
    # selection) so the first measured turns do not pay it.
    prefill.call("warmup", tokens=a.history_max + a.turn_tokens[1])
    manifest: Optional[bytes] = None
    turns: List[Dict[str, Any]] = []
    bit_equal, max_diff, agree, agree_n = True, 0.0, 0, 0
    fallbacks = false_completions = 0
    later = 0
    advise_total = 0.0
    truncated = None
    warm_error = None
    staged = a.stage_prompt == "on"
    for t, sess, user, gen in w.rounds(sessions):
        if a.budget_s and time.perf_counter() - t_start > a.budget_s:
            truncated = f"--budget-s {a.budget_s} reached after {len(turns)} turns"
            notes.append(truncated)
            print(f"gpu_serving: {truncated}", flush=True)
            break
        prompt = sess.history + user
        hashes = kv_reuse.sequence_hashes(prompt, tpb)
        check_greedy = t > 0 and later % a.greedy_every == 0 and a.greedy_tokens > 0

        offs: List[Dict[str, Any]] = []
        ons: List[Dict[str, Any]] = []
        ideals: List[Dict[str, Any]] = []
        on_logits_all: List[bytes] = []
        on_sums: List[int] = []
        off = off_greedy = on = advice = on_greedy = ideal = None
        warmup_ms = prefill.call("warmup", tokens=64)[0]["worker_ms"]
        for rep in range(a.first_turn_repeats if t == 0 and a.first_turn_repeats else a.repeats):
            # OFF and ON alternate which runs first, so neither always finds the
            # caches and allocator warmed by the other.
            off_first = (len(turns) + rep) % 2 == 0
            greedy_now = check_greedy and rep == 0

            def run_off():
                r, _, smp = timed(prefill, "off", {"prompt": prompt})
                g = prefill.call("greedy", n=a.greedy_tokens)[0]["greedy"] if greedy_now else None
                return r, smp, g

            if off_first:
                o, smp, g = run_off()
                offs.append(smp)
                if off is None:
                    off, off_greedy = o, g
            rid = f"{sess.id}-t{t}" + (f"-r{rep}" if rep else "")
            o, adv, smp = timed(
                prefill, "on",
                # Without a hint nothing is fetched: the request carries no hashes
                # (a first turn pays no pickling of them).
                lambda adv: {"prompt": None if staged else prompt, "hint": adv.hint,
                             "hashes": hashes if adv.hint is not None else None, "manifest": manifest},
                before=lambda: router.advise(rid, hashes, ph["engine_id"]),
                stage={"prompt": prompt} if staged else None,
            )
            ons.append(smp)
            on_logits_all.append(o["logits"])
            advise_total += smp["phases_ms"]["advise"]
            if rep == 0:
                on, advice = o, adv
                on_greedy = prefill.call("greedy", n=a.greedy_tokens)[0]["greedy"] if greedy_now else None
                got = prefill.call("fetched_checksums")[0]  # untimed
                on_sums, on_device_bytes = got["checksums"], got.get("device_bytes")
            if o["fetched_tokens"] > 0:
                idl, _, smp = timed(prefill, "ideal", {"prompt": prompt})
                ideals.append(smp)
                on_logits_all.append(idl["logits"])
                if ideal is None:
                    ideal = idl
            if not off_first:
                o, smp, g = run_off()
                offs.append(smp)
                if off is None:
                    off, off_greedy = o, g
        off_s, on_s = best(offs), best(ons)
        off_ms, on_ms, advise_ms = off_s["ms"], on_s["ms"], on_s["phases_ms"]["advise"]
        row: Dict[str, Any] = {
            "session": sess.id,
            "turn": t,
            "history": len(sess.history),
            "prompt": len(prompt),
            "bucket": w.bucket_of(len(sess.history)),
            "off_ms": round(off_ms, 3),
            "on_ms": round(on_ms, 3),
            "advise_ms": round(advise_ms, 3),
            "warmup_ms": round(warmup_ms, 3),
            "fetch_ms": round(on["fetch_ms"], 3),
            # The stable refusal code (None when admitted) and its words, not
            # the deprecated `Advice.verdict` (a Debug text of no stable form).
            "reason": advice.reason,
            "detail": advice.detail,
            "admitted": advice.admitted,
            "fetched_tokens": on["fetched_tokens"],
            "fetch_us": on.get("fetch_us"),
            "fetch_stages_us": on.get("fetch_stages_us"),
            "overlap_us": on.get("overlap_us"),
            # The prefill's torch-allocated device bytes before / after ON (None on the CPU).
            "device_bytes": on_device_bytes,
            "bytes": on["bytes"],
            "host_payload_bytes": on["host_payload_bytes"],
            "transport": on["transport"],
            "fell_back": on["fell_back"],
            # Where the reported (minimum) sample's time went, and every sample.
            "off_phases_ms": off_s["phases_ms"],
            "on_phases_ms": on_s["phases_ms"],
            "samples_ms": {"off": [round(x["ms"], 3) for x in offs], "on": [round(x["ms"], 3) for x in ons],
                           "ideal": [round(x["ms"], 3) for x in ideals]},
        }
        if ideals:
            row["ideal_phases_ms"] = best(ideals)["phases_ms"]
            ideal_ms = best(ideals)["ms"]
        if advice.hint is not None and on["fetched_tokens"] == 0:
            fallbacks += 1
        on_logits, off_logits = bf16_bits_to_f32(on["logits"]), bf16_bits_to_f32(off["logits"])
        diff = float(np.max(np.abs(on_logits - off_logits)))
        row["max_logit_diff_vs_off"] = diff
        if trim:
            prefill.call("trim")  # untimed: room for the decode's restore (op_trim)
        if ideal is not None:
            row["ideal_ms"] = round(ideal_ms, 3)
            ref = decode.call("reference", session=sess.id, prompt=prompt, fetched_tokens=on["fetched_tokens"], greedy_n=0)[0]
            # Every repetition's ON and ideal must give the same bits (a fetch is deterministic).
            eq = ref["logits"] == on["logits"] and ideal["logits"] == on["logits"] and all(x == on["logits"] for x in on_logits_all)
            row["logits_bit_equal_to_donor"] = eq
            bit_equal &= eq
            max_diff = max(max_diff, diff)
            n = on["fetched_tokens"] // tpb
            want = decode.call("checksums", hashes=hashes[:n])[0]["checksums"]
            row["checksums_equal"] = want == on_sums
            if not row["checksums_equal"]:
                false_completions += 1
        if check_greedy:
            same = sum(x == y for x, y in zip(on_greedy, off_greedy))
            row["greedy_agreement"] = same / a.greedy_tokens
            agree += same
            agree_n += a.greedy_tokens
        if warm is not None:
            try:
                prefill.call("warmup", tokens=64)  # the decode's reference / checksums ran on the GPU meanwhile
                wr = warm.turn(prefill, sess.id, t, prompt, hashes, manifest, on_first=len(turns) % 2 == 0,
                               repeats=a.repeats, staged=staged)
            except rpc.WorkerError as e:
                # The churn measurement goes on; the JSON says why warm stopped
                # (kvq's warm_regime check fails on it).
                warm_error = f"{sess.id} turn {t}: {e}"
                print(f"gpu_serving: warm regime stopped: {warm_error}", flush=True)
                warm = None
        if warm is not None:
            on_l, off_l = wr.pop("_logits")
            sums = wr.pop("_checksums")
            wr["max_logit_diff_vs_off"] = float(np.max(np.abs(bf16_bits_to_f32(on_l) - bf16_bits_to_f32(off_l))))
            if wr["fetched_tokens"] > 0:
                lo = wr["fetch_from"]
                want = decode.call("checksums", hashes=hashes[lo : lo + len(sums)])[0]["checksums"]
                wr["checksums_equal"] = want == sums
                if not wr["checksums_equal"]:
                    false_completions += 1
            row["warm"] = wr
        if t > 0:
            later += 1
        if trim:
            prefill.call("trim")
        d, _ = decode.call("turn", session=sess.id, prompt=prompt, gen=gen)
        for e in d["events"]:
            router.apply_event(e)
        if warm is not None:
            warm.learn(d["events"])
            warm.report(sess.id, prompt, hashes)
        if a.router == "service":
            manifest = dh["engine_id"]  # the prefill resolves it from the donor directory
        else:
            manifest = d["manifest"]
            router.report_donor(manifest, dh["endpoint"], d["slots"])
        row["decode_ms"] = round(d["decode_ms"], 3)
        row["retain_ms"] = round(d["retain_ms"], 3)
        sess.history = prompt + d["output"]
        turns.append(row)
        print(
            f"gpu_serving: [{time.perf_counter() - t_start:.0f} s] {sess.id} turn {t} history {row['history']}: OFF {off_ms:.1f} ms, ON {on_ms:.1f} ms"
            f" ({row['fetched_tokens']} fetched, {row['reason'] or 'admitted'}; "
            + " ".join(f"{k} {v:.1f}" for k, v in row["on_phases_ms"].items())
            + f"), ideal {row.get('ideal_ms', float('nan')):.1f} ms"
            + (f"; warm OFF {row['warm']['off_ms']:.1f} ms, ON {row['warm']['on_ms']:.1f} ms"
               f" ({row['warm']['fetched_tokens']} fetched from block {row['warm']['fetch_from']})" if "warm" in row else ""),
            flush=True,
        )
    ds, _ = decode.call("stats")
    kill = None
    if a.donor_kill == "on" and turns:
        # Last: the decode worker is dead afterwards. The session with the
        # longest history: its fetch is the one the cost model admits most
        # surely (a short one, e.g. the tiny CPU model's last session, may be
        # refused as not worth it, and then no fetch is there to kill).
        last = max(sessions, key=lambda x: len(x.history))
        rng = random.Random(a.seed + 2)
        user = [rng.randrange(s.vocab) for _ in range(a.turn_tokens[0])]
        try:
            kill = donor_kill(prefill, router, ph["engine_id"], decode.proc.pid, last, user,
                              lambda toks: kv_reuse.sequence_hashes(toks, tpb), manifest)
        except rpc.WorkerError as e:  # recorded: kvq's donor_kill_falls_back fails on it
            kill = {"ok": False, "error": str(e), "first_token_produced": False}
        print(f"gpu_serving: donor SIGKILLed mid-fetch: fell back {kill.get('fell_back')}, ok {kill['ok']}", flush=True)
    ps, _ = prefill.call("stats", forget_donors=True)
    r = summarise(a, w, turns, dh, ph, ds, ps, bit_equal, max_diff, agree, agree_n, fallbacks, false_completions, notes, slots, target_rows)
    r["warm"] = warm_summary(w, turns, warm_run.unreported) if warm_run is not None else None
    r["warm_error"] = warm_error
    r["donor_kill"] = kill
    r["truncated"] = truncated
    r["_advise_ms"] = advise_total
    return r


class ServiceRouter:
    """What the harness asks of a router, answered by the router service (``--router service``).

    ``advise`` goes through ``kv_reuse.RouterClient`` (NATS request/reply to
    ``kv-reuse-router``); workers, KV events and the donor directory reach
    the service from the workers' own publishers, so ``register_worker`` /
    ``report_donor`` have no counterpart here. The warm regime's
    prefix-cache events go out through ``publish_prefix`` (the prefill
    worker's warm target publisher).
    """

    def __init__(self, kv_reuse: Any, nats_url: str, prefill: Any, timeout_s: float = 5.0, busy_poll_us: int = 0) -> None:
        self.kv = kv_reuse
        self.prefill = prefill
        self.client = kv_reuse.RouterClient(nats_url, timeout_s=timeout_s, busy_poll_us=busy_poll_us)

    def advise(self, request_id: str, hashes: List[int], target: str) -> Any:
        return self.client.advise(request_id, hashes, target)

    def publish_prefix(self, tokens: List[int], first_block: int) -> int:
        """The warm target now holds the sealed blocks of ``tokens``, new from ``first_block``: its event on NATS."""
        return self.prefill.call("publish_prefix_stored", tokens=tokens, first_block=first_block)[0]["blocks"]

    def wait_known(self, targets: List[str], tpb: int, deadline_s: float = 60.0) -> None:
        """Waits until the service answers for every target (their announcements processed).

        Raises ``WorkerError("router", ...)`` after ``deadline_s`` seconds.
        """
        hashes = self.kv.sequence_hashes([1] * tpb, tpb)
        end = time.monotonic() + deadline_s
        for t in targets:
            while True:
                try:
                    self.client.advise(f"wait-{t}", hashes, t)
                    break
                except self.kv.AdviseRefused as e:
                    if time.monotonic() > end:
                        raise rpc_error("router", f"target {t} unknown to the router service after {deadline_s} s: {e}")
                    time.sleep(0.1)


def rpc_error(op: str, msg: str):
    from .rpc import WorkerError

    return WorkerError(op, msg)


def summarise(a, w, turns, dh, ph, ds, ps, bit_equal, max_diff, agree, agree_n, fallbacks, false_completions, notes, slots, target_rows):
    later = [r for r in turns if r["turn"] > 0]
    first = [r for r in turns if r["turn"] == 0]
    first_pairs = paired_ms(first)
    buckets = bucket_table(w, later, ideal=True)
    transports = sorted({r["transport"] for r in turns if r["fetched_tokens"] > 0})
    leaks = sum(ps["leaks_grown"].values()) + (ds["pins_outstanding"] or 0)
    return {
        "model": a.model,
        # The top-level buckets are churn's (the prefill keeps no prefix
        # cache, ON fetches everything); "warm" holds the warm regime's.
        "regime": "churn+warm" if a.regime == "both" else "churn",
        "devices": {"prefill": a.prefill_device, "decode": a.decode_device},
        "workload": {
            "sessions": w.sessions,
            "turns": w.turns,
            "history_max": w.history_max,
            "turn_tokens": list(w.turn_tokens),
            "gen_tokens": list(w.gen_tokens),
            "tokens_per_block": a.tokens_per_block,
            "seed": w.seed,
            "answer": a.answer,
            "greedy_every": a.greedy_every,
        },

        "router": ("service: kv-reuse-router and nats-server as processes, advice over NATS (kv_reuse.RouterClient), "
                   "cost model deciding" if a.router == "service" else
                   "in-process kv_reuse.Router (the wheel), cost model deciding"),
        "router_mode": a.router,
        "transport": transports,
        "transport_path": TRANSPORT_PATH[a.transport],
        # Where the prefill's fetches land: "cache" (the engine's own KV cache, HF
        # layout, converted inside the copy) or "rows" (block-major rows, re-laid).
        "landing": ph.get("landing", "rows"),
        # True: ON's suffix forward was enqueued behind the fetch's copies
        # while the fetch completed on another thread (StreamGate).
        "fetch_overlap": ph.get("fetch_overlap", False),
        # Layer groups the overlapped fetch was released in (None: the whole fetch at once).
        "layer_groups": ph.get("layer_groups"),
        # True: ON requests sent their prompt ahead of the advise (--stage-prompt on).
        "prompt_staged": a.stage_prompt == "on",
        "turns": turns,
        "buckets": buckets,
        # Median per phase of the reported (minimum) samples of later turns
        # that fetched: where ON's time goes next to ideal's and OFF's.
        "phase_p50_ms": {
            k: phase_medians([r for r in later if r["fetched_tokens"] > 0], f"{k}_phases_ms") for k in ("on", "ideal", "off")
        },
        # The first repetition's fetch split (import / transfer / rest, µs), median over later fetched turns.
        "fetch_us_p50": phase_medians([r for r in later if r["fetched_tokens"] > 0 and r.get("fetch_us")], "fetch_us"),
        # The executor's stages and, with fetch overlap, the launch's points (µs, medians).
        "fetch_stages_us_p50": phase_medians([r for r in later if r["fetched_tokens"] > 0 and r.get("fetch_stages_us")],
                                             "fetch_stages_us"),
        "overlap_us_p50": phase_medians([r for r in later if r["fetched_tokens"] > 0 and r.get("overlap_us")], "overlap_us"),
        "repeats": a.repeats,
        "first_turn_repeats": a.first_turn_repeats or a.repeats,
        "first_turns": {
            "turns": len(first),
            "off_p50_ms": percentile([r["off_ms"] for r in first], 50),
            "on_p50_ms": percentile([r["on_ms"] for r in first], 50),
            # Per turn ON - OFF (the same prompt), then the median: the two p50s
            # above come from turns of different sizes, so one noisy turn moves them.
            "on_minus_off_p50_ms": percentile([r["on_ms"] - r["off_ms"] for r in first], 50),
            "advise_p50_ms": percentile([r["advise_ms"] for r in first], 50),
            # Per turn ON's forward phase - OFF's, then the median: how much of the
            # difference above is the forward itself (the same computation; with a
            # staged prompt ON's excludes building the ids tensor, done during the advise).
            "forward_on_minus_off_p50_ms": percentile(
                [r["on_phases_ms"].get("forward", 0.0) - r["off_phases_ms"].get("forward", 0.0) for r in first], 50),
            # ON - OFF of every repetition of every first turn, paired by repetition
            # (the two ran back to back), then the median: the goal's measure. It keeps
            # all of ON's cost, in the forward too, and a drift slower than one
            # repetition cancels in each pair.
            "paired_p50_ms": percentile(first_pairs, 50),
            "pairs": len(first_pairs),
            # Diagnosis, not the goal: per turn, what ON adds outside the forward
            # (advise, the empty fetch, the request's own time against OFF's), then the
            # median. It leaves out anything ON makes slower inside the forward.
            "added_p50_ms": percentile(
                [(r["on_ms"] - r["on_phases_ms"].get("forward", 0.0)) - (r["off_ms"] - r["off_phases_ms"].get("forward", 0.0))
                 for r in first], 50),
            # Per turn, the range (max - min) of OFF's own samples, then the median: the
            # spread one forward of a first turn shows between identical requests.
            "off_spread_p50_ms": percentile(
                [max(r["samples_ms"]["off"]) - min(r["samples_ms"]["off"]) for r in first], 50),
        },
        "bytes_moved": sum(r["bytes"] for r in turns),
        "host_payload_bytes": sum(r["host_payload_bytes"] for r in turns),
        "fetched_turns": sum(1 for r in turns if r["fetched_tokens"] > 0),
        "logits_bit_equal_to_donor": bit_equal and any(r["fetched_tokens"] > 0 for r in turns),
        "max_logit_diff_vs_off": max_diff,
        "greedy_agreement": round(agree / agree_n, 4) if agree_n else None,
        "fallbacks": fallbacks,
        "false_completions": false_completions,
        "leaks": leaks,
        "leaks_detail": {"prefill_grown": ps["leaks_grown"], "donor_pins_outstanding": ds["pins_outstanding"],
                         # Donors each prefill target kept imported at the end (dropped before the count above).
                         "prefill_imported_donors": ps.get("imported_donors")},
        "bank_slots": slots,
        "target_rows": target_rows,
        "store_failures": len(ds["store_failures"]),
        "build_s": {"prefill": round(ph["build_s"], 1), "decode": round(dh["build_s"], 1)},
        "device_bytes": {
            "prefill_before": ph["device_bytes"],
            "prefill_after": ps["device_bytes"],
            "decode_before": dh["device_bytes"],
            "decode_after": ds["device_bytes"],
        },
        "notes": notes,
    }


if __name__ == "__main__":
    sys.exit(main())
