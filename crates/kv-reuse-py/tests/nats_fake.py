"""A nats-server for the tests and a minimal raw-protocol NATS replier
standing in for a router replica (the NATS client protocol is text: INFO,
CONNECT, SUB, MSG, PUB, PING/PONG)."""

import os
import sys
import socket
import struct
import subprocess
import threading

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# The gpu_serving harness's nats-server discovery (`$KV_NATS_SERVER`, `$PATH`,
# target/nats; a server older than 2.10.0 passed over, as the Rust harness
# does) and start (on a port it picks itself): one copy (stdlib only).
sys.path.insert(0, os.path.join(REPO, "crates", "kv-testkit", "python"))
from gpu_serving.service import find_nats_server, start_nats_server  # noqa: E402,F401


def ci_requires():
    """True when $CI is true, 1 or yes (case-insensitive): the same rule as
    the Rust tests' kv_transfer::ci_requires and xtask."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_or_fail(what, why):
    """Skips with a printed `SKIP what: why` line; under CI=true a missing
    prerequisite is a failure instead (CI as in kv_transfer::ci_requires)."""
    line = f"SKIP {what}: {why}"
    print(line)
    if ci_requires():
        pytest.fail(line + " (CI)")
    pytest.skip(line)


class NatsServer:
    """A nats-server on a loopback port it picks itself
    (`gpu_serving.service.start_nats_server`), stopped by `stop()`."""

    def __init__(self, binary, store_dir, extra_args=()):
        # JetStream on: the router binary keeps its donor directory in a KV bucket.
        # `extra_args`: e.g. ("--user", "u", "--pass", "p") for a server that authenticates.
        self.proc, self.port = start_nats_server(binary, str(store_dir), tuple(extra_args))
        self.url = f"nats://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def msgpack(v):
    """MessagePack of None, bool, a non-negative int, float (as float64), str
    and dict values: a refusal reply, or a decision with its cost terms."""
    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        assert 0 <= v < 2**64
        return bytes([v]) if v < 128 else b"\xcf" + struct.pack(">Q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        assert len(b) < 256
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else bytes([0xD9, len(b)])) + b
    assert isinstance(v, dict) and len(v) < 16
    return bytes([0x80 | len(v)]) + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())


class Replier(threading.Thread):
    """Subscribes to `subject` (queue group kv_reuse_router) and answers
    each request with `reply(payload)`, or never when `reply` is None.
    `requests` collects the payloads received."""

    def __init__(self, url, subject, reply):
        super().__init__(daemon=True)
        host, port = url.rsplit("//", 1)[1].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self.file = self.sock.makefile("rb")
        self.reply = reply
        self.requests = []
        assert self.file.readline().startswith(b"INFO")
        self.sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
                          + f"SUB {subject} kv_reuse_router 1\r\nPING\r\n".encode())
        # PONG after our PING: the server has registered the SUB.
        while (line := self.file.readline()) and not line.startswith(b"PONG"):
            pass
        self.sock.settimeout(None)

    def run(self):
        try:
            while line := self.file.readline():
                if line.startswith(b"PING"):
                    self.sock.sendall(b"PONG\r\n")
                    continue
                parts = line.split()
                if parts[:1] not in ([b"MSG"], [b"HMSG"]):
                    continue
                size = int(parts[-1])
                body = self.file.read(size + 2)[:size]
                if parts[0] == b"HMSG":
                    body = body[int(parts[-2]):]
                self.requests.append(body)
                inbox = parts[3] if len(parts) >= (6 if parts[0] == b"HMSG" else 5) else None
                if self.reply is not None and inbox is not None:
                    out = self.reply(body)
                    self.sock.sendall(b"PUB " + inbox + f" {len(out)}\r\n".encode() + out + b"\r\n")
        except (OSError, ValueError):
            pass  # closed by stop()

    def stop(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.file.close()
        self.sock.close()
        self.join(timeout=5)


def request(url, subject, payload=b"", timeout=5.0):
    """One NATS request over the raw protocol (an inbox, a PUB with it as
    the reply subject, the first MSG on it): e.g. a JetStream API call such
    as `$JS.API.STREAM.DELETE.KV_<bucket>`. Returns the reply payload."""
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        f = sock.makefile("rb")
        assert f.readline().startswith(b"INFO")
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB _INBOX.fake 1\r\n'
                     + f"PUB {subject} _INBOX.fake {len(payload)}\r\n".encode() + payload + b"\r\n")
        while line := f.readline():
            if line.startswith(b"PING"):
                sock.sendall(b"PONG\r\n")
            elif line.startswith(b"MSG"):
                size = int(line.split()[-1])
                return f.read(size + 2)[:size]
        raise AssertionError(f"no reply to {subject}")


ROUTER_SOURCE = os.path.join(REPO, "crates", "kv-router-glue", "src", "bin", "kv-reuse-router.rs")


def find_router_binary():
    """$KVQ_ROUTER_BIN, else the workspace's debug or release build of
    `kv-reuse-router`; None when absent."""
    for cand in (os.environ.get("KVQ_ROUTER_BIN"),
                 os.path.join(REPO, "target", "debug", "kv-reuse-router"),
                 os.path.join(REPO, "target", "release", "kv-reuse-router")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _openssl(*args):
    """Runs `openssl args...`; raises RuntimeError with its stderr on failure."""
    try:
        out = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise RuntimeError(f"cannot run openssl: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed ({out.returncode}): {out.stderr.strip()}")


def make_pki(directory, clients=()):
    """A throwaway PKI in `directory` (the Rust tests' kv_router_glue::test_pki
    made the same way): CA `ca.pem`/`ca.key`, a server certificate for
    IP:127.0.0.1 (`server.pem`/`server.key`) and one client certificate
    `<name>.pem`/`<name>.key` (clientAuth) per name in `clients`, RSA-2048,
    valid one day. Skips (fails under CI=true) when openssl cannot make them.
    Returns {name: (pem, key)} with "ca" and "server" included."""
    d = str(directory)
    os.makedirs(d, exist_ok=True)
    p = lambda name: os.path.join(d, name)  # noqa: E731
    try:
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kv-test-ca",
                 "-keyout", p("ca.key"), "-out", p("ca.pem"))
        for name, cn, ext in [("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1"),
                              *[(c, c, "extendedKeyUsage=clientAuth") for c in clients]]:
            with open(p(f"{name}.ext"), "w") as f:
                f.write(ext + "\n")
            _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                     "-keyout", p(f"{name}.key"), "-out", p(f"{name}.csr"))
            _openssl("x509", "-req", "-in", p(f"{name}.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                     "-CAcreateserial", "-days", "1", "-extfile", p(f"{name}.ext"), "-out", p(f"{name}.pem"))
    except RuntimeError as e:
        skip_or_fail("openssl", f"could not make test certificates ({e})")
    return {name: (p(f"{name}.pem"), p(f"{name}.key")) for name in ("ca", "server", *clients)}
