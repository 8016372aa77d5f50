"""A donor (bank, pin server) and a target in one process that forks a
helper child, for test_fork.py; run as a script so the child is a plain
Python process (no pytest state in it) whose exit runs interpreter
finalization.

argv: socket path, mode: ``exit`` (the child returns from ``sys.exit(0)``:
finalization drops the bank, pin server and target), ``daemon`` (as
``exit``, with a bank of the child's own that a daemon thread still running
at exit keeps from being dropped: the wheel's exit hook runs in the child,
removes that bank's names and none of the parent's) or ``del`` (the child
tries ``store`` and ``write`` on the inherited bank, then deletes every
object and exits normally). Prints one JSON line: what the child reported
(``del``; ``daemon``: its pid, its own bank's entries while alive and, read
by the parent, after the child exited), the parent's /dev/shm entries before and after the child, whether
the socket file survived, and the bytes of a fetch made after the child
exited, or the error it raised."""

import json
import os
import sys

import numpy as np

import kv_reuse

TPB, BLOCKS = 64, 6


def row(layout, rank, block):
    return np.arange(layout.rank_block_elems, dtype=np.float32) + np.float32(1000 * block + 100000 * rank)


def main():
    sock, mode = sys.argv[1], sys.argv[2]
    layout = kv_reuse.Layout(2, 2, 8, "f32", TPB, 2)
    bank = kv_reuse.DonorBank(layout, slots=8, lease_s=5.0)
    tokens = list(range(TPB * BLOCKS))
    store = bank.store(tokens)
    for rank in range(2):
        store.write(rank, np.stack([row(layout, rank, b) for b in range(BLOCKS)]))
        store.ack(rank)
    del store
    pins = bank.serve_pins("unix:" + sock)
    target = kv_reuse.Target(layout, rows=8)
    me = os.getpid()
    mine = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{me}-"))  # noqa: E731
    before = mine()
    r, w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if mode == "daemon":
            # A bank of the child's own, held past finalization by a daemon
            # thread still running at exit: only the exit hook removes its
            # names, and that hook must leave the inherited (parent's) bank
            # alone.
            import threading
            import time

            own = kv_reuse.DonorBank(layout, slots=2, lease_s=5.0)
            child = os.getpid()
            def hold(bank):  # its running frame holds the bank
                time.sleep(100)

            threading.Thread(target=hold, args=(own,), daemon=True).start()
            own_names = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{child}-"))
            os.write(w, json.dumps({"pid": child, "own": own_names}).encode())
        if mode == "del":
            report = {}
            try:
                bank.store(list(range(10**6, 10**6 + TPB)))
                report["store"] = "accepted"
            except kv_reuse.BankFailed as e:
                report["store"] = str(e)
            try:
                del target, pins, bank
                report["del"] = "ok"
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                report["del"] = f"{type(e).__name__}: {e}"
            os.write(w, json.dumps(report).encode())
        os.close(w)
        sys.exit(0)  # finalization: whatever is left is dropped now
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child = f.read().decode()
    _, status = os.waitpid(pid, 0)
    child = json.loads(child) if child else None
    if mode == "daemon":
        child["own_after"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{child['pid']}-"))
    result = {
        "child": child,
        "child_exit": os.waitstatus_to_exitcode(status),
        "before": before,
        "after": mine(),
        "socket": os.path.exists(sock),
    }
    hashes = kv_reuse.sequence_hashes(tokens, TPB)
    router = kv_reuse.Router(kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={}), TPB)
    router.register_worker(1, bank.engine_id, "decode", layout)
    router.register_worker(2, target.engine_id, "prefill", layout)
    for e in bank.drain_events():
        router.apply_event(e)
    router.report_donor(bank.manifest(), pins.endpoint, dict(zip(hashes, bank.slots(hashes))))
    advice = router.advise("req-fork", hashes, target.engine_id)
    try:
        with target.fetch(advice.hint, hashes, bank.manifest()) as out:
            result["fetch"] = all(
                np.array_equal(np.frombuffer(target.read_row(rank, r), dtype=np.float32), row(layout, rank, b))
                for b, r in enumerate(out.rows)
                for rank in range(2)
            ) and len(out.rows) == BLOCKS
    except kv_reuse.KvReuseError as e:
        result["fetch"] = f"{type(e).__name__}: {e}"
    pins.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
