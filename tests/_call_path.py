"""The call path of a tempokern entry point, measured with sys.setprofile: the sequence of tempokern modules the
executing frame moves through (consecutive frames of one module are one stop). ``modules``: distinct modules;
``reentries``: stops in a module the path had already left."""
from __future__ import annotations

import sys
from typing import Callable, List, Tuple


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "")


def call_path(fn: Callable[[], object]) -> Tuple[List[str], int, int]:
    """(stops, distinct tempokern modules, re-entries) of ``fn()``'s tempokern frames."""
    stops: List[str] = []

    def note(mod: str) -> None:
        if mod.startswith("tempokern") and (not stops or stops[-1] != mod):
            stops.append(mod)

    def prof(frame, event, arg):
        if event == "call":
            note(_module(frame))
        elif event == "return" and frame.f_back is not None:
            note(_module(frame.f_back))

    old = sys.getprofile()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(old)
    # the entry module itself (the nn module whose forward is called) starts the path
    seen, reentries = set(), 0
    for i, m in enumerate(stops):
        if m in seen:
            reentries += 1
        seen.add(m)
    return stops, len(seen), reentries
