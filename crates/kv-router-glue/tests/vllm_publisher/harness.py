"""Runs vLLM's own `ZmqEventPublisher` (vllm/distributed/kv_events.py, taken
unmodified from a vLLM wheel) over a simulated prefix cache, for the
kv-router-glue interop tests.

    python harness.py sandbox WHEEL DIR   # extract kv_events.py + stubs into DIR
    python harness.py serve DIR SEED      # run the publisher; commands on stdin
    python harness.py record DIR OUT.json # capture frames for committed test data

Only `vllm/distributed/kv_events.py` and `vllm/config/kv_events.py` come from
the wheel. The modules they import that would pull in torch (the package
`__init__`s, `vllm.config.utils`, `vllm.logger`, `vllm.utils.network_utils`,
`vllm.v1.core.kv_cache_utils`) are replaced by the few names kv_events.py uses.

`serve` binds PUB and ROUTER replay sockets on free localhost ports, prints
`ENDPOINTS <pub> <replay>`, then obeys one command per stdin line, answering
each with one `OK ...` line:
- `steps N`: N scheduler steps; each step admits one request over a shared
  16-token-block prefix (random length), stores its new full blocks
  (`BlockStored`, chained by `parent_block_hash`) and evicts LRU blocks past
  the capacity (`BlockRemoved`), published as one `KVEventBatch`;
- `hybrid N`: like `steps` but a second KV cache group (sliding window,
  `group_idx` 1) stores the same blocks and removes all but the last 2 of
  every request (and what the cache evicts); the full-attention group (0)
  keeps them until evicted;
- `bytes N`: like `steps`, block hashes published as 32-byte digests;
- `clear`: one `AllBlocksCleared` batch;
- `restart`: shuts the publisher down and starts a new one on the same
  endpoints (its seq starts again at 0; the cache is empty);
- `inventory`: `OK <json>`: every cached block as `[token_ids of its whole
  prefix]` (what an index of this engine must hold);
- `seq`: `OK <next seq>`.
"""

import hashlib
import json
import os
import random
import sys
import time
import zipfile

FROM_WHEEL = ("vllm/distributed/kv_events.py", "vllm/config/kv_events.py")

STUBS = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/utils/__init__.py": "",
    # pydantic dataclass decorator in vLLM; a plain dataclass is enough here.
    "vllm/config/utils.py": "from dataclasses import dataclass as config\n",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/utils/network_utils.py": (
        "def get_ip():\n    return '127.0.0.1'\n\n"
        "def get_tcp_uri(ip, port):\n    return f'tcp://{ip}:{port}'\n\n"
        "def is_valid_ipv6_address(ip):\n    return ':' in ip\n\n"
        "def split_zmq_path(path):\n"
        "    scheme, rest = path.split('://', 1)\n"
        "    host, _, port = rest.rpartition(':')\n"
        "    return scheme, host, port\n"
    ),
    "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
}


