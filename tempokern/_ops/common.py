"""Shared plumbing for the op wrappers: the compiled module, dtype codes, launch
arguments, argument validation and the debug finite-value switch."""
from __future__ import annotations

import math
import os
import struct
from typing import Iterable, Optional, Sequence

import torch

from .. import _C  # noqa: F401
from . import backend
from .._util import cache_put

# Must match csrc/common/types.h::DType.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
FLOAT_DTYPES = tuple(DTYPE_CODES)

_checks = os.environ.get("TEMPOKERN_CHECK", "0") not in ("", "0", "false", "False")


def set_debug_checks(enabled: bool) -> None:
    """Turn finite-value checks on or off (also: environment TEMPOKERN_CHECK=1).

    Off by default: a check costs a device synchronisation on every call."""
    global _checks
    _checks = bool(enabled)


def debug_checks_enabled() -> bool:
    return _checks


def check_finite(name: str, t: torch.Tensor) -> None:
    if _checks and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf values (TEMPOKERN_CHECK is on)")


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def kernels():
    """The compiled module of the backend CPU tensors run on (tempokern/_ops/backend.py): tempokern._C, or an
    installed emulated build."""
    return backend.resolve(_CPU).kernels


_CPU = torch.device("cpu")


def on_cuda_path(t) -> bool:
    """Whether an op on tensor (or device) t runs the CUDA kernels (backend.resolve(t).cuda_path)."""
    return backend.resolve(t).cuda_path


def sm_count(device: torch.device) -> int:
    """backend.resolve(device).sm_count."""
    return backend.resolve(device).sm_count


def launch_args(t: torch.Tensor) -> tuple[int, int]:
    """(device, stream) for a kernel launch: device -1 means CPU (backend.resolve(t).launch)."""
    return backend.resolve(t).launch


def check_tensor(name: str, t, *, ndim: Optional[int] = None, floating: bool = False,
                 integer: bool = False, dtypes: Optional[Iterable[torch.dtype]] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name} must have dtype in {tuple(dtypes)}, got {t.dtype}")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"{name} must be a CPU or CUDA tensor, got device {t.device}")
    if integer:
        check_int64_range(name, t)
    return t


def _has_values(t: torch.Tensor) -> bool:
    """Whether t's values can be read here: a plain tensor (not meta, not a torch.compile fake / functional
    tensor, whose values a trace does not know)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


def check_int64_range(name: str, t: torch.Tensor) -> None:
    """Integer arguments (spans, ids, indices) are used as int64: a uint64 tensor holding a value >= 2^63
    would wrap to a negative number, so it is a ValueError naming the argument. Reads the values only for
    uint64 (one device synchronisation there)."""
    if t.dtype != torch.uint64 or t.numel() == 0 or not _has_values(t):
        return
    if bool((t.view(torch.int64) < 0).any()):   # the uint64 values >= 2^63, seen as int64
        raise ValueError(f"{name} holds a uint64 value >= 2**63, outside the int64 range the op computes in")


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    devs = {k: v.device for k, v in tensors.items() if v is not None}
    first = next(iter(devs.values()))
    for k, d in devs.items():
        if d != first:
            desc = ", ".join(f"{n} on {dv}" for n, dv in devs.items())
            raise ValueError(f"all tensors must be on one device, got {desc}")
    return first


def scalar_value(name: str, value) -> float:
    """A Python int/float or a one-element tensor as a float (bools rejected)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value, got a tensor of shape {tuple(value.shape)}")
        value = value.detach().reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")
    return float(value)


def check_positive(name: str, value) -> float:
    value = scalar_value(name, value)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _as_float32(v: float) -> float:
    """v rounded to float32 (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.inf


def check_reciprocal(name: str, value, acc: torch.dtype) -> float:
    """A finite number > 0 whose reciprocal the accumulation dtype ``acc`` can hold (a temperature or a
    softmax tau: the kernels multiply by 1 / value), else a ValueError naming the argument."""
    v = check_positive(name, value)
    va = v if acc == torch.float64 else _as_float32(v)     # what the kernels see (no tensor: no host copy)
    if va == 0.0 or not 1.0 / va <= torch.finfo(acc).max:
        raise ValueError(f"{name} {v!r} is too small: 1 / {name} overflows {acc} (the dtype the op computes in)")
    return v


def compiling(default: bool = True) -> bool:
    """Whether torch.compile is tracing the caller (``default`` where torch cannot say)."""
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(f()) if f is not None else default


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the ops: float64 for float64 input, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take a row stride but need unit column stride."""
    if t.dim() >= 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


_CONSTANTS: dict = {}
_CONSTANTS_MAX = 256  # small tensors (level coefficients, scales): bounded, pins little memory


def device_constant(values, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """torch.tensor(values, dtype, like.device), cached per (values, dtype, device) when ``like`` is a plain
    tensor. A fresh torch.tensor on a GPU is a host-to-device copy from pageable memory, which waits for the
    stream: one host synchronisation per training step (measured on the H100, 2026-11-23: the table-bias step
    issued in 3.3 ms with one per step). Traced calls (torch.compile's fake / functional tensors) get a plain
    torch.tensor, which the trace records as a constant. Callers must not modify the returned tensor."""
    if type(like) not in (torch.Tensor, torch.nn.Parameter):
        return torch.tensor(values, dtype=dtype, device=like.device)
    key = (repr(values), dtype, like.device)  # repr: -0.0 and 0.0 differ, NaN finds its entry
    t = _CONSTANTS.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():  # usable by autograd even if first made in inference
            t = cache_put(_CONSTANTS, key, torch.tensor(values, dtype=dtype).to(like.device), _CONSTANTS_MAX)
    return t
