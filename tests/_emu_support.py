"""The test harness's emulator hooks: tools/cuda_emu/emu_support.py (cuda_emulator, force_blocked)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "cuda_emu"))
try:
    from emu_support import cuda_emulator, force_blocked  # noqa: E402,F401
finally:
    sys.path.pop(0)

from tempokern._ops import backend as _backend  # noqa: E402

_REAL_SM_COUNT = _backend.Backend.sm_count.fget


def patch_sm_count(monkeypatch, fn) -> None:
    """Every backend reports fn(device) streaming multiprocessors for the rest of the test (grid sizes)."""
    monkeypatch.setattr(_backend.Backend, "sm_count", property(lambda self: fn(self.device)))


def real_sm_count(device) -> int:
    """The SM count of device's backend as it is without patch_sm_count."""
    return _REAL_SM_COUNT(_backend.resolve(device))


def real_kernels():
    """The compiled module CPU / emulated tensors launch (tempokern._C or the installed emulated build)."""
    return _backend.kernels_for(False)


def patch_kernels(monkeypatch, spy) -> None:
    """Every backend launches through ``spy()`` (a module-like object) for the rest of the test."""
    monkeypatch.setattr(_backend.Backend, "kernels", property(lambda self: spy()))
