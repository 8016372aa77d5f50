"""Why is a worker request slower right after a router-service advise? (issue 21, first turns)

gpu_serving's first turns (no donor: ON = advise + the same request as OFF) showed the pipe
request after the advise ("rpc": client time minus the worker's own) 0.1-0.7 ms slower than
OFF's in every service-router record, none in the in-process-router ones. This probe rebuilds
that sequence without torch or a GPU: a worker process on gpu_serving's own pipe protocol
(``rpc.Worker``) whose ``echo`` request unpickles a prompt and answers with a logits-sized
payload, the router binary and nats-server as processes, a donor publishing on NATS, and the
prefill target announced from the worker process as gpu_serving's prefill worker does.

Per round (interleaved, ``--gap-ms`` of idle between rounds, as a forward leaves the harness
idle): ``quiesce`` then, after one of
- ``off``: nothing;
- ``advise``: ``RouterClient.advise`` of the prompt's hashes for the announced target (no donor
  holds them: the first-turn case);
- ``sleep``: ``time.sleep`` for the advise's median (is it the idle gap, or the advise?);
the ``echo`` request. Prints per variant the p50 / p90 of the request's client ms and its
``rpc`` (client ms minus the worker's). Run from the repository root:

    PYTHONPATH=crates/kv-testkit/python <python with kv_reuse> xtask/gpu/advise_rpc_probe.py \
        --router-bin <kv-reuse-router> --nats-server <nats-server> [--busy-poll-us N] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

TPB = 16


def pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class EchoWorker:
    """A worker whose ``echo`` costs what gpu_serving's request costs outside the forward."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        import kv_reuse

        self.kv = kv_reuse
        self.publishers = []
        self.directory = None
        if cfg.get("nats_url"):
            layout = kv_reuse.Layout(2, 2, 8, "f32", TPB, 1)
            self.target = kv_reuse.Target(layout, rows=16)
            self.publishers.append(kv_reuse.WorkerPublisher.target(
                cfg["nats_url"], "probe-prefill", layout, self.target.engine_id, announce_period_s=1.0))
            self.directory = kv_reuse.DonorDirectory(cfg["nats_url"])
        self.logits = bytes(cfg.get("logits_bytes", 256 * 1024))
        self.busy_ms = cfg.get("busy_ms", 0.0)

    def op_hello(self) -> Dict[str, Any]:
        return {"engine_id": self.target.engine_id if self.publishers else None}

    def op_quiesce(self) -> Dict[str, Any]:
        gc.collect()
        return {}

    def op_echo(self, prompt: List[int], **_: Any) -> Dict[str, Any]:
        t0 = time.perf_counter()
        # A stand-in forward: host work the size of a short one (the real one is
        # host-bound at these sizes), so the worker is not idle when the reply goes.
        end = t0 + self.busy_ms / 1e3
        x = 0
        while time.perf_counter() < end:
            x += 1
        ms = (time.perf_counter() - t0) * 1e3
        return {"worker_ms": ms, "logits": self.logits, "tokens": len(prompt)}


def worker_main(conn: Any, cfg: Dict[str, Any]) -> None:
    from gpu_serving import rpc

    try:
        w = EchoWorker(cfg)
    except Exception as e:  # reported as the start error
        conn.send({"ok": False, "error": repr(e)})
        return
    conn.send({"ok": True})
    rpc.serve(conn, w)


