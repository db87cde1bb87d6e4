"""Date surface forms shared by the synthetic-data generators and the time parser.

``format_date(date, fmt, *, ref=None)`` writes a ``datetime.date`` in one of the named surface forms of
:data:`DATE_FORMATS`; :func:`tempokern.text.parse_time` reads every one of them back (the round-trip test
in ``tests/test_time_parse.py`` checks 1,000 random dates x every format). Each format has a
*granularity* (:data:`FORMAT_GRANULARITY`): what the text still says about the date —

- ``"day"``: year, month and day (``parse_time`` returns all three, mask ``(1, 1, 1)``);
- ``"month"``: year and month (day masked);
- ``"year"``: the year only;
- ``"decade"``: the decade only; it parses to the mid-decade year (``"the 1990s"`` -> 1995), month and day
  masked (Re³ §3.2).

Formats in :data:`RELATIVE_FORMATS` describe the date relative to a reference date ``ref`` (for a document:
its publication date ``d_pub``); they need ``ref`` to be written and to be parsed back, and they can only
express dates near ``ref`` (:func:`expressible` tells which). Conventions (the parser uses the same):
``"last Friday"`` is the latest Friday strictly before ``ref`` (1-7 days back), ``"next Friday"`` the first
Friday strictly after ``ref`` (1-7 days ahead), ``"N days ago"`` for 2 <= N <= 10 (number words),
``"last month"`` / ``"last year"`` the calendar month / year before ``ref``'s.
"""
from __future__ import annotations

import datetime as _dt
from typing import Optional

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
# abbreviations with a dot, except May (no abbreviation)
MONTH_ABBRS = ("Jan.", "Feb.", "Mar.", "Apr.", "May", "Jun.", "Jul.", "Aug.", "Sep.", "Oct.", "Nov.", "Dec.")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
ORDINAL_WORDS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                 "tenth", "eleventh", "twelfth")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
SEASONS = {"winter": 1, "spring": 4, "summer": 7, "autumn": 10, "fall": 10}  # middle month of the season
_SEASON_OF_MONTH = {12: "winter", 1: "winter", 2: "winter", 3: "spring", 4: "spring", 5: "spring",
                    6: "summer", 7: "summer", 8: "summer", 9: "autumn", 10: "autumn", 11: "autumn"}

FORMAT_GRANULARITY = {
    # day
    "iso": "day",                   # 2014-03-07
    "us_slash": "day",              # 03/07/2014
    "us_slash_short": "day",        # 3/7/2014
    "month_d_yyyy": "day",          # March 7, 2014
    "d_month_yyyy": "day",          # 7 March 2014
    "abbr_d_yyyy": "day",           # Mar. 7, 2014
    "d_abbr_yyyy": "day",           # 7 Mar. 2014
    "month_ordinal_yyyy": "day",    # March 7th, 2014
    "ordinal_of_month_yyyy": "day",  # the 7th of March 2014
    "weekday_month_d_yyyy": "day",  # Friday, March 7, 2014
    "weekday_d_month_yyyy": "day",  # Friday 7 March 2014
    "weekday_iso": "day",           # Friday 2014-03-07
    # month
    "month_yyyy": "month",          # March 2014
    "abbr_yyyy": "month",           # Mar. 2014
    "yyyy_mm": "month",             # 2014-03
    "mm_yyyy": "month",             # 03/2014
    "nth_month_of_yyyy": "month",   # the third month of 2014
    "early_month_yyyy": "month",    # early March 2014 (early / mid / late by day of month)
    # year
    "yyyy": "year",                 # 2014
    "season_yyyy": "year",          # spring 2014 (year only; the season is not a month)
    # decade
    "decade": "decade",             # the 2010s
    # relative to ref
    "today": "day",
    "yesterday": "day",
    "tomorrow": "day",
    "days_ago": "day",              # three days ago
    "last_weekday": "day",          # last Friday
    "next_weekday": "day",          # next Friday
    "last_month": "month",          # last month
    "last_year": "year",            # last year
}
DATE_FORMATS = tuple(FORMAT_GRANULARITY)
RELATIVE_FORMATS = ("today", "yesterday", "tomorrow", "days_ago", "last_weekday", "next_weekday",
                    "last_month", "last_year")
ABSOLUTE_FORMATS = tuple(f for f in DATE_FORMATS if f not in RELATIVE_FORMATS)
DAY_FORMATS = tuple(f for f in ABSOLUTE_FORMATS if FORMAT_GRANULARITY[f] == "day")


