"""How the harness times a request: quiesced, garbage collector off, repeated, minimum kept.

The H200 runs showed identical requests 40+ ms apart. What this module
removes from a timed sample, on both sides of the pipe: a garbage
collection (``gc.collect()`` before, ``gc.disable()`` during; inside the worker
``quiesce`` collects and ``engine.Stopwatch`` keeps the collector off), device work queued by an earlier
request (the worker's untimed ``quiesce`` drains it first), and one-off
outliers (each measurement runs ``--repeats`` times; the turn row reports the
minimum and keeps every sample).

A sample's ``phases_ms`` is where its client-observed time went: the
worker's laps (``fetch``, ``relayout``, ``forward``, ``readback``; which
appear depends on the request), ``stage`` (sending an ON request's prompt
ahead of its advise, when staged), ``advise`` (the router, in the harness) and
``rpc`` (client time minus the worker's own: pickling, the pipe, the reply's
logits copy, and with a staged prompt whatever of the worker's staging
outlasted the advise). ``stage_worker`` (staged ON only) is the worker's own
time on the staged prompt (unpickled before it, so not counting that): it ran
beside the advise and is not added into the total.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .workload import percentile


def timed(worker: Any, op: str, args: Any, before: Optional[Callable[[], Any]] = None,
          stage: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Any, Dict[str, Any]]:
    """One timed request ``op``: (reply, ``before()``'s result or None, sample).

    ``args``: the request's arguments, a dict, or with ``before`` a callable
    of ``before()``'s result giving the dict. ``before`` runs inside the
    timed region ahead of the request (ON's router advice, whose ``hint``
    the request needs) and is reported as the ``advise`` phase. ``stage``:
    arguments of a one-way ``stage`` request sent first, inside the timed
    region (ON's prompt, which the worker unpickles and uploads while
    ``before`` waits for the router), reported as the ``stage`` phase (the
    send alone). The sample is ``{"ms": client ms incl. stage and before,
    "worker_ms", "phases_ms"}``. Raises what ``worker.call`` raises
    (``rpc.WorkerError``; a failed stage is the reply to ``op``).
    """
    worker.call("quiesce")
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        stage_ms = worker.send("stage", **stage) if stage is not None else None
        t_pre = time.perf_counter()
        pre = before() if before is not None else None
        pre_ms = (time.perf_counter() - t_pre) * 1e3 if before is not None else 0.0
        reply, call_ms = worker.call(op, **(args(pre) if callable(args) else args))
    finally:
        if was:
            gc.enable()
    phases = dict(reply.get("phases_ms") or {})
    if stage_ms is not None:
        phases["stage"] = stage_ms
        if reply.get("stage_worker_ms") is not None:
            # Not additive: the worker's own time on the staged prompt ran
            # beside the advise; what outlasted the advise is part of ``rpc``.
            phases["stage_worker"] = reply["stage_worker_ms"]
    if before is not None:
        phases["advise"] = pre_ms
    worker_ms = reply.get("worker_ms", call_ms)
    phases["rpc"] = max(call_ms - worker_ms, 0.0)
    sample = {"ms": (stage_ms or 0.0) + pre_ms + call_ms, "worker_ms": worker_ms, "phases_ms": {k: round(v, 3) for k, v in phases.items()}}
    return reply, pre, sample


def best(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The sample with the smallest ``ms`` (the first of equal ones); raises ``ValueError`` when empty."""
    if not samples:
        raise ValueError("samples: none")
    return min(samples, key=lambda s: s["ms"])


def phase_medians(rows: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    """Per phase, the median over ``rows`` of ``row[key]`` (a phase -> ms dict); rows without it are skipped."""
    names: List[str] = []
    for r in rows:
        for n in r.get(key) or {}:
            if n not in names:
                names.append(n)
    return {n: percentile([r[key][n] for r in rows if n in (r.get(key) or {})], 50) for n in names}
