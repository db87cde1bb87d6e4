"""Fused soft-calendar ops: calendar_scalar (expected linear position u) and
calendar_context (softmax-weighted Fourier codes per level)."""
from __future__ import annotations

import collections
from typing import List, Sequence

import torch

from . import backend, dispatch
from ..reference.calendar import fourier_table as _ref_fourier_table
from ..reference.calendar import level_weights
from .common import (acc_dtype, check_finite, check_reciprocal, check_same_device, check_tensor, dtype_code,
                     ptr, rows_contiguous)

_MAX_LEVELS = 8  # csrc/calendar/calendar.h::kMaxCalendarLevels
_CW = 32  # csrc/calendar/calendar_cuda.cu::kCW: CUDA tables are zero-padded to multiples of it
# CUDA grid: min(row tiles, 64 x SM count) CTAs of 128 rows (64 in float64), grid-stride over the tiles beyond.
# A cap, not a target: 1M rows are 8,192 tiles -> 8,192 CTAs, ~10 waves at the 6 resident CTAs per SM of an
# H100 (5 in the backward), so the last wave's tail is short; a small fixed multiple (8 x SMs) would leave
# 1.3 waves and up to half the card idle at the end. At least 2 x SMs whenever there are that many tiles.
_CTAS_PER_SM = 64
# The context forward (warp-cooperative rows): CTAs of 8 warps, a warp per group of 8 rows (4 in float64),
# grid-stride over the groups; the grid is min(groups / 8, 8 x SM count): at 1M rows 1,056 CTAs on an H100, every
# warp walking ~16 groups, so all warps do the same work and there is no tail wave.
_CTAS_PER_SM_GROUPS = 8
# The candidate v3 calendar_context (csrc/calendar/calendar_v3_cuda.cu): persistent CTAs of 256 threads walking
# 64-row tiles, 2 resident per SM (<= 128 registers, <= 93 KB shared memory); a grid of 2 x SMs gives every CTA the
# same number of tiles (+-1), and each CTA's next tile is in flight while it computes the current one.
_CTAS_PER_SM_V3 = 2
# The candidate v3 calendar_scalar: CTAs of 8 warps, a warp per group of 8 rows (4 lanes per row), no shared
# memory; 3 resident per SM, grid-stride with the next group's loads in flight
_CTAS_PER_SM_V3_SCALAR = 3
_V3_MAX_LEVELS = 3   # levels per v3 launch (the forward holds every level's logits of its next tile in registers)
_V3_MAX_CLASSES = 32
_V3_MAX_DIM = 128
_TABLE_CACHE_SIZE = 32  # Fourier tables kept (least recently used dropped): bounded, pins little memory
_tables: "collections.OrderedDict" = collections.OrderedDict()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _table(n: int, dim: int, dtype: torch.dtype, device: torch.device, layout: str = "cpu") -> torch.Tensor:
    """fourier_table(n, dim) in the layout a kernel reads: "cpu" (n, dim); "cuda_fwd" (n, roundup(dim, 32));
    "cuda_bwd" the transpose (dim, roundup(n, 32)); CUDA layouts zero-padded, each its own allocation
    (aligned rows). Cached in a small LRU."""
    key = (n, dim, dtype, str(device), layout)
    t = _tables.get(key)
    if t is not None:
        _tables.move_to_end(key)
        return t
    base = _ref_fourier_table(n, dim, dtype=torch.float64)
    if layout == "cuda_fwd":
        t = torch.zeros(n, _round_up(dim, _CW), dtype=torch.float64)
        t[:, :dim] = base
    elif layout == "cuda_bwd":
        t = torch.zeros(dim, _round_up(n, _CW), dtype=torch.float64)
        t[:, :n] = base.t()
    else:
        t = base
    t = t.to(dtype=dtype, device=device).contiguous()
    if layout != "cpu" and t.data_ptr() % 32:
        raise RuntimeError("tempokern: a CUDA calendar table is not 32-byte aligned")
    _tables[key] = t
    while len(_tables) > _TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return t


