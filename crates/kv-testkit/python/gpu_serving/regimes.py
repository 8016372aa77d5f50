"""The warm regime and the donor-killed turn, driven by the harness beside the churn regime.

**Warm**: the prefill worker keeps the KV it computed for each session's last
prompt (its native prefix cache) and tells the router which blocks it holds
(``prefix_events``) under a second prefill engine id. Each later turn is then
measured twice more in the same run: OFF-warm (prefill only what the own
cache lacks) and ON-warm (advise for the warm engine, fetch what the cost
model admits, which is only the blocks past the own cache: the decode's
output tokens, then prefill the rest). The cost model decides; the harness
always asks. Reported under ``warm`` in the JSON.

**Donor killed mid-fetch**: after the workload, one more turn of one
session, with the decode worker SIGKILLed once its pins are granted and
before the first byte moves (the target's ``donor_alive`` probe): the fetch
must fall back, the turn must still produce its first token (recomputed),
and the prefill worker must hold no more rows, pins, mappings or fds than
before. Reported under ``donor_kill``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .prefix_events import EventError, PrefixEvents
from .timing import best, timed
from .workload import percentile


class WarmRegime:
    """The harness side of the warm regime: the warm engine's events, per-session reported blocks."""

    def __init__(self, router: Any, warm_engine: str, tpb: int, publish: Optional[Any] = None) -> None:
        """``publish(tokens, first_block)``: the router service's path for the
        warm target's own prefix (``ServiceRouter.publish_prefix``); None:
        ``stored`` events for ``router.apply_event``."""
        self.router = router
        self.publish = publish
        self.engine = warm_engine
        self.tpb = tpb
        self.events = PrefixEvents(warm_engine)
        self.reported: Dict[str, int] = {}  # session -> sealed blocks told to the router
        self.unreported = 0  # blocks the decode never stored (so no token hash): left out

    def learn(self, decode_events: List[bytes]) -> None:
        """Token hashes and layout from the decode worker's events of a turn."""
        for e in decode_events:
            self.events.learn(e)

    def turn(self, prefill: Any, sess_id: str, t: int, prompt: List[int], hashes: List[int], manifest: Optional[bytes],
             on_first: bool, repeats: int = 1, staged: bool = False) -> Dict[str, Any]:
        """OFF-warm and ON-warm of one turn, ``repeats`` times each (order alternating, starting per ``on_first``).

        ``staged``: ON-warm sends its prompt ahead of the advise (``timing.timed``'s ``stage``).

        The turn's ``warm`` row: the minimum of each (``timing.timed`` samples,
        all kept in ``samples_ms``), the first ON's fetch fields. The fetched
        blocks' checksums are asked for after the first ON, untimed.
        """
        offs: List[Dict[str, Any]] = []
        ons: List[Dict[str, Any]] = []
        on = off = advice = None
        sums: List[int] = []
        logits_all: List[bytes] = []

        def run_on(rep: int):
            nonlocal on, advice, sums
            rid = f"{sess_id}-t{t}-warm" + (f"-r{rep}" if rep else "")
            o, adv, smp = timed(
                prefill, "warm_on",
                lambda adv: {"session": sess_id, "prompt": None if staged else prompt, "hint": adv.hint,
                             "hashes": hashes if adv.hint is not None else None, "manifest": manifest},
                before=lambda: self.router.advise(rid, hashes, self.engine),
                stage={"prompt": prompt} if staged else None,
            )
            ons.append(smp)
            logits_all.append(o["logits"])
            if on is None:
                on, advice = o, adv
                sums = prefill.call("fetched_checksums")[0]["checksums"]

        for rep in range(repeats):
            first = on_first if rep % 2 == 0 else not on_first
            if first:
                run_on(rep)
            o, _, smp = timed(prefill, "warm_off", {"session": sess_id, "prompt": prompt})
            offs.append(smp)
            off = off if off is not None else o
            if not first:
                run_on(rep)
        prefill.call("warm_commit", session=sess_id)
        off_s, on_s = best(offs), best(ons)
        return {
            "off_ms": round(off_s["ms"], 3),
            "on_ms": round(on_s["ms"], 3),
            "advise_ms": round(on_s["phases_ms"]["advise"], 3),
            "fetch_ms": round(on["fetch_ms"], 3),
            "reason": advice.reason,  # the stable refusal code, None when admitted
            "detail": advice.detail,
            "held_tokens": on["held_tokens"],
            "fetch_from": on["fetch_from"],
            "fetched_tokens": on["fetched_tokens"],
            "bytes": on["bytes"],
            "host_payload_bytes": on["host_payload_bytes"],
            "transport": on["transport"],
            "fell_back": on["fell_back"],
            "advised": advice.hint is not None,
            "off_phases_ms": off_s["phases_ms"],
            "on_phases_ms": on_s["phases_ms"],
            "samples_ms": {"off": [round(x["ms"], 3) for x in offs], "on": [round(x["ms"], 3) for x in ons]},
            "on_repeats_bit_equal": all(x == on["logits"] for x in logits_all),
            "_logits": (on["logits"], off["logits"]),
            "_checksums": sums,
        }

    def report(self, sess_id: str, prompt: List[int], hashes: List[int]) -> None:
        """Tells the router the prefill now holds the sealed blocks of ``prompt`` (after the decode's events).

        In-process router: a ``stored`` event written here (``PrefixEvents``,
        token hashes learned from the decode's events) for ``apply_event``.
        Router service (``publish`` given): the prefill worker's warm target
        publishes it on NATS.
        """
        n = len(prompt) // self.tpb
        done = self.reported.get(sess_id, 0)
        if n <= done:
            return
        publish = self.publish
        if publish is not None:
            # Router service: the prefill's warm target publishes the event
            # itself (token hashes computed by the wheel from the tokens).
            publish(prompt[: n * self.tpb], done)
            self.reported[sess_id] = n
            return
        parent = hashes[done - 1] if done else None
        new = hashes[done:n]
        known = 0
        while known < len(new) and new[known] in self.events.token_hash:
            known += 1
        if known == 0:
            self.unreported += len(new)
            return
        try:
            self.router.apply_event(self.events.stored(parent, new[:known]))
        except EventError:
            self.unreported += len(new)
            return
        self.unreported += len(new) - known
        self.reported[sess_id] = done + known


