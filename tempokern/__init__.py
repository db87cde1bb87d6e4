"""tempokern: fused C++/CUDA kernels for temporal retrieval as PyTorch custom ops."""
from ._version import __version__


def _load_extension():
    """Imports tempokern._C (the compiled kernels; imports without a GPU driver). When it is missing or
    does not load, raises an ImportError that says why and what to do, instead of Python's
    "cannot import name '_C' from partially initialized module ... (circular import)"."""
    import importlib
    import importlib.machinery
    import os
    import sys
    try:
        return importlib.import_module("._C", __name__)
    except ImportError as e:
        err = e
    here = os.path.dirname(os.path.abspath(__file__))
    built = sorted(f for f in os.listdir(here) if f.startswith("_C.") and f.endswith((".so", ".pyd")))
    todo = ("Either install it (`pip install .` in the checkout, then run Python from another directory: a "
            "checkout's tempokern/ folder shadows the installed package when the checkout root is the current "
            "directory or on sys.path), or build it in place for development (`tools/dev_build.sh`, see "
            "docs/DEVELOPING.md).")
    if isinstance(err, ModuleNotFoundError) and err.name == f"{__name__}._C":
        if not built:
            msg = (f"tempokern's compiled extension tempokern._C was not found in {here}: this looks like a source "
                   f"checkout that has not been built. {todo}")
        else:
            msg = (f"tempokern's compiled extension in {here} ({', '.join(built)}) was built for another Python: "
                   f"this interpreter ({sys.executable}, Python {sys.version.split()[0]}) loads "
                   f"{' / '.join('_C' + s for s in importlib.machinery.EXTENSION_SUFFIXES)}. Rebuild it with this "
                   f"interpreter: `PYTHON={sys.executable} tools/dev_build.sh`, or `pip install .`.")
    else:
        msg = (f"tempokern's compiled extension tempokern._C in {here} failed to load ({err}); it may be stale or "
               f"built against another environment. Rebuild it. {todo}")
        raise ImportError(msg, name=f"{__name__}._C") from err
    raise ImportError(msg, name=f"{__name__}._C") from None


_C = _load_extension()
del _load_extension
from ._build import build_info
from ._ops.common import debug_checks_enabled, set_debug_checks
from ._ops.calendar import calendar_context, calendar_scalar, fourier_table
from ._ops.offset_bias import offset_bias, offset_bias_lookup
from ._ops.routing import matryoshka_infonce, multipos_infonce
from ._ops.ctd_topk import ctd_topk
from ._ops.matryoshka_infonce import truncate
from . import reference
from . import nn
from . import search
from .calendar import Calendar, Interval
from . import baselines, datasets, eval
from . import rerank

__all__ = [
    "__version__", "build_info", "set_debug_checks", "debug_checks_enabled",
    "calendar_scalar", "calendar_context", "fourier_table",
    "offset_bias", "offset_bias_lookup", "multipos_infonce", "ctd_topk",
    "matryoshka_infonce", "truncate",
    "reference", "nn", "search", "Calendar", "Interval", "baselines", "datasets", "eval",
]
__all__ += ["rerank"]


def __getattr__(name):  # tempokern.models / tempokern.training on first use (they need transformers at run time)
    if name in ("models", "training"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tempokern' has no attribute {name!r}")
