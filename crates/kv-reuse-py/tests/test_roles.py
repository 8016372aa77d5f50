"""Donor, router and target across two Python processes over host-shm banks:
store -> events -> advise -> fetch, a dead donor falling back, and refusals."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TOKENS_PER_BLOCK, TP, stop_process

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from donor_proc import pattern  # noqa: E402


@pytest.fixture
def donor(tmp_path):
    """A donor process; yields (process, its JSON report)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "donor_proc.py"), str(tmp_path / "pin.sock"),
         str(TOKENS_PER_BLOCK), str(BLOCKS), str(TP)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert line, "donor process printed nothing"
    report = json.loads(line)
    yield proc, report
    if proc.poll() is None:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    proc.wait(timeout=10)
    # The pipes are this process's fds: close them, not the garbage collector.
    proc.stdin.close()
    proc.stdout.close()


def shm_names_of(pid):
    """/dev/shm entries a process created (`kvbank-<pid>-...`)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{pid}-"))


def assert_reclaimed(pid):
    """A killed donor leaves its segments (it cannot unlink them);
    reclaim_stale removes them once its 2 s lease lapsed."""
    assert shm_names_of(pid), "the killed donor left no segments to reclaim"
    deadline = time.monotonic() + 10
    removed = []
    while shm_names_of(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
        # This donor's prefix only: other processes' banks on a shared
        # machine are theirs to reclaim.
        removed += kv_reuse.reclaim_stale(f"kvbank-{pid}-")
    assert shm_names_of(pid) == [], shm_names_of(pid)
    assert any(f"kvbank-{pid}-" in n for n in removed), removed


def router_for(report, layout, settings, target):
    router = kv_reuse.Router(settings, TOKENS_PER_BLOCK)
    router.register_worker(1, report["engine_id"], "decode", layout)
    router.register_worker(2, target.engine_id, "prefill", layout)
    for e in report["events"]:
        router.apply_event(bytes.fromhex(e))
    router.report_donor(bytes.fromhex(report["manifest"]), report["endpoint"],
                        {int(h): s for h, s in report["slots"].items()})
    return router


def router_for_bank(bank, endpoint, hashes, layout, settings, target):
    """``router_for`` for a donor bank in this process: its events drained,
    its manifest reported with the pin ``endpoint`` and the slots of ``hashes``."""
    return router_for(
        {
            "engine_id": bank.engine_id,
            "events": [e.hex() for e in bank.drain_events()],
            "manifest": bank.manifest().hex(),
            "endpoint": endpoint,
            "slots": dict(zip(hashes, bank.slots(hashes))),
        },
        layout,
        settings,
        target,
    )


def test_round_trip_store_events_advise_fetch_across_processes(donor, layout, enabled):
    proc, report = donor
    assert report["ready"] == [False, True]
    tokens = list(range(TOKENS_PER_BLOCK * BLOCKS))
    prompt = kv_reuse.sequence_hashes(tokens, TOKENS_PER_BLOCK)
    assert prompt == report["hashes"]
    target = kv_reuse.Target(layout, rows=16)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-1", prompt, target.engine_id)
    assert advice.admitted, advice
    with target.fetch(advice.hint, prompt, bytes.fromhex(report["manifest"])) as out:
        assert out.fetch_from == 0
        assert out.fetched == prompt
        assert len(out.rows) == BLOCKS
        assert out.bytes == BLOCKS * TP * layout.rank_block_bytes
        assert target.free_rows == 16 - BLOCKS
        for block, row in enumerate(out.rows):
            for rank in range(TP):
                got = np.frombuffer(target.read_row(rank, row), dtype=np.float32)
                np.testing.assert_array_equal(got, pattern(layout, rank, block))
    assert out.released and target.free_rows == 16
    proc.stdin.write("pins\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"pins": 0}


def ask(proc, command):
    """The donor process's one-line JSON answer to ``command``."""
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def admitted_target(report, layout, enabled, request_id):
    """The donor's prompt and manifest, a 16-row host target and the
    router's admitted advice for it: ``(prompt, manifest, target, advice)``."""
    prompt, manifest = report["hashes"], bytes.fromhex(report["manifest"])
    target = kv_reuse.Target(layout, rows=16)
    advice = router_for(report, layout, enabled, target).advise(request_id, prompt, target.engine_id)
    assert advice.admitted, advice
    return prompt, manifest, target, advice


