"""A donor (decode worker) in its own process for the round-trip tests.

argv: socket path, tokens_per_block, blocks, tp[, "cuda" for a bank in
device memory on GPU 0 (every rank), exported over CUDA IPC, filled from
numpy rows (host-to-device); "cuda-torch" for the same bank filled from
torch CUDA tensors on GPU 0 (device to device)]. Prints one JSON line with
the engine id, manifest, events, slot table (bytes as hex) and the bank's
stats, then serves pins until stdin closes or says `quit`; answers `pins`
with the pins held now and `taken` with the pins taken so far (one JSON
line each)."""

import json
import sys

import numpy as np

import kv_reuse


def pattern(layout, rank, block):
    """Distinct float values for rank `rank`'s part of block `block`."""
    base = np.arange(layout.rank_block_elems, dtype=np.float32)
    return base + np.float32(1000 * block + 100000 * rank)


def main():
    sock, tpb, blocks, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    layout = kv_reuse.Layout(2, 2, 8, "f32", tpb, tp)
    mode = sys.argv[5] if len(sys.argv) > 5 else "host"
    gpus = [0] * tp if mode in ("cuda", "cuda-torch") else None
    # A 2 s lease: the tests reclaim a killed donor's segments within ~2 s
    # (renewed every 0.4 s, so a loaded machine does not lapse it).
    bank = kv_reuse.DonorBank(layout, slots=blocks + 2, gpus=gpus, lease_s=2.0)
    tokens = list(range(tpb * blocks))
    # "cuda-torch" stores the first half first, then the whole prompt: the
    # second store writes only the blocks the bank lacks (its
    # sequence_hashes), so every byte landing at its block is checked too.
    halves = [blocks // 2, blocks] if mode == "cuda-torch" else [blocks]
    held = 0
    for upto in halves:
        store = bank.store(tokens[: tpb * upto])
        assert store.already_retained == held, (store.already_retained, held)
        for rank in range(tp):
            rows = np.stack([pattern(layout, rank, b) for b in range(held, upto)])
            if mode == "cuda-torch":
                import torch

                # The engine's KV on its GPU: the store copies device to device.
                rows = torch.from_numpy(rows).to("cuda:0")
            store.write(rank, rows)
        ready = [store.ack(rank) for rank in range(tp)]
        held = upto
    with bank.serve_pins("unix:" + sock) as server:
        hashes = kv_reuse.sequence_hashes(tokens, tpb)
        print(
            json.dumps(
                {
                    "ready": ready,
                    "engine_id": bank.engine_id,
                    "endpoint": server.endpoint,
                    "manifest": bank.manifest().hex(),
                    "events": [e.hex() for e in bank.drain_events()],
                    "slots": {str(h): s for h, s in zip(hashes, bank.slots(hashes))},
                    "hashes": hashes,
                    "stats": bank.stats,
                }
            ),
            flush=True,
        )
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            if line.strip() == "pins":
                print(json.dumps({"pins": bank.pins_outstanding}), flush=True)
            if line.strip() == "taken":
                print(json.dumps({"taken": bank.stats["pins"]}), flush=True)


if __name__ == "__main__":
    main()
