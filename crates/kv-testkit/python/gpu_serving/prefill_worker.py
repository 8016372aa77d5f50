"""The prefill worker process: the target that fetches a donor's retained blocks.

Three ways to produce a turn's first token, each one request (the harness
times it from send to reply):

- ``off``: full prefill of the prompt (reuse disabled; every prefix recomputed).
- ``on``: ``kv_reuse.Target.fetch`` of the hinted blocks, then the suffix
  prefill. Where they land (``landing``): ``cache`` (default on the ``cuda``
  transport) straight into the engine's preallocated KV cache, at their
  token positions (``transport.CacheLanding``, the wheel's ``kv_layout="hf"``:
  the copy converts the layout, nothing is re-laid afterwards); ``rows``
  (the ``host`` transport, or asked for) into block-major rows of the
  worker's own (``transport.Landing``), then re-laid into a cache
  (``relayout`` phase). A fetch that falls back (``FetchFellBack``) or is not
  advised recomputes the whole prompt, inside the timed request.
  With ``fetch_overlap`` (cache landing on the ``cuda`` transport), the
  fetch runs on this worker's fetch thread with a ``kv_reuse.StreamGate``:
  once its copies are issued the torch stream waits for them and the suffix
  forward is enqueued behind them, while the fetch completes (copy end,
  donor probe, pin release, commit). The forward's first token is used only
  when the fetch then succeeded; a fetch that fails after the forward was
  enqueued is recomputed in full like any fallback. With ``layer_groups``
  (``--fetch-overlap layers``) the gate releases the fetch layer group by
  layer group: a pre-hook on each group's first decoder layer makes the
  stream wait for that group only (``gate.wait_layer``), so the first
  layers compute while later layers are still being copied.
- ``ideal``: the same suffix prefill on the fetched KV already resident on the
  device (kept from the preceding ``on``): in the landing cache as it is
  (``cache``), or re-laid from the kept rows (``rows``).

``transport.Landing.land`` / ``CacheLanding.land`` are the only code that turns
a ``FetchOutcome`` into KV the engine reads.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import engine, rpc, service, transport
from .decode_worker import EngineWorker, _bits, _device_bytes

LANDINGS = ("cache", "rows")

# Tokens a landing cache holds past its target's rows: the 16-token greedy
# continuation of an ``on`` writes past the prompt in the same (pinned) arena.
GREEDY_HEADROOM = 1024


class PrefillWorker(EngineWorker):
    """Requests: ``hello``, ``off``, ``on``, ``ideal``, ``greedy``, ``stats``; one-way: ``stage``."""

    # Requests answered by no reply (rpc.serve): the harness sends an ON
    # request's prompt ahead of its advise.
    ONE_WAY_OPS = ("stage",)

    def __init__(self, cfg: Dict[str, Any]) -> None:
        super().__init__(cfg)
        self.landing_kind = cfg.get("landing") or ("cache" if self.transport == "cuda" else "rows")
        if self.landing_kind not in LANDINGS:
            raise engine.EngineError("landing", f"unknown {self.landing_kind!r}, expected one of {list(LANDINGS)}")
        self.landing = self._landing(cfg["target_rows"])
        self.target = self.landing.target
        self.overlap = bool(cfg.get("fetch_overlap")) and self.landing_kind == "cache"
        # Layer groups of an overlapped fetch (None: the stream waits for the whole fetch).
        self.layer_groups = cfg.get("layer_groups") if self.overlap else None
        self.gpu = transport.ordinal(self.device, self.transport)
        # The warm regime's target: another engine to the router (its held
        # blocks come from prefix_events), its own destination.
        self.warm_landing = self._landing(cfg["target_rows"]) if cfg.get("warm") else None
        self.warm: Dict[str, Any] = {}
        self.warm_next: Dict[str, Any] = {}
        # What the last ``on`` left for ``ideal``: its rows (``rows``), or the
        # tokens it landed in the landing cache (``cache``).
        self.resident: Optional[Any] = None
        # The last on / warm_on's used blocks, for fetched_checksums: rows, or
        # (cache, first block, blocks).
        self.fetched: Optional[Any] = None
        self.last: Optional[engine.PrefillResult] = None  # for ``greedy``, untimed
        # The prompt of the next on / warm_on, sent ahead (``stage``): (tokens, ids on the device,
        # host ms the stage took).
        self.staged: Optional[Tuple[List[int], Any, float]] = None
        # torch-allocated device bytes at the last ``quiesce`` (the state right
        # before a timed request), and the last ``on``'s before/after pair
        # (``after_reply``), handed out by ``fetched_checksums``.
        self.quiesced_device_bytes: Optional[int] = None
        self.on_device_bytes: Optional[Dict[str, Optional[int]]] = None
        # ``nats_url`` (the harness's --router service): each target is
        # announced to the router service, and a donor's manifest is resolved
        # from the donor directory (JetStream bucket) by its engine id.
        self.publishers: List[Any] = []
        self.directory = None
        if cfg.get("nats_url"):
            gpu = transport.ordinal(self.device, self.transport)
            key = cfg.get("worker_key", "gpu-serving-prefill")
            for suffix, landing in (("", self.landing), ("-warm", self.warm_landing)):
                if landing is not None:
                    self.publishers.append(self.kv.WorkerPublisher.target(
                        cfg["nats_url"], key + suffix, self.layout, landing.target.engine_id,
                        gpus=None if gpu is None else [gpu], announce_period_s=service.ANNOUNCE_PERIOD_S))
            self.directory = self.kv.DonorDirectory(cfg["nats_url"])
        self.leaks_at_start = self.kv.leak_counters()
        self.fds_rebased = False
        self.fds_at_first_fetch: Optional[int] = None

    def _landing(self, rows: int):
        """A target of ``rows`` blocks landing as ``self.landing_kind`` says."""
        if self.landing_kind == "rows":
            return transport.Landing(self.kv, self.layout, rows, self.device, self.transport)
        cache = engine.PreallocCache.for_shape(self.shape, rows * self.tpb + GREEDY_HEADROOM, self.device)
        return transport.CacheLanding(self.kv, self.layout, cache, rows, self.device, self.transport)

    def op_adopt_weights(self, weights: bytes) -> Dict[str, Any]:
        """Runs on the decode worker's parameters from now on (``engine.adopt_weights``); frees its own.

        Same seed, same bits: the weights were already equal, this only
        stops the card holding them twice (the harness's --share-weights).
        """
        freed = engine.adopt_weights(self.model, weights)
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        # The mapped parameters hold file descriptors for the rest of the
        # run (one per shared storage on the CPU, the driver's on a GPU):
        # deliberate, like the driver's own at the first fetch, so they are
        # part of the baseline the leak check compares against.
        fds = self.kv.leak_counters().get("open_fds")
        if fds is not None:
            self.leaks_at_start["open_fds"] = fds
        return {"freed_bytes": freed, "device_bytes": _device_bytes(self.device)}

    def op_hello(self) -> Dict[str, Any]:
        return {
            "engine_id": self.target.engine_id,
            "warm_engine_id": self.warm_landing.target.engine_id if self.warm_landing else None,
            "weights_checksum": engine.weights_checksum(self.model),
            "device_bytes": _device_bytes(self.device),
            "build_s": self.build_s,
            "landing": self.landing_kind,
            "fetch_overlap": self.overlap,
            "layer_groups": self.layer_groups,
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

    def op_warmup(self, tokens: int) -> Dict[str, Any]:
        """An untimed prefill of ``tokens`` tokens and a 16-token suffix on its KV, then a sync.

        Why: the first request after the decode worker used the same GPU, and
        the first request of a size, paid 70-150 ms (1.3 s for the first 32K
        prefill) on the H200 in whichever of OFF / ON ran first; the harness
        pays that here, outside the timed requests. ``tokens`` below 2 is refused.
        """
        if tokens < 2:
            raise engine.EngineError("tokens", f"warmup needs at least 2 tokens, got {tokens}")
        ids = [i % self.shape.vocab for i in range(tokens)]
        sw = engine.Stopwatch(self.device)
        r = engine.prefill(self.model, ids[:-1])
        engine.prefill(self.model, ids[-1:] * 16, r.cache)
        return {"worker_ms": sw.stop()}

    def op_stage(self, prompt: List[int]) -> Dict[str, Any]:
        """One-way: keeps ``prompt`` for the next ``on`` / ``warm_on`` and starts uploading its ids.

        Why: the harness sends an ON request's prompt before it asks the
        router for advice, so this process receives it, unpickles it and
        turns it into a device tensor (~2 ms for a 32K-token list on the H200
        host, inside the forward otherwise) while the advise is in flight;
        the request itself then carries the hint alone. The upload goes from
        pinned memory without blocking; the request's stopwatch synchronises
        the device before its clock starts. A later ``stage`` replaces an
        unused one. Raises ``EngineError("prompt", ...)`` when empty.
        """
        self.staged = None  # a failed stage must not leave an earlier prompt for the next request
        t0 = time.perf_counter()
        if not prompt:
            raise engine.EngineError("prompt", "a staged prompt needs at least one token")
        host = torch.tensor([prompt], dtype=torch.long)
        if self.device != "cpu":
            host = host.pin_memory()
        ids = host.to(self.device, non_blocking=True)
        self.staged = (prompt, ids, (time.perf_counter() - t0) * 1e3)
        return {}

    def _prompt_ids(self, prompt: Optional[List[int]]) -> Tuple[List[int], Optional[Any], Optional[float]]:
        """(tokens, their device ids, the stage's host ms): ``prompt`` as sent (ids and ms None), or
        the staged one when None. Either way nothing stays staged.

        Raises ``EngineError("prompt", ...)`` when neither is there.
        """
        got, self.staged = self.staged, None
        if prompt is not None:
            return prompt, None, None
        if got is None:
            raise engine.EngineError("prompt", "no prompt given and none staged")
        return got

    def op_off(self, prompt: List[int]) -> Dict[str, Any]:
        sw = engine.Stopwatch(self.device)
        r = engine.prefill(self.model, prompt, sw=sw)
        ms = sw.stop()
        return {"worker_ms": ms, "phases_ms": sw.phases, **self._first(r)}

    def _fetch(self, landing: transport.Landing, hint: bytes, hashes: List[int], manifest: Union[bytes, str, None],
               held_blocks: int, kill_donor: Optional[int] = None, gate: Any = None):
        """Fetches the hinted blocks into ``landing``: (landed or None, fetch fields, fell_back, fetch_from).

        ``landed``: the fetched rows (``transport.Landing``) or the number of
        blocks now in the landing cache (``transport.CacheLanding``).

        ``manifest``: the donor's manifest (wire bytes), or its engine id
        (str) to resolve from the donor directory (service mode); a donor
        without a record falls back (``no_record``).

        ``held_blocks``: the blocks this worker holds of the prompt (0 in
        churn); a hint starting past them is refused. ``kill_donor``: a donor
        pid SIGKILLed once its pins are granted, before the first byte (the
        wheel's ``donor_alive`` probe): the donor-killed-mid-fetch turn.
        ``gate``: a ``kv_reuse.StreamGate`` for the wheel's fetch (overlap).
        """
        return self._fetch_finish(landing, held_blocks,
                                  self._fetch_begin(landing, hint, hashes, manifest, kill_donor, gate, False))

    @staticmethod
    def _no_fetch() -> Dict[str, Any]:
        return {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}

    def _fetch_begin(self, landing: transport.Landing, hint: bytes, hashes: List[int],
                     manifest: Union[bytes, str, None], kill_donor: Optional[int], gate: Any, run_async: bool):
        """Starts ``_fetch``'s fetch: a callable giving its ``FetchOutcome`` (raising what the fetch raises), or
        ``_fetch``'s result tuple when it cannot start.

        ``run_async``: on the target's own fetch thread (``Target.fetch_async``,
        which takes no GIL from this process's engine thread), the callable
        being the job's ``result``; else ``Target.fetch`` when called.
        """
        if isinstance(manifest, str):
            # A donor engine id: its manifest from the donor directory (a
            # local lookup in the watched bucket), inside the timed request.
            got = self.directory.manifest(manifest) if self.directory is not None else None
            if got is None:
                return None, self._no_fetch(), [f"donor {manifest} not in the directory", "resolve", "no_record"], 0
            manifest = got
        kw: Dict[str, Any] = {}
        if kill_donor is not None:
            kw["donor_alive"] = _killer(kill_donor)
        if gate is not None:
            kw["gate"] = gate
        if not run_async:
            return lambda: landing.target.fetch(hint, hashes, manifest, **kw)
        try:
            return landing.target.fetch_async(hint, hashes, manifest, **kw).result
        except (self.kv.KvReuseError, ValueError) as e:
            return None, self._no_fetch(), [repr(e), "refused", type(e).__name__], 0

    def _fetch_finish(self, landing: transport.Landing, held_blocks: int, started: Any):
        """``_fetch``'s result from ``_fetch_begin``'s ``started``."""
        if isinstance(started, tuple):
            return started
        fetch = self._no_fetch()
        try:
            with started() as out:
                if out.fetch_from > held_blocks:
                    raise ValueError(f"fetch_from {out.fetch_from} past the {held_blocks} blocks held")
                rows = landing.land(out)
                fetch = {
                    "fetched_tokens": len(out.fetched) * self.tpb,
                    "bytes": out.bytes,
                    "host_payload_bytes": out.host_payload_bytes,
                    "transport": out.transport,
                    # Where the fetch's time went (the wheel's own clocks):
                    # donor import, the delivery, and the rest (reserve, pin
                    # round trip, unpin, verify, commit).
                    "fetch_us": {"import": out.import_us, "transfer": out.transfer_us,
                                 "rest": out.total_us - out.import_us - out.transfer_us},
                    # The executor's stages (reserve, plan, pin, transfer, verify_commit).
                    "fetch_stages_us": out.stages_us,
                }
                start = out.fetch_from
            self._steady_fds()  # after the outcome released its rows
            return rows, fetch, None, start
        except self.kv.FetchFellBack as e:
            return None, fetch, [str(a) for a in e.args], 0
        except (self.kv.KvReuseError, ValueError) as e:
            return None, fetch, [repr(e), "refused", type(e).__name__], 0

    def op_on(self, prompt: Optional[List[int]], hint: Optional[bytes], hashes: Optional[List[int]],
              manifest: Union[bytes, str, None], kill_donor: Optional[int] = None) -> Dict[str, Any]:
        """Reuse on, churn: the advised fetch into the landing, then the rest of ``prompt`` (None: the staged one)."""
        prompt, ids, stage_ms = self._prompt_ids(prompt)
        sw = engine.Stopwatch(self.device)
        self.resident = None
        fetch: Dict[str, Any] = {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}
        fell_back: Optional[List[str]] = None
        landed = None
        if hint is not None and self.overlap:
            got = self._on_overlapped(prompt, ids, hint, hashes, manifest, kill_donor, sw)
            if got["result"] is not None:
                return self._on_reply(got["result"], got["ms"], got["fetch_ms"], got["fetch"], got["fell_back"],
                                      sw, stage_ms)
            landed, fetch, fell_back = got["landed"], got["fetch"], got["fell_back"]
        elif hint is not None:
            landed, fetch, fell_back, _ = self._fetch(self.landing, hint, hashes, manifest, 0, kill_donor)
        fetch_ms = sw.lap("fetch")
        f = fetch["fetched_tokens"]
        if landed is not None and f >= len(prompt):
            # At least one token must be computed for a first token: drop the last block.
            f -= self.tpb
            fetch["fetched_tokens"] = f
            if not isinstance(landed, int):
                landed = landed[:-1]
        if landed is not None and f > 0:
            if isinstance(landed, int):
                cache = self.landing.cache
                cache.set_length(f)  # the fetch wrote tokens 0 .. f in place
                self.resident = self.fetched = (cache, 0, f // self.tpb)
            else:
                cache = engine.cache_from_blocks(landed, self.shape, self.tpb)
                sw.lap("relayout")
                self.resident = self.fetched = landed
            r = engine.prefill(self.model, prompt[f:], cache, sw=sw, ids=_tail(ids, f))
        else:
            f = fetch["fetched_tokens"] = 0
            self.fetched = None
            r = engine.prefill(self.model, prompt, sw=sw, ids=ids)
        ms = sw.stop()
        return self._on_reply(r, ms, fetch_ms, fetch, fell_back, sw, stage_ms)

    def _on_reply(self, r: engine.PrefillResult, ms: float, fetch_ms: float, fetch: Dict[str, Any],
                  fell_back: Optional[List[str]], sw: engine.Stopwatch,
                  stage_ms: Optional[float]) -> Dict[str, Any]:
        # Checksums are not part of a TTFT: the harness asks for them in a
        # separate, untimed ``fetched_checksums`` (they cost tens of ms at 8K
        # when they were computed before this reply went out). The device
        # memory after the request is read in ``after_reply`` for the same reason.
        return {"worker_ms": ms, "fetch_ms": fetch_ms, "phases_ms": sw.phases, "fell_back": fell_back,
                "stage_worker_ms": stage_ms, **fetch, **self._first(r)}

    def after_reply(self, op: str) -> None:
        """``rpc.serve``'s hook, after ``op``'s reply went out: an ``on``'s device memory after.

        ``torch.cuda.memory_allocated`` builds and flattens the allocator's
        whole statistics dict in Python; read inside ``on`` (before and after)
        it was paid by ON's client-observed time and by no other request's,
        which made ON's ``rpc`` phase 0.1-0.7 ms longer than OFF's on first
        turns in every router-service record. The reading before is taken
        in the untimed ``quiesce`` that precedes each timed request.
        """
        if op == "on":
            # The reading of the quiesce before this request, taken once: an ``on``
            # without its own quiesce (the donor-kill turn) gets None, never an older one.
            before, self.quiesced_device_bytes = self.quiesced_device_bytes, None
            self.on_device_bytes = {"before": before, "after": _device_bytes(self.device)}

    def _on_overlapped(self, prompt: List[int], ids: Optional[Any], hint: bytes, hashes: List[int],
                       manifest: Union[bytes, str, None], kill_donor: Optional[int],
                       sw: engine.Stopwatch) -> Dict[str, Any]:
        """``on``'s fetch on the fetch thread, the suffix forward enqueued behind its copies (StreamGate).

        Returns ``result`` (the first token's ``PrefillResult``, with ``ms``,
        ``fetch_ms``, ``fetch``, ``fell_back``) when this path produced it:
        the fetch succeeded under the forward, or failed after the forward
        was enqueued (then the forward's output is dropped and the whole
        prompt recomputed). Returns ``result`` None with the fetch's
        ``landed`` / ``fetch`` / ``fell_back`` when the gate never opened (the
        fetch failed before any copy, or delivered nothing here): ``op_on``
        goes on as without overlap.
        """
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        gate = self.kv.StreamGate(stream, self.gpu, layer_groups=self.layer_groups) if self.layer_groups else \
            self.kv.StreamGate(stream, self.gpu)
        # On the target's own thread (no Python thread: nothing here waits
        # for it to take the GIL, and it takes none from the forward below).
        started = self._fetch_begin(self.landing, hint, hashes, manifest, kill_donor, gate, True)
        opened = gate.wait()
        t_open = time.perf_counter()
        if not opened or gate.fetch_from != 0:
            # No copy was issued here (or the hint starts past what a churn
            # target holds: refused by _fetch): the sequential path.
            landed, fetch, fell_back, _ = self._fetch_finish(self.landing, 0, started)
            return {"result": None, "landed": landed, "fetch": fetch, "fell_back": fell_back}
        end = gate.blocks * self.tpb
        if end >= len(prompt):
            end -= self.tpb  # at least one token computed for a first token
        # The suffix's ids: a view of the staged prompt's (uploaded before
        # the gate), or from pinned memory, asynchronously: the upload
        # queues behind the stream's wait for the copies instead of blocking
        # this thread (a pageable upload may), and only the suffix is built
        # (a 32K-token list to a tensor costs ~2 ms on the host).
        suffix_ids = _tail(ids, end) if ids is not None else \
            torch.tensor([prompt[end:]], dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
        # Host clock only: a device sync here would wait for the copies.
        fetch_ms = sw.mark("fetch_launch")
        cache = self.landing.cache
        cache.set_length(end)
        with _layer_waits(self.model, gate, self.layer_groups, self.kv):
            r = engine.prefill(self.model, prompt[end:], cache, sw=sw, ids=suffix_ids)
        t_fwd = time.perf_counter()
        landed, fetch, fell_back, _ = self._fetch_finish(self.landing, 0, started)
        fetch_ms += sw.lap("fetch_join")
        # Where the launch went: the gate's own clock (from its creation: the
        # fetch thread took it, the copies were enqueued, the fetch ended)
        # and this thread's (the gate opened, the forward was done).
        if self.layer_groups:
            fetch["layer_groups_issued"] = len(gate.groups_issued)
        fetch["overlap_us"] = {**{f"gate_{k}": v for k, v in gate.times_us.items()},
                               "opened": round((t_open - t0) * 1e6), "forward_done": round((t_fwd - t0) * 1e6)}
        if landed is None or landed * self.tpb < end:
            # The fetch failed (or delivered less) after the forward was
            # enqueued on its rows: that forward's output is never used.
            if landed is not None and fell_back is None:
                fell_back = [f"landed {landed} blocks, the forward read {end // self.tpb}", "land", "short"]
            self.fetched = None
            fetch["fetched_tokens"] = 0
            r = engine.prefill(self.model, prompt, sw=sw, ids=ids)
        else:
            fetch["fetched_tokens"] = end
            self.resident = self.fetched = (cache, 0, end // self.tpb)
        return {"result": r, "ms": sw.stop(), "fetch_ms": fetch_ms, "fetch": fetch, "fell_back": fell_back}

    def op_fetched_checksums(self) -> Dict[str, Any]:
        """``engine.block_checksums`` of the blocks the last ``on`` / ``warm_on`` used (``[]`` when none), and the
        last ``on``'s device memory (``{"before", "after"}`` torch-allocated bytes, None on the CPU or when no
        ``on`` ran since the last call); untimed."""
        got, self.fetched = self.fetched, None
        device_bytes, self.on_device_bytes = self.on_device_bytes, None
        if isinstance(got, tuple):
            cache, first, n = got
            got = engine.to_blocks(cache, first, n, self.tpb) if n > 0 else None
        return {"checksums": engine.block_checksums(got) if got is not None and got.shape[0] > 0 else [],
                "device_bytes": device_bytes}

    # The warm regime: this worker keeps, per session, the KV it computed for
    # the session's last prompt (its native prefix cache), and a second
    # target whose held blocks the router knows from prefix_events.

    def _warm_base(self, session: str, prompt: List[int]):
        """(a copy of this worker's cached prefix of ``prompt``, tokens it holds); (None, 0) when none.

        The copy is made before the timed part: OFF and ON both start from
        the same cache, and a real prefix cache would not copy at all.
        """
        got = self.warm.get(session)
        if got is None:
            return None, 0
        toks, cache = got
        held = self._held(toks, prompt)
        if held == 0:
            return None, 0
        return engine.cropped(cache, held), held

    @staticmethod
    def _held(toks: List[int], prompt: List[int]) -> int:
        """Tokens of ``prompt`` a cached ``toks`` holds (its common prefix, at most ``len(prompt) - 1``)."""
        held = min(len(toks), len(prompt) - 1)
        while held > 0 and toks[:held] != prompt[:held]:
            held -= 1  # not expected: a session's prompt extends its last one
        return held

    def op_warm_off(self, session: str, prompt: List[int]) -> Dict[str, Any]:
        """Reuse off, warm: prefill what this worker's own prefix cache lacks; the result becomes the cache."""
        base, held = self._warm_base(session, prompt)
        engine.sync(self.device)
        sw = engine.Stopwatch(self.device)
        r = engine.prefill(self.model, prompt[held:], base, sw=sw)
        ms = sw.stop()
        self.warm_next[session] = (list(prompt), r.cache)
        return {"worker_ms": ms, "phases_ms": sw.phases, "held_tokens": held, "first_token": r.first_token,
                "logits": _bits(r.logits)}

    def op_warm_on(self, session: str, prompt: Optional[List[int]], hint: Optional[bytes], hashes: Optional[List[int]],
                   manifest: Union[bytes, str, None]) -> Dict[str, Any]:
        """Reuse on, warm: the advised fetch (only the blocks past what this worker holds), then the rest.

        ``prompt`` None: the staged one."""
        prompt, ids, stage_ms = self._prompt_ids(prompt)
        cache_landing = self.landing_kind == "cache"
        if cache_landing:
            # Untimed, like _warm_base's copy: this worker's own cached prefix
            # goes under the landing cache (a real engine's prefix cache is
            # already there); the fetch then lands after (or over) it.
            got = self.warm.get(session)
            own, held = (got[1], self._held(got[0], prompt)) if got is not None else (None, 0)
            cache = self.warm_landing.cache
            if held:
                engine.load_prefix(cache, own, held)
            else:
                cache.set_length(0)
            base = cache
        else:
            base, held = self._warm_base(session, prompt)
        engine.sync(self.device)
        sw = engine.Stopwatch(self.device)
        landed, fetch, fell_back, start = None, {"fetched_tokens": 0, "bytes": 0, "host_payload_bytes": 0, "transport": "none"}, None, 0
        if hint is not None:
            landed, fetch, fell_back, start = self._fetch(self.warm_landing, hint, hashes, manifest, held // self.tpb)
        fetch_ms = sw.lap("fetch")
        n = 0 if landed is None else landed if isinstance(landed, int) else landed.shape[0]
        if n and (start + n) * self.tpb >= len(prompt):
            n = max((len(prompt) - 1) // self.tpb - start, 0)  # at least one token computed
            if not isinstance(landed, int):
                landed = landed[:n]
        if landed is not None and n > 0:
            f = (start + n) * self.tpb
            if cache_landing:
                cache.set_length(f)  # own tokens 0 .. start*T, fetched ones after, in place
            else:
                cache = engine.extended(base, start * self.tpb, engine.from_blocks(landed, self.shape, self.tpb)) if start else \
                    engine.cache_from_blocks(landed, self.shape, self.tpb)
                sw.lap("relayout")
        else:
            if cache_landing and hint is not None and held:
                # A fetch that fell back, was refused or is not used may have
                # written over own tokens (from its fetch_from on; unknown
                # after a fallback): put them back before they are read.
                engine.load_prefix(cache, own, held, first=min(start * self.tpb, held) if landed is not None else 0)
            cache, f, n = base, held, 0
        r = engine.prefill(self.model, prompt[f:], cache if held or n else None, sw=sw, ids=_tail(ids, f))
        ms = sw.stop()
        fetch["fetched_tokens"] = n * self.tpb
        # Checksummed by fetched_checksums, untimed.
        self.fetched = None if n == 0 else (cache, start, n) if cache_landing else landed
        return {
            "worker_ms": ms, "fetch_ms": fetch_ms, "phases_ms": sw.phases, "fell_back": fell_back, "held_tokens": held,
            "fetch_from": start, "stage_worker_ms": stage_ms, **fetch, "first_token": r.first_token,
            "logits": _bits(r.logits),
        }

    def op_warm_commit(self, session: str) -> Dict[str, Any]:
        """The last ``warm_off``'s cache becomes the session's cached prefix; its token count."""
        toks, cache = self.warm_next.pop(session)
        self.warm[session] = (toks, cache)
        return {"tokens": len(toks)}

    def op_ideal(self, prompt: List[int]) -> Dict[str, Any]:
        """Suffix prefill on the KV the preceding ``on`` left resident; refuses without it.

        ``cache`` landing: the landing cache as the ``on`` left it (its tokens
        0 .. f untouched since; the suffix and any greedy tokens after them are
        overwritten). ``rows``: re-laid from the kept rows (``relayout`` phase).
        """
        if self.resident is None:
            raise engine.EngineError("resident", "no fetched KV resident (the preceding on fell back)")
        got, self.resident = self.resident, None
        sw = engine.Stopwatch(self.device)
        if isinstance(got, tuple):
            cache, _, blocks = got
            f = blocks * self.tpb
            cache.set_length(f)
        else:
            f = got.shape[0] * self.tpb
            cache = engine.cache_from_blocks(got, self.shape, self.tpb)
            sw.lap("relayout")
        r = engine.prefill(self.model, prompt[f:], cache, sw=sw)
        ms = sw.stop()
        return {"worker_ms": ms, "phases_ms": sw.phases, "first_token": r.first_token, "logits": _bits(r.logits)}

    def op_probe(self, history: int, suffix: int, reps: int, freeze_gc: bool = False, pre: str = "none",
                 threads: Optional[int] = None, cores: Optional[List[int]] = None) -> Dict[str, Any]:
        """Untimed diagnostic: ``reps`` suffix forwards of ``suffix`` tokens on ``history`` tokens of the landing cache.

        The history's KV is whatever the cache holds (its content does not
        change a forward's time); with ``landing="rows"`` a fresh cache of
        ``history`` tokens is prefilled first. Returns per rep ``wall_ms``
        (device-synchronised) and ``launch_ms`` (until the model call
        returned, before the sync: near ``wall_ms`` when the forward is
        host-bound). ``freeze_gc`` calls ``gc.freeze()`` first. Used by
        ``xtask/gpu/worker_forward.py`` to find why a forward inside the
        worker is slower than in a fresh process.

        Before the reps: ``pre`` is ``none``, ``collect`` (``gc.collect``),
        ``empty_cache`` (``torch.cuda.empty_cache``), ``sleep:<ms>`` or
        ``spin:<ms>`` (a busy loop on this thread: does a core kept busy
        run the next host-bound forward faster?);
        ``threads`` sets ``torch.set_num_threads``;
        per rep, ``at_unix_s`` (its start, to line up with a clock log such
        as ``nvidia-smi --query-gpu=clocks.sm``), ``cpu`` (the core it began
        on) and ``cpu_khz`` (that core's ``scaling_cur_freq``, None where the
        host has no cpufreq); ``cores`` pins this
        process to those CPU cores (``os.sched_setaffinity``). Both stay set
        for the process's later calls.
        """

        if history < 1 or suffix < 1 or reps < 1:
            raise engine.EngineError("history", f"history {history}, suffix {suffix}, reps {reps} must be positive")
        if freeze_gc:
            gc.freeze()
        if threads is not None:
            torch.set_num_threads(threads)
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if pre == "collect":
            gc.collect()
        elif pre == "empty_cache":
            torch.cuda.empty_cache()
        elif pre.startswith("sleep:"):
            time.sleep(float(pre[6:]) / 1e3)
        elif pre.startswith("spin:"):
            until = time.perf_counter() + float(pre[5:]) / 1e3
            while time.perf_counter() < until:
                pass
        elif pre != "none":
            raise engine.EngineError("pre", f"unknown {pre!r}: none, collect, empty_cache, sleep:<ms> or spin:<ms>")
        ids = [i % self.shape.vocab for i in range(history + suffix)]
        if self.landing_kind == "cache":
            cache = self.landing.cache
            if history + suffix > cache.capacity():
                raise engine.EngineError("history", f"{history + suffix} tokens past the landing cache's {cache.capacity()}")
        else:
            cache = engine.prefill(self.model, ids[:history]).cache
        walls, launches, at, on_cpu, khz = [], [], [], [], []
        for _ in range(reps):
            cpu = _current_cpu()
            at.append(round(time.time(), 4))
            on_cpu.append(cpu)
            khz.append(_cpu_khz(cpu))
            cache.set_length(history)
            engine.sync(self.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                tok = torch.tensor([ids[history:]], dtype=torch.long, device=self.device)
                self.model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            engine.sync(self.device)
            t2 = time.perf_counter()
            launches.append(round((t1 - t0) * 1e3, 3))
            walls.append(round((t2 - t0) * 1e3, 3))
        cores = sorted(os.sched_getaffinity(0))
        return {"wall_ms": walls, "launch_ms": launches, "at_unix_s": at, "cpu": on_cpu, "cpu_khz": khz,
                "gc_counts": list(gc.get_count()),
                "gc_tracked": len(gc.get_objects()), "torch_threads": torch.get_num_threads(),
                "cores": cores[:4] + (["..."] if len(cores) > 4 else [])}

    def _steady_fds(self) -> None:
        """On the cuda transport, re-bases ``open_fds`` at the first fetch (once).

        The CUDA driver opens fds of its own at the process's first IPC import
        and keeps them until exit (crates/kv-reuse-py/tests/test_gpu.py checks
        fds as a steady state for the same reason); every other counter keeps
        the start baseline.
        """
        if self.transport == "cuda" and not self.fds_rebased:
            self.fds_rebased = True
            self.fds_at_first_fetch = self.kv.leak_counters().get("open_fds")

    def op_trim(self) -> Dict[str, Any]:
        """Untimed: hands the allocator's cached free blocks back to the device (``torch.cuda.empty_cache``).

        Why: on a card the two workers barely fit (``--decode-cache host``),
        the memory an OFF prefill of 32K tokens leaves cached here (~12 GiB
        of activations and cache) is what the decode's next restore needs
        (session 25, H100: out of memory in ``reference`` with the weights
        shared and both regimes). The harness trims before the decode's
        requests, between turns; a turn's timed repetitions run back to back
        and the minimum is kept, so a repetition that maps memory again is
        never the one reported. Returns the bytes reserved before and after.
        """
        gc.collect()
        if not self.device.startswith("cuda"):
            return {"reserved_before": None, "reserved_after": None}
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        return {"reserved_before": before, "reserved_after": torch.cuda.memory_reserved(self.device)}

    def op_quiesce(self) -> Dict[str, Any]:
        """Untimed, before each timed request: collect garbage, drain the device's queue, read the device memory."""
        gc.collect()
        engine.sync(self.device)
        self.quiesced_device_bytes = _device_bytes(self.device)
        return {}

    def op_stats(self, forget_donors: bool = False) -> Dict[str, Any]:
        """Free rows, resource growth since start, device bytes, and the donors each target keeps imported.

        ``forget_donors`` first drops those imports (``Target.forget_donors``):
        the run's final leak check counts what is left after the targets
        stopped fetching; kept imports are bounded and deliberate, not leaks.
        """
        targets = [self.landing.target] + ([self.warm_landing.target] if self.warm_landing is not None else [])
        imported = [t.imported_donors for t in targets]
        if forget_donors:
            for t in targets:
                t.forget_donors()
        now = self.kv.leak_counters()
        base = dict(self.leaks_at_start)
        if self.fds_at_first_fetch is not None:
            base["open_fds"] = self.fds_at_first_fetch
        grown = {k: now[k] - base.get(k, 0) for k in now if now[k] > base.get(k, 0)}
        return {
            "free_rows": self.target.free_rows,
            "leaks_grown": grown,
            "device_bytes": _device_bytes(self.device),
            "imported_donors": imported,
        }


    def op_publish_prefix_stored(self, tokens: List[int], first_block: int = 0) -> Dict[str, Any]:
        """The warm target's own prefix cache holds the sealed blocks of ``tokens``: one ``stored`` KV event on NATS.

        Blocks ``first_block ..`` are new (``WorkerPublisher.publish_prefix_stored``);
        returns ``{"blocks": n}``, the blocks named. Refused
        (``EngineError("router", ...)``) without ``nats_url`` or without the
        warm regime.
        """
        if len(self.publishers) < 2:
            raise engine.EngineError("router", "no warm target publisher (needs nats_url and the warm regime)")
        return {"blocks": self.publishers[1].publish_prefix_stored(tokens, first_block)}

    def close(self) -> None:
        """Stops the targets' announcements and the directory watch (service mode)."""
        for p in self.publishers:
            p.close()
        if self.directory is not None:
            self.directory.close()


@contextlib.contextmanager
def _layer_waits(model: Any, gate: Any, groups: Optional[int], kv: Any):
    """With ``groups``: a forward pre-hook on the first decoder layer of each layer group
    (``kv.layer_group_ranges``, ``kv`` the wheel's module) that makes the stream wait for that group's copies
    (``gate.wait_layer``) before the layer reads its KV; removed on exit. Without: nothing.

    A ``wait_layer`` that returns False (the fetch ended without issuing the group) lets the
    forward go on over rows that were not delivered: the caller drops that forward's output
    when the fetch failed or landed less, as it does without layer groups."""
    if not groups:
        yield
        return
    layers = model.model.layers

    def waits_for(layer: int):
        def hook(_module, _args):
            gate.wait_layer(layer)  # False: the fetch ended without this group (see above)
            return None  # a pre-hook returning anything else replaces the layer's arguments

        return hook

    hooks = [layers[r.start].register_forward_pre_hook(waits_for(r.start))
             for r in kv.layer_group_ranges(len(layers), groups)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _tail(ids: Optional[Any], start: int) -> Optional[Any]:
    """``ids[:, start:]`` (a view, no copy) or None when ``ids`` is None."""
    return None if ids is None else ids[:, start:]


def _current_cpu() -> Optional[int]:
    """The core this thread last ran on: field 39 of ``/proc/thread-self/stat`` (proc(5)); None off Linux."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_khz(cpu: Optional[int]) -> Optional[int]:
    """``scaling_cur_freq`` of core ``cpu`` in kHz (Linux cpufreq); None where the host does not expose it."""
    if cpu is None:
        return None
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _killer(pid: int):
    """A ``donor_alive`` probe that SIGKILLs ``pid`` at its first call and then reports it dead."""
    state = {"killed": False}

    def alive() -> bool:
        if not state["killed"]:
            state["killed"] = True
            os.kill(pid, signal.SIGKILL)
        return False

    return alive


def main(conn: Any, cfg: Dict[str, Any]) -> None:
    """Process entry point (``rpc.Worker``)."""
    try:
        w = PrefillWorker(cfg)
    except Exception as e:
        conn.send({"ok": False, "error": f"prefill worker start: {e!r}"})
        return
    conn.send({"ok": True})
    try:
        rpc.serve(conn, w)
    finally:
        w.close()
