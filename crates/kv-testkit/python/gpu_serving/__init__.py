"""Reference engines and the `gpu_serving` qualification harness.

Modules:

- ``engine``: transformers' ``LlamaForCausalLM`` built from a config (no weight
  download, seeded random weights, SDPA), prefill / suffix prefill / greedy
  decode, and the KV re-layout between a ``DynamicCache`` and the bank's
  block-major rows.
- ``decode_worker``: the decode worker process (the donor: retains prompt +
  output KV blocks in a ``kv_reuse.DonorBank``).
- ``prefill_worker``: the prefill worker process (the target: OFF full prefill,
  ON fetch + suffix prefill, ideal suffix prefill on resident KV).
- ``workload``: the multi-turn sessions and the history buckets.
- ``harness``: drives both workers and an in-process ``kv_reuse.Router``,
  writes the ``gpu_serving`` JSON (docs/gpu-serving.md).

torch and transformers are imported lazily by ``engine``; ``harness`` prints
``SKIP gpu_serving: ...`` and exits 0 when they cannot be imported.
"""
