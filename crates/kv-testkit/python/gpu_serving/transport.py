"""Where the KV lives on each side of a fetch, per transport.

Two transports, picked with the harness's ``--transport``:

- ``cuda`` (GPU default): the decode worker's ``kv_reuse.DonorBank`` is device
  memory on its GPU (``gpus=[ordinal]``, exported over CUDA IPC) and the
  prefill worker's ``kv_reuse.Target`` lands the fetched blocks on its device:
  a device to device copy, ``FetchOutcome.host_payload_bytes == 0``. Either
  straight into the engine's KV cache at their token positions
  (:class:`CacheLanding`, ``kv_layout="hf"``: the gather kernel converts the
  layout inside the copy; the prefill worker's default), or into block-major
  rows of a CUDA tensor of its own (:class:`Landing`), which the engine then
  re-lays into its cache (torch view / permute, no host copy).
- ``host`` (CPU tests, and the older measurement): the bank is host shared
  memory and the target fetches into its own host rows (``read_row``), copied
  through a pinned staging tensor onto the engine's device.

Tensor shapes: one bank row / target row is one KV block, block-major
(``kv_descriptor`` ``TensorOrder::BlockMajor``), ``[num_layers, 2, tokens_per_block,
kv_heads, head_dim]`` bf16 values, i.e. ``Layout.rank_block_elems`` elements.
The engine side handles them as int16 ``[rows, rank_block_elems]`` (bf16 bits).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch

TRANSPORTS = ("cuda", "host")


class TransportError(ValueError):
    """A transport setting was refused; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def ordinal(device: str, transport: str) -> Optional[int]:
    """The CUDA ordinal ``device`` names for the ``cuda`` transport; None for ``host``.

    Raises ``TransportError("transport", ...)`` for an unknown transport and
    ``TransportError("device", ...)`` for a non-CUDA device on the ``cuda``
    transport (CUDA IPC needs device memory on both sides).
    """
    if transport not in TRANSPORTS:
        raise TransportError("transport", f"unknown {transport!r}, expected one of {list(TRANSPORTS)}")
    if transport == "host":
        return None
    if not device.startswith("cuda"):
        raise TransportError("device", f"{device!r} on the cuda transport; use a cuda:N device or --transport host")
    _, _, n = device.partition(":")
    return int(n) if n else int(torch.cuda.current_device())


