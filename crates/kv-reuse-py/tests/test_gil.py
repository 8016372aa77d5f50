"""Long calls release the GIL: another Python thread makes progress while
the extension waits (here on a pin service that never answers)."""

import socket
import threading
import time

import pytest

import kv_reuse
from conftest import TOKENS_PER_BLOCK
from test_roles import donor, router_for  # noqa: F401  (fixture)


class Ticker(threading.Thread):
    """Counts loop turns, each needing the GIL."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ticks = 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.ticks += 1
            time.sleep(0.001)


def test_fetch_releases_the_gil_while_the_pin_service_stalls(donor, layout, enabled, tmp_path):  # noqa: F811
    _, report = donor
    # A pin endpoint that accepts and never answers.
    path = str(tmp_path / "stall.sock")
    stall = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stall.bind(path)
    stall.listen(4)
    target = kv_reuse.Target(layout, rows=8)
    fake = dict(report, endpoint="unix:" + path)
    router = router_for(fake, layout, enabled, target)
    advice = router.advise("req-gil", report["hashes"], target.engine_id)
    assert advice.admitted, advice.verdict
    ticker = Ticker()
    ticker.start()
    time.sleep(0.02)
    t0, ticks0 = time.monotonic(), ticker.ticks
    try:
        with pytest.raises(kv_reuse.FetchFellBack) as e:
            target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]),
                         pin_timeout_s=0.5)
        stage = e.value.args[1]
        del e
    finally:
        elapsed, ticks = time.monotonic() - t0, ticker.ticks - ticks0
        ticker.stop.set()
        ticker.join()
        stall.close()
    assert stage == "pin"
    assert elapsed >= 0.45, elapsed
    # ~1 ms per tick when the thread may run; 0 if the GIL were held.
    assert ticks >= 50, (ticks, elapsed)
    assert target.free_rows == 8
