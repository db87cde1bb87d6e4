"""The test harness's emulator hooks: tools/cuda_emu/emu_support.py (cuda_emulator, force_blocked)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "cuda_emu"))
try:
    from emu_support import cuda_emulator, force_blocked  # noqa: E402,F401
finally:
    sys.path.pop(0)