class _CalendarCall:
    """A calendar kernel launch as the dispatch table sees it (tempokern/_ops/dispatch.py)."""
    __slots__ = ("role", "logits", "dim", "grad")

    def __init__(self, role: str, logits, dim: int, grad):
        self.role, self.logits, self.dim, self.grad = role, logits, dim, grad

    def v3_takes(self) -> bool:
        return _v3_takes(self.role, self.logits, self.dim, self.grad)


def _kernel(kernel: str, logits, dim: int = 0, grad: "torch.Tensor | None" = None, be=None) -> str:
    """The kernel ("cpu", "groups", "tiles" or "v3") of ``kernel`` ("context_fwd", "context_bwd", "scalar_fwd",
    "scalar_bwd") for these inputs on backend ``be`` (None: resolved from them): the path dispatch.choose
    picks, its kernel for the role."""
    be = backend.resolve(logits[0]) if be is None else be
    op, role = kernel.split("_")
    path = dispatch.choose("calendar_" + op, _CalendarCall(kernel, logits, dim, grad), be)
    return path.kernel_for(role)


def _v3_takes(kernel: str, logits, dim: int, grad) -> bool:
    """Whether the v3 kernels take the call: float32 / float16 / bfloat16 levels of <= 32 classes; context: dim a
    multiple of 4 in 4..128 and (backward) an upstream gradient with unit column stride and 16-byte aligned rows."""
    if not _v3_levels(logits):
        return False
    if kernel.startswith("scalar"):
        return True
    ok = 4 <= dim <= _V3_MAX_DIM and dim % 4 == 0
    if ok and grad is not None:
        vec = 4 * grad.element_size()
        ok = grad.stride(1) == 1 and (grad.stride(0) * grad.element_size()) % vec == 0 and grad.data_ptr() % vec == 0
    return ok


def _op(kernel: str, k: str) -> str:
    """calendar_launch's op name: the default kernels (and the CPU ones) under the kernel's name, v3 suffixed."""
    return kernel + "_v3" if k == "v3" else kernel


def _max_ctas(be, kernel: str, k: str) -> int:
    """The grid cap of kernel k (0: the CPU kernels) on backend ``be`` (or a tensor's)."""
    if k == "cpu":
        return 0
    per_sm = {"tiles": _CTAS_PER_SM, "groups": _CTAS_PER_SM_GROUPS,
              "v3": _CTAS_PER_SM_V3_SCALAR if kernel.startswith("scalar") else _CTAS_PER_SM_V3}[k]
    return max(1, per_sm * backend.of(be).sm_count)


def _v3_levels(logits) -> bool:
    """Whether the v3 kernels take these levels: float32 / float16 / bfloat16, each of <= 32 classes."""
    return logits[0].dtype in (torch.float32, torch.float16, torch.bfloat16) and all(
        x.shape[1] <= _V3_MAX_CLASSES for x in logits)


def _chunks(n: int, k: str = "tiles"):
    """The launches of n levels by kernel k: v3 takes 3 levels per launch, the others 8."""
    size = _V3_MAX_LEVELS if k == "v3" else _MAX_LEVELS
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def validate_levels(logits) -> List[torch.Tensor]:
    if isinstance(logits, torch.Tensor) or not isinstance(logits, (list, tuple)):
        raise TypeError("logits must be a list or tuple of (B, n_l) tensors, coarse level first, "
                        f"got {type(logits).__name__}")
    if len(logits) == 0:
        raise ValueError("logits must hold at least one level, got an empty sequence")
    out = []
    for i, x in enumerate(logits):
        check_tensor(f"logits[{i}]", x, ndim=2, floating=True)
        if x.shape[1] < 1:
            raise ValueError(f"logits[{i}] must have at least one class, got shape {tuple(x.shape)}")
        if x.shape[0] != logits[0].shape[0]:
            raise ValueError(f"logits[{i}] has batch size {x.shape[0]}, expected {logits[0].shape[0]} "
                             "like logits[0]")
        if x.dtype != logits[0].dtype:
            raise TypeError(f"logits[{i}] has dtype {x.dtype}, expected {logits[0].dtype} like logits[0]")
        check_finite(f"logits[{i}]", x)
        out.append(x)
    check_same_device(**{f"logits[{i}]": x for i, x in enumerate(out)})
    return out


