"""Nothing of a donor is left in /dev/shm after its process exits normally
with the donor, its pin server and a target still held in module globals:
interpreter finalization must reach the bank's Rust drop, which unlinks its
segments and lease files (exit_proc.py). A target in a reference cycle is
collected, but never while a fetch into its tensors runs."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TOKENS_PER_BLOCK, TP

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("kind", ["numpy", "dlpack", "array_interface", "failed_job"])
def test_a_donor_held_in_globals_leaves_no_shm_at_exit(kind, tmp_path):
    """With ``kv_caches`` from a class of the script (``dlpack``,
    ``array_interface``) the script's globals, the target and its exporters
    form a reference cycle that only the garbage collector frees: the
    target must show the collector the exporters it holds
    (``Target.__traverse__``), or the cycle, and the donor in those globals,
    outlive finalization and the bank's segments and leases stay in
    /dev/shm. ``failed_job``: an untaken ``FetchJob`` whose fallback chains
    the probe's exception (its traceback holds the script's globals) must
    show the collector that result (``FetchJob.__traverse__``) for the
    same reason."""
    sock = tmp_path / "pin.sock"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "exit_proc.py"), kind, str(sock)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rows"], report  # the fetch ran into the exporters' memory
    # One segment and one lease per TP rank while the donor lived.
    assert len(report["shm"]) == 4, report["shm"]
    assert any(n.endswith(".lease") for n in report["shm"]), report["shm"]
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{report['pid']}-"))
    for name in left:  # a failure here must not leave them for the next run
        os.unlink(os.path.join("/dev/shm", name))
    assert left == [], f"left in /dev/shm by {kind}: {left}"
    assert not sock.exists(), "the pin socket outlived its donor"


class DlpackCache:
    """A KV tensor that only speaks DLPack, of a class defined here (as in
    exit_proc.py); weakly referenceable, so a test can see it collected."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None, **kwargs):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def stored_bank(layout, tokens):
    bank = kv_reuse.DonorBank(layout, slots=8)
    store = bank.store(tokens)
    for rank in range(TP):
        store.write(rank, np.full((BLOCKS, layout.rank_block_elems), rank + 1, dtype=np.float32))
        store.ack(rank)
    return bank


def admitted(enabled, layout, bank, pins, target, prompt):
    """The router's admitted advice for fetching ``prompt`` from ``bank``
    (serving pins at ``pins``) into ``target``."""
    router = kv_reuse.Router(enabled, TOKENS_PER_BLOCK)
    router.register_worker(1, bank.engine_id, "decode", layout)
    router.register_worker(2, target.engine_id, "prefill", layout)
    for event in bank.drain_events():
        router.apply_event(event)
    router.report_donor(bank.manifest(), pins.endpoint, dict(zip(prompt, bank.slots(prompt))))
    advice = router.advise("req-gc", prompt, target.engine_id)
    assert advice.admitted, advice
    return advice


def test_a_fetch_in_flight_keeps_a_target_in_a_cycle_from_being_collected(layout, enabled, tmp_path):
    """A target reachable only through a reference cycle and its running
    ``fetch_async`` job: a collection during the fetch (run by the
    ``donor_alive`` probe, on the fetch thread, before the first byte and
    after the last) must not take the target or clear its exporters (the
    memory the fetch writes); once the job ended, the cycle is garbage and
    collected."""
    tokens = list(range(TOKENS_PER_BLOCK * BLOCKS))
    prompt = kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)
    bank = stored_bank(layout, tokens)
    with bank.serve_pins("unix:" + str(tmp_path / "pin.sock")) as pins:
        arrays = [np.zeros((8, layout.rank_block_elems), dtype=np.float32) for _ in range(TP)]
        caches = [DlpackCache(a) for a in arrays]
        target = kv_reuse.Target(layout, rows=8, kv_caches=caches)
        advice = admitted(enabled, layout, bank, pins, target, prompt)
        caches[0].target = target  # the cycle: target -> exporter -> target
        exporter = weakref.ref(caches[0])
        seen = []

        def probe():
            gc.collect()
            seen.append(exporter() is not None and hasattr(exporter(), "array"))
            return True

        job = target.fetch_async(advice.hint, prompt, bank.manifest(), donor_alive=probe)
        del target, caches  # the job's own reference keeps the target
        with job.result() as out:
            rows = out.rows
        assert seen and all(seen), f"collected while the fetch ran: {seen}"
        for rank in range(TP):
            assert (arrays[rank][rows] == rank + 1).all()
        del job, out
        # The fetch thread let go of the target (its decref runs at the next
        # call into kv_reuse): the cycle is garbage now, and collected.
        deadline = time.monotonic() + 5
        while exporter() is not None and time.monotonic() < deadline:
            kv_reuse.leak_counters()
            gc.collect()
            time.sleep(0.01)
        assert exporter() is None, "the cycle through the target was not collected"


