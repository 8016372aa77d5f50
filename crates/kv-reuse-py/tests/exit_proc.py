"""A donor and a target whose ``kv_caches`` come from an exporter of the
given kind, all held in module globals of this script (as an engine's
launcher script would hold them), for test_exit.py; run as a script so its
exit runs interpreter finalization with nothing of pytest in the process.

argv: exporter kind, pin socket path. Exporter kinds: ``numpy`` (numpy arrays), ``dlpack`` (a class of this
script implementing ``__dlpack__`` / ``__dlpack_device__``) or
``array_interface`` (a class of this script with ``__array_interface__``);
``failed_job``: numpy, and after the fetch a ``fetch_async`` whose
``donor_alive`` (a function of this script) raises, its result never taken.
The donor stores a prompt, serves pins, and the target fetches it into its
``kv_caches``; then the script prints one JSON line (this process's
``/dev/shm`` entries, the fetched rows) and returns without deleting
anything: whatever drops the bank (and so unlinks its segments and leases)
is interpreter finalization.

A class defined here references this module's globals (its methods'
``__globals__``), which hold the target, which holds the exporters: a
reference cycle through the ``Target``. Only the garbage collector can free
it, and only if the ``Target`` tells the collector what it holds."""

import json
import os
import sys
import time

import numpy as np

import kv_reuse

TPB, BLOCKS, TP = 64, 6, 2
KIND, SOCK = sys.argv[1], sys.argv[2]


class DlpackCache:
    """An engine's KV tensor that only speaks DLPack (as a framework's own
    tensor type would)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None, **kwargs):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class InterfaceCache:
    """An engine's KV tensor that only speaks the numpy array interface."""

    def __init__(self, array):
        self.array = array
        self.__array_interface__ = array.__array_interface__


def exporter(array):
    if KIND in ("numpy", "failed_job"):
        return array
    if KIND == "dlpack":
        return DlpackCache(array)
    if KIND == "array_interface":
        return InterfaceCache(array)
    raise SystemExit(f"unknown exporter kind {KIND!r}")


layout = kv_reuse.Layout(2, 2, 8, "f32", TPB, TP)
donor = kv_reuse.DonorBank(layout, slots=8, lease_s=5.0)
tokens = list(range(TPB * BLOCKS))
store = donor.store(tokens)
for rank in range(TP):
    store.write(rank, np.full((BLOCKS, layout.rank_block_elems), rank + 1, dtype=np.float32))
    store.ack(rank)
del store
pins = donor.serve_pins("unix:" + SOCK)
caches = [exporter(np.zeros((8, layout.rank_block_elems), dtype=np.float32)) for _ in range(TP)]
target = kv_reuse.Target(layout, rows=8, kv_caches=caches)
router = kv_reuse.Router(kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={}), TPB)
router.register_worker(1, donor.engine_id, "decode", layout)
router.register_worker(2, target.engine_id, "prefill", layout)
for event in donor.drain_events():
    router.apply_event(event)
prompt = kv_reuse.sequence_hashes(tokens, TPB)
router.report_donor(donor.manifest(), pins.endpoint, dict(zip(prompt, donor.slots(prompt))))
advice = router.advise("req-1", prompt, target.engine_id)
with target.fetch(advice.hint, prompt, donor.manifest()) as outcome:
    rows = list(outcome.rows)


def failing_probe():
    raise RuntimeError("the probe failed")


if KIND == "failed_job":
    # The job's FetchFellBack has the probe's exception as its __cause__,
    # whose traceback holds this script's frame and so its globals, which
    # hold the job: a cycle through the FetchJob, left untaken.
    job = target.fetch_async(advice.hint, prompt, donor.manifest(), donor_alive=failing_probe)
    while job.state != "done":
        time.sleep(0.01)
me = os.getpid()
print(
    json.dumps(
        {
            "pid": me,
            "shm": sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{me}-")),
            "rows": rows,
        }
    ),
    flush=True,
)
