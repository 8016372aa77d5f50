"""Stand-ins for torch, transformers and kv_reuse where they cannot be imported (this CPU machine).

``install()`` puts them into ``sys.modules`` only for the modules that are
missing, so on a machine with torch the real one is used. The torch stand-in
is a numpy-backed tensor with just what ``gpu_serving.transport`` and the
workers' construction use (zeros / empty / tensor, slicing that shares
memory, same-size dtype views, ``index_select``, a device tag, DLPack device
queries); its values are real, so tests can assert what a landing returned.
The kv_reuse stand-in records how ``DonorBank`` and ``Target`` were opened.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, List

import numpy as np


class DType:
    def __init__(self, name: str, np_dtype: Any) -> None:
        self.name, self.np = name, np.dtype(np_dtype)

    def __repr__(self) -> str:
        return f"torch.{self.name}"


BF16 = DType("bfloat16", np.uint16)  # bf16 bits carried as uint16
INT16 = DType("int16", np.int16)
INT64 = DType("int64", np.int64)
FLOAT32 = DType("float32", np.float32)


class FakeTensor:
    """A numpy array with a torch dtype tag and a device string."""

    def __init__(self, a: np.ndarray, dtype: DType, device: str = "cpu") -> None:
        self.a, self.dtype, self.device = a, dtype, device

    @property
    def shape(self):
        return self.a.shape

    def __getitem__(self, k):
        return FakeTensor(self.a[k], self.dtype, self.device)

    def __len__(self):
        return len(self.a)

    def view(self, dtype):
        return FakeTensor(self.a.view(dtype.np), dtype, self.device)

    def index_select(self, dim, index):
        assert dim == 0 and index.device == self.device, "index must live on the tensor's device"
        return FakeTensor(self.a[index.a].copy(), self.dtype, self.device)

    def numpy(self):
        assert self.device == "cpu", "numpy() of a CUDA tensor"
        return self.a

    def cpu(self):
        return FakeTensor(self.a, self.dtype, "cpu")

    def pin_memory(self):
        return self

    def to(self, device, non_blocking=False):
        return FakeTensor(self.a.copy(), self.dtype, str(device))

    def __dlpack_device__(self):
        if self.device.startswith("cuda"):
            _, _, n = self.device.partition(":")
            return (2, int(n or 0))  # kDLCUDA
        return (1, 0)  # kDLCPU

    def __dlpack__(self, stream=None):
        return ("dltensor", self)


def _fake_torch() -> types.ModuleType:
    t = types.ModuleType("torch")
    t.__stub__ = True
    t.bfloat16, t.int16, t.int64, t.long, t.float32 = BF16, INT16, INT64, INT64, FLOAT32
    t.Tensor = FakeTensor

    def zeros(shape, dtype=FLOAT32, device="cpu", pin_memory=False):
        return FakeTensor(np.zeros(shape, dtype=dtype.np), dtype, str(device))

    def tensor(data, dtype=INT64, device="cpu"):
        return FakeTensor(np.array(data, dtype=dtype.np), dtype, str(device))

    t.zeros, t.empty, t.tensor = zeros, zeros, tensor
    t.inference_mode = lambda: (lambda f: f)
    t.manual_seed = lambda seed: None
    cuda = types.ModuleType("torch.cuda")
    cuda.synced: List[str] = []
    cuda.is_available = lambda: True
    cuda.current_device = lambda: 0
    cuda.set_device = lambda d: None
    cuda.synchronize = lambda d=None: cuda.synced.append(str(d))
    cuda.memory_allocated = lambda d=None: 0
    cuda.current_stream = lambda d=None: types.SimpleNamespace(cuda_stream=0x51)
    t.cuda = cuda
    nn = types.ModuleType("torch.nn")
    nn.Module = object
    t.nn = nn
    return t


def _fake_transformers() -> types.ModuleType:
    m = types.ModuleType("transformers")
    m.__stub__ = True
    for name in ("DynamicCache", "LlamaConfig", "LlamaForCausalLM"):
        setattr(m, name, type(name, (), {}))
    # engine.py subclasses DynamicLayer and registers its attention function.
    cache_utils = types.ModuleType("transformers.cache_utils")
    cache_utils.DynamicLayer = type("DynamicLayer", (), {})
    m.cache_utils = cache_utils
    m.AttentionInterface = type("AttentionInterface", (), {"register": staticmethod(lambda name, fn: None)})
    return m


class Opened:
    """What a stand-in kv_reuse class was constructed with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        OPENED.append(self)