def bucket_table(w: Any, rows: List[Dict[str, Any]], ideal: bool) -> List[Dict[str, Any]]:
    """p50 / p99 of ``off_ms``, ``on_ms`` (and ``ideal_ms``) per history bucket of ``rows``."""
    out = []
    for b in w.buckets():
        rs = [r for r in rows if r["bucket"] == b]
        if not rs:
            continue
        off = [r["off_ms"] for r in rs]
        on = [r["on_ms"] for r in rs]
        off50, on50 = percentile(off, 50), percentile(on, 50)
        row = {
            "history": b,
            "turns": len(rs),
            "off_p50_ms": off50,
            "off_p99_ms": percentile(off, 99),
            "on_p50_ms": on50,
            "on_p99_ms": percentile(on, 99),
            "ratio": round(off50 / on50, 3) if on50 else None,
        }
        if ideal:
            idl = [r["ideal_ms"] for r in rs if "ideal_ms" in r]
            row["ideal_p50_ms"] = percentile(idl, 50)
            row["ideal_p99_ms"] = percentile(idl, 99)
            row["on_over_ideal"] = round(on50 / percentile(idl, 50), 3) if idl else None
        out.append(row)
    return out


def paired_ms(rows: List[Dict[str, Any]]) -> List[float]:
    """ON - OFF of each repetition of each row (``samples_ms``, ms), paired by repetition index.

    The two requests of one repetition run back to back (their order
    alternating), so a drift slower than one repetition (clocks, heat)
    cancels in the pair, and the median over many pairs keeps whatever ON
    itself costs, in or outside the forward; ``samples_ms`` lists are in
    repetition order.
    """
    return [on - off for r in rows for on, off in zip(r["samples_ms"]["on"], r["samples_ms"]["off"])]


