"""Reference engine: transformers' LlamaForCausalLM from a config, no download.

Two model shapes share all code: ``llama-3.1-8b`` (Llama-3.1-8B's published
geometry: 32 layers, 32 query heads, 8 KV heads, head dim 128, hidden 4096,
MLP 14336, vocabulary 128256, RoPE theta 500000) and ``tiny`` (2 layers, 2 KV
heads, head dim 16) for CPU tests. Weights are random (``torch.manual_seed``
then the model's own initialisation), bf16, attention through SDPA.

KV shapes: a ``DynamicCache`` layer holds keys and values of shape
``[1, kv_heads, tokens, head_dim]``. The bank's rows are block-major
(kv_descriptor ``TensorOrder::BlockMajor``): one block is
``[num_layers, 2 (K, V), tokens_per_block, kv_heads, head_dim]`` elements, bf16
carried as ``uint16`` (the wheel's ``Layout.typestr`` ``<u2``).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


class EngineError(ValueError):
    """Bad engine input; ``field`` names the argument that was refused."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Geometry of one model (the KV layout follows from it)."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers, bf16."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


SHAPES = {
    # Llama-3.1-8B's config.json geometry (Meta's model card); the llama3 RoPE
    # frequency scaling is left out: it changes values, not cost.
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0),
    "tiny": ModelShape("tiny", 2, 64, 128, 4, 2, 16, 256, 10000.0),
}


def shape(name: str) -> ModelShape:
    """The shape called ``name``; raises ``EngineError("model", ...)`` for an unknown one."""
    try:
        return SHAPES[name]
    except KeyError:
        raise EngineError("model", f"unknown {name!r}, expected one of {sorted(SHAPES)}") from None


def build_model(name: str, device: str, seed: int = 0) -> LlamaForCausalLM:
    """A seeded random bf16 ``LlamaForCausalLM`` of shape ``name`` on ``device``, SDPA, eval mode.

    Same ``name``, ``device`` and ``seed`` give bit-identical weights in any process
    (the workers compare :func:`weights_checksum`).
    """
    s = shape(name)
    cfg = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=131072,
        rope_theta=s.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype=torch.bfloat16).eval()
    model.requires_grad_(False)
    return model


def weights_checksum(model: torch.nn.Module) -> int:
    """Sum over all parameters of their bf16 bit patterns as int64 (equal weights -> equal sums)."""
    total = 0
    for p in model.parameters():
        total += int(p.detach().view(torch.int16).to(torch.int64).sum().item())
    return total


def sync(device: str) -> None:
    """Waits for the device's queued work (timing boundaries)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class PrefillResult:
    """First token of a prefill and what produced it."""

    first_token: int
    logits: torch.Tensor  # [vocab] bf16, the last position's logits
    cache: DynamicCache  # every token's KV so far (history + this prefill's tokens)


@torch.inference_mode()
def prefill(model: LlamaForCausalLM, tokens: Sequence[int], cache: Optional[DynamicCache] = None,
            sw: Optional["Stopwatch"] = None) -> PrefillResult:
    """Prefill ``tokens`` on top of ``cache`` (None: from scratch); greedy first token.

    Only the last position's logits are computed (``logits_to_keep=1``): a 32K
    prefill would otherwise materialise 32K x vocab logits. ``cache`` is
    extended in place. Raises ``EngineError("tokens", ...)`` when empty.
    ``sw``: when given, its ``forward`` lap ends after the forward pass (device
    synchronised) and its ``readback`` lap after the first token reached the
    host, so a timed request says which of the two its time went to.
    """
    if len(tokens) == 0:
        raise EngineError("tokens", "a prefill needs at least one token")
    dev = model.device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=dev)
    if cache is None:
        cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1]
    if sw is not None:
        sw.lap("forward")
    first = int(torch.argmax(logits).item())
    if sw is not None:
        sw.lap("readback")
    return PrefillResult(first, logits, out.past_key_values)


@torch.inference_mode()
def greedy(model: LlamaForCausalLM, first: PrefillResult, n: int) -> Tuple[List[int], DynamicCache]:
    """``n`` greedy tokens starting with ``first.first_token`` (n - 1 decode steps).

    The returned cache holds every token's KV except the last generated
    token's (it has not been fed back yet), as a decode engine holds it.
    """
    if n < 1:
        raise EngineError("n", "at least one token")
    out = [first.first_token]
    cache = first.cache
    dev = model.device
    for _ in range(n - 1):
        ids = torch.tensor([[out[-1]]], dtype=torch.long, device=dev)
        r = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = r.past_key_values
        out.append(int(torch.argmax(r.logits[0, -1]).item()))
    return out, cache


def cache_len(cache: DynamicCache) -> int:
    """Tokens held by ``cache``."""
    return int(cache.get_seq_length())


def layer_kv(cache: DynamicCache) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each ``[1, kv_heads, tokens, head_dim]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


def cache_from_kv(kv: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (per-layer keys, values ``[1, H, T, D]``)."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def cropped(cache: DynamicCache, tokens: int) -> DynamicCache:
    """A new cache with the first ``tokens`` tokens of ``cache``; ``cache`` is untouched.

    Raises ``EngineError("tokens", ...)`` past the cache's length.
    """
    n = cache_len(cache)
    if not 0 < tokens <= n:
        raise EngineError("tokens", f"{tokens} not in 1..={n}")
    return cache_from_kv([(k[:, :, :tokens], v[:, :, :tokens]) for k, v in layer_kv(cache)])


def extended(cache: DynamicCache, tokens: int, kv: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A new cache: the first ``tokens`` tokens of ``cache`` followed by ``kv`` (per-layer ``[1, H, T, D]``).

    The warm regime's landing: the prefill's own prefix plus the fetched
    blocks after it, on the device. Raises ``EngineError("tokens", ...)``
    past the cache's length.
    """
    n = cache_len(cache)
    if not 0 <= tokens <= n:
        raise EngineError("tokens", f"{tokens} not in 0..={n}")
    own = layer_kv(cache)
    return cache_from_kv(
        [(torch.cat([k[:, :, :tokens], fk], 2), torch.cat([v[:, :, :tokens], fv], 2)) for (k, v), (fk, fv) in zip(own, kv)]
    )


