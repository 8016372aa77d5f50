"""The array protocols: numpy (__array_interface__), DLPack and
__cuda_array_interface__ objects as bank sources and fetch destinations,
and their refusals naming the argument (dtype, shape, strides, contiguity,
read-only, device, CPU vs GPU path)."""

import re

import numpy as np
import pytest

import kv_reuse
from conftest import BLOCKS, TOKENS_PER_BLOCK
from donor_proc import pattern
from test_roles import donor, router_for, router_for_bank  # noqa: F401  (fixture)


class FakeCuda:
    """A tensor that only speaks __cuda_array_interface__ (CuPy-like);
    never dereferenced: every path here refuses before touching memory."""

    def __init__(self, shape, typestr="<f4", strides=None, device=None, addr=0xDEAD0000):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "strides": strides,
            "data": (addr, False), "version": 3,
        }
        if device is not None:
            self.__dlpack_device__ = lambda: (2, device)


class DlpackOnly:
    """Hides numpy's __array_interface__: only __dlpack__ / __dlpack_device__."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, stream=None):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class RecodedDlpack:
    """A numpy array exported through DLPack with the capsule's dtype code
    rewritten: how torch exports its float8 types (dlpack.h v1.1 codes:
    10 float8_e4m3fn, 12 float8_e5m2), testable without torch. The bytes
    are the array's own; only the declared type changes."""

    def __init__(self, arr, code):
        self._arr, self._code = arr, code

    def __dlpack__(self, stream=None):
        import ctypes
        capsule = self._arr.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        # DLTensor: data (8 bytes), device (2 x i32), ndim (i32), then
        # dtype {code: u8, bits: u8, lanes: u16} at byte 20.
        ctypes.c_uint8.from_address(get(capsule, b"dltensor") + 20).value = self._code
        return capsule

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class MetaLike:
    """What torch's ``meta`` tensor does: ``__dlpack_device__`` raises
    ValueError (it has no memory to export)."""

    def __dlpack__(self, stream=None):
        raise BufferError("no data")

    def __dlpack_device__(self):
        raise ValueError("Unknown device type meta for Dlpack")


def store_of(layout, n=2):
    bank = kv_reuse.DonorBank(layout, slots=8)
    return bank, bank.store(list(range(TOKENS_PER_BLOCK * n)))


def fetch_into(bank, endpoint, hashes, layout, enabled, kv_caches, caches, rows, request_id):
    """Serves `bank`'s pins on `endpoint`, fetches `hashes` into a Target over
    `kv_caches` (the exporters handed to it) and checks that every fetched row
    of `caches` (the arrays behind them) holds the donor's `rows`."""
    with bank.serve_pins(endpoint):
        target = kv_reuse.Target(layout, rows=8, kv_caches=kv_caches)
        router = router_for_bank(bank, endpoint, hashes, layout, enabled, target)
        advice = router.advise(request_id, hashes, target.engine_id)
        assert advice.admitted, advice
        with target.fetch(advice.hint, hashes, bank.manifest()) as out:
            assert len(out.rows) == BLOCKS
            for r in range(layout.tp_size):
                for block, row in enumerate(out.rows):
                    assert caches[r][row].tobytes() == rows[r][block].tobytes()


def ramp_rows(layout, step):
    """Per rank, ``BLOCKS`` rows of a float32 ramp, rank ``r``'s shifted by ``step * r``
    (every block and rank distinct)."""
    n = layout.rank_block_elems
    return [np.arange(BLOCKS * n, dtype=np.float32).reshape(BLOCKS, n) + step * r
            for r in range(layout.tp_size)]


def test_a_dlpack_cpu_source_is_stored_byte_for_byte(layout, enabled, tmp_path):
    bank, store = store_of(layout, BLOCKS)
    n = layout.rank_block_elems
    rows = ramp_rows(layout, 7)
    for r in range(layout.tp_size):
        store.write(r, DlpackOnly(rows[r]))
        store.ack(r)
    hashes = store.sequence_hashes
    endpoint = "unix:" + str(tmp_path / "pin.sock")
    caches = [np.zeros((8, n), dtype=np.float32) for _ in range(layout.tp_size)]
    fetch_into(bank, endpoint, hashes, layout, enabled, caches, caches, rows, "req-dl")


