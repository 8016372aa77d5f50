"""The pipe protocol between the harness and its worker processes.

Each worker is its own process (``multiprocessing`` spawn context, so CUDA is
initialised only in the child). A request is ``{"op": name, **arguments}``; the
reply is ``{"ok": True, **result}`` or ``{"ok": False, "error": repr}``. The
harness times a request from send to reply (client-observed latency).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Callable, Dict, Tuple


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# Expandable segments grow one mapping instead of cudaMalloc-ing new segments
# while a worker's memory climbs to tens of GB (a 32K prefill); the H200 runs
# showed 40+ ms between identical requests, blamed on segment allocation.
ALLOC_DEFAULT = "expandable_segments:True"


def child_env(env: Dict[str, str]) -> Dict[str, str]:
    """The variables a worker process gets on top of ``env``: ``ALLOC_CONF`` unless the caller set it."""
    return {} if env.get(ALLOC_CONF) else {ALLOC_CONF: ALLOC_DEFAULT}


# A request carrying this key set gets no reply (``Worker.send``, ``serve``).
ONE_WAY_KEY = "_one_way"


class WorkerError(RuntimeError):
    """A worker answered a request with an error; ``op`` names the request."""

    def __init__(self, op: str, error: str) -> None:
        super().__init__(f"{op}: {error}")
        self.op = op


def freeze_startup_objects() -> None:
    """Moves every object alive now (the model, imported modules) to the collector's permanent generation.

    Each timed request is preceded by a ``gc.collect()`` (``op_quiesce``,
    ``timing.timed``); with torch and transformers loaded that walked millions
    of startup objects every time (the H200 s10 run spent 98 s of its 333 in
    ``quiesce``). Frozen objects are never freed, which is what startup
    objects are anyway; garbage made later is still collected.
    """
    gc.collect()
    gc.freeze()


def serve(conn, handler: Any) -> None:
    """Answers requests on ``conn`` with ``handler.op_<name>(**args)`` until ``op == "exit"``.

    Freezes the startup objects first (``freeze_startup_objects``). A
    request marked one-way (``Worker.send``) gets no reply: it must name an
    op in ``handler.ONE_WAY_OPS``, else it is not run. A one-way request that
    raises or is refused leaves its error to be answered to the next request
    instead of running it (``exit`` included), so no error is lost and every
    reply pairs with its request; the sender's flag, not the handler, decides
    whether a reply is sent.

    After a request's reply has gone out, ``handler.after_reply(op)`` runs
    when the handler has one: untimed bookkeeping (the client already holds
    its reply and has stopped its clock), done before the next request is
    read. An error there is owed to the next request like a one-way one's.
    """
    freeze_startup_objects()
    one_way_ops = frozenset(getattr(handler, "ONE_WAY_OPS", ()))
    after_reply = getattr(handler, "after_reply", None)
    pending: Any = None  # the error of a one-way request, owed to the next request
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        op = req.pop("op")
        one_way = bool(req.pop(ONE_WAY_KEY, False))
        if op == "exit":
            conn.send({"ok": True} if pending is None else {"ok": False, "error": pending})
            return
        if pending is not None and not one_way:
            conn.send({"ok": False, "error": pending})
            pending = None
            continue
        try:
            if one_way and op not in one_way_ops:
                raise ValueError(f"{op!r} sent one-way, but the worker's one-way ops are {sorted(one_way_ops)}")
            res = getattr(handler, "op_" + op)(**req)
            if not one_way:
                conn.send({"ok": True, **res})
                if after_reply is not None:
                    try:
                        after_reply(op)
                    except Exception as e:
                        pending = f"after_reply({op}) (after its reply, before this request): {e!r}\n{traceback.format_exc()}"
        except Exception as e:  # reported to the harness, which records it
            err = f"{e!r}\n{traceback.format_exc()}"
            if one_way:
                pending = pending or f"{op} (one-way, before this request): {err}"
            else:
                conn.send({"ok": False, "error": err})
        finally:
            # A timed request turns the collector off (engine.Stopwatch); one
            # that raised mid-way must not leave it off for the rest of the run.
            gc.enable()


class Worker:
    """A worker process started with ``main(conn, cfg)``; ``call`` sends one request."""

    def __init__(self, main: Callable, cfg: Dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, cfg), daemon=True)
        # The child imports torch while unpickling ``main``, before any of its
        # own code runs: the allocator setting must already be in the
        # environment it inherits. Only the child's copy is changed.
        saved = os.environ.get(ALLOC_CONF)
        os.environ.update(child_env(os.environ))
        try:
            self.proc.start()
        finally:
            if saved is None:
                os.environ.pop(ALLOC_CONF, None)
            else:
                os.environ[ALLOC_CONF] = saved
        child.close()
        # Milliseconds spent per request name (send to reply): the run's
        # per-phase time budget (``harness`` prints and records it).
        self.totals_ms: Dict[str, float] = {}

    def wait_started(self) -> None:
        """Waits for the worker's start message; raises ``WorkerError("start", ...)``."""
        try:
            res = self.conn.recv()
        except EOFError:
            raise WorkerError("start", f"worker exited with code {self.proc.exitcode}") from None
        if not res.get("ok"):
            raise WorkerError("start", res.get("error", "?"))

    def send(self, op: str, **args: Any) -> float:
        """Sends a one-way request (the worker's ``ONE_WAY_OPS``: no reply); milliseconds the send took.

        An error it raises in the worker is the reply to the next ``call``.
        """
        t0 = time.perf_counter()
        self.conn.send({"op": op, ONE_WAY_KEY: True, **args})
        ms = (time.perf_counter() - t0) * 1e3
        self.totals_ms[op] = self.totals_ms.get(op, 0.0) + ms
        return ms

    def call(self, op: str, **args: Any) -> Tuple[Dict[str, Any], float]:
        """(reply, milliseconds from send to reply); raises ``WorkerError`` on an error reply."""
        t0 = time.perf_counter()
        self.conn.send({"op": op, **args})
        res = self.conn.recv()
        ms = (time.perf_counter() - t0) * 1e3
        self.totals_ms[op] = self.totals_ms.get(op, 0.0) + ms
        if not res.pop("ok"):
            raise WorkerError(op, res["error"])
        return res, ms

    def close(self, timeout: float = 30.0) -> None:
        """Asks the worker to exit; kills it if it does not within ``timeout`` seconds."""
        try:
            self.conn.send({"op": "exit"})
            self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