def _level_args(logits, grads=None, tables=None, dim=0):
    weights = level_weights([x.shape[1] for x in logits])
    return [(ptr(x), ptr(grads[i]) if grads else 0, x.shape[1], x.stride(0), weights[i],
             ptr(tables[i]) if tables else 0, i * dim) for i, x in enumerate(logits)]


# ---- calendar_scalar -------------------------------------------------------------------------

@torch.library.custom_op("tempokern::calendar_scalar", mutates_args=())
def _calendar_scalar(logits: List[torch.Tensor], tau: float) -> torch.Tensor:
    logits = [rows_contiguous(x) for x in logits]
    x0 = logits[0]
    out = torch.empty(x0.shape[0], dtype=acc_dtype(x0.dtype), device=x0.device)
    be = backend.resolve(x0)
    dev, stream = be.launch
    levels = _level_args(logits)
    v = _kernel("scalar_fwd", logits, be=be)
    for k, idx in enumerate(_chunks(len(levels), v)):
        be.kernels.calendar_launch(_op("scalar_fwd", v), dev, stream, dtype_code(x0), x0.shape[0], 1.0 / tau,
                                  [levels[i] for i in idx], ptr(out), 0, 0, 0, k > 0, 1,
                                  _max_ctas(be, "scalar_fwd", v))
    return out


@_calendar_scalar.register_fake
def _(logits, tau):
    return logits[0].new_empty(logits[0].shape[0], dtype=acc_dtype(logits[0].dtype))


@torch.library.custom_op("tempokern::calendar_scalar_backward", mutates_args=())
def _calendar_scalar_backward(grad: torch.Tensor, logits: List[torch.Tensor], tau: float) -> List[torch.Tensor]:
    logits = [rows_contiguous(x) for x in logits]
    x0 = logits[0]
    grad = grad.to(acc_dtype(x0.dtype)).contiguous()
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in logits]
    be = backend.resolve(x0)
    dev, stream = be.launch
    levels = _level_args(logits, grads)
    v = _kernel("scalar_bwd", logits, be=be)
    for idx in _chunks(len(levels), v):
        be.kernels.calendar_launch(_op("scalar_bwd", v), dev, stream, dtype_code(x0), x0.shape[0], 1.0 / tau,
                                  [levels[i] for i in idx], 0, ptr(grad), 0, 0, False, 1,
                                  _max_ctas(be, "scalar_bwd", v))
    return grads


@_calendar_scalar_backward.register_fake
def _(grad, logits, tau):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in logits]


def _scalar_setup(ctx, inputs, output):
    logits, tau = inputs
    ctx.save_for_backward(*logits)
    ctx.tau = tau


def _scalar_backward(ctx, grad):
    logits = list(ctx.saved_tensors)
    return torch.ops.tempokern.calendar_scalar_backward(grad, logits, ctx.tau), None


_calendar_scalar.register_autograd(_scalar_backward, setup_context=_scalar_setup)


def calendar_scalar(logits: Sequence[torch.Tensor], tau: float = 1.0) -> torch.Tensor:
    """Expected linear calendar position u in [0, 1] per row (fused softmax + expectation).

    ``logits``: L tensors (B, n_l), coarse level first. Returns float32 (float64 for
    float64 input) of shape (B,). See :func:`tempokern.reference.calendar_scalar`."""
    logits = validate_levels(logits)
    tau = check_reciprocal("tau", tau, acc_dtype(logits[0].dtype))
    return torch.ops.tempokern.calendar_scalar(logits, tau)


# ---- calendar_context ------------------------------------------------------------------------

