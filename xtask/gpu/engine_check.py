"""Full prefill (OFF) and suffix prefill through gpu_serving.engine itself, attention and cache swapped.

Companion of engine_profile.py for the question it left open: after the engine
switched to ``sdpa_lower_right`` + ``PreallocCache``, gpu_serving's OFF rows got
~60-80 ms slower at every history. This times ``engine.prefill`` of a whole
prompt (H + 256 tokens) and of a 256-token turn on ``engine.cache_from_blocks``
rows, for attention in {stock ``sdpa``, ``sdpa_lower_right``} x cache in
{DynamicCache, PreallocCache}, and which SDPA backends accept the square
``is_causal`` + ``enable_gqa`` call. Run:
``python3 xtask/gpu/engine_check.py OUTDIR`` (set PYTORCH_CUDA_ALLOC_CONF as the
workers do to compare allocators).
"""
import json
import os
import statistics
import sys
import time
import traceback

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kv-testkit", "python"))
from gpu_serving import engine  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
TAG = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default") or "default"
res = {"alloc_conf": TAG, "rows": [], "backends": {}, "errors": []}
s = engine.shape("llama-3.1-8b")
model = engine.build_model("llama-3.1-8b", "cuda:0")
gen = torch.Generator().manual_seed(2)


def ms(fn, reps=5):
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 2), round(min(out), 2), round(max(out), 2)


def _dyn(rows):
    c = transformers.DynamicCache()
    for i, (k, v) in enumerate(engine.from_blocks(rows, s, 64)):
        c.update(k, v, i)
    return c


with torch.inference_mode():
    # Which backends take the square causal GQA call (OFF's attention).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]:
        for gqa in (True, False):
            kk = k if gqa else k.repeat_interleave(4, 1)
            try:
                with sdpa_kernel([be]):
                    t = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, kk, is_causal=True, enable_gqa=gqa))
                res["backends"][f"{name}_gqa{gqa}"] = t
            except Exception as e:
                res["backends"][f"{name}_gqa{gqa}"] = str(e)[:200]
    t = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    res["backends"]["auto_gqaTrue"] = t
    t = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), k.repeat_interleave(4, 1), is_causal=True))
    res["backends"]["auto_repeat"] = t
    print(res["backends"], flush=True)

    for H in [int(x) for x in os.environ.get("HISTORIES", "2048,8192").split(",")]:
        ids = torch.randint(0, 128256, (H + 256,), generator=gen).tolist()
        hist = engine.prefill(model, ids[:H]).cache
        rows = engine.to_blocks(hist, 0, H // 64, 64)
        del hist
        for attn in ["sdpa", engine.ATTENTION]:
            model.config._attn_implementation = attn
            for cache in ["dynamic", "prealloc"]:
                try:
                    mk = (lambda: transformers.DynamicCache()) if cache == "dynamic" else (lambda: engine.PreallocCache(s.num_layers))
                    off = ms(lambda: engine.prefill(model, ids, mk()))
                    if cache == "prealloc":
                        turn = ms(lambda: engine.prefill(model, ids[H:], engine.cache_from_blocks(rows, s, 64)))
                    else:
                        turn = ms(lambda: engine.prefill(model, ids[H:], _dyn(rows)))
                    row = {"history": H, "attention": attn, "cache": cache, "off_ms": off, "turn_ms_incl_landing": turn}
                    res["rows"].append(row)
                    print(row, flush=True)
                except Exception:
                    res["errors"].append(traceback.format_exc()[-1500:])
                    print(traceback.format_exc()[-800:], flush=True)
        model.config._attn_implementation = engine.ATTENTION
        torch.cuda.empty_cache()


with open(os.path.join(OUT, f"engine_check_{TAG.replace(':', '_')}.json"), "w") as f:
    json.dump(res, f, indent=1)