class DlpackView:
    """Shows the wheel only a tensor's DLPack protocol.

    torch raises ``TypeError`` (not ``AttributeError``) from
    ``__cuda_array_interface__`` for bf16 tensors, and the wheel reads that
    attribute first, so a bare bf16 CUDA tensor would be refused; DLPack
    carries bf16 (``kDLBfloat``, 16 bits). The view keeps ``tensor`` alive,
    which keeps the memory the wheel was handed valid.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        # The consumer's stream (the wheel's store asks 1, the legacy default)
        # lets torch order its queued work before the consumer's copy.
        if stream is None:
            return self.tensor.__dlpack__()
        return self.tensor.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()


def open_bank(kv: Any, layout: Any, slots: int, device: str, transport: str) -> Any:
    """The decode worker's ``kv_reuse.DonorBank`` of ``slots`` blocks for ``transport``.

    ``cuda``: device memory on ``device``'s GPU (``gpus=[ordinal]``), TP 1.
    ``host``: host shared memory. An open store may hold its slots 60 s
    (an 8B-shaped turn's first store copies gigabytes).
    """
    gpu = ordinal(device, transport)
    if gpu is None:
        return kv.DonorBank(layout, slots=slots, store_timeout_s=60.0)
    return kv.DonorBank(layout, slots=slots, gpus=[gpu], store_timeout_s=60.0)


def store_source(rows: torch.Tensor, transport: str) -> Any:
    """What ``PendingStore.write`` reads for the new blocks ``rows`` (int16 ``[k, elems]``, on the engine's device).

    ``cuda``: the device rows themselves as bf16 behind :class:`DlpackView`:
    the wheel copies them device to device into the CUDA bank (no host
    payload; it asks ``__dlpack__(stream=1)``, ordering torch's work before
    its copy). ``host``: a host ``uint16`` copy (numpy) for the shm bank.
    """
    if transport == "cuda":
        return DlpackView(rows.view(torch.bfloat16))
    return rows.cpu().numpy().view(np.uint16)


class Landing:
    """The prefill worker's ``kv_reuse.Target`` and where its fetches land.

    ``cuda``: a bf16 CUDA tensor ``[rows, elems]`` on the engine's device is
    the target's destination; :meth:`land` returns the fetched rows of it,
    in prefix order, without leaving the device. ``host``: the target's own
    host rows, copied through a pinned staging tensor to the device.
    """

    def __init__(self, kv: Any, layout: Any, rows: int, device: str, transport: str) -> None:
        self.device = device
        self.transport = transport
        gpu = ordinal(device, transport)
        elems = layout.rank_block_elems
        if gpu is None:
            self.kv_cache: Optional[torch.Tensor] = None
            self.target = kv.Target(layout, rows=rows)
            # One staging buffer for the largest fetch, pinned so the copy to
            # the device runs at full PCIe / NVLink-C2C speed.
            pin = device.startswith("cuda")
            self.staging = torch.empty((rows, elems), dtype=torch.int16, pin_memory=pin)
        else:
            self.kv_cache = torch.zeros((rows, elems), dtype=torch.bfloat16, device=device)
            self.staging = None
            # The engine's writes (the zero fill) land before the wheel maps it.
            torch.cuda.synchronize(device)
            self.target = kv.Target(layout, rows=rows, kv_caches=[DlpackView(self.kv_cache)], gpus=[gpu])

    def land(self, out: Any) -> torch.Tensor:
        """The fetched blocks of ``out`` (a ``FetchOutcome``) as int16 device rows ``[n, elems]``, prefix order.

        ``cuda``: a view of the destination tensor when the target put the
        prefix in consecutive rows, else a device-side gather. The rows stay
        valid until the next fetch (the harness's ``ideal`` runs before it).
        """
        rows: List[int] = list(out.rows)
        n = len(rows)
        if self.kv_cache is not None:
            if n and rows == list(range(rows[0], rows[0] + n)):
                got = self.kv_cache[rows[0] : rows[0] + n]
            else:
                got = self.kv_cache.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
            return got.view(torch.int16)
        for i, row in enumerate(rows):
            self.staging[i].numpy().view(np.uint8)[:] = np.frombuffer(self.target.read_row(0, row), dtype=np.uint8)
        return self.staging[:n].to(self.device, non_blocking=True)


class CacheLanding:
    """A ``kv_reuse.Target`` whose fetches land straight in the engine's KV cache (``kv_layout="hf"``).

    ``cache`` is an allocated ``engine.PreallocCache`` on the CUDA device
    ``device``: its arena ``[L, 2, 1, H, capacity, D]`` bf16 is the target's
    destination, per layer K and V views ``[1, H, capacity, D]`` (one K-to-V
    distance in every layer, as the wheel's "hf" layout requires); block ``b``
    of a fetch lands at tokens ``b*T .. (b+1)*T``, converted from the donor's
    block-major rows inside the copy (no re-layout afterwards, no host
    payload). The cache is pinned here: it never reallocates while the target
    maps it. ``rows`` blocks of ``T`` tokens must fit its capacity.

    Raises ``TransportError("transport", ...)`` off the ``cuda`` transport
    (a host target cannot write device memory) and
    ``TransportError("rows", ...)`` when ``rows * T`` tokens exceed the cache.
    """

    def __init__(self, kv: Any, layout: Any, cache: Any, rows: int, device: str, transport: str) -> None:
        gpu = ordinal(device, transport)
        if gpu is None:
            raise TransportError("transport", "landing in the engine cache needs the cuda transport (device memory)")
        t = layout.tokens_per_block
        if rows * t > cache.capacity():
            raise TransportError("rows", f"{rows} blocks of {t} tokens exceed the cache's {cache.capacity()} tokens")
        self.device = device
        self.transport = transport
        self.cache = cache
        cache.pin()
        views = [DlpackView(b) for k, v in cache.buffers() for b in (k, v)]
        # Writes queued on the arena (its allocation) land before the wheel maps it.
        torch.cuda.synchronize(device)
        self.target = kv.Target(layout, rows=rows, kv_caches=[views], gpus=[gpu], kv_layout="hf")

    def land(self, out: Any) -> int:
        """The blocks ``out`` (a ``FetchOutcome``) landed, already at tokens ``fetch_from*T ..`` of the cache.

        Raises ``TransportError("rows", ...)`` when the target did not put
        them at their prompt positions (then the cache does not hold them).
        """
        rows: List[int] = list(out.rows)
        start = out.fetch_from
        if rows != list(range(start, start + len(rows))):
            raise TransportError("rows", f"landed at blocks {rows[:4]}..., not at prompt positions from {start}")
        return len(rows)
