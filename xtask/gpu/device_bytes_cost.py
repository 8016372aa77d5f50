"""What one ``torch.cuda.memory_allocated`` read costs on the host (issue 21, first turns).

gpu_serving's prefill worker read it twice inside each timed ON request (device memory
before / after) and never in OFF. It builds the caching allocator's whole statistics dict
and flattens it in Python. Prints the p50 / p90 µs of a read with an empty allocator and
after a few thousand live allocations, under gpu_serving's allocator setting
(``expandable_segments:True``). Needs torch and a CUDA device; prints one JSON line.

    python3 xtask/gpu/device_bytes_cost.py
"""

import json
import os
import statistics
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402


def cost_us(n: int = 300) -> dict:
    dev = "cuda:0"
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        torch.cuda.memory_allocated(dev)
        xs.append((time.perf_counter() - t0) * 1e6)
    xs.sort()
    return {"p50_us": round(statistics.median(xs), 1), "p90_us": round(xs[int(0.9 * len(xs))], 1)}


def main() -> None:
    torch.cuda.init()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "empty": cost_us()}
    live = [torch.empty(((i % 97) + 1) * 4096, dtype=torch.uint8, device="cuda:0") for i in range(4000)]
    out["live_4000"] = cost_us()
    out["live_bytes"] = torch.cuda.memory_allocated("cuda:0")
    del live
    print(json.dumps(out))


if __name__ == "__main__":
    main()
