"""Shared fixtures: a layout and settings that admit a fetch, and a leak
check around every test (the kv_bank leak counters, exposed to Python)."""

import os
import signal
import time

import pytest

import kv_reuse

# 64-token blocks: with the default costs (30 us/token prefill, 400 us/block
# transfer) each fetched block saves ~1.5 ms, so 6 blocks clear the 2 ms bar.
TOKENS_PER_BLOCK = 64
BLOCKS = 6
TP = 2

# Counters that must not grow across a test (fds: sockets, shm files).
LEAK_KEYS = (
    "open_fds",
    "shm_entries",
    "shm_mappings",
    "pins",
    "reserved_blocks",
    "lease_holders",
    "background_threads",
)


def stop_process(proc, within_s=10.0):
    """SIGSTOPs the child process ``proc`` and returns once every thread of
    it has stopped. ``os.kill`` returns before that: the kernel wakes one
    thread to begin the group stop, and until it gets a CPU the others still
    run. On a loaded machine a nats-server stopped so still acknowledged the
    next JetStream put (test_publisher), and a donor's pin service can still
    grant a pin. ``waitpid(WUNTRACED)`` reports the stop once it is complete."""
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while True:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            assert os.WIFSTOPPED(status), f"process {proc.pid} did not stop (wait status {status})"
            return
        assert time.monotonic() < deadline, f"process {proc.pid} not stopped {within_s} s after SIGSTOP"
        time.sleep(0.001)


@pytest.fixture
def nats(tmp_path):
    """A nats-server with JetStream on a free loopback port (skipped, or
    failed under CI=true, when none is installed)."""
    from nats_fake import NatsServer, find_nats_server, skip_or_fail

    binary = find_nats_server()
    if binary is None:
        skip_or_fail("nats-server", "no nats-server >= 2.10.0 at $KV_NATS_SERVER, on $PATH or in target/nats (cargo xtask install)")
    server = NatsServer(binary, tmp_path / "js")
    yield server
    server.stop()


@pytest.fixture
def layout():
    return kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, TP)


@pytest.fixture
def enabled():
    return kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={})


def _grown(before):
    after = kv_reuse.leak_counters()
    return {k: (before[k], after[k]) for k in LEAK_KEYS if after[k] > before[k]}


@pytest.fixture(scope="session", autouse=True)
def tokio_process_globals():
    """The first RouterClient's runtime creates tokio's process-wide signal
    socket pair (2 fds kept until exit, not per client): create it before
    any per-test fd count."""
    with pytest.raises(kv_reuse.RouterUnavailable):
        kv_reuse.RouterClient("nats://127.0.0.1:1", timeout_s=0.2)


@pytest.fixture(autouse=True)
def no_leaks():
    before = kv_reuse.leak_counters()
    yield
    # Pin-service threads and lease renewers end asynchronously: wait a bit.
    deadline = time.monotonic() + 5.0
    grown = _grown(before)
    while grown and time.monotonic() < deadline:
        time.sleep(0.05)
        grown = _grown(before)
    assert not grown, f"leaked (before, after): {grown}"