def sandbox(wheel, out):
    with zipfile.ZipFile(wheel) as z:
        for name in FROM_WHEEL:
            dest = os.path.join(out, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(z.read(name))
    for name, text in STUBS.items():
        dest = os.path.join(out, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "w") as f:
            f.write(text)


BS = 16
CAPACITY = 600


class Cache:
    """LRU prefix cache of full 16-token blocks, named like vLLM names them
    (SHA-256 over parent digest, tokens and extra keys)."""

    def __init__(self, rng):
        self.rng = rng
        self.blocks = {}  # digest -> (parent digest, tokens of the prefix)
        self.lru = []  # digests, oldest first
        # A few long shared prefixes; requests take a random number of their blocks.
        self.prefixes = [
            [rng.randrange(32000) for _ in range(BS * 48)] for _ in range(40)
        ]

    def step(self, mk, group_idx=None):
        prefix = self.rng.choice(self.prefixes)
        n = self.rng.randrange(1, len(prefix) // BS + 1)
        parent = None
        new, new_tokens, first_parent = [], [], None
        for k in range(n):
            tokens = prefix[: (k + 1) * BS]
            digest = hashlib.sha256(
                repr((parent, tuple(tokens[-BS:]), None)).encode()
            ).digest()
            if digest in self.blocks:
                self.lru.remove(digest)
            else:
                if not new:
                    first_parent = parent
                elif parent != new[-1]:
                    break  # keep one chained run per event
                self.blocks[digest] = (parent, tokens)
                new.append(digest)
                new_tokens.extend(tokens[-BS:])
            self.lru.append(digest)
            parent = digest
        events = []
        if new:
            events.append(
                mk.BlockStored(
                    block_hashes=[mk.name(d) for d in new],
                    parent_block_hash=None if first_parent is None else mk.name(first_parent),
                    token_ids=new_tokens,
                    block_size=BS,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=group_idx,
                )
            )
        evicted = []
        while len(self.lru) > CAPACITY:
            d = self.lru.pop(0)
            del self.blocks[d]
            evicted.append(d)
        if evicted:
            events.append(
                mk.BlockRemoved(
                    block_hashes=[mk.name(d) for d in evicted],
                    medium="GPU",
                    group_idx=group_idx,
                )
            )
        self.evicted = evicted
        return events, new


class Names:
    def __init__(self, kv, as_bytes=False):
        self.kv = kv
        self.as_bytes = as_bytes
        self.BlockStored = kv.BlockStored
        self.BlockRemoved = kv.BlockRemoved

    def name(self, digest):
        if self.as_bytes:
            return digest
        # vLLM's maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
        return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def serve(root, seed):
    sys.path.insert(0, root)
    from vllm.distributed import kv_events as kv  # noqa: E402

    rng = random.Random(seed)

    def bind(pub_ep, replay_ep):
        # vLLM binds only endpoints with a wildcard host; others it connects to.
        return kv.ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=pub_ep.replace("127.0.0.1", "*"),
            replay_endpoint=replay_ep,
        )

    pub_ep, replay_ep = free_endpoint(), free_endpoint()
    publisher = bind(pub_ep, replay_ep)
    cache = Cache(rng)
    seq = 0
    print(f"ENDPOINTS {pub_ep} {replay_ep}", flush=True)

    def publish(events):
        nonlocal seq
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        seq += 1

    for line in sys.stdin:
        words = line.split()
        cmd, n = words[0], int(words[1]) if len(words) > 1 else 0
        if cmd in ("steps", "bytes"):
            mk = Names(kv, as_bytes=cmd == "bytes")
            for _ in range(n):
                events, _ = cache.step(mk)
                publish(events)
        elif cmd == "hybrid":
            mk = Names(kv)
            for _ in range(n):
                cache.sliding = getattr(cache, "sliding", set())
                events, new = cache.step(mk, group_idx=0)
                # The sliding-window group stores the same blocks, then frees
                # all but the last two of them (outside its window).
                for e in list(events):
                    if isinstance(e, kv.BlockStored):
                        events.append(
                            kv.BlockStored(
                                block_hashes=e.block_hashes,
                                parent_block_hash=e.parent_block_hash,
                                token_ids=e.token_ids,
                                block_size=BS,
                                lora_id=None,
                                medium="GPU",
                                lora_name=None,
                                group_idx=1,
                                kv_cache_spec_kind="sliding_window",
                                kv_cache_spec_sliding_window=2 * BS,
                            )
                        )
                cache.sliding |= set(new[-2:])
                freed = new[:-2] + [d for d in cache.evicted if d in cache.sliding]
                cache.sliding -= set(freed)
                if freed:
                    events.append(
                        kv.BlockRemoved(
                            block_hashes=[mk.name(d) for d in freed],
                            medium="GPU",
                            group_idx=1,
                        )
                    )
                publish(events)
        elif cmd == "clear":
            cache.blocks.clear()
            cache.lru.clear()
            publish([kv.AllBlocksCleared()])
        elif cmd == "restart":
            publisher.shutdown()
            time.sleep(0.2)
            publisher = bind(pub_ep, replay_ep)
            cache = Cache(random.Random(seed + 1))
            seq = 0
        elif cmd == "inventory":
            print("OK " + json.dumps([t for _, t in cache.blocks.values()]), flush=True)
            continue
        elif cmd == "seq":
            pass
        else:
            raise SystemExit(f"unknown command {cmd!r}")
        # Let the publisher thread drain its queue before answering.
        while publisher._event_queue.qsize() > 0:
            time.sleep(0.01)
        time.sleep(0.05)
        print(f"OK {seq}", flush=True)
    publisher.shutdown()


def record(root, out):
    """Captures what vLLM's publisher puts on the wire: live messages of a
    few batches (int hashes, byte hashes, hybrid groups, a clear) and the
    replies to a replay request from seq 1, end marker included. Writes
    `out` as JSON: {"live": [[hex frame, ...], ...], "replay": [...]}."""
    import zmq

    sys.path.insert(0, root)
    from vllm.distributed import kv_events as kv  # noqa: E402

    pub_ep, replay_ep = free_endpoint(), free_endpoint()
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=pub_ep.replace("127.0.0.1", "*"),
        replay_endpoint=replay_ep,
        topic="kv",
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub_ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # slow joiner: let the subscription reach the PUB socket
    rng = random.Random(7)
    cache = Cache(rng)
    cache.prefixes = [p[: BS * 3] for p in cache.prefixes[:2]]
    batches = []
    for as_bytes, group in ((False, None), (True, None), (False, 0)):
        events, new = cache.step(Names(kv, as_bytes), group_idx=group)
        if group is not None:
            events.append(
                kv.BlockRemoved(
                    block_hashes=[Names(kv).name(d) for d in new[:1]],
                    medium="GPU",
                    group_idx=1,
                )
            )
        batches.append(events)
    batches.append([kv.AllBlocksCleared()])
    for events in batches:
        publisher.publish(kv.KVEventBatch(ts=1.75e9, events=events))
    live = [sub.recv_multipart() for _ in batches]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_ep)
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replay = []
    while True:
        msg = dealer.recv_multipart()
        replay.append(msg)
        if len(msg) >= 3 and msg[-2] == b"\xff" * 8:
            break
    publisher.shutdown()
    hexed = lambda msgs: [[f.hex() for f in m] for m in msgs]
    with open(out, "w") as f:
        json.dump({"vllm": "0.33.0", "topic": "kv", "live": hexed(live), "replay": hexed(replay)}, f, indent=1)
        f.write("\n")


def free_endpoint():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


if __name__ == "__main__":
    if sys.argv[1] == "sandbox":
        sandbox(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("usage: harness.py sandbox WHEEL DIR | serve DIR SEED")
