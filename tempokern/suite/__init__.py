"""The English comparison suite: `tempokern benchmark --suite english` (docs/benchmark-english.md).

Methods register rows with :func:`register` (modules of :mod:`tempokern.suite.methods`); the runner
trains and evaluates each on the same splits with the same backbone and writes results.json,
results.md and plots."""
from .registry import (EVAL_SPLITS, SETS, Budget, Method, MethodOutput, SuiteContext, get_method, missing_needs,
                       register, registered, topk_runs, unregister)
from .runner import load_methods as _load_methods

__all__ = ["Method", "MethodOutput", "SuiteContext", "Budget", "register", "registered", "unregister",
           "get_method", "missing_needs", "topk_runs", "SETS", "EVAL_SPLITS", "load_methods"]


def load_methods():
    """Import every module of :mod:`tempokern.suite.methods` (each registers its rows); returns
    ``(registered(), errors)`` where errors = {module: message} of modules that failed to import."""
    return _load_methods()