@torch.library.custom_op("tempokern::calendar_context", mutates_args=())
def _calendar_context(logits: List[torch.Tensor], dim: int, tau: float) -> torch.Tensor:
    logits = [rows_contiguous(x) for x in logits]
    x0 = logits[0]
    B, L = x0.shape[0], len(logits)
    out = torch.empty(B, L * dim, dtype=x0.dtype, device=x0.device)
    if dim == 0 or B == 0:
        return out
    be = backend.resolve(x0)
    dev, stream = be.launch
    v = _kernel("context_fwd", logits, dim, be=be)
    layout = "cuda_fwd" if be.cuda_path else "cpu"
    tables = [_table(x.shape[1], dim, acc_dtype(x0.dtype), x0.device, layout) for x in logits]
    levels = _level_args(logits, tables=tables, dim=dim)
    for idx in _chunks(L, v):
        be.kernels.calendar_launch(_op("context_fwd", v), dev, stream, dtype_code(x0), B, 1.0 / tau,
                                  [levels[i] for i in idx], ptr(out), 0, out.stride(0), dim, False, 1,
                                  _max_ctas(be, "context_fwd", v))
    return out


@_calendar_context.register_fake
def _(logits, dim, tau):
    return logits[0].new_empty(logits[0].shape[0], len(logits) * dim)


@torch.library.custom_op("tempokern::calendar_context_backward", mutates_args=())
def _calendar_context_backward(grad: torch.Tensor, logits: List[torch.Tensor], dim: int,
                               tau: float) -> List[torch.Tensor]:
    logits = [rows_contiguous(x) for x in logits]
    x0 = logits[0]
    B = x0.shape[0]
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in logits]
    if B == 0:
        return grads
    if dim == 0:
        return [g.zero_() for g in grads]
    grad = grad.to(x0.dtype)  # read through its strides: a broadcast gradient (from .sum()) is not copied
    be = backend.resolve(x0)
    dev, stream = be.launch
    v = _kernel("context_bwd", logits, dim, grad, be)
    # the tile kernel reads the transposed table; v3 the forward's layout (rows of classes, 16-byte loads along dim)
    layout = ("cuda_fwd" if v == "v3" else "cuda_bwd") if be.cuda_path else "cpu"
    tables = [_table(x.shape[1], dim, acc_dtype(x0.dtype), x0.device, layout) for x in logits]
    levels = _level_args(logits, grads, tables, dim)
    for idx in _chunks(len(logits), v):
        be.kernels.calendar_launch(_op("context_bwd", v), dev, stream, dtype_code(x0), B, 1.0 / tau,
                                  [levels[i] for i in idx], 0, ptr(grad), grad.stride(0), dim, False, grad.stride(1),
                                  _max_ctas(be, "context_bwd", v))
    return grads


@_calendar_context_backward.register_fake
def _(grad, logits, dim, tau):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in logits]


def _context_setup(ctx, inputs, output):
    logits, dim, tau = inputs
    ctx.save_for_backward(*logits)
    ctx.dim, ctx.tau = dim, tau


def _context_backward(ctx, grad):
    logits = list(ctx.saved_tensors)
    return torch.ops.tempokern.calendar_context_backward(grad, logits, ctx.dim, ctx.tau), None, None


_calendar_context.register_autograd(_context_backward, setup_context=_context_setup)


def calendar_context(logits: Sequence[torch.Tensor], dim: int, tau: float = 1.0) -> torch.Tensor:
    """Per level, softmax(logits_l / tau) @ fourier_table(n_l, dim), concatenated: (B, L*dim)
    in the logits' dtype (float32 accumulation). See :func:`tempokern.reference.calendar_context`."""
    logits = validate_levels(logits)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    tau = check_reciprocal("tau", tau, acc_dtype(logits[0].dtype))
    return torch.ops.tempokern.calendar_context(logits, dim, tau)


def fourier_table(n: int, dim: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The fixed sinusoidal codebook (n, dim) used by calendar_context."""
    for name, v, lo in (("n", n, 1), ("dim", dim, 1)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    return _ref_fourier_table(n, dim, dtype=dtype, device=device)
