"""Prefill cost per token of a Llama-3.1-8B-shaped model on the local GPU.

Random bf16 weights (the cost of a forward pass does not depend on the values), batch 1,
PyTorch SDPA attention through Hugging Face transformers' LlamaForCausalLM. Prints one JSON
object: per prompt length the median of 5 timed forward passes (after 2 warm-ups), and µs/token,
plus the model's KV bytes per token (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB).

Run on the lent GPU machine: `python3 xtask/gpu/prefill_cost.py > prefill.json`.
"""
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

LENGTHS = [int(x) for x in (sys.argv[1].split(",") if len(sys.argv) > 1 else "512,2048,8192,16384".split(","))]

cfg = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rope_theta=500000.0, torch_dtype="bfloat16", attn_implementation="sdpa",
)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg)
model.eval()

rows = []
with torch.inference_mode():
    for n in LENGTHS:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        for _ in range(2):
            model(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        rows.append({"tokens": n, "prefill_ms": round(ms, 3), "us_per_token": round(ms * 1e3 / n, 3)})

# KV bytes per token: 2 (K,V) x layers x kv_heads x head_dim x 2 bytes
kv_token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
print(json.dumps({
    "model": "Llama-3.1-8B shape, random bf16 weights",
    "framework": f"torch {torch.__version__}, transformers {transformers.__version__}, SDPA",
    "gpu": torch.cuda.get_device_name(0),
    "kv_bytes_per_token": kv_token_bytes,
    "rows": rows,
}))
