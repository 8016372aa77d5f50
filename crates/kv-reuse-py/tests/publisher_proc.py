"""A decode worker that publishes on NATS, in its own process, for the
router-service tests (test_publisher.py).

argv: nats_url, socket path, tokens_per_block, blocks, tp, and optionally
the NATS keywords as JSON (credentials, TLS files). Opens a
`WorkerPublisher.donor`, stores `blocks` blocks of tokens 0.. (rank r of
block b = `pattern(layout, r, b)`), publishes their events, prints one JSON
line (engine id, pin endpoint, the manifest as hex), then keeps publishing
until stdin closes, closes the publisher (record deleted) and prints
`{"closed": true}`."""

import json
import sys

import numpy as np

import kv_reuse


def pattern(layout, rank, block):
    """Distinct float values for rank `rank`'s part of block `block`."""
    base = np.arange(layout.rank_block_elems, dtype=np.float32)
    return base + np.float32(1000 * block + 100000 * rank)


def main():
    url, sock = sys.argv[1], sys.argv[2]
    tpb, blocks, tp = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    nats = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    layout = kv_reuse.Layout(2, 2, 8, "f32", tpb, tp)
    pub = kv_reuse.WorkerPublisher.donor(url, "decode-py", layout, blocks + 2, "unix:" + sock,
                                         lease_s=5.0, announce_period_s=0.2, **nats)
    with pub:
        bank = pub.bank
        tokens = list(range(tpb * blocks))
        store = bank.store(tokens)
        for rank in range(tp):
            store.write(rank, np.stack([pattern(layout, rank, b) for b in range(blocks)]))
        ready = [store.ack(rank) for rank in range(tp)]
        published = pub.publish_events()
        print(json.dumps({"ready": ready, "published": published, "engine_id": pub.engine_id,
                          "role": pub.role, "endpoint": pub.pin_endpoint,
                          "manifest": bank.manifest().hex()}), flush=True)
        sys.stdin.read()
    print(json.dumps({"closed": not pub.open}), flush=True)


if __name__ == "__main__":
    main()