def to_blocks(cache: DynamicCache, first_block: int, num_blocks: int, tokens_per_block: int) -> torch.Tensor:
    """Blocks ``first_block .. first_block + num_blocks`` of ``cache`` in block-major order.

    Returns a contiguous int16 tensor ``[num_blocks, L * 2 * B * H * D]`` (bf16 bits)
    on the cache's device. Raises ``EngineError("num_blocks", ...)`` when the
    cache holds fewer tokens.
    """
    lo, hi = first_block * tokens_per_block, (first_block + num_blocks) * tokens_per_block
    if num_blocks < 1 or hi > cache_len(cache):
        raise EngineError("num_blocks", f"blocks {first_block}..{first_block + num_blocks} exceed {cache_len(cache)} tokens")
    per_layer = []
    for k, v in layer_kv(cache):
        kv = torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]], 0)  # [2, H, n*B, D]
        per_layer.append(kv)
    x = torch.stack(per_layer, 0)  # [L, 2, H, n*B, D]
    L, _, H, _, D = x.shape
    x = x.view(L, 2, H, num_blocks, tokens_per_block, D).permute(3, 0, 1, 4, 2, 5)
    return x.contiguous().view(torch.int16).reshape(num_blocks, -1)


def from_blocks(rows: torch.Tensor, s: ModelShape, tokens_per_block: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`to_blocks`: int16 rows ``[n, elems]`` -> per-layer (K, V) ``[1, H, n*B, D]`` bf16.

    Raises ``EngineError("rows", ...)`` when the row width does not match the shape.
    """
    n = rows.shape[0]
    elems = s.num_layers * 2 * tokens_per_block * s.num_kv_heads * s.head_dim
    if rows.dim() != 2 or rows.shape[1] != elems:
        raise EngineError("rows", f"shape {tuple(rows.shape)}, expected (n, {elems})")
    x = rows.view(torch.bfloat16).view(n, s.num_layers, 2, tokens_per_block, s.num_kv_heads, s.head_dim)
    x = x.permute(1, 2, 4, 0, 3, 5).reshape(s.num_layers, 2, s.num_kv_heads, n * tokens_per_block, s.head_dim)
    return [(x[l, 0].unsqueeze(0).contiguous(), x[l, 1].unsqueeze(0).contiguous()) for l in range(s.num_layers)]


def block_checksums(rows: torch.Tensor, chunk: int = 16) -> List[int]:
    """Per-row position-weighted sum of the int16 values, as int64 (not cryptographic).

    Computed in chunks of ``chunk`` rows to bound the int64 temporary. A
    swapped, shifted or changed element changes the sum except by coincidence.
    """
    out: List[int] = []
    w = (torch.arange(rows.shape[1], device=rows.device, dtype=torch.int64) % 65521) + 1
    for i in range(0, rows.shape[0], chunk):
        part = rows[i : i + chunk].to(torch.int64)
        out.extend(int(x) for x in (part * w).sum(dim=1).tolist())
    return out


class Stopwatch:
    """Wall time in milliseconds between device-synchronised points, per named phase.

    Construction disables the garbage collector until :meth:`stop`: a
    collection inside a timed request would add tens of ms to one sample
    only (the jitter the H200 runs showed). It does not collect: a full
    collection walks every tracked object (transformers holds many) and the
    harness's client clock is already running; the untimed ``quiesce``
    request collects beforehand. The device is synchronised right before the
    clock starts and before every reading, so queued work of an earlier
    request is not billed to this one.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.phases: Dict[str, float] = {}  # phase name -> ms, in lap order
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        sync(device)
        self.t0 = time.perf_counter()
        self._last = self.t0

    def lap(self, name: str) -> float:
        """Ends phase ``name`` (added to it if repeated): its ms since the previous lap, device-synchronised."""
        sync(self.device)
        now = time.perf_counter()
        ms = (now - self._last) * 1e3
        self._last = now
        self.phases[name] = self.phases.get(name, 0.0) + ms
        return ms

    def ms(self) -> float:
        """Milliseconds since construction, after the device's queued work finished."""
        sync(self.device)
        return (time.perf_counter() - self.t0) * 1e3

    def stop(self) -> float:
        """:meth:`ms`, then the garbage collector is re-enabled (if it was on at construction)."""
        ms = self.ms()
        if self._gc_was_enabled:
            gc.enable()
        return ms
