"""The prefill worker process: the target that fetches a donor's retained blocks.

Three ways to produce a turn's first token, each one request (the harness
times it from send to reply):

- ``off``: full prefill of the prompt (reuse disabled; every prefix recomputed).
- ``on``: ``kv_reuse.Target.fetch`` of the hinted blocks into this worker's
  KV rows (``transport.Landing``: a CUDA tensor of its own over CUDA IPC on
  the ``cuda`` transport, its host rows copied to the device on ``host``),
  re-laid out into a ``DynamicCache`` on the device, then the suffix
  prefill. A fetch that falls back (``FetchFellBack``) or is not advised
  recomputes the whole prompt, inside the timed request.
- ``ideal``: the same suffix prefill on the fetched KV already resident on the
  device (kept from the preceding ``on``), re-layout included.

``transport.Landing.land`` is the only code that turns a ``FetchOutcome`` into
device rows.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from . import engine, rpc, transport
from .decode_worker import EngineWorker, _bits, _device_bytes


class PrefillWorker(EngineWorker):
    """Requests: ``hello``, ``off``, ``on``, ``ideal``, ``greedy``, ``stats``."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        super().__init__(cfg)
        kv_reuse = self.kv
        self.landing = transport.Landing(kv_reuse, self.layout, cfg["target_rows"], self.device, self.transport)
        self.target = self.landing.target
        self.resident: Optional[torch.Tensor] = None
        self.last: Optional[engine.PrefillResult] = None  # for ``greedy``, untimed
        self.leaks_at_start = kv_reuse.leak_counters()

    def op_hello(self) -> Dict[str, Any]:
        return {
            "engine_id": self.target.engine_id,
            "weights_checksum": engine.weights_checksum(self.model),
            "device_bytes": _device_bytes(self.device),
            "build_s": self.build_s,
        }

    def _first(self, r: engine.PrefillResult) -> Dict[str, Any]:
        self.last = r
        return {"first_token": r.first_token, "logits": _bits(r.logits)}

    def op_greedy(self, n: int) -> Dict[str, Any]:
        """``n`` greedy tokens continuing the last ``off`` / ``on`` (a separate, untimed request)."""
        if self.last is None:
            raise engine.EngineError("last", "no off/on prefill to continue")
        toks = engine.greedy(self.model, self.last, n)[0]
        self.last = None
        return {"greedy": toks}

    def op_off(self, prompt: List[int]) -> Dict[str, Any]:
        sw = engine.Stopwatch(self.device)
        r = engine.prefill(self.model, prompt)
        ms = sw.ms()
        return {"worker_ms": ms, **self._first(r)}

    def op_on(self, prompt: List[int], hint: Optional[bytes], hashes: List[int], manifest: Optional[bytes]) -> Dict[str, Any]:
        sw = engine.Stopwatch(self.device)
        self.resident = None
        fetch: Dict[str, Any] = {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}
        fell_back: Optional[List[str]] = None
        rows = None
        if hint is not None:
            try:
                with self.target.fetch(hint, hashes, manifest) as out:
                    if out.fetch_from != 0:  # this worker holds nothing to start from (churn)
                        raise ValueError(f"fetch_from {out.fetch_from}")
                    rows = self.landing.land(out)
                    fetch = {
                        "fetched_tokens": len(out.fetched) * self.tpb,
                        "bytes": out.bytes,
                        "host_payload_bytes": out.host_payload_bytes,
                        "transport": out.transport,
                    }
            except self.kv.FetchFellBack as e:
                fell_back = [str(a) for a in e.args]
            except (self.kv.KvReuseError, ValueError) as e:
                fell_back = [repr(e), "refused", type(e).__name__]
        fetch_ms = sw.ms()
        f = fetch["fetched_tokens"]
        if rows is not None and f >= len(prompt):
            # At least one token must be computed for a first token: drop the last block.
            f -= self.tpb
            rows = rows[:-1]
            fetch["fetched_tokens"] = f
        if rows is not None and f > 0:
            cache = engine.cache_from_kv(engine.from_blocks(rows, self.shape, self.tpb))
            r = engine.prefill(self.model, prompt[f:], cache)
        else:
            f = fetch["fetched_tokens"] = 0
            r = engine.prefill(self.model, prompt)
        ms = sw.ms()
        self.resident = rows if f > 0 else None
        res = {"worker_ms": ms, "fetch_ms": fetch_ms, "fell_back": fell_back, **fetch, **self._first(r)}
        res["checksums"] = engine.block_checksums(rows) if f > 0 else []
        return res

    def op_ideal(self, prompt: List[int]) -> Dict[str, Any]:
        """Suffix prefill on the KV the preceding ``on`` left resident; refuses without it."""
        if self.resident is None:
            raise engine.EngineError("resident", "no fetched KV resident (the preceding on fell back)")
        f = self.resident.shape[0] * self.tpb
        sw = engine.Stopwatch(self.device)
        cache = engine.cache_from_kv(engine.from_blocks(self.resident, self.shape, self.tpb))
        r = engine.prefill(self.model, prompt[f:], cache)
        ms = sw.ms()
        self.resident = None
        return {"worker_ms": ms, "first_token": r.first_token, "logits": _bits(r.logits)}

    def op_stats(self) -> Dict[str, Any]:
        now = self.kv.leak_counters()
        grown = {k: now[k] - self.leaks_at_start.get(k, 0) for k in now if now[k] > self.leaks_at_start.get(k, 0)}
        return {
            "free_rows": self.target.free_rows,
            "leaks_grown": grown,
            "device_bytes": _device_bytes(self.device),
        }


def main(conn: Any, cfg: Dict[str, Any]) -> None:
    """Process entry point (``rpc.Worker``)."""
    try:
        w = PrefillWorker(cfg)
    except Exception as e:
        conn.send({"ok": False, "error": f"prefill worker start: {e!r}"})
        return
    conn.send({"ok": True})
    rpc.serve(conn, w)
