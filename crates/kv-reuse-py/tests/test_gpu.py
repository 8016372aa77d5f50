"""The GPU path: a donor process with a CUDA bank (CUDA IPC), a target
fetching into torch CUDA tensors (the engine's KV cache) through
__cuda_array_interface__, every byte checked, host payload 0. Skips with a
printed reason without torch or a CUDA device (torch is not installed on
the CPU CI machine; it is on the lent H200)."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TOKENS_PER_BLOCK
from donor_proc import pattern
from test_roles import router_for


@pytest.fixture
def enabled():
    """Reuse with the GPU path on (overrides conftest's host-path settings).

    A CUDA donor bank is the cost model's GPU path: without
    ``enable_decode_to_prefill_gpu_reuse`` every advice is
    ``Refuse(GpuPathDisabled)`` (seen on the H200 before this fixture).
    """
    return kv_reuse.Settings(
        {"enable_decode_to_prefill_reuse": True, "enable_decode_to_prefill_gpu_reuse": True}, env={}
    )


HERE = os.path.dirname(os.path.abspath(__file__))
# TP 1 on GPU 0: a bank refuses two TP ranks on one GPU (each rank's part
# names its device), and the lent H200 has one.
TP = 1


@pytest.fixture
def layout():
    """conftest's geometry at TP 1 (see TP above)."""
    return kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, TP)


def torch_cuda():
    try:
        import torch
    except ImportError:
        line = "SKIP test_gpu: torch is not installed"
        print(line)
        pytest.skip(line)
    if not torch.cuda.is_available():
        line = "SKIP test_gpu: torch sees no CUDA device"
        print(line)
        pytest.skip(line)
    return torch


def spawn_donor(tmp_path, mode):
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "donor_proc.py"), str(tmp_path / "pin.sock"),
         str(TOKENS_PER_BLOCK), str(BLOCKS), str(TP), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


@pytest.fixture(params=["cuda", "cuda-torch"])
def cuda_donor(tmp_path, request):
    """A CUDA donor filled from numpy rows (``cuda``) or from torch CUDA
    tensors device to device (``cuda-torch``)."""
    torch_cuda()  # skips, saying why, before a donor that needs a GPU starts
    proc = spawn_donor(tmp_path, request.param)
    line = proc.stdout.readline()
    assert line, "CUDA donor process printed nothing"
    report = json.loads(line)
    report["mode"] = request.param
    yield proc, report
    if proc.poll() is None:
        proc.stdin.write("quit\n")
        proc.stdin.flush()
    proc.wait(timeout=30)
    proc.stdin.close()
    proc.stdout.close()


@pytest.fixture(autouse=True)
def no_leaks():
    """Overrides conftest's check for this module: the CUDA driver keeps its
    device fds (/dev/nvidia*, its eventfds) open for the process once CUDA
    is initialised, so fds are checked here as a steady state instead (the
    second round trip adds none), and the rest as in conftest."""
    keys = ("shm_entries", "shm_mappings", "pins", "reserved_blocks", "lease_holders")
    before = kv_reuse.leak_counters()
    yield
    after = kv_reuse.leak_counters()
    assert {k: (before[k], after[k]) for k in keys if after[k] > before[k]} == {}


