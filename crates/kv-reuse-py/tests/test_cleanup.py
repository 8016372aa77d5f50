"""A test that fails reports its own failure alone: what it opened is
closed on every path, so conftest's leak check does not add a second error
that hides the first among leak counters."""

import os
import subprocess
import sys

from nats_fake import find_nats_server, skip_or_fail

HERE = os.path.dirname(os.path.abspath(__file__))
PASSWORD_TEST = "test_publisher.py::test_a_password_in_nats_url_never_reaches_an_error_message"


def test_a_failing_publisher_test_reports_its_failure_not_also_a_leak():
    """test_publisher's password test stops nats-server (SIGSTOP) so that a
    publish times out. Where the publish went through instead, its failure
    came with an error: the publisher it never closed, reported by the leak
    check. Run with a stop that does nothing (no_stop_plugin.py), it must
    fail, and fail alone."""
    if find_nats_server() is None:
        skip_or_fail("nats-server", "no nats-server >= 2.10.0 (cargo xtask install)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no_stop_plugin",
         os.path.join(HERE, PASSWORD_TEST)],
        cwd=HERE, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    # The plugin took: the publish went through where a timeout was expected.
    assert "DID NOT RAISE" in out, out
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.startswith("1 failed in "), out
    assert "leaked" not in out, out