def test_fetch_async_runs_on_the_targets_thread_and_returns_what_fetch_does(donor, layout, enabled):
    """``fetch_async`` checks its arguments on the calling thread, runs the
    fetch on the target's own thread while this one keeps the GIL, and its
    job gives the same outcome (rows, bytes) as ``fetch``; the result is
    taken once; a fallback raises from ``result()``, leaving nothing held
    (the killed donor's /dev/shm entries are reclaimed)."""
    proc, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-async")
    other = kv_reuse.sequence_hashes(list(range(5, 5 + TOKENS_PER_BLOCK * BLOCKS)), TOKENS_PER_BLOCK)
    with pytest.raises(kv_reuse.PromptMismatch):
        target.fetch_async(advice.hint, other, manifest)
    jobs = [target.fetch_async(advice.hint, prompt, manifest) for _ in range(2)]
    for job in jobs:
        with job.result() as out:
            assert out.fetched == prompt and len(out.rows) == BLOCKS
            assert out.bytes == BLOCKS * TP * layout.rank_block_bytes
            for block, row in enumerate(out.rows):
                for rank in range(TP):
                    got = np.frombuffer(target.read_row(rank, row), dtype=np.float32)
                    np.testing.assert_array_equal(got, pattern(layout, rank, block))
        assert out.released
        with pytest.raises(kv_reuse.BadArgument, match="^result: "):
            job.result()
    assert target.free_rows == 16
    # A job dropped without its result completes and releases its rows. Its
    # end is seen through the job after it: one target's jobs run one after
    # another, in call order. (Polling free_rows back to 16 passed at once
    # when the fetch thread had not reserved the dropped job's rows yet,
    # and the donor then still held its pin: {"pins": 6} below.)
    del job, jobs
    taken = ask(proc, "taken")["taken"]
    dropped = target.fetch_async(advice.hint, prompt, manifest)
    del dropped
    with target.fetch_async(advice.hint, prompt, manifest).result() as out:
        assert out.fetched == prompt
        assert target.free_rows == 16 - BLOCKS  # the dropped job's rows are back
    assert target.free_rows == 16
    assert ask(proc, "taken")["taken"] == taken + 2  # the dropped job ran: it pinned too
    proc.stdin.write("pins\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"pins": 0}
    proc.kill()
    proc.wait(timeout=10)
    job = target.fetch_async(advice.hint, prompt, manifest)
    with pytest.raises(kv_reuse.FetchFellBack) as e:
        job.result()
    assert e.value.args[1] in ("import", "pin", "transfer"), e.value.args
    del e
    # The killed donor could not unlink its segments and leases: reclaimed
    # here once its lease lapsed, as an operator's sweep would, not left in
    # /dev/shm by every run.
    assert_reclaimed(proc.pid)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP is POSIX only")
def test_fetch_job_result_with_a_timeout_raises_and_keeps_the_result(donor, layout, enabled):
    """``result(timeout_s=...)`` on a fetch that cannot finish yet (the donor
    process stopped before the pin) raises TimeoutError and keeps the job:
    once the donor runs again, ``result()`` returns the fetch's outcome."""
    proc, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-timeout")
    job = target.fetch_async(advice.hint, prompt, manifest)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(kv_reuse.BadArgument, match="^timeout_s: "):
            job.result(timeout_s=bad)
    with job.result() as out:  # the bad values left the job's result in place
        assert out.fetched == prompt
    stop_process(proc)
    try:
        job = target.fetch_async(advice.hint, prompt, manifest)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="timeout_s=0.2"):
            job.result(timeout_s=0.2)
        assert 0.15 < time.monotonic() - t0 < 1.5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    with job.result(timeout_s=10) as out:
        assert out.fetched == prompt and len(out.rows) == BLOCKS
    assert target.free_rows == 16


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP is POSIX only")
def test_ctrl_c_interrupts_a_waiting_fetch_job_result_and_keeps_the_job(donor, layout, enabled):
    """A SIGINT while ``result()`` waits (the donor stopped before the pin)
    raises KeyboardInterrupt within about the 50 ms signal slice, not after
    the pin timeout; the job keeps running and a later ``result()`` returns
    its outcome (helper-22 finding 9: the wait ignored Ctrl-C)."""
    proc, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-sigint")
    stop_process(proc)
    try:
        job = target.fetch_async(advice.hint, prompt, manifest, pin_timeout_s=8.0)
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            job.result()
        took = time.monotonic() - t0
        timer.join()
        assert took < 2.0, took
        assert job.state == "running"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    with job.result(timeout_s=10) as out:
        assert out.fetched == prompt and len(out.rows) == BLOCKS
    assert target.free_rows == 16


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP is POSIX only")
def test_fetch_job_cancel_skips_a_queued_job_and_stops_a_running_one(donor, layout, enabled):
    """With the donor stopped, the first job waits in its pin and two more
    queue behind it. Cancelling the second before it started skips it (no
    pin: the donor never sees it; FetchFellBack stage ``queued``); cancelling the running first one makes its delivery
    fall back once the pin answers; the third, not cancelled, completes."""
    proc, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-cancel")
    stop_process(proc)
    try:
        running = target.fetch_async(advice.hint, prompt, manifest)
        skipped = target.fetch_async(advice.hint, prompt, manifest)
        kept = target.fetch_async(advice.hint, prompt, manifest)
        deadline = time.monotonic() + 5
        while running.state != "running" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (running.state, skipped.state, kept.state) == ("running", "queued", "queued")
        assert skipped.cancel() is True
        assert skipped.state == "cancelled"
        assert skipped.cancel() is False  # already cancelled, by the call before
        assert running.cancel() is False
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    with pytest.raises(kv_reuse.FetchFellBack) as e:
        running.result(timeout_s=10)
    assert e.value.args[2] == "transfer_cancelled", e.value.args
    with pytest.raises(kv_reuse.FetchFellBack) as e:
        skipped.result(timeout_s=10)
    assert e.value.args[1:] == ("queued", "cancelled"), e.value.args
    del e
    with kept.result(timeout_s=10) as out:
        assert out.fetched == prompt and len(out.rows) == BLOCKS
    assert kept.state == "done" and kept.cancel() is False
    assert target.free_rows == 16
    proc.stdin.write("pins\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"pins": 0}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
def test_fetch_async_in_a_forked_child_runs_on_a_thread_of_the_child(donor, layout, enabled):
    """A child forked after the target's fetch thread started inherits the
    target but not the thread: its ``fetch_async`` starts a thread of its
    own, so ``result()`` returns (it used to wait forever)."""
    _, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-fork")
    with target.fetch_async(advice.hint, prompt, manifest).result() as out:
        assert out.fetched == prompt  # the parent's fetch thread is running
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's teardown
        try:
            os.close(r)
            job = target.fetch_async(advice.hint, prompt, manifest)
            done = []
            t = threading.Thread(target=lambda: done.append(job.result()), daemon=True)
            t.start()
            t.join(10)
            if done:
                with done[0] as out:
                    msg = f"ok {len(out.rows)} {int(out.fetched == prompt)}"
            else:
                msg = "hung"
            os.write(w, msg.encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, f"error {type(e).__name__}: {e}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    assert got == f"ok {BLOCKS} 1", got
    # The parent's own thread still serves the parent.
    with target.fetch_async(advice.hint, prompt, manifest).result() as out:
        assert out.fetched == prompt
    assert target.free_rows == 16
    assert target.free_rows == 16


def test_a_stream_gate_is_refused_by_a_host_target_and_never_left_waiting(donor, layout, enabled):
    """A host target delivers to no CUDA stream: a gate is refused by name,
    nothing was reserved or pinned, and the gate reads ended (wait() returns
    False at once instead of blocking the engine thread)."""
    proc, report = donor
    target = kv_reuse.Target(layout, rows=8)
    advice = router_for(report, layout, enabled, target).advise("req-gate-host", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    gate = kv_reuse.StreamGate(0, 0)
    with pytest.raises(kv_reuse.BadArgument, match="^gate: a host target"):
        target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]), gate=gate)
    assert gate.ended and not gate.enqueued and gate.fetch_from is None
    started = time.monotonic()
    assert gate.wait() is False
    assert time.monotonic() - started < 1.0
    assert target.free_rows == 8
    proc.stdin.write("pins\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"pins": 0}


def test_reuse_off_by_default_attaches_no_hint(donor, layout):
    _, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, kv_reuse.Settings(env={}), target)
    advice = router.advise("req-off", report["hashes"], target.engine_id)
    assert not advice.admitted and advice.hint is None
    assert advice.reason == "reuse_disabled" and advice.terms is None


