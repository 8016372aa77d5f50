"""A RouterClient, DonorDirectory or target WorkerPublisher in a process
that forks a child, for test_fork.py; run as a script so the child is a
plain Python process whose exit runs interpreter finalization.

argv: NATS URL, ``client`` / ``directory`` / ``publisher``, mode: ``use``
(the child calls the object, reads ``connected`` / ``open``, closes it,
deletes it and exits normally) or ``exit`` (the child only exits:
finalization drops the inherited object). The parent then uses its own
object over its connection and closes it. Prints one JSON line: the child's
report (``use``), its exit status (``hung`` when it did not end within 20 s,
then killed) and what the parent's call returned afterwards."""

import json
import os
import signal
import sys
import time

import kv_reuse
from nats_fake import Replier, msgpack

TARGET = "00000000-0000-4000-8000-000000000001"


def refusal(call):
    try:
        call()
    except kv_reuse.KvReuseError as e:
        return f"{type(e).__name__}: {e}"
    return "no refusal"


def main():
    url, which, mode = sys.argv[1:4]
    replica = None
    if which == "client":
        reply = msgpack({"request_id": "req-parent", "result": {"refused": "draining"}})
        replica = Replier(url, "kv_reuse.advise", lambda _: reply)
        replica.start()
        obj = kv_reuse.RouterClient(url)
        use = lambda: obj.advise("req-child", [1, 2], TARGET)  # noqa: E731
        flag = lambda: obj.connected  # noqa: E731
    elif which == "directory":
        obj = kv_reuse.DonorDirectory(url, create=True)
        use = lambda: obj.manifest(TARGET)  # noqa: E731
        flag = lambda: refusal(lambda: obj.donors)  # noqa: E731
    else:
        layout = kv_reuse.Layout(2, 2, 8, "f32", 16, 1)
        obj = kv_reuse.WorkerPublisher.target(url, "fork-target", layout, TARGET)
        use = lambda: obj.publish_prefix_stored(list(range(32)))  # noqa: E731
        flag = lambda: obj.open  # noqa: E731
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        if mode == "use":
            report = {"call": refusal(use), "flag": flag()}
            t = time.monotonic()
            obj.close()
            report["close_s"] = round(time.monotonic() - t, 3)
            del obj
            os.write(write_end, json.dumps(report).encode())
        os.close(write_end)
        sys.exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 20
    status = "hung"
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    child = os.read(read_end, 65536).decode()
    if which == "client":
        after = refusal(lambda: obj.advise("req-parent", [1, 2], TARGET))
    elif which == "directory":
        after = {"donors": obj.donors, "manifest": obj.manifest(TARGET)}
    else:
        after = obj.publish_prefix_stored(list(range(32)))
    obj.close()
    if replica is not None:
        replica.stop()
    print(json.dumps({"child": json.loads(child) if child else None, "status": status, "after": after}))


if __name__ == "__main__":
    main()
