"""Why a suffix forward inside gpu_serving's prefill worker is slower than in a fresh process.

gpu_serving measured the 256-token turn's forward at ~35 ms inside the prefill
worker (ON and ideal alike) against ~20 ms in ``engine_profile.py``'s fresh
process. This script times the same forward (``PrefillWorker.op_probe``: a
suffix on ``--history`` tokens of the landing cache, device-synchronised wall
and the time until the model call returned) step by step from a fresh
process to a worker in the harness's state, so the step that adds the time
shows:

1. ``in_process``: a ``PrefillWorker`` in this process;
2. ``child``: the same worker as an ``rpc.Worker`` child (spawn), as the harness runs it;
3. ``with_decode``: both, with a decode worker process on the same GPU;
4. ``after_fetch``: after a decode turn retained the history and the child fetched it (CUDA IPC import, ``on`` and ``ideal``);
5. ``after_off``: after a full prefill of ``--off-tokens`` tokens in the child;
6. ``gc_frozen``: the child after ``gc.freeze()``;
7. ``after_off_spin50``: a 50 ms busy loop before the reps; ``long_run``: 40 reps
   in a row with each rep's start time, core and core clock.

Run on the GPU machine, with the bundle's python dir (the wheel) and this
checkout's harness on PYTHONPATH::

    PYTHONPATH=crates/kv-testkit/python:.bundle/python python3 xtask/gpu/worker_forward.py OUTDIR

CPU smoke test: ``--model tiny --device cpu --transport host``. Writes
``OUTDIR/worker_forward.json`` (medians per stage and every sample).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kv-testkit", "python"))

from gpu_serving import decode_worker, engine, prefill_worker, rpc  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--transport", default="cuda", choices=("cuda", "host"))
    p.add_argument("--history", type=int, default=8192)
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--off-tokens", type=int, default=32768)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tokens-per-block", type=int, default=64)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import kv_reuse

    tpb = a.tokens_per_block
    rows = (max(a.history, a.off_tokens) + a.suffix) // tpb + 2
    cfg = {"model": a.model, "seed": 0, "tokens_per_block": tpb, "transport": a.transport, "device": a.device}
    pcfg = {**cfg, "target_rows": rows, "warm": False, "landing": None}
    res = {"args": vars(a), "stages": []}

    def record(stage: str, got: dict) -> None:
        walls, launches = got["wall_ms"][1:], got["launch_ms"][1:]
        row = {"stage": stage, "wall_p50_ms": statistics.median(walls), "launch_p50_ms": statistics.median(launches),
               **{k: v for k, v in got.items()}}
        res["stages"].append(row)
        print(f"{stage:28s} wall p50 {row['wall_p50_ms']:7.2f} ms, launch p50 {row['launch_p50_ms']:7.2f} ms, "
              f"gc tracked {got['gc_tracked']}, threads {got['torch_threads']}, cores {got['cores']}, "
              f"walls {got['wall_ms']}", flush=True)

    probe = {"history": a.history, "suffix": a.suffix, "reps": a.reps}
    t0 = time.perf_counter()
    local = prefill_worker.PrefillWorker(pcfg)
    record("in_process", local.op_probe(**probe))
    child = rpc.Worker(prefill_worker.main, pcfg)
    try:
        child.wait_started()
        record("child", child.call("probe", **probe)[0])
        record("in_process_again", local.op_probe(**probe))
        decode = rpc.Worker(decode_worker.main, {**cfg, "bank_slots": rows + 8, "answer": "greedy"})
        try:
            decode.wait_started()
            dh, _ = decode.call("hello")
            ph, _ = child.call("hello")
            record("with_decode", child.call("probe", **probe)[0])
            record("with_decode_in_process", local.op_probe(**probe))
            # A turn retained by the decode worker, fetched by the child (the harness's ON path).
            vocab = engine.shape(a.model).vocab
            prompt = [(7 * i + 3) % vocab for i in range(a.history + a.suffix)]
            d, _ = decode.call("turn", session="s", prompt=prompt[: a.history], gen=64)
            s = engine.shape(a.model)
            layout = kv_reuse.Layout(s.num_layers, s.num_kv_heads, s.head_dim, "bf16", tpb, 1)
            router = kv_reuse.Router(kv_reuse.Settings({"enable_decode_to_prefill_reuse": True,
                                                        "enable_decode_to_prefill_gpu_reuse": True}, env={}),
                                     tokens_per_block=tpb)
            router.register_worker(1, dh["engine_id"], "decode", layout)
            router.register_worker(2, ph["engine_id"], "prefill", layout)
            for e in d["events"]:
                router.apply_event(e)
            router.report_donor(d["manifest"], dh["endpoint"], d["slots"])
            hashes = kv_reuse.sequence_hashes(prompt, tpb)
            ons, ideals = [], []
            for i in range(4):
                child.call("quiesce")
                adv = router.advise(f"s-{i}", hashes, ph["engine_id"])
                on, on_ms = child.call("on", prompt=prompt, hint=adv.hint, hashes=hashes, manifest=d["manifest"])
                ons.append({"client_ms": on_ms, "worker_ms": on["worker_ms"], "phases_ms": on["phases_ms"],
                            "fetched_tokens": on["fetched_tokens"], "verdict": adv.verdict})
                if on["fetched_tokens"]:
                    idl, idl_ms = child.call("ideal", prompt=prompt)
                    ideals.append({"client_ms": idl_ms, "worker_ms": idl["worker_ms"], "phases_ms": idl["phases_ms"]})
                print(f"on {ons[-1]}\nideal {ideals[-1] if ideals else None}", flush=True)
            res["on"], res["ideal"] = ons, ideals
            record("after_fetch", child.call("probe", **probe)[0])
            off, off_ms = child.call("off", prompt=[(5 * i + 1) % vocab for i in range(a.off_tokens)])
            res["off"] = {"client_ms": off_ms, "worker_ms": off["worker_ms"]}
            record("after_off", child.call("probe", **probe)[0])
            big = [(5 * i + 1) % vocab for i in range(a.off_tokens)]

            def after_off(stage: str, **kw) -> None:
                child.call("quiesce")
                child.call("off", prompt=big)
                record(stage, child.call("probe", **probe, **kw)[0])

            # Which step after a big OFF prefill brings the forward back.
            after_off("after_off_again")
            after_off("after_off_collect", pre="collect")
            after_off("after_off_empty_cache", pre="empty_cache")
            after_off("after_off_sleep200", pre="sleep:200")
            after_off("after_off_spin50", pre="spin:50")
            record("plain_again", child.call("probe", **probe)[0])
            # Many reps in a row, each with its start time, core and core clock,
            # to line up with a GPU clock log (nvidia-smi) taken beside the run.
            record("long_run", child.call("probe", **{**probe, "reps": 40})[0])
            # Host-bound forwards: fewer intra-op threads, then pinned cores.
            record("threads4", child.call("probe", **probe, threads=4)[0])
            after_off("threads4_after_off")
            two = sorted(os.sched_getaffinity(0))[-2:]
            record("cores2", child.call("probe", **probe, cores=two)[0])
            after_off("cores2_after_off")
            record("cores2_again", child.call("probe", **probe)[0])
            record("gc_frozen", child.call("probe", **probe, freeze_gc=True)[0])
            after_off("gc_frozen_after_off")
            record("in_process_last", local.op_probe(**probe))
        finally:
            decode.close()
        record("decode_closed", child.call("probe", **probe)[0])
    finally:
        child.close()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out, "worker_forward.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
