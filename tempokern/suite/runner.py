"""The suite runner (filled in below the registry API)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, List, Tuple

from .registry import Method, registered


def load_methods() -> Tuple[List[Method], Dict[str, str]]:
    """Import every module of tempokern.suite.methods; returns (registered methods, import errors)."""
    from . import methods as pkg
    errors: Dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        name = f"{pkg.__name__}.{info.name}"
        try:
            importlib.import_module(name)
        except Exception as e:  # reported in results.md, not skipped silently
            errors[name] = f"{type(e).__name__}: {e}"
    return registered(), errors
