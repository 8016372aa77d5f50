"""Where the reference engine's suffix prefill spends its time, on the local GPU.

gpu_serving's ON and ideal paths both run a 256-token prefill on top of a long
history's KV. This script times that forward at 2K / 8K / 16K / 32K history for
several attention and cache variants of the same transformers LlamaForCausalLM
(Llama-3.1-8B shape, random bf16 weights), with the full prefill (OFF) beside
them, and records which variants agree with the stock SDPA path:

- attention ``hf_sdpa``: transformers' own SDPA path (bool mask, GQA expanded
  by ``repeat_kv`` when a mask is present);
- ``lr_gqa``: ``F.scaled_dot_product_attention`` with PyTorch's
  ``causal_lower_right`` bias and ``enable_gqa=True`` (no mask tensor, no
  expanded K/V);
- ``lr_rep``: the same bias with K/V expanded to the query heads;
- ``bool_gqa``: an explicit lower-right bool mask with ``enable_gqa=True``;
- cache ``dynamic``: ``DynamicCache`` (``torch.cat`` of the whole history per
  layer per forward) vs ``prealloc``: per-layer buffers of fixed capacity
  written in place, views of the first n tokens handed to attention.

Run on the lent GPU machine from the repository root:
``python3 xtask/gpu/engine_profile.py OUTDIR``. Writes OUTDIR/engine_profile.json,
profiler tables and copies of the transformers sources that decide the path.
"""
import json
import os
import shutil
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kv-testkit", "python"))
from gpu_serving import engine  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(os.path.join(OUT, "src"), exist_ok=True)
HISTORIES = [int(x) for x in os.environ.get("HISTORIES", "2048,8192,16384,32768").split(",")]
SUFFIX = 256
REPS = 5
res = {"torch": torch.__version__, "transformers": transformers.__version__,
       "gpu": torch.cuda.get_device_name(0), "errors": [], "rows": []}


def note_error(what):
    res["errors"].append({"what": what, "trace": traceback.format_exc()[-3000:]})
    print("ERROR", what, traceback.format_exc()[-800:], flush=True)


# Sources that decide the attention path, for reading afterwards.
for modname in ["transformers.integrations.sdpa_attention", "transformers.masking_utils",
                "transformers.cache_utils", "transformers.models.llama.modeling_llama",
                "transformers.modeling_utils"]:
    try:
        mod = __import__(modname, fromlist=["x"])
        shutil.copy(mod.__file__, os.path.join(OUT, "src", modname.split(".")[-1] + ".py"))
    except Exception:
        note_error(f"copy {modname}")

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

try:
    from torch.nn.attention.bias import causal_lower_right
except Exception:
    causal_lower_right = None
    note_error("import causal_lower_right")

ORIG_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]


def attn_fn(mode):
    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        q_len, k_len = query.shape[2], key.shape[2]
        groups = query.shape[1] // key.shape[1]
        if mode == "lr_gqa":
            if q_len == k_len:
                o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, k_len),
                                                   scale=scaling, enable_gqa=True)
        elif mode == "lr_rep":
            k = key.repeat_interleave(groups, dim=1)
            v = value.repeat_interleave(groups, dim=1)
            if q_len == k_len:
                o = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
            else:
                o = F.scaled_dot_product_attention(query, k, v, attn_mask=causal_lower_right(q_len, k_len), scale=scaling)
        elif mode == "bool_gqa":
            i = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
            j = torch.arange(k_len, device=query.device)[None, :]
            o = F.scaled_dot_product_attention(query, key, value, attn_mask=(j <= i), scale=scaling, enable_gqa=True)
        else:
            raise ValueError(mode)
        return o.transpose(1, 2).contiguous(), None
    return fn


def set_attention(mode):
    ALL_ATTENTION_FUNCTIONS["sdpa"] = ORIG_SDPA if mode == "hf_sdpa" else attn_fn(mode)


class PreLayer(transformers.cache_utils.DynamicLayer):
    """Fixed-capacity per-layer K/V written in place; attention sees views of the first n tokens."""

    def __init__(self, k, v, cap):
        super().__init__()
        shape = (k.shape[0], k.shape[1], cap, k.shape[3])
        self.kb = torch.empty(shape, dtype=k.dtype, device=k.device)
        self.vb = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.n = k.shape[2]
        self.kb[:, :, : self.n].copy_(k)
        self.vb[:, :, : self.n].copy_(v)
        self.dtype, self.device = k.dtype, k.device
        self.is_initialized = True
        self._views()

    def _views(self):
        self.keys = self.kb[:, :, : self.n]
        self.values = self.vb[:, :, : self.n]

    def lazy_initialization(self, *a, **k):
        pass

    def update(self, key_states, value_states, cache_kwargs=None):
        m = key_states.shape[2]
        self.kb[:, :, self.n : self.n + m].copy_(key_states)
        self.vb[:, :, self.n : self.n + m].copy_(value_states)
        self.n += m
        self._views()
        return self.keys, self.values

    def get_seq_length(self, *a, **k):
        return self.n