def warm_summary(w: Any, turns: List[Dict[str, Any]], unreported: int) -> Optional[Dict[str, Any]]:
    """The JSON's ``warm``: later turns' buckets (OFF-warm vs ON-warm), fetches, fallbacks; None when not run.

    ``within_1ms``, the goal (ON-warm no slower than OFF-warm by more than
    1 ms): in every bucket the median of ``paired_ms`` over its turns'
    repetitions (``paired_p50_ms``) is <= 1 ms; ``p50_within_1ms``: the
    bucket p50s (each turn's minimum) compared instead.
    """
    rows = [dict(r["warm"], bucket=r["bucket"], turn=r["turn"]) for r in turns if "warm" in r]
    if not rows:
        return None
    later = [r for r in rows if r["turn"] > 0]
    buckets = bucket_table(w, later, ideal=False)
    for b in buckets:
        pairs = paired_ms([r for r in later if r["bucket"] == b["history"] and "samples_ms" in r])
        b["paired_p50_ms"] = percentile(pairs, 50)
        b["pairs"] = len(pairs)
    fetched = [r for r in later if r["fetched_tokens"] > 0]
    return {
        "buckets": buckets,
        "later_turns": len(later),
        "fetched_turns": len(fetched),
        "fetched_tokens_p50": percentile([r["fetched_tokens"] for r in fetched], 50),
        "held_tokens_p50": percentile([r["held_tokens"] for r in later], 50),
        "refused_turns": sum(1 for r in later if not r["advised"]),
        "fallbacks": sum(1 for r in later if r["advised"] and r["fetched_tokens"] == 0),
        "bytes_moved": sum(r["bytes"] for r in rows),
        "host_payload_bytes": sum(r["host_payload_bytes"] for r in rows),
        "within_1ms": (all(b["paired_p50_ms"] is not None and b["paired_p50_ms"] <= 1.0 for b in buckets)
                       if buckets else None),
        "p50_within_1ms": all(b["on_p50_ms"] <= b["off_p50_ms"] + 1.0 for b in buckets) if buckets else None,
        "unreported_blocks": unreported,
    }


def donor_kill(prefill: Any, router: Any, target_engine: str, decode_pid: int, sess: Any, user: List[int], hashes_of, manifest: Optional[bytes]) -> Dict[str, Any]:
    """The donor-killed turn (module docstring); the JSON's ``donor_kill``.

    ``hashes_of(tokens)`` gives the sequence hashes. The decode worker is
    dead afterwards: call this after everything that needs it.
    """
    before, _ = prefill.call("stats")
    prompt = sess.history + user
    hashes = hashes_of(prompt)
    advice = router.advise(f"{sess.id}-kill", hashes, target_engine)
    on, ms = prefill.call("on", prompt=prompt, hint=advice.hint, hashes=hashes, manifest=manifest, kill_donor=decode_pid)
    after, _ = prefill.call("stats")
    grown = {k: v for k, v in after["leaks_grown"].items() if v > before["leaks_grown"].get(k, 0)}
    return {
        "session": sess.id,
        "history": len(sess.history),
        "advised": advice.hint is not None,
        "reason": advice.reason,  # the stable refusal code, None when admitted
        "detail": advice.detail,
        "fell_back": on["fell_back"],
        "fetched_tokens": on["fetched_tokens"],
        "first_token_produced": isinstance(on.get("first_token"), int),
        "on_ms": round(ms, 3),
        "prefill_leaks_grown": grown,
        "free_rows_before": before["free_rows"],
        "free_rows_after": after["free_rows"],
        "ok": advice.hint is not None
        and on["fell_back"] is not None
        and on["fetched_tokens"] == 0
        and not grown
        and after["free_rows"] == before["free_rows"],
    }