class NoStrides:
    """An exporter whose ``__array_interface__`` leaves out ``strides``:
    optional in NumPy's array interface spec, absent meaning C-contiguous
    (numpy writes None; other exporters omit the key)."""

    def __init__(self, arr):
        assert arr.flags.c_contiguous
        self.arr = arr
        ai = dict(arr.__array_interface__)
        del ai["strides"]
        self.__array_interface__ = ai


def test_an_array_interface_without_strides_is_read_as_c_contiguous(layout, enabled, tmp_path):
    """Such an exporter was refused (``blocks: __array_interface__ lacks
    `strides```) as a store source and as a fetch destination; it is stored
    and fetched into byte for byte. The CUDA array interface reads the key
    the same way: its refusal is about the dtype, not the strides."""
    bank, store = store_of(layout, BLOCKS)
    n = layout.rank_block_elems
    rows = ramp_rows(layout, 11)
    for r in range(layout.tp_size):
        store.write(r, NoStrides(rows[r]))
        assert store.ack(r) == (r == layout.tp_size - 1)
    caches = [np.zeros((8, n), dtype=np.float32) for _ in range(layout.tp_size)]
    fetch_into(bank, "unix:" + str(tmp_path / "pin.sock"), store.sequence_hashes, layout, enabled,
               [NoStrides(c) for c in caches], caches, rows, "req-nostrides")
    cuda = FakeCuda((4, n), typestr="<f2", device=0)
    del cuda.__cuda_array_interface__["strides"]
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[0\]: dtype <f2, expected <f4$"):
        kv_reuse.Target(layout, rows=4, kv_caches=[cuda, cuda], gpus=[0, 0])


class RaisingInterface:
    """An exporter whose ``__array_interface__`` property raises (a
    framework's tensor that cannot export itself)."""

    @property
    def __array_interface__(self):
        raise RuntimeError("cannot export a lazy tensor")


class OddTypestr:
    def __init__(self, arr, typestr):
        self.arr = arr
        self.__array_interface__ = dict(arr.__array_interface__, typestr=typestr)


def test_an_exporter_whose_array_interface_raises_is_refused_naming_the_argument(layout):
    """A raising ``__array_interface__`` let a bare RuntimeError through,
    while a raising ``__dlpack__`` was ``BadArgument`` naming the argument:
    the same now, the exporter's exception kept as ``__cause__``."""
    _bank, store = store_of(layout)
    why = r"__array_interface__ failed: RuntimeError: cannot export a lazy tensor$"
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: " + why) as e:
        store.write(0, RaisingInterface())
    cause = e.value.__cause__
    assert type(cause) is RuntimeError and str(cause) == "cannot export a lazy tensor"
    del e, cause
    ok = np.zeros((4, layout.rank_block_elems), dtype=np.float32)
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + why):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok, RaisingInterface()])
    # A raising __dlpack__ keeps its cause too.
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: __dlpack_device__\(\) failed: ValueError") as e:
        store.write(0, MetaLike())
    assert type(e.value.__cause__) is ValueError
    del e


def test_a_typestr_that_is_no_typestr_says_what_is_wrong(layout):
    """``typestr "zz"`` alone did not say what was wrong with it."""
    _bank, store = store_of(layout)
    rows = np.zeros((2, layout.rank_block_elems), dtype=np.float32)
    for bad in ("zz", "<f", "", "<fx"):
        with pytest.raises(kv_reuse.BadArgument,
                           match=rf'^blocks: __array_interface__ typestr "{re.escape(bad)}" is not a supported '
                                 r'typestr \(byte order, kind and size in bytes, as numpy writes them\); '
                                 r'this layout takes "<f4"$'):
            store.write(0, OddTypestr(rows, bad))
    # A well-formed typestr of another dtype keeps its dtype refusal.
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: dtype <i4, expected <f4$"):
        store.write(0, OddTypestr(rows, "<i4"))


