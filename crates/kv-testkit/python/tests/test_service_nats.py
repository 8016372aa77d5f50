"""gpu_serving.service's nats-server lookup (no torch needed)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_serving import service  # noqa: E402


def test_a_nats_server_older_than_2_10_is_passed_over(tmp_path, monkeypatch):
    # Debian 12's nats-server 2.9.10 starts, then fails the JetStream donor
    # directory; kv_router_glue's find_nats_server refuses it too.
    old = tmp_path / "nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.9.10'\n")
    old.chmod(0o755)
    monkeypatch.setenv("KV_NATS_SERVER", str(old))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert service.nats_server_version(str(old)) == (2, 9, 10)
    assert service.find_nats_server() != str(old)
    old.write_text("#!/bin/sh\necho 'nats-server: v2.11.3'\n")
    assert service.find_nats_server() == str(old)
    old.write_text("#!/bin/sh\necho 'nats-server: v2.10.0-RC.1'\n")
    assert service.nats_server_version(str(old)) == (2, 10, 0)
    assert service.find_nats_server() == str(old)
    old.write_text("#!/bin/sh\necho hello\n")
    assert service.nats_server_version(str(old)) is None
    assert service.find_nats_server() != str(old)