def test_a_killed_donor_falls_back(donor, layout, enabled):
    proc, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-dead", report["hashes"], target.engine_id)
    assert advice.admitted
    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(kv_reuse.FetchFellBack) as e:
        target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]))
    _, stage, _cause = e.value.args
    assert stage in ("import", "pin"), e.value.args
    assert target.free_rows == 8
    assert_reclaimed(proc.pid)


def test_a_hint_for_another_prompt_is_refused(donor, layout, enabled):
    _, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-x", report["hashes"], target.engine_id)
    other = kv_reuse.sequence_hashes(list(range(5, 5 + TOKENS_PER_BLOCK * BLOCKS)), TOKENS_PER_BLOCK)
    with pytest.raises(kv_reuse.PromptMismatch):
        target.fetch(advice.hint, other, bytes.fromhex(report["manifest"]))
    assert target.free_rows == 8


def test_a_hint_for_another_prompt_is_refused_before_its_dead_donor_is_imported(donor, layout, enabled):
    """The prompt check comes first: with the donor killed and its segments
    reclaimed, a hint for another prompt is still PromptMismatch (not a
    fallback at `import`), and only the right prompt reaches the import."""
    proc, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-gone", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    manifest = bytes.fromhex(report["manifest"])
    proc.kill()
    proc.wait(timeout=10)
    assert_reclaimed(proc.pid)
    other = kv_reuse.sequence_hashes(list(range(5, 5 + TOKENS_PER_BLOCK * BLOCKS)), TOKENS_PER_BLOCK)
    with pytest.raises(kv_reuse.PromptMismatch, match=r"hint\.sequence_hashes\[0\]` differs"):
        target.fetch(advice.hint, other, manifest)
    with pytest.raises(kv_reuse.PromptMismatch, match=f"holds {BLOCKS} blocks, the prompt only 2"):
        target.fetch(advice.hint, report["hashes"][:2], manifest)
    with pytest.raises(kv_reuse.FetchFellBack, match="donor import") as e:
        target.fetch(advice.hint, report["hashes"], manifest)
    stage = e.value.args[1]
    del e  # the traceback would keep this frame's objects past the leak check
    assert stage == "import"
    assert target.free_rows == 8