OPENED: List[Opened] = []


def _fake_kv_reuse() -> types.ModuleType:
    m = types.ModuleType("kv_reuse")
    m.__stub__ = True

    class Layout(Opened):
        def __init__(self, layers, heads, dim, dtype, tpb, tp):
            super().__init__(layers, heads, dim, dtype, tpb, tp)
            self.rank_block_elems = layers * 2 * tpb * heads * dim
            self.tokens_per_block = tpb

    m.Layout = Layout
    class DonorBank(Opened):
        engine_id = "00000000-0000-4000-8000-00000000000d"
        pins_outstanding = 0

        def serve_pins(self, endpoint):
            return types.SimpleNamespace(endpoint=endpoint, close=lambda: None)

    class Target(Opened):
        engine_id = "00000000-0000-4000-8000-00000000000e"
        free_rows = 6
        imported_donors = 0

        def forget_donors(self):
            return 0

    m.DonorBank, m.Target = DonorBank, Target
    m.KvReuseError = type("KvReuseError", (Exception,), {})
    # The wheel's KvEvent codec, as JSON text in place of MessagePack.
    m.encode_kv_event = lambda event_json: event_json.encode()
    m.decode_kv_event = lambda event: bytes(event).decode()
    m.leak_counters = lambda: {"open_fds": 3}
    return m


def advice(hint: Any, reason: str = "no_donor", detail: str = "no donor holds the prefix") -> types.SimpleNamespace:
    """A router's answer with the fields of ``kv_reuse.Advice`` a harness may read.

    Admitted when ``hint`` is not None (``reason`` and ``detail`` then None),
    else refused with ``reason`` (a stable code) and ``detail`` (words). It
    has no ``verdict``: the wheel's is deprecated, so a harness that still
    reads it fails here.
    """
    admitted = hint is not None
    return types.SimpleNamespace(
        admitted=admitted, hint=hint, terms=None,
        reason=None if admitted else reason, detail=None if admitted else detail,
    )


def install() -> Dict[str, Any]:
    """Puts stand-ins for torch, transformers and kv_reuse into ``sys.modules`` (replacing real ones).

    The tests that use them check this package's wiring, the same on every
    machine; the real engines are checked by test_engine / test_harness where
    torch is installed. Returns what :func:`restore` puts back.
    """
    saved = {n: m for n, m in sys.modules.items() if _swapped(n)}
    for name in saved:
        del sys.modules[name]
    sys.modules["torch"] = _fake_torch()
    sys.modules["transformers"] = _fake_transformers()
    sys.modules["transformers.cache_utils"] = sys.modules["transformers"].cache_utils
    sys.modules["kv_reuse"] = _fake_kv_reuse()
    OPENED.clear()
    return saved


def restore(saved: Dict[str, Any]) -> None:
    """Removes the stand-ins and the modules imported on top of them; puts ``saved`` back."""
    for name in [n for n in sys.modules if _swapped(n)]:
        del sys.modules[name]
    sys.modules.update(saved)


def _swapped(name: str) -> bool:
    """Whether ``install`` / ``restore`` swap module ``name``: the stand-ins' packages with all their submodules.

    Submodules too: a real ``torch.nn.attention`` left in ``sys.modules``
    while the fake ``torch`` is installed, or one imported on top of the fake
    and left after ``restore``, breaks the real torch's lazy submodules
    (``torch._dynamo``) for the tests that run after these in one process.
    """
    return any(name == p or name.startswith(p + ".") for p in ("torch", "transformers", "kv_reuse")) or name.startswith("gpu_serving")