def test_source_refusals_name_blocks(layout):
    _bank, store = store_of(layout)
    n = layout.rank_block_elems
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: dtype dlpack\(code=2, bits=64"):
        store.write(0, DlpackOnly(np.zeros((2, n), dtype=np.float64)))
    with pytest.raises(kv_reuse.BadArgument, match=r"blocks: shape \[2, %d\], expected \[2, %d\]" % (n + 1, n)):
        store.write(0, DlpackOnly(np.zeros((2, n + 1), dtype=np.float32)))
    with pytest.raises(kv_reuse.BadArgument, match="blocks: strides .* are not C-contiguous"):
        store.write(0, DlpackOnly(np.zeros((n, 2), dtype=np.float32).T))
    with pytest.raises(kv_reuse.BadArgument, match="blocks: a CUDA tensor on the host path"):
        store.write(0, FakeCuda((2, n)))
    with pytest.raises(kv_reuse.BadArgument, match="blocks: has no __array_interface__ or __dlpack__"):
        store.write(0, object())


def test_fetch_into_the_engines_numpy_kv_cache_every_byte(donor, layout, enabled):  # noqa: F811
    proc, report = donor
    n = layout.rank_block_elems
    rows = 16
    sentinel = np.float32(-1.5)
    caches = [np.full((rows, n), sentinel, dtype=np.float32) for _ in range(layout.tp_size)]
    target = kv_reuse.Target(layout, rows=rows, kv_caches=caches)
    router = router_for(report, layout, enabled, target)
    advice = router.advise("req-cache", report["hashes"], target.engine_id)
    assert advice.admitted, advice
    with target.fetch(advice.hint, report["hashes"], bytes.fromhex(report["manifest"])) as out:
        assert out.host_payload_bytes == out.bytes == len(out.rows) * layout.tp_size * layout.rank_block_bytes
        # The fetch's time split: import and delivery are parts of the whole.
        assert out.total_us > 0
        assert out.import_us + out.transfer_us <= out.total_us, (out.import_us, out.transfer_us, out.total_us)
        for rank in range(layout.tp_size):
            want = np.full((rows, n), sentinel, dtype=np.float32)
            for block, row in enumerate(out.rows):
                want[row] = pattern(layout, rank, block)
            # The engine's own arrays were written in place, every byte,
            # and no other row was touched.
            assert caches[rank].tobytes() == want.tobytes()
            for row in out.rows:
                assert target.read_row(rank, row) == caches[rank][row].tobytes()


def test_destination_refusals_name_the_kv_cache(layout):
    n = layout.rank_block_elems
    ok = np.zeros((4, n), dtype=np.float32)
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches: 1 tensors, expected one per TP rank \(2\)"):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: dtype <f2"):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok, np.zeros((4, n), dtype=np.float16)])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: shape \[3, %d\]" % n):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok, np.zeros((3, n), dtype=np.float32)])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]: strides"):
        kv_reuse.Target(layout, rows=4, kv_caches=[np.zeros((4, 2 * n), dtype=np.float32)[:, ::2], ok])
    ro = np.zeros((4, n), dtype=np.float32)
    ro.setflags(write=False)
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[1\]: is read-only"):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok, ro])
    with pytest.raises(kv_reuse.BadArgument, match=r"kv_caches\[0\]: a CUDA tensor on the host path"):
        kv_reuse.Target(layout, rows=4, kv_caches=[FakeCuda((4, n)), ok])