class DlpackOnly:
    """Hides a tensor's __cuda_array_interface__: only DLPack is left."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def round_trip(torch, layout, enabled, report, protocol, request_id):
    """One fetch into fresh torch CUDA caches; every byte checked."""
    n, rows = layout.rank_block_elems, 16
    caches = [torch.full((rows, n), -1.5, dtype=torch.float32, device="cuda:0") for _ in range(TP)]
    given = caches if protocol == "cuda_array_interface" else [DlpackOnly(t) for t in caches]
    torch.cuda.synchronize()  # the engine's writes land before the fetch's copies
    target = kv_reuse.Target(layout, rows=rows, kv_caches=given, gpus=[0] * TP)
    router = router_for(report, layout, enabled, target)
    advice = router.advise(request_id, report["hashes"], target.engine_id)
    assert advice.admitted, advice
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"])) as out:
        assert out.host_payload_bytes == 0, out.transport
        assert out.bytes == BLOCKS * TP * layout.rank_block_bytes
        for rank in range(TP):
            want = np.full((rows, n), -1.5, dtype=np.float32)
            for block, row in enumerate(out.rows):
                want[row] = pattern(layout, rank, block)
            assert caches[rank].cpu().numpy().tobytes() == want.tobytes()
    assert target.free_rows == rows


def test_a_gpu_donor_is_priced_on_the_gpu_path_and_refused_when_it_is_off(cuda_donor, layout, enabled):
    """A CUDA bank's advice prices the GPU path (``terms.path == "gpu"``, the
    GPU block cost); with ``enable_decode_to_prefill_gpu_reuse`` off the
    router refuses it as ``gpu_path_disabled``, keeping its terms."""
    _, report = cuda_donor
    target = types.SimpleNamespace(engine_id="00000000-0000-4000-8000-0000000000b1")
    advice = router_for(report, layout, enabled, target).advise("req-gpu", report["hashes"], target.engine_id)
    assert advice.admitted and advice.reason is None, advice.detail
    assert advice.terms.path == "gpu" and advice.terms.transfer_blocks == BLOCKS
    host_only = kv_reuse.Settings({"enable_decode_to_prefill_reuse": True}, env={})
    advice = router_for(report, layout, host_only, target).advise("req-gpu-off", report["hashes"],
                                                                  target.engine_id)
    assert (advice.admitted, advice.reason) == (False, "gpu_path_disabled")
    assert "enable_decode_to_prefill_gpu_reuse is off" in advice.detail
    assert advice.terms.path == "gpu" and advice.hint is None


@pytest.mark.parametrize("protocol", ["cuda_array_interface", "dlpack"])
def test_cuda_round_trip_into_torch_tensors_moves_no_host_payload(layout, enabled, protocol, cuda_donor):
    torch = torch_cuda()
    proc, report = cuda_donor
    # The donor's store payload by source: numpy rows cross host-to-device,
    # torch CUDA rows device to device with no host payload.
    payload = BLOCKS * TP * layout.rank_block_bytes
    stats = report["stats"]
    if report["mode"] == "cuda-torch":
        assert (stats["store_bytes_from_host"], stats["store_bytes_from_device"]) == (0, payload)
    else:
        assert (stats["store_bytes_from_host"], stats["store_bytes_from_device"]) == (payload, 0)
    round_trip(torch, layout, enabled, report, protocol, "req-gpu-1")
    warm = kv_reuse.leak_counters()
    round_trip(torch, layout, enabled, report, protocol, "req-gpu-2")
    after = kv_reuse.leak_counters()
    for key in ("open_fds", "ipc_mappings", "device_allocations", "pins", "reserved_blocks"):
        assert after[key] <= warm[key], (key, warm[key], after[key])
    proc.stdin.write("pins\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"pins": 0}


def test_a_cpu_torch_tensor_is_refused_on_the_gpu_path():
    torch = torch_cuda()
    # TP 2: the refusals name kv_caches[0] / [1] before any bank is opened.
    layout = kv_reuse.Layout(2, 2, 8, "f32", TOKENS_PER_BLOCK, 2)
    n = layout.rank_block_elems
    good = torch.zeros((4, n), dtype=torch.float32, device="cuda:0")
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]: a CPU tensor on the GPU path"):
        kv_reuse.Target(layout, rows=4, kv_caches=[torch.zeros((4, n)), good], gpus=[0, 0])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: a CUDA tensor on the host path"):
        kv_reuse.Target(layout, rows=4, kv_caches=[torch.zeros((4, n)), good])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: dtype"):
        kv_reuse.Target(layout, rows=4, kv_caches=[good, good.half()], gpus=[0, 0])


def test_device_source_refusals_name_blocks(layout):
    torch = torch_cuda()
    bank = kv_reuse.DonorBank(layout, slots=4, gpus=[0] * TP)
    store = bank.store(list(range(TOKENS_PER_BLOCK * 2)))
    n = layout.rank_block_elems
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: dtype"):
        store.write(0, torch.zeros((2, n), dtype=torch.float16, device="cuda:0"))
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: shape \[3, %d\], expected \[2, %d\]" % (n, n)):
        store.write(0, torch.zeros((3, n), dtype=torch.float32, device="cuda:0"))
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: strides .* are not C-contiguous"):
        store.write(0, torch.zeros((n, 2), dtype=torch.float32, device="cuda:0").t())
    if torch.cuda.device_count() > 1:
        with pytest.raises(kv_reuse.BadArgument, match=r"blocks: on cuda:1, expected cuda:0"):
            store.write(0, torch.zeros((2, n), dtype=torch.float32, device="cuda:1"))
    else:
        print("SKIP device_source other-GPU refusal: one CUDA device")
    assert bank.stats["store_bytes_from_device"] == 0
    # The refusals left nothing half-done: the right tensors store.
    for r in range(TP):
        store.write(r, torch.full((2, n), float(r + 1), dtype=torch.float32, device="cuda:0"))
    assert [store.ack(r) for r in range(TP)] == [r == TP - 1 for r in range(TP)]
    assert bank.stats["store_bytes_from_device"] == 2 * TP * layout.rank_block_bytes
    assert bank.stats["store_bytes_from_host"] == 0


@pytest.mark.parametrize("protocol", ["cuda_array_interface", "dlpack"])
def test_cuda_fetch_into_hf_caches_lands_at_token_positions(layout, enabled, protocol, cuda_donor):
    """kv_layout="hf" on the GPU path: torch CUDA K/V views [1, H, capacity, D]
    of one buffer, blocks landing at tokens 2T.. (dst_token_offset) through
    the gather kernel, every byte equal to the donor's, no host payload."""
    torch = torch_cuda()
    _, report = cuda_donor
    L, T, H, D, rows = 2, TOKENS_PER_BLOCK, 2, 8, 16
    cap = rows * T
    buf = torch.full((L, 2, 1, H, cap + 24, D), -1.5, dtype=torch.float32, device="cuda:0")
    views = [buf[l, kv, :, :, :cap] for l in range(L) for kv in range(2)]
    given = views if protocol == "cuda_array_interface" else [DlpackOnly(v) for v in views]
    torch.cuda.synchronize()
    target = kv_reuse.Target(layout, rows=rows, kv_caches=[given], gpus=[0], kv_layout="hf")
    advice = router_for(report, layout, enabled, target).advise("req-gpu-hf", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]),
                      dst_token_offset=2 * T) as out:
        assert out.host_payload_bytes == 0, out.transport
        assert out.bytes == BLOCKS * layout.rank_block_bytes
        assert out.rows == list(range(2, 2 + BLOCKS))
        want = np.full((L, 2, 1, H, cap + 24, D), -1.5, dtype=np.float32)
        for j in range(BLOCKS):
            b = pattern(layout, 0, j).reshape(L, 2, T, H, D)
            t0 = (2 + j) * T
            want[:, :, 0, :, t0:t0 + T, :] = b.transpose(0, 1, 3, 2, 4)
        assert buf.cpu().numpy().tobytes() == want.tobytes()
    assert target.free_rows == rows


