"""A donor serving pins, held in module globals, that waits to be stopped
by SIGTERM, for test_exit.py. argv: ``handler`` (install the SIGTERM
handler docs/python.md recommends for a donor run as a service) or
``default`` (Python's default action), then the pin socket path. Prints one
JSON line (pid, this process's /dev/shm entries) once it serves."""

import json
import os
import signal
import sys
import time

import numpy as np

import kv_reuse

MODE, SOCK = sys.argv[1], sys.argv[2]
if MODE == "handler":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

layout = kv_reuse.Layout(2, 2, 8, "f32", 16, 2)
donor = kv_reuse.DonorBank(layout, slots=4, lease_s=5.0)
store = donor.store(list(range(16 * 2)))
for rank in range(layout.tp_size):
    store.write(rank, np.ones((2, layout.rank_block_elems), np.float32))
    store.ack(rank)
pins = donor.serve_pins("unix:" + SOCK)
pid = os.getpid()
print(json.dumps({"pid": pid, "shm": sorted(n for n in os.listdir("/dev/shm")
                                            if n.startswith(f"kvbank-{pid}-"))}), flush=True)
while True:
    time.sleep(1)