def test_destinations_sharing_memory_are_refused_naming_the_later_one(layout):
    """Each rank's destination is its own memory: the same array twice, or
    two views that share bytes, would let one rank's fetch overwrite the
    other's rows."""
    n = layout.rank_block_elems
    a = np.zeros((4, n), dtype=np.float32)
    shared = r"overlaps the memory of kv_caches\[0\] \(the same tensor, or views sharing bytes\)"
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + shared):
        kv_reuse.Target(layout, rows=4, kv_caches=[a, a])
    # Overlapping views of one buffer: rows 0..4 and 3..7.
    buf = np.zeros((7, n), dtype=np.float32)
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + shared):
        kv_reuse.Target(layout, rows=4, kv_caches=[buf[:4], buf[3:]])
    # vLLM kv-first: the same stacked buffer for both ranks.
    L, T, H, D = 2, layout.tokens_per_block, 1, 8
    v = np.zeros((L, 2, 4, T, H, D), dtype=np.float32)
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + shared):
        kv_reuse.Target(layout, rows=4, kv_caches=[v, v], kv_layout="vllm_kv_first")
    # HF caches: rank 1 given rank 0's layer-0 K as its own.
    hf = [np.zeros((L, 2, 1, H, 4 * T, D), dtype=np.float32) for _ in range(2)]
    caches = [[b[l, kv] for l in range(L) for kv in range(2)] for b in hf]
    caches[1][2] = caches[0][0]
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]\[2\]: overlaps the memory of kv_caches\[0\]\[0\]"):
        kv_reuse.Target(layout, rows=4, kv_caches=caches, kv_layout="hf")
    # The GPU path compares device addresses the same way, before any CUDA call.
    good = FakeCuda((4, n), device=0)
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + shared):
        kv_reuse.Target(layout, rows=4, kv_caches=[good, FakeCuda((4, n), device=0)], gpus=[0, 0])
    # Adjacent, disjoint views of one buffer are two destinations.
    target = kv_reuse.Target(layout, rows=3, kv_caches=[buf[:3], buf[3:6]])
    assert target.free_rows == 3


def test_gpu_path_refusals_before_any_cuda_call(layout):
    n = layout.rank_block_elems
    good = FakeCuda((4, n), device=0)
    cases = [
        ([np.zeros((4, n), dtype=np.float32), good], r"kv_caches\[0\]: a CPU tensor on the GPU path"),
        ([good, FakeCuda((4, n), typestr="<f2")], r"kv_caches\[1\]: dtype <f2, expected <f4"),
        ([good, FakeCuda((4, n + 1))], r"kv_caches\[1\]: shape \[4, %d\]" % (n + 1)),
        ([good, FakeCuda((4, n), strides=(8 * n, 8))], r"kv_caches\[1\]: strides \[%d, 8\] are not C-contiguous" % (8 * n)),
        ([good, FakeCuda((4, n), device=1)], r"kv_caches\[1\]: on cuda:1, expected cuda:0"),
        ([good, object()], r"kv_caches\[1\]: has no __cuda_array_interface__ or __dlpack__"),
    ]
    for caches, msg in cases:
        with pytest.raises(kv_reuse.BadArgument, match=msg):
            kv_reuse.Target(layout, rows=4, kv_caches=caches, gpus=[0, 0])
    with pytest.raises(kv_reuse.BadArgument, match="gpus: 1 ordinals, expected one per TP rank"):
        kv_reuse.Target(layout, rows=4, kv_caches=[good, good], gpus=[0])
    with pytest.raises(kv_reuse.BadArgument, match="kv_caches: required with `gpus`"):
        kv_reuse.Target(layout, rows=4, gpus=[0, 0])


def test_the_gpu_path_without_a_driver_raises_cuda_unavailable(layout):
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        line = "SKIP cuda_unavailable: a CUDA driver library is present here"
        print(line)
        pytest.skip(line)
    good = FakeCuda((4, layout.rank_block_elems), device=0)
    other = FakeCuda((4, layout.rank_block_elems), device=0, addr=0xBEEF0000)
    with pytest.raises(kv_reuse.CudaUnavailable, match="gpus"):
        kv_reuse.Target(layout, rows=4, kv_caches=[good, other], gpus=[0, 0])
    with pytest.raises(kv_reuse.CudaUnavailable, match="gpus"):
        kv_reuse.DonorBank(layout, slots=2, gpus=[0, 0])
    with pytest.raises(kv_reuse.BadArgument, match="gpus: 1 ordinals"):
        kv_reuse.DonorBank(layout, slots=2, gpus=[0])


def fp8_layout():
    return kv_reuse.Layout(2, 2, 8, "fp8_e4m3", TOKENS_PER_BLOCK, 2)


