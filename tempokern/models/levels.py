"""The one thing the encoder needs from a calendar: its levels (name, size), coarse first."""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Tuple

Level = Tuple[str, int]


class LevelSpec:
    """A calendar reduced to its level names and sizes: what a saved encoder records, and what
    `CTDEncoder.load` rebuilds when no `tempokern.Calendar` is passed."""

    def __init__(self, levels: Sequence[Level], name: str = "custom"):
        self.levels = [(str(n), int(s)) for n, s in levels]
        self.name = name

    def __repr__(self):
        return f"LevelSpec({self.name!r}, {self.levels})"


def _size(obj: Any) -> int:
    for attr in ("size", "n", "num_classes", "length"):
        v = getattr(obj, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError


def calendar_levels(calendar: Any) -> List[Level]:
    """[(name, size), ...] of a tempokern.Calendar, a LevelSpec, a {name: size} mapping or a
    sequence of (name, size) pairs. Raises TypeError/ValueError saying what was expected."""
    levels: Any = None
    if isinstance(calendar, Mapping):
        levels = list(calendar.items())
    elif isinstance(calendar, (list, tuple)):
        levels = list(calendar)
    else:
        names = sizes = None
        for na, sa in (("level_names", "level_sizes"), ("names", "sizes")):
            names, sizes = getattr(calendar, na, None), getattr(calendar, sa, None)
            if callable(names):
                names = names()
            if callable(sizes):
                sizes = sizes()
            if names is not None and sizes is not None:
                levels = list(zip(names, sizes))
                break
        if levels is None:
            raw = getattr(calendar, "levels", None)
            if callable(raw):
                raw = raw()
            if raw is not None:
                levels = []
                for i, lv in enumerate(raw):
                    if isinstance(lv, (tuple, list)) and len(lv) == 2:
                        levels.append((lv[0], lv[1]))
                    else:
                        try:
                            levels.append((getattr(lv, "name", f"level{i}"), _size(lv)))
                        except TypeError:
                            levels = None
                            break
        if levels is None and sizes is not None:
            levels = [(f"level{i}", s) for i, s in enumerate(sizes)]
    if not levels:
        raise TypeError("calendar must be a tempokern.Calendar (or a sequence of (level name, size) pairs, "
                        f"coarse first), got {type(calendar).__name__}")
    out = []
    for i, lv in enumerate(levels):
        try:
            name, size = lv
            size = int(size)
        except (TypeError, ValueError):
            raise TypeError(f"calendar level {i} must be a (name, size) pair, got {lv!r}") from None
        if size < 1:
            raise ValueError(f"calendar level {i} ({name}) must have size >= 1, got {size}")
        out.append((str(name), size))
    return out


def calendar_name(calendar: Any) -> str:
    for attr in ("name", "kind"):
        v = getattr(calendar, attr, None)
        if isinstance(v, str):
            return v
    return "custom"