class Nats:
    """nats-server with JetStream (the router's donor directory) on a free loopback port."""

    def __init__(self, binary: str, store: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"nats://127.0.0.1:{port}"
        self.proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("nats-server did not listen within 10 s")
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router-bin", required=True)
    p.add_argument("--nats-server", required=True)
    p.add_argument("--busy-poll-us", type=int, default=0, help="router's and client's busy-poll window, µs")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--gap-ms", type=float, default=30.0, help="idle between rounds (a forward's wait)")
    p.add_argument("--busy-ms", type=float, default=2.0, help="the echo's stand-in host work, ms")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 8192, 32768])
    p.add_argument("--json")
    a = p.parse_args()

    import kv_reuse
    from gpu_serving import rpc

    store = tempfile.mkdtemp(prefix="advise-rpc-probe-")
    server = Nats(a.nats_server, store)
    router = subprocess.Popen(
        [a.router_bin, "--nats-url", server.url, "--metrics-addr", "127.0.0.1:0", "--tokens-per-block", str(TPB),
         "--announce-period-ms", "1000", "--enable-decode-to-prefill-reuse",
         "--advise-busy-poll-us", str(a.busy_poll_us)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    print(router.stdout.readline().strip(), flush=True)
    worker = rpc.Worker(worker_main, {"nats_url": server.url, "busy_ms": a.busy_ms})
    out: Dict[str, Any] = {"busy_poll_us": a.busy_poll_us, "gap_ms": a.gap_ms, "busy_ms": a.busy_ms,
                           "rounds": a.rounds, "cpus": os.cpu_count(), "sizes": {}}
    try:
        worker.wait_started()
        engine_id = worker.call("hello")[0]["engine_id"]
        client = kv_reuse.RouterClient(server.url, timeout_s=5.0, busy_poll_us=a.busy_poll_us)
        # Until the router knows the target (its announcement processed).
        deadline = time.monotonic() + 30
        while True:
            try:
                client.advise("wait", kv_reuse.sequence_hashes([1] * TPB, TPB), engine_id)
                break
            except kv_reuse.AdviseRefused:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for n in a.prompt_tokens:
            prompt = list(range(1000, 1000 + n))
            hashes = kv_reuse.sequence_hashes(prompt, TPB)
            res: Dict[str, Dict[str, List[float]]] = {v: {"ms": [], "rpc": [], "pre": []}
                                                    for v in ("off", "advise", "sleep")}
            sleep_s = 0.0006
            for i in range(a.rounds):
                order = ["off", "advise", "sleep"]
                order = order[i % 3:] + order[:i % 3]
                for v in order:
                    time.sleep(a.gap_ms / 1e3)
                    worker.call("quiesce")
                    gc.collect()
                    gc.disable()
                    try:
                        t0 = time.perf_counter()
                        if v == "advise":
                            client.advise(f"r{n}-{i}", hashes, engine_id)
                        elif v == "sleep":
                            time.sleep(sleep_s)
                        pre = (time.perf_counter() - t0) * 1e3
                        reply, call_ms = worker.call("echo", prompt=prompt, hint=None, hashes=None, manifest=None)
                    finally:
                        gc.enable()
                    res[v]["ms"].append(call_ms)
                    res[v]["rpc"].append(call_ms - reply["worker_ms"])
                    res[v]["pre"].append(pre)
                if i == 10:
                    sleep_s = statistics.median(res["advise"]["pre"]) / 1e3
            row = {}
            for v, r in res.items():
                row[v] = {"pre_p50_ms": round(statistics.median(r["pre"]), 3),
                          "rpc_p50_ms": round(statistics.median(r["rpc"]), 3),
                          "rpc_p90_ms": round(pct(r["rpc"], 0.9), 3),
                          "call_p50_ms": round(statistics.median(r["ms"]), 3)}
            # Paired per round: what the advise (or the sleep) added to the request after it.
            row["advise_minus_off_rpc_p50_ms"] = round(statistics.median(
                [x - y for x, y in zip(res["advise"]["rpc"], res["off"]["rpc"])]), 3)
            row["sleep_minus_off_rpc_p50_ms"] = round(statistics.median(
                [x - y for x, y in zip(res["sleep"]["rpc"], res["off"]["rpc"])]), 3)
            out["sizes"][str(n)] = row
            print(f"prompt {n:6d} tokens: " + "; ".join(
                f"{v} pre {row[v]['pre_p50_ms']:.3f} rpc p50 {row[v]['rpc_p50_ms']:.3f} p90 {row[v]['rpc_p90_ms']:.3f}"
                for v in ("off", "advise", "sleep"))
                + f"; paired rpc advise-off {row['advise_minus_off_rpc_p50_ms']:+.3f} sleep-off "
                  f"{row['sleep_minus_off_rpc_p50_ms']:+.3f} ms", flush=True)
        client.close()
    finally:
        worker.close()
        router.terminate()
        router.wait(10)
        server.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