def test_a_float8_e4m3fn_dlpack_source_is_stored_byte_for_byte(enabled, tmp_path):
    # torch.float8_e4m3fn through DLPack (vLLM's fp8 KV cache) was refused as
    # `dlpack(code=10, ...)`: it is the layout's own format, taken as bf16 is.
    layout = fp8_layout()
    bank, store = store_of(layout, BLOCKS)
    n = layout.rank_block_elems
    rows = [((np.arange(BLOCKS * n) * 7 + 13 * r) % 251).astype(np.uint8).reshape(BLOCKS, n)
            for r in range(layout.tp_size)]
    for r in range(layout.tp_size):
        store.write(r, RecodedDlpack(rows[r], 10))
        store.ack(r)
    hashes = store.sequence_hashes
    endpoint = "unix:" + str(tmp_path / "pin.sock")
    # The destinations are float8_e4m3fn through DLPack too.
    caches = [np.zeros((8, n), dtype=np.uint8) for _ in range(layout.tp_size)]
    exporters = [RecodedDlpack(c, 10) for c in caches]
    fetch_into(bank, endpoint, hashes, layout, enabled, exporters, caches, rows, "req-fp8")


def test_dtype_refusals_through_dlpack_list_what_dlpack_may_carry(layout):
    # Another FP8 format is not the layout's (its bytes mean other numbers):
    # refused, saying which DLPack types are taken.
    _bank, store = store_of(fp8_layout())
    n = fp8_layout().rank_block_elems
    e5m2 = RecodedDlpack(np.zeros((2, n), dtype=np.uint8), 12)
    with pytest.raises(kv_reuse.BadArgument, match=re.escape(
            "blocks: dtype dlpack(code=12, bits=8, lanes=1) = float8_e5m2, "
            "expected |u1 (DLPack float8_e4m3fn or uint8)")):
        store.write(0, e5m2)
    # On an f32 layout a float8 tensor is refused the same way.
    _bank, store = store_of(layout)
    n = layout.rank_block_elems
    with pytest.raises(kv_reuse.BadArgument, match=re.escape(
            "blocks: dtype dlpack(code=10, bits=8, lanes=1) = float8_e4m3fn, expected <f4 (DLPack float32)")):
        store.write(0, RecodedDlpack(np.zeros((2, n), dtype=np.uint8), 10))
    # numpy's typestr path still names the typestr alone.
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: dtype \|u1, expected <f4$"):
        store.write(0, np.zeros((2, n), dtype=np.uint8))


def test_an_exporter_that_cannot_name_its_device_is_refused_naming_the_argument(layout):
    # torch's `meta` tensor raised its own ValueError through the call.
    _bank, store = store_of(layout)
    why = r"__dlpack_device__\(\) failed: ValueError: Unknown device type meta for Dlpack"
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: " + why):
        store.write(0, MetaLike())
    ok = np.zeros((4, layout.rank_block_elems), dtype=np.float32)
    with pytest.raises(kv_reuse.BadArgument, match=r"^kv_caches\[1\]: " + why):
        kv_reuse.Target(layout, rows=4, kv_caches=[ok, MetaLike()])


def test_torch_float8_and_meta_tensors(layout):
    """The same with torch itself (skipped without torch)."""
    torch = pytest.importorskip("torch")
    fp8 = fp8_layout()
    n = fp8.rank_block_elems
    bank, store = store_of(fp8)
    rows = torch.arange(2 * n, dtype=torch.uint8).reshape(2, n)
    store.write(0, rows.view(torch.float8_e4m3fn))
    store.write(1, rows)
    assert [store.ack(r) for r in range(2)] == [False, True]
    with pytest.raises(kv_reuse.BadArgument, match=r"float8_e5m2, expected \|u1 \(DLPack float8_e4m3fn or uint8\)"):
        bank.store(list(range(TOKENS_PER_BLOCK * 3))).write(0, torch.zeros((1, n), dtype=torch.float8_e5m2))
    _bank, store = store_of(layout)
    with pytest.raises(kv_reuse.BadArgument, match=r"^blocks: __dlpack_device__\(\) failed: ValueError"):
        store.write(0, torch.zeros((2, layout.rank_block_elems), dtype=torch.float32, device="meta"))
