"""The backend a call runs on, resolved once from its inputs: the kind (``cpu``, ``cuda``, or ``emulated``: CPU
tensors through the CUDA kernels of an emulated build, installed by the test harness), the compiled module the
kernels come from, and the launch arguments (device index, stream) and SM count the CUDA kernels need.

Kernel-layer code receives a :class:`Backend` (from :func:`resolve`) and asks it, not the tensors' device. What a
CPU tensor runs on is ``cpu`` unless a backend is installed with :func:`installed` (a context variable: only the
code inside the block, in that thread or task, sees it). Product code never installs one; tests do
(the CUDA emulator of tools/cuda_emu, and the blocked torch path on plain CPU tensors)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch

from .. import _C
from .._util import trace_constant

#: SM count the emulator reports (tools/cuda_emu/emu_runtime.cpp, cudaDevAttrMultiProcessorCount)
EMULATED_SM_COUNT = 132


class _Installed:
    __slots__ = ("kernels", "block_rows")

    def __init__(self, kernels, block_rows: Optional[int]):
        self.kernels = kernels
        self.block_rows = block_rows


_installed: contextvars.ContextVar = contextvars.ContextVar("tempokern_backend", default=None)


@contextlib.contextmanager
def installed(kernels=None, *, block_rows: Optional[int] = None) -> Iterator[None]:
    """Inside the block CPU tensors run on ``kernels`` (an emulated build of _C: the ``emulated`` backend; None:
    the ``cpu`` backend) and, with ``block_rows`` (an int, 0 = from the memory budget), the blocked torch path in
    blocks of that many rows where an op has one. Test support: the harness installs these."""
    token = _installed.set(None if kernels is None and block_rows is None else _Installed(kernels, block_rows))
    try:
        yield
    finally:
        _installed.reset(token)


@trace_constant  # (dynamo cannot trace ContextVar.get; an installed backend never changes inside a compiled region)
def _emulating() -> bool:
    inst = _installed.get()
    return inst is not None and inst.kernels is not None


@trace_constant
def _block_rows() -> int:
    """The installed block rows, -1 for none."""
    inst = _installed.get()
    return -1 if inst is None or inst.block_rows is None else int(inst.block_rows)


_SMS: dict = {}


class Backend:
    """Where one call runs: ``kind`` is "cpu", "cuda" or "emulated"; ``cuda_path`` whether the CUDA kernels run
    (cuda or emulated); ``kernels`` the compiled module; ``index`` the CUDA device index (0 on the emulator, -1 on
    the CPU); ``block_rows`` the rows per block of an op's blocked torch path when a test installed it (None: not
    installed); ``launch`` (device, stream) for a kernel launch (device -1: CPU) and ``sm_count`` the streaming
    multiprocessors the grids are sized for (1 on the CPU), both asked of the device when first read."""
    __slots__ = ("kind", "device", "block_rows", "cuda_path", "emulated", "_index")

    def __init__(self, kind: str, device: torch.device, block_rows: Optional[int] = None):
        self.kind = kind
        self.device = device
        self.block_rows = block_rows
        self.cuda_path = kind != "cpu"
        self.emulated = kind == "emulated"
        self._index = device.index if kind == "cuda" else (0 if kind == "emulated" else -1)

    def __repr__(self) -> str:
        return f"Backend({self.kind!r}, {self.device})"

    @property
    def kernels(self):
        # (read inside the custom ops, never in a traced region: dynamo cannot trace ContextVar.get)
        return _installed.get().kernels if self.kind == "emulated" else _C

    @property
    def index(self) -> int:
        if self._index is None:  # a CUDA device without an index: the current one, asked when first needed
            self._index = torch.cuda.current_device()
        return self._index

    @property
    def launch(self) -> tuple:
        if self.device.type == "meta":   # resolvable for tracing, never launched
            raise ValueError(f"tempokern runs on CPU and CUDA tensors, got device {self.device}")
        if self.kind == "cpu":
            return (-1, 0)
        if self.kind == "emulated":
            return (0, 0)
        if not _C.cuda_compiled:
            raise RuntimeError(
                "tempokern was built without CUDA kernels, so CUDA tensors cannot be used; "
                "reinstall with nvcc on PATH (TEMPOKERN_CUDA=ON pip install .)")
        ok, _, msg = _C.cuda_runtime_status()
        if not ok:
            raise RuntimeError(f"tempokern's CUDA runtime is unavailable: {msg}")
        idx = self.index
        return idx, torch.cuda.current_stream(idx).cuda_stream

    @property
    def sm_count(self) -> int:
        if self.kind == "cuda":
            idx = self.index
            n = _SMS.get(idx)
            if n is None:
                n = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
            return n
        return EMULATED_SM_COUNT if self.kind == "emulated" else 1


def kernels_for(cuda: bool):
    """The compiled module of CUDA tensors (cuda) or of CPU tensors (an installed emulated build, else _C)."""
    if cuda:
        return _C
    inst = _installed.get()
    return _C if inst is None or inst.kernels is None else inst.kernels


def of(t) -> Backend:
    """``t`` itself when it is a Backend, else :func:`resolve` (t a tensor or a device)."""
    return t if isinstance(t, Backend) else resolve(t)


def resolve(t) -> Backend:
    """The backend of a call whose inputs live where tensor (or device) ``t`` does."""
    dev = t if isinstance(t, torch.device) else t.device
    if dev.type == "cuda":
        return Backend("cuda", dev)
    if dev.type not in ("cpu", "meta"):
        raise ValueError(f"tempokern runs on CPU and CUDA tensors, got device {dev}")
    rows = None if (r := _block_rows()) < 0 else r
    return Backend("emulated" if _emulating() else "cpu", dev, rows)
