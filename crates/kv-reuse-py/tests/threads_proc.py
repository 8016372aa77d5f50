"""Child process of test_publisher.py's thread test: one RouterClient and one
target WorkerPublisher shared by several Python threads at once (advises,
the `connected` getter, prefix events, ticks), then closed while advises are
in flight. Prints one JSON line with the counts. Run as a child so that a
deadlock (the GIL held while waiting for a lock another thread keeps across
a GIL release: helper-22 finding 1) fails the test by its timeout instead of
hanging pytest.

argv: nats_url tokens_per_block tp"""

import json
import sys
import threading

import kv_reuse

url, tpb, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layout = kv_reuse.Layout(2, 2, 8, "f32", tpb, tp)
tokens = list(range(tpb * 4))
hashes = kv_reuse.sequence_hashes(tokens, tpb)
engine = "00000000-0000-4000-8000-000000000001"
counts = {"refused": 0, "other": 0, "connected_reads": 0, "prefix": 0, "ticks": 0}
lock = threading.Lock()


def count(key, n=1):
    with lock:
        counts[key] += n


client = kv_reuse.RouterClient(url, timeout_s=5.0)
publisher = kv_reuse.WorkerPublisher.target(url, "threads-py", layout, engine, announce_period_s=0.2)


def advises(i):
    for k in range(50):
        try:
            client.advise(f"t{i}-{k}", hashes, "00000000-0000-4000-8000-0000000000ff")
            count("other")
        except kv_reuse.AdviseRefused:
            count("refused")


def reads():
    for _ in range(2000):
        if client.connected:
            count("connected_reads")


def prefix(i):
    for _ in range(20):
        count("prefix", publisher.publish_prefix_stored(tokens, 0))
        publisher.tick()
        count("ticks")


threads = [threading.Thread(target=advises, args=(i,)) for i in range(4)]
threads += [threading.Thread(target=reads)]
threads += [threading.Thread(target=prefix, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()

# A close while advises run on other threads: they finish (answered or
# RouterUnavailable once closed), nothing hangs.
late = []


def late_advises():
    for k in range(50):
        try:
            client.advise(f"late-{k}", hashes, engine)
        except (kv_reuse.AdviseRefused, kv_reuse.RouterUnavailable) as e:
            late.append(type(e).__name__)


runners = [threading.Thread(target=late_advises) for _ in range(3)]
for t in runners:
    t.start()
client.close()
for t in runners:
    t.join()
publisher.close()
counts["after_close"] = sorted(set(late))
counts["connected_after_close"] = client.connected
print(json.dumps(counts), flush=True)
