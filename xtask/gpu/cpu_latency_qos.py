"""Hold a Linux CPU latency QoS request while a run goes on (an experiment tool, not part of the product).

The forward of gpu_serving's prefill worker is host-bound (kernel launches take
as long as the forward), and an advise crosses three processes (client,
nats-server, router) that each sleep between requests. Both pay the exit
latency of a CPU idle state whenever a core slept deeply. Writing a 32-bit
latency bound to ``/dev/cpu_dma_latency`` and keeping the file open asks the
kernel's PM QoS to keep every CPU out of idle states whose exit latency exceeds
the bound (``Documentation/power/pm_qos_interface.rst``); closing the file, or
this process ending, withdraws the request. This is what ``tuned``'s
``latency-performance`` profile does. Needs write access to the device
(root).

    python3 xtask/gpu/cpu_latency_qos.py --us 0 --seconds 600 &   # then the run, then kill %1

Prints the idle states of CPU 0 (name, exit latency in µs, whether disabled)
before the request, and ``holding <N> us`` once it is in force. Exits 2 when
the device cannot be opened (the reason printed), so a run can tell a held
request from none.
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import struct
import sys
import time


def idle_states() -> list:
    out = []
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        def read(name: str) -> str:
            try:
                with open(os.path.join(d, name)) as f:
                    return f.read().strip()
            except OSError as e:
                return f"? ({e.strerror})"
        out.append({"state": os.path.basename(d), "name": read("name"), "latency_us": read("latency"),
                    "disabled": read("disable")})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--us", type=int, default=0, help="latency bound in µs (0: no idle state deeper than polling)")
    p.add_argument("--seconds", type=float, default=600.0, help="hold this long at most")
    a = p.parse_args()
    for s in idle_states():
        print(f"cpu0 {s['state']}: {s['name']} exit latency {s['latency_us']} us, disabled {s['disabled']}", flush=True)
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_RDWR)
    except OSError as e:
        print(f"cpu_latency_qos: cannot open /dev/cpu_dma_latency: {e.strerror}", flush=True)
        return 2
    os.write(fd, struct.pack("i", a.us))
    # The device reads back the bound in force (the minimum over all holders).
    os.lseek(fd, 0, os.SEEK_SET)
    now = struct.unpack("i", os.read(fd, 4))[0]
    print(f"holding {a.us} us (in force: {now} us)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(a.seconds)
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
