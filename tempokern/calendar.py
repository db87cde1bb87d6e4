"""Calendars: a hierarchy of levels (coarse first) over which time keys live.

A :class:`Calendar` has L levels, each with a name and an ordered list of labels (its size).
The product of the sizes is the *padded grid*; the calendar's *units* are the grid slots that
really exist (e.g. Duke Min reigned 2 years, so years 3..32 of his reign are padding), listed in
chronological order. Every key therefore has three coordinates:

* ``index``: per-level 0-based indices, e.g. Duke Xi, year 3, month 5 -> ``(4, 2, 4)``;
* ``flat`` / grid position: ``flat = sum_l idx_l * prod_{k>l} n_k`` and
  ``u = flat / (prod_l n_l - 1)`` in [0, 1]: exactly the axis that
  :func:`tempokern.calendar_scalar` produces from per-level logits (for 12 x 32 x 12 this is
  ``(g*Y*M + y*M + m) / (G*Y*M - 1)``);
* ``rank`` / rank position: the unit's place among the real units (0 .. num_units-1, the
  "time id" ChunQiuTR uses), and ``rank / (num_units - 1)``.

Intervals (:class:`Interval`) are inclusive ranges of ranks; a key prefix such as ``(5,)`` (all of
Duke Xi) or ``(5, 3)`` (his third year) denotes the interval of the units under it.
"""
from __future__ import annotations

import bisect
import datetime as _dt
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._resources import load_chunqiu_splits

__all__ = ["Calendar", "Interval", "Level", "CHUNQIU_DUKES", "LEAP_MONTH"]

Key = Tuple[Any, ...]
KeyLike = Union[str, Sequence[Any], _dt.date, int]

#: label of the intercalary-month slot in reign calendars (a year's 13th month slot)
#: the years a Gregorian calendar (and every date field of a data file) may name (tempokern.limits)
from .limits import YEAR_MAX, YEAR_MIN  # noqa: E402
LEAP_MONTH = "闰"

#: the twelve dukes of Lu in the Spring and Autumn Annals: (pinyin, traditional, simplified)
CHUNQIU_DUKES = (
    ("Yin", "隱公", "隐公"), ("Huan", "桓公", "桓公"), ("Zhuang", "莊公", "庄公"), ("Min", "閔公", "闵公"),
    ("Xi", "僖公", "僖公"), ("Wen", "文公", "文公"), ("Xuan", "宣公", "宣公"), ("Cheng", "成公", "成公"),
    ("Xiang", "襄公", "襄公"), ("Zhao", "昭公", "昭公"), ("Ding", "定公", "定公"), ("Ai", "哀公", "哀公"),
)


@dataclass(frozen=True)
class Interval:
    """Inclusive range ``[start, end]`` of unit ranks on a calendar's rank axis."""
    start: int
    end: int

    def __post_init__(self):
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"Interval.{name} must be an int rank, got {type(v).__name__}")
        if self.end < self.start:
            raise ValueError(f"Interval end {self.end} is before start {self.start}")
        object.__setattr__(self, "start", int(self.start))
        object.__setattr__(self, "end", int(self.end))

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __contains__(self, rank) -> bool:
        return self.start <= rank <= self.end

    def overlaps(self, other: "Interval") -> bool:
        return self.start <= other.end and other.start <= self.end

    def overlap(self, other: "Interval") -> int:
        """Number of units both intervals cover."""
        return max(0, min(self.end, other.end) - max(self.start, other.start) + 1)

    def hull(self, other: "Interval") -> "Interval":
        return Interval(min(self.start, other.start), max(self.end, other.end))

    def ranks(self) -> range:
        return range(self.start, self.end + 1)

    def to_list(self) -> List[int]:
        return [self.start, self.end]


@dataclass(frozen=True)
class Level:
    """One calendar level: a name and its labels in index order (size = len(labels))."""
    name: str
    labels: Tuple[Any, ...]

    @property
    def size(self) -> int:
        return len(self.labels)