def fresh_cache(hist, kind, cap):
    if kind == "dynamic":
        return engine.cropped(hist, engine.cache_len(hist))
    c = transformers.DynamicCache()
    c.layers = [PreLayer(k, v, cap) for k, v in engine.layer_kv(hist)]
    return c


def timed_forward(model, ids, cache):
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    e1.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return wall, e0.elapsed_time(e1), out.logits[0, -1].float()


model = engine.build_model("llama-3.1-8b", "cuda:0")
gen = torch.Generator().manual_seed(1)
with torch.inference_mode():
    # Launch-bound floor: the turn with no history, stock path.
    set_attention("hf_sdpa")
    ids = torch.randint(0, 128256, (1, SUFFIX), generator=gen).cuda()
    for _ in range(2):
        timed_forward(model, ids, None)
    walls, gpus = [], []
    for _ in range(REPS):
        w, g, _ = timed_forward(model, ids, None)
        walls.append(w)
        gpus.append(g)
    res["no_history"] = {"wall_ms": statistics.median(walls), "gpu_ms": statistics.median(gpus)}
    print("no_history", res["no_history"], flush=True)

    for H in HISTORIES:
        hist_ids = torch.randint(0, 128256, (1, H), generator=gen).cuda()
        suf = torch.randint(0, 128256, (1, SUFFIX), generator=gen).cuda()
        full = torch.cat([hist_ids, suf], 1)
        set_attention("hf_sdpa")
        offs = []
        for _ in range(3):
            w, g, _ = timed_forward(model, full, transformers.DynamicCache())
            offs.append((w, g))
        row = {"history": H, "off_wall_ms": statistics.median(x[0] for x in offs),
               "off_gpu_ms": statistics.median(x[1] for x in offs), "variants": []}
        hist = model(input_ids=hist_ids, past_key_values=transformers.DynamicCache(), use_cache=True,
                     logits_to_keep=1).past_key_values
        ref = None
        for mode in ["hf_sdpa", "lr_gqa", "lr_rep", "bool_gqa"]:
            for kind in ["dynamic", "prealloc"]:
                try:
                    set_attention(mode)
                    walls, gpus = [], []
                    for r in range(REPS + 1):
                        c = fresh_cache(hist, kind, H + 2 * SUFFIX)
                        w, g, logits = timed_forward(model, suf, c)
                        if r:
                            walls.append(w)
                            gpus.append(g)
                        del c
                    if ref is None:
                        ref = logits
                    v = {"attention": mode, "cache": kind, "wall_ms": statistics.median(walls),
                         "wall_min_ms": min(walls), "gpu_ms": statistics.median(gpus),
                         "max_abs_logit_diff_vs_hf_dynamic": float((logits - ref).abs().max()),
                         "argmax_equal": bool(int(logits.argmax()) == int(ref.argmax()))}
                    row["variants"].append(v)
                    print(H, v, flush=True)
                except Exception:
                    note_error(f"H={H} {mode} {kind}")
            torch.cuda.empty_cache()
        # Which SDPA backend takes the lower-right bias with GQA: force flash only.
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            set_attention("lr_gqa")
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                w, g, _ = timed_forward(model, suf, fresh_cache(hist, "prealloc", H + 2 * SUFFIX))
            row["lr_gqa_flash_only"] = {"wall_ms": w, "gpu_ms": g}
        except Exception as e:
            row["lr_gqa_flash_only"] = {"error": str(e)[:500]}
        # Profiler tables at the longest history: stock vs the lower-right GQA path.
        if H == HISTORIES[-1]:
            for mode in ["hf_sdpa", "lr_gqa"]:
                try:
                    set_attention(mode)
                    c = fresh_cache(hist, "prealloc" if mode != "hf_sdpa" else "dynamic", H + 2 * SUFFIX)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        timed_forward(model, suf, c)
                    with open(os.path.join(OUT, f"profile_{mode}_{H}.txt"), "w") as f:
                        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
                except Exception:
                    note_error(f"profile {mode}")
        res["rows"].append(row)
        del hist, full
        torch.cuda.empty_cache()
        with open(os.path.join(OUT, "engine_profile.json"), "w") as f:
            json.dump(res, f, indent=1)

with open(os.path.join(OUT, "engine_profile.json"), "w") as f:
    json.dump(res, f, indent=1)
print("done", flush=True)
