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

Only the MessagePack subset those events use is encoded and decoded: nil,
bool, unsigned ints, str, bin, arrays and maps.
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Tuple


class EventError(ValueError):
    """A KV event could not be read or written; ``field`` names the part."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def pack(v: Any) -> bytes:
    """MessagePack of ``v`` (None, bool, int >= 0, str, bytes, list, dict with str keys)."""
    out = bytearray()
    _pack(v, out)
    return bytes(out)


def _pack(v: Any, out: bytearray) -> None:
    if v is None:
        out.append(0xC0)
    elif v is True or v is False:
        out.append(0xC3 if v else 0xC2)
    elif isinstance(v, int):
        if v < 0:
            raise EventError("value", f"negative int {v} (not used by KvEvent)")
        for limit, code, fmt in ((0x80, None, None), (1 << 8, 0xCC, ">B"), (1 << 16, 0xCD, ">H"), (1 << 32, 0xCE, ">I"), (1 << 64, 0xCF, ">Q")):
            if v < limit:
                if code is None:
                    out.append(v)
                else:
                    out.append(code)
                    out += struct.pack(fmt, v)
                return
        raise EventError("value", f"int {v} above u64")
    elif isinstance(v, str):
        b = v.encode()
        _header(len(b), out, 0xA0, 32, (0xD9, 0xDA, 0xDB))
        out += b
    elif isinstance(v, (bytes, bytearray)):
        _header(len(v), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += v
    elif isinstance(v, (list, tuple)):
        _header(len(v), out, 0x90, 16, (None, 0xDC, 0xDD))
        for x in v:
            _pack(x, out)
    elif isinstance(v, dict):
        _header(len(v), out, 0x80, 16, (None, 0xDE, 0xDF))
        for k, x in v.items():
            _pack(k, out)
            _pack(x, out)
    else:
        raise EventError("value", f"cannot pack {type(v).__name__}")


def _header(n: int, out: bytearray, fix: Optional[int], fix_max: int, codes: Tuple[Optional[int], ...]) -> None:
    if fix is not None and n < fix_max:
        out.append(fix | n)
        return
    for code, fmt, limit in zip(codes, (">B", ">H", ">I"), (1 << 8, 1 << 16, 1 << 32)):
        if code is not None and n < limit:
            out.append(code)
            out += struct.pack(fmt, n)
            return
    raise EventError("value", f"length {n} too large")


def unpack(b: bytes) -> Any:
    """The value MessagePack ``b`` holds; raises ``EventError("bytes", ...)`` on trailing or unknown bytes."""
    v, i = _unpack(b, 0)
    if i != len(b):
        raise EventError("bytes", f"{len(b) - i} trailing bytes")
    return v


def _unpack(b: bytes, i: int) -> Tuple[Any, int]:
    try:
        c = b[i]
    except IndexError:
        raise EventError("bytes", "truncated") from None
    i += 1
    if c < 0x80:
        return c, i
    if c & 0xF0 == 0x80:
        return _map(b, i, c & 0x0F)
    if c & 0xF0 == 0x90:
        return _array(b, i, c & 0x0F)
    if c & 0xE0 == 0xA0:
        n = c & 0x1F
        return b[i : i + n].decode(), i + n
    sizes = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD9: ">B", 0xDA: ">H", 0xDB: ">I",
             0xC4: ">B", 0xC5: ">H", 0xC6: ">I", 0xDC: ">H", 0xDD: ">I", 0xDE: ">H", 0xDF: ">I"}
    if c == 0xC0:
        return None, i
    if c in (0xC2, 0xC3):
        return c == 0xC3, i
    if c not in sizes:
        raise EventError("bytes", f"unsupported MessagePack code 0x{c:02x}")
    fmt = sizes[c]
    w = struct.calcsize(fmt)
    (n,) = struct.unpack_from(fmt, b, i)
    i += w
    if c in (0xCC, 0xCD, 0xCE, 0xCF):
        return n, i
    if c in (0xD9, 0xDA, 0xDB):
        return b[i : i + n].decode(), i + n
    if c in (0xC4, 0xC5, 0xC6):
        return bytes(b[i : i + n]), i + n
    if c in (0xDC, 0xDD):
        return _array(b, i, n)
    return _map(b, i, n)


def _array(b: bytes, i: int, n: int) -> Tuple[List[Any], int]:
    out = []
    for _ in range(n):
        v, i = _unpack(b, i)
        out.append(v)
    return out, i


def _map(b: bytes, i: int, n: int) -> Tuple[Dict[Any, Any], int]:
    out = {}
    for _ in range(n):
        k, i = _unpack(b, i)
        v, i = _unpack(b, i)
        out[k] = v
    return out, i


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