def _ordinal_suffix(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def ordinal(n: int) -> str:
    """``1 -> "1st"``, ``22 -> "22nd"``, ``13 -> "13th"``."""
    return f"{n}{_ordinal_suffix(n)}"


def _prev_month(d: _dt.date) -> tuple:
    return (d.year - 1, 12) if d.month == 1 else (d.year, d.month - 1)


def expressible(date: _dt.date, fmt: str, *, ref: Optional[_dt.date] = None) -> bool:
    """Whether ``format_date(date, fmt, ref=ref)`` can express ``date`` (always true for absolute formats
    within years 1000-9999; relative formats only near ``ref``)."""
    _check_fmt(fmt)
    if fmt not in RELATIVE_FORMATS:
        return 1000 <= date.year <= 9999
    if ref is None:
        return False
    delta = (date - ref).days
    if fmt == "today":
        return delta == 0
    if fmt == "yesterday":
        return delta == -1
    if fmt == "tomorrow":
        return delta == 1
    if fmt == "days_ago":
        return 2 <= -delta <= 10
    if fmt == "last_weekday":
        return 1 <= -delta <= 7
    if fmt == "next_weekday":
        return 1 <= delta <= 7
    if fmt == "last_month":
        return (date.year, date.month) == _prev_month(ref)
    if fmt == "last_year":
        return date.year == ref.year - 1
    raise AssertionError(fmt)


def _check_fmt(fmt):
    if not isinstance(fmt, str) or fmt not in FORMAT_GRANULARITY:
        raise ValueError(f"fmt: unknown date format {fmt!r}; expected one of {DATE_FORMATS}")


def format_date(date: _dt.date, fmt: str, *, ref: Optional[_dt.date] = None) -> str:
    """Write ``date`` in the surface form ``fmt`` (one of :data:`DATE_FORMATS`).

    Relative formats need ``ref`` (the date the text is written on) and raise ``ValueError`` when the date
    cannot be expressed that way (see :func:`expressible`)."""
    if isinstance(date, _dt.datetime):
        date = date.date()
    if not isinstance(date, _dt.date):
        raise TypeError(f"date: expected datetime.date, got {type(date).__name__}")
    _check_fmt(fmt)
    if ref is not None and isinstance(ref, _dt.datetime):
        ref = ref.date()
    if ref is not None and not isinstance(ref, _dt.date):
        raise TypeError(f"ref: expected datetime.date or None, got {type(ref).__name__}")
    if not expressible(date, fmt, ref=ref):
        if fmt in RELATIVE_FORMATS and ref is None:
            raise ValueError(f"ref: format {fmt!r} is relative and needs a reference date")
        raise ValueError(f"date: {date.isoformat()} cannot be written as {fmt!r}"
                         + (f" relative to {ref.isoformat()}" if ref is not None else ""))
    y, m, d = date.year, date.month, date.day
    mon, abbr, wd = MONTHS[m - 1], MONTH_ABBRS[m - 1], WEEKDAYS[date.weekday()]
    if fmt == "iso":
        return f"{y:04d}-{m:02d}-{d:02d}"
    if fmt == "us_slash":
        return f"{m:02d}/{d:02d}/{y:04d}"
    if fmt == "us_slash_short":
        return f"{m}/{d}/{y}"
    if fmt == "month_d_yyyy":
        return f"{mon} {d}, {y}"
    if fmt == "d_month_yyyy":
        return f"{d} {mon} {y}"
    if fmt == "abbr_d_yyyy":
        return f"{abbr} {d}, {y}"
    if fmt == "d_abbr_yyyy":
        return f"{d} {abbr} {y}"
    if fmt == "month_ordinal_yyyy":
        return f"{mon} {ordinal(d)}, {y}"
    if fmt == "ordinal_of_month_yyyy":
        return f"the {ordinal(d)} of {mon} {y}"
    if fmt == "weekday_month_d_yyyy":
        return f"{wd}, {mon} {d}, {y}"
    if fmt == "weekday_d_month_yyyy":
        return f"{wd} {d} {mon} {y}"
    if fmt == "weekday_iso":
        return f"{wd} {y:04d}-{m:02d}-{d:02d}"
    if fmt == "month_yyyy":
        return f"{mon} {y}"
    if fmt == "abbr_yyyy":
        return f"{abbr} {y}"
    if fmt == "yyyy_mm":
        return f"{y:04d}-{m:02d}"
    if fmt == "mm_yyyy":
        return f"{m:02d}/{y:04d}"
    if fmt == "nth_month_of_yyyy":
        return f"the {ORDINAL_WORDS[m - 1]} month of {y}"
    if fmt == "early_month_yyyy":
        part = "early" if d <= 10 else ("mid" if d <= 20 else "late")
        return f"{part} {mon} {y}" if part != "mid" else f"mid-{mon} {y}"
    if fmt == "yyyy":
        return f"{y}"
    if fmt == "season_yyyy":
        # December belongs to the winter that starts in it; written with the year of its January
        season = _SEASON_OF_MONTH[m]
        return f"winter {y + 1}" if m == 12 else f"{season} {y}"
    if fmt == "decade":
        return f"the {y // 10 * 10}s"
    delta = (date - ref).days
    if fmt == "today":
        return "today"
    if fmt == "yesterday":
        return "yesterday"
    if fmt == "tomorrow":
        return "tomorrow"
    if fmt == "days_ago":
        return f"{NUMBER_WORDS[-delta]} days ago"
    if fmt == "last_weekday":
        return f"last {wd}"
    if fmt == "next_weekday":
        return f"next {wd}"
    if fmt == "last_month":
        return "last month"
    if fmt == "last_year":
        return "last year"
    raise AssertionError(fmt)


def expected_parts(date: _dt.date, fmt: str) -> tuple:
    """What the text ``format_date(date, fmt, ...)`` says about ``date``: ``(year, month, day)`` with
    ``None`` for the parts the format does not carry (decades give the mid-decade year; ``season_yyyy``
    gives the season's year, December counting to the next year's winter)."""
    _check_fmt(fmt)
    g = FORMAT_GRANULARITY[fmt]
    if g == "day":
        return (date.year, date.month, date.day)
    if g == "month":
        return (date.year, date.month, None)
    if g == "decade":
        return (date.year // 10 * 10 + 5, None, None)
    if fmt == "season_yyyy" and date.month == 12:
        return (date.year + 1, None, None)
    return (date.year, None, None)


__all__ = ["DATE_FORMATS", "FORMAT_GRANULARITY", "RELATIVE_FORMATS", "ABSOLUTE_FORMATS", "DAY_FORMATS",
           "MONTHS", "MONTH_ABBRS", "WEEKDAYS", "SEASONS", "format_date", "expressible", "expected_parts",
           "ordinal"]
