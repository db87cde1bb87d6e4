"""build_info(): what this installation of tempokern was built with and can use."""
from __future__ import annotations

from . import _C
from ._version import __version__


def build_info() -> dict:
    ok, count, message = _C.cuda_runtime_status()
    archs = [a for a in _C.cuda_archs.split(",") if a]
    return {
        "version": __version__,
        "cuda_compiled": bool(_C.cuda_compiled),
        "cuda_archs": archs,
        "cuda_runtime_ok": bool(ok),
        "cuda_runtime_message": message,
        "device_count": int(count),
        "openmp_threads": int(_C.openmp_threads()),
    }
