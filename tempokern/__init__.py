"""tempokern: fused C++/CUDA kernels for temporal retrieval as PyTorch custom ops."""
from ._version import __version__
from . import _C  # noqa: F401  (compiled kernels; imports without a GPU driver)
from ._build import build_info
from ._ops.common import debug_checks_enabled, set_debug_checks
from ._ops.calendar import calendar_context, calendar_scalar, fourier_table
from ._ops.offset_bias import offset_bias, offset_bias_lookup
from ._ops.multipos_infonce import multipos_infonce
from ._ops.ctd_topk import ctd_topk
from . import reference
from . import nn
from . import search
from .calendar import Calendar, Interval
from . import baselines, datasets, eval

__all__ = [
    "__version__", "build_info", "set_debug_checks", "debug_checks_enabled",
    "calendar_scalar", "calendar_context", "fourier_table",
    "offset_bias", "offset_bias_lookup", "multipos_infonce", "ctd_topk",
    "reference", "nn", "search", "Calendar", "Interval", "baselines", "datasets", "eval",
]


def __getattr__(name):  # tempokern.models / tempokern.training on first use (they need transformers at run time)
    if name in ("models", "training"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tempokern' has no attribute {name!r}")
