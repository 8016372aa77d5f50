"""Reference engine: transformers' LlamaForCausalLM from a config, no download.

Two model shapes share all code: ``llama-3.1-8b`` (Llama-3.1-8B's published
geometry: 32 layers, 32 query heads, 8 KV heads, head dim 128, hidden 4096,
MLP 14336, vocabulary 128256, RoPE theta 500000) and ``tiny`` (2 layers, 2 KV
heads, head dim 16) for CPU tests. Weights are random (``torch.manual_seed``
then the model's own initialisation), bf16, attention through SDPA.

Two departures from transformers' stock generation path, both what a serving
engine does and both applied to every path alike (OFF, ON, ideal, the donor's
reference), measured on the H200 with ``xtask/gpu/engine_profile.py``
(256-token turn, 8B shape; record in docs/qualification/h200-s8/engine/):

- attention ``sdpa_lower_right`` (:func:`sdpa_lower_right`): one
  ``torch.nn.functional.scaled_dot_product_attention`` call per layer with
  PyTorch's lower-right causal bias and native GQA, so a turn on top of a
  cached history runs the flash kernel without a materialised mask and
  without expanding 8 KV heads to 32. transformers' stock SDPA path builds a
  bool mask and ``repeat_kv`` copies whenever query and key lengths differ:
  69.4 ms against 39.8 ms at 32K history (22.5 / 20.6 ms at 2K);
- cache :class:`PreallocCache`: per-layer key / value buffers of a fixed
  capacity written in place, attention reading views of the first n tokens.
  ``DynamicCache`` concatenates the whole history per layer per forward
  (39.8 against 30.7 ms at 32K with the attention above).

KV shapes: a cache layer holds keys and values of shape
``[1, kv_heads, tokens, head_dim]`` (views of ``[1, kv_heads, capacity,
head_dim]`` buffers). The bank's rows are block-major
(kv_descriptor ``TensorOrder::BlockMajor``): one block is
``[num_layers, 2 (K, V), tokens_per_block, kv_heads, head_dim]`` elements, bf16
carried as ``uint16`` (the wheel's ``Layout.typestr`` ``<u2``).
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

try:  # transformers >= 4.48 exports it; older releases only have the module-level registry
    from transformers import AttentionInterface as _AttentionInterface

    def _register_attention(name, fn):
        _AttentionInterface.register(name, fn)
except ImportError:  # pragma: no cover - old transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as _ALL

    def _register_attention(name, fn):
        _ALL[name] = fn

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - torch < 2.2
    causal_lower_right = None


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

    def weight_bytes(self) -> int:
        """Bytes of the bf16 weights :func:`build_model` creates (untied embeddings; Llama blocks)."""
        attn = self.hidden * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return 2 * (2 * self.vocab * self.hidden + self.num_layers * per_layer + self.hidden)


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


ATTENTION = "sdpa_lower_right"
"""The attention implementation :func:`build_model` selects (registered at import)."""


def sdpa_lower_right(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: causal SDPA aligned to the last key, native GQA.

    ``query`` ``[1, heads, q, head_dim]``, ``key`` / ``value`` ``[1, kv_heads, k, head_dim]``
    with ``k >= q`` (the last ``q`` keys are the query's own tokens). Returns
    ``([1, q, heads, head_dim], None)`` as transformers' attention functions do.
    Query ``i`` attends keys ``0 ..= k - q + i``: PyTorch's ``causal_lower_right``
    bias (``torch.nn.attention.bias``), which the flash backend takes without
    a mask tensor. Because the name is not one of transformers' mask
    implementations, the model builds no mask (``masking_utils``: custom
    attention needs none); a batch of one unpadded sequence is all this engine
    runs, so an ``attention_mask`` given anyway raises ``EngineError``.
    """
    if attention_mask is not None:
        raise EngineError("attention_mask", "sdpa_lower_right serves one unpadded sequence; got a mask")
    q_len, k_len = query.shape[2], key.shape[2]
    if k_len < q_len:
        raise EngineError("key", f"{k_len} keys for {q_len} queries")
    if q_len == k_len or q_len == 1:
        # Square: upper-left and lower-right alignment coincide. One query: it sees every key.
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=True)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q_len, k_len), scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