def test_a_layered_gate_releases_each_layer_group_behind_its_own_copies(layout, enabled, cuda_donor):
    """StreamGate(layer_groups=2) on a converting (kv_layout="hf") fetch: one
    group per layer, issued in layer order; a copy of layer 0 enqueued
    behind wait_layer(0) reads every fetched byte of layer 0, and one of the
    whole cache behind wait_layer(1) every fetched byte."""
    import concurrent.futures

    torch = torch_cuda()
    _, report = cuda_donor
    L, T, H, D, rows = 2, TOKENS_PER_BLOCK, 2, 8, 16
    cap = rows * T
    buf = torch.full((L, 2, 1, H, cap, D), -1.5, dtype=torch.float32, device="cuda:0")
    views = [buf[l, kv] for l in range(L) for kv in range(2)]
    torch.cuda.synchronize()
    target = kv_reuse.Target(layout, rows=rows, kv_caches=[views], gpus=[0], kv_layout="hf")
    advice = router_for(report, layout, enabled, target).advise("req-gate-layers", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    stream = torch.cuda.Stream(device="cuda:0")
    gate = kv_reuse.StreamGate(stream.cuda_stream, 0, layer_groups=2)
    assert gate.layer_groups == 2 and gate.groups_issued == []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(target.fetch, advice.hint, report["hashes"], bytes.fromhex(report["manifest"]), gate=gate)
        assert gate.wait(timeout_s=30)
        assert gate.wait_layer(0, timeout_s=30)
        with torch.cuda.stream(stream):
            layer0 = buf[0].clone()  # behind group 0's copies only
        assert gate.wait_layer(1, timeout_s=30)
        with torch.cuda.stream(stream):
            whole = buf.clone()
        out = job.result(timeout=30)
    assert gate.ended and gate.groups_issued == [(0, 1), (1, 2)]
    assert {"first_group", "last_group"} <= set(gate.times_us)
    with out:
        stream.synchronize()
        want = np.full((L, 2, 1, H, cap, D), -1.5, dtype=np.float32)
        for j in range(BLOCKS):
            b = pattern(layout, 0, j).reshape(L, 2, T, H, D)
            want[:, :, 0, :, j * T:(j + 1) * T, :] = b.transpose(0, 1, 3, 2, 4)
        assert layer0.cpu().numpy().tobytes() == want[0].tobytes()
        assert whole.cpu().numpy().tobytes() == want.tobytes()
    assert target.free_rows == rows


def test_a_gated_fetch_releases_the_engine_stream_before_it_returns(layout, enabled, cuda_donor):
    """StreamGate: the fetch runs on another thread; once the gate opens, a
    copy enqueued on the engine's stream (behind the wait) reads every
    fetched byte, while nothing was synchronised by the engine thread. The
    gate names what the fetch delivers before the fetch returned."""
    import concurrent.futures

    torch = torch_cuda()
    _, report = cuda_donor
    n, rows = layout.rank_block_elems, 16
    cache = torch.full((rows, n), -1.5, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    target = kv_reuse.Target(layout, rows=rows, kv_caches=[cache], gpus=[0])
    advice = router_for(report, layout, enabled, target).advise("req-gate", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    stream = torch.cuda.Stream(device="cuda:0")
    gate = kv_reuse.StreamGate(stream.cuda_stream, 0)
    assert gate.fetch_from is None and not gate.enqueued
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(target.fetch, advice.hint, report["hashes"], bytes.fromhex(report["manifest"]), gate=gate)
        assert gate.wait(timeout_s=30)
        assert gate.enqueued and (gate.fetch_from, gate.blocks) == (0, BLOCKS)
        with torch.cuda.stream(stream):
            seen = cache.clone()  # ordered after the fetch's copies by the gate's wait
        out = job.result(timeout=30)
    assert gate.ended
    with out:
        stream.synchronize()
        want = np.full((rows, n), -1.5, dtype=np.float32)
        for block, row in enumerate(out.rows):
            want[row] = pattern(layout, 0, block)
        assert seen.cpu().numpy().tobytes() == want.tobytes()
    # One fetch per gate.
    with pytest.raises(kv_reuse.BadArgument, match="gate"):
        target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]), gate=gate)
    # A gate on a device the target does not deliver to is refused by name.
    with pytest.raises(kv_reuse.BadArgument, match="gate"):
        target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"]),
                     gate=kv_reuse.StreamGate(stream.cuda_stream, 7))
    assert target.free_rows == rows
