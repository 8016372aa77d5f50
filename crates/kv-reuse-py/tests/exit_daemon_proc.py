"""A donor held in this script's globals while a daemon thread is still
alive at exit, for test_exit.py; run as a script so its exit runs
interpreter finalization with nothing of pytest in the process.

argv: how the daemon thread holds on: ``accept`` (a function of this script
blocked in ``socket.accept()``, as a server loop would be), ``sleep`` (a
function of this script sleeping) or ``builtin`` (``time.sleep`` itself:
no frame of this script). A running thread's frames cannot be cleared at exit, and a frame of
a function of this script holds this module's globals (which hold the bank):
finalization never drops the bank then, and only the wheel's exit hook
removes its /dev/shm names. Prints one JSON line (pid, this process's
/dev/shm entries while the donor lives) and returns with the thread still
running."""

import json
import os
import socket
import sys
import threading
import time

import numpy as np

import kv_reuse

TPB, BLOCKS, TP = 64, 2, 2
MODE = sys.argv[1]

layout = kv_reuse.Layout(2, 2, 8, "f32", TPB, TP)
donor = kv_reuse.DonorBank(layout, slots=8, lease_s=5.0)
store = donor.store(list(range(TPB * BLOCKS)))
for rank in range(TP):
    store.write(rank, np.full((BLOCKS, layout.rank_block_elems), rank + 1, dtype=np.float32))
    store.ack(rank)
del store
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()


def serve():
    listener.accept()


def sleeper():
    time.sleep(100)


started = threading.Event()


def run(target, *args):
    def body():
        started.set()
        target(*args)

    threading.Thread(target=body, daemon=True).start()
    started.wait(10)


if MODE == "accept":
    run(serve)
elif MODE == "sleep":
    run(sleeper)
elif MODE == "builtin":
    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
else:
    raise SystemExit(f"unknown mode {MODE!r}")
me = os.getpid()
print(
    json.dumps({"pid": me, "shm": sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{me}-"))}),
    flush=True,
)
