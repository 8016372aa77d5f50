"""The decode worker process: generates answers and retains KV blocks as the donor.

It keeps one ``DynamicCache`` per session on its device and, after every turn,
retains the sealed blocks of prompt + output (the tokens whose KV it holds) in
a ``kv_reuse.DonorBank`` (device memory exported over CUDA IPC on the ``cuda``
transport, host shared memory on ``host``: ``transport.open_bank``), serving
pins on a Unix socket so a prefill worker can fetch them.

The answer (``answer`` in the config): ``greedy`` generates every token with
one decode step each; ``forced`` takes the first token greedily and draws the
rest from a seeded generator, computing their KV in one forward pass (the
same KV a decode holds after generating those tokens, for a fraction of the
time: the measured TTFT is the prefill's, and the answer's content does not
enter it).

How the prompt's KV reaches decode: the decode worker continues on its own
retained KV and computes only the tokens it lacks (the new user turn; the whole
prompt on a session's first turn, in chunks of ``prefill_chunk`` tokens when
set). That is untimed: the measured TTFT is the prefill worker's.

Where an idle session's KV waits (``decode_cache``): ``device`` keeps every
session's cache on the card beside the bank's copy of its blocks; ``host``
keeps it in pinned host memory and restores it for the session's next turn
or a reference request (untimed), so the card holds one session's working
cache at a time. The harness picks ``host`` where the workload would not fit
the card otherwise (an 80 GB card for 8 sessions to 32K).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from . import engine, rpc, service, transport

DECODE_CACHES = ("device", "host")

# Tokens a restored cache holds past the turn's prompt and answer.
RESTORE_HEADROOM = 512


def _bits(t: torch.Tensor) -> bytes:
    """bf16 logits as their raw bytes (exact comparison across processes)."""
    return t.detach().view(torch.int16).cpu().numpy().tobytes()


class EngineWorker:
    """What both workers hold: the kv_reuse module, device, model and bank layout (TP 1, bf16)."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        import kv_reuse

        self.kv = kv_reuse
        self.device = cfg["device"]
        self.transport = cfg.get("transport", "host")
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        self.shape = engine.shape(cfg["model"])
        self.model = engine.build_model(cfg["model"], self.device, cfg["seed"])
        engine.sync(self.device)
        self.build_s = time.perf_counter() - t0
        self.tpb = cfg["tokens_per_block"]
        s = self.shape
        self.layout = kv_reuse.Layout(s.num_layers, s.num_kv_heads, s.head_dim, "bf16", self.tpb, 1)


