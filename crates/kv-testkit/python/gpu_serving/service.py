"""nats-server and the router service as processes, for the harness's ``--router service``.

With ``--router service`` no router lives in the harness: the decode worker
is a ``kv_reuse.WorkerPublisher.donor`` (its bank's record in the JetStream
donor directory, its KV events and announcements on NATS), the prefill worker
announces its targets (``WorkerPublisher.target``) and resolves the donor's
manifest from the directory (``kv_reuse.DonorDirectory``), and the harness
advises through ``kv_reuse.RouterClient`` against the ``kv-reuse-router``
binary (docs/router-service.md). This module starts and stops the two
servers.

Binaries: ``$KV_NATS_SERVER`` (``cargo xtask install`` and the GPU bundle's
``run.sh`` export it) else ``nats-server`` on ``$PATH``; ``$KVQ_ROUTER_BIN``
(``run.sh``) else the workspace's release / debug build of
``kv-reuse-router``. Neither found: :class:`ServiceError` naming which.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional, Tuple

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))

# Announce timing of the router service (``--announce-period-ms``,
# ``--missed-periods``) and of the workers' publishers. A worker whose
# process is busy for seconds (a 32K prefill, a model build on a loaded
# host) still announces from its publisher thread, but 200 ms periods
# dropped busy workers as silent on a loaded 2-core host; one second and 60
# missed periods never drop a live worker inside a run.
ANNOUNCE_PERIOD_S = 1.0
MISSED_PERIODS = 60


class ServiceError(RuntimeError):
    """A server could not be found or started; ``field`` names which (``nats_server``, ``router``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _executable(cands: List[Optional[str]]) -> Optional[str]:
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    return None


MIN_NATS_SERVER_VERSION = (2, 10, 0)


def nats_server_version(binary: str) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of the first ``vX.Y.Z`` word of ``binary --version``
    (``nats-server: v2.10.22``); None when it prints none or fails."""
    try:
        out = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    for word in (out.stdout + out.stderr).split():
        m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)(?:[-+].*)?", word)
        if m:
            return (int(m.group(1)), int(m.group(2)), int(m.group(3)))
    return None


def find_nats_server() -> Optional[str]:
    """``$KV_NATS_SERVER``, ``nats-server`` on ``$PATH`` or ``target/nats``, passing over
    one older than 2.10.0 (the JetStream donor directory fails against it, and
    kv_router_glue's find_nats_server refuses it); None when none is usable."""
    for c in (os.environ.get("KV_NATS_SERVER"), shutil.which("nats-server"),
              os.path.join(REPO, "target", "nats", "bin", "nats-server")):
        if c and os.access(c, os.X_OK):
            version = nats_server_version(c)
            if version is not None and version >= MIN_NATS_SERVER_VERSION:
                return c
    return None


def find_router() -> Optional[str]:
    """``$KVQ_ROUTER_BIN`` or the workspace's release / debug ``kv-reuse-router``; None when none."""
    return _executable([os.environ.get("KVQ_ROUTER_BIN"),
                        os.path.join(REPO, "target", "release", "kv-reuse-router"),
                        os.path.join(REPO, "target", "debug", "kv-reuse-router")])


def reported_port(ports_dir: str) -> Optional[int]:
    """The client port nats-server wrote to its ports file in ``ports_dir``
    (``--ports_file_dir``: ``{"nats": ["nats://127.0.0.1:<port>"], ...}``);
    None until the file is there and whole."""
    for name in os.listdir(ports_dir):
        if name.endswith(".ports"):
            try:
                with open(os.path.join(ports_dir, name)) as f:
                    return int(json.load(f)["nats"][0].rsplit(":", 1)[1])
            except (OSError, ValueError, KeyError, IndexError):
                return None
    return None


def start_nats_server(binary: str, store_dir: str,
                      extra_args: Tuple[str, ...] = ()) -> Tuple[subprocess.Popen, int]:
    """A JetStream nats-server with its store in ``store_dir`` on a loopback port it
    picks itself (``-p -1``, read back from its ports file under ``store_dir``: a port
    picked here and released could be taken before the server binds it), once it
    accepts connections; ``extra_args`` as given (``--user``, ``--tls``, ...).

    Returns the process and its port. Raises :class:`ServiceError` (``nats_server``)
    when it exits or reports no listening port within 10 s (the process is killed).
    """
    ports_dir = os.path.join(store_dir, "ports")
    os.makedirs(ports_dir, exist_ok=True)
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", ports_dir,
                             "-js", "-sd", store_dir, *extra_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError("nats_server", f"exited with code {proc.returncode}")
        port = reported_port(ports_dir)
        if port is not None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return proc, port
            except OSError:
                pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise ServiceError("nats_server", f"reported no listening port in {ports_dir} within 10 s")


class RouterService:
    """A JetStream nats-server on a loopback port it picks itself (``-p -1``, read
    back from its ports file: a port picked here and released could be taken
    before the server binds it) and a ``kv-reuse-router`` following it.

    ``tokens_per_block``: the engines' block size (the router's cost model).
    ``settings``: reuse flags of the router (``--enable-...`` names without
    dashes), e.g. ``enable_decode_to_prefill_gpu_reuse``; ``extra_args``: more router
    arguments as given (``["--advise-busy-poll-us", "200"]``). ``url`` is the NATS
    URL; ``ready`` the router's ready line (JSON). :meth:`stop` terminates
    both (SIGTERM: the router drains) and removes the JetStream store.
    Raises :class:`ServiceError` when a binary is missing, the server does
    not accept connections within 10 s, or the router exits or prints no
    ready line within 30 s.
    """

    def __init__(self, tokens_per_block: int, settings: List[str], extra_args: Optional[List[str]] = None) -> None:
        nats_bin, router_bin = find_nats_server(), find_router()
        if nats_bin is None:
            raise ServiceError("nats_server", "not found ($KV_NATS_SERVER, $PATH, target/nats: cargo xtask install)")
        if router_bin is None:
            raise ServiceError("router", "kv-reuse-router not found ($KVQ_ROUTER_BIN, target/release, target/debug)")
        self.dir = tempfile.mkdtemp(prefix="gpu-serving-nats-")
        self.nats: Optional[subprocess.Popen] = None
        self.router: Optional[subprocess.Popen] = None
        try:
            self.nats, self.port = start_nats_server(nats_bin, self.dir)
            self.url = f"nats://127.0.0.1:{self.port}"
            args = [router_bin, "--nats-url", self.url, "--metrics-addr", "127.0.0.1:0",
                    "--tokens-per-block", str(tokens_per_block),
                    "--announce-period-ms", str(int(ANNOUNCE_PERIOD_S * 1000)),
                    "--missed-periods", str(MISSED_PERIODS)] + ["--" + s.replace("_", "-") for s in settings] \
                + list(extra_args or [])
            # KV_REUSE_* variables are router settings; none of the harness's own may leak in.
            env = {k: v for k, v in os.environ.items() if not k.startswith("KV_REUSE_")}
            self.router = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env)
            self.ready = self._ready_line()
        except BaseException:
            self.stop()
            raise

    def _ready_line(self) -> Dict:
        assert self.router is not None and self.router.stdout is not None
        # The router prints its ready line once serving, or exits; a router
        # that does neither within 30 s is refused rather than waited on.
        ready, _, _ = select.select([self.router.stdout], [], [], 30.0)
        if not ready:
            raise ServiceError("router", "no ready line within 30 s")
        line = self.router.stdout.readline()
        if not line:
            self.router.wait(timeout=30)
            raise ServiceError("router", f"exited with code {self.router.returncode} before its ready line")
        got = json.loads(line)
        if got.get("event") != "ready":
            raise ServiceError("router", f"first line is not the ready line: {line.strip()}")
        return got

    def advise_latency(self) -> Optional[Dict[str, float]]:
        """The router's own time per advise request (payload in to reply out), from its /metrics.

        ``{"count", "mean_us", "p50_le_us", "p99_le_us"}``: the histogram's
        request count, mean, and the upper bounds of the buckets holding the
        median and the 99th percentile (``kv_reuse_advise_latency_seconds``,
        buckets 1 µs x 2^k). None when the router is gone or serves no
        metrics. What a client measures beyond this is NATS and the client.
        """
        addr = self.ready.get("metrics_addr") if isinstance(getattr(self, "ready", None), dict) else None
        if not addr or not self.router_alive():
            return None
        try:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        return histogram_summary(text, "kv_reuse_advise_latency_seconds")

    def router_alive(self) -> bool:
        """True while the router process runs."""
        return self.router is not None and self.router.poll() is None

    def stop(self) -> Dict[str, Optional[int]]:
        """Terminates the router (drains) then nats-server; their exit codes. Idempotent."""
        codes: Dict[str, Optional[int]] = {}
        for name, p in (("router", self.router), ("nats_server", self.nats)):
            if p is None:
                continue
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            codes[name] = p.returncode
            if p.stdout is not None:
                p.stdout.close()
        self.router = None
        shutil.rmtree(self.dir, ignore_errors=True)
        return codes


def histogram_summary(text: str, name: str) -> Optional[Dict[str, float]]:
    """Count, mean and the p50 / p99 bucket bounds (µs) of Prometheus histogram ``name`` in ``text``; None if absent."""
    buckets: List[Tuple[float, float]] = []
    total = count = None
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(name + "_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count = float(line.rsplit(" ", 1)[1])
    if not count or total is None:
        return None

    def bound(q: float) -> float:
        for le, c in sorted(buckets):
            if c >= q * count:
                return le * 1e6
        return float("inf")

    return {"count": count, "mean_us": round(total / count * 1e6, 1), "p50_le_us": bound(0.5), "p99_le_us": bound(0.99)}
