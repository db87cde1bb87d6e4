"""Every date expression of a text as an interval of date prefixes.

:func:`time_intervals` runs the rule tagger (:func:`tempokern.text.temporal_spans`) and reads each tagged
expression with the rule parser (:func:`tempokern.text.find_time`): a single date is the interval from itself
to itself (``"May 2019"`` -> ``((2019, 5), (2019, 5))``), a range from its first to its last date
(``"from 1811 to 1827"`` -> ``((1811,), (1827,))``; ``"1990-95"`` -> ``((1990,), (1995,))``), a decade its
ten years, a numbered century its hundred years. Relative expressions (``"last year"``) need ``ref``;
weekdays alone and expressions without a year are left out. :func:`hull` is the earliest start to the
latest end."""
from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

from .temporal import temporal_spans
from .time import find_time

__all__ = ["time_intervals", "hull", "DatePrefix", "DateInterval"]

DatePrefix = Tuple[int, ...]
DateInterval = Tuple[DatePrefix, DatePrefix]

_DIGIT = re.compile(r"[0-9]")
_BC_AFTER = re.compile(r"[\s-]*(?:BCE?|B\.C\.)\b")
_SHORT_END = re.compile(r"(?<![0-9])(1[0-9]{3}|20[0-9]{2})\s*[-–—]\s*([0-9]{2})(?![0-9])")
_DECADE = re.compile(r"(?<![0-9])([12][0-9]{2})0'?s")
_CENTURY = re.compile(r"(?<![0-9])([0-9]{1,2})(?:st|nd|rd|th)[ -]century", re.I)


def _prefix(t) -> Optional[DatePrefix]:
    y, m, d = t.parts()
    if y is None:
        return None
    if m is None:
        return (y,)
    return (y, m) if d is None else (y, m, d)


def _times_in(span: str, ref) -> List[DatePrefix]:
    out, pos = [], 0
    while pos < len(span):
        t, sp = find_time(span[pos:], ref=ref)
        if t is None or sp is None or sp[1] <= 0:
            break
        p = _prefix(t)
        if p is not None:
            out.append(p)
        pos += sp[1]
    return out


_SEP = re.compile(r"\s*(?:[-–—]|\bto\b|\band\b|\buntil\b|\btill\b|\bthrough\b|\bthru\b)\s*", re.I)
_MONTH_WORD = re.compile(r"\b(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?", re.I)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")


def _range(span: str, ref) -> Optional[DateInterval]:
    """A range expression's (first date, last date); an open start takes the missing fields from the end
    (``"May–June 2019"``, ``"5–7 May 2019"``) and a two-digit end year the century of the start
    (``"1990-95"``)."""
    m = _SHORT_END.search(span)
    if m:
        y0 = int(m.group(1))
        y1 = y0 // 100 * 100 + int(m.group(2))
        if y1 > y0 and not re.match(r"\s*[-–—]\s*[0-9]{2}[0-9]", span[m.end(1):]):
            return (y0,), (y1,)
    parts = [p for p in _SEP.split(span) if p.strip()]
    if len(parts) < 2:
        return None
    left, right = _times_in(parts[0], ref), _times_in(parts[-1], ref)
    if not right:
        return None
    end = right[-1]
    if left:
        start = left[0]
    else:   # the start names no year: a month name, or a day number, completed from the end
        mw = _MONTH_WORD.search(parts[0])
        dn = re.search(r"(?<![0-9])([0-9]{1,2})(?![0-9])", parts[0])
        if mw:
            start = (end[0], _MONTHS.index(mw.group(1).lower()[:3]) + 1)
        elif dn and len(end) == 3 and 1 <= int(dn.group(1)) <= end[2]:
            start = (end[0], end[1], int(dn.group(1)))
        else:
            return None
    if _key(end, 99) < _key(start, 0):
        start, end = end, start
    return start, end


def _key(p: DatePrefix, fill: int) -> Tuple[int, int, int]:
    return tuple(p) + (fill,) * (3 - len(p))


def time_intervals(text: str, *, ref=None) -> List[DateInterval]:
    """``[(start, end), ...]`` for every date expression of ``text`` in reading order; ``start`` and
    ``end`` are date prefixes ``(year,)``, ``(year, month)`` or ``(year, month, day)``."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    out: List[DateInterval] = []
    if ref is None and not _DIGIT.search(text):   # every expression kept without `ref` holds a digit
        return out
    for s, e, kind in temporal_spans(text):
        span = text[s:e]
        if kind == "weekday" or (kind == "relative" and ref is None):
            continue
        if kind == "decade":
            m = _DECADE.search(span)
            if m:
                y0 = int(m.group(1)) * 10
                out.append(((y0,), (y0 + 9,)))
            continue
        if kind == "century":
            m = _CENTURY.search(span)
            bc = "bc" in span.lower() or _BC_AFTER.match(text, e)
            if m and not bc:       # centuries BC are left out (the calendars start at year 1)
                c = int(m.group(1))
                out.append((((c - 1) * 100 + 1,), (c * 100,)))
            continue
        if kind == "range":
            iv = _range(span, ref)
            if iv is not None:
                out.append(iv)
                continue
        times = _times_in(span, ref)
        if kind == "range" and len(times) >= 2:
            out.append((times[0], times[-1]) if _key(times[0], 0) <= _key(times[-1], 99) else (times[-1], times[0]))
            continue
        for t in times:
            out.append((t, t))
    return out


def hull(intervals: Sequence[DateInterval]) -> Optional[DateInterval]:
    """The earliest start to the latest end (None for no interval); prefixes compare by their leading
    fields, so ``(2019,)`` starts before ``(2019, 5)`` and ends after it."""
    if not intervals:
        return None
    start = min((a for a, _ in intervals), key=lambda p: _key(p, 0))
    end = max((b for _, b in intervals), key=lambda p: _key(p, 99))
    return start, end