class DecodeWorker(EngineWorker):
    """Requests: ``hello``, ``turn``, ``reference``, ``stats``."""

    def __init__(self, cfg: Dict[str, Any]) -> None:
        super().__init__(cfg)
        kv_reuse = self.kv
        self.answer = cfg.get("answer", "greedy")
        if self.answer not in ("greedy", "forced"):
            raise engine.EngineError("answer", f"unknown {self.answer!r}, expected greedy or forced")
        self.endpoint = "unix:" + os.path.join(tempfile.mkdtemp(prefix="gpu-serving-"), "pins.sock")
        # ``nats_url`` (the harness's --router service): a donor agent on
        # NATS opens the bank and serves its pins, publishes its directory
        # record, KV events and announcements (the router service follows
        # them); otherwise the bank is this worker's own and the harness
        # hands its events to an in-process router.
        self.publisher = None
        if cfg.get("nats_url"):
            gpu = transport.ordinal(self.device, self.transport)
            self.publisher = kv_reuse.WorkerPublisher.donor(
                cfg["nats_url"], cfg.get("worker_key", "gpu-serving-decode"), self.layout, cfg["bank_slots"],
                self.endpoint, gpus=None if gpu is None else [gpu], store_timeout_s=60.0,
                announce_period_s=service.ANNOUNCE_PERIOD_S)
            self.bank = self.publisher.bank
            self.pins = None
        else:
            self.bank = transport.open_bank(kv_reuse, self.layout, cfg["bank_slots"], self.device, self.transport)
            self.pins = self.bank.serve_pins(self.endpoint)
        self.decode_cache = cfg.get("decode_cache", "device")
        if self.decode_cache not in DECODE_CACHES:
            raise engine.EngineError("decode_cache", f"unknown {self.decode_cache!r}, expected one of {list(DECODE_CACHES)}")
        self.prefill_chunk = int(cfg.get("prefill_chunk", 0))
        # decode_cache "device": session -> its cache; "host": session -> engine.HostCopy.
        self.caches: Dict[str, Any] = {}
        self.checksums: Dict[int, int] = {}  # sequence hash -> block checksum (engine.block_checksums)
        self.store_failures: List[str] = []

    def op_export_weights(self) -> Dict[str, Any]:
        """The model's parameters for another worker on the same device (``engine.export_weights``)."""
        return {"weights": engine.export_weights(self.model)}

    def op_hello(self) -> Dict[str, Any]:
        return {
            "engine_id": self.bank.engine_id,
            "endpoint": self.endpoint,
            "weights_checksum": engine.weights_checksum(self.model),
            "device_bytes": _device_bytes(self.device),
            "build_s": self.build_s,
        }

    def _answer(self, session: str, prompt: List[int], first: engine.PrefillResult, gen: int):
        """(output tokens, cache holding prompt + all but the last output token)."""
        if self.answer == "greedy" or gen < 2:
            return engine.greedy(self.model, first, gen)
        # str seeds are hashed with SHA-512 by random.Random: the same in every process.
        rng = random.Random(f"{session}:{len(prompt)}")
        out = [first.first_token] + [rng.randrange(self.shape.vocab) for _ in range(gen - 1)]
        r = engine.prefill(self.model, out[:-1], first.cache)
        return out, r.cache

    def _session_cache(self, session: str, tokens: Optional[int], capacity: int) -> Any:
        """The session's cache on the device with room for ``capacity`` tokens (None: none yet).

        ``tokens``: how many of its tokens to keep (None: all). On ``host`` a
        fresh device cache restored from the host copy; on ``device`` the kept
        cache itself (grown in place) or, with ``tokens``, a cropped copy.
        """
        kept = self.caches.get(session)
        if kept is None:
            return None
        if self.decode_cache == "host":
            return kept.restore(kept.tokens if tokens is None else tokens, capacity, self.device)
        if tokens is not None:
            return engine.cropped(kept, tokens)
        if isinstance(kept, engine.PreallocCache) and kept.capacity() < capacity - RESTORE_HEADROOM:
            # One growth for the whole turn (not one per chunk), and only when
            # the turn does not fit: the same growths as before chunking.
            kept.reserve(capacity)
        return kept

    def op_turn(self, session: str, prompt: List[int], gen: int) -> Dict[str, Any]:
        """Prefill what this worker lacks of ``prompt``, generate ``gen`` tokens, retain the blocks."""
        room = len(prompt) + gen + RESTORE_HEADROOM
        cache = self._session_cache(session, None, room)
        if cache is None and self.prefill_chunk and len(prompt) > self.prefill_chunk:
            cache = engine.PreallocCache.for_shape(self.shape, room, self.device)
        held = engine.cache_len(cache) if cache is not None else 0
        sw = engine.Stopwatch(self.device)
        first = engine.prefill(self.model, prompt[held:], cache, chunk=self.prefill_chunk)
        out, cache = self._answer(session, prompt, first, gen)
        decode_ms = sw.stop()
        kv_tokens = (list(prompt) + out)[: engine.cache_len(cache)]
        sw = engine.Stopwatch(self.device)
        hashes = self._retain(cache, kv_tokens)
        if self.decode_cache == "host":
            self.caches.setdefault(session, engine.HostCopy()).update(cache)
            del cache, first
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()  # this turn's working cache and retain rows go back to the card
        else:
            self.caches[session] = cache
        return {
            "output": out,
            "computed_tokens": len(prompt) - held,
            "decode_ms": decode_ms,
            "retain_ms": sw.stop(),
            "events": self._events(),
            "manifest": self.bank.manifest(),
            "slots": self._all_slots(),
        }

    def _events(self) -> List[bytes]:
        """This turn's KV events for the harness's in-process router; [] when the publisher sent them on NATS."""
        if self.publisher is not None:
            self.publisher.publish_events()
            return []
        return self.bank.drain_events()

    def _all_slots(self) -> Dict[int, int]:
        """Slot of every block this worker retained and the bank still holds (all sessions).

        The router's donor directory takes the donor's whole slot map per
        report, so every report carries every session's blocks.
        """
        hashes = list(self.checksums)
        return {h: s for h, s in zip(hashes, self.bank.slots(hashes)) if s is not None}

    def _retain(self, cache: Any, kv_tokens: List[int]) -> List[int]:
        """Stores the sealed blocks of ``kv_tokens`` not yet retained; their hashes."""
        n = len(kv_tokens) // self.tpb
        if n == 0:
            return []
        hashes = self.kv.sequence_hashes(kv_tokens[: n * self.tpb], self.tpb)
        missing = [i for i, s in enumerate(self.bank.slots(hashes)) if s is None]
        if not missing:
            return hashes
        # Everything slow (gathering the new blocks, their checksums, the copy
        # to the host on the host transport) happens before the store is
        # opened: an open store holds its reserved slots and is rolled back
        # after the bank's store timeout, which an 8B-shaped turn can exceed.
        rows, sums, source = self._rows(cache, missing, n)
        try:
            pending = self.bank.store(kv_tokens[: n * self.tpb])
        except self.kv.KvReuseError as e:  # bank full: this turn is not retained
            self.store_failures.append(repr(e))
            return hashes
        # The store holds exactly the blocks the bank lacks, in prefix order
        # (row i = sequence_hashes[i]); that is ``missing`` unless the bank
        # changed between slots() and store(), e.g. an eviction of this prefix.
        want = list(pending.sequence_hashes)
        at = {h: i for i, h in enumerate(hashes)}
        if want != [hashes[i] for i in missing]:
            missing = [at[h] for h in want]
            rows, sums, source = self._rows(cache, missing, n) if missing else (None, [], None)
        if missing:
            pending.write(0, source)
        pending.ack(0)
        for i, c in zip(missing, sums):
            self.checksums[hashes[i]] = c
        return hashes

    def _rows(self, cache: Any, blocks: List[int], n: int):
        """(device rows of ``blocks`` in order, their checksums, what ``PendingStore.write`` reads)."""
        lo = blocks[0]
        rows = engine.to_blocks(cache, lo, n - lo, self.tpb)
        if blocks != list(range(lo, n)):  # a gap (blocks the bank already holds): a copy of the rest
            rows = rows[[i - lo for i in blocks]]
        return rows, engine.block_checksums(rows), transport.store_source(rows, self.transport)

    def op_reference(self, session: str, prompt: List[int], fetched_tokens: int, greedy_n: int) -> Dict[str, Any]:
        """The donor continuing ``session`` on its own KV, split as the target split it.

        The first ``fetched_tokens`` tokens' KV come from this worker's cache
        (a cropped copy), the rest of ``prompt`` is prefilled on top: the same
        kernels and inputs as the target's ON path.
        """
        if session not in self.caches:
            raise engine.EngineError("session", f"{session!r} has no turn on this worker")
        cache = self._session_cache(session, fetched_tokens, len(prompt) + greedy_n + RESTORE_HEADROOM)
        r = engine.prefill(self.model, prompt[fetched_tokens:], cache)
        toks = engine.greedy(self.model, r, greedy_n)[0] if greedy_n else []
        out = {"logits": _bits(r.logits), "first_token": r.first_token, "greedy": toks}
        if self.decode_cache == "host":
            del cache, r
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()  # the restored cache goes back to the card, as after a turn
        return out

    def op_checksums(self, hashes: List[int]) -> Dict[str, Any]:
        """The checksum recorded when each block was retained (None: not retained here)."""
        return {"checksums": [self.checksums.get(h) for h in hashes]}

    def op_stats(self) -> Dict[str, Any]:
        return {
            "store_failures": self.store_failures,
            "pins_outstanding": self.bank.pins_outstanding,
            "leaks": self.kv.leak_counters(),
            "device_bytes": _device_bytes(self.device),
        }

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()  # record deleted, pins stopped, bank closed
        else:
            self.pins.close()


def _device_bytes(device: str) -> Optional[int]:
    """Bytes torch holds allocated on ``device`` (None on the CPU)."""
    return int(torch.cuda.memory_allocated(device)) if device.startswith("cuda") else None


def main(conn: Any, cfg: Dict[str, Any]) -> None:
    """Process entry point (``rpc.Worker``)."""
    try:
        w = DecodeWorker(cfg)
    except Exception as e:
        conn.send({"ok": False, "error": f"decode worker start: {e!r}"})
        return
    conn.send({"ok": True})
    try:
        rpc.serve(conn, w)
    finally:
        w.close()