class RaisingProbe:
    """A ``donor_alive`` probe that raises: its exception's traceback holds
    the frame of ``__call__``, whose ``self`` is this probe."""

    def __call__(self):
        raise RuntimeError("the probe failed")


def test_an_untaken_failed_job_in_a_reference_cycle_is_collected(layout, enabled, tmp_path):
    """A finished job whose result was never taken shows the collector what
    it holds (its target, the probe, the probe's exception: a
    ``FetchFellBack.__cause__`` to be) and lets go of it once taken. In a
    cycle through that exception (probe -> job -> exception -> traceback ->
    frame -> probe, as exit_proc.py's ``failed_job`` forms through the
    script's globals) it is collected; when the result sat where the
    collector could not see it, the cycle was never freed."""
    tokens = list(range(TOKENS_PER_BLOCK * BLOCKS))
    prompt = kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)
    bank = stored_bank(layout, tokens)
    with bank.serve_pins("unix:" + str(tmp_path / "pin.sock")) as pins:
        target = kv_reuse.Target(layout, rows=8)
        advice = admitted(enabled, layout, bank, pins, target, prompt)
        probe = RaisingProbe()
        job = target.fetch_async(advice.hint, prompt, bank.manifest(), donor_alive=probe)
        deadline = time.monotonic() + 10
        while job.state != "done" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.state == "done"
        held = gc.get_referents(job)
        assert any(o is target for o in held) and any(o is probe for o in held), held
        causes = [o for o in held if isinstance(o, RuntimeError)]
        assert [str(c) for c in causes] == ["the probe failed"], held
        del held, causes
        # Taken, the result lets go of all of it.
        taken = target.fetch_async(advice.hint, prompt, bank.manifest(), donor_alive=probe)
        with pytest.raises(kv_reuse.FetchFellBack) as info:
            taken.result(timeout_s=10)
        assert type(info.value.__cause__) is RuntimeError
        del info
        assert gc.get_referents(taken) == []
        probe.job = job  # the cycle
        gone = weakref.ref(probe)
        del job, probe, taken
        gc.collect()
        assert gone() is None, "the cycle through the untaken job was not collected"
        assert target.free_rows == 8


@pytest.mark.parametrize("mode", ["accept", "sleep", "builtin"])
def test_a_donor_in_globals_leaves_no_shm_at_exit_with_a_daemon_thread_alive(mode):
    """A daemon thread still running at exit whose frames hold the script's
    globals (``accept``: a server loop blocked in ``socket.accept()``;
    ``sleep``: a function of the script) keeps the globals, and the donor in
    them, from ever being dropped: finalization cannot clear a running
    thread's frames. The wheel's exit hook (``atexit``, registered at
    import) removes the names of every bank still alive, so nothing of the
    donor stays in /dev/shm; before it, the 2 segments and 2 leases were
    left there until a ``reclaim_stale`` after the lease lapsed.
    ``builtin``: a thread of ``time.sleep`` itself, which holds nothing of
    the script."""
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "exit_daemon_proc.py"), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "panicked" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # One segment and one lease per TP rank while the donor lived.
    assert len(report["shm"]) == 4, report["shm"]
    assert sum(n.endswith(".lease") for n in report["shm"]) == 2, report["shm"]
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{report['pid']}-"))
    for name in left:  # a failure here must not leave them for the next run
        os.unlink(os.path.join("/dev/shm", name))
    assert left == [], f"left in /dev/shm with a daemon thread ({mode}): {left}"


@pytest.mark.parametrize("mode", ["handler", "default"])
def test_a_donor_stopped_by_sigterm_cleans_up_only_with_the_documented_handler(mode, tmp_path):
    """docs/python.md: Python runs no `atexit` hook when SIGTERM's default
    action ends the process, so a donor stopped that way (systemd, docker
    stop) leaves its /dev/shm names and pin socket; with the one-line
    handler the doc gives, SIGTERM is a normal exit and leaves nothing."""
    sock = tmp_path / "pin.sock"
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "sigterm_proc.py"), mode, str(sock)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        report = json.loads(proc.stdout.readline())
        assert len(report["shm"]) == 4, report  # a segment and a lease per rank
        assert sock.exists()
        proc.terminate()
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{report['pid']}-"))
    for name in left:  # never leave them for the next run
        os.unlink(os.path.join("/dev/shm", name))
    if mode == "handler":
        assert rc == 0
        assert left == [] and not sock.exists(), (left, sock.exists())
    else:
        # What the doc warns of; if Python ever ran atexit here, the doc must change.
        assert rc == -signal.SIGTERM
        assert left == report["shm"] and sock.exists()
