"""The prefill worker's own prefix cache, told to the router as KV events (the warm regime).

In the warm regime the prefill worker keeps the KV it computed for a
session's last prompt. The router's cost model only counts that as the
target's baseline (``fetch_from``: blocks the target already holds, so a fetch
pays only for the rest) when the index holds the target's ``stored`` events.
The wheel gives events only for a ``DonorBank``; this module writes the
prefill's own ones in the same wire form (docs/wire-formats.md, ``KvEvent``:
named-field MessagePack), taking the layout fingerprint and each block's token
hash from the decode worker's events for the same blocks (the decode retained
every block the prefill computed: prompt + output).

The bytes are written and read by the wheel (kv-descriptor's own codec,
``kv_reuse.encode_kv_event`` / ``decode_kv_event``, JSON of the same field
names on the Python side), so this module holds no second MessagePack codec.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


class EventError(ValueError):
    """A KV event could not be read or written; ``field`` names the part."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def pack(v: Dict[str, Any]) -> bytes:
    """Wire bytes of the KvEvent whose fields ``v`` holds, written by the wheel
    (kv-descriptor's codec, ``kv_reuse.encode_kv_event``), validated on the way.

    Raises ``EventError("event", ...)`` when ``v`` is not a valid KvEvent.
    """
    import kv_reuse

    try:
        return bytes(kv_reuse.encode_kv_event(json.dumps(v)))
    except kv_reuse.KvReuseError as e:
        raise EventError("event", str(e)) from e


def unpack(b: bytes) -> Dict[str, Any]:
    """The fields of the KvEvent in wire bytes ``b`` (``kv_reuse.decode_kv_event``).

    Raises ``EventError("event", ...)`` for bytes that are not one valid KvEvent.
    """
    import kv_reuse

    try:
        return json.loads(kv_reuse.decode_kv_event(bytes(b)))
    except kv_reuse.KvReuseError as e:
        raise EventError("event", str(e)) from e


class PrefixEvents:
    """Writes one prefill engine's ``stored`` / ``removed`` KV events for its own prefix cache.

    ``learn`` reads the decode worker's events (token hash per sequence hash,
    the layout fingerprint, the TP size); ``stored`` / ``removed`` return the
    wire bytes for ``Router.apply_event``. Event ids start at 1 and grow by 1
    (a jump would read as a gap). Tier ``device``: the prefill's own KV cache.
    """

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.next_id = 1
        self.token_hash: Dict[int, int] = {}
        self.fingerprint: Optional[int] = None
        self.tp_size: Optional[int] = None

    def learn(self, event: bytes) -> None:
        """Takes the token hashes and layout of a decode worker's ``stored`` event (others are ignored)."""
        e = unpack(event)
        if not isinstance(e, dict) or "layout_fingerprint" not in e:
            raise EventError("event", "not a KvEvent map")
        self.fingerprint, self.tp_size = e["layout_fingerprint"], e["tp_size"]
        data = e.get("data")
        if isinstance(data, dict) and "stored" in data:
            for blk in data["stored"]["blocks"]:
                self.token_hash[blk["sequence_hash"]] = blk["token_hash"]

    def _event(self, data: Any) -> bytes:
        if self.fingerprint is None:
            raise EventError("layout_fingerprint", "no decode event learned yet")
        ev = {
            "publisher": self.engine_id,
            "event_id": self.next_id,
            "role": "prefill",
            "layout_fingerprint": self.fingerprint,
            "tp_size": self.tp_size,
            "tier": "device",
            "data": data,
        }
        self.next_id += 1
        return pack(ev)

    def stored(self, parent: Optional[int], hashes: List[int]) -> bytes:
        """A ``stored`` event for ``hashes`` (consecutive blocks after ``parent``, None: from the root).

        Raises ``EventError("token_hash", ...)`` for a block no decode event named.
        """
        blocks = []
        for h in hashes:
            if h not in self.token_hash:
                raise EventError("token_hash", f"sequence hash {h} was never stored by the decode worker")
            blocks.append({"sequence_hash": h, "token_hash": self.token_hash[h]})
        return self._event({"stored": {"parent": parent, "blocks": blocks}})

    def removed(self, hashes: List[int]) -> bytes:
        """A ``removed`` event for ``hashes``."""
        return self._event({"removed": {"sequence_hashes": list(hashes)}})
