"""The donor's shared memory across fork and when a store is rolled back:
a forked child that exits leaves the parent's segments, leases and pin
socket alone (and does not panic), a bank too large for /dev/shm is refused
up front naming ``slots``, and aborted or dropped stores give their slots
back at once."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kv_reuse
from conftest import TOKENS_PER_BLOCK

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.parametrize("mode", ["exit", "daemon", "del"])
def test_a_forked_child_leaves_the_parents_donor_serving(mode, tmp_path):
    """``exit``: the child of a donor simply exits (finalization drops the
    inherited bank, pin server and target; the wheel's exit hook runs and
    must remove none of the parent's names). ``daemon``: the same with a
    bank of the child's own kept alive past finalization by a daemon
    thread, which the exit hook must remove. ``del``: it deletes them. Either
    way the parent's /dev/shm entries and socket stay, a fetch from it after
    the child is gone returns every byte, and the child's drop raises
    nothing (it used to unlink the segments and raise PanicException
    ``threads should not terminate unexpectedly``)."""
    sock = tmp_path / "pin.sock"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fork_proc.py"), str(sock), mode],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "panicked" not in proc.stderr and "PanicException" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["child_exit"] == 0
    assert len(result["before"]) == 4, result  # 2 segments + 2 leases
    assert result["after"] == result["before"], "the child's exit removed the parent's shm"
    assert result["socket"], "the child's exit removed the parent's pin socket"
    assert result["fetch"] is True, result["fetch"]
    if mode == "daemon":
        # The exit hook ran in the child: its own bank's names are gone
        # (held by a live daemon thread, finalization never dropped it),
        # while the parent's above were left alone.
        child = result["child"]
        assert len(child["own"]) == 4, child
        left = child["own_after"]
        for name in left:
            os.unlink(os.path.join("/dev/shm", name))
        assert left == [], f"the child's own bank left {left}"
    if mode == "del":
        # A store in the child would write the parent's memory behind its slot table.
        assert result["child"]["store"].startswith("`store` refused in process "), result["child"]
        assert result["child"]["del"] == "ok", result["child"]


def test_a_bank_larger_than_dev_shm_is_refused_naming_slots():
    """The pages are reserved at creation: a bank that does not fit is
    ``BankFailed`` naming ``slots`` here, never a SIGBUS at a later write,
    and leaves no segment or lease behind."""
    st = os.statvfs("/dev/shm")
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit: nothing is refused up front")
    size = st.f_blocks * st.f_frsize
    layout = kv_reuse.Layout(32, 8, 128, "f32", 64, 2)  # 8 MiB per rank block
    slots = size // layout.rank_block_bytes + 1  # each rank alone exceeds /dev/shm
    mine = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"kvbank-{os.getpid()}-")]  # noqa: E731
    before = mine()
    with pytest.raises(kv_reuse.BankFailed) as e:
        kv_reuse.DonorBank(layout, slots=slots)
    msg = str(e.value)
    assert msg.startswith("slots: the bank needs %d bytes of host shared memory for its slots" % (2 * slots * layout.rank_block_bytes)), msg
    assert "bytes free" in msg and "/dev/shm" in msg, msg
    assert mine() == before


def refusal(call):
    """The message of the ``BankFailed`` that ``call()`` raises."""
    try:
        call()
    except kv_reuse.BankFailed as e:
        return str(e)
    raise AssertionError("BankFailed not raised")


def blocks(layout, n):
    return np.ones((n, layout.rank_block_elems), dtype=np.float32)


def test_an_aborted_or_dropped_store_gives_its_slots_back_at_once(layout):
    """With a 30 s store timeout a quarantine would hold the slots for 30 s:
    ``abort()``, a ``with`` block left by an exception and a dropped store
    free them at once (Python's ``write`` returned before any of them, so
    nothing can still be copying)."""
    bank = kv_reuse.DonorBank(layout, slots=4, store_timeout_s=30.0)
    full = list(range(10**6, 10**6 + 4 * TOKENS_PER_BLOCK))

    def store_all_four():
        s = bank.store(full)
        assert len(s.sequence_hashes) == 4
        assert s.abort() is True

    s = bank.store(list(range(2 * TOKENS_PER_BLOCK)))  # no write ran
    assert s.abort() is True and s.abort() is False
    store_all_four()
    with pytest.raises(RuntimeError, match="engine failed"):
        with bank.store(list(range(2 * TOKENS_PER_BLOCK))) as s:
            s.write(0, blocks(layout, 2))  # one rank wrote, the other never will
            raise RuntimeError("engine failed")
    store_all_four()
    s = bank.store(list(range(3 * TOKENS_PER_BLOCK)))
    s.write(1, blocks(layout, 3))
    del s  # nobody can ack it any more
    store_all_four()
    assert bank.stats["stores_rolled_back"] == 6
    assert bank.stats["stores_ready"] == 0


def test_a_timed_out_store_is_quarantined_and_the_error_says_until_when(layout):
    """A store rolled back by ``store_timeout_s`` (a rank may still be
    copying) keeps its slots for one more timeout: the refusal names them
    as quarantined and when they return, not as pinned or pending."""
    bank = kv_reuse.DonorBank(layout, slots=4, store_timeout_s=0.3)
    late = bank.store(list(range(3 * TOKENS_PER_BLOCK)))
    late.write(0, blocks(layout, 3))
    time.sleep(0.4)
    # The message only: an ExceptionInfo kept here would hold this frame
    # (and the bank) in a reference cycle past the leak check.
    msg = refusal(lambda: bank.store(list(range(10**6, 10**6 + 2 * TOKENS_PER_BLOCK))))
    assert "0 pinned, 0 pending in open stores, 3 quarantined after a rolled-back store" in msg, msg
    ms = int(msg.split("until ")[1].split(" ms from now")[0])
    assert 0 < ms <= 300, msg
    assert late.abort() is False  # already rolled back by the timeout
    time.sleep(0.35)
    s = bank.store(list(range(10**6, 10**6 + 4 * TOKENS_PER_BLOCK)))
    assert len(s.sequence_hashes) == 4
    s.abort()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.parametrize("which", ["client", "directory", "publisher"])
@pytest.mark.parametrize("mode", ["use", "exit"])
def test_a_forked_child_refuses_the_parents_nats_connection(which, mode, nats):
    """A RouterClient, DonorDirectory or target WorkerPublisher inherited by
    a forked child: its calls are refused naming the call and both
    processes (they would block on a runtime whose worker thread is the
    parent's, or write into the parent's NATS stream), ``close()`` returns
    at once, and the child's drop raises nothing. Before, the child's
    ``close()`` of a publisher hung and its drop of a RouterClient raised
    ``PanicException: threads should not terminate unexpectedly``. The
    parent's connection still works afterwards."""
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "fork_nats_proc.py"), nats.url, which, mode],
        capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "panicked" not in proc.stderr and "PanicException" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == 0, result
    if mode == "use":
        child = result["child"]
        cls = {"client": "RouterClient", "directory": "DonorDirectory", "publisher": "WorkerPublisher"}[which]
        call = {"client": "advise", "directory": "manifest", "publisher": "publish_prefix_stored"}[which]
        exc = "RouterUnavailable" if which == "client" else "PublishFailed"
        assert child["call"].startswith(f"{exc}: `{call}` refused in process "), child
        assert f"this {cls} was created in process {os.getpid()}" not in child["call"]  # the script's pid, not pytest's
        assert f"create a new {cls} in this process" in child["call"], child
        if which == "directory":
            assert child["flag"].startswith("PublishFailed: `donors` refused in process "), child
        else:
            assert child["flag"] is False, child  # connected / open
        assert child["close_s"] < 1.0, child
    after = result["after"]
    if which == "client":
        assert after == "AdviseRefused: router is draining", after  # answered over the parent's connection
    elif which == "directory":
        assert after == {"donors": 0, "manifest": None}, after
    else:
        assert after == 2, after  # two sealed blocks of 16 published
