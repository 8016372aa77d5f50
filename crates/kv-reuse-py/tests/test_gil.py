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
    assert advice.admitted, advice
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


def test_a_long_store_write_releases_the_gil():
    import numpy as np

    # 4 MiB per block and rank (32 layers x K,V x 8 heads x 128 dims x 16
    # tokens x f32): 32 blocks are a 128 MiB copy into fresh shm pages.
    layout = kv_reuse.Layout(32, 8, 128, "f32", 16, 1)
    blocks = 32
    bank = kv_reuse.DonorBank(layout, slots=blocks)
    store = bank.store(list(range(16 * blocks)))
    src = np.ones((blocks, layout.rank_block_elems), dtype=np.float32)
    ticker = Ticker()
    ticker.start()
    time.sleep(0.02)
    try:
        t0, ticks0 = time.monotonic(), ticker.ticks
        store.write(0, src)
        elapsed, ticks = time.monotonic() - t0, ticker.ticks - ticks0
    finally:
        ticker.stop.set()
        ticker.join()
    assert store.ack(0)
    # With the GIL held the ticker gets no turn during the call at all.
    assert elapsed >= 0.01, f"copy too short to judge: {elapsed:.4f} s"
    assert ticks >= 3, (ticks, elapsed)
    del store, bank
