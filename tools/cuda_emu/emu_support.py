"""Support for the CUDA emulator (tools/cuda_emu) and the blocked torch paths, for tests, tools and benchmarks:
installs a backend (tempokern/_ops/backend.py) for the CPU tensors of the code inside the block. Product code
never imports this (tests/test_dispatch.py checks)."""
from __future__ import annotations

import contextlib

from tempokern._ops import backend


@contextlib.contextmanager
def cuda_emulator(module):
    """Runs CPU tensors through the CUDA kernels of ``module``, an emulated build of _C; ``module=None`` switches
    the emulator off inside the block (the CPU kernels)."""
    inst = backend._installed.get()
    with backend.installed(module, block_rows=None if inst is None else inst.block_rows):
        yield module


@contextlib.contextmanager
def force_blocked(block_rows: int = 0):
    """Runs CPU tensors through the blocked torch path (the CUDA path's algorithm) of the ops that have one, with
    blocks of ``block_rows`` rows (0: chosen from the memory budget). Keeps an installed emulator."""
    inst = backend._installed.get()
    with backend.installed(None if inst is None else inst.kernels, block_rows=int(block_rows)):
        yield