_register_attention(ATTENTION, sdpa_lower_right)


QUANTUM = 4096
"""Cache capacities are multiples of this many tokens (see :class:`PreallocCache`)."""


class PreallocLayer(DynamicLayer):
    """One layer's keys and values: views ``[1, kv_heads, capacity, head_dim]`` of its cache's arena.

    ``keys`` / ``values`` are views of the first ``n`` tokens; ``update``
    writes the new tokens in place and asks the owning :class:`PreallocCache`
    to grow when they do not fit.
    """

    def __init__(self, owner: "PreallocCache", index: int) -> None:
        super().__init__()
        # A weak reference: a strong one would make every cache a reference
        # cycle (cache -> layer -> cache), freed only by the garbage collector,
        # which the workers run only before timed requests; the decode worker
        # restoring a 4 GiB cache per turn ran an 80 GB card out of memory so.
        self.owner, self.index = weakref.proxy(owner), index
        self.n = 0
        self.kb: Optional[torch.Tensor] = None
        self.vb: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._publish()

    def _publish(self) -> None:
        if self.kb is None:
            self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
            self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        else:
            self.keys = self.kb[:, :, : self.n]
            self.values = self.vb[:, :, : self.n]

    def set_length(self, n: int) -> None:
        """Declares the first ``n`` tokens of the buffers the layer's content (after a direct landing)."""
        cap = 0 if self.kb is None else self.kb.shape[2]
        if not 0 <= n <= cap:
            raise EngineError("n", f"{n} not in 0..={cap} (capacity)")
        self.n = n
        self._publish()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = key_states.shape[-2]
        if self.kb is None or self.n + m > self.kb.shape[2]:
            self.owner.grow(self.n + m, key_states)
        self.kb[:, :, self.n : self.n + m].copy_(key_states)
        self.vb[:, :, self.n : self.n + m].copy_(value_states)
        self.n += m
        self._publish()
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.n

    def crop(self, tokens_to_remove: int) -> None:
        raise EngineError("crop", "PreallocCache is not cropped in place; use engine.cropped (a copy)")