def test_a_hint_for_another_donor_or_generation_is_refused_before_dst_blocks(donor, layout, enabled):
    """The hint's identity (donor engine, bank generation) is checked before
    ``dst_blocks``: a hint that is not for this manifest is HintRefused naming
    that cause, not BadArgument for a block count that means nothing."""
    _, report = donor
    prompt, manifest, target, advice = admitted_target(report, layout, enabled, "req-ident")
    # Another donor's manifest (another engine): the hint is not for it.
    other = kv_reuse.DonorBank(layout, slots=2).manifest()
    # The same donor, but a hint for another generation of its bank (the
    # envelope's payload is a string-keyed map: the key, then its fixint).
    field = b"\xafbank_generation"
    assert advice.hint.count(field + b"\x01") == 1
    stale = advice.hint.replace(field + b"\x01", field + b"\x02")
    for hint, man, why in ((advice.hint, other, r"`hint\.donor_engine_id` \S+ but the donor bank belongs to"),
                           (stale, manifest, r"`hint\.bank_generation` 2 but the donor bank is generation 1")):
        for dst in ([0], None, list(range(BLOCKS))):
            with pytest.raises(kv_reuse.HintRefused, match=why) as e:
                target.fetch(hint, prompt, man, dst_blocks=dst)
            assert type(e.value) is kv_reuse.HintRefused, e.value
            del e  # the traceback would keep this frame's objects past the leak check
    assert target.free_rows == 16
    # The right manifest and generation with a wrong count: the allocator's bug.
    with pytest.raises(kv_reuse.BadArgument, match=rf"^dst_blocks: 1 ids given, the hint fetches {BLOCKS} blocks"):
        target.fetch(advice.hint, prompt, manifest, dst_blocks=[0])