def _norm(c: Any) -> str:
    return str(c).strip()


class Calendar:
    """A hierarchy of levels (coarse first) with key <-> index <-> linear position.

    Parameters
    ----------
    levels:
        sequence of ``(name, size)`` (labels 1..size) or ``(name, labels)``, coarse level first.
    units:
        the real units as keys (label tuples or strings), in chronological order. Default: every
        grid slot in grid order (no padding).
    name:
        a short name (``"chunqiu"``, ``"gregorian"`` ...).
    aliases:
        optional per-level ``{alias: label}`` maps accepted when parsing keys (e.g. ``"僖公" -> 5``).
    splits:
        optional ``{key: split_name}`` for every unit (train/val/test by time).
    sep:
        separator of the string form of keys (``"5-3-12"``).
    """

    def __init__(self, levels: Sequence[Tuple[str, Union[int, Sequence[Any]]]],
                 units: Optional[Iterable[KeyLike]] = None, *, name: str = "calendar",
                 aliases: Optional[Sequence[Mapping[Any, Any]]] = None,
                 splits: Optional[Mapping[Any, str]] = None, sep: str = "-"):
        if isinstance(levels, (str, bytes)) or not isinstance(levels, Sequence) or len(levels) == 0:
            raise TypeError("levels must be a non-empty sequence of (name, size) or (name, labels) pairs")
        lv = []
        for i, item in enumerate(levels):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"levels[{i}] must be a (name, size) or (name, labels) pair, got {item!r}")
            lname, spec = item
            if isinstance(spec, bool):
                raise TypeError(f"levels[{i}] size must be an int or a label sequence, got bool")
            if isinstance(spec, (int, np.integer)):
                if spec < 1:
                    raise ValueError(f"levels[{i}] ({lname}) size must be >= 1, got {spec}")
                labels = tuple(range(1, int(spec) + 1))
            else:
                labels = tuple(spec)
                if not labels:
                    raise ValueError(f"levels[{i}] ({lname}) has no labels")
            if len({_norm(x) for x in labels}) != len(labels):
                raise ValueError(f"levels[{i}] ({lname}) has duplicate labels")
            lv.append(Level(str(lname), labels))
        self._levels: Tuple[Level, ...] = tuple(lv)
        self.name = name
        self.sep = sep
        self._sizes = tuple(l.size for l in lv)
        self._strides = tuple(math.prod(self._sizes[l + 1:]) for l in range(len(lv)))
        self._num_slots = math.prod(self._sizes)
        self._lookup: List[Dict[str, int]] = [{_norm(x): j for j, x in enumerate(l.labels)} for l in lv]
        self._aliases: List[Dict[str, Any]] = [{} for _ in lv]
        if aliases is not None:
            if len(aliases) != len(lv):
                raise ValueError(f"aliases must hold one mapping per level ({len(lv)}), got {len(aliases)}")
            for l, amap in enumerate(aliases):
                for a, target in (amap or {}).items():
                    j = self._lookup[l].get(_norm(target))
                    if j is None:
                        raise ValueError(f"alias {a!r} of level {lv[l].name} points to unknown label {target!r}")
                    self._lookup[l].setdefault(_norm(a), j)
                    self._aliases[l][str(a)] = lv[l].labels[j]
        if units is None:
            flats = np.arange(self._num_slots, dtype=np.int64)
        else:
            flats = np.asarray([self.flat(u) for u in units], dtype=np.int64)
            if flats.size == 0:
                raise ValueError("units must hold at least one key")
        rank_of = np.full(self._num_slots, -1, dtype=np.int64)
        if np.unique(flats).size != flats.size:
            dup = flats[np.argsort(flats)][np.flatnonzero(np.diff(np.sort(flats)) == 0)[0]]
            raise ValueError(f"units list the key {self.sep.join(map(str, self.key(int(dup))))} twice")
        rank_of[flats] = np.arange(flats.size)
        self._unit_flat = flats
        self._rank_of_flat = rank_of
        self._sorted_flat = np.sort(flats)
        self._splits: Optional[Dict[int, str]] = None
        if splits is not None:
            sp = {}
            for k, s in splits.items():
                r = self.rank(k)
                sp[r] = str(s)
            missing = flats.size - len(sp)
            if missing:
                raise ValueError(f"splits must name a split for every unit; {missing} units have none")
            self._splits = sp
        self.meta: Dict[str, Any] = {}

    # ---- structure -------------------------------------------------------------------------
    @property
    def levels(self) -> Tuple[Level, ...]:
        return self._levels

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(l.name for l in self._levels)

    @property
    def sizes(self) -> Tuple[int, ...]:
        """Per-level sizes of the padded grid (the class counts of per-level time heads)."""
        return self._sizes

    @property
    def num_levels(self) -> int:
        return len(self._levels)

    @property
    def num_slots(self) -> int:
        """Size of the padded grid, prod(sizes)."""
        return self._num_slots

    @property
    def num_units(self) -> int:
        """Number of real units (months for chunqiu)."""
        return int(self._unit_flat.size)

    def __len__(self) -> int:
        return self.num_units

    def __iter__(self) -> Iterator[Key]:
        return (self.key(int(f)) for f in self._unit_flat)

    def __contains__(self, key) -> bool:
        try:
            return self._rank_of_flat[self.flat(key)] >= 0
        except (KeyError, ValueError, TypeError):
            return False

    def __repr__(self) -> str:
        lv = ", ".join(f"{l.name}={l.size}" for l in self._levels)
        return f"Calendar({self.name!r}: {lv}; {self.num_units} of {self.num_slots} slots real)"

    # ---- key <-> index <-> flat ------------------------------------------------------------
    def _components(self, key: KeyLike, allow_prefix: bool = False) -> List[Any]:
        if isinstance(key, _dt.datetime):
            key = key.date()
        if isinstance(key, _dt.date):
            comps: List[Any] = [key.year, key.month, key.day][: self.num_levels]
        elif isinstance(key, str):
            comps = [c for c in key.strip().split(self.sep)] if key.strip() else []
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            comps = [int(key)]
        elif isinstance(key, (tuple, list)):
            comps = list(key)
        else:
            raise TypeError(f"a calendar key must be a tuple of labels, a '{self.sep}'-joined string or a "
                            f"date, got {type(key).__name__}")
        n = len(comps)
        if n == 0 or n > self.num_levels or (n < self.num_levels and not allow_prefix):
            want = f"1..{self.num_levels}" if allow_prefix else str(self.num_levels)
            raise ValueError(f"key {key!r} has {n} components, calendar {self.name!r} expects {want} "
                             f"({', '.join(self.names)})")
        return comps

    def _level_index(self, l: int, c: Any, key: Any) -> int:
        s = _norm(c)
        j = self._lookup[l].get(s)
        if j is None and s.lstrip("-").isdigit():
            j = self._lookup[l].get(str(int(s)))
        if j is None:
            lv = self._levels[l]
            raise KeyError(f"key {key!r}: {c!r} is not a label of level {lv.name!r} of calendar "
                           f"{self.name!r} (labels {lv.labels[0]!r}..{lv.labels[-1]!r})")
        return j

    def index(self, key: KeyLike) -> Tuple[int, ...]:
        """Per-level 0-based indices of ``key`` (padding slots allowed; see :meth:`is_real`)."""
        comps = self._components(key)
        return tuple(self._level_index(l, c, key) for l, c in enumerate(comps))

    def key(self, index_or_flat: Union[int, Sequence[int]]) -> Key:
        """Label tuple of a per-level index tuple or of a flat slot number."""
        if isinstance(index_or_flat, (int, np.integer)) and not isinstance(index_or_flat, bool):
            index_or_flat = self.unflat(int(index_or_flat))
        idx = tuple(int(i) for i in index_or_flat)
        if len(idx) != self.num_levels:
            raise ValueError(f"index {idx} must have {self.num_levels} entries")
        for l, i in enumerate(idx):
            if not 0 <= i < self._sizes[l]:
                raise ValueError(f"index {idx}: level {self._levels[l].name!r} index {i} out of range "
                                 f"[0, {self._sizes[l]})")
        return tuple(self._levels[l].labels[i] for l, i in enumerate(idx))

    def key_str(self, key: KeyLike) -> str:
        """Canonical string form, e.g. ``"5-3-12"``."""
        return self.sep.join(str(x) for x in self.key(self.index(key)))

    def parse(self, key: KeyLike) -> Key:
        """Canonical label tuple of any accepted key form (raises on unknown labels)."""
        return self.key(self.index(key))

    def flat(self, key: KeyLike) -> int:
        """Slot number on the padded grid (row-major, coarse level first)."""
        return int(sum(i * s for i, s in zip(self.index(key), self._strides)))

    def unflat(self, flat: int) -> Tuple[int, ...]:
        if not 0 <= int(flat) < self._num_slots:
            raise ValueError(f"flat slot {flat} out of range [0, {self._num_slots})")
        out, rem = [], int(flat)
        for s in self._strides:
            out.append(rem // s)
            rem %= s
        return tuple(out)

    def is_real(self, key: KeyLike) -> bool:
        """True if ``key`` is a real unit, False if it is a padding slot (raises on unknown labels)."""
        return bool(self._rank_of_flat[self.flat(key)] >= 0)

    # ---- ranks and positions ---------------------------------------------------------------
    def rank(self, key: KeyLike) -> int:
        """Chronological rank of a real unit, 0 .. num_units-1 (ChunQiuTR's time id)."""
        f = self.flat(key)
        r = int(self._rank_of_flat[f])
        if r < 0:
            raise KeyError(f"key {key!r} is a padding slot of calendar {self.name!r}, not a real unit")
        return r

    def key_at(self, rank: int) -> Key:
        """Key of the unit with this rank."""
        if not 0 <= int(rank) < self.num_units:
            raise IndexError(f"rank {rank} out of range [0, {self.num_units})")
        return self.key(int(self._unit_flat[int(rank)]))

    def position(self, key: KeyLike, axis: str = "grid") -> float:
        """Linear position in [0, 1]: ``axis="grid"`` gives flat/(num_slots-1), the
        :func:`tempokern.calendar_scalar` axis; ``axis="rank"`` gives rank/(num_units-1)."""
        if axis == "grid":
            return self.flat(key) / max(1, self._num_slots - 1)
        if axis == "rank":
            return self.rank(key) / max(1, self.num_units - 1)
        raise ValueError(f"axis must be 'grid' or 'rank', got {axis!r}")

    def positions(self, keys: Iterable[KeyLike], axis: str = "grid") -> np.ndarray:
        """:meth:`position` of many keys, float64 array."""
        return np.asarray([self.position(k, axis) for k in keys], dtype=np.float64)

    def ranks(self, keys: Iterable[KeyLike]) -> np.ndarray:
        return np.asarray([self.rank(k) for k in keys], dtype=np.int64)

    def targets(self, keys: Iterable[KeyLike]) -> np.ndarray:
        """(N, L) int64 per-level class indices: the labels of per-level time heads (CTD)."""
        out = np.asarray([self.index(k) for k in keys], dtype=np.int64)
        return out.reshape(-1, self.num_levels)

    def grid_of_rank(self, ranks) -> np.ndarray:
        """Grid positions u of units given by rank (vectorized)."""
        r = np.asarray(ranks, dtype=np.int64)
        return self._unit_flat[r] / max(1, self._num_slots - 1)

    def rank_of_grid(self, u: Union[float, np.ndarray]) -> np.ndarray:
        """Rank of the real unit nearest (on the grid) to grid position(s) ``u``."""
        f = np.rint(np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0) * (self._num_slots - 1)).astype(np.int64)
        sf = self._sorted_flat
        j = np.clip(np.searchsorted(sf, f), 0, sf.size - 1)
        jl = np.clip(j - 1, 0, sf.size - 1)
        pick = np.where(np.abs(sf[jl] - f) <= np.abs(sf[j] - f), sf[jl], sf[j])
        return self._rank_of_flat[pick]

    def from_position(self, u: float, axis: str = "grid") -> Key:
        """Key of the real unit nearest to position ``u`` on the given axis."""
        if axis == "grid":
            return self.key_at(int(self.rank_of_grid(float(u))))
        if axis == "rank":
            return self.key_at(int(round(min(1.0, max(0.0, float(u))) * (self.num_units - 1))))
        raise ValueError(f"axis must be 'grid' or 'rank', got {axis!r}")

    # ---- padding ---------------------------------------------------------------------------
    def padding_mask(self) -> np.ndarray:
        """Boolean array of shape ``sizes``: True where the slot is a real unit."""
        return (self._rank_of_flat >= 0).reshape(self._sizes)

    def valid_children(self, prefix: KeyLike = ()) -> List[int]:
        """Indices at level ``len(prefix)`` that reach at least one real unit under ``prefix``
        (use it to mask a per-level classifier for uneven levels)."""
        comps = [] if (isinstance(prefix, (tuple, list)) and len(prefix) == 0) else self._components(prefix, True)
        if len(comps) >= self.num_levels:
            raise ValueError(f"prefix {prefix!r} must be shorter than the {self.num_levels} levels")
        m = self.padding_mask()
        for l, c in enumerate(comps):
            m = m[self._level_index(l, c, prefix)]
        return [int(i) for i in np.flatnonzero(m.reshape(m.shape[0], -1).any(axis=1))]

    # ---- intervals -------------------------------------------------------------------------
    def span(self, prefix: KeyLike) -> Interval:
        """Interval of the real units under a key prefix (a full key gives a one-unit interval)."""
        comps = self._components(prefix, allow_prefix=True)
        idx = [self._level_index(l, c, prefix) for l, c in enumerate(comps)]
        lo = sum(i * s for i, s in zip(idx, self._strides))
        hi = lo + self._strides[len(idx) - 1] - 1
        sf = self._sorted_flat
        a, b = bisect.bisect_left(sf, lo), bisect.bisect_right(sf, hi)
        if a >= b:
            raise KeyError(f"prefix {prefix!r} holds no real unit of calendar {self.name!r}")
        ranks = self._rank_of_flat[sf[a:b]]
        return Interval(int(ranks.min()), int(ranks.max()))

    def interval(self, start: KeyLike, end: Optional[KeyLike] = None) -> Interval:
        """Interval from the first unit under ``start`` to the last unit under ``end``
        (default ``end = start``); both may be key prefixes."""
        a = self.span(start)
        b = a if end is None else self.span(end)
        if b.end < a.start:
            raise ValueError(f"interval end {end!r} is before its start {start!r}")
        return Interval(a.start, b.end)

    def keys_in(self, interval: Interval) -> List[Key]:
        return [self.key_at(r) for r in interval.ranks()]

    # ---- splits ----------------------------------------------------------------------------
    @property
    def has_splits(self) -> bool:
        return self._splits is not None

    def split(self, key: KeyLike) -> str:
        """Split name ("train"/"val"/"test") of a unit."""
        if self._splits is None:
            raise ValueError(f"calendar {self.name!r} has no splits")
        return self._splits[self.rank(key)]

    def split_of_rank(self, rank: int) -> str:
        if self._splits is None:
            raise ValueError(f"calendar {self.name!r} has no splits")
        return self._splits[int(rank)]

    def split_keys(self, split: str) -> List[Key]:
        """Units of one split, chronological."""
        if self._splits is None:
            raise ValueError(f"calendar {self.name!r} has no splits")
        out = [self.key_at(r) for r in range(self.num_units) if self._splits[r] == split]
        if not out:
            raise ValueError(f"calendar {self.name!r} has no split {split!r}; splits: {sorted(set(self._splits.values()))}")
        return out

    def split_of_interval(self, interval: Interval) -> str:
        """The split holding every unit of ``interval``, or ``"mixed"`` (as ChunQiuTR does)."""
        s = {self.split_of_rank(r) for r in interval.ranks()}
        return s.pop() if len(s) == 1 else "mixed"

    def with_splits(self, blocks: Mapping[Any, str], default: str = "train") -> "Calendar":
        """A copy whose units are split by key prefixes: ``{("永明", 6): "val", ("永明", 7): "test"}``
        puts every unit under each prefix in that split and the rest in ``default`` (reign-aligned,
        leak-free blocks as in ChunQiuTR). Later prefixes win where prefixes nest."""
        assign = [default] * self.num_units
        for prefix, name in blocks.items():
            iv = self.span(prefix)
            for r in iv.ranks():
                assign[r] = str(name)
        units = [self.key_at(r) for r in range(self.num_units)]
        cal = Calendar([(l.name, l.labels) for l in self._levels], units=units, name=self.name,
                       aliases=self._aliases, splits=dict(zip(units, assign)), sep=self.sep)
        cal.meta.update(self.meta)
        return cal

    # ---- factories -------------------------------------------------------------------------
    @classmethod
    def chunqiu(cls) -> "Calendar":
        """The Lu timeline of the Spring and Autumn Annals (722-481 BCE) as in ChunQiuTR:
        12 dukes x up to 32 regnal years x 12 months, 3,036 real months of 4,608 slots, with the
        reign-aligned train/val/test month splits of the ChunQiuTR release (2,424/295/317).
        Keys are ``(duke, year, month)``, 1-based ints (``"5-3-12"`` works too); dukes also accept
        their names (``"Xi"``, ``"僖公"``)."""
        raw = load_chunqiu_splits()
        keys = sorted((tuple(int(x) for x in k.split("-")) for k in raw), key=lambda t: t)
        splits = {k: raw["-".join(map(str, k))] for k in keys}
        aliases = [{a: i + 1 for i, names in enumerate(CHUNQIU_DUKES) for a in names}, {}, {}]
        cal = cls([("duke", 12), ("year", 32), ("month", 12)], units=keys, name="chunqiu",
                  aliases=aliases, splits=splits)
        cal.meta["duke_names"] = {i + 1: n for i, n in enumerate(CHUNQIU_DUKES)}
        return cal

    @classmethod
    def reign(cls, eras: Sequence[Tuple], months: int = 12,
              leap_months: Optional[Mapping[Tuple[str, int], int]] = None, name: str = "reign",
              splits: Optional[Mapping[Any, str]] = None) -> "Calendar":
        """Era-based calendar (reign title, era year, lunar month), as in the Zizhi Tongjian.

        ``eras``: chronological ``(title, n_years)`` or ``(title, n_years, first_ad_year)``.
        ``leap_months``: ``{(title, era_year): m}``: that year has an intercalary month right after
        month m. The month level then has ``months + 1`` slots, the last labelled
        :data:`LEAP_MONTH` ("闰"), padding in years without one. The rank axis puts the leap month
        after month m; the grid puts it in the year's last slot (grid order is label order)."""
        if not eras:
            raise ValueError("eras must list at least one (title, n_years) era")
        titles, lens, ad = [], [], {}
        for i, e in enumerate(eras):
            if not isinstance(e, (tuple, list)) or len(e) not in (2, 3):
                raise TypeError(f"eras[{i}] must be (title, n_years) or (title, n_years, first_ad_year), got {e!r}")
            t, n = str(e[0]), e[1]
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"eras[{i}] ({t}) n_years must be a positive int, got {n!r}")
            titles.append(t)
            lens.append(int(n))
            if len(e) == 3:
                ad[t] = int(e[2])
        leap = {}
        for (t, y), m in (leap_months or {}).items():
            if t not in titles:
                raise ValueError(f"leap_months names unknown era {t!r}")
            if not 1 <= int(y) <= lens[titles.index(t)]:
                raise ValueError(f"leap_months: {t} has no year {y}")
            if not 1 <= int(m) <= months:
                raise ValueError(f"leap_months[({t!r}, {y})] = {m} must be a month 1..{months}")
            leap[(t, int(y))] = int(m)
        month_labels: List[Any] = list(range(1, months + 1)) + ([LEAP_MONTH] if leap else [])
        units = []
        for t, n in zip(titles, lens):
            for y in range(1, n + 1):
                for m in range(1, months + 1):
                    units.append((t, y, m))
                    if leap.get((t, y)) == m:
                        units.append((t, y, LEAP_MONTH))
        leap_alias = {"L": LEAP_MONTH, "閏": LEAP_MONTH, "闰月": LEAP_MONTH, "閏月": LEAP_MONTH} if leap else {}
        cal = cls([("reign", titles), ("year", max(lens)), ("month", month_labels)], units=units,
                  name=name, aliases=[{}, {}, leap_alias], splits=splits)
        cal.meta.update(era_years=dict(zip(titles, lens)), first_ad_year=ad,
                        leap_months=[[t, y, m] for (t, y), m in leap.items()])
        return cal

    def ad_year(self, key: KeyLike) -> int:
        """Gregorian (proleptic, AD) year of a reign-calendar key, when eras gave first_ad_year."""
        ad = self.meta.get("first_ad_year") or {}
        k = self.parse(key)
        if k[0] not in ad:
            raise ValueError(f"calendar {self.name!r} knows no AD year for era {k[0]!r}")
        return ad[k[0]] + int(k[1]) - 1

    @classmethod
    def gregorian(cls, first_year: int, last_year: int, resolution: str = "day") -> "Calendar":
        """Gregorian year/month/day (``resolution="month"``: year/month). Days 29-31 of short
        months are padding. Keys accept ``datetime.date`` and ISO strings (``"2019-05-03"``);
        a prefix such as ``"2019"`` or ``"2019-05"`` spans the whole year / month."""
        for nm, v in (("first_year", first_year), ("last_year", last_year)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{nm} must be an int, got {type(v).__name__}")
        if not YEAR_MIN <= first_year <= last_year <= YEAR_MAX:
            raise ValueError(f"need {YEAR_MIN} <= first_year <= last_year <= {YEAR_MAX}, got {first_year}, {last_year}")
        if resolution not in ("day", "month"):
            raise ValueError(f"resolution must be 'day' or 'month', got {resolution!r}")
        years = list(range(int(first_year), int(last_year) + 1))
        if resolution == "month":
            return cls([("year", years), ("month", 12)], name="gregorian-month")
        units = []
        d, stop = _dt.date(int(first_year), 1, 1), _dt.date(int(last_year), 12, 31)
        one = _dt.timedelta(days=1)
        while True:
            units.append((d.year, d.month, d.day))
            if d == stop:   # no step past the last day (9999-12-31 has no successor)
                break
            d += one
        return cls([("year", years), ("month", 12), ("day", 31)], units=units, name="gregorian")

    # ---- serialization ---------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """JSON-able description (levels, units, splits) that :meth:`from_dict` restores."""
        return {
            "name": self.name, "sep": self.sep,
            "levels": [[l.name, list(l.labels)] for l in self._levels],
            "units": [list(self.key(int(f))) for f in self._unit_flat],
            "aliases": [dict(a) for a in self._aliases],
            "splits": None if self._splits is None else [self._splits[r] for r in range(self.num_units)],
            "meta": json.loads(json.dumps(self.meta, ensure_ascii=False, default=str)),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calendar":
        units = [tuple(u) for u in d["units"]]
        splits = None if d.get("splits") is None else dict(zip(units, d["splits"]))
        cal = cls([(n, labels) for n, labels in d["levels"]], units=units, name=d.get("name", "calendar"),
                  splits=splits, sep=d.get("sep", "-"), aliases=d.get("aliases"))
        cal.meta.update(d.get("meta") or {})
        return cal