class PreallocCache(DynamicCache):
    """A transformers cache over one arena ``[num_layers, 2, 1, kv_heads, capacity, head_dim]``.

    Each layer's keys / values are views of the arena, written in place and
    never concatenated. Why one arena with capacities rounded up to
    :data:`QUANTUM` tokens: on the H200 the serving workers' per-layer
    allocations of a different size every request (64 of them per prefill)
    added 30-80 ms to a full prefill inside the worker processes while the same
    code in a fresh process did not; one allocation of a size the caching
    allocator has seen before is served from its cache. Growth (past the
    capacity) reallocates the arena to ``needed + headroom`` rounded up and
    copies every layer's held tokens.

    ``capacity`` and ``like`` (a ``[1, kv_heads, *, head_dim]`` tensor giving
    heads, dtype and device) allocate at once, so an engine or a fetch landing
    can write tokens ``0 .. capacity`` into :meth:`buffers` and call
    :meth:`set_length`.
    """

    def __init__(self, num_layers: int, capacity: int = 0, like: Optional[torch.Tensor] = None, headroom: int = 512) -> None:
        super().__init__()
        self.headroom = headroom
        self.arena: Optional[torch.Tensor] = None
        # Set by :meth:`pin`: a fetch target maps the arena, so it must never move.
        self.pinned = False
        self.layers = [PreallocLayer(self, i) for i in range(num_layers)]
        if capacity:
            if like is None:
                raise EngineError("like", "needed to allocate a capacity")
            self.grow(capacity, like, exact=True)

    @classmethod
    def for_shape(cls, s: "ModelShape", capacity: int, device: str) -> "PreallocCache":
        """Buffers for ``capacity`` tokens (rounded up to :data:`QUANTUM`) of model shape ``s`` (bf16) on ``device``."""
        like = torch.empty((1, s.num_kv_heads, 0, s.head_dim), dtype=torch.bfloat16, device=device)
        return cls(s.num_layers, capacity, like)

    def grow(self, tokens: int, like: torch.Tensor, exact: bool = False) -> None:
        """Capacity for at least ``tokens`` tokens (plus the headroom unless ``exact``), rounded up to :data:`QUANTUM`."""
        if self.arena is not None and tokens <= self.arena.shape[4]:
            return
        if self.pinned:
            # A kv_reuse.Target holds device pointers into the arena: a new
            # arena would leave its next fetch writing into freed memory.
            raise EngineError("capacity", f"{tokens} tokens past the pinned arena's {self.capacity()}")
        want = tokens if exact else tokens + self.headroom
        cap = -(-want // QUANTUM) * QUANTUM
        arena = torch.empty((len(self.layers), 2, like.shape[0], like.shape[1], cap, like.shape[3]), dtype=like.dtype, device=like.device)
        for i, layer in enumerate(self.layers):
            if layer.n:
                arena[i, 0, :, :, : layer.n].copy_(layer.kb[:, :, : layer.n])
                arena[i, 1, :, :, : layer.n].copy_(layer.vb[:, :, : layer.n])
            layer.kb, layer.vb = arena[i, 0], arena[i, 1]
            layer.dtype, layer.device = like.dtype, like.device
            layer.is_initialized = True
            layer._publish()
        self.arena = arena

    def buffers(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the full-capacity (keys, values) views ``[1, kv_heads, capacity, head_dim]`` of the arena."""
        if self.arena is None:
            raise EngineError("capacity", "buffers are allocated by a capacity or the first update")
        return [(layer.kb, layer.vb) for layer in self.layers]

    def capacity(self) -> int:
        """Tokens every layer can hold without reallocating."""
        return 0 if self.arena is None else int(self.arena.shape[4])

    def reserve(self, tokens: int) -> None:
        """Capacity for ``tokens`` tokens in every layer (an allocated cache only)."""
        if self.arena is None:
            raise EngineError("capacity", "nothing allocated to grow")
        self.grow(tokens, self.layers[0].kb, exact=True)

    def set_length(self, n: int) -> None:
        """Declares the first ``n`` tokens of every layer's buffers the cache's content."""
        for layer in self.layers:
            layer.set_length(n)

    def pin(self) -> None:
        """Fixes the arena in place: growth past :meth:`capacity` then raises ``EngineError("capacity", ...)``.

        For a cache whose :meth:`buffers` a fetch target writes into
        (``transport.CacheLanding``); refuses an unallocated cache.
        """
        if self.arena is None:
            raise EngineError("capacity", "nothing allocated to pin")
        self.pinned = True


def load_prefix(dst: PreallocCache, src: DynamicCache, tokens: int, first: int = 0) -> None:
    """Copies tokens ``first .. tokens`` of ``src`` into ``dst``'s buffers, then ``dst`` holds ``tokens`` tokens.

    Tokens below ``first`` are ``dst``'s own (already there). The warm
    regime's prefill puts its own cached prefix under a pinned landing arena
    this way. Raises ``EngineError("tokens", ...)`` past ``src``'s length or
    ``dst``'s capacity.
    """
    if not 0 <= first <= tokens <= min(cache_len(src), dst.capacity()):
        raise EngineError("tokens", f"{first}..{tokens} not within {cache_len(src)} held and {dst.capacity()} capacity")
    for (kb, vb), (k, v) in zip(dst.buffers(), layer_kv(src)):
        kb[:, :, first:tokens].copy_(k[:, :, first:tokens])
        vb[:, :, first:tokens].copy_(v[:, :, first:tokens])
    dst.set_length(tokens)


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
    cfg._attn_implementation = ATTENTION
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


def export_weights(model: torch.nn.Module) -> bytes:
    """Every parameter of ``model`` as one blob another process can map (:func:`adopt_weights`).

    ``multiprocessing``'s pickler with torch's reductions: a CUDA tensor
    travels as a CUDA IPC handle to its storage, a CPU tensor as shared
    memory, so no weight byte is copied. The blob is opaque bytes, so a
    process that only forwards it (the harness) never maps a tensor or
    creates a CUDA context. The exporting process must keep ``model`` (and
    stay alive) while any process uses the adopted weights.
    """
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps({n: p.detach() for n, p in model.named_parameters()}))


def adopt_weights(model: torch.nn.Module, blob: bytes) -> int:
    """Replaces every parameter of ``model`` by the same-named tensor of ``blob`` (:func:`export_weights`).

    Both models must have the same parameter names, shapes, dtypes and
    device; anything else raises :class:`EngineError` naming ``weights``
    before a parameter is replaced. Returns the bytes of the parameters
    given up (freed once nothing else holds them; the caller empties the
    allocator's cache). Buffers (RoPE's ``inv_freq``) stay the model's own.
    """
    import pickle

    import torch.multiprocessing  # noqa: F401

    theirs = pickle.loads(blob)
    mine = dict(model.named_parameters())
    if set(theirs) != set(mine):
        raise EngineError("weights", f"parameter names differ: {sorted(set(theirs) ^ set(mine))[:4]}")
    for n, p in mine.items():
        t = theirs[n]
        if (t.shape, t.dtype, t.device) != (p.shape, p.dtype, p.device):
            raise EngineError("weights", f"{n}: {tuple(t.shape)} {t.dtype} on {t.device}, "
                                         f"this model has {tuple(p.shape)} {p.dtype} on {p.device}")
    freed = 0
    for n, p in mine.items():
        freed += p.numel() * p.element_size()
        p.data = theirs[n]
    return freed


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
    cache: DynamicCache  # a PreallocCache: every token's KV so far (history + this prefill's tokens)


@torch.inference_mode()
def prefill(model: LlamaForCausalLM, tokens: Sequence[int], cache: Optional[DynamicCache] = None,
            sw: Optional["Stopwatch"] = None, ids: Optional[torch.Tensor] = None, chunk: int = 0) -> PrefillResult:
    """Prefill ``tokens`` on top of ``cache`` (None: from scratch); greedy first token.

    Only the last position's logits are computed (``logits_to_keep=1``): a 32K
    prefill would otherwise materialise 32K x vocab logits. ``cache`` is
    extended in place. Raises ``EngineError("tokens", ...)`` when empty.
    ``sw``: when given, its ``forward`` lap ends after the forward pass (device
    synchronised) and its ``readback`` lap after the first token reached the
    host, so a timed request says which of the two its time went to.
    ``ids``: ``tokens`` already on the device (``[1, len(tokens)]`` long),
    uploaded earlier by a caller whose stream is about to wait on other work.
    Raises ``EngineError("ids", ...)`` when its shape does not match.
    ``chunk`` (tokens, 0: one pass): a chunked prefill, every chunk's forward
    on top of the previous chunks' KV, so activations scale with ``chunk``
    instead of ``len(tokens)`` (a 32K one-pass prefill of the 8B shape peaks
    at ~13 GiB). The KV equals a one-pass prefill's only up to rounding; the
    decode worker uses it (untimed) to fit both workers on one 80 GB card.
    Raises ``EngineError("chunk", ...)`` when negative or given with ``sw``.
    """
    if len(tokens) == 0:
        raise EngineError("tokens", "a prefill needs at least one token")
    if chunk < 0 or (chunk and sw is not None):
        raise EngineError("chunk", f"{chunk}: a chunk is >= 0 tokens and never timed")
    dev = model.device
    if ids is None:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=dev)
    elif tuple(ids.shape) != (1, len(tokens)):
        raise EngineError("ids", f"shape {tuple(ids.shape)}, expected (1, {len(tokens)})")
    if cache is None:
        cache = PreallocCache(model.config.num_hidden_layers)
    if chunk and len(tokens) > chunk:
        last = (len(tokens) - 1) // chunk * chunk
        for lo in range(0, last, chunk):
            cache = model(input_ids=ids[:, lo : lo + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values
        ids = ids[:, last:]
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


def cache_from_kv(kv: Sequence[Tuple[torch.Tensor, torch.Tensor]], headroom: int = 1024) -> PreallocCache:
    """A :class:`PreallocCache` holding a copy of ``kv`` (per-layer keys, values ``[1, H, T, D]``).

    Capacity ``T + headroom`` tokens, so the turn prefilled next writes in place.
    """
    if len(kv) == 0:
        raise EngineError("kv", "no layers")
    t = kv[0][0].shape[2]
    cache = PreallocCache(len(kv), t + headroom, kv[0][0])
    for layer, (k, v) in zip(cache.layers, kv):
        layer.kb[:, :, :t].copy_(k)
        layer.vb[:, :, :t].copy_(v)
    cache.set_length(t)
    return cache


def cache_from_blocks(rows: torch.Tensor, s: ModelShape, tokens_per_block: int, headroom: int = 1024) -> PreallocCache:
    """Block-major int16 rows ``[n, L * 2 * B * H * D]`` (:func:`to_blocks`' order) -> a cache of their ``n * B`` tokens.

    One strided copy per layer and K / V straight into the cache's buffers
    (no intermediate per-layer tensors, no concatenation): the landing of a
    fetch into the engine's cache when the transfer wrote block-major rows.
    Raises ``EngineError("rows", ...)`` when the row width does not match.
    """
    n = rows.shape[0]
    elems = s.num_layers * 2 * tokens_per_block * s.num_kv_heads * s.head_dim
    if rows.dim() != 2 or rows.shape[1] != elems:
        raise EngineError("rows", f"shape {tuple(rows.shape)}, expected (n, {elems})")
    t = n * tokens_per_block
    cache = PreallocCache.for_shape(s, t + headroom, str(rows.device))
    x = rows.view(torch.bfloat16).view(n, s.num_layers, 2, tokens_per_block, s.num_kv_heads, s.head_dim)
    for l, (kb, vb) in enumerate(cache.buffers()):
        for j, buf in enumerate((kb, vb)):
            # buf[0, :, :t] is [H, n*B, D]; viewed [H, n, B, D] it takes x[:, l, j] ([n, B, H, D]) permuted.
            buf[0, :, :t].view(s.num_kv_heads, n, tokens_per_block, s.head_dim).copy_(x[:, l, j].permute(2, 0, 1, 3))
    cache.set_length(t)
    return cache


def cropped(cache: DynamicCache, tokens: int) -> DynamicCache:
    """A new cache with the first ``tokens`` tokens of ``cache``; ``cache`` is untouched.

    Raises ``EngineError("tokens", ...)`` past the cache's length.
    """
    n = cache_len(cache)
    if not 0 < tokens <= n:
        raise EngineError("tokens", f"{tokens} not in 1..={n}")
    return cache_from_kv([(k[:, :, :tokens], v[:, :, :tokens]) for k, v in layer_kv(cache)])


class HostCopy:
    """A cache's first ``tokens`` tokens in host memory, one ``[L, 2, 1, H, capacity, D]`` tensor.

    The decode worker's ``decode_cache="host"`` keeps each idle session's KV
    here instead of on the device (restored for the session's next turn or a
    reference request; untimed), so the card holds one session's KV beside
    the bank rather than every session's twice. :meth:`update` reuses the
    buffer while it is large enough. Pinned host memory when the cache is on a
    CUDA device (faster copies both ways).
    """

    def __init__(self) -> None:
        self.buf: Optional[torch.Tensor] = None
        self.tokens = 0

    def update(self, cache: DynamicCache, headroom: int = 2048) -> None:
        """Copies every token of ``cache`` here (layer by layer: one layer's temporary at a time)."""
        kv = layer_kv(cache)
        t = cache_len(cache)
        k0 = kv[0][0]
        if self.buf is None or self.buf.shape[4] < t or self.buf.shape[3] != k0.shape[1]:
            shape = (len(kv), 2, 1, k0.shape[1], t + headroom, k0.shape[3])
            self.buf = torch.empty(shape, dtype=k0.dtype, pin_memory=k0.is_cuda)
        for l, (k, v) in enumerate(kv):
            self.buf[l, 0, :, :, :t].copy_(k[:, :, :t])
            self.buf[l, 1, :, :, :t].copy_(v[:, :, :t])
        self.tokens = t

    def restore(self, tokens: int, capacity: int, device: str) -> PreallocCache:
        """A device cache of capacity ``>= capacity`` holding the first ``tokens`` tokens kept here.

        Raises ``EngineError("tokens", ...)`` past what is kept or past ``capacity``.
        """
        if self.buf is None or not 0 < tokens <= min(self.tokens, capacity):
            raise EngineError("tokens", f"{tokens} not in 1..={min(self.tokens, capacity)} (kept {self.tokens})")
        like = torch.empty((1, self.buf.shape[3], 0, self.buf.shape[5]), dtype=self.buf.dtype, device=device)
        cache = PreallocCache(self.buf.shape[0], capacity, like)
        for l, (kb, vb) in enumerate(cache.buffers()):
            kb[:, :, :tokens].copy_(self.buf[l, 0, :, :, :tokens])
            vb[:, :, :tokens].copy_(self.buf[l, 1, :, :, :tokens])
        cache.set_length(tokens)
        return cache


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
    f = kv[0][0].shape[2]
    out = PreallocCache(len(own), tokens + f + 1024, kv[0][0])
    for layer, (k, v), (fk, fv) in zip(out.layers, own, kv):
        layer.kb[:, :, :tokens].copy_(k[:, :, :tokens])
        layer.vb[:, :, :tokens].copy_(v[:, :, :tokens])
        layer.kb[:, :, tokens : tokens + f].copy_(fk)
        layer.vb[:, :, tokens : tokens + f].copy_(fv)
    out.set_length(tokens + f)
    return out


def to_blocks(cache: DynamicCache, first_block: int, num_blocks: int, tokens_per_block: int) -> torch.Tensor:
    """Blocks ``first_block .. first_block + num_blocks`` of ``cache`` in block-major order.

    Returns a contiguous int16 tensor ``[num_blocks, L * 2 * B * H * D]`` (bf16 bits)
    on the cache's device. Raises ``EngineError("num_blocks", ...)`` when the
    cache holds fewer tokens. One allocation of the result and one strided
    copy per layer and K / V into it: no intermediate stacks, so a 30K-token
    retain needs its result's 3.8 GiB (8B shape) and nothing more (an 80 GB
    card holding both workers has no room for three copies).
    """
    lo, hi = first_block * tokens_per_block, (first_block + num_blocks) * tokens_per_block
    if num_blocks < 1 or hi > cache_len(cache):
        raise EngineError("num_blocks", f"blocks {first_block}..{first_block + num_blocks} exceed {cache_len(cache)} tokens")
    kv = layer_kv(cache)
    H, D = kv[0][0].shape[1], kv[0][0].shape[3]
    out = torch.empty((num_blocks, len(kv), 2, tokens_per_block, H, D), dtype=kv[0][0].dtype, device=kv[0][0].device)
    for l, pair in enumerate(kv):
        for j, t in enumerate(pair):
            # t[0, :, lo:hi] is [H, n*B, D]; viewed [H, n, B, D] and permuted it is out[:, l, j] ([n, B, H, D]).
            out[:, l, j].copy_(t[0, :, lo:hi].view(H, num_blocks, tokens_per_block, D).permute(1, 2, 0, 3))
    return out.view(torch.int16).reshape(num_blocks, -1)


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

    def mark(self, name: str) -> float:
        """Ends phase ``name`` like :meth:`lap` on the host clock only (no device sync): queued work
        (a fetch's copies in flight) goes on and is billed to the next synchronised lap."""
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