def _killing_probe(proc, honest_after):
    """A liveness probe that SIGKILLs the donor process on its first call
    (before the first byte: the donor dies mid-fetch, after granting the
    pin) and still answers True then. Later calls answer the truth when
    `honest_after`, else keep lying (so only the pin release can notice)."""
    calls = []

    def probe():
        calls.append(proc.poll())
        if len(calls) == 1:
            proc.kill()
            proc.wait(timeout=10)
            return True
        return proc.poll() is None if honest_after else True

    return probe, calls


@pytest.mark.parametrize("honest_after, stage", [(True, "transfer"), (False, "verify")])
def test_a_donor_killed_mid_fetch_falls_back_without_leaks(donor, layout, enabled, honest_after, stage):
    proc, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-mid", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    before = kv_reuse.leak_counters()
    probe, calls = _killing_probe(proc, honest_after)
    with pytest.raises(kv_reuse.FetchFellBack) as e:
        target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]),
                     donor_alive=probe)
    args = e.value.args
    del e  # the traceback would keep this frame's objects past the leak check
    assert args[1] == stage, args
    assert calls[0] is None, "the donor was alive when the fetch started"
    assert proc.returncode == -9
    # No destination row kept, no pin, mapping or fd of the dead donor held.
    assert target.free_rows == 8
    after = kv_reuse.leak_counters()
    for key in ("open_fds", "shm_mappings", "pins", "reserved_blocks"):
        assert after[key] == before[key], (key, before[key], after[key])
    assert_reclaimed(proc.pid)


def test_a_raising_or_non_bool_probe_counts_as_a_dead_donor(donor, layout, enabled):
    proc, report = donor
    target = kv_reuse.Target(layout, rows=8)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-probe", report["hashes"], target.engine_id)
    manifest = bytes.fromhex(report["manifest"])

    def raising():
        raise RuntimeError("probe broke")

    # Still a fallback (fail closed), but the probe's own error is the
    # fallback's __cause__: a buggy probe must not pass for a dead donor
    # without a trace. Through fetch and through fetch_async's job alike.
    cases = ((raising, RuntimeError, "probe broke"),
             (lambda: "yes", TypeError, "donor_alive returned 'yes', not a bool"))
    for probe, kind, text in cases:
        for run in (lambda p: target.fetch(advice.hint, report["hashes"], manifest, donor_alive=p),
                    lambda p: target.fetch_async(advice.hint, report["hashes"], manifest,
                                                 donor_alive=p).result()):
            with pytest.raises(kv_reuse.FetchFellBack, match="DonorUnreachable|liveness") as info:
                run(probe)
            cause = info.value.__cause__
            assert type(cause) is kind and str(cause) == text, repr(cause)
            # The tracebacks hold this frame (and the target) past the leak check.
            del info, cause
    # A probe that answers True raises nothing and chains nothing.
    with target.fetch(advice.hint, report["hashes"], manifest, donor_alive=lambda: True) as out:
        assert out.fetched == report["hashes"]
    with pytest.raises(kv_reuse.BadArgument, match="donor_alive: is not callable"):
        target.fetch(advice.hint, report["hashes"], manifest, donor_alive=3)
    with pytest.raises(kv_reuse.BadArgument, match="pin_timeout_s"):
        target.fetch(advice.hint, report["hashes"], manifest, pin_timeout_s=0)
    # The donor is fine: a fetch without a probe still completes.
    with target.fetch(advice.hint, report["hashes"], manifest) as out:
        assert out.fetched == report["hashes"]
    assert target.free_rows == 8
